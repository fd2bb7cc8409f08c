"""Ids on the host: validation, conversion to int32, and the batch pytree that carries its capacities.

Host inputs are checked once, before anything is dispatched, so a bad id raises an error that names the
feature, the table and the id. Inside `jit` ids cannot raise: an out-of-range id is treated as padding
and counted (`stats['invalid_ids']`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jaxscale.engine.tables import TableConfig

PADDING_ID = -1


def as_int32(feature: str, x) -> np.ndarray:
    """`x` as int32, when that is lossless; TypeError naming the feature otherwise."""
    x = np.asarray(x)
    if x.dtype == np.int32:
        return x
    is_float = np.issubdtype(x.dtype, np.floating)
    if not (np.issubdtype(x.dtype, np.integer) or is_float):
        raise TypeError(f"feature {feature!r}: ids must be integers (int32), got dtype {x.dtype}")
    if is_float and x.size and not np.all(np.isfinite(x)):
        raise TypeError(f"feature {feature!r}: ids contain NaN or Inf")
    info = np.iinfo(np.int32)
    if x.size and (x.max() > info.max or x.min() < info.min):
        raise TypeError(
            f"feature {feature!r}: ids of dtype {x.dtype} cannot be converted to int32 without loss (out of range)"
        )
    y = x.astype(np.int32)
    if not np.array_equal(y.astype(x.dtype), x):
        raise TypeError(f"feature {feature!r}: ids of dtype {x.dtype} cannot be converted to int32 without loss")
    return y


@dataclasses.dataclass(frozen=True)
class InvalidIds:
    """Out-of-range ids of one feature: how many, and the first one (for the error message)."""

    feature: str
    table: str
    rows: int
    count: int
    first: int

    def message(self, where: str = "") -> str:
        at = f" in {where}" if where else ""
        return (
            f"feature {self.feature!r} (table {self.table!r}, {self.rows} rows){at}: id {self.first} is out of "
            f"range; ids must be in [0, {self.rows}) or {PADDING_ID} for padding ({self.count} bad ids)"
        )


def check_ids(
    ids: Mapping[str, object], tables: Sequence[TableConfig], feature_table: Mapping[str, int]
) -> tuple[dict[str, np.ndarray], list[InvalidIds]]:
    """Host ids -> ({feature: int32 [B, L]}, out-of-range ids per feature). Raises on everything else.

    Accepts [B] (one id per example) or [B, L]; integer or float dtypes are converted to int32 when
    the conversion is lossless. Unknown features, bad dtypes or shapes and mismatched batch sizes raise a
    ValueError/TypeError naming the feature; ids outside [0, rows) other than -1 are returned as a list, so
    the caller decides (raise, or count and pad).
    """
    if not isinstance(ids, Mapping):
        raise TypeError(f"ids must be a dict {{feature: int32 [B, L]}}, got {type(ids).__name__}")
    unknown = [f for f in ids if f not in feature_table]
    if unknown:
        raise ValueError(f"features {unknown} have no table; known features: {sorted(feature_table)}")
    out, invalid, batch = {}, [], None
    for f, x in ids.items():
        t = tables[feature_table[f]]
        x = as_int32(f, x)
        if x.ndim == 1:
            x = x[:, None]
        if x.ndim != 2:
            raise ValueError(f"feature {f!r}: ids must be [B] or [B, L], got shape {x.shape}")
        if batch is None:
            batch = (f, x.shape[0])
        elif x.shape[0] != batch[1]:
            raise ValueError(f"feature {f!r} has batch size {x.shape[0]} but feature {batch[0]!r} has {batch[1]}")
        bad = (x < PADDING_ID) | (x >= t.stored_rows)
        if bad.any():
            invalid.append(InvalidIds(f, t.name, t.stored_rows, int(bad.sum()), int(x[bad][0])))
        out[f] = x
    return out, invalid


def pad_invalid(ids: Mapping[str, np.ndarray], tables, feature_table) -> dict[str, np.ndarray]:
    """Out-of-range ids replaced by the padding id (what the device would do, done before dispatch)."""
    out = {}
    for f, x in ids.items():
        t = tables[feature_table[f]]
        out[f] = np.where((x < PADDING_ID) | (x >= t.stored_rows), PADDING_ID, x).astype(np.int32)
    return out


@jax.tree_util.register_pytree_node_class
class ShardedIds(Mapping):
    """{feature: int32 [B, L] global array} plus static per-batch metadata (the exchange capacities).

    The metadata is the pytree's aux data, so `jax.jit` picks (or compiles) the executable for it: a batch
    whose capacities were counted on the host runs the step compiled for exactly those buffer sizes.
    Behaves as a read-only dict of its arrays.
    """

    def __init__(self, arrays: Mapping[str, jax.Array], capacities=None):
        self._arrays = dict(arrays)
        self.capacities = capacities

    def __getitem__(self, key):
        return self._arrays[key]

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self):
        return len(self._arrays)

    def __repr__(self):
        shapes = {k: tuple(getattr(v, "shape", ())) for k, v in self._arrays.items()}
        return f"ShardedIds({shapes}, capacities={self.capacities})"

    def tree_flatten(self):
        keys = tuple(sorted(self._arrays))
        return tuple(self._arrays[k] for k in keys), (keys, self.capacities)

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, capacities = aux
        return cls(dict(zip(keys, children)), capacities)
