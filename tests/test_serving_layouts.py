"""Repeated request layouts: the root cuts leaf bodies from a known layout's bytes and the leaf reads a known
layout's inputs as views (`wire.LayoutCache`); both must give exactly what decoding the body gives."""

import json
import urllib.error
import urllib.request

import numpy as np
import pyarrow as pa
import pytest
from serving_helpers import demo_store, running_leaves

from jaxscale.serving import demo, wire
from jaxscale.serving.root import FANOUT_HEADER, LeafAddress, Root, RootConfig
from jaxscale.serving.trim import trim_batch

BATCH = 8
UNIVERSE = demo.feature_universe()
MODELS = {(m.model, m.version): m for m in demo.demo_models(UNIVERSE)}


def request(seed: int, rows: int = BATCH) -> dict[str, np.ndarray]:
    return demo.make_request(UNIVERSE, rows, np.random.default_rng(seed))


def post(url, body):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": wire.MEDIA_TYPE}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def outputs_of(body):
    batch = wire.decode(body)
    return {name: wire.to_numpy(batch, name) for name in batch.schema.names}


# ------------------------------------------------------------------------------------------------------ wire


def test_layout_cache_matches_only_the_same_layout():
    body = wire.encode(request(0))
    cache = wire.LayoutCache()
    assert cache.find(body) is None
    assert cache.learn(body, "seen", wire.decode(body))
    assert cache.find(wire.encode(request(1))) == "seen"  # other values, same layout
    assert cache.find(wire.encode(request(1, rows=5))) is None  # other row count
    other = request(1)
    other.pop(next(iter(other)))
    assert cache.find(wire.encode(other)) is None  # other schema
    assert cache.find(body[:-1]) is None
    assert cache.find(body + b"\0" * 8) is None


def test_batch_body_start_and_view_offsets():
    features = {"x": np.arange(24, dtype=np.float32).reshape(8, 3), "y": np.arange(8, dtype=np.int32)}
    body = wire.encode(features)
    start = wire.batch_body_start(body)
    assert start is not None and 0 < start < len(body) - 8
    batch = wire.decode(body)
    for name, want in features.items():
        array = wire.to_numpy(batch, name)
        offset = wire.view_offset(array, body)
        assert offset is not None and offset >= start
        view = np.frombuffer(body, array.dtype, array.size, offset).reshape(array.shape)
        np.testing.assert_array_equal(view, want)
    assert wire.view_offset(np.zeros(4), body) is None  # not a view of the body
    assert wire.batch_body_start(b"not arrow at all, not arrow at all") is None


def test_compressed_bodies_are_learned_but_never_viewed():
    body = wire.encode({"x": np.arange(4096, dtype=np.float32).reshape(8, 512)}, "zstd")
    array = wire.to_numpy(wire.decode(body), "x")
    assert wire.view_offset(array, body) is None  # decompressed: a copy


# --------------------------------------------------------------------------------------------- root and leaf


@pytest.fixture(scope="module")
def store():
    return demo_store()[0]


@pytest.fixture(scope="module")
def leaves(store):
    with running_leaves(store, MODELS, BATCH) as started:
        yield started


@pytest.fixture(scope="module")
def root(store, leaves):
    addresses = tuple(LeafAddress(m, v, leaf.url) for (m, v), leaf in leaves.items())
    with Root(RootConfig(store, addresses)) as r:  # uncompressed: leaf bodies are cut from the request's bytes
        yield r


def reference_outputs(features):
    out = {}
    for (m, v), model in MODELS.items():
        ref = model.reference(features)
        for name, value in ref.items() if isinstance(ref, dict) else [("output", ref)]:
            out[f"{m}/{v}/{name}"] = value
    return out


@pytest.mark.parametrize("models", ["", "?models=ctr/1", "?models=save/2,hide/1"])
def test_repeated_layouts_answer_what_decoding_answers(root, leaves, models):
    fanouts = []
    for seed in range(4):  # the first request of the layout is decoded, the others take the known layout
        features = request(100 + seed)
        body = wire.encode(features)
        status, headers, answer = post(root.url + "/predict" + models, body)
        assert status == 200, answer
        got, want = outputs_of(answer), reference_outputs(features)
        assert got and set(got) <= set(want)
        for name, value in got.items():
            np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        for (m, v), leaf in leaves.items():  # each leaf, called directly with the same features
            for name, value in leaf.predict(features).items():
                key = f"{m}/{v}/{name}"
                if key in got:
                    assert got[key].tobytes() == value.tobytes(), key
        fanouts.append(json.loads(headers[FANOUT_HEADER]))
        known = root._layouts.find(body)
        assert known is not None and known.recipes and all(r is not None for r in known.recipes.values())
    assert all(f == fanouts[0] for f in fanouts)  # same features and bytes sent, decoded or cut
    for label in fanouts[0]:  # each leaf called read the later requests' inputs as views
        assert leaves[tuple(label.split("/"))]._layouts._entries


def test_cut_leaf_bodies_are_the_encoded_trimmed_batches(root):
    first, later = wire.encode(request(7)), wire.encode(request(8))
    post(root.url + "/predict", first)
    known = root._layouts.find(later)
    assert known is not None
    batch = wire.decode(later)
    _, plans = root._plan(batch, None)
    for plan in plans:
        recipe = known.recipes[plan]
        assert recipe is not None
        assert recipe.apply(later) == wire.encode(trim_batch(batch, plan))


def test_leaf_reads_a_known_layout_as_views(leaves):
    leaf = leaves[("ctr", "1")]
    batch = wire.decode(wire.encode(request(9)))
    plan = leaf._input_plan(batch.schema)
    body = wire.encode(batch.select([i for _, i, _, _ in plan.reads if i is not None]))
    slow = leaf._inputs(wire.decode(body))
    leaf._body_inputs(body)  # learns the layout
    assert leaf._layouts.find(body) is not None
    fast, rows = leaf._body_inputs(body)
    assert rows == BATCH and fast.keys() == slow.keys()
    for name, value in slow.items():
        assert fast[name].dtype == value.dtype and fast[name].shape == value.shape, name
        assert fast[name].tobytes() == value.tobytes(), name


def test_bad_bodies_are_refused_after_a_layout_is_known(root, leaves):
    good = wire.encode(request(11))
    assert post(root.url + "/predict", good)[0] == 200
    status, _, answer = post(root.url + "/predict", b"\xff" * len(good))  # the known length, not a stream
    assert status == 400 and json.loads(answer)["reason"] == "payload"
    missing = request(11)
    missing.pop(next(iter(MODELS.values())).reads[0])
    status, _, answer = post(root.url + "/predict", wire.encode(missing))
    assert status == 400 and json.loads(answer)["reason"] == "missing"
    batch = wire.decode(good)
    reads = set(MODELS[("ctr", "1")].reads)
    name = next(f.name for f in batch.schema if f.name in reads and not pa.types.is_fixed_size_list(f.type))
    column = batch.column(name).to_pylist()
    column[0] = None
    arrays = [pa.array(column, c.type) if n == name else c for n, c in zip(batch.schema.names, batch.columns)]
    status, _, answer = post(
        root.url + "/predict?models=ctr/1", wire.encode(pa.RecordBatch.from_arrays(arrays, names=batch.schema.names))
    )
    assert status == 400 and json.loads(answer)["reason"] == "nulls", answer
