"""Contextual two-tower model: the retrieval loss (logQ, accidental hits), the streaming frequency estimator,
exact full-corpus Recall@K, the planted-context data and input checks, each against a NumPy reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxscale
from jaxscale_models.contextual_two_tower import (
    ContextualTwoTower,
    ContextualTwoTowerConfig,
    StreamingFrequencyEstimator,
    frequency_update,
    full_corpus_recall,
    in_batch_softmax,
    two_tower_ids,
    two_tower_loss,
    two_tower_summarize,
    two_tower_tables,
    withhold_context,
)
from jaxscale_models.contextual_two_tower_data import SyntheticContextualData, derive_pseudo_context
from jaxscale_models.foundation import SequenceEncoder

# One small shape family for every model test: XLA compiles each new shape once, and on CPU that dominates.
TINY = dict(
    item_rows=300,
    num_categories=12,
    item_dim=8,
    d_model=16,
    num_layers=1,
    num_heads=2,
    mlp_ratio=2,
    max_seq_len=8,
    context_dim=8,
    head_hidden=(16,),
    item_hidden=(16,),
    embed_dim=8,
    recall_ks=(1, 5, 10),
)


# ------------------------------------------------------------------------------------------ loss


def softmax_reference(q, c, labels, valid, tau, log_q, remove_hits):
    """Row by row: logits over the valid candidates that are not accidental hits, minus log q."""
    losses = []
    for i in range(len(q)):
        if not valid[i]:
            continue
        logits = {}
        for j in range(len(q)):
            if not valid[j] or (remove_hits and j != i and labels[j] == labels[i]):
                continue
            logits[j] = float(q[i] @ c[j]) / tau - (0.0 if log_q is None else float(log_q[j]))
        values = np.array(list(logits.values()), np.float64)
        lse = values.max() + np.log(np.sum(np.exp(values - values.max())))
        losses.append(lse - logits[i])
    return np.mean(losses)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_in_batch_softmax_logq_and_accidental_hits_match_numpy(seed):
    rng = np.random.default_rng(seed)
    n, e = int(rng.integers(5, 24)), int(rng.integers(2, 9))
    q = rng.normal(size=(n, e)).astype(np.float32)
    c = rng.normal(size=(n, e)).astype(np.float32)
    labels = rng.integers(0, max(2, n // 3), n)  # many repeated items: accidental hits
    valid = rng.random(n) > 0.2
    valid[0] = True
    log_q = np.log(rng.uniform(0.01, 1.0, n)).astype(np.float32)
    tau = float(rng.uniform(0.05, 1.0))
    f = jax.jit(in_batch_softmax, static_argnames=("temperature", "remove_accidental_hits"))
    for lq in (log_q, None):
        for remove in (True, False):
            got = f(q, c, labels, valid, temperature=tau, log_q=lq, remove_accidental_hits=remove)
            want = softmax_reference(q, c, labels, valid, tau, lq, remove)
            np.testing.assert_allclose(float(got), want, rtol=2e-5, atol=2e-5)
    # the corrections change the loss (the tests above would pass for a no-op otherwise)
    a = float(f(q, c, labels, valid, temperature=tau, log_q=log_q, remove_accidental_hits=True))
    b = float(f(q, c, labels, valid, temperature=tau, log_q=None, remove_accidental_hits=True))
    d = float(f(q, c, labels, valid, temperature=tau, log_q=log_q, remove_accidental_hits=False))
    assert abs(a - b) > 1e-4 and abs(a - d) > 1e-4


def test_in_batch_softmax_gradient_ignores_invalid_rows():
    rng = np.random.default_rng(3)
    q, c = rng.normal(size=(6, 4)).astype(np.float32), rng.normal(size=(6, 4)).astype(np.float32)
    labels, valid = np.arange(6), np.array([True, True, False, True, False, True])

    def loss(q, c):
        return in_batch_softmax(q, c, labels, valid, temperature=0.1, log_q=None)

    gq, gc = jax.grad(loss, argnums=(0, 1))(q, c)
    assert np.all(np.isfinite(gq)) and np.all(np.isfinite(gc))
    assert np.all(np.asarray(gq)[~valid] == 0) and np.all(np.asarray(gc)[~valid] == 0)


# ------------------------------------------------------------------------------------------ estimator


def estimator_reference(steps, buckets: int, alpha: float):
    """Yi et al. 2019 Algorithm 2, one candidate at a time; an item's first sighting sets its gap to t."""
    last, gap = np.zeros(buckets, np.int64), np.ones(buckets, np.float64)
    for t, (b, v) in enumerate(steps, start=1):
        for h, ok in zip(b, v):
            if not ok:
                continue
            gap[h] = t - last[h] if last[h] == 0 else (1 - alpha) * gap[h] + alpha * (t - last[h])
            last[h] = t
    return last, gap


@pytest.mark.parametrize("buckets, alpha", [(7, 0.1), (40, 0.3)])
def test_frequency_update_matches_sequential_reference(buckets, alpha):
    rng = np.random.default_rng(buckets)
    steps = []
    for _ in range(25):
        n = 16
        b = np.minimum(rng.zipf(1.5, n) - 1, buckets - 1).astype(np.int32)  # hot buckets repeat in a step
        v = rng.random(n) > 0.15
        steps.append((b, v))
    last = jnp.zeros(buckets, jnp.int32)
    gap = jnp.ones(buckets, jnp.float32)
    step = jnp.zeros((), jnp.int32)
    update = jax.jit(frequency_update, static_argnames="alpha")
    for b, v in steps:
        last, gap, step = update(last, gap, step, jnp.asarray(b), jnp.asarray(v), alpha=alpha)
    want_last, want_gap = estimator_reference(steps, buckets, alpha)
    assert int(step) == len(steps)
    np.testing.assert_array_equal(np.asarray(last), want_last)
    np.testing.assert_allclose(np.asarray(gap), want_gap, rtol=1e-5)


def test_estimator_recovers_sampling_rates():
    """Items appearing with known probabilities per step: p = 1 / gap tracks the rate (ratios hold)."""
    rng = np.random.default_rng(0)
    rates = np.array([0.9, 0.5, 0.2, 0.05])
    est = StreamingFrequencyEstimator(buckets=4, alpha=0.02, vocab=4)
    call = nnx.jit(lambda e, ids, valid: e(ids, valid))
    for _ in range(3000):
        present = rng.random(4) < rates
        call(est, jnp.arange(4, dtype=jnp.int32), jnp.asarray(present))
    p = np.exp(np.asarray(est.log_probability(jnp.arange(4))))
    np.testing.assert_allclose(p, rates, rtol=0.3)
    assert np.all(np.diff(p) < 0)


def test_estimator_hashes_into_fewer_buckets_and_freezes_in_eval():
    est = StreamingFrequencyEstimator(buckets=5, alpha=0.1, vocab=1000)
    ids = jnp.asarray([3, 999, 500, 3], jnp.int32)
    b = np.asarray(est.bucket(ids))
    assert b.min() >= 0 and b.max() < 5 and b[0] == b[3]
    est(ids, jnp.ones(4, bool))
    assert int(est.step[...]) == 1
    est.eval()  # like BatchNorm: read, don't update
    before = np.asarray(est.gap[...]).copy()
    out = est(ids, jnp.ones(4, bool))
    assert int(est.step[...]) == 1 and np.array_equal(np.asarray(est.gap[...]), before)
    np.testing.assert_allclose(np.asarray(out), -np.log(before[b]), rtol=1e-6)


# ------------------------------------------------------------------------------------------ recall


def recall_reference(queries, items, labels, k):
    scores = queries.astype(np.float64) @ items.T.astype(np.float64)
    order = np.argsort(-scores, axis=1, kind="stable")  # ties: lower index first, as lax.top_k
    return np.mean([labels[i] in order[i, :k] for i in range(len(labels))])


@pytest.mark.parametrize("n, m, e, chunk", [(37, 120, 5, 16), (8, 10, 3, 1024), (50, 333, 8, 7)])
def test_full_corpus_recall_matches_bruteforce(n, m, e, chunk):
    rng = np.random.default_rng(n + m)
    queries = rng.normal(size=(n, e)).astype(np.float32)
    items = rng.normal(size=(m, e)).astype(np.float32)
    labels = rng.integers(0, m, n)
    labels[: n // 3] = np.argmax(queries[: n // 3] @ items.T, axis=1)  # some certain hits
    ks = tuple(sorted({1, min(5, m), min(10, m), m}))
    got = full_corpus_recall(queries, items, labels, ks, chunk=chunk)
    for k in ks:
        assert got[f"recall@{k}"] == pytest.approx(recall_reference(queries, items, labels, k), abs=1e-12)
    assert got[f"recall@{m}"] == 1.0  # the whole corpus always contains the label


def test_full_corpus_recall_ties_and_errors():
    items = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]], np.float32)
    query = np.array([[1.0, 0.0]], np.float32)  # ties: lower index first, so the top 3 are items 0, 1, 3
    assert full_corpus_recall(query, items, np.array([3]), (2, 3)) == {"recall@2": 0.0, "recall@3": 1.0}
    assert full_corpus_recall(query, items, np.array([1]), (1, 2)) == {"recall@1": 0.0, "recall@2": 1.0}
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 4\]"):
        full_corpus_recall(np.ones((1, 2), np.float32), items, np.zeros(1), (5,))
    with pytest.raises(ValueError, match="queries"):
        full_corpus_recall(np.ones((1, 3), np.float32), items, np.zeros(1), (2,))
    with pytest.raises(ValueError, match="labels of shape"):
        full_corpus_recall(np.ones((2, 2), np.float32), items, np.zeros(3), (2,))


# ------------------------------------------------------------------------------------------ data


def test_data_deterministic_split_across_processes_and_planted_signal():
    cfg = ContextualTwoTowerConfig(**TINY)
    data = SyntheticContextualData(cfg, 256, seed=4)
    a, b = data.batch(3), data.batch(3)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    halves = [data.batch(3, p, 2) for p in range(2)]
    for k in a:
        np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), a[k])
    assert not np.array_equal(data.batch(4)["label_item"], a["label_item"])
    # items, categories and the item metadata agree; padding is -1 after the mask
    m = a["mask"]
    np.testing.assert_array_equal(data.item_category[a["item_ids"][m]], a["item_categories"][m])
    assert np.all(a["item_ids"][~m] == -1) and np.all(m[:, 0])
    np.testing.assert_array_equal(data.item_category[a["label_item"]], a["label_category"])
    # train split: pseudo-context from the label, right about as often as the confidence says
    big = SyntheticContextualData(cfg, 4096, seed=4).batch(0)
    agree = big["context_category"] == big["label_category"]
    assert abs(agree.mean() - big["context_confidence"].mean()) < 0.05
    # eval split: the real context; the label follows the subject's category well above chance
    ev = SyntheticContextualData(cfg, 4096, seed=4).held_out().batch(0)
    has = ev["context_category"] >= 0
    assert 0.05 < 1 - has.mean() < 0.15  # missing_context_rate = 0.1
    assert (ev["context_category"] == ev["label_category"])[has].mean() > 0.4
    assert np.all(ev["context_confidence"][~has] == 0) and np.all(ev["context_hour"] < 24)


def test_eval_batches_carry_the_whole_corpus_once():
    cfg = ContextualTwoTowerConfig(**TINY)
    data = SyntheticContextualData(cfg, 64, seed=0).held_out()
    parts = [data.batch(0, p, 4) for p in range(4)]
    ids = np.concatenate([p["corpus_items"] for p in parts]).reshape(-1)
    cats = np.concatenate([p["corpus_categories"] for p in parts]).reshape(-1)
    assert np.array_equal(np.sort(ids[ids >= 0]), np.arange(cfg.item_rows))
    np.testing.assert_array_equal(cats[ids >= 0], data.item_category[ids[ids >= 0]])
    assert "corpus_items" not in SyntheticContextualData(cfg, 64, seed=0).batch(0)


def test_derive_pseudo_context():
    label = np.array([3, 5, -1, 7])
    cat, conf = derive_pseudo_context(label, np.array([0.9, 0.6, 0.8, 0.5]), np.array([1, 0, 1, 1], bool), 9)
    assert cat.tolist() == [3, 9, -1, 7] and conf.tolist() == pytest.approx([0.9, 0.6, 0.0, 0.5])


# ------------------------------------------------------------------------------------------ checks


def test_ids_and_context_checks_name_the_feature():
    cfg = ContextualTwoTowerConfig(**TINY)
    batch = SyntheticContextualData(cfg, 8, seed=0).batch(0)
    ids = two_tower_ids(cfg, batch)
    assert set(ids) == {"item_ids", "item_categories", "label_item", "label_category", "context_category"}
    assert ids["label_item"].shape == (8, 1) and all(v.dtype == np.int32 for v in ids.values())
    no_ctx = dataclasses.replace(cfg, use_context=False)
    assert "context_category" not in two_tower_ids(no_ctx, batch)
    bad = {
        "context_surface": (np.full(8, 9, np.int32), "context_surface"),
        "context_hour": (np.full(8, 24, np.int32), "context_hour"),
        "context_confidence": (np.full(8, 1.5, np.float32), "context_confidence"),
    }
    for key, (value, word) in bad.items():
        with pytest.raises(ValueError, match=word):
            two_tower_ids(cfg, dict(batch, **{key: value}))
    with pytest.raises(ValueError, match="context_hour"):
        two_tower_ids(cfg, dict(batch, context_hour=np.zeros((8, 2), np.int32)))
    with pytest.raises(ValueError, match="context_confidence"):
        two_tower_ids(cfg, dict(batch, context_confidence=np.full(8, np.nan, np.float32)))
    with pytest.raises(ValueError, match="context_surface"):
        two_tower_ids(cfg, dict(batch, context_surface=np.zeros(8, np.float32)))
    with pytest.raises(ValueError, match="label_item"):
        two_tower_ids(cfg, {k: v for k, v in batch.items() if k != "label_item"})
    with pytest.raises(ValueError, match="max_seq_len"):
        two_tower_ids(cfg, dict(batch, item_ids=np.zeros((8, 9), np.int32), item_categories=np.zeros((8, 9), np.int32)))
    # the embedding engine checks ids against the tables, naming feature and table
    ec = jaxscale.EmbeddingCollection(two_tower_tables(cfg), jaxscale.make_mesh(1, 1, jax.devices()[:1]))
    with pytest.raises(ValueError, match="label_item"):
        ec.validate_ids(two_tower_ids(cfg, dict(batch, label_item=np.full(8, cfg.item_rows, np.int32))))


def test_config_validation_names_fields():
    for field, value in (("context_dropout", 1.0), ("num_heads", 3), ("recall_ks", ()), ("temperature", 0.0)):
        with pytest.raises(ValueError, match=field):
            ContextualTwoTowerConfig(**{**TINY, field: value})
    assert ContextualTwoTowerConfig(head_hidden=[8, 4]).head_hidden == (8, 4)


# ------------------------------------------------------------------------------------------ the model


def fake_lookup(cfg, ids, seed=0):
    """Stands in for EmbeddingCollection.lookup (fixed random rows, zeros on padding)."""
    tables = {
        t.name: np.random.default_rng(seed + i).normal(size=(t.rows, t.dim))
        for i, t in enumerate(two_tower_tables(cfg))
    }
    out = {}
    for t in two_tower_tables(cfg):
        for f in t.features:
            if f in ids:
                x = np.asarray(ids[f])
                out[f] = jnp.asarray(np.where((x >= 0)[..., None], tables[t.name][np.maximum(x, 0)], 0.0), jnp.float32)
    return out


def test_model_structure_and_context_dropout_equals_withheld_context():
    cfg = ContextualTwoTowerConfig(**TINY, context_dropout=0.5, context_dropout_mode="sample")
    model = ContextualTwoTower(cfg, rngs=nnx.Rngs(0))
    assert isinstance(model.encoder, SequenceEncoder)
    host = SyntheticContextualData(cfg, 32, seed=1).held_out().with_options(corpus=False).batch(0)
    emb = fake_lookup(cfg, two_tower_ids(cfg, host))
    held = withhold_context(host)
    emb_held = fake_lookup(cfg, two_tower_ids(cfg, held))
    call = nnx.jit(lambda m, e, b: m(e, b)["query"])
    model.eval()
    with_ctx, without = np.asarray(call(model, emb, host)), np.asarray(call(model, emb_held, held))
    assert np.abs(with_ctx - without).max() > 1e-3  # the context matters
    model.train()
    dropped = np.asarray(call(model, emb, host))  # each row: its context kept, or dropped = withheld
    is_kept = np.all(np.abs(dropped - with_ctx) < 1e-5, axis=1)
    is_dropped = np.all(np.abs(dropped - without) < 1e-5, axis=1)
    assert np.all(is_kept | is_dropped) and 0 < is_dropped.sum() < 32
    again = np.asarray(call(model, emb, host))  # the RNG advances: another mask
    assert not np.array_equal(again, dropped)
    no_ctx = ContextualTwoTower(dataclasses.replace(cfg, use_context=False), rngs=nnx.Rngs(0))
    assert not hasattr(no_ctx.query_head, "context")


def test_loss_updates_the_estimator_only_in_training_and_summarize_ranks_the_corpus():
    cfg = ContextualTwoTowerConfig(**TINY)
    model = ContextualTwoTower(cfg, rngs=nnx.Rngs(0))
    host = SyntheticContextualData(cfg, 32, seed=2).held_out().batch(0)
    emb = fake_lookup(cfg, two_tower_ids(cfg, host))
    loss_fn = nnx.jit(two_tower_loss)
    loss, m = loss_fn(model, emb, host)
    assert np.isfinite(float(loss)) and int(m["logq_estimator_step"]) == 1 and int(model.logq.step[...]) == 1
    loss_fn(model, emb, host)
    assert int(model.logq.step[...]) == 2
    model.eval()
    _, m = loss_fn(model, emb, host)
    assert int(model.logq.step[...]) == 2
    m = jax.tree.map(np.asarray, m)
    assert m["corpus_vectors"].shape == host["corpus_items"].shape + (cfg.embed_dim,)
    got = two_tower_summarize(cfg, [m])
    # reference: every item's vector from its id and category, every query scored against all of them
    items = np.zeros((cfg.item_rows, cfg.embed_dim), np.float32)
    ids = host["corpus_items"].reshape(-1)
    items[ids[ids >= 0]] = m["corpus_vectors"].reshape(-1, cfg.embed_dim)[ids >= 0]
    for k in cfg.recall_ks:
        assert got[f"recall@{k}"] == pytest.approx(recall_reference(m["query"], items, host["label_item"], k))
    with pytest.raises(ValueError, match="exactly once"):
        two_tower_summarize(cfg, [dict(m, corpus_items=np.zeros_like(m["corpus_items"]))])
    assert two_tower_summarize(cfg, [{k: v for k, v in m.items() if not k.startswith("corpus")}]) == {}


def test_marginal_context_dropout_averages_the_losses_with_and_without_context():
    cfg = ContextualTwoTowerConfig(**TINY, context_dropout=0.7, context_dropout_mode="marginal", logq_correction=False)
    model = ContextualTwoTower(cfg, rngs=nnx.Rngs(4))
    host = SyntheticContextualData(cfg, 32, seed=6).batch(0)
    held = withhold_context(host)
    emb, emb_held = fake_lookup(cfg, two_tower_ids(cfg, host)), fake_lookup(cfg, two_tower_ids(cfg, held))
    loss_fn = nnx.jit(two_tower_loss)
    loss, m = loss_fn(model, emb, host)  # training mode: both halves
    model.eval()  # eval mode: the examples' own context only
    with_ctx, _ = loss_fn(model, emb, host)
    without, _ = loss_fn(model, emb_held, held)
    np.testing.assert_allclose(float(m["loss_with_context"]), float(with_ctx), rtol=1e-5)
    np.testing.assert_allclose(float(m["loss_context_missing"]), float(without), rtol=1e-5)
    np.testing.assert_allclose(float(loss), 0.3 * float(with_ctx) + 0.7 * float(without), rtol=1e-5)
    assert abs(float(with_ctx) - float(without)) > 1e-3


def test_parquet_round_trip_of_the_synthetic_requests(tmp_path):
    from jaxscale.training.data import ParquetData, write_parquet_sample
    from jaxscale_models.contextual_two_tower import SPEC

    cfg = ContextualTwoTowerConfig(**TINY)
    data = SyntheticContextualData(cfg, 16, seed=2)
    path = write_parquet_sample(tmp_path / "requests.parquet", data, 32, row_group_size=16)
    columns, seq_len = SPEC.parquet_columns(cfg)
    read = ParquetData(path, columns, batch_size=16, seq_len=seq_len)
    for step in range(2):
        want, got = data.batch(step), read.batch(step)
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
