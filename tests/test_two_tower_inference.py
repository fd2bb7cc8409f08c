"""Hybrid inference: the cached encoder state + the online context layer and head equal the end-to-end forward
(tables sharded over a 2x4 mesh); the user-keyed state store round-trips, is written atomically and refuses
what it cannot serve."""

import dataclasses
import os

import jax
import numpy as np
import pytest
from flax import nnx

import jaxscale
from jaxscale.serving.states import EncoderStateStore
from jaxscale_models.contextual_two_tower import ContextualTwoTower, ContextualTwoTowerConfig, two_tower_tables
from jaxscale_models.contextual_two_tower_data import SyntheticContextualData
from jaxscale_models.two_tower_inference import (
    CorpusEncoder,
    EndToEndQueryTower,
    OfflineEncoder,
    OnlineQueryTower,
    build_state_store,
)

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
)


def _collection(cfg, mesh, seed=0):
    ec = jaxscale.EmbeddingCollection(two_tower_tables(cfg), mesh, jaxscale.EmbeddingSettings(sharding="row_wise"))
    rng = np.random.default_rng(seed)  # rows of unit scale, so every user's query is distinct
    return ec, ec.from_dense({t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in ec.tables})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cfg = ContextualTwoTowerConfig(**TINY)
    ec, emb_state = _collection(cfg, jaxscale.make_mesh(2, 4))
    model = ContextualTwoTower(cfg, rngs=nnx.Rngs(0))
    data = SyntheticContextualData(cfg, 16, seed=5).held_out().with_options(corpus=False)
    path = tmp_path_factory.mktemp("store") / "states.arrow"
    store = build_state_store(
        path, OfflineEncoder(model, ec, emb_state), [(data.user_ids(s), data.batch(s)) for s in range(3)], version="v1"
    )
    return cfg, model, ec, emb_state, data, store


def test_online_from_cached_state_equals_end_to_end(served):
    cfg, model, ec, emb_state, data, store = served
    assert len(store) == 48 and store.dim == cfg.d_model
    online = OnlineQueryTower.from_collection(model, ec, emb_state, store)
    e2e = EndToEndQueryTower(model, ec, emb_state)
    for step in (0, 2):
        batch = data.batch(step)
        want = e2e(batch)
        got = online.for_users(data.user_ids(step), batch)
        assert got.shape == (16, cfg.embed_dim)
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert np.abs(want[1:] - want[:1]).max() > 1e-2  # distinct queries: the comparison has teeth
    # 5 requests (not a multiple of the 8 devices; padded inside), users in another order
    batch = {k: v[[9, 3, 14, 0, 7]] for k, v in data.batch(1).items()}
    np.testing.assert_allclose(online.for_users(data.user_ids(1)[[9, 3, 14, 0, 7]], batch), e2e(batch), atol=1e-5)
    # the context matters online too: another context, another query
    other = dict(batch, context_hour=(batch["context_hour"] + 6) % 24)
    assert np.abs(online(store.get(data.user_ids(1)[[9, 3, 14, 0, 7]]), other) - e2e(batch)).max() > 1e-3


def test_context_free_model_online_equals_end_to_end(served):
    cfg, _, ec, emb_state, data, _ = served
    model = ContextualTwoTower(dataclasses.replace(cfg, use_context=False), rngs=nnx.Rngs(1))
    batch = data.batch(0)
    states = OfflineEncoder(model, ec, emb_state)(batch)
    online = OnlineQueryTower.from_collection(model, ec, emb_state)
    np.testing.assert_allclose(online(states, {}), EndToEndQueryTower(model, ec, emb_state)(batch), atol=1e-5)


def test_corpus_encoder_matches_the_item_tower(served):
    cfg, model, ec, emb_state, data, _ = served
    corpus = CorpusEncoder(model, ec, emb_state, rows_per_call=128)(data.item_category)
    tables = ec.to_dense(emb_state)
    want = model.item_vectors(tables["items"], tables["categories"][data.item_category])
    np.testing.assert_allclose(corpus, np.asarray(want), atol=1e-5)
    with pytest.raises(ValueError, match="item_categories"):
        CorpusEncoder(model, ec, emb_state)(data.item_category[:-1])


def test_online_rejects_bad_requests_naming_the_feature(served):
    cfg, model, ec, emb_state, data, store = served
    online = OnlineQueryTower.from_collection(model, ec, emb_state, store)
    batch, users = data.batch(0), data.user_ids(0)
    for key, value in (
        ("context_hour", np.full(16, 30, np.int32)),
        ("context_surface", np.full(16, -2, np.int32)),
        ("context_category", np.full(16, cfg.num_categories, np.int32)),
        ("context_confidence", np.full(16, -0.5, np.float32)),
        ("context_hour", np.zeros(3, np.int32)),
    ):
        with pytest.raises(ValueError, match=key):
            online.for_users(users, dict(batch, **{key: value}))
    with pytest.raises(ValueError, match="context_surface"):
        online.for_users(users, {k: v for k, v in batch.items() if k != "context_surface"})
    with pytest.raises(ValueError, match="states must be"):
        online(np.zeros((2, cfg.d_model + 1), np.float32), batch)
    with pytest.raises(KeyError, match="123"):
        online.for_users(np.array([users[0], 123]), {k: v[:2] for k, v in batch.items()})
    with pytest.raises(ValueError, match="no store"):
        OnlineQueryTower.from_collection(model, ec, emb_state).for_users(users, batch)
    with pytest.raises(ValueError, match="category_table"):
        OnlineQueryTower(model, np.zeros((cfg.num_categories + 1, cfg.item_dim)))


def test_store_round_trip_atomic_writes_and_refusals(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.permutation(1000)[:50].astype(np.int64) * 7919
    states = rng.normal(size=(50, 6)).astype(np.float32)
    path = tmp_path / "s.arrow"
    store = EncoderStateStore.write(path, ids, states, version="m1")
    assert len(store) == 50 and store.version == "m1" and np.all(np.diff(store.user_ids) > 0)
    order = rng.permutation(50)
    np.testing.assert_array_equal(EncoderStateStore.open(path, version="m1").get(ids[order]), states[order])
    got, found = store.lookup(np.array([ids[3], -5, ids[7]]))
    assert found.tolist() == [True, False, True] and np.array_equal(got[1], np.zeros(6))
    with pytest.raises(KeyError, match="-5"):
        store.get([ids[0], -5])
    with pytest.raises(ValueError, match="version 'm1'"):
        EncoderStateStore.open(path, version="m2")
    # refused writes leave the existing store intact and no temporary file behind
    for bad_ids, bad_states, word in (
        (np.array([1, 2, 2]), np.zeros((3, 6)), "user id 2"),
        (np.array([1, 2]), np.array([[0.0] * 6, [np.nan] * 6]), "user 2"),
        (np.array([1, 2]), np.zeros((3, 6)), "states must be"),
        (np.array([1.5, 2.0]), np.zeros((2, 6)), "integer"),
    ):
        with pytest.raises(ValueError, match=word):
            EncoderStateStore.write(path, bad_ids, bad_states, version="m3")
    with pytest.raises(ValueError, match="version"):
        EncoderStateStore.write(path, ids, states, version="")
    np.testing.assert_array_equal(EncoderStateStore.open(path).get(ids), states)
    assert sorted(os.listdir(tmp_path)) == ["s.arrow"]
    # an overwrite replaces it whole
    EncoderStateStore.write(path, ids[:5], states[:5] + 1, version="m4")
    assert len(EncoderStateStore.open(path, version="m4")) == 5
    # files that are not stores
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(ValueError, match="junk.arrow"):
        EncoderStateStore.open(tmp_path / "junk.arrow")
    import pyarrow as pa

    with (
        pa.OSFile(str(tmp_path / "other.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, pa.schema([("x", pa.int64())])) as w,
    ):
        w.write_table(pa.table({"x": [1, 2]}))
    with pytest.raises(ValueError, match="not an encoder-state store"):
        EncoderStateStore.open(tmp_path / "other.arrow")
    with pytest.raises(ValueError, match="missing.arrow"):
        EncoderStateStore.open(tmp_path / "missing.arrow")


def test_online_step_runs_on_one_device_from_a_store_built_on_eight(served, tmp_path):
    """A serving host: one device, the store file and a dense category table; no embedding collection."""
    cfg, model, ec, emb_state, data, store = served
    table = ec.to_dense(emb_state)["categories"]
    one = jaxscale.make_mesh(1, 1, devices=jax.devices()[:1])
    ec1, emb1 = _collection(cfg, one)  # the same tables (same seed) on one device: the end-to-end reference
    online = OnlineQueryTower(model, table, EncoderStateStore.open(store.path, version="v1"))
    batch = data.batch(1)
    np.testing.assert_allclose(
        online.for_users(data.user_ids(1), batch), EndToEndQueryTower(model, ec1, emb1)(batch), atol=1e-5
    )
