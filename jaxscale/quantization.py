"""Low-precision wire formats for embedding communication (QComms).

Embedding rows are quantized just before a collective and dequantized right after it, so the network
moves 1 or 2 bytes per element instead of 4. Two rules make the savings real:

* fp8 uses a per-row fp32 scale (row = last axis), so rows of any magnitude use the full fp8 range and
  large values never clip. The scale travels *inside* the payload (4 extra u8 per row): one collective.
* Every low-precision payload is bitcast to an unsigned integer of the same width before the collective.
  XLA:CPU upcasts f8 collectives to f16 and bf16 ones to f32; integers are moved as they are, on every
  backend.

Non-finite input: with fp8, a NaN or inf anywhere in a row makes that row's scale non-finite, so the whole
row arrives as NaN; other rows are unaffected. bf16/fp16 keep NaN/inf per element. fp16 is an unscaled
cast (as TorchRec's FP16): values above 65504 become inf. Use bf16 or fp8 for unbounded values.
Rows whose max |x| is an fp32 subnormal (< 1.2e-38) are sent with the smallest normal scale and lose
relative precision (CPU may flush such inputs to zero anyway).

`wire_bytes(rows, dim, precision)` is the one definition of what a payload costs on the wire; the planner,
the communication model and the scaling model use it without JAX, so JAX is imported inside the functions
that trace arrays, never at module import.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only; see the module docstring
    import jax

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_FORMATS = ("e4m3", "e5m2")
SCALE_BYTES = 4  # one fp32 scale per row, packed as 4 u8 behind the fp8 payload

_FP8_DTYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}  # jax.numpy attribute names
_CAST_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_F32_TINY = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """Precisions of the embedding all-to-all, set separately for the forward and the backward pass.

    Attributes:
      forward: precision of the looked-up rows on the forward pass ('fp32' | 'bf16' | 'fp16' | 'fp8').
      backward: precision of their cotangents on the backward pass.
      fp8_forward_format: fp8 flavour when forward == 'fp8'; 'e4m3' (more mantissa) suits activations.
      fp8_backward_format: fp8 flavour when backward == 'fp8'; 'e5m2' (more range) suits gradients.

    Its fields are the keyword arguments of `collectives.quantized_all_to_all`:
    `quantized_all_to_all(x, axis, **dataclasses.asdict(config))`.
    """

    forward: str = "fp32"
    backward: str = "fp32"
    fp8_forward_format: str = "e4m3"
    fp8_backward_format: str = "e5m2"

    def __post_init__(self):
        for field, check in (
            ("forward", check_precision),
            ("backward", check_precision),
            ("fp8_forward_format", check_fp8_format),
            ("fp8_backward_format", check_fp8_format),
        ):
            try:
                check(getattr(self, field), f"CommConfig.{field}")
            except ValueError as e:
                e.field = field  # lets the config loader name the full dotted key
                raise


def check_precision(precision: str, what: str = "precision") -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"{what} must be one of {PRECISIONS}, got {precision!r}")
    return precision


def check_fp8_format(fp8_format: str, what: str = "fp8_format") -> str:
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"{what} must be one of {FP8_FORMATS}, got {fp8_format!r}")
    return fp8_format


def bytes_per_element(precision: str) -> int:
    """Bytes one element occupies on the wire (fp8's per-row scale not included)."""
    return _BYTES_PER_ELEMENT[check_precision(precision)]


def wire_bytes(rows: int, dim: int, precision: str) -> int:
    """Bytes that `rows` rows of width `dim` occupy on the wire at `precision`, as `encode` lays them out.

    fp32 4 bytes per element, bf16/fp16 2, fp8 1 plus the row's fp32 scale (4 bytes per row). The one
    definition of a payload's size: the engine's buffers, the planner, `jaxscale.comm_model` and the
    scaling model all count bytes with it. Pure Python (no JAX).
    """
    for name, value in (("rows", rows), ("dim", dim)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"wire_bytes: {name} must be a non-negative integer, got {value!r}")
    per_row = int(dim) * bytes_per_element(precision) + (SCALE_BYTES if precision == "fp8" else 0)
    return int(rows) * per_row


payload_bytes = wire_bytes  # the earlier name of the same function


def wire_dtype(precision: str, fp8_format: str = "e4m3"):
    """The dtype a value has *before* it is bitcast for the wire (f32, bf16, f16, or an fp8 type)."""
    import jax.numpy as jnp

    if check_precision(precision) == "fp8":
        return getattr(jnp, _FP8_DTYPES[check_fp8_format(fp8_format)])
    return getattr(jnp, _CAST_DTYPES[precision])


def quantize(x: jax.Array, precision: str, fp8_format: str = "e4m3") -> tuple[jax.Array, jax.Array | None]:
    """Quantize `x` to `precision`; returns (values, scale).

    For fp8 `scale` is fp32 of shape x.shape[:-1] + (1,) with x ~= values * scale per row (last axis);
    for the other precisions it is None (plain cast). The scale is amax / finfo.max computed in fp32, so
    |x| up to the fp32 limit maps into range without overflow; all-zero rows get scale 1 (zeros, no NaN).
    """
    import jax.numpy as jnp

    qdt = wire_dtype(precision, fp8_format)
    x32 = jnp.asarray(x).astype(jnp.float32)
    if precision != "fp8":
        return x32.astype(qdt), None
    fmax = float(jnp.finfo(qdt).max)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    # amax == 0 -> 1 (zeros stay zeros); NaN/inf amax -> non-finite scale, so only that row becomes NaN.
    scale = jnp.where(amax == 0, 1.0, amax / fmax)
    scale = jnp.maximum(scale, _F32_TINY)  # an fp32-subnormal amax must not give a zero scale
    values = jnp.clip(x32 / scale, -fmax, fmax).astype(qdt)
    return values, scale


def dequantize(values: jax.Array, scale: jax.Array | None, dtype=np.float32) -> jax.Array:
    """Inverse of `quantize`: values * scale (scale None -> plain cast), returned as `dtype`."""
    out = values.astype(np.float32)
    if scale is not None:
        out = out * scale
    return out.astype(dtype)


def bitcast_to_uint(x: jax.Array) -> jax.Array:
    """Reinterpret `x` as the unsigned int of the same width, so collectives move exactly its bytes."""
    import jax

    return jax.lax.bitcast_convert_type(x, _UINT_OF_WIDTH[np.dtype(x.dtype).itemsize])


def bitcast_from_uint(u: jax.Array, dtype) -> jax.Array:
    """Inverse of `bitcast_to_uint`."""
    import jax

    return jax.lax.bitcast_convert_type(u, dtype)


def encode(x: jax.Array, precision: str, fp8_format: str = "e4m3") -> jax.Array:
    """`x` as the array a collective should move.

    fp32 -> f32 unchanged; bf16/fp16 -> u16 of the same shape; fp8 -> u8 of shape [..., d + 4], the row's
    fp32 scale packed as its last 4 bytes so payload and scale travel in one collective.
    """
    import jax
    import jax.numpy as jnp

    values, scale = quantize(x, precision, fp8_format)
    if precision == "fp32":
        return values
    wire = bitcast_to_uint(values)
    if scale is None:
        return wire
    scale_bytes = jax.lax.bitcast_convert_type(scale[..., 0], jnp.uint8)  # [...] f32 -> [..., 4] u8
    return jnp.concatenate([wire, scale_bytes], axis=-1)


def decode(wire: jax.Array, precision: str, fp8_format: str = "e4m3", dtype=np.float32) -> jax.Array:
    """Inverse of `encode`: the dequantized array as `dtype`."""
    import jax
    import jax.numpy as jnp

    qdt = wire_dtype(precision, fp8_format)
    if precision == "fp32":
        return wire.astype(dtype)
    if precision != "fp8":
        return dequantize(bitcast_from_uint(wire, qdt), None, dtype)
    values = bitcast_from_uint(wire[..., :-SCALE_BYTES], qdt)
    scale = jax.lax.bitcast_convert_type(wire[..., -SCALE_BYTES:], jnp.float32)[..., None]
    return dequantize(values, scale, dtype)
