"""The NumPy reference of FBGEMM's table-batched embedding (TBE) semantics, on one device.

One definition of what a correct lookup and a correct sparse update are, shared by the tests, the
benchmark suite (`jaxscale.benchmarks`) and the TorchRec baseline runner (`jaxscale.benchmarks.torchrec_runner`), so
jaxscale, TorchRec and NumPy are all checked against the same thing. Pure NumPy: importing it starts
neither JAX nor torch.

Semantics (FBGEMM's `SplitTableBatchedEmbeddingBagsCodegen`, which TorchRec's fused optimizers run):
  * ids: ``{feature: int [B, L]}``; ``-1`` is padding, anywhere in a row. Every other id must lie in
    ``[0, rows)`` of the feature's table (checked; the error names feature, table and id).
  * lookup: pooled tables (``pooling='sum'|'mean'``) give ``[B, dim]``; ``mean`` divides by the number
    of non-padding ids and an empty bag gives zeros. Sequence tables (``pooling=None``) give
    ``[B, L, dim]`` with zeros at padding. Sums are taken in float64 and returned as float32.
  * gradient of a row: the sum, over every position that looked it up (duplicate ids and features
    sharing the table included), of the output gradient there (sum pooling: the bag's gradient; mean:
    divided by the bag's id count; sequence: the position's gradient). Accumulated in float64.
  * ``EXACT_SGD``: ``w_r -= lr * g_r`` for each touched row r.
  * ``EXACT_ROWWISE_ADAGRAD``: ``acc_r += mean(g_r**2)``; ``w_r -= lr * g_r / (sqrt(acc_r) + eps)``,
    with the accumulator stored in its own dtype (float32, as FBGEMM keeps it) before it is used.
    ``col_parts=k`` keeps one accumulator per equal column block (the mean over the block only), as
    each column shard of a TorchRec/FBGEMM column-wise table does; accumulators are then ``[rows, k]``.

Tables are given as ``{name: float32 [rows, dim]}``; ``configs`` are `jaxscale.TableConfig`s (or any
objects with ``name``, ``pooling`` and ``features``). Row counts and dims are read from the arrays, so a
``reshape='half_dim'`` table is checked in its stored layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

OPTIMIZERS = ("sgd", "rowwise_adagrad")


@dataclasses.dataclass(frozen=True)
class RowGradients:
    """The summed gradient of every touched row of one table: rows sorted ascending, no duplicates."""

    rows: np.ndarray  # int64 [n]
    grads: np.ndarray  # float64 [n, dim]


# ------------------------------------------------------------------------------------------- inputs


def _features(configs) -> dict:
    """{feature: table config}."""
    out = {}
    for t in configs:
        for f in tuple(t.features) or (t.name,):
            out[f] = t
    return out


def _table_of(by_feature: Mapping, feature: str):
    if feature not in by_feature:
        raise ValueError(f"feature {feature!r} is not read by any table (features: {sorted(by_feature)})")
    return by_feature[feature]


def _weights(tables: Mapping, t) -> np.ndarray:
    if t.name not in tables:
        raise ValueError(f"no weights for table {t.name!r} (got {sorted(tables)})")
    w = np.asarray(tables[t.name])
    if w.ndim != 2:
        raise ValueError(f"table {t.name!r}: weights must be [rows, dim], got shape {w.shape}")
    return w


def check_ids(feature: str, table_name: str, rows: int, ids) -> np.ndarray:
    """ids as an int64 [B, L] array; ValueError naming the feature, table and id when one is invalid."""
    x = np.asarray(ids)
    if x.ndim != 2:
        raise ValueError(f"feature {feature!r}: ids must be [batch, ids per example], got shape {x.shape}")
    if x.size and not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"feature {feature!r}: ids must be integers, got dtype {x.dtype}")
    x = x.astype(np.int64)
    bad = (x < -1) | (x >= rows)
    if bad.any():
        b, j = np.argwhere(bad)[0]
        raise ValueError(
            f"feature {feature!r} (table {table_name!r}, {rows} rows): id {x[b, j]} at [{b}, {j}] is out of "
            f"range; ids must be in [0, {rows}) or -1 for padding"
        )
    return x


def _grad(feature: str, t, grads: Mapping, shape: tuple) -> np.ndarray:
    if feature not in grads:
        raise ValueError(f"no gradient for feature {feature!r} (got {sorted(grads)})")
    g = np.asarray(grads[feature], np.float64)
    if g.shape != shape:
        kind = "sequence" if t.pooling is None else f"{t.pooling}-pooled"
        raise ValueError(f"feature {feature!r} ({kind} table {t.name!r}): gradient must be {shape}, got {g.shape}")
    return g


# ------------------------------------------------------------------------------------------- lookup


def lookup(tables: Mapping, configs, ids: Mapping) -> dict:
    """{feature: pooled float32 [B, dim] or sequence float32 [B, L, dim]}; padding (-1) contributes zeros."""
    by_feature = _features(configs)
    out = {}
    for f, raw in ids.items():
        t = _table_of(by_feature, f)
        w = _weights(tables, t)
        x = check_ids(f, t.name, w.shape[0], raw)
        valid = x >= 0
        emb = np.where(valid[..., None], w[np.where(valid, x, 0)], 0).astype(np.float64)
        if t.pooling is None:
            out[f] = emb.astype(np.float32)
            continue
        pooled = emb.sum(1)
        if t.pooling == "mean":
            pooled /= np.maximum(valid.sum(1), 1)[:, None]
        out[f] = pooled.astype(np.float32)
    return out


# ---------------------------------------------------------------------------------- row gradients


def row_gradients(tables: Mapping, configs, ids: Mapping, grads: Mapping) -> dict[str, RowGradients]:
    """{table: RowGradients} for every table some feature of `ids` reads: duplicates summed."""
    by_feature = _features(configs)
    rows_of: dict[str, list] = {}
    grads_of: dict[str, list] = {}
    for f, raw in ids.items():
        t = _table_of(by_feature, f)
        w = _weights(tables, t)
        x = check_ids(f, t.name, w.shape[0], raw)
        valid = x >= 0
        dim = w.shape[1]
        if t.pooling is None:
            per_position = _grad(f, t, grads, x.shape + (dim,))
        else:
            g = _grad(f, t, grads, (x.shape[0], dim))
            if t.pooling == "mean":
                g = g / np.maximum(valid.sum(1), 1)[:, None]
            per_position = np.broadcast_to(g[:, None, :], x.shape + (dim,))
        rows_of.setdefault(t.name, []).append(x[valid])
        grads_of.setdefault(t.name, []).append(per_position[valid])
    out = {}
    for name, parts in rows_of.items():
        rows = np.concatenate(parts)
        g = np.concatenate(grads_of[name])
        order = np.argsort(rows, kind="stable")
        rows, g = rows[order], g[order]
        if len(rows):
            starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
            out[name] = RowGradients(rows[starts], np.add.reduceat(g, starts, axis=0))
        else:
            out[name] = RowGradients(rows, g.reshape(0, tables[name].shape[1]))
    return out


def row_grads(tables: Mapping, configs, ids: Mapping, grads: Mapping) -> dict:
    """{table: {row: summed float64 gradient}} (the same sums as `row_gradients`, keyed by row)."""
    return {
        name: {int(r): g for r, g in zip(rg.rows, rg.grads)}
        for name, rg in row_gradients(tables, configs, ids, grads).items()
    }


# ---------------------------------------------------------------------------------- optimizers


def apply_sgd(weights: np.ndarray, rg: RowGradients, lr: float) -> None:
    """EXACT_SGD on the touched rows of one table, in place."""
    r = rg.rows
    weights[r] = (weights[r] - lr * rg.grads).astype(weights.dtype)


def apply_rowwise_adagrad(
    weights: np.ndarray, accumulator: np.ndarray, rg: RowGradients, lr: float, eps: float, col_parts: int = 1
) -> None:
    """EXACT_ROWWISE_ADAGRAD on the touched rows of one table, in place (weights and accumulator).

    `accumulator` is [rows] when col_parts == 1, else [rows, col_parts] (one per column block)."""
    n, dim = rg.grads.shape
    if col_parts < 1 or dim % col_parts:
        raise ValueError(f"col_parts must be a positive divisor of the dim {dim}, got {col_parts}")
    want = (weights.shape[0],) if col_parts == 1 else (weights.shape[0], col_parts)
    if accumulator.shape != want:
        raise ValueError(f"accumulator must be {want} for col_parts={col_parts}, got {accumulator.shape}")
    r = rg.rows
    blocks = rg.grads.reshape(n, col_parts, dim // col_parts)
    mean_sq = (blocks * blocks).mean(2)  # [n, col_parts]
    acc = accumulator.reshape(weights.shape[0], col_parts)
    acc[r] = (acc[r] + mean_sq).astype(accumulator.dtype)
    accumulator[...] = acc.reshape(accumulator.shape)  # a no-op when reshape gave a view
    denom = np.sqrt(acc[r].astype(np.float64)) + eps  # the stored value, as FBGEMM reads it back
    step = lr * blocks / denom[:, :, None]
    weights[r] = (weights[r] - step.reshape(n, dim)).astype(weights.dtype)


def _copy(arrays: Mapping) -> dict:
    return {k: np.array(v, copy=True) for k, v in arrays.items()}


def sgd_step(tables: Mapping, configs, ids: Mapping, grads: Mapping, lr: float) -> dict:
    """One EXACT_SGD step; returns new tables (the inputs are not modified)."""
    out = _copy(tables)
    for name, rg in row_gradients(out, configs, ids, grads).items():
        apply_sgd(out[name], rg, lr)
    return out


def adagrad_step(
    tables: Mapping,
    accumulators: Mapping,
    configs,
    ids: Mapping,
    grads: Mapping,
    lr: float,
    eps: float,
    col_parts: Mapping[str, int] | None = None,
) -> tuple[dict, dict]:
    """One EXACT_ROWWISE_ADAGRAD step; returns (new tables, new accumulators), inputs not modified.

    `col_parts[table]` > 1 keeps one accumulator per column block (accumulator [rows, col_parts])."""
    out, acc = _copy(tables), _copy(accumulators)
    col_parts = col_parts or {}
    for name, rg in row_gradients(out, configs, ids, grads).items():
        if name not in acc:
            raise ValueError(f"no accumulator for table {name!r} (got {sorted(acc)})")
        apply_rowwise_adagrad(out[name], acc[name], rg, lr, eps, col_parts.get(name, 1))
    return out, acc


def zero_accumulators(tables: Mapping, col_parts: Mapping[str, int] | None = None) -> dict:
    """float32 zeros: [rows] per table, or [rows, col_parts] where col_parts > 1."""
    col_parts = col_parts or {}
    return {
        k: np.zeros((v.shape[0],) + ((col_parts[k],) if col_parts.get(k, 1) > 1 else ()), np.float32)
        for k, v in tables.items()
    }


def train(
    tables: Mapping,
    configs,
    batches: Sequence[Mapping],
    grads=None,
    *,
    optimizer: str = "sgd",
    lr: float = 0.1,
    eps: float = 1e-8,
    col_parts: Mapping[str, int] | None = None,
) -> dict:
    """Lookup then update, once per batch, from copies of `tables`.

    grads: None (lookups only), one {feature: gradient of the output} used every step, or one per batch.
    Returns {"outputs": [{feature: array} per step, taken before that step's update],
             "tables": {name: array}, "accumulators": {name: array} (row-wise AdaGrad only)}."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if grads is None or isinstance(grads, Mapping):
        per_step = [grads] * len(batches)
    else:
        per_step = list(grads)
        if len(per_step) != len(batches):
            raise ValueError(f"got {len(per_step)} gradient dicts for {len(batches)} batches")
    w = _copy(tables)
    acc = zero_accumulators(w, col_parts)
    outputs = []
    for ids, g in zip(batches, per_step):
        outputs.append(lookup(w, configs, ids))
        if g is None:
            continue
        for name, rg in row_gradients(w, configs, ids, g).items():
            if optimizer == "sgd":
                apply_sgd(w[name], rg, lr)
            else:
                apply_rowwise_adagrad(w[name], acc[name], rg, lr, eps, (col_parts or {}).get(name, 1))
    result = {"outputs": outputs, "tables": w}
    if optimizer == "rowwise_adagrad":
        result["accumulators"] = acc
    return result
