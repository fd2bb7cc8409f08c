"""Layers whose gradients XLA:CPU runs as few, plain passes: `Linear` and `LayerNorm`, drop-in for nnx's.

`nnx.Linear` contracts the last axis of a [B, L, d] input with its kernel, and autodiff forms the kernel's
gradient as a product contracting two axes (B and L) of both operands. XLA:CPU then lays one operand out
transposed for its matrix-product library, fusing whatever elementwise work produced it (a dropout mask's
bytes, a GELU's derivative) into a strided, untiled copy: on the foundation model's training step those
copies were about a tenth of the time. `flat_dot_general` keeps the forward and the input gradient as they
were and forms the kernel gradient as one 2-D product, x^T dy over the flattened B*L rows.

`nnx.LayerNorm`'s autodiff differentiates the mean, the variance and the normalisation one by one;
`layer_norm` has the fused backward of the normalisation literature (Apex, Triton's tutorial): dx =
(dxh - mean(dxh) - xh * mean(dxh * xh)) / sigma, from the normalised input and 1/sigma kept by the forward.

Both are their nnx classes with the same parameters, initialisers and state (checkpoints and configs are
unchanged), equal to jax's autodiff of the definitions (tests/test_foundation_kernels.py); measured side by
side in docs/benchmarks.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _is_last_axis_by_first(lhs, rhs, dimension_numbers) -> bool:
    """Is this `nnx.Linear`'s product: the lhs's last axis against a 2-D rhs's first, no batch axes."""
    (lc, rc), (lb, rb) = dimension_numbers
    return rhs.ndim == 2 and tuple(lc) == (lhs.ndim - 1,) and tuple(rc) == (0,) and not lb and not rb


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_2d_kernel_grad(x, w, precision, preferred_element_type):
    return jnp.matmul(x, w, precision=precision, preferred_element_type=preferred_element_type)


def _matmul_2d_kernel_grad_fwd(x, w, precision, preferred_element_type):
    return _matmul_2d_kernel_grad(x, w, precision, preferred_element_type), (x, w)


def _matmul_2d_kernel_grad_bwd(precision, preferred_element_type, res, dy):
    x, w = res
    dx = jnp.matmul(dy, w.T.astype(dy.dtype), precision=precision).astype(x.dtype)
    rows, drows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dw = jnp.matmul(rows.T.astype(drows.dtype), drows, precision=precision).astype(w.dtype)
    return dx, dw


_matmul_2d_kernel_grad.defvjp(_matmul_2d_kernel_grad_fwd, _matmul_2d_kernel_grad_bwd)


def flat_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    """`jax.lax.dot_general` for `nnx.Linear`'s product (last axis of `lhs` by the first of a 2-D `rhs`): the
    product and the input's gradient as jax forms them, the kernel's gradient as one 2-D product over the
    flattened leading axes (its custom VJP). Any other product, or an `out_sharding`, goes to
    `jax.lax.dot_general` unchanged."""
    if kwargs.get("out_sharding") is not None or not _is_last_axis_by_first(lhs, rhs, dimension_numbers):
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type, **kwargs
        )
    return _matmul_2d_kernel_grad(lhs, rhs, precision, preferred_element_type)


Linear = functools.partial(nnx.Linear, dot_general=flat_dot_general)
"""`nnx.Linear` whose kernel gradient is one 2-D product (`flat_dot_general`): same parameters and state."""


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x, scale, bias, epsilon: float):
    """Layer normalisation over the last axis of float32 `x`, (x - mean) / sqrt(var + epsilon) * scale + bias
    (the variance about the mean), with the fused backward."""
    return _layer_norm_forward(x, scale, bias, epsilon)[0]


def _layer_norm_forward(x, scale, bias, epsilon):
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    inv = jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + epsilon)
    normed = centred * inv
    return normed * scale + bias, (normed, inv, scale)


def _layer_norm_bwd(epsilon, res, dy):
    normed, inv, scale = res
    d_normed = dy * scale
    dx = inv * (
        d_normed
        - jnp.mean(d_normed, axis=-1, keepdims=True)
        - normed * jnp.mean(d_normed * normed, axis=-1, keepdims=True)
    )
    rows, d_rows = normed.reshape(-1, normed.shape[-1]), dy.reshape(-1, dy.shape[-1])
    return dx, jnp.sum(d_rows * rows, axis=0), jnp.sum(d_rows, axis=0)


layer_norm.defvjp(_layer_norm_forward, _layer_norm_bwd)


class LayerNorm(nnx.LayerNorm):
    """`nnx.LayerNorm` through `layer_norm` where it is the plain case (float32, the last axis, scale and bias,
    no mask, no cross-device statistics); any other case is nnx.LayerNorm's own computation."""

    def __call__(self, x, *, mask=None):
        plain = (
            mask is None
            and self.scale is not None
            and self.bias is not None
            and self.axis_name is None
            and tuple(np.atleast_1d(self.reduction_axes)) in ((-1,), (x.ndim - 1,))
            and tuple(np.atleast_1d(self.feature_axes)) in ((-1,), (x.ndim - 1,))
            and x.dtype == jnp.float32
            and self.scale[...].dtype == jnp.float32
            and self.dtype in (None, jnp.float32)
        )
        if not plain:
            return super().__call__(x, mask=mask)
        return layer_norm(x, self.scale[...], self.bias[...], self.epsilon)
