"""Retrieval served (jaxscale.serving.retrieval): the contextual two-tower's online query step exported with its
ANN index as a model version; its signature lists exactly what the step reads; retrieve = state lookup + the
exported step + the index, equal to the offline `OnlineQueryTower` followed by exact or ANN search, directly
and through a leaf and a root over HTTP; a half-written version is never served."""

import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from flax import nnx

from jaxscale.serving import store as store_lib
from jaxscale.serving import wire
from jaxscale.serving.ann import AnnIndex, exact_search
from jaxscale.serving.export import UnusedFeatureError
from jaxscale.serving.retrieval import (
    MANIFEST,
    STATE_FEATURE,
    RetrievalError,
    RetrievalModel,
    RetrievalParts,
    export_retrieval,
    request_signature,
)
from jaxscale.serving.signature import FeatureSpec
from jaxscale_models.contextual_two_tower import ContextualTwoTower, ContextualTwoTowerConfig, two_tower_tables
from jaxscale_models.contextual_two_tower_data import CONTEXT_KEYS, SyntheticContextualData
from jaxscale_models.two_tower_inference import OnlineQueryTower
from jaxscale_models.two_tower_serving import query_features, query_step

TINY = dict(
    item_rows=400,
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
    reserved_rows=2,
)


class DictStates:
    """A `jaxscale.serving.states.StateReader` stand-in: lookup -> (states, found), the default for unknown users."""

    def __init__(self, user_ids, states, default, version=1):
        self.rows = {int(u): np.asarray(s, np.float32) for u, s in zip(user_ids, states)}
        self.default, self.version = np.asarray(default, np.float32), version
        self.dim = self.default.shape[0]

    def lookup(self, user_ids):
        found = np.array([int(u) in self.rows for u in user_ids], bool)
        return np.stack([self.rows.get(int(u), self.default) for u in user_ids]), found


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    cfg = ContextualTwoTowerConfig(**TINY)
    rng = np.random.default_rng(0)  # rows of unit scale, so every user's query is distinct
    tables = {t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in two_tower_tables(cfg)}
    model = ContextualTwoTower(cfg, rngs=nnx.Rngs(0))
    data = SyntheticContextualData(cfg, 16, seed=5).held_out().with_options(corpus=False)
    users = np.concatenate([data.user_ids(s) for s in range(2)])
    states = rng.normal(size=(users.shape[0], cfg.d_model)).astype(np.float32)  # cached encoder states
    table = tables["categories"]
    rows = np.arange(cfg.reserved_rows, cfg.item_rows)
    vectors = np.asarray(model.item_vectors(tables["items"][rows], table[data.item_category[rows]]))
    item_ids = rows * 3 + 1000  # served ids are not rows
    parts = RetrievalParts(item_ids, vectors, query_step(model, table), query_features(model))
    online = OnlineQueryTower(model, table)
    reader = DictStates(users, states, default=np.full(cfg.d_model, 0.1, np.float32))
    context = {k: np.concatenate([data.batch(s)[k] for s in range(2)]) for k in CONTEXT_KEYS}
    context["context_category"][:3] = -1  # some requests without a subject
    context["context_confidence"][:3] = 0.0
    store = tmp_path_factory.mktemp("models")
    versions = {}
    for kind in ("flat", "hnsw"):
        index = AnnIndex.build(item_ids, vectors, kind=kind, provenance={"model_version": "tiny/step-0"})
        export_retrieval(parts, index, store=store, model="tt", version=kind)
        versions[kind] = index
    return dict(
        cfg=cfg, model=model, online=online, reader=reader, users=users, states=states, context=context,
        parts=parts, store=store, indexes=versions, item_ids=item_ids, vectors=vectors,
    )  # fmt: skip


def offline(world, kind, users, context, k):
    """The reference: the hybrid path of two_tower_inference, then the index (or exact search)."""
    states, _ = world["reader"].lookup(users)
    queries = world["online"](states, context)
    if kind == "exact":
        ids, vectors = world["indexes"]["flat"].vectors()
        return exact_search(queries, ids, vectors, k)
    return world["indexes"][kind].search(queries, k)


def test_signature_lists_exactly_the_features_the_step_reads(world):
    sig = RetrievalModel(world["store"], "tt", "flat").signature
    assert sig.feature_names == (STATE_FEATURE, *CONTEXT_KEYS) and sig.unused == ()
    assert sig.spec(STATE_FEATURE) == FeatureSpec(STATE_FEATURE, "float32", (world["cfg"].d_model,))
    assert [(o.name, o.shape) for o in sig.outputs] == [("query", (world["cfg"].embed_dim,))]
    assert request_signature(sig).required == ("user_id", *CONTEXT_KEYS)
    # declaring a feature the step does not read is refused: the signature cannot over-list
    parts = world["parts"]
    extra = RetrievalParts(
        parts.item_ids, parts.item_vectors, parts.query_fn, (*parts.features, FeatureSpec("x", "int32"))
    )
    with pytest.raises(UnusedFeatureError, match=r"\['x'\]"):
        export_retrieval(extra, world["indexes"]["flat"], store=world["store"], model="tt", version="extra")
    assert not store_lib.signature_path(world["store"], "tt", "extra").exists()
    # a model without a context layer reads the state only
    plain = ContextualTwoTower(ContextualTwoTowerConfig(**TINY, use_context=False), rngs=nnx.Rngs(1))
    assert [f.name for f in query_features(plain)] == [STATE_FEATURE]


def test_exported_step_equals_the_online_query_tower(world):
    served = RetrievalModel(world["store"], "tt", "hnsw")
    for rows in (slice(0, 5), slice(0, 32)):  # 5 rows: padded to a bucket inside
        states = world["states"][rows]
        context = {k: v[rows] for k, v in world["context"].items()}
        want = world["online"](states, context)
        np.testing.assert_allclose(served.query(states, context), want, atol=1e-5)
    assert np.abs(want[1:] - want[:1]).max() > 1e-2  # distinct queries: the comparison has teeth


@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_retrieve_equals_offline_hybrid_inference_and_search(world, kind):
    served = RetrievalModel(world["store"], "tt", kind)
    users = np.concatenate([world["users"][:20], [987654321]])  # the last user has no state: the default
    context = {k: np.concatenate([v[:20], v[:1]]) for k, v in world["context"].items()}
    result = served.retrieve(world["reader"], {"user_id": users, **context}, k=10)
    ids, scores = offline(world, kind, users, context, 10)
    np.testing.assert_array_equal(result.item_ids, ids)
    np.testing.assert_allclose(result.scores, scores, atol=1e-5)
    assert result.state_found.tolist() == [True] * 20 + [False]
    assert set(result.timings_ms) == {"state_lookup", "online_step", "ann", "total"}
    exact_ids, _ = offline(world, "exact", users, context, 10)
    hits = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(result.item_ids, exact_ids)])
    assert hits >= 0.95 if kind == "hnsw" else hits == 1.0


def test_a_half_written_or_mismatched_version_is_never_served(world, tmp_path):
    parts, index = world["parts"], world["indexes"]["flat"]
    export_retrieval(parts, index, store=tmp_path, model="tt", version="1")
    RetrievalModel(tmp_path, "tt", "1")
    vdir = store_lib.version_dir(tmp_path, "tt", "1")
    meta = json.loads((vdir / "index" / "index.json").read_text())
    faiss_file = vdir / "index" / meta["index_file"]
    data = faiss_file.read_bytes()
    faiss_file.write_bytes(data[:-100])  # torn index file
    with pytest.raises(RetrievalError, match="half-written"):
        RetrievalModel(tmp_path, "tt", "1")
    faiss_file.write_bytes(data)
    # another (complete) index dropped into the version: not the one exported with the step
    world["indexes"]["hnsw"].save(vdir / "index")
    with pytest.raises(RetrievalError, match="not the one exported with it"):
        RetrievalModel(tmp_path, "tt", "1")
    (vdir / MANIFEST).unlink()
    with pytest.raises(RetrievalError, match="no retrieval.json"):
        RetrievalModel(tmp_path, "tt", "1")
    with pytest.raises(FileExistsError, match="immutable"):
        export_retrieval(parts, index, store=tmp_path, model="tt", version="1")


def post(url, body, content_type="application/json"):
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def publish_states(root, reader: DictStates, publication: int, model_version="tiny/step-0", published_at_ms=0):
    """A state publication in `jaxscale.serving.states`' on-disk format (what its builder writes): a version file,
    then the CURRENT pointer, so the leaf reads it with the real `StateReader`."""
    import pyarrow as pa

    from jaxscale.infra import atomic
    from jaxscale.serving import states as states_lib

    ids = np.array(sorted(reader.rows), np.int64)
    values = np.stack([reader.rows[int(u)] for u in ids]).astype(np.float32)
    n, d = values.shape
    schema = pa.schema(
        [("user_id", pa.int64()), ("state", pa.list_(pa.float32(), d)), ("state_time", pa.int64()),
         ("ingest_time", pa.int64()), ("events", pa.int64()), ("digest", pa.uint64())],
        metadata={"format": states_lib.STATE_FORMAT, "version": model_version, "d_model": str(d),
                  "publication": str(publication), "published_at_ms": str(published_at_ms),
                  "default_state": json.dumps([float(x) for x in reader.default])},
    )  # fmt: skip
    zeros = pa.array(np.zeros(n, np.int64))
    table = pa.table(
        [pa.array(ids), pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), d), zeros, zeros, zeros,
         pa.array(np.zeros(n, np.uint64))],
        schema=schema,
    )  # fmt: skip
    name = states_lib.version_file(publication)
    with atomic.replacing(root / name) as tmp, pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
        w.write_table(table)
    pointer = {"format": states_lib.POINTER_FORMAT, "version": publication, "file": name, "published_at_ms": 0,
               "model_version": model_version, "users": n}  # fmt: skip
    atomic.write_json(root / states_lib.POINTER, pointer)


def test_retrieve_through_a_leaf_and_a_root_equals_offline(world, tmp_path):
    from jaxscale.serving import Leaf, LeafAddress, LeafConfig, Root, RootConfig

    users = np.concatenate([world["users"][:12], [987654321]])
    context = {k: np.concatenate([v[:12], v[:1]]) for k, v in world["context"].items()}
    want_ids, want_scores = offline(world, "hnsw", users, context, 7)
    inputs = {"user_id": users.tolist(), **{k: v.tolist() for k, v in context.items()}}
    extra = {f"other_{i}": np.arange(13, dtype=np.float32).tolist() for i in range(20)}  # for models not ours
    request = {"k": 7, "inputs": {**inputs, **extra}}

    def check(status, headers, body):
        assert status == 200, body
        out = json.loads(body)
        np.testing.assert_array_equal(out["item_ids"], want_ids)
        np.testing.assert_allclose(out["scores"], want_scores, atol=1e-5)
        assert out["state_found"] == [True] * 12 + [False] and out["k"] == 7
        assert set(json.loads(headers["X-Jaxscale-Timings"])) == {"state_lookup", "online_step", "ann", "total"}

    (tmp_path / "states").mkdir()
    publish_states(tmp_path / "states", world["reader"], 1)
    config = LeafConfig(world["store"], "tt", "hnsw", states=tmp_path / "states", states_watch_s=0.05)
    with Leaf(config) as leaf:  # the real StateReader over a published state directory
        url = f"{leaf.url}/v1/models/tt:retrieve"
        check(*post(url, request))
        # Arrow IPC in, Arrow IPC out
        arrow = {"user_id": users, **{k: v.astype(np.float32 if k == "context_confidence" else np.int32)
                                      for k, v in context.items()}}  # fmt: skip
        status, headers, body = post(f"{url}?k=7", wire.encode(arrow), wire.MEDIA_TYPE)
        assert status == 200, body
        out = wire.decode(body)
        np.testing.assert_array_equal(wire.to_numpy(out, "item_ids"), want_ids)
        np.testing.assert_allclose(wire.to_numpy(out, "scores"), want_scores, atol=1e-5)
        # a bad request names the feature
        status, _, body = post(url, {"k": 7, "inputs": {k: v for k, v in inputs.items() if k != "context_hour"}})
        assert status == 400 and json.loads(body)["feature"] == "context_hour"
        status, _, body = post(url, {"k": 0, "inputs": inputs})
        assert status == 400 and json.loads(body)["reason"] == "k"
        assert post(f"{leaf.url}/v1/models/other:retrieve", request)[0] == 404

        address = (LeafAddress("tt", "hnsw", leaf.url),)
        sent = {}
        for trim in (True, False):
            with Root(RootConfig(world["store"], address, trim=trim)) as root:
                status, headers, body = post(f"{root.url}/v1/models/tt:retrieve", request)
                check(status, headers, body)
                fanout = json.loads(headers["X-Jaxscale-Fanout"])["tt/hnsw"]
                sent[trim] = fanout
                assert fanout["fail_open"] is None and root.fail_open_count() == 0
                # Arrow IPC through the root: trimmed by column selection
                extra_cols = {f"other_{i}": np.arange(13, dtype=np.float32) for i in range(20)}
                status, headers, body = post(
                    f"{root.url}/v1/models/tt:retrieve?k=7", wire.encode({**arrow, **extra_cols}), wire.MEDIA_TYPE
                )
                assert status == 200, body
                np.testing.assert_array_equal(wire.to_numpy(wire.decode(body), "item_ids"), want_ids)
                assert json.loads(headers["X-Jaxscale-Fanout"])["tt/hnsw"]["features"] == (5 if trim else 25)
                assert post(f"{root.url}/v1/models/nope:retrieve", request)[0] == 404
                # checked at the root, before the leaf is called
                bad = {"k": 7, "inputs": {k: v for k, v in inputs.items() if k != "context_surface"}}
                status, _, body = post(f"{root.url}/v1/models/tt:retrieve", bad)
                assert status == 400 and json.loads(body)["feature"] == "context_surface"
        assert sent[True]["features"] == 5 and sent[False]["features"] == 25
        assert sent[True]["bytes"] < sent[False]["bytes"] / 2

        # the root's store has no signature for the version: it fails open, the leaf still answers right
        with Root(RootConfig(tmp_path / "no-signatures", address)) as root:
            status, headers, body = post(f"{root.url}/v1/models/tt:retrieve", request)
            check(status, headers, body)
            assert json.loads(headers["X-Jaxscale-Fanout"])["tt/hnsw"] == {
                "features": 25, "bytes": len(json.dumps(request).encode()), "fail_open": "missing"
            }  # fmt: skip
            assert root.fail_open_count() == 1

        # a new state publication is followed: user 0's new state gives user 0's new answer
        newer = DictStates(world["users"], world["states"], world["reader"].default)
        newer.rows[int(users[0])] = world["states"][5] * -1.0
        publish_states(tmp_path / "states", newer, 2)
        one = {"k": 7, "inputs": {k: v[:1] for k, v in inputs.items()}}
        states, _ = newer.lookup(users[:1])
        want_new = world["indexes"]["hnsw"].search(world["online"](states, {k: v[:1] for k, v in context.items()}), 7)
        deadline = time.monotonic() + 30
        while True:
            out = json.loads(post(url, one)[2])
            if out["state_version"] == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert out["state_version"] == 2 and out["item_ids"] == want_new[0].tolist()
        assert out["item_ids"] != want_ids[:1].tolist()


@pytest.mark.slow
def test_cli_builds_the_index_and_exports_a_trained_checkpoint(tmp_path):
    import re
    import subprocess
    import sys

    from conftest import ROOT, subprocess_env

    smoke = str(ROOT / "jaxscale" / "configs" / "two_tower_smoke.yaml")
    tiny = [f"model.contextual_two_tower.{k}={v}" for k, v in TINY.items() if k != "reserved_rows"]
    tiny = [t.replace("(", "[").replace(",)", "]").replace(")", "]") for t in tiny]
    tiny += ["train.batch_size=64", "train.eval_every=0", "data.eval_batches=2", "embedding.capacity_factor=2.0"]
    run = tmp_path / "run"

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", *args], env=subprocess_env(), cwd=ROOT, capture_output=True,
                           text=True, timeout=900)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout

    cli("jaxscale.train", "--config", smoke, "--no-progress", *tiny, "train.steps=4", "train.checkpoint_every=4",
        f"train.workdir={run}")  # fmt: skip
    model_args = ["--config", smoke, "--checkpoint", str(run), *tiny]
    # the command: the config is the one saved with the checkpoint
    out = cli(
        "jaxscale.serving",
        "build-index",
        "--checkpoint",
        str(run),
        "--out",
        str(tmp_path / "index"),
        "--queries",
        "200",
    )
    recall = float(re.search(r"recall@10 vs exact search: ([\d.]+) on 200 queries", out).group(1))
    assert recall >= 0.95 and re.search(r"latency index: median [\d.]+ ms, p99 [\d.]+ ms per batch of 1", out)
    index = AnnIndex.load(tmp_path / "index", expect={"model_version": "run/step-4"})
    assert len(index) == TINY["item_rows"] and index.meta["recall"]["recall@10"] == recall
    out = cli("jaxscale.serving", "export-retrieval", *model_args, "--index", str(tmp_path / "index"),
              "--store", str(tmp_path / "models"), "--model", "tt", "--version", "1")  # fmt: skip
    assert "query step reads ['encoder_state', 'context_category'" in out
    served = RetrievalModel(tmp_path / "models", "tt", "1")
    assert served.model_version == "run/step-4" and served.index.meta["index_sha256"] == index.meta["index_sha256"]


# ------------------------------------------------------------------------------------- hostile input (issue 35)


def test_retrieve_routes_refuse_compression_bombs_and_deep_json(world):
    """Both retrieve routes (leaf and root): a compression bomb is 413 naming the limit, refused from the IPC
    metadata (nothing decompressed); a JSON body 100k deep is 400 naming max_json_depth (it was a 500 with a
    traceback); a JSON body with more rows than max_rows is 413 (passed on by the root)."""
    import pyarrow as pa

    from jaxscale.infra.http_server import ServerConfig
    from jaxscale.serving import Leaf, LeafAddress, LeafConfig, Root, RootConfig

    bomb = wire.encode({"user_id": np.zeros(64_000_000, np.int64)}, "zstd")  # 8 KB -> 512 MB
    deep = b"[" * 100_000 + b"]" * 100_000
    nested = b'{"k": 3, "inputs": {"user_id": ' + deep + b"}}"
    rows = {"k": 3, "inputs": {"user_id": list(range(1001)), **{k: [0] * 1001 for k in world["context"]}}}
    config = LeafConfig(world["store"], "tt", "hnsw", server=ServerConfig(max_rows=1000))
    with Leaf(config, states=world["reader"]) as leaf:
        with Root(RootConfig(world["store"], (LeafAddress("tt", "hnsw", leaf.url),))) as root:
            for url in (leaf.url, root.url):
                allocated = pa.total_allocated_bytes()
                status, _, body = post(f"{url}/v1/models/tt:retrieve", bomb, wire.MEDIA_TYPE)
                assert status == 413 and json.loads(body)["limit"] == "max_rows", body
                assert pa.total_allocated_bytes() - allocated < 16 << 20
                for text in (deep, nested):
                    status, _, body = post(f"{url}/v1/models/tt:retrieve", text)
                    assert status == 400 and "over the limit of 64 (max_json_depth)" in json.loads(body)["error"]
                status, _, body = post(f"{url}/v1/models/tt:retrieve", rows)
                assert status == 413 and "1001 rows, over the limit of 1000" in json.loads(body)["error"], body


def test_retrieve_never_answers_unfilled_ids(world, tmp_path):
    """An IVF index probing 1 of 10 cells finds fewer than k items: faiss fills the rest with id -1, which is
    never answered; ``found`` says how many each row has (JSON and Arrow)."""
    from jaxscale.serving import Leaf, LeafConfig
    from jaxscale.serving.ann import AnnParams

    params = AnnParams(kind="ivf", nlist=10, nprobe=1, min_recall=0.0, tune=False)
    index = AnnIndex.build(world["item_ids"], world["vectors"], params=params, provenance={"model_version": "t"})
    export_retrieval(world["parts"], index, store=tmp_path, model="tt", version="ivf")
    users = world["users"][:4]
    context = {k: v[:4] for k, v in world["context"].items()}
    k = len(world["item_ids"])
    raw, _ = index.search(world["online"](world["reader"].lookup(users)[0], context), k)
    assert (raw == -1).any()  # the case: fewer than k found
    with Leaf(LeafConfig(tmp_path, "tt", "ivf"), states=world["reader"]) as leaf:
        url = f"{leaf.url}/v1/models/tt:retrieve"
        request = {"k": k, "inputs": {"user_id": users.tolist(), **{n: v.tolist() for n, v in context.items()}}}
        status, _, body = post(url, request)
        assert status == 200, body
        out = json.loads(body)
        assert out["found"] == (raw != -1).sum(axis=1).tolist() and max(out["found"]) < k
        for ids, scores, want, n in zip(out["item_ids"], out["scores"], raw, out["found"]):
            assert -1 not in ids and len(ids) == len(scores) == n and ids == want[:n].tolist()
        arrow = {"user_id": users, **{n: v.astype(np.float32 if n == "context_confidence" else np.int32)
                                      for n, v in context.items()}}  # fmt: skip
        status, _, body = post(f"{url}?k={k}", wire.encode(arrow), wire.MEDIA_TYPE)
        assert status == 200, body
        answer = wire.decode(body).to_pydict()
        assert answer["found"] == out["found"] and answer["item_ids"] == out["item_ids"]


def test_healthz_answers_while_the_root_parses_a_large_json_body(world):
    """A large JSON retrieve body (tens of MB) is parsed off the event loop, in a thread that lets the loop run:
    /healthz, asked by another process during the parse, keeps answering promptly (it stalled for the
    whole parse when the root parsed on the loop)."""

    from serving_helpers import healthz_during

    from jaxscale.serving import LeafAddress, Root, RootConfig

    n = 2_500_000
    body = b'{"k": 3, "inputs": {"user_id": [' + ",".join(map(str, range(n))).encode() + b"]}}"
    with Root(RootConfig(world["store"], (LeafAddress("tt", "hnsw", "http://127.0.0.1:9"),))) as root:
        during, took, (status, _, answer) = healthz_during(
            root.url, lambda: post(f"{root.url}/v1/models/tt:retrieve", body)
        )
    # the body is parsed (then refused: it lacks the context features): the parse happened
    assert status == 400 and json.loads(answer)["feature"] != "user_id"
    assert len(during) >= 5 and max(during) < max(0.25, took / 4), (took, len(during), sorted(during)[-5:])


def wait_for(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def get_status(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_state_publication_of_another_model_version_is_refused(world, tmp_path, caplog):
    """Same width, another model: served, it gives wrong answers and no error. The leaf refuses it (the previous
    states stay served; a metric and a log line say why) and follows the next publication of its own version."""
    from jaxscale.serving import Leaf, LeafConfig

    users, context = world["users"][:3], {k: v[:3] for k, v in world["context"].items()}
    request = {"k": 5, "inputs": {"user_id": users.tolist(), **{k: v.tolist() for k, v in context.items()}}}
    states = tmp_path / "states"
    states.mkdir()
    publish_states(states, world["reader"], 1)
    config = LeafConfig(world["store"], "tt", "hnsw", states=states, states_watch_s=0.05)
    with caplog.at_level("WARNING", logger="jaxscale.serving.leaf"), Leaf(config) as leaf:
        url = f"{leaf.url}/v1/models/tt:retrieve"
        first = json.loads(post(url, request)[2])
        assert first["state_version"] == 1
        other = DictStates(world["users"], -world["states"], world["reader"].default)  # same width, other model
        publish_states(states, other, 2, model_version="tiny/step-9")
        assert wait_for(lambda: leaf.metrics.value("state_publications_refused", model_version="tiny/step-9") == 1)
        again = json.loads(post(url, request)[2])
        assert again["state_version"] == 1 and again["item_ids"] == first["item_ids"]
        assert any("refused state publication 2" in r.getMessage() and "tiny/step-9" in r.getMessage()
                   for r in caplog.records)  # fmt: skip
        assert get_status(f"{leaf.url}/readyz")[0] == 200  # still serving its own version's states
        newer = DictStates(world["users"], world["states"] * 2, world["reader"].default)
        publish_states(states, newer, 3)
        assert wait_for(lambda: json.loads(post(url, request)[2])["state_version"] == 3)


def test_a_leaf_without_states_of_its_model_version_is_live_but_not_ready(world, tmp_path):
    from jaxscale.serving import Leaf, LeafConfig

    states = tmp_path / "states"
    states.mkdir()
    request = {"k": 5, "inputs": {"user_id": world["users"][:2].tolist(),
                                  **{k: v[:2].tolist() for k, v in world["context"].items()}}}  # fmt: skip
    config = LeafConfig(world["store"], "tt", "hnsw", states=states, states_watch_s=0.05)
    with Leaf(config) as leaf:  # nothing published yet
        status, body = get_status(f"{leaf.url}/readyz")
        assert status == 503 and "tiny/step-0" in body["reasons"][0]
        publish_states(states, world["reader"], 1, model_version="tiny/step-9")  # only another model's
        assert wait_for(lambda: leaf.metrics.value("state_publications_refused", model_version="tiny/step-9") == 1)
        assert get_status(f"{leaf.url}/healthz")[0] == 200  # live
        status, body = get_status(f"{leaf.url}/readyz")
        assert status == 503 and "tiny/step-0" in body["reasons"][0]
        status, headers, answer = post(f"{leaf.url}/v1/models/tt:retrieve", request)
        assert status == 503 and json.loads(answer)["reason"] == "states_not_ready" and "Retry-After" in headers
        publish_states(states, world["reader"], 2)
        assert wait_for(lambda: get_status(f"{leaf.url}/readyz")[0] == 200)
        status, _, answer = post(f"{leaf.url}/v1/models/tt:retrieve", request)
        assert status == 200 and json.loads(answer)["state_version"] == 2
    # a reader passed in holding another model version's states: refused per request too
    other = DictStates(world["users"], world["states"], world["reader"].default)
    other.model_version = "tiny/step-9"
    with Leaf(LeafConfig(world["store"], "tt", "hnsw"), states=other) as leaf:
        status, _, answer = post(f"{leaf.url}/v1/models/tt:retrieve", request)
        assert status == 503 and "tiny/step-9" in json.loads(answer)["error"]
        assert get_status(f"{leaf.url}/readyz")[0] == 503


def test_export_retrieval_checks_the_index_provenance_like_the_cli(world, tmp_path):
    index = world["indexes"]["flat"]  # built from tiny/step-0
    with pytest.raises(ValueError, match="built from model version 'tiny/step-0'.*'tiny/step-9'"):
        export_retrieval(world["parts"], index, store=tmp_path, model="tt", version="1",
                         provenance={"model_version": "tiny/step-9"})  # fmt: skip
    assert not store_lib.signature_path(tmp_path, "tt", "1").exists()
    export_retrieval(world["parts"], index, store=tmp_path, model="tt", version="1",
                     provenance={"model_version": "tiny/step-0", "checkpoint": "c"})  # fmt: skip


def test_a_leaf_serving_old_states_is_not_ready(world, tmp_path):
    """--max-state-age: /readyz says 503 while the publication served is older than the bound (retrieve still
    answers); a fresh publication makes the leaf ready."""
    from jaxscale.serving import Leaf, LeafConfig

    states = tmp_path / "states"
    states.mkdir()
    publish_states(states, world["reader"], 1)  # published at epoch 0
    config = LeafConfig(world["store"], "tt", "hnsw", states=states, states_watch_s=0.05, max_state_age_s=600)
    with Leaf(config) as leaf:
        status, body = get_status(f"{leaf.url}/readyz")
        assert status == 503 and "max_state_age_s=600" in body["reasons"][0]
        publish_states(states, world["reader"], 2, published_at_ms=int(time.time() * 1000))
        assert wait_for(lambda: get_status(f"{leaf.url}/readyz")[0] == 200)
        assert leaf.metrics.value("states_ready") == 1
