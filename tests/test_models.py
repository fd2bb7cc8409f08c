"""Dense models: shapes, causality, losses against references, and that a few optimizer steps learn."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxscale_models.dlrm import DLRM, DLRMConfig, auc, dlrm_ids, dlrm_loss, dlrm_tables
from jaxscale_models.dlrm_data import SyntheticDLRMData
from jaxscale_models.foundation import (
    FoundationConfig,
    FoundationModel,
    foundation_ids,
    foundation_loss,
    foundation_tables,
    hash_ids,
    info_nce,
    item_features,
)
from jaxscale_models.foundation_data import SyntheticFoundationData

# One shape family for every foundation test: XLA compiles each new shape once, and on CPU that dominates.
TINY = dict(
    item_rows=500,
    item_dim=8,
    num_item_tables=2,
    item_combine="concat",
    d_model=32,
    num_layers=2,
    num_heads=4,
    max_seq_len=12,
    num_actions=3,
    num_surfaces=2,
    recall_k=5,
)


@nnx.jit
def apply(model, emb, batch):
    return model(emb, batch)


@nnx.jit
def f_loss(model, emb, batch):
    return foundation_loss(model, emb, batch)


def fake_lookup(tables, ids, seed=0):
    """Stands in for EmbeddingCollection.lookup: fixed random rows, zeros on padding, pooled if asked.
    numpy, so the tests don't pay an XLA compile per table shape."""
    out = {}
    for i, t in enumerate(tables):
        table = np.random.default_rng(seed + i).normal(size=(t.rows, t.dim)).astype(np.float32)
        for f in t.features:
            x = np.asarray(ids[f])
            rows = np.where((x >= 0)[..., None], table[np.maximum(x, 0)], 0.0).astype(np.float32)
            out[f] = jnp.asarray(rows if t.pooling is None else rows.sum(axis=1))
    return out


def foundation_inputs(cfg, batch_size=8, step=0):
    batch = SyntheticFoundationData(cfg, batch_size, seed=3, num_clusters=4).batch(step)
    emb = fake_lookup(foundation_tables(cfg), foundation_ids(cfg, batch))
    return emb, {k: jnp.asarray(v) for k, v in batch.items()}


def test_foundation_tables_and_ids():
    cfg = FoundationConfig(**TINY, item_vocab=5000)
    tables = foundation_tables(cfg)
    assert [t.name for t in tables] == list(item_features(cfg)) == ["item_h0", "item_h1"]
    assert all(t.pooling is None and t.rows == 500 and t.dim == 8 for t in tables)
    batch = SyntheticFoundationData(cfg, 4, seed=0).batch(0)
    ids = foundation_ids(cfg, batch)
    for x in ids.values():
        assert x.dtype == np.int32 and x.shape == batch["item_ids"].shape
        np.testing.assert_array_equal(x < 0, ~batch["mask"])
        assert x[batch["mask"]].max() < 500
    assert not np.array_equal(ids["item_h0"], ids["item_h1"])  # independent hashes
    jx = foundation_ids(cfg, {"item_ids": jnp.asarray(batch["item_ids"])})
    for f in ids:  # the jax path (inside a jitted step) hashes exactly like the host path
        np.testing.assert_array_equal(np.asarray(jx[f]), ids[f])
    np.testing.assert_array_equal(hash_ids(batch["item_ids"] % 500, 0, 500, vocab=500), batch["item_ids"] % 500)


def test_foundation_shapes_and_finite_loss():
    cfg = FoundationConfig(**TINY, time_encoding="sinusoidal")
    emb, batch = foundation_inputs(cfg)
    model = FoundationModel(cfg, rngs=nnx.Rngs(0))
    out = apply(model, emb, batch)
    b, l = batch["mask"].shape
    assert out["hidden"].shape == (b, l, 32)
    assert out["query"].shape == out["item"].shape == (b, l, 16)
    assert out["engage_logits"].shape == (b, l - 1)
    loss, m = f_loss(model, emb, batch)
    assert np.isfinite(float(loss)) and np.isfinite(float(m["retrieval_loss"])) and np.isfinite(float(m["engage_loss"]))
    assert 0.0 <= float(m["recall@5"]) <= 1.0
    assert int(m["pairs"]) == int(np.sum(np.asarray(batch["mask"][:, :-1] & batch["mask"][:, 1:])))


@pytest.mark.parametrize("encoding", ["log_bucket", "sinusoidal"])
def test_causal_masking(encoding):
    cfg = FoundationConfig(**TINY, time_encoding=encoding)
    emb, batch = foundation_inputs(cfg)
    batch = dict(batch, mask=jnp.ones_like(batch["mask"]))  # every position real, so every one can change
    model = FoundationModel(cfg, rngs=nnx.Rngs(1))
    ref = apply(model, emb, batch)
    s = 5  # change every input of events > s
    future = jnp.arange(cfg.max_seq_len) > s
    emb2 = {f: jnp.where(future[None, :, None], v + 1.0, v) for f, v in emb.items()}
    batch2 = dict(
        batch,
        actions=jnp.where(future, (batch["actions"] + 1) % 3, batch["actions"]),
        surfaces=jnp.where(future, 1 - jnp.clip(batch["surfaces"], 0, 1), batch["surfaces"]),
        timestamps=jnp.where(future, batch["timestamps"] + 977, batch["timestamps"]),
    )
    new = apply(model, emb2, batch2)
    for k in ("hidden", "query"):
        np.testing.assert_allclose(new[k][:, : s + 1], ref[k][:, : s + 1], atol=1e-5)
        assert float(jnp.max(jnp.abs(new[k][:, s + 1 :] - ref[k][:, s + 1 :]))) > 1e-3
    # engage logit t uses item t+1: logits up to s-1 see nothing of the future
    np.testing.assert_allclose(new["engage_logits"][:, :s], ref["engage_logits"][:, :s], atol=1e-5)
    assert float(jnp.max(jnp.abs(new["engage_logits"][:, s:] - ref["engage_logits"][:, s:]))) > 1e-3


def test_padding_is_ignored():
    cfg = FoundationConfig(**TINY)
    emb, batch = foundation_inputs(cfg)
    model = FoundationModel(cfg, rngs=nnx.Rngs(2))
    pad = ~batch["mask"]
    assert bool(jnp.any(pad))
    emb2 = {f: jnp.where(pad[..., None], 5.0, v) for f, v in emb.items()}
    batch2 = dict(
        batch, actions=jnp.where(pad, 2, batch["actions"]), timestamps=jnp.where(pad, 123, batch["timestamps"])
    )
    l1, _ = f_loss(model, emb, batch)
    l2, _ = f_loss(model, emb2, batch2)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)


def test_info_nce_matches_reference():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(5, 3)).astype(np.float32)
    t = rng.normal(size=(5, 3)).astype(np.float32)
    valid = np.array([True, True, True, False, True])
    ids = np.array([7, 8, 7, 9, 10])  # rows 0 and 2 share an item: not each other's negatives
    tau, k = 0.5, 1
    loss, recall, n = jax.jit(info_nce, static_argnames=("temperature", "k", "max_negatives"))(
        jnp.asarray(q), jnp.asarray(t), jnp.asarray(valid), jnp.asarray(ids), temperature=tau, k=k
    )
    losses, hits = [], []
    for i in range(5):
        if not valid[i]:
            continue
        pos = q[i] @ t[i] / tau
        negs = [q[i] @ t[j] / tau for j in range(5) if valid[j] and ids[j] != ids[i]]
        losses.append(-pos + np.log(np.exp(pos) + np.sum(np.exp(negs))))
        hits.append(sum(x > pos for x in negs) < k)
    np.testing.assert_allclose(float(loss), np.mean(losses), rtol=1e-5)
    np.testing.assert_allclose(float(recall), np.mean(hits), rtol=1e-6)
    assert int(n) == 4
    # a pool subset (max_negatives) changes the negatives, so the loss
    sub, _, _ = info_nce(
        jnp.asarray(q), jnp.asarray(t), jnp.asarray(valid), jnp.asarray(ids), temperature=tau, max_negatives=2, k=k
    )
    assert abs(float(sub) - float(loss)) > 1e-4


def _train(model, loss_fn, steps, lr):
    opt = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m)[0])(model)
        opt.update(model, grads)
        return loss

    return [float(step(model, opt)) for _ in range(steps)]


def test_foundation_dense_training_reduces_loss():
    cfg = FoundationConfig(**TINY)
    emb, batch = foundation_inputs(cfg, batch_size=16)
    model = FoundationModel(cfg, rngs=nnx.Rngs(0))
    losses = _train(model, lambda m: foundation_loss(m, emb, batch), steps=8, lr=3e-3)
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("interaction, train", [("dot", True), ("dcn", False)])
def test_dlrm_shapes_and_training(interaction, train):
    cfg = DLRMConfig(
        num_sparse_features=3,
        rows=(50, 60, 70),
        emb_dim=8,
        ids_per_feature=(1, 2, 3),
        num_dense=4,
        bottom_mlp=(16, 8),
        top_mlp=(16,),
        interaction=interaction,
        dcn_rank=4,
    )
    tables = dlrm_tables(cfg)
    assert [(t.name, t.rows, t.pooling) for t in tables] == [
        ("sparse_0", 50, "sum"),
        ("sparse_1", 60, "sum"),
        ("sparse_2", 70, "sum"),
    ]
    host = SyntheticDLRMData(cfg, 32, seed=1).batch(0)
    emb = fake_lookup(tables, dlrm_ids(cfg, host))
    batch = {k: jnp.asarray(v) for k, v in host.items()}
    assert emb["sparse_2"].shape == (32, 8)
    model = DLRM(cfg, rngs=nnx.Rngs(0))
    loss, m = nnx.jit(dlrm_loss)(model, emb, batch)
    assert m["logits"].shape == (32,)
    assert m["probs"].shape == m["labels"].shape == (32,)
    np.testing.assert_allclose(np.asarray(m["probs"]), np.asarray(jax.nn.sigmoid(m["logits"])), rtol=1e-6)
    assert np.isfinite(float(loss))
    if train:
        losses = _train(model, lambda mm: dlrm_loss(mm, emb, batch), steps=10, lr=1e-2)
        assert np.isfinite(losses).all() and losses[-1] < losses[0] - 0.05, losses


def _auc_bruteforce(labels, scores):
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = [(1.0 if p > n else 0.5 if p == n else 0.0) for p, n in itertools.product(pos, neg)]
    return np.mean(pairs)


def test_auc_matches_pairwise_reference():
    rng = np.random.default_rng(0)
    for _ in range(5):
        labels = rng.integers(0, 2, 60)
        scores = np.round(rng.normal(size=60) + labels * 0.7, 1)  # rounding makes ties
        np.testing.assert_allclose(auc(labels, scores), _auc_bruteforce(labels, scores), rtol=1e-12)
    assert auc([0, 0, 1, 1], [0.1, 0.2, 0.8, 0.9]) == 1.0
    assert auc([1, 1, 0, 0], [0.1, 0.2, 0.8, 0.9]) == 0.0
    assert np.isnan(auc([1, 1], [0.3, 0.4]))


def test_config_validation_names_fields():
    with pytest.raises(ValueError, match="num_heads"):
        FoundationConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        FoundationConfig(max_seq_len=1)
    with pytest.raises(ValueError, match="bottom_mlp"):
        DLRMConfig(emb_dim=16, bottom_mlp=(64, 32))
    with pytest.raises(ValueError, match="rows"):
        DLRMConfig(num_sparse_features=3, rows=(10, 10))
    assert FoundationConfig.large().embedding_params > 1e9
    assert DLRMConfig.large().embedding_params > 1e9
    assert FoundationConfig.smoke() == FoundationConfig()


@pytest.mark.parametrize("action_inputs", [True, False])
def test_action_inputs_ablation_drops_the_event_type_input(action_inputs):
    cfg = FoundationConfig(**TINY, action_inputs=action_inputs, time_encoding="none")
    emb, batch = foundation_inputs(cfg)
    model = FoundationModel(cfg, rngs=nnx.Rngs(1))
    assert hasattr(model, "action_emb") is action_inputs  # no parameter of an input the model does not read
    ref = apply(model, emb, batch)
    moved = apply(model, emb, dict(batch, actions=(batch["actions"] + 1) % cfg.num_actions))
    changed = float(jnp.max(jnp.abs(moved["hidden"] - ref["hidden"])))
    assert (changed > 1e-3) if action_inputs else (changed == 0.0)


@pytest.mark.parametrize("scale", [1.0, 10.0])
def test_seen_item_offset_is_its_scale_times_the_trained_scalar(scale):
    """The offset the scores get is `seen_item_bias_scale * p`, so its gradient in p is the scale times its
    gradient in the offset (Adam then moves the offset `scale` learning rates per step); a scale <= 0 is
    refused by name."""
    cfg = FoundationConfig(
        **dict(TINY, num_item_tables=1),
        retrieval_loss="full_softmax",
        similarity="dot",
        seen_item_bias=True,
        seen_item_bias_scale=scale,
    )
    emb, batch = foundation_inputs(cfg)
    model = FoundationModel(cfg, rngs=nnx.Rngs(2))
    model.seen_bias[...] = jnp.float32(-0.3)
    model.eval()  # no dropout: the two passes below see the same network
    out = apply(model, emb, batch)
    np.testing.assert_allclose(np.asarray(out["seen_bias"]), -0.3 * scale, rtol=1e-6)

    def loss_at(bias):  # the objective as a function of the offset itself
        from jaxscale_models.foundation import foundation_objective

        return foundation_objective(cfg, dict(out, seen_bias=jnp.broadcast_to(bias, out["seen_bias"].shape)), batch)[0]

    d_offset = float(jax.grad(loss_at)(jnp.float32(-0.3 * scale)))
    grads = nnx.grad(lambda m: foundation_loss(m, emb, batch)[0])(model)
    assert d_offset != 0.0
    assert float(grads.seen_bias[...]) == pytest.approx(scale * d_offset, rel=1e-4)
    for bad in (0.0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="seen_item_bias_scale"):
            FoundationConfig(**TINY, seen_item_bias_scale=bad)
