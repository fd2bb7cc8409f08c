"""Quantized wire formats and the collectives built on them, against fp32 references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.engine import collectives, quantization
from jaxscale.engine.mesh import LOCAL, NODE
from jaxscale.engine.quantization import CommConfig, decode, dequantize, encode, quantize

# (precision, fp8_format) -> (upper bound, lower bound) of the per-row relative L2 error. The lower bound
# proves the payload really was quantized (a silent fp32 path would pass any upper bound).
ROUND_TRIP_BOUNDS = {
    ("fp8", "e4m3"): (0.05, 0.005),
    ("fp8", "e5m2"): (0.1, 0.01),
    ("bf16", "e4m3"): (0.01, 5e-4),
    ("fp16", "e4m3"): (0.002, 5e-5),
}


def bounds(precision, fp8_format):
    return ROUND_TRIP_BOUNDS[(precision, fp8_format if precision == "fp8" else "e4m3")]


VARIANTS = [("fp32", "e4m3")] + list(ROUND_TRIP_BOUNDS)
VARIANT_IDS = ["fp32"] + [p if p != "fp8" else f"fp8-{f}" for p, f in ROUND_TRIP_BOUNDS]
AXES_UNDER_TEST = {"local": LOCAL, "node": NODE, "node+local": (NODE, LOCAL)}


def rows_with_spread_scales(n, d, seed=0, low=-3, high=3):
    """Gaussian rows, each scaled by 10**U(low, high): per-row scaling must handle every magnitude."""
    rng = np.random.default_rng(seed)
    scales = 10.0 ** rng.uniform(low, high, size=(n, 1))
    return (rng.standard_normal((n, d)) * scales).astype(np.float32)


def row_rel_err(y, ref):
    y, ref = np.asarray(y, np.float64).reshape(-1, ref.shape[-1]), np.asarray(ref, np.float64).reshape(y.shape)
    return np.linalg.norm(y - ref, axis=-1) / np.linalg.norm(ref, axis=-1)


def round_trip(x, precision, fp8_format):
    return np.asarray(jax.jit(lambda v: decode(encode(v, precision, fp8_format), precision, fp8_format))(x))


# --- CommConfig -------------------------------------------------------------------------------------


def test_comm_config_defaults_and_frozen():
    config = CommConfig()
    assert (config.forward, config.backward) == ("fp32", "fp32")
    assert (config.fp8_forward_format, config.fp8_backward_format) == ("e4m3", "e5m2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.forward = "fp8"


@pytest.mark.parametrize(
    "field, bad",
    [("forward", "fp64"), ("backward", "int8"), ("fp8_forward_format", "e3m4"), ("fp8_backward_format", "E5M2")],
)
def test_comm_config_rejects_bad_values_naming_the_field(field, bad):
    with pytest.raises(ValueError, match=f"CommConfig.{field}"):
        CommConfig(**{field: bad})


# --- quantize / dequantize / encode -----------------------------------------------------------------


@pytest.mark.parametrize("precision, fp8_format", list(ROUND_TRIP_BOUNDS), ids=VARIANT_IDS[1:])
def test_round_trip_error_per_row(precision, fp8_format):
    x = rows_with_spread_scales(256, 64, low=-2 if precision == "fp16" else -3, high=2 if precision == "fp16" else 3)
    err = row_rel_err(round_trip(x, precision, fp8_format), x)
    upper, lower = ROUND_TRIP_BOUNDS[(precision, fp8_format)]
    assert err.max() < upper, f"worst row rel-L2 {err.max():.4g}"
    assert err.mean() > lower, f"mean rel-L2 {err.mean():.3g}: was the payload quantized at all?"


def test_fp32_round_trip_is_exact():
    x = rows_with_spread_scales(16, 8)
    np.testing.assert_array_equal(round_trip(x, "fp32", "e4m3"), x)


@pytest.mark.parametrize("fp8_format", quantization.FP8_FORMATS)
def test_fp8_extreme_rows_stay_finite_and_accurate(fp8_format):
    d = 32
    rng = np.random.default_rng(1)
    base = rng.standard_normal((4, d)).astype(np.float32)
    x = np.stack(
        [base[0] * 1e30, base[1] * 1e-30, np.zeros(d, np.float32), base[2] / np.abs(base[2]).max() * 3e38, base[3]]
    ).astype(np.float32)
    y = round_trip(x, "fp8", fp8_format)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y[2], 0.0)
    bound = ROUND_TRIP_BOUNDS[("fp8", fp8_format)][0]
    nonzero = [0, 1, 3, 4]
    assert row_rel_err(y[nonzero], x[nonzero]).max() < bound


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_fp8_non_finite_value_poisons_only_its_row(bad):
    x = rows_with_spread_scales(4, 16)
    x[1, 3] = bad
    y = round_trip(x, "fp8", "e4m3")
    assert np.isnan(y[1]).all(), "a non-finite row scale must turn the whole row into NaN"
    keep = [0, 2, 3]
    assert np.isfinite(y[keep]).all()
    assert row_rel_err(y[keep], x[keep]).max() < 0.05


def test_bf16_keeps_nan_per_element_and_fp16_overflows_to_inf():
    x = np.array([[np.nan, 1.0, 2.0, 1e30]], np.float32)
    bf16 = round_trip(x, "bf16", "e4m3")
    assert np.isnan(bf16[0, 0]) and np.isfinite(bf16[0, 1:]).all()
    fp16 = round_trip(x, "fp16", "e4m3")
    assert fp16[0, 3] == np.inf, "fp16 is an unscaled cast: 1e30 is documented to overflow to inf"
    np.testing.assert_array_equal(fp16[0, 1:3], [1.0, 2.0])


def test_quantize_returns_row_scales_only_for_fp8():
    x = jnp.asarray(rows_with_spread_scales(3, 8))
    quantize_ = jax.jit(quantize, static_argnums=(1, 2))
    values, scale = quantize_(x, "fp8", "e4m3")
    assert values.dtype == jnp.float8_e4m3fn and scale.shape == (3, 1) and scale.dtype == jnp.float32
    # the smallest power of two that brings the row's max |x| into e4m3's range (E8M0 on the wire)
    want = 2.0 ** np.ceil(np.log2(np.abs(np.asarray(x, np.float64)).max(-1) / 448.0))
    np.testing.assert_array_equal(scale[:, 0], want)
    np.testing.assert_array_equal(jax.jit(dequantize)(values, scale), round_trip(x, "fp8", "e4m3"))
    values, scale = quantize_(x, "bf16", "e4m3")
    assert values.dtype == jnp.bfloat16 and scale is None


@pytest.mark.parametrize(
    "precision, fp8_format, dtype, width",
    [
        ("fp32", "e4m3", jnp.float32, 8),
        ("bf16", "e4m3", jnp.uint16, 8),
        ("fp16", "e4m3", jnp.uint16, 8),
        ("fp8", "e4m3", jnp.uint8, 9),
        ("fp8", "e5m2", jnp.uint8, 9),
    ],
)
def test_encode_produces_narrow_unsigned_payload(precision, fp8_format, dtype, width):
    wire = jax.jit(encode, static_argnums=(1, 2))(jnp.ones((2, 3, 8)), precision, fp8_format)
    assert wire.dtype == dtype and wire.shape == (2, 3, width)
    assert wire.nbytes == quantization.payload_bytes(6, 8, precision)


def test_bytes_per_element_and_payload_bytes():
    assert [quantization.bytes_per_element(p) for p in quantization.PRECISIONS] == [4, 2, 2, 1]
    assert quantization.payload_bytes(10, 64, "fp32") == 2560
    assert quantization.payload_bytes(10, 64, "fp8") == 650  # 64 + 1 (the scale exponent) per row
    assert quantization.payload_bytes(10, 64, "fp8") / quantization.payload_bytes(10, 64, "fp32") < 0.3
    with pytest.raises(ValueError, match="precision"):
        quantization.bytes_per_element("int8")


def test_bitcast_helpers_round_trip():
    x = jnp.asarray([1.5, -2.25, 3e-3], jnp.bfloat16)
    u = quantization.bitcast_to_uint(x)
    assert u.dtype == jnp.uint16
    np.testing.assert_array_equal(quantization.bitcast_from_uint(u, jnp.bfloat16), x)


# --- collectives inside shard_map -------------------------------------------------------------------


def _reference_all_to_all(x, mesh_shape, axis, rows_per_peer):
    """numpy tiled all_to_all over `axis` of the per-device blocks of x (sharded over both axes)."""
    n, l = mesh_shape
    d = x.shape[-1]
    if axis == LOCAL:
        return np.swapaxes(x.reshape(n, l, l, rows_per_peer, d), 1, 2).reshape(x.shape)
    if axis == NODE:
        return x.reshape(n, l, n, rows_per_peer, d).transpose(2, 1, 0, 3, 4).reshape(x.shape)
    return np.swapaxes(x.reshape(n * l, n * l, rows_per_peer, d), 0, 1).reshape(x.shape)


def _group_size(mesh, axis):
    return int(np.prod([mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis)]))


# Every axis runs fp8-e4m3 (the forward default) plus one other precision, so that across the three axes
# every precision crosses the wire on every mesh while each mesh compiles few collectives (XLA:CPU
# compiles of 8-device collectives dominate this file's runtime).
AXIS_CASES = [
    (LOCAL, [("fp8", "e4m3"), ("bf16", "e4m3")]),
    (NODE, [("fp8", "e4m3"), ("fp16", "e4m3")]),
    ((NODE, LOCAL), [("fp8", "e4m3"), ("fp8", "e5m2")]),
]


@pytest.mark.parametrize("axis, variants", AXIS_CASES, ids=list(AXES_UNDER_TEST))
def test_all_to_all_matches_fp32_reference(mesh, axis, variants):
    s, k, d = _group_size(mesh, axis), 3, 32
    x = rows_with_spread_scales(mesh.size * s * k, d, seed=2)
    spec = P((NODE, LOCAL))

    def body(block):
        return tuple(collectives.all_to_all(block, axis, p, f) for p, f in variants)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec,) * len(variants)))
    outs = step(jax.device_put(x, NamedSharding(mesh, spec)))
    reference = _reference_all_to_all(x, mesh.devices.shape, axis, k)
    for (precision, fp8_format), out in zip(variants, outs):
        assert out.dtype == jnp.float32 and out.shape == x.shape
        err = row_rel_err(out, reference)
        upper, lower = bounds(precision, fp8_format)
        assert err.max() < upper, f"{precision}/{fp8_format}: worst row {err.max():.4g}"
        assert err.mean() > lower, f"{precision}/{fp8_format}: mean err {err.mean():.3g}, was it quantized?"


def test_fp32_all_to_all_is_exact(mesh):
    k, d = 2, 8
    x = rows_with_spread_scales(mesh.size * mesh.size * k, d, seed=6)
    spec = P((NODE, LOCAL))
    step = jax.jit(
        jax.shard_map(lambda b: collectives.all_to_all(b, (NODE, LOCAL)), mesh=mesh, in_specs=spec, out_specs=spec)
    )
    out = step(jax.device_put(x, NamedSharding(mesh, spec)))
    np.testing.assert_array_equal(np.asarray(out), _reference_all_to_all(x, mesh.devices.shape, (NODE, LOCAL), k))


@pytest.fixture(scope="module")
def mesh_2x4():
    import jaxscale

    return jaxscale.make_mesh(2, 4)


@pytest.mark.parametrize("axis", [LOCAL, (NODE, LOCAL)], ids=["local", "node+local"])
def test_all_gather_matches_reference(mesh_2x4, axis):
    mesh, k, d = mesh_2x4, 2, 16
    variants = [("fp32", "e4m3"), ("fp8", "e4m3"), ("bf16", "e4m3")]
    x = rows_with_spread_scales(mesh.size * k, d, seed=3)
    spec = P((NODE, LOCAL))

    def body(block):
        return tuple(collectives.all_gather(block, axis, p, f) for p, f in variants)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec,) * len(variants)))
    outs = [np.asarray(o) for o in step(jax.device_put(x, NamedSharding(mesh, spec)))]
    n, l = mesh.devices.shape
    blocks = x.reshape(n, l, k, d)
    gathered = (
        np.broadcast_to(blocks[:, None], (n, l, l, k, d))
        if axis == LOCAL
        else np.broadcast_to(blocks.reshape(1, 1, n * l, k, d), (n, l, n * l, k, d))
    )
    reference = gathered.reshape(-1, d)
    np.testing.assert_array_equal(outs[0], reference)
    for (precision, fp8_format), out in zip(variants[1:], outs[1:]):
        assert row_rel_err(out, reference).max() < bounds(precision, fp8_format)[0]


def test_ids_are_never_quantized(mesh):
    spec = P((NODE, LOCAL))
    ids = np.arange(mesh.size * 8, dtype=np.int32) * 7919  # large ids: any float rounding would show
    out = jax.jit(
        jax.shard_map(lambda b: collectives.all_to_all_ids(b, LOCAL), mesh=mesh, in_specs=spec, out_specs=spec)
    )(jax.device_put(ids, NamedSharding(mesh, spec)))
    n, l = mesh.devices.shape
    expected = np.swapaxes(ids.reshape(n, l, l, 8 // l), 1, 2).reshape(-1)
    np.testing.assert_array_equal(np.asarray(out), expected)
    with pytest.raises(TypeError, match="all_to_all_ids"):
        collectives.all_to_all(jnp.zeros((8,), jnp.int32), LOCAL, "fp8")
    with pytest.raises(TypeError, match="integer"):
        collectives.all_to_all_ids(jnp.zeros((8,), jnp.float32), LOCAL)


GRAD_CONFIGS = [CommConfig("fp8", "fp8"), CommConfig("bf16", "fp16"), CommConfig("fp32", "bf16")]


def test_quantized_all_to_all_gradients_match_fp32(mesh_2x4):
    """d/dx sum(w * a2a(x)) = a2a(w): the forward precision shows in the value, the backward one in the grad."""
    mesh, axis, k, d = mesh_2x4, [NODE, LOCAL], 2, 32  # a list axis must work (normalised to a tuple)
    x = rows_with_spread_scales(mesh.size * mesh.size * k, d, seed=4)
    w = rows_with_spread_scales(x.shape[0], d, seed=5)
    spec = P((NODE, LOCAL))

    def loss(x, w, config):
        y = jax.shard_map(
            lambda b: collectives.quantized_all_to_all(b, axis, **dataclasses.asdict(config)),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )(x)
        return jnp.sum(y * w), y

    def all_grads(x, w):
        return [jax.grad(loss, has_aux=True)(x, w, c) for c in GRAD_CONFIGS]

    sharding = NamedSharding(mesh, spec)
    results = jax.jit(all_grads)(jax.device_put(x, sharding), jax.device_put(w, sharding))
    y_ref = _reference_all_to_all(x, mesh.devices.shape, (NODE, LOCAL), k)
    grad_ref = _reference_all_to_all(w, mesh.devices.shape, (NODE, LOCAL), k)
    for config, (grad, y) in zip(GRAD_CONFIGS, results):
        for precision, fmt, got, want in [
            (config.forward, config.fp8_forward_format, y, y_ref),
            (config.backward, config.fp8_backward_format, grad, grad_ref),
        ]:
            err = row_rel_err(got, want)
            if precision == "fp32":
                assert err.max() == 0.0
            else:
                upper, lower = bounds(precision, fmt)
                assert lower < err.mean() and err.max() < upper, f"{config}: {precision}/{fmt} err {err.max():.4g}"


def test_quantized_all_to_all_validates_precisions():
    with pytest.raises(ValueError, match="backward"):
        collectives.quantized_all_to_all(jnp.ones((8, 4)), LOCAL, "fp8", "fp64")
    with pytest.raises(ValueError, match="fp8_forward_format"):
        collectives.quantized_all_to_all(jnp.ones((8, 4)), LOCAL, "fp8", "fp8", fp8_forward_format="e2m1")
