"""Per-shard compute on one device's block: gather rows, pool, sum gradients per row, the sparse optimizer.

Plain functions on local arrays (no collectives), called inside `shard_map` bodies and usable alone
inside `jax.jit`. Static arguments are keyword-only. The gathers and the optimizer step run the fused
native CPU kernels of `jaxscale.engine.native` (JAXSCALE_NATIVE=auto|0|1), which fall back to pure-JAX kernels
of the same semantics on other platforms or when the native library is unavailable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxscale.engine import native
from jaxscale.engine.optimizers import SGD


def gather_rows(table: jax.Array, rows: jax.Array) -> jax.Array:
    """table f32[R, w], rows i32[...] -> f32[..., w]; rows < 0 (or >= R) give zeros."""
    out = native.gather_rows(table, rows.reshape(-1))
    return out.reshape(rows.shape + (table.shape[1],))


def gather_pool(table: jax.Array, rows: jax.Array, *, pooling: str | None) -> jax.Array:
    """Fused gather + pool: table f32[R, w], rows i32[b, L] (< 0: padding) -> f32[b, w] ('sum' / 'mean',
    the mean over the valid rows) or f32[b, L, w] (None), never materialising [b*L, w] for pooled bags."""
    return native.gather_pool(table, rows, pooling=pooling)


def gather_segment_sum(table: jax.Array, rows: jax.Array, segments: jax.Array, *, num_segments: int) -> jax.Array:
    """Fused gather + segment sum: rows i32[n] (< 0: none), segments i32[n] -> f32[num_segments, w]."""
    return native.gather_segment_sum(table, rows, segments, num_segments=num_segments)


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


def _optimizer_args(optimizer) -> dict:
    if isinstance(optimizer, SGD):
        return dict(optimizer="sgd", learning_rate=optimizer.learning_rate)
    return dict(optimizer="rowwise_adagrad", learning_rate=optimizer.learning_rate, eps=optimizer.eps)


def apply_rows(table, slots: dict, rows, grads, *, optimizer, apply, grad_sq_mean=None, after=None):
    """Applies `optimizer` to the rows named in `rows` (duplicates summed first; rows < 0 ignored), in place.

    table f32[R, w] (or a [1, ..., 1, R, w] state block), slots {name: f32[R] (or [1, ..., 1, R])}, rows
    i32[m] (rows of the block), grads f32[m, w]; `apply` (traced bool) False
    leaves everything unchanged. `grad_sq_mean` f32[m] (optional, equal for entries of one row): the
    row's mean squared gradient over the FULL embedding dim, for row-wise AdaGrad on a column-sharded
    table (the mean over this shard's columns otherwise). `after`: arrays the in-place write must wait for
    (this step's lookup outputs when the gradients do not depend on them; else XLA copies the table).
    Only the touched rows are read and written.
    """
    acc = slots.get("accumulator")
    table, acc = native.update_rows(
        table,
        acc,
        rows,
        grads,
        apply=apply,
        acc_increment=grad_sq_mean,
        after=after,
        **_optimizer_args(optimizer),
    )
    return table, ({"accumulator": acc} if acc is not None else {})


def apply_rows_indexed(table, slots: dict, rows, grad_index, grads, *, optimizer, apply, after=None):
    """`apply_rows` with row rows[i]'s gradient grads[grad_index[i]] (grad_index outside [0, len(grads)):
    ignored): the backward of the partial-sums exchange, where a pair's gradient is its bag's, without
    materialising one gradient row per pair."""
    acc = slots.get("accumulator")
    table, acc = native.update_rows_indexed(
        table, acc, rows, grad_index, grads, apply=apply, after=after, **_optimizer_args(optimizer)
    )
    return table, ({"accumulator": acc} if acc is not None else {})


def apply_pooled(table, slots: dict, rows, grad, *, pooling, optimizer, apply, after=None):
    """The fused backward of `gather_pool`: rows i32[b, L] (< 0: padding), grad f32[b, w] (pooled) or
    f32[b, L, w] (sequence): per-row gradients summed and the optimizer applied, never materialising
    [b*L, w]. Only for a block read by ONE feature (features sharing a table need one combined step)."""
    acc = slots.get("accumulator")
    table, acc = native.update_pooled(
        table, acc, rows, grad, pooling=pooling, apply=apply, after=after, **_optimizer_args(optimizer)
    )
    return table, ({"accumulator": acc} if acc is not None else {})
