"""Per-shard embedding kernels: gathers, pooled gathers and fused sparse optimizer updates.

Plain functions on local arrays: call them inside `jax.jit`, and per device inside `jax.shard_map` (each
device runs the kernel on its own block). On CPU they lower to the native kernels when those are available
(see `jaxscale.engine.native.runtime` and JAXSCALE_NATIVE); on other backends, or when the native library is not
available, to the pure-JAX kernels of `jaxscale.engine.native.jax_kernels`, with the same results up to the order
of float summation.

Conventions: tables are float32 [R, w]; ids/rows are int32 and any value outside [0, R) is padding (reads
zeros, is not counted in a mean, receives no update). The optimizers follow FBGEMM's exact semantics: per
touched row with summed gradient g, SGD: w -= lr * g; row-wise AdaGrad: acc += mean(g**2) over the row,
w -= lr * g / (sqrt(acc) + eps).
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp

from jaxscale.engine.native import ffi_kernels as _ffi
from jaxscale.engine.native import jax_kernels as _jk
from jaxscale.engine.native import runtime

POOLINGS = ("sum", "mean", None)
OPTIMIZERS = ("sgd", "rowwise_adagrad")

# ------------------------------------------------------------------------------------------- checks


def _shape(x) -> str:
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


def _table(op: str, table):
    if getattr(table, "ndim", None) != 2 or table.dtype != jnp.float32:
        got = _shape(table) if hasattr(table, "dtype") else type(table).__name__
        raise TypeError(f"{op}: table must be a float32 [R, w] array, got {got}")
    return table


def _ints(op: str, name: str, x, ndim: int):
    x = jnp.asarray(x)
    if x.ndim != ndim or not jnp.issubdtype(x.dtype, jnp.integer):
        want = "[m]" if ndim == 1 else "[b, L]"
        raise TypeError(f"{op}: {name} must be an int32 {want} array, got {_shape(x)}")
    return x.astype(jnp.int32)


def _floats(op: str, name: str, x, shape: tuple):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or tuple(x.shape) != tuple(shape):
        raise TypeError(f"{op}: {name} must be a float32 array of shape {list(shape)}, got {_shape(x)}")
    return x.astype(jnp.float32)


def _pooling(op: str, pooling):
    if pooling not in POOLINGS:
        raise ValueError(f"{op}: pooling must be 'sum', 'mean' or None, got {pooling!r}")
    return pooling


def _hyper(op: str, name: str, value) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a static Python number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{op}: {name} must be finite and >= 0, got {value!r}")
    return float(value)


def _apply(op: str, apply):
    a = jnp.asarray(apply)
    if a.shape != () or not (a.dtype == jnp.bool_ or jnp.issubdtype(a.dtype, jnp.integer)):
        raise TypeError(f"{op}: apply must be a boolean scalar, got {_shape(a)}")
    return a.astype(jnp.bool_)


def _static_count(op: str, name: str, value, limit: int = 2**31) -> int:
    """A static shape argument: a Python int in [0, limit) (it sizes an output or an attribute)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise TypeError(f"{op}: {name} must be a static non-negative int below {limit}, got {value!r}")
    return value


def _state_block(op: str, table):
    """An update op's table: f32[R, w], or a state block with leading axes of size 1 ([1, ..., 1, R, w]),
    which the kernel updates in place as it is (reshaping it first would make XLA copy the donated buffer)."""
    ndim = getattr(table, "ndim", None)
    if ndim is None or ndim < 2 or table.dtype != jnp.float32 or any(d != 1 for d in table.shape[:-2]):
        got = _shape(table) if hasattr(table, "dtype") else type(table).__name__
        raise TypeError(f"{op}: table must be a float32 [R, w] array (or [1, ..., 1, R, w]), got {got}")
    return table


def _state(op: str, table, acc, optimizer):
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"{op}: optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    _state_block(op, table)
    if acc is None:
        if optimizer == "rowwise_adagrad":
            raise ValueError(f"{op}: optimizer 'rowwise_adagrad' needs the accumulator acc (float32 [R])")
        return None
    if getattr(acc, "dtype", None) != jnp.float32 or tuple(acc.shape) != tuple(table.shape[:-1]):
        got = _shape(acc) if hasattr(acc, "dtype") else type(acc).__name__
        want = ", ".join(str(d) for d in table.shape[:-1])
        raise TypeError(
            f"{op}: acc must be a float32 [R] = [{want}] array (the table's shape without width), got {got}"
        )
    return acc


def _flat_state(jax_fn):
    """A pure-JAX update kernel applied to a state block with leading unit axes: reshaped to [R, w] / [R]
    around the call (XLA keeps its own scatters in place through a reshape)."""

    def run(table, acc, *rest, **kw):
        shape, acc_shape = table.shape, None if acc is None else acc.shape
        t = table.reshape(shape[-2:])
        a = None if acc is None else acc.reshape(acc_shape[-1:])
        new_t, new_a = jax_fn(t, a, *rest, **kw)
        return new_t.reshape(shape), (None if new_a is None else new_a.reshape(acc_shape))

    return run


def _order_token(after):
    """f32[k]: one element of each non-empty array in the pytree `after` (None when there is none).

    Passed to the update as an operand it ignores, it makes the update wait for those arrays.
    """
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(after)]
    picks = [x.reshape(-1)[:1].astype(jnp.float32) for x in leaves if x.size]
    return jnp.concatenate(picks) if picks else None


def _vma(x) -> frozenset:
    """The shard_map axes one value varies over (`aval.vma`, or `aval.mat.varying` in jax >= 0.10)."""
    aval = jax.typeof(x)
    axes = getattr(aval, "vma", None)
    if axes is None:
        axes = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(axes or ())


def _varying_axes(tree) -> frozenset:
    """The shard_map axes the values of `tree` vary over (empty outside shard_map)."""
    return frozenset().union(*(_vma(x) for x in jax.tree.leaves(tree)))


def _vary(outputs, axes: frozenset):
    """Marks the FFI outputs as varying over the inputs' shard_map axes (an ffi_call's outputs are not)."""
    if not axes:
        return outputs

    def cast(y):
        missing = tuple(sorted(axes - _vma(y)))
        return jax.lax.pcast(y, missing, to="varying") if missing else y

    return jax.tree.map(cast, outputs)


def _dispatch(native_fn, jax_fn, *args):
    """The native kernel on CPU when available, the pure-JAX kernel on other platforms or otherwise.

    With a GPU/TPU default backend nothing is built (the native kernels only serve CPU computations).
    """
    if jax.default_backend() == "cpu" and runtime.use_native():
        # A direct call, not `jax.lax.platform_dependent`: inside shard_map that lowers to a conditional,
        # whose operands XLA copies, so the donated table would be copied whole instead of updated in place.
        return _vary(native_fn(*args), _varying_axes(args))
    return jax_fn(*args)


# ------------------------------------------------------------------------------------------ gathers


def gather_rows(table, rows):
    """Rows of a table: table f32[R, w], rows i32[m] -> f32[m, w]; rows < 0 or >= R give zeros.

    Differentiable in `table` (the cotangent is a dense [R, w] scatter-add, for use under jax.grad).
    """
    _table("gather_rows", table)
    rows = _ints("gather_rows", "rows", rows, 1)
    return _gather_rows(table.shape[0], table, rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_rows(num_rows, table, rows):
    return _dispatch(_ffi.gather_rows, _jk.gather_rows, table, rows)


def _gather_rows_fwd(num_rows, table, rows):
    return _gather_rows(num_rows, table, rows), rows


def _gather_rows_bwd(num_rows, rows, ct):
    idx = jnp.where(_jk.valid_rows(rows, num_rows), rows, num_rows)
    return jnp.zeros((num_rows, ct.shape[-1]), ct.dtype).at[idx].add(ct, mode="drop"), None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def gather_pool(table, ids, *, pooling):
    """Pooled lookup: table f32[R, w], ids i32[b, L] -> f32[b, w] ('sum' / 'mean') or f32[b, L, w] (None).

    Ids outside [0, R) are padding: zeros, not counted in the mean (an all-padding bag gives zeros).
    The native kernel is parallel over the bags and prefetches the rows of the next ids.
    """
    _table("gather_pool", table)
    ids = _ints("gather_pool", "ids", ids, 2)
    return _gather_pool(table.shape[0], _pooling("gather_pool", pooling), table, ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gather_pool(num_rows, pooling, table, ids):
    return _dispatch(
        functools.partial(_ffi.gather_pool, pooling=pooling),
        functools.partial(_jk.gather_pool, pooling=pooling),
        table,
        ids,
    )


def _gather_pool_fwd(num_rows, pooling, table, ids):
    return _gather_pool(num_rows, pooling, table, ids), ids


def _gather_pool_bwd(num_rows, pooling, ids, ct):
    g = _jk.position_grads(ids, ct, pooling, num_rows)
    idx = jnp.where(_jk.valid_rows(ids, num_rows), ids, num_rows).reshape(-1)
    return jnp.zeros((num_rows, ct.shape[-1]), ct.dtype).at[idx].add(g, mode="drop"), None


_gather_pool.defvjp(_gather_pool_fwd, _gather_pool_bwd)


def gather_segment_sum(table, rows, segments, *, num_segments: int):
    """Rows summed into segments: table f32[R, w], rows i32[n], segments i32[n] -> f32[num_segments, w].

    out[s] = sum of table[rows[i]] over the i with segments[i] == s (zeros for an empty segment); entries
    whose row is outside [0, R) or whose segment is outside [0, num_segments) contribute nothing. This is
    an owner pooling the rows it holds into per-bag partial sums (bags identified by arbitrary slots).
    Differentiable in `table`.
    """
    op = "gather_segment_sum"
    _table(op, table)
    rows = _ints(op, "rows", rows, 1)
    segments = _ints(op, "segments", segments, 1)
    if segments.shape != rows.shape:
        raise TypeError(f"{op}: segments must have the shape of rows {list(rows.shape)}, got {list(segments.shape)}")
    _static_count(op, "num_segments", num_segments)
    return _gather_segment_sum(table.shape[0], num_segments, table, rows, segments)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gather_segment_sum(num_rows, num_segments, table, rows, segments):
    return _dispatch(
        functools.partial(_ffi.gather_segment_sum, num_segments=num_segments),
        functools.partial(_jk.gather_segment_sum, num_segments=num_segments),
        table,
        rows,
        segments,
    )


def _gather_segment_sum_fwd(num_rows, num_segments, table, rows, segments):
    return _gather_segment_sum(num_rows, num_segments, table, rows, segments), (rows, segments)


def _gather_segment_sum_bwd(num_rows, num_segments, res, ct):
    rows, segments = res
    ok = _jk.valid_rows(rows, num_rows) & _jk.valid_rows(segments, num_segments)
    g = jnp.take(ct, jnp.where(ok, segments, 0), axis=0)
    idx = jnp.where(ok, rows, num_rows)
    return jnp.zeros((num_rows, ct.shape[-1]), ct.dtype).at[idx].add(g, mode="drop"), None, None


_gather_segment_sum.defvjp(_gather_segment_sum_fwd, _gather_segment_sum_bwd)


# ------------------------------------------------------------------------------------------ updates


def update_rows(
    table,
    acc,
    rows,
    grads,
    *,
    optimizer: str,
    learning_rate: float,
    eps: float = 1e-8,
    apply=True,
    acc_increment=None,
    after=None,
):
    """Fused sparse optimizer step on the given rows; returns (table, acc), updated in place when donated.

    Args:
      table: f32[R, w]. acc: f32[R] row-wise AdaGrad accumulator, or None (SGD; returned as None).
      rows: i32[m]; rows < 0 or >= R are ignored. grads: f32[m, w], the gradient of each entry of rows.
      optimizer: 'sgd' or 'rowwise_adagrad'. learning_rate, eps: static numbers.
      apply: bool scalar (may be traced); False leaves table and acc unchanged.
      acc_increment: optional f32[m]; AdaGrad then adds, per unique row, the value of that row's first
        entry instead of mean(g**2) (for column-sharded tables whose accumulator follows the full row).
      after: optional arrays (any pytree) the update must wait for: pass the lookup output computed from
        this table when the gradients do not depend on it, or XLA copies the whole donated table to keep
        the old one alive for the lookup (see docs/native.md, "the in-place trap").

    Duplicate rows have their gradients summed first (in a fixed order, independent of the thread
    count), then the optimizer touches each unique row once.
    """
    op = "update_rows"
    acc = _state(op, table, acc, optimizer)
    rows = _ints(op, "rows", rows, 1)
    grads = _floats(op, "grads", grads, (rows.shape[0], table.shape[-1]))
    if acc_increment is not None:
        if optimizer != "rowwise_adagrad":
            raise ValueError(f"{op}: acc_increment only applies to optimizer 'rowwise_adagrad'")
        acc_increment = _floats(op, "acc_increment", acc_increment, (rows.shape[0],))
    kw = dict(
        optimizer=optimizer,
        learning_rate=_hyper(op, "learning_rate", learning_rate),
        eps=_hyper(op, "eps", eps),
    )
    apply = _apply(op, apply)
    token = _order_token(after)

    def run(impl):
        return lambda t, a, r, g, ap, inc, tok: impl(t, a, r, g, apply=ap, acc_increment=inc, after=tok, **kw)

    return _dispatch(
        run(_ffi.update_rows), run(_flat_state(_jk.update_rows)), table, acc, rows, grads, apply, acc_increment, token
    )


def update_pooled(
    table,
    acc,
    ids,
    grad,
    *,
    pooling,
    optimizer: str,
    learning_rate: float,
    eps: float = 1e-8,
    apply=True,
    after=None,
):
    """The backward of `gather_pool` fused with the optimizer; returns (table, acc), in place when donated.

    Args:
      table: f32[R, w]. acc: f32[R] or None (SGD).
      ids: i32[b, L], as given to `gather_pool` (ids outside [0, R) are padding).
      grad: the gradient of gather_pool's output: f32[b, w] ('sum' / 'mean') or f32[b, L, w] (None).
      pooling, optimizer, learning_rate, eps, apply, after: as in `gather_pool` / `update_rows`.

    Equivalent to `update_rows` on every valid id with its share of the bag's gradient (the bag's
    gradient for 'sum', divided by the bag's valid ids for 'mean'), without materialising [b*L, w]:
    the native kernel sorts the ids into unique rows, sums each row's bag gradients and updates it.
    """
    op = "update_pooled"
    acc = _state(op, table, acc, optimizer)
    pooling = _pooling(op, pooling)
    ids = _ints(op, "ids", ids, 2)
    b, L = ids.shape
    w = table.shape[-1]
    grad = _floats(op, "grad", grad, (b, w) if pooling is not None else (b, L, w))
    kw = dict(
        pooling=pooling,
        optimizer=optimizer,
        learning_rate=_hyper(op, "learning_rate", learning_rate),
        eps=_hyper(op, "eps", eps),
    )
    apply = _apply(op, apply)
    token = _order_token(after)

    def run(impl):
        return lambda t, a, x, g, ap, tok: impl(t, a, x, g, apply=ap, after=tok, **kw)

    return _dispatch(run(_ffi.update_pooled), run(_flat_state(_jk.update_pooled)), table, acc, ids, grad, apply, token)


def update_rows_indexed(
    table,
    acc,
    rows,
    grad_index,
    grads,
    *,
    optimizer: str,
    learning_rate: float,
    eps: float = 1e-8,
    apply=True,
    after=None,
):
    """Like `update_rows`, with each row's gradient picked from a smaller gradient matrix.

    Args:
      table: f32[R, w]. acc: f32[R] or None (SGD).
      rows: i32[m]. grad_index: i32[m]. grads: f32[G, w]: row rows[i] receives grads[grad_index[i]]
        (e.g. the gradient of the bag the row was pooled into, as `gather_segment_sum` pooled it).
        Entries whose row is outside [0, R) or whose grad_index is outside [0, G) are ignored.
      optimizer, learning_rate, eps, apply, after: as in `update_rows`.

    The backward of `gather_segment_sum` fused with the optimizer, without materialising [m, w]. The sum
    of a row's gradients runs in increasing grad_index (a fixed order, independent of the thread count).
    """
    op = "update_rows_indexed"
    acc = _state(op, table, acc, optimizer)
    rows = _ints(op, "rows", rows, 1)
    grad_index = _ints(op, "grad_index", grad_index, 1)
    if grad_index.shape != rows.shape:
        raise TypeError(
            f"{op}: grad_index must have the shape of rows {list(rows.shape)}, got {list(grad_index.shape)}"
        )
    grads = jnp.asarray(grads)
    grads = _floats(op, "grads", grads, (grads.shape[0] if grads.ndim == 2 else "G", table.shape[-1]))
    kw = dict(
        optimizer=optimizer,
        learning_rate=_hyper(op, "learning_rate", learning_rate),
        eps=_hyper(op, "eps", eps),
    )
    apply = _apply(op, apply)
    token = _order_token(after)

    def run(impl):
        return lambda t, a, r, gi, g, ap, tok: impl(t, a, r, gi, g, apply=ap, after=tok, **kw)

    return _dispatch(
        run(_ffi.update_rows_indexed),
        run(_flat_state(_jk.update_rows_indexed)),
        table,
        acc,
        rows,
        grad_index,
        grads,
        apply,
        token,
    )


# ------------------------------------------------------------------------------------------ routing


def rank_within_owner(owner, *, owners: int):
    """Each request's rank among the earlier requests with the same owner: owner i32[n] -> i32[n].

    rank[i] = #{j < i : owner[j] == owner[i]}; -1 where owner[i] is outside [0, owners). This is a
    request's position in its owner's block of a send buffer that keeps request order.
    """
    op = "rank_within_owner"
    owner = _ints(op, "owner", owner, 1)
    _static_count(op, "owners", owners)
    return _dispatch(
        functools.partial(_ffi.rank_within_owner, owners=owners),
        functools.partial(_jk.rank_within_owner, owners=owners),
        owner,
    )


def slot_bags(counts, *, capacity: int):
    """The bag of every received slot: counts i32[S, G] -> i32[S, capacity].

    Sender s listed counts[s, g] slots of bag g, in bag order; bag[s, j] is the bag of its slot j, and -1
    past its last slot. Negative counts count as zero; slots past `capacity` are cut.
    """
    op = "slot_bags"
    counts = _ints(op, "counts", counts, 2)
    _static_count(op, "capacity", capacity)
    return _dispatch(
        functools.partial(_ffi.slot_bags, capacity=capacity),
        functools.partial(_jk.slot_bags, capacity=capacity),
        counts,
    )
