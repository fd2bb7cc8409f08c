"""Low-precision wire formats for embedding communication (QComms).

Embedding rows are quantized just before a collective and dequantized right after it, so the network
moves 1 or 2 bytes per element instead of 4. Two rules make the savings real:

* fp8 uses a per-row power-of-two scale (row = last axis), so rows of any magnitude use the fp8 range
  and large values never clip. The scale is stored as one biased exponent byte (E8M0, the shared-scale
  format of the OCP Microscaling (MX) formats) and travels *inside* the payload: 1 extra u8 per row, one
  collective. A power of two loses nothing against an exact fp32 scale: fp8 is a floating-point format,
  so its relative precision is the same at every scale; the row's max |x| lands in (max/2, max] instead
  of exactly at the format's max, which gives up at most one binade at the subnormal end.
* Every low-precision payload is bitcast to an unsigned integer of the same width before the collective.
  XLA:CPU upcasts f8 collectives to f16 and bf16 ones to f32; integers are moved as they are, on every
  backend.

Non-finite input: with fp8, a NaN or inf anywhere in a row makes that row's scale NaN (exponent byte
0xFF, E8M0's NaN), so the whole row arrives as NaN; other rows are unaffected. bf16/fp16 keep NaN/inf
per element. fp16 is an unscaled cast (as TorchRec's FP16): values above 65504 become inf. Use bf16 or
fp8 for unbounded values.
Scales are clamped to [2**-126, 2**127]: rows whose max |x| is below ~2**-118 (e4m3) lose relative
precision at the subnormal end of fp8 (CPU may flush fp32 subnormal inputs to zero anyway).

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
SCALE_BYTES = 1  # one E8M0 exponent byte per row (scale 2**(byte - 127)), packed behind the fp8 payload
_SCALE_BIAS = 127
_SCALE_NAN = 255  # E8M0's NaN: the row had a NaN or inf

_FP8_DTYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}  # jax.numpy attribute names
_CAST_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_MIN_SCALE_EXP, _MAX_SCALE_EXP = -126, 127  # normal fp32 powers of two


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

    fp32 4 bytes per element, bf16/fp16 2, fp8 1 plus the row's scale exponent (1 byte per row). The one
    definition of a payload's size: the engine's buffers, the planner, `jaxscale.engine.comm_model` and the
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
    for the other precisions it is None (plain cast). The scale is the smallest power of two with
    amax / scale <= finfo.max (clamped to normal fp32 powers of two), so |x| up to the fp32 limit maps
    into range without overflow and dividing by it is exact; all-zero rows get scale 1 (zeros, no NaN);
    a row with a NaN or inf gets a NaN scale, so only that row becomes NaN.
    """
    import jax.numpy as jnp

    qdt = wire_dtype(precision, fp8_format)
    x32 = jnp.asarray(x).astype(jnp.float32)
    if precision != "fp8":
        return x32.astype(qdt), None
    fmax = float(jnp.finfo(qdt).max)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    exponent = _scale_exponent(amax, fmax)
    scale = jnp.where(jnp.isfinite(amax), jnp.ldexp(jnp.float32(1), exponent), jnp.nan)
    values = jnp.clip(x32 / scale, -fmax, fmax).astype(qdt)
    return values, scale


def _scale_exponent(amax, fmax: float):
    """int32 e with 2**(e-1) < amax / fmax <= 2**e, clamped to the normal range; 0 for amax == 0."""
    import jax.numpy as jnp

    mantissa, exponent = jnp.frexp(amax / fmax)  # amax / fmax = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)  # exact powers of two need no round-up
    exponent = jnp.where(amax == 0, 0, exponent)
    return jnp.clip(exponent, _MIN_SCALE_EXP, _MAX_SCALE_EXP).astype(jnp.int32)


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

    fp32 -> f32 unchanged; bf16/fp16 -> u16 of the same shape; fp8 -> u8 of shape [..., d + 1], the row's
    scale packed as its last byte (E8M0: biased exponent, 255 = NaN) so payload and scale travel in one
    collective.
    """
    import jax.numpy as jnp

    values, scale = quantize(x, precision, fp8_format)
    if precision == "fp32":
        return values
    wire = bitcast_to_uint(values)
    if scale is None:
        return wire
    return jnp.concatenate([wire, _scale_to_e8m0(scale)], axis=-1)


def _scale_to_e8m0(scale):
    """fp32 powers of two [..., 1] -> their biased exponent byte [..., 1] u8 (NaN -> 255)."""
    import jax.numpy as jnp

    _, exponent = jnp.frexp(scale)  # scale = 0.5 * 2**exponent
    biased = exponent - 1 + _SCALE_BIAS
    return jnp.where(jnp.isnan(scale), _SCALE_NAN, biased).astype(jnp.uint8)


def _scale_from_e8m0(byte):
    """Inverse of `_scale_to_e8m0`: u8 [..., 1] -> fp32 2**(byte - 127), NaN for 255."""
    import jax.numpy as jnp

    exponent = byte.astype(jnp.int32) - _SCALE_BIAS
    return jnp.where(byte == _SCALE_NAN, jnp.nan, jnp.ldexp(jnp.float32(1), exponent))


def decode(wire: jax.Array, precision: str, fp8_format: str = "e4m3", dtype=np.float32) -> jax.Array:
    """Inverse of `encode`: the dequantized array as `dtype`."""

    qdt = wire_dtype(precision, fp8_format)
    if precision == "fp32":
        return wire.astype(dtype)
    if precision != "fp8":
        return dequantize(bitcast_from_uint(wire, qdt), None, dtype)
    values = bitcast_from_uint(wire[..., :-SCALE_BYTES], qdt)
    return dequantize(values, _scale_from_e8m0(wire[..., -SCALE_BYTES:]), dtype)
