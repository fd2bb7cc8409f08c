"""`jax.ffi` calls of the native CPU kernels (targets registered by `jaxscale.engine.native.runtime`).

The updates alias their outputs to the table and accumulator inputs (`input_output_aliases`), so a donated
state is updated in place: the kernel writes only the touched rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

POOLING_CODES = {"sum": 1, "mean": 2}
OPTIMIZER_CODES = {"sgd": 0, "rowwise_adagrad": 1}
_EMPTY = ((0,), jnp.float32)


def gather_rows(table, rows):
    m, w = rows.shape[0], table.shape[1]
    call = jax.ffi.ffi_call("jaxscale_gather_rows", jax.ShapeDtypeStruct((m, w), jnp.float32), vmap_method="sequential")
    return call(table, rows)


def gather_pool(table, ids, pooling):
    b, L = ids.shape
    w = table.shape[1]
    if pooling is None:  # a sequence lookup is a row gather of the flattened ids
        return gather_rows(table, ids.reshape(-1)).reshape(b, L, w)
    call = jax.ffi.ffi_call("jaxscale_gather_pool", jax.ShapeDtypeStruct((b, w), jnp.float32), vmap_method="sequential")
    return call(table, ids, pooling=np.int32(POOLING_CODES[pooling]))


def _state_io(table, acc):
    acc_in = acc if acc is not None else jnp.zeros(*_EMPTY)
    shapes = (jax.ShapeDtypeStruct(table.shape, jnp.float32), jax.ShapeDtypeStruct(acc_in.shape, jnp.float32))
    return acc_in, shapes


def update_rows(table, acc, rows, grads, *, optimizer, learning_rate, eps, apply, acc_increment=None, after=None):
    acc_in, shapes = _state_io(table, acc)
    inc = acc_increment if acc_increment is not None else jnp.zeros(*_EMPTY)
    after = after if after is not None else jnp.zeros(*_EMPTY)
    call = jax.ffi.ffi_call("jaxscale_update_rows", shapes, input_output_aliases={0: 0, 1: 1}, vmap_method="sequential")
    new_table, new_acc = call(
        table,
        acc_in,
        rows,
        grads,
        apply,
        inc,
        after,
        optimizer=np.int32(OPTIMIZER_CODES[optimizer]),
        learning_rate=np.float32(learning_rate),
        eps=np.float32(eps),
    )
    return new_table, (new_acc if acc is not None else None)


def update_pooled(table, acc, ids, grad, *, pooling, optimizer, learning_rate, eps, apply, after=None):
    if pooling is None:  # sequence gradients are per id already: a row update of the flattened ids
        b, L = ids.shape
        return update_rows(
            table,
            acc,
            ids.reshape(-1),
            grad.reshape(b * L, -1),
            optimizer=optimizer,
            learning_rate=learning_rate,
            eps=eps,
            apply=apply,
            after=after,
        )
    acc_in, shapes = _state_io(table, acc)
    after = after if after is not None else jnp.zeros(*_EMPTY)
    call = jax.ffi.ffi_call(
        "jaxscale_update_pooled", shapes, input_output_aliases={0: 0, 1: 1}, vmap_method="sequential"
    )
    new_table, new_acc = call(
        table,
        acc_in,
        ids,
        grad,
        apply,
        after,
        pooling=np.int32(POOLING_CODES[pooling]),
        optimizer=np.int32(OPTIMIZER_CODES[optimizer]),
        learning_rate=np.float32(learning_rate),
        eps=np.float32(eps),
    )
    return new_table, (new_acc if acc is not None else None)


def gather_segment_sum(table, rows, segments, num_segments):
    w = table.shape[1]
    call = jax.ffi.ffi_call(
        "jaxscale_gather_segment_sum",
        jax.ShapeDtypeStruct((num_segments, w), jnp.float32),
        vmap_method="sequential",
    )
    return call(table, rows, segments)


def update_rows_indexed(table, acc, rows, grad_index, grads, *, optimizer, learning_rate, eps, apply, after=None):
    acc_in, shapes = _state_io(table, acc)
    after = after if after is not None else jnp.zeros(*_EMPTY)
    call = jax.ffi.ffi_call(
        "jaxscale_update_rows_indexed", shapes, input_output_aliases={0: 0, 1: 1}, vmap_method="sequential"
    )
    new_table, new_acc = call(
        table,
        acc_in,
        rows,
        grad_index,
        grads,
        apply,
        after,
        optimizer=np.int32(OPTIMIZER_CODES[optimizer]),
        learning_rate=np.float32(learning_rate),
        eps=np.float32(eps),
    )
    return new_table, (new_acc if acc is not None else None)


def rank_within_owner(owner, *, owners):
    call = jax.ffi.ffi_call(
        "jaxscale_rank_within_owner", jax.ShapeDtypeStruct(owner.shape, jnp.int32), vmap_method="sequential"
    )
    return call(owner, owners=np.int32(owners))


def slot_bags(counts, *, capacity):
    call = jax.ffi.ffi_call(
        "jaxscale_slot_bags", jax.ShapeDtypeStruct((counts.shape[0], capacity), jnp.int32), vmap_method="sequential"
    )
    return call(counts)
