"""Input data machinery: counter-based randomness, a Parquet reader, and host -> global arrays.

Every source yields *this process's* slice of the global batch as a dict of NumPy arrays (`batch(step)`);
`to_global` assembles the slices into arrays sharded over every device. Each model's synthetic generator
lives with the model (`jaxscale_models.*_data`) and is found through the registry (`make_data`).

Synthetic data is counter-based: every random number is a hash of (seed, split, step, example index,
position, purpose), so any process can produce its rows of any step without coordination, the slices of
`process_count` processes concatenate to exactly the one-process batch, and a restarted run replays the
same stream. The eval split uses another split id (a disjoint stream of users) over the same item world.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

SPLITS = {"train": 0, "eval": 1}
LEAVE_ONE_OUT_SPLITS = ("valid", "test")
"""Splits only a sequence store's leave-one-out reader has (`data.sequences.split: leave_one_out`)."""

_G = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser (a bijection on uint64 with full avalanche)."""
    x = x + _G
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def hash64(*parts) -> np.ndarray:
    """Hash of broadcast integer arrays/scalars -> uint64 array (counter-based randomness)."""
    with np.errstate(over="ignore"):
        h = np.zeros((), np.uint64)
        for p in parts:
            h = _mix(h ^ np.asarray(p).astype(np.int64).astype(np.uint64))
        return np.asarray(h)


def uniform(*parts) -> np.ndarray:
    """Uniform float64 in (0, 1) from a hash."""
    return ((hash64(*parts) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def normal(*parts) -> np.ndarray:
    """Standard normal (Box-Muller); the second uniform hashes the first one's parts plus a salt."""
    u1, u2 = uniform(*parts, 1), uniform(*parts, 2)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


class ZipfSampler:
    """Bounded Zipf over ranks [0, n): P(k) proportional to (k + 1) ** -exponent, via inverse CDF.

    The head (the first `head` ranks, where the discreteness matters) is an exact table; the tail uses
    the continuous power-law inverse CDF with a half-rank correction. Memory is O(head), so n may be
    1e9; sampling is two vectorised numpy passes.
    """

    def __init__(self, n: int, exponent: float = 1.1, head: int = 1 << 16):
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"ZipfSampler: n must be a positive integer, got {n!r}")
        if not (isinstance(exponent, (int, float)) and exponent >= 0 and math.isfinite(exponent)):
            raise ValueError(f"ZipfSampler: exponent must be a finite number >= 0, got {exponent!r}")
        self.n, self.s = int(n), float(exponent)
        h = min(self.n, head)
        w = np.arange(1, h + 1, dtype=np.float64) ** -self.s
        self.head = h
        self.head_cdf = np.cumsum(w) / w.sum()
        self.a, self.b = h + 0.5, self.n + 0.5
        tail = self._integral(self.a, self.b) if self.n > h else 0.0
        self.p_head = float(w.sum() / (w.sum() + tail))

    def _integral(self, a, b):
        if abs(self.s - 1.0) < 1e-12:
            return math.log(b / a)
        return (b ** (1 - self.s) - a ** (1 - self.s)) / (1 - self.s)

    def __call__(self, u: np.ndarray) -> np.ndarray:
        """Ranks (int64) for uniforms u in (0, 1)."""
        u = np.asarray(u, np.float64)
        in_head = u < self.p_head
        k_head = np.searchsorted(self.head_cdf, np.minimum(u / self.p_head, 1.0), side="right")
        if self.n == self.head:
            return np.minimum(k_head, self.n - 1).astype(np.int64)
        v = np.clip((u - self.p_head) / (1.0 - self.p_head), 0.0, 1.0)
        if abs(self.s - 1.0) < 1e-12:
            x = self.a * np.exp(v * math.log(self.b / self.a))
        else:
            e = 1.0 - self.s
            x = (self.a**e + v * (self.b**e - self.a**e)) ** (1.0 / e)
        k_tail = np.clip(np.floor(x + 0.5), self.head + 1, self.n) - 1
        return np.where(in_head, np.minimum(k_head, self.head - 1), k_tail).astype(np.int64)

    def pmf(self, k: np.ndarray) -> np.ndarray:
        """Approximate probability of ranks k (exact in the head)."""
        k = np.asarray(k)
        total = (np.arange(1, self.head + 1, dtype=np.float64) ** -self.s).sum() / self.p_head
        return (k + 1.0) ** -self.s / total


def coprime_multiplier(n: int) -> int:
    """A multiplier a with gcd(a, n) == 1: x -> (a x + b) % n is a bijection of [0, n) (id scrambling)."""
    for a in (2654435761, 2246822519, 3266489917, 668265263, 374761393, 1000003):
        a %= max(n, 1)
        if a > 0 and math.gcd(a, n) == 1:
            return a
    return 1


def example_indices(global_batch: int, process_index: int, process_count: int) -> np.ndarray:
    """Global example indices of this process's rows."""
    if not isinstance(process_count, (int, np.integer)) or process_count < 1:
        raise ValueError(f"process_count must be a positive integer, got {process_count!r}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, {process_count}), got {process_index!r}")
    if global_batch % process_count:
        raise ValueError(f"global batch {global_batch} is not divisible by process_count={process_count}")
    b = global_batch // process_count
    return np.arange(process_index * b, (process_index + 1) * b, dtype=np.int64)


def check_batch(global_batch) -> int:
    if not isinstance(global_batch, (int, np.integer)) or isinstance(global_batch, bool) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    return int(global_batch)


def check_split(split) -> int:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {tuple(SPLITS)}, got {split!r}")
    return SPLITS[split]


_DROPPED = "__truncated_events__"  # per cached row: list entries cut by seq_len


@dataclasses.dataclass(frozen=True)
class Column:
    """How a batch key is stored in Parquet.

    kind: 'seq' (variable-length list; its length is the count of entries of `length_key` >= 0),
    'fixed' (fixed-size list), 'scalar', or 'derived' (not stored; `mask` is item_ids >= 0).
    """

    kind: str
    pad: float | int = -1
    length_key: str | None = None


def to_global(batch_local: Mapping[str, np.ndarray], mesh) -> dict:
    """This process's rows -> global jax.Arrays sharded on axis 0 over ('node', 'local').

    Every process must pass the same number of rows; the global batch is rows * process_count.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxscale.engine.mesh import BATCH_AXES

    sharding = NamedSharding(mesh, P(BATCH_AXES))
    n = jax.process_count()
    host = {k: np.asarray(v) for k, v in batch_local.items()}
    for k, v in host.items():
        if v.shape[0] * n % mesh.size:
            raise ValueError(
                f"to_global: {k!r} has {v.shape[0] * n} global rows, not divisible by "
                f"the {mesh.size} devices of the mesh"
            )
    if n == 1:  # one batched transfer of every array (a call per array costs ~1 ms of Python each)
        return jax.device_put(host, sharding)
    return {
        k: jax.make_array_from_process_local_data(sharding, v, (v.shape[0] * n,) + v.shape[1:]) for k, v in host.items()
    }


# ---------------------------------------------------------------------------------------------- Parquet


def write_parquet_sample(path, data, n: int, *, row_group_size: int = 64, first_step: int = 0) -> Path:
    """Writes `n` examples of a synthetic generator to Parquet, one row per example.

    'seq' keys become variable-length lists (padding stripped), 'fixed' keys fixed-size lists, 'scalar'
    keys plain columns; 'derived' keys (mask) are not stored. Returns the path.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    batches, have, step = [], 0, first_step
    while have < n:
        batches.append(data.batch(step))
        have += data.global_batch
        step += 1
    full = {k: np.concatenate([b[k] for b in batches])[:n] for k in batches[0]}
    arrays, names = [], []
    for key, col in data.columns.items():
        x = full[key]
        if col.kind == "derived":
            continue
        if col.kind == "scalar":
            arr = pa.array(x)
        elif col.kind == "fixed":
            arr = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])
        elif col.kind == "seq":
            lengths = (full[col.length_key] >= 0).sum(axis=1)
            keep = np.arange(x.shape[1])[None, :] < lengths[:, None]
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(x[keep]))
        else:
            raise ValueError(f"unknown column kind {col.kind!r} for {key!r}")
        arrays.append(arr)
        names.append(key)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_arrays(arrays, names=names), path, row_group_size=row_group_size)
    return path


class ParquetData:
    """Reads examples from a Parquet file (one row per example), this process's row groups only.

    Process p reads row groups i with i % process_count == p, and only the requested `columns`.
    Variable-length list columns are right-padded / truncated to `seq_len` (an int, or {column: int});
    truncation keeps the last entries (`keep='last'`: the most recent events) or the first. 'mask' is
    derived as item_ids >= 0 when requested and not stored. `batch(step)` returns rows
    [step * batch_size, (step + 1) * batch_size) of this process's rows, wrapping around (epochs);
    iterating yields one epoch of full batches. Keys match the synthetic generators.

    Nothing is cut silently: `provenance(step)` names the file and row groups of a batch (for error
    messages) and counts its sequences longer than `seq_len` and the events truncation dropped.
    """

    def __init__(
        self,
        path,
        columns: Sequence[str],
        *,
        batch_size: int,
        seq_len: int | Mapping[str, int] | None = None,
        process_index: int = 0,
        process_count: int = 1,
        pad_values: Mapping[str, float] | None = None,
        keep: str = "last",
    ):
        import pyarrow.parquet as pq

        self.path = Path(path)
        self.file = pq.ParquetFile(self.path)
        stored = set(self.file.schema_arrow.names)
        self.columns = tuple(columns)
        if not self.columns:
            raise ValueError("ParquetData: columns must name at least one column")
        self.derive_mask = "mask" in self.columns and "mask" not in stored
        read = [c for c in self.columns if not (c == "mask" and self.derive_mask)]
        if self.derive_mask and "item_ids" not in read:
            read.append("item_ids")
        missing = [c for c in read if c not in stored]
        if missing:
            raise ValueError(f"ParquetData: columns {missing} are not in {self.path} (has {sorted(stored)})")
        self.read_columns = tuple(read)
        if keep not in ("last", "first"):
            raise ValueError(f"ParquetData: keep must be 'last' or 'first', got {keep!r}")
        self.keep, self.seq_len, self.pad_values = keep, seq_len, dict(pad_values or {})
        self.batch_size = check_batch(batch_size)
        example_indices(process_count, process_index, process_count)  # validates the pair
        self.row_groups = [i for i in range(self.file.num_row_groups) if i % process_count == process_index]
        sizes = [self.file.metadata.row_group(i).num_rows for i in self.row_groups]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_rows = int(self.starts[-1])
        if self.num_rows == 0:
            raise ValueError(
                f"ParquetData: process {process_index} of {process_count} has no rows in {self.path} "
                f"({self.file.num_row_groups} row groups)"
            )
        self._cache: dict[int, dict[str, np.ndarray]] = {}

    def _length(self, column: str) -> int:
        if isinstance(self.seq_len, Mapping):
            if column not in self.seq_len:
                raise ValueError(f"ParquetData: no seq_len given for list column {column!r}")
            return int(self.seq_len[column])
        if self.seq_len is None:
            raise ValueError(f"ParquetData: list column {column!r} needs seq_len")
        return int(self.seq_len)

    def _group(self, j: int) -> dict[str, np.ndarray]:
        """Row group self.row_groups[j] as padded numpy arrays (a 2-entry cache)."""
        import pyarrow as pa

        if j in self._cache:
            return self._cache[j]
        table = self.file.read_row_group(self.row_groups[j], columns=list(self.read_columns))
        out, dropped = {}, np.zeros(table.num_rows, np.int64)
        for name in self.read_columns:
            arr = table.column(name).combine_chunks()
            if pa.types.is_fixed_size_list(arr.type):
                out[name] = arr.values.to_numpy(zero_copy_only=False).reshape(len(arr), arr.type.list_size)
            elif pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
                out[name] = self._pad(name, arr)
                lengths = np.diff(arr.offsets.to_numpy())
                dropped = np.maximum(dropped, lengths - np.minimum(lengths, self._length(name)))
            else:
                out[name] = arr.to_numpy(zero_copy_only=False)
        if self.derive_mask:
            out["mask"] = out["item_ids"] >= 0
        out = {k: out[k] for k in self.columns}
        out[_DROPPED] = dropped
        if len(self._cache) >= 2:
            self._cache.pop(next(iter(self._cache)))
        self._cache[j] = out
        return out

    def _pad(self, name, arr) -> np.ndarray:
        L = self._length(name)
        values = arr.flatten().to_numpy(zero_copy_only=False)
        offsets = arr.offsets.to_numpy() - arr.offsets[0].as_py()
        lengths = np.diff(offsets)
        take = np.minimum(lengths, L)
        first = offsets[:-1] + (lengths - take if self.keep == "last" else 0)
        pos = np.arange(L)[None, :]
        valid = pos < take[:, None]
        src = np.where(valid, first[:, None] + pos, 0)
        pad = self.pad_values.get(name, 0.0 if np.issubdtype(values.dtype, np.floating) else -1)
        gathered = values[src] if values.size else np.zeros(src.shape, values.dtype)
        return np.where(valid, gathered, np.asarray(pad, values.dtype)).astype(values.dtype)

    def _rows(self, step: int):
        rows = (step * self.batch_size + np.arange(self.batch_size)) % self.num_rows
        return rows, np.searchsorted(self.starts, rows, side="right") - 1

    def _gather(self, step: int, keys) -> dict[str, np.ndarray]:
        rows, groups = self._rows(step)
        parts = {k: [] for k in keys}
        for j in np.unique(groups):  # rows are consecutive, so each group's rows form one run
            data = self._group(int(j))
            sel = rows[groups == j] - self.starts[j]
            for k in keys:
                parts[k].append(data[k][sel])
        order = np.argsort(np.concatenate([np.flatnonzero(groups == j) for j in np.unique(groups)]), kind="stable")
        return {k: np.concatenate(v)[order] for k, v in parts.items()}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self._gather(step, self.columns)

    def provenance(self, step: int) -> dict:
        """Where the batch of `step` comes from ('where': file and row groups) and what truncation cut:
        'truncated_sequences' (rows longer than seq_len) and 'truncated_events' (entries dropped)."""
        rows, groups = self._rows(step)
        dropped = self._gather(step, (_DROPPED,))[_DROPPED]
        used = sorted({self.row_groups[int(j)] for j in np.unique(groups)})
        return {
            "where": f"{self.path} (row groups {used}, rows {int(rows[0])}..{int(rows[-1])} of this process)",
            "truncated_sequences": int((dropped > 0).sum()),
            "truncated_events": int(dropped.sum()),
        }

    def __len__(self) -> int:
        """Full batches in one epoch of this process's rows."""
        return self.num_rows // self.batch_size

    def __iter__(self):
        for step in range(len(self)):
            yield self.batch(step)


class BoundSource:
    """A synthetic generator bound to one process: `batch(step)` -> this process's slice."""

    def __init__(self, source, process_index: int, process_count: int):
        example_indices(source.global_batch, process_index, process_count)
        self.source, self.process_index, self.process_count = source, process_index, process_count

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.source.batch(step, self.process_index, self.process_count)


def make_data(config, *, split: str = "train", process_index: int = 0, process_count: int = 1):
    """The data source a `jaxscale.training.config.Config` describes, bound to this process: `.batch(step)` returns
    this process's rows (config.train.batch_size // process_count of them) of step `step`.

    'synthetic': the model's generator (the eval split is its held-out stream). 'parquet': data.path
    (train) or data.eval_path (eval), read with the model's column layout; None for an eval split without
    eval_path. Other sources are the model's own (`ModelSpec.data_sources`).
    """
    from jaxscale.training import registry

    spec = registry.get(config.model.kind)
    mcfg, data = config.model.params, config.data
    if split in LEAVE_ONE_OUT_SPLITS and data.source not in spec.data_sources:
        raise ValueError(f"split {split!r} is read from a sequence store (data.source: sequences), not {data.source!r}")
    if split not in LEAVE_ONE_OUT_SPLITS:
        check_split(split)
    if data.source == "synthetic":
        return BoundSource(spec.synthetic(mcfg, config.train.batch_size, data, split), process_index, process_count)
    if data.source == "parquet":
        path = data.path if split == "train" else data.eval_path
        if path is None:
            return None
        if config.train.batch_size % process_count:
            raise ValueError(
                f"train.batch_size={config.train.batch_size} is not divisible by {process_count} processes"
            )
        columns, seq_len = spec.parquet_columns(mcfg)
        return ParquetData(
            path,
            columns,
            batch_size=config.train.batch_size // process_count,
            seq_len=seq_len,
            process_index=process_index,
            process_count=process_count,
        )
    if data.source in spec.data_sources:
        return spec.data_sources[data.source](mcfg, config, split, process_index, process_count)
    known = ["synthetic", "parquet", *spec.data_sources]
    raise ValueError(f"data.source {data.source!r} is not available for model kind {spec.kind!r}; known: {known}")


def planning_sample(config, steps: int = 4) -> dict[str, np.ndarray]:
    """{feature: engine ids} of the first `steps` GLOBAL training batches, for the planner.

    Read as one process reads the whole batch, so every process of a multi-process run plans from the same
    sample and reaches the same plan."""
    from jaxscale.training import registry

    spec = registry.get(config.model.kind)
    source = make_data(config, split="train")
    batches = [spec.ids(config.model.params, source.batch(s)) for s in range(steps)]
    return {f: np.concatenate([b[f] for b in batches]) for f in batches[0]}
