"""Per-shard compute on one device's block: gather rows, sum gradients per row, apply the sparse optimizer.

Plain functions on local arrays (no collectives), called inside `shard_map` bodies and usable alone
inside `jax.jit`. Static arguments are keyword-only. This is where a native kernel replaces the
pure-JAX path (`jaxscale.native`, selected by JAXSCALE_NATIVE): same signatures, same results up to
float summation order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_rows(table: jax.Array, rows: jax.Array) -> jax.Array:
    """table f32[R, w], rows i32[...] -> f32[..., w]; rows < 0 give zeros (rows >= R never occur:
    every row id reaching a kernel was routed from a validated id)."""
    vals = jnp.take(table, jnp.clip(rows, 0, table.shape[0] - 1), axis=0, mode="clip")
    return jnp.where((rows >= 0)[..., None], vals, jnp.zeros((), table.dtype))


def pool(emb: jax.Array, valid: jax.Array, pooling: str | None) -> jax.Array:
    """[b, L, w] rows -> [b, w] sum / mean over the valid ones (mean ignores padding), or [b, L, w]."""
    if pooling is None:
        return emb
    s = emb.sum(axis=1)
    if pooling == "mean":
        s = s / jnp.maximum(valid.sum(-1, keepdims=True), 1).astype(s.dtype)
    return s


def sum_by_row(rows: jax.Array, grads: jax.Array, *, block_rows: int, values: jax.Array | None = None):
    """Gradients summed per unique row: (rows i32[m] sorted ascending, then -1; sums f32[m, w]; count;
    per-row values or None).

    rows i32[m] (< 0: no row), grads f32[m, w]. The outputs keep the static size m: entries past `count`
    are -1 rows with zero sums. `values` f32[m] (optional) carries one number per entry that is equal for
    all entries of a row (e.g. a row's full-dim squared-gradient mean); it comes back once per row.
    """
    m = rows.shape[0]
    key = jnp.where(rows >= 0, rows, block_rows)  # the sentinel sorts last
    key, order = jax.lax.sort((key, jnp.arange(m, dtype=jnp.int32)), num_keys=1)
    new = jnp.concatenate([jnp.ones((1,), bool), key[1:] != key[:-1]]) & (key < block_rows)
    uid = jnp.cumsum(new, dtype=jnp.int32) - 1
    count = jnp.sum(new, dtype=jnp.int32)
    # entries without a row go to segment m, which the scatters drop
    seg = jnp.where(key < block_rows, uid, m)
    sums = jax.ops.segment_sum(grads[order], seg, num_segments=m, indices_are_sorted=True)
    urows = jnp.full((m,), -1, jnp.int32).at[seg].set(key, mode="drop")
    per_row = None
    if values is not None:
        per_row = jnp.zeros((m,), values.dtype).at[jnp.where(new, uid, m)].set(values[order], mode="drop")
    return urows, sums, count, per_row


def apply_rows(table, slots: dict, rows, grads, *, optimizer, apply, grad_sq_mean=None):
    """Applies `optimizer` to the rows named in `rows` (duplicates summed first; rows < 0 ignored).

    table f32[R, w], slots {name: f32[R]}, rows i32[m], grads f32[m, w]; `apply` (traced bool) False
    leaves everything unchanged. `grad_sq_mean` f32[m] (optional, equal for entries of one row): the
    row's mean squared gradient over the FULL embedding dim, for row-wise AdaGrad on a column-sharded
    table (the mean over this shard's columns otherwise). Only the touched rows are read and written.
    """
    R = table.shape[0]
    urows, gsum, _, sq = sum_by_row(rows, grads, block_rows=R, values=grad_sq_mean)
    idx = jnp.where(urows >= 0, urows, R)  # R: dropped by the scatters, zero-filled by the gathers
    old = {s: v.at[idx].get(mode="fill", fill_value=0.0) for s, v in slots.items()}
    rows_w = table.at[idx].get(mode="fill", fill_value=0.0)
    delta, new = optimizer.row_update(rows_w, old, gsum, grad_sq_mean=sq)
    table = table.at[idx].add(jnp.where(apply, delta, 0.0), mode="drop")
    out = {s: v.at[idx].set(jnp.where(apply, new[s], old[s]), mode="drop") for s, v in slots.items()}
    return table, out
