"""Dense layers whose products XLA:CPU runs as plain 2-D matrix products.

`nnx.Linear` contracts the last axis of a [B, L, d] input with its kernel, and autodiff forms the kernel's
gradient as a product contracting two axes (B and L) of both operands. XLA:CPU then lays one operand out
transposed for its matrix-product library, fusing whatever elementwise work produced it (a dropout mask's
bytes, a GELU's derivative) into a strided, untiled copy: on the foundation model's training step those
copies were about a tenth of the time. `flat_dot_general` flattens the leading axes once, so the forward,
the input gradient and the kernel gradient are each one 2-D product (the kernel's as x^T dy over the B*L
rows), and `Linear` is `nnx.Linear` with it: the same parameters, initialisers and state, so checkpoints
and configs are unchanged. Measured side by side in docs/benchmarks.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def _is_last_axis_by_first(lhs, rhs, dimension_numbers) -> bool:
    """Is this `nnx.Linear`'s product: the lhs's last axis against a 2-D rhs's first, no batch axes."""
    (lc, rc), (lb, rb) = dimension_numbers
    return rhs.ndim == 2 and tuple(lc) == (lhs.ndim - 1,) and tuple(rc) == (0,) and not lb and not rb


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _flat_matmul(x, w, precision, preferred_element_type):
    return jnp.matmul(x, w, precision=precision, preferred_element_type=preferred_element_type)


def _flat_matmul_fwd(x, w, precision, preferred_element_type):
    return _flat_matmul(x, w, precision, preferred_element_type), (x, w)


def _flat_matmul_bwd(precision, preferred_element_type, res, dy):
    x, w = res
    dx = jnp.matmul(dy, w.T.astype(dy.dtype), precision=precision).astype(x.dtype)
    rows, drows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dw = jnp.matmul(rows.T.astype(drows.dtype), drows, precision=precision).astype(w.dtype)
    return dx, dw


_flat_matmul.defvjp(_flat_matmul_fwd, _flat_matmul_bwd)


def flat_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """`jax.lax.dot_general` for `nnx.Linear`'s product (last axis of `lhs` by the first of a 2-D `rhs`) as one
    2-D product over the flattened leading axes, with a custom VJP that keeps its two gradients 2-D products
    too. Any other product, or an `out_sharding`, goes to `jax.lax.dot_general` unchanged."""
    if kwargs.get("out_sharding") is not None or not _is_last_axis_by_first(lhs, rhs, dimension_numbers):
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type, **kwargs
        )
    return _flat_matmul(lhs, rhs, precision, preferred_element_type)


Linear = functools.partial(nnx.Linear, dot_general=flat_dot_general)
"""`nnx.Linear` whose products are 2-D (`flat_dot_general`): same parameters and state as `nnx.Linear`."""
