"""The foundation model's fast parts against brute-force references: the byte-mask dropout, the 2-D dense
layers, the block-causal attention, the encoder's last-position path, the chunked cross-entropy's gradients,
and that cross-entropy split over the batch axes of a mesh."""

import dataclasses
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxscale
from jaxscale.training.config import load_config
from jaxscale.training.trainer import Trainer
from jaxscale_models import foundation as fm
from jaxscale_models.layers import LayerNorm, Linear, flat_dot_general

# ------------------------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("rate", [0.2, 0.5, 0.1])
def test_byte_dropout_drops_its_quantised_rate_and_keeps_the_mean(rate):
    drop = fm.byte_threshold(rate)
    layer = fm.ByteDropout(rate, rngs=nnx.Rngs(dropout=3))
    x = jnp.ones((64, 4099))  # a last axis that is not a multiple of 4
    y = np.asarray(layer(x))
    dropped = y == 0
    n = dropped.size
    applied = drop / 256
    assert abs(applied - rate) <= 1 / 512
    assert abs(dropped.mean() - applied) < 5 * math.sqrt(applied * (1 - applied) / n)  # binomial, 5 sigma
    np.testing.assert_allclose(y[~dropped], 256 / (256 - drop), rtol=1e-6)  # kept values rescaled exactly
    assert abs(y.mean() - 1.0) < 0.01
    assert not np.array_equal(dropped, np.asarray(layer(x)) == 0)  # the stream advances: new masks per call


def test_byte_dropout_eval_identity_and_exact_fallbacks():
    x = jnp.arange(12.0).reshape(3, 4) + 1
    layer = fm.ByteDropout(0.2, rngs=nnx.Rngs(dropout=0))
    layer.eval()
    np.testing.assert_array_equal(layer(x), x)
    # rates a byte cannot represent take nnx.Dropout's exact path (which also keeps explicit keys working)
    assert fm.byte_threshold(0.001) == 0 and fm.byte_threshold(0.999) == 256
    tiny = fm.ByteDropout(0.001, rngs=nnx.Rngs(dropout=0))
    assert np.asarray(tiny(jnp.ones((100, 100))) == 0).sum() < 60
    key = jax.random.key(1)
    a = fm.ByteDropout(0.5, rngs=nnx.Rngs(dropout=0))(x, rngs=key)
    b = nnx.Dropout(0.5)(x, rngs=key)
    np.testing.assert_array_equal(a, b)
    assert fm.ByteDropout(0.2, rngs=nnx.Rngs(dropout=0))(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("shape", [(9,), (3, 5), (2, 3, 8), (4, 1)])
def test_threefry_words_are_both_halves_of_jaxs_threefry_blocks(shape):
    """Word 2j and 2j+1 of a row are the two halves of threefry's block for counter j over the whole array:
    their XOR is what `jax.random.bits` draws for block j (the same key schedule and counters); a shorter
    last axis is the longer one's prefix; raw uint32 keys draw what typed keys do; other key kinds fall back
    to `jax.random.bits`."""
    key = jax.random.key(7)
    *lead, last = shape
    half = -(-last // 2)
    even = np.asarray(fm.threefry_words(key, (*lead, 2 * half))).reshape(*lead, half, 2)
    blocks = np.asarray(jax.random.bits(key, (math.prod(lead) * half,), jnp.uint32)).reshape(*lead, half)
    np.testing.assert_array_equal(even[..., 0] ^ even[..., 1], blocks)
    words = np.asarray(fm.threefry_words(key, shape))
    np.testing.assert_array_equal(words, even.reshape(*lead, 2 * half)[..., :last])
    np.testing.assert_array_equal(fm.threefry_words(jax.random.PRNGKey(7), shape), words)
    rbg = jax.random.key(7, impl="rbg")
    np.testing.assert_array_equal(fm.threefry_words(rbg, shape), jax.random.bits(rbg, shape, jnp.uint32))


def test_threefry_words_are_uniform_and_do_not_depend_on_the_sharding():
    """Bytes uniform over 0..255 (chi-square, 255 degrees of freedom, far tail) with no byte position of a
    word favoured; the same words when the array is computed sharded over 8 devices."""
    words = np.asarray(fm.threefry_words(jax.random.key(11), (256, 1024)))
    octets = words.view(np.uint8).reshape(-1, 4)
    for column in range(4):
        counts = np.bincount(octets[:, column], minlength=256)
        expected = octets.shape[0] / 256
        assert ((counts - expected) ** 2 / expected).sum() < 400
    mesh = jax.make_mesh((8,), ("b",))
    sharded = jax.jit(
        lambda k: fm.threefry_words(k, (256, 1024)),
        out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("b")),
    )(jax.random.key(11))
    assert len(sharded.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(sharded), words)


# -------------------------------------------------------------------------------------- dense layers


def _linear_dims(x):
    return (((x.ndim - 1,), (0,)), ((), ()))


@pytest.mark.parametrize("lead", [(), (3,), (4, 5), (2, 3, 4), (0, 3)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flat_dot_general_value_and_gradients_equal_dot_general(lead, dtype):
    """`flat_dot_general` (2-D products, its own VJP) against `jax.lax.dot_general` and jax's autodiff of it,
    for inputs of rank 1 to 4 (an empty batch included) and both dtypes nnx.Linear computes in."""
    rng = np.random.default_rng(len(lead) + 7 * sum(lead))
    d, f = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    x = jnp.asarray(rng.normal(size=(*lead, d)), dtype)
    w = jnp.asarray(rng.normal(size=(d, f)), dtype)
    cot = jnp.asarray(rng.normal(size=(*lead, f)), dtype)

    def run(dot):
        y, vjp = jax.vjp(lambda a, b: dot(a, b, _linear_dims(a)), x, w)
        return (y, *vjp(cot))

    tol = 1e-6 if dtype == "float32" else 2e-2
    for got, want in zip(run(flat_dot_general), run(jax.lax.dot_general)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_flat_dot_general_passes_other_products_to_dot_general():
    """A product that is not nnx.Linear's (a batch axis; the lhs's first axis contracted) is dot_general's."""
    rng = np.random.default_rng(0)
    a, b = jnp.asarray(rng.normal(size=(3, 4, 5))), jnp.asarray(rng.normal(size=(3, 5, 2)))
    dims = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_array_equal(flat_dot_general(a, b, dims), jax.lax.dot_general(a, b, dims))
    c, m = jnp.asarray(rng.normal(size=(4, 6))), jnp.asarray(rng.normal(size=(4, 2)))
    dims = (((0,), (0,)), ((), ()))
    np.testing.assert_array_equal(flat_dot_general(c, m, dims), jax.lax.dot_general(c, m, dims))


def test_linear_is_nnx_linear_with_the_same_state_outputs_and_gradients():
    """`Linear` has nnx.Linear's parameters (a checkpoint of one restores into the other) and equal outputs
    and parameter gradients on a [B, L, d] input."""
    ours, theirs = Linear(6, 5, rngs=nnx.Rngs(3)), nnx.Linear(6, 5, rngs=nnx.Rngs(3))
    s_ours, s_theirs = nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
    assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)
    for a, b in zip(jax.tree.leaves(s_ours), jax.tree.leaves(s_theirs)):
        np.testing.assert_array_equal(a, b)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 7, 6)), jnp.float32)

    def loss(model):
        return jnp.sum(jnp.tanh(model(x)) * jnp.arange(5.0))

    for a, b in zip(jax.tree.leaves(nnx.grad(loss)(ours)), jax.tree.leaves(nnx.grad(loss)(theirs))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(theirs(x)), rtol=1e-6, atol=1e-6)


def _contractions(text: str) -> list[str]:
    return re.findall(r"contracting_dims = \[([\d, ]*)\]", text)


def test_linear_kernel_gradient_is_one_2d_product_as_lowered():
    """The point of `Linear`: the gradient it hands XLA for a [B, L, d] layer has only one-axis
    contractions (nnx.Linear's kernel gradient contracts B and L together, which XLA:CPU answered with
    strided transposing copies on the foundation step: docs/benchmarks.md)."""
    x = jnp.ones((4, 7, 6), jnp.float32)

    def lowered(model):
        graph, params = nnx.split(model)
        grad = jax.grad(lambda p, a: jnp.sum(nnx.merge(graph, p)(a) ** 2), argnums=(0, 1))
        return jax.jit(grad).lower(params, x).as_text()

    ours, theirs = (_contractions(lowered(m(6, 5, rngs=nnx.Rngs(0)))) for m in (Linear, nnx.Linear))
    assert len(ours) == 3 and all("," not in c for c in ours), ours  # forward, input and kernel gradient
    assert any("," in c for c in theirs), theirs  # the reference really is the two-axis product


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 4, 16), (0, 8)])
def test_layer_norm_equals_nnx_layer_norm_values_and_gradients(shape):
    """`LayerNorm` (the fused backward) against nnx.LayerNorm and jax's autodiff of it: output, input
    gradient, scale and bias gradients, on inputs with a large common offset (where the variance about the
    mean matters)."""
    rng = np.random.default_rng(len(shape) + sum(shape))
    d = shape[-1]
    ours, theirs = LayerNorm(d, rngs=nnx.Rngs(0)), nnx.LayerNorm(d, rngs=nnx.Rngs(0))
    params = {"scale": rng.normal(size=d), "bias": rng.normal(size=d)}
    for layer in (ours, theirs):
        layer.scale[...] = jnp.asarray(params["scale"], jnp.float32)
        layer.bias[...] = jnp.asarray(params["bias"], jnp.float32)
    x = jnp.asarray(rng.normal(size=shape) * 3 + 5, jnp.float32)
    w = jnp.asarray(rng.normal(size=shape), jnp.float32)

    def loss(layer, x):
        return jnp.sum(jnp.tanh(layer(x)) * w)

    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(theirs(x)), rtol=1e-5, atol=1e-5)
    got, want = (nnx.grad(loss, argnums=(0, 1))(m, x) for m in (ours, theirs))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_layer_norm_other_cases_are_nnx_layer_norms_own():
    """bfloat16 inputs, no bias, a mask: nnx.LayerNorm's computation, bit for bit."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 6)), jnp.float32)
    cases = [({}, x.astype(jnp.bfloat16), {}), ({"use_bias": False}, x, {}), ({}, x, {"mask": x > 0})]
    for kwargs, inputs, call in cases:
        ours, theirs = LayerNorm(6, rngs=nnx.Rngs(0), **kwargs), nnx.LayerNorm(6, rngs=nnx.Rngs(0), **kwargs)
        np.testing.assert_array_equal(np.asarray(ours(inputs, **call)), np.asarray(theirs(inputs, **call)))


# ----------------------------------------------------------------------------------------- attention


def _attention_reference(q, k, v, mask):
    """Every query against every key, masked: numpy, float64. q, k, v [B, H, L, D]; mask [B, L]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    l = q.shape[2]
    logits = np.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    allowed = (np.tril(np.ones((l, l), bool))[None] & np.asarray(mask)[:, None, :]) | np.eye(l, dtype=bool)[None]
    logits = np.where(allowed[:, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("l", [1, 7, 64, 65, 200])
def test_block_causal_attention_equals_the_full_masked_product(l):
    cfg = fm.FoundationConfig.smoke(d_model=16, num_heads=2, max_seq_len=max(l, 2), dropout=0.0)
    attn = fm.CausalSelfAttention(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(l)
    x = jnp.asarray(rng.normal(size=(3, l, 16)), jnp.float32)
    mask = np.ones((3, l), bool)
    mask[1, l // 2 + 1 :] = False  # right padding
    mask[2, 0] = l == 1  # a leading hole: rows that see nothing but themselves stay finite
    got = attn(x, jnp.asarray(mask))
    qkv = np.asarray(attn.qkv(x)).reshape(3, l, 3, 2, 8).transpose(2, 0, 3, 1, 4)
    heads = _attention_reference(*qkv, mask).transpose(0, 2, 1, 3).reshape(3, l, 16)
    want = np.asarray(attn.out(jnp.asarray(heads, jnp.float32)))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)
    at = rng.integers(0, l, 3)  # any query position, not only a row's last valid one: causal, too
    one = attn.at(x, jnp.asarray(mask), jnp.asarray(at))
    np.testing.assert_allclose(np.asarray(one), want[[0, 1, 2], at], atol=2e-5)


def test_block_causal_attention_gradients_equal_one_block(monkeypatch):
    cfg = fm.FoundationConfig.smoke(d_model=16, num_heads=2, max_seq_len=150, dropout=0.0)
    attn = fm.CausalSelfAttention(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 150, 16)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 150)) < 0.9)
    w = jnp.asarray(rng.normal(size=(2, 150, 16)), jnp.float32)

    def grads():
        return nnx.grad(lambda m, x: jnp.sum(m(x, mask) * w), argnums=(0, 1))(attn, x)

    blocked = grads()
    monkeypatch.setattr(fm, "ATTENTION_BLOCK", 10_000)  # one block: the full square
    whole = grads()
    for a, b in zip(jax.tree.leaves(blocked), jax.tree.leaves(whole)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def _attention_inputs(seed, b, h, q, k, d, dtype="float32"):
    """Random heads, a random key mask that always allows each query its own (last) key, and a dropout
    keep mask: the shapes of one query block (q <= k) or of `at` (q = 1)."""
    rng = np.random.default_rng(seed)
    qkv = [jnp.asarray(rng.normal(size=(b, h, n, d)), dtype) for n in (q, k, k)]
    allowed = rng.random((b, q, k)) < 0.6
    allowed[..., -1] = True
    keep = rng.random((b, h, q, k)) < 0.8
    return (*qkv, jnp.asarray(allowed), jnp.asarray(keep))


@pytest.mark.parametrize(("b", "h", "q", "k", "d"), [(2, 2, 5, 9, 4), (3, 1, 1, 7, 8), (1, 3, 16, 16, 2)])
@pytest.mark.parametrize("dropout", [True, False])
def test_softmax_attention_value_and_gradients_equal_autodiff_of_the_definition(b, h, q, k, d, dropout):
    """`softmax_attention` (its VJP written out) against jax's autodiff of `attention_reference` with the
    same dropout mask applied to the probabilities, gradients of q, k and v."""
    qa, ka, va, allowed, keep = _attention_inputs(q * k + d, b, h, q, k, d)
    keep, scale = (keep, 1.25) if dropout else (None, 1.0)
    drop = (lambda p: jnp.where(keep, p * scale, 0.0)) if dropout else None
    w = jnp.asarray(np.random.default_rng(1).normal(size=(b, h, q, d)), jnp.float32)

    def ours(qa, ka, va):
        return jnp.sum(fm.softmax_attention(qa, ka, va, allowed, keep, scale) * w)

    def theirs(qa, ka, va):
        return jnp.sum(fm.attention_reference(qa, ka, va, allowed, drop) * w)

    np.testing.assert_allclose(float(ours(qa, ka, va)), float(theirs(qa, ka, va)), rtol=1e-5)
    got = jax.grad(ours, argnums=(0, 1, 2))(qa, ka, va)
    want = jax.grad(theirs, argnums=(0, 1, 2))(qa, ka, va)
    for a, c in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-4, atol=1e-5)


def test_softmax_attention_in_bfloat16_keeps_its_dtypes_and_tracks_float32():
    qa, ka, va, allowed, keep = _attention_inputs(3, 2, 2, 6, 6, 8)
    low = [a.astype(jnp.bfloat16) for a in (qa, ka, va)]

    def loss(*a):
        return jnp.sum(fm.softmax_attention(*a, allowed, keep, 1.25).astype(jnp.float32))

    assert fm.softmax_attention(*low, allowed, keep, 1.25).dtype == jnp.bfloat16
    for a, c in zip(jax.grad(loss, argnums=(0, 1, 2))(*low), jax.grad(loss, argnums=(0, 1, 2))(qa, ka, va)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c), rtol=0.1, atol=0.1)


def test_attention_in_training_draws_the_dropout_mask_its_dropout_layer_would():
    """In training the layer applies `ByteDropout.byte_mask`'s draw: the same mask the dropout layer itself
    draws from the same rng state, so the output equals the definition with the layer's own dropout."""
    cfg = fm.FoundationConfig.smoke(d_model=16, num_heads=2, max_seq_len=70, dropout=0.3)
    attn = fm.CausalSelfAttention(cfg, rngs=nnx.Rngs(0, dropout=5))
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(2, 70, 16)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 70)) < 0.9)
    twin = nnx.clone(attn)
    got = attn(x, mask)

    def reference_attend(q, k, v, allowed):
        return fm.attention_reference(q, k, v, allowed, twin.dropout)

    twin._attend = reference_attend  # the same rng state: the same draws, applied by the definition
    want = twin(x, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    attn.eval()
    twin.eval()  # no dropout: the kernel without a mask against the definition
    assert attn.dropout.byte_mask((2, 2, 3, 3)) == (None, 1.0)
    np.testing.assert_allclose(np.asarray(attn(x, mask)), np.asarray(twin(x, mask)), rtol=1e-5, atol=1e-6)


def _encoder_batch(rng, b, l):
    """Masks of every shape `last_positions` meets: full, right-padded, holes, empty, one event at 0."""
    mask = rng.random((b, l)) < 0.8
    mask[0] = True
    mask[1, l // 2 + 1 :] = False
    mask[2] = False  # empty history: position 0
    mask[3] = False
    mask[3, 0] = True
    return {
        "mask": jnp.asarray(mask),
        "actions": jnp.asarray(rng.integers(0, 5, (b, l)), jnp.int32),
        "surfaces": jnp.asarray(rng.integers(0, 2, (b, l)), jnp.int32),
        "timestamps": jnp.asarray(np.cumsum(rng.integers(0, 10_000, (b, l)), axis=1), jnp.int32),
    }


@pytest.mark.parametrize(("layers", "l"), [(1, 1), (2, 7), (2, 65), (3, 200)])
def test_encode_last_equals_encode_at_the_last_valid_position_gradients_included(layers, l):
    cfg = fm.FoundationConfig.smoke(
        d_model=16, num_heads=2, num_layers=layers, item_dim=8, max_seq_len=max(l, 2), dropout=0.3
    )
    model = fm.SequenceEncoder(cfg, rngs=nnx.Rngs(0))
    model.eval()  # dropout off: both paths are deterministic
    rng = np.random.default_rng(l)
    batch = _encoder_batch(rng, 6, l)
    items = jnp.asarray(rng.normal(size=(6, l, cfg.item_out_dim)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 16)), jnp.float32)
    last = np.asarray(fm.last_positions(batch["mask"]))
    mask = np.asarray(batch["mask"])
    want_last = [max(np.flatnonzero(row), default=0) for row in mask]  # brute force
    np.testing.assert_array_equal(last, want_last)

    def full(m, items):
        hidden = m.encode(items, batch)
        return jnp.sum(w * jnp.take_along_axis(hidden, jnp.asarray(last)[:, None, None], axis=1)[:, 0])

    def at_last(m, items):
        return jnp.sum(w * m.encode_last(items, batch))

    @nnx.jit  # one compile for both paths; op by op, autodiff of the encoder takes tens of seconds
    def both(m, items):
        return tuple(nnx.value_and_grad(f, argnums=(0, 1))(m, items) for f in (at_last, full))

    (got_value, got), (want_value, want) = both(model, items)
    np.testing.assert_allclose(float(got_value), float(want_value), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_encode_last_compiles_to_under_0_7x_the_flops_of_encode():
    """XLA's cost analysis of the compiled forward pass, at the ML-1M shapes (2 layers, d 64, 200 events): the
    work left out of the last block is real, not just unread."""
    cfg = fm.FoundationConfig.smoke(d_model=64, num_heads=2, num_layers=2, item_dim=64, max_seq_len=200, dropout=0.0)
    graph, state = nnx.split(fm.SequenceEncoder(cfg, rngs=nnx.Rngs(0)))
    batch = _encoder_batch(np.random.default_rng(0), 8, 200)
    items = jnp.ones((8, 200, cfg.item_out_dim))

    def flops(method: str) -> float:
        fn = jax.jit(lambda state, items: getattr(nnx.merge(graph, state), method)(items, batch))
        return fn.lower(state, items).compile().cost_analysis()["flops"]

    whole, last = flops("encode"), flops("encode_last")
    assert 0 < last < 0.7 * whole, (last, whole)


def test_encode_last_in_training_draws_dropout_and_stays_finite():
    cfg = fm.FoundationConfig.smoke(d_model=16, num_heads=2, num_layers=2, item_dim=8, max_seq_len=30, dropout=0.5)
    model = fm.SequenceEncoder(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batch = _encoder_batch(rng, 6, 30)
    items = jnp.asarray(rng.normal(size=(6, 30, cfg.item_out_dim)), jnp.float32)
    encode_last = nnx.jit(lambda m, items: m.encode_last(items, batch))
    a, b = np.asarray(encode_last(model, items)), np.asarray(encode_last(model, items))
    assert a.shape == (6, 16) and np.isfinite(a).all()
    assert not np.array_equal(a, b)  # each call draws new masks
    model.eval()
    np.testing.assert_array_equal(encode_last(model, items), encode_last(model, items))


@pytest.mark.parametrize(
    ("similarity", "seen", "space"),
    [("cosine", True, "projected"), ("dot", False, "projected"), ("dot", True, "projected"), ("dot", True, "tied")],
)
def test_foundation_score_equals_the_full_forward_at_the_last_event(similarity, seen, space):
    """Ranking scores through `last_query` (encode_last, no engagement head) = the definition: the full
    forward's query at the history's last event against every row, the offset on the rows in the history."""
    rows, l, b = 23, 9, 6
    dim = 16 if space == "tied" else 8
    cfg = fm.FoundationConfig(
        item_rows=rows, item_dim=dim, d_model=16, num_heads=2, num_layers=2, max_seq_len=l,
        retrieval_loss="full_softmax", similarity=similarity, temperature=0.3, reserved_rows=2,
        seen_item_bias=seen, seen_item_bias_scale=3.0, dropout=0.3, item_space=space,
    )  # fmt: skip
    model = fm.FoundationModel(cfg, rngs=nnx.Rngs(0))
    model.eval()
    if seen:
        model.seen_bias[...] = jnp.float32(-0.4)
    rng = np.random.default_rng(1)
    lengths = np.array([0, 1, 4, l, 7, 2])  # an empty history ranks from position 0
    mask = np.arange(l)[None] < lengths[:, None]
    batch = dict(_encoder_batch(rng, b, l), mask=jnp.asarray(mask))
    batch["item_ids"] = np.where(mask, rng.integers(2, rows, (b, l)), -1).astype(np.int32)
    batch["target_item_ids"] = rng.integers(2, rows, b).astype(np.int32)
    table = rng.normal(size=(rows, dim)).astype(np.float32)
    emb = {
        f: jnp.asarray(table[np.maximum(v, 0)] * (v >= 0)[..., None]) for f, v in fm.foundation_ids(cfg, batch).items()
    }

    scores, target = nnx.jit(fm.foundation_score)(model, emb, batch)

    out = nnx.jit(lambda m, emb: m(emb, batch))(model, emb)
    query = np.asarray(out["query"])[np.arange(b), np.maximum(lengths - 1, 0)]
    corpus = np.asarray(out["corpus"]).reshape(-1, cfg.item_out_dim)[:rows]
    want = query @ corpus.T / cfg.temperature
    rows_of = np.asarray(fm.table_rows(cfg, batch["item_ids"]))
    for u in range(b):
        if seen:
            want[u, np.unique(rows_of[u][mask[u]])] += 3.0 * -0.4
    want[:, :2] = -np.inf
    np.testing.assert_allclose(np.asarray(scores), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(target), np.asarray(fm.table_rows(cfg, batch["target_item_ids"])))


def test_tied_item_space_adds_the_rows_and_scores_with_the_hidden_state():
    """item_space='tied' (SASRec's): the encoder's input is the table row itself plus the event embeddings
    (no LayerNorm, no input Linear), the query is the final hidden state (no query head), and the projected
    space's three layers are not parameters; a tied config that cannot share one space is refused."""
    rows, l, b, d = 19, 7, 5, 16
    cfg = fm.FoundationConfig(
        item_rows=rows, item_dim=d, d_model=d, num_heads=2, num_layers=1, max_seq_len=l,
        retrieval_loss="full_softmax", similarity="dot", temperature=1.0, item_space="tied",
    )  # fmt: skip
    model = fm.FoundationModel(cfg, rngs=nnx.Rngs(0))
    model.eval()
    names = {"/".join(map(str, p)) for p, _ in nnx.iter_graph(model)}
    assert not any(n.split("/")[0] in ("item_ln", "item_in", "query") for n in names)
    projected = fm.FoundationModel(dataclasses.replace(cfg, item_space="projected"), rngs=nnx.Rngs(0))
    count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
    assert count(projected) - count(model) == (2 * d) + (d * d + d) + (d * d + d)  # item_ln, item_in, query

    rng = np.random.default_rng(3)
    batch = _encoder_batch(rng, b, l)
    items = jnp.asarray(rng.normal(size=(b, l, d)), jnp.float32)
    x, _ = model._inputs(items, batch)
    mask = np.asarray(batch["mask"])
    want = (
        np.asarray(items)
        + np.asarray(model.surface_emb(jnp.clip(jnp.where(mask, batch["surfaces"], 0), 0, cfg.num_surfaces - 1)))
        + np.asarray(model.pos_emb.embedding[...])[None, :l]
        + np.asarray(model.action_emb(jnp.clip(jnp.where(mask, batch["actions"], 0), 0, cfg.num_actions - 1)))
        + np.asarray(model.time_features(batch["timestamps"], mask))
    )
    np.testing.assert_allclose(np.asarray(x), want, rtol=1e-6, atol=1e-6)

    table = rng.normal(size=(rows, d)).astype(np.float32)
    batch["item_ids"] = np.where(mask, rng.integers(0, rows, (b, l)), -1).astype(np.int32)
    emb = {f: jnp.asarray(table[np.maximum(v, 0)]) for f, v in fm.foundation_ids(cfg, batch).items()}
    out = model(emb, batch)
    np.testing.assert_array_equal(np.asarray(out["query"]), np.asarray(out["hidden"]))

    in_batch = {"retrieval_loss": "in_batch"}
    for bad in (
        {"item_dim": 8},
        {"num_item_tables": 2, "item_combine": "concat", **in_batch},  # 2 x 16 concatenated
        {"item_reshape": "half_dim", **in_batch},
    ):
        with pytest.raises(ValueError, match="item_space.*item_out_dim == d_model"):
            dataclasses.replace(cfg, **bad)
    with pytest.raises(ValueError, match="item_space"):
        dataclasses.replace(cfg, item_space="shared")


# ------------------------------------------------------------------------------------- cross-entropy


def _xent_inputs(seed, b=5, p=7, e=4, n=13, seen=True):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, p, e)), jnp.float32)
    corpus = jnp.asarray(rng.normal(size=(n, e)), jnp.float32)
    nxt = jnp.asarray(rng.integers(0, n, (b, p)), jnp.int32)
    valid = jnp.asarray(rng.random((b, p)) < 0.8)
    pos = jnp.asarray(np.sort(rng.integers(0, 3 * p, (b, p)), axis=1), jnp.int32)
    first = jnp.asarray(rng.integers(0, 3 * p + 1, (b, n)) if seen else np.zeros((b, 0)), jnp.int32)
    return q, corpus, jnp.float32(0.7), nxt, valid, pos, first


def _dense_xent(x, q, corpus, bias, nxt, valid, pos, first):
    """The definition: [B, P, N] logits materialised, reserved rows -inf, jax's own autodiff."""
    logits = jnp.einsum("bpe,ne->bpn", q, corpus) / x.temperature
    if x.seen:
        logits = logits + bias * (pos[..., None] >= first[:, None, :])
    logits = jnp.where(jnp.arange(corpus.shape[0]) >= x.reserved, logits, -jnp.inf)
    target = jnp.clip(nxt, 0, corpus.shape[0] - 1)
    positive = jnp.take_along_axis(logits, target[..., None], -1)[..., 0]
    ok = valid & (nxt >= x.reserved)
    nll = jnp.sum(jnp.where(ok, jax.nn.logsumexp(logits, -1) - positive, 0.0))
    hits = jnp.sum(ok & (jnp.sum(logits > positive[..., None], -1) < x.recall_k))
    return nll, hits


@pytest.mark.parametrize(
    "seed,seen,reserved,temperature,chunk", [(0, True, 2, 0.5, 40), (1, False, 0, 1.0, 1 << 21), (2, True, 1, 0.05, 13)]
)
def test_chunked_cross_entropy_value_and_gradients_equal_the_dense_definition(seed, seen, reserved, temperature, chunk):
    args = _xent_inputs(seed, seen=seen)
    x = fm.CrossEntropy(temperature, reserved, 3, seen, chunk_elements=chunk)  # chunks that pad the batch
    got = fm.softmax_cross_entropy(x, *args)
    want = _dense_xent(x, *args)
    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-5) and int(got[1]) == int(want[1])
    diff = (0, 1, 2) if seen else (0, 1)

    def grad(f):
        return jax.grad(lambda *a: f(x, *a, *args[len(a) :])[0], argnums=diff)(*args[: len(diff)])

    for g, w in zip(grad(fm.softmax_cross_entropy), grad(_dense_xent)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("seed,p,empty", [(3, 37, False), (4, 16, False), (5, 21, True)])
def test_cross_entropy_skips_padding_and_still_equals_the_dense_definition(seed, p, empty):
    """Right-padded histories (a few long, most short; `empty`: one row with no valid position, or all of
    them): spans of XENT_SPAN positions without a valid one are never scored, the chunks that are left run in
    a loop. Value, hits and every gradient equal the dense definition, the padding's query gradient is 0."""
    b, e, n = 6, 4, 11
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0 if empty else 1, p + 1, b)
    lengths[0] = p  # a full row: its spans all live
    args = list(_xent_inputs(seed, b=b, p=p, e=e, n=n))
    args[4] = jnp.asarray(np.arange(p)[None] < lengths[:, None])
    x = fm.CrossEntropy(0.5, 2, 3, True, chunk_elements=3 * fm.XENT_SPAN * (n - 2))  # 3 spans a chunk
    cases = [args, args[:4] + [jnp.zeros_like(args[4])] + args[5:]] if empty else [args]
    for a in cases:
        got, want = fm.softmax_cross_entropy(x, *a), _dense_xent(x, *a)
        assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-5, abs=1e-6) and int(got[1]) == int(want[1])

        def grad(f, a=a):
            return jax.grad(lambda q, c, bias: f(x, q, c, bias, *a[3:])[0], argnums=(0, 1, 2))(*a[:3])

        got_g, want_g = grad(fm.softmax_cross_entropy), grad(_dense_xent)
        for g, w in zip(got_g, want_g):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)
        assert not np.any(np.asarray(got_g[0])[~np.asarray(a[4])])


def test_live_spans_come_first_in_their_order():
    """The partition the cross-entropy's loop relies on: a permutation, live spans first, each group stable
    (the loop stops after ceil(live / chunk) chunks, so a live span past that point would go unscored)."""
    rng = np.random.default_rng(7)
    for live in [rng.random(50) < 0.3, np.zeros(9, bool), np.ones(9, bool)]:
        order = np.asarray(fm._live_first(jnp.asarray(live)))
        want = np.concatenate([np.flatnonzero(live), np.flatnonzero(~live)])
        np.testing.assert_array_equal(order, want)


def _softmax_loss(cfg, b, seed):
    """(f(query, corpus, seen_bias) -> (loss, recall, count), args) on a random right-padded batch."""
    rng = np.random.default_rng(seed)
    l, e = cfg.max_seq_len, cfg.item_out_dim
    lengths = rng.integers(1, l + 1, b)
    mask = np.arange(l)[None] < lengths[:, None]
    batch = {
        "item_ids": np.where(mask, rng.integers(2, cfg.item_rows, (b, l)), -1).astype(np.int32),
        "mask": mask,
        "target_item_ids": rng.integers(0, cfg.item_rows, b).astype(np.int32),
    }
    per = -(-cfg.item_rows // b)

    def f(query, corpus, bias):
        out = {"query": query, "corpus": corpus, "seen_bias": jnp.broadcast_to(bias, (b,))}
        return fm.full_softmax(cfg, out, batch)

    args = (
        jnp.asarray(rng.normal(size=(b, l, e)), jnp.float32),
        jnp.asarray(rng.normal(size=(b, per, e)), jnp.float32),
        jnp.float32(0.4),
    )
    return f, args


@dataclasses.dataclass(frozen=True)
class _TwoSpanChunks(fm.CrossEntropy):
    chunk_elements: int = 2 * fm.XENT_SPAN * (37 - 2)  # two spans of the test's 35 candidates a chunk


def test_full_softmax_split_over_the_batch_axes_equals_one_device(mesh, monkeypatch):
    """Under the trainer's mesh context each device scores its own examples (`shard_map`): the loss, recall,
    count and the gradients of query, corpus and offset equal the single-device computation. Histories of 40
    (three spans of XENT_SPAN) with random lengths: each device skips its own padding spans, so the devices'
    loops run different numbers of chunks (two spans a chunk)."""
    monkeypatch.setattr(fm, "CrossEntropy", _TwoSpanChunks)
    cfg = fm.FoundationConfig(
        item_rows=37,
        item_dim=8,
        d_model=8,
        max_seq_len=40,
        retrieval_loss="full_softmax",
        similarity="dot",
        temperature=0.5,
        reserved_rows=2,
        seen_item_bias=True,
    )
    f, args = _softmax_loss(cfg, 16, seed=sum(mesh.devices.shape))

    def run():
        return jax.jit(jax.value_and_grad(lambda *a: f(*a)[0], argnums=(0, 1, 2)))(*args), jax.jit(f)(*args)

    (loss, grads), metrics = run()
    assert jaxscale.engine.mesh.batch_mesh(16) is None
    with jax.set_mesh(mesh):
        assert jaxscale.engine.mesh.batch_mesh(16) is not None and jaxscale.engine.mesh.batch_mesh(12) is None
        hlo = jax.jit(f).lower(*args).as_text()
        (s_loss, s_grads), s_metrics = run()
    assert "shard_map" in hlo or "sdy.manual_computation" in hlo
    assert float(s_loss) == pytest.approx(float(loss), rel=1e-5)
    for a, b in zip(s_metrics, metrics):
        assert float(a) == pytest.approx(float(b), rel=1e-5)
    for a, b in zip(s_grads, grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------- sharded training step

TINY = Path(__file__).resolve().parent.parent / "jaxscale" / "configs" / "foundation_tiny.yaml"
FAST_PARTS = (  # dropout on (byte masks from threefry_words, softmax_attention's mask), the full softmax
    "model.foundation.dropout=0.2",
    "model.foundation.retrieval_loss=full_softmax",
    "model.foundation.seen_item_bias=true",
    "train.eval_every=0",
    "data.eval_batches=0",
    "train.checkpoint_every=0",
)


TIED = ("model.foundation.item_space=tied", "model.foundation.item_dim=32")  # the table in d_model's space


def _tiny_run(workdir, nodes, local, topology, steps=3, parts=()):
    cfg = load_config(
        str(TINY),
        [*FAST_PARTS, *parts, f"mesh.nodes={nodes}", f"mesh.local={local}", f"embedding.topology={topology}"],
    )
    mesh = jaxscale.make_mesh(nodes, local, devices=jax.devices()[: nodes * local])
    tr = Trainer(cfg, mesh, workdir=str(workdir), progress=False, log=False)
    out = tr.run(steps=steps)
    state = out["final_state"]
    dense = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state["dense"])[0]}
    return out["losses"], dense, tr.ec.to_dense(state["emb"])


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    runs = {}

    def run(parts):
        if parts not in runs:
            runs[parts] = _tiny_run(tmp_path_factory.mktemp("one_device"), 1, 1, "1d", parts=parts)
        return runs[parts]

    return run


@pytest.mark.parametrize(
    ("nodes", "local", "topology", "parts"),
    [
        (1, 8, "1d", ()),
        (2, 4, "2d_ar", ()),
        (4, 2, "2d_a2a", ()),
        (2, 4, "2d_a2a", TIED),
        (4, 2, "2d_ar", TIED),
        (1, 8, "1d", TIED),
    ],
)
def test_foundation_training_on_a_mesh_equals_one_device(one_device_run, tmp_path, nodes, local, topology, parts):
    """Three training steps of the foundation model with this pass's layers (2-D kernel gradients, the
    attention and layer-norm VJPs, the dropout words) on a mesh equal one device's: losses, every dense
    parameter after the updates and the item table after its row-wise updates. Each mesh shape and each
    topology once (a claim about these three pairs), and the same for the tied item space (the rows enter
    the transformer as they are and the hidden state scores them) in other pairs; the dropout masks do not
    depend on the sharding."""
    losses, dense, tables = _tiny_run(tmp_path, nodes, local, topology, parts=parts)
    want_losses, want_dense, want_tables = one_device_run(parts)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4)
    assert dense.keys() == want_dense.keys()
    for path, want in want_dense.items():
        got = dense[path]
        if "['qkv']['bias']" in path:
            # The key bias adds one constant to all of a query's scores, so its gradient is exactly 0 and
            # only rounding noise reaches Adam, which turns noise into steps of up to the learning rate
            # each: that third of the bias is held to 3 steps of it, the rest as every parameter.
            d, lr = want.shape[0] // 3, load_config(str(TINY), []).train.learning_rate
            np.testing.assert_allclose(got[d : 2 * d], want[d : 2 * d], atol=3 * lr, err_msg=path)
            got, want = np.delete(got, np.s_[d : 2 * d]), np.delete(want, np.s_[d : 2 * d])
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=path)  # Adam amplifies rounding
    for name, want in want_tables.items():
        np.testing.assert_allclose(tables[name], want, rtol=1e-3, atol=1e-5, err_msg=name)
