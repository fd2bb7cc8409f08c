"""Per-shard collectives with quantized payloads, for use inside `jax.shard_map` bodies.

Each function sees local blocks. `axis_name` is one mesh axis (`NODE`, `LOCAL`) or a tuple of them
(`(NODE, LOCAL)` = every device); S below is the size of that axis group. The payload is quantized per
row (last axis), bitcast to unsigned ints and moved by ONE collective (fp8 scales ride inside it, see
`quantization.encode`), then dequantized back to the input dtype.

`all_to_all` / `all_gather` are forward-only for precisions other than 'fp32' (their bitcasts have no
gradient); use `quantized_all_to_all` where gradients must flow.

`gather_small` gathers small control values (the host capacity exchange's maxima): on CPU as ONE
all-to-all, which gloo (XLA:CPU between processes) runs as one round of pairwise exchanges, where its
all-gather is a ring of dependent rounds (`experiments/bench/collective_latency.py` measures both, and
the all-reduce the step's counters use).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxscale.engine.quantization import check_fp8_format, check_precision, decode, encode

AxisName = str | tuple[str, ...]


def _axis(axis_name: str | Sequence[str]) -> AxisName:
    """Lists are not hashable (custom_vjp needs hashable static args): normalise to str or tuple."""
    return axis_name if isinstance(axis_name, str) else tuple(axis_name)


def _check_float(x: jax.Array, fn: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{fn} quantizes float payloads; got {x.dtype}. Move ids with all_to_all_ids.")


def _a2a(x: jax.Array, axis_name: AxisName) -> jax.Array:
    # split_axis = concat_axis = 0, tiled: block i goes to peer i; the op is its own transpose.
    return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)


def _quantized_a2a(x: jax.Array, axis_name: AxisName, precision: str, fp8_format: str) -> jax.Array:
    wire = _a2a(encode(x, precision, fp8_format), axis_name)
    return decode(wire, precision, fp8_format, x.dtype)


def all_to_all(
    x: jax.Array, axis_name: str | Sequence[str], precision: str = "fp32", fp8_format: str = "e4m3"
) -> jax.Array:
    """Tiled all_to_all of float rows x: [S*k, ..., d] -> same shape, block i of axis 0 sent to peer i.

    The payload crosses the wire in `precision` ('fp32' is a plain all_to_all); the result is x.dtype.
    """
    _check_float(x, "all_to_all")
    return _quantized_a2a(x, _axis(axis_name), check_precision(precision), check_fp8_format(fp8_format))


def all_to_all_ids(x: jax.Array, axis_name: str | Sequence[str]) -> jax.Array:
    """Tiled all_to_all of integer ids (never quantized: a rounded id is a different row)."""
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"all_to_all_ids moves integer ids; got {x.dtype}. Use all_to_all for float rows.")
    return _a2a(x, _axis(axis_name))


def all_to_all_ids_and_sum(x: jax.Array, counters: jax.Array, axis_name: str | Sequence[str]):
    """`all_to_all_ids(x)` that also sums small non-negative int32 `counters` [k] over the axis group:
    (received ids, the sums [k], the same on every device). The counters ride as extra words at the end of
    every block of the same all-to-all, so the sum costs no collective of its own (between processes each
    collective is a round of messages; an all-reduce of two counters costs about as much as the ids'
    exchange itself, experiments/results/collective_latency.md)."""
    if not jnp.issubdtype(x.dtype, jnp.integer) or x.dtype.itemsize > 4:
        raise TypeError(f"all_to_all_ids_and_sum moves integer ids of at most 32 bits; got {x.dtype}")
    size, k, per = x.shape[0], counters.size, 4 // x.dtype.itemsize  # per: words of one counter
    words = jax.lax.bitcast_convert_type(counters.astype(jnp.uint32), x.dtype).reshape(k * per)
    blocks = jnp.concatenate([x.reshape(size, -1), jnp.broadcast_to(words, (size, k * per))], axis=1)
    recv = _a2a(blocks, _axis(axis_name))
    n = recv.shape[1] - k * per
    got = recv[:, n:].reshape((size, k, per) if per > 1 else (size, k))
    sums = jax.lax.bitcast_convert_type(got, jnp.uint32).astype(jnp.int32).sum(0)
    return recv[:, :n].reshape(x.shape), sums


def all_gather(
    x: jax.Array, axis_name: str | Sequence[str], precision: str = "fp32", fp8_format: str = "e4m3"
) -> jax.Array:
    """Tiled all_gather along axis 0 ([k, ..., d] -> [S*k, ..., d]) with the payload in `precision`.

    Used for the sparse replica sync: each replica gathers the touched rows' updates of its peers.
    """
    _check_float(x, "all_gather")
    check_precision(precision)
    check_fp8_format(fp8_format)
    wire = jax.lax.all_gather(encode(x, precision, fp8_format), _axis(axis_name), axis=0, tiled=True)
    return decode(wire, precision, fp8_format, x.dtype)


def quantized_all_to_all(
    x: jax.Array,
    axis_name: str | Sequence[str],
    forward: str = "fp32",
    backward: str = "fp32",
    fp8_forward_format: str = "e4m3",
    fp8_backward_format: str = "e5m2",
) -> jax.Array:
    """Differentiable `all_to_all`: rows travel in `forward` precision, their cotangents in `backward`.

    The cotangent of a tiled split=concat=0 all_to_all is the same all_to_all of the cotangent, so the
    backward pass is one more quantized all_to_all. Keyword names match `CommConfig`'s fields.
    """
    _check_float(x, "quantized_all_to_all")
    check_precision(forward, "forward")
    check_precision(backward, "backward")
    check_fp8_format(fp8_forward_format, "fp8_forward_format")
    check_fp8_format(fp8_backward_format, "fp8_backward_format")
    return _qa2a(x, _axis(axis_name), forward, backward, fp8_forward_format, fp8_backward_format)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _qa2a(x, axis_name, forward, backward, fp8_forward_format, fp8_backward_format):
    return _quantized_a2a(x, axis_name, forward, fp8_forward_format)


def _qa2a_fwd(x, axis_name, forward, backward, fp8_forward_format, fp8_backward_format):
    return _quantized_a2a(x, axis_name, forward, fp8_forward_format), None


def _qa2a_bwd(axis_name, forward, backward, fp8_forward_format, fp8_backward_format, _, g):
    return (_quantized_a2a(g, axis_name, backward, fp8_backward_format),)


_qa2a.defvjp(_qa2a_fwd, _qa2a_bwd)


# ------------------------------------------------------------------------- small control values


def gather_small(x: jax.Array, axis_name: str | Sequence[str], size: int, as_all_to_all: bool) -> jax.Array:
    """Every peer's block of a small array, stacked: [k, ...] -> [size * k, ...] (block i from peer i).

    `as_all_to_all`: the block is repeated once per peer and moved by one tiled all-to-all, so peer i's
    copy lands in slot i on every device; else a plain all-gather. Same result; the all-to-all is one
    round of pairwise exchanges where gloo's all-gather is a ring of size - 1 dependent rounds.
    """
    axis = _axis(axis_name)
    if not as_all_to_all:
        return jax.lax.all_gather(x, axis, axis=0, tiled=True)
    return jax.lax.all_to_all(jnp.concatenate([x] * size, axis=0), axis, 0, 0, tiled=True)


def prefers_all_to_all(mesh) -> bool:
    """Small gathers travel by all-to-all on CPU meshes (gloo), by the platform's all-gather elsewhere
    (NCCL's is latency-optimised; an all-to-all of a few values is S - 1 messages)."""
    return mesh.devices.flat[0].platform == "cpu"
