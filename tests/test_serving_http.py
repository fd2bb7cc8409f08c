"""Feature trimmer over real HTTP on 127.0.0.1: six leaf servers (3 models x 2 versions), roots that trim or
not, a real client (urllib). Outputs are compared bit for bit and against the models' NumPy reference."""

import json
import shutil
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import demo_store, running_leaves

from jaxscale.serving import demo, wire
from jaxscale.serving import store as store_lib
from jaxscale.serving.root import FANOUT_HEADER, GENERATION_HEADER, LeafAddress, Root, RootConfig
from jaxscale.serving.signature import Signature

BATCH = 8
UNIVERSE = demo.feature_universe()
MODELS = {(m.model, m.version): m for m in demo.demo_models(UNIVERSE)}
REQUEST = demo.make_request(UNIVERSE, BATCH, np.random.default_rng(42))
BODY = wire.encode(REQUEST)


def post(url, body, content_type=wire.MEDIA_TYPE):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def get(url):
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()


@pytest.fixture(scope="module")
def store():
    return demo_store()[0]


@pytest.fixture(scope="module")
def leaves(store):
    with running_leaves(store, MODELS, BATCH) as started:
        yield started


def addresses(leaves):
    return tuple(LeafAddress(m, v, leaf.url) for (m, v), leaf in leaves.items())


@pytest.fixture(scope="module")
def root(store, leaves):
    with Root(RootConfig(store, addresses(leaves), compression="zstd")) as r:
        yield r


@pytest.fixture(scope="module")
def untrimmed_root(store, leaves):
    with Root(RootConfig(store, addresses(leaves), trim=False)) as r:
        yield r


def outputs_of(body):
    batch = wire.decode(body)
    return {name: wire.to_numpy(batch, name) for name in batch.schema.names}


def reference_outputs(request):
    out = {}
    for (m, v), model in MODELS.items():
        ref = model.reference(request)
        for name, value in ref.items() if isinstance(ref, dict) else [("output", ref)]:
            out[f"{m}/{v}/{name}"] = value
    return out


# --------------------------------------------------------------------------------------------- identical outputs


@pytest.mark.parametrize("batch", [BATCH, 5])
def test_trimmed_fanout_equals_untrimmed_bit_for_bit_and_the_reference(root, untrimmed_root, batch):
    request = {k: v[:batch] for k, v in REQUEST.items()}
    body = wire.encode(request)
    status, headers, trimmed_body = post(root.url + "/predict", body)
    assert status == 200, trimmed_body
    status, full_headers, full_body = post(untrimmed_root.url + "/predict", body)
    assert status == 200, full_body
    trimmed, full = outputs_of(trimmed_body), outputs_of(full_body)
    reference = reference_outputs(request)
    assert sorted(trimmed) == sorted(full) == sorted(reference)
    for name, value in trimmed.items():
        assert value.dtype == full[name].dtype and value.tobytes() == full[name].tobytes(), name
        np.testing.assert_allclose(value, reference[name], rtol=1e-5, atol=1e-6, err_msg=name)
        assert value.shape[0] == batch
    fanout, full_fanout = json.loads(headers[FANOUT_HEADER]), json.loads(full_headers[FANOUT_HEADER])
    for (m, v), model in MODELS.items():
        assert fanout[f"{m}/{v}"]["features"] == len(model.reads)
        assert full_fanout[f"{m}/{v}"]["features"] is None  # everything
        assert fanout[f"{m}/{v}"]["bytes"] < full_fanout[f"{m}/{v}"]["bytes"]
    assert int(headers[GENERATION_HEADER]) == root.routes.current().generation


def test_python_fan_out_matches_http(root):
    result = root.fan_out(REQUEST)
    _, _, body = post(root.url + "/predict", BODY)
    http = outputs_of(body)
    for key, outs in result.outputs().items():
        for name, value in outs.items():
            assert value.tobytes() == http[f"{key}/{name}"].tobytes()
    assert set(result.leaves) == {f"{m}/{v}" for m, v in MODELS}


def test_leaf_gives_identical_outputs_for_full_trimmed_and_declared_payloads(leaves):
    for key, leaf in leaves.items():
        model, sig = MODELS[key], leaf.signature
        payloads = {
            "full": REQUEST,
            "trimmed": {n: REQUEST[n] for n in sig.required},
            "declared": {n: REQUEST[n] for n in sig.feature_names},
            "reversed": {n: REQUEST[n] for n in reversed(sig.required)},
        }
        results = {}
        for what, features in payloads.items():
            before = leaf.metrics.snapshot()
            status, _, body = post(leaf.url + "/predict", wire.encode(features))
            assert status == 200, body
            results[what] = outputs_of(body)
            after = leaf.metrics.snapshot()
            delta = {k: after[k][""] - before[k][""] for k in ("ignored_features", "filled_unused_features")}
            declared_sent = sum(n in set(sig.feature_names) for n in features)
            assert delta == {
                "ignored_features": len(features) - declared_sent,
                "filled_unused_features": len(sig.feature_names) - declared_sent,
            }, what
        for what, outs in results.items():
            for name, value in outs.items():
                assert value.tobytes() == results["full"][name].tobytes(), (key, what, name)
        if model.unused:  # ctr/1: its declared-but-unused features really are not needed
            assert len(payloads["trimmed"]) < len(payloads["declared"])


# ---------------------------------------------------------------------------------------------------- bad requests

CTR2 = MODELS[("ctr", "2")]
DENSE = next(n for n in CTR2.reads if n.startswith(("count", "ratio", "emb")))
IDS = next(n for n in CTR2.reads if n.startswith("ids"))


def broken(kind):
    request = dict(REQUEST)
    if kind == "missing":
        del request[IDS]
        return request, IDS
    if kind == "dtype":
        request[DENSE] = request[DENSE].astype(np.float64)
        return request, DENSE
    request[IDS] = request[IDS][:, :-1]  # one id short per example
    return request, IDS


@pytest.mark.parametrize("kind", ["missing", "dtype", "shape"])
def test_bad_request_at_root_is_400_naming_the_feature(root, kind):
    request, feature = broken(kind)
    sent_before = root.metrics.total("leaf_requests")
    status, _, body = post(root.url + "/predict?models=ctr/2", wire.encode(request))
    assert status == 400
    err = json.loads(body)
    assert (err["feature"], err["reason"], err["model"], err["version"]) == (feature, kind, "ctr", "2")
    assert f"'{feature}'" in err["error"] and "ctr/2" in err["error"]
    assert root.metrics.total("leaf_requests") == sent_before  # refused before any leaf was called
    assert root.metrics.value("bad_requests", reason=kind) >= 1


@pytest.mark.parametrize("kind", ["missing", "dtype", "shape"])
def test_bad_request_at_leaf_is_400_naming_the_feature(leaves, kind):
    request, feature = broken(kind)
    leaf = leaves[("ctr", "2")]
    status, _, body = post(leaf.url + "/predict", wire.encode(request))
    assert status == 400
    err = json.loads(body)
    assert (err["feature"], err["reason"], err["model"], err["version"]) == (feature, kind, "ctr", "2")
    assert leaf.metrics.value("bad_requests", reason=kind) >= 1


def test_malformed_requests(root, leaves):
    leaf = leaves[("hide", "1")]
    for url in (root.url, leaf.url):
        status, _, body = post(url + "/predict", b"not arrow at all")
        assert status == 400 and json.loads(body)["reason"] == "payload"
        status, _, body = post(url + "/predict", BODY, content_type="application/json")
        assert status == 415 and wire.MEDIA_TYPE in json.loads(body)["error"]
        with pytest.raises(urllib.error.HTTPError) as info:
            get(url + "/nope")
        assert info.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as info:
            get(url + "/predict")
        assert info.value.code == 405
    status, _, body = post(root.url + "/predict?models=ctr/9", BODY)
    assert status == 400 and "no leaf serves model 'ctr/9'" in json.loads(body)["error"]
    # A declared-but-unused feature of ctr/1 may be absent: it is not required.
    unused = MODELS[("ctr", "1")].unused[0]
    status, _, body = post(
        root.url + "/predict?models=ctr/1", wire.encode({k: v for k, v in REQUEST.items() if k != unused})
    )
    assert status == 200, body


def test_unreachable_leaf_is_503_naming_it(store):
    """Unreachable is unavailable (Envoy's "upstream connect error"): 503 + Retry-After, naming the leaf."""
    with Root(RootConfig(store, (LeafAddress("ctr", "1", "http://127.0.0.1:9"),), leaf_timeout_s=5)) as r:
        status, headers, body = post(r.url + "/predict", BODY)
        assert status == 503 and "leaf ctr/1 at http://127.0.0.1:9 unreachable" in json.loads(body)["error"]
        assert headers["Retry-After"] == "1"
        assert r.metrics.value("leaf_errors", model="ctr", version="1") == 1


# ------------------------------------------------------------------------------------------------------ fail open


def copy_signatures(src, dst, keys):
    for m, v in keys:
        target = store_lib.signature_path(dst, m, v)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(store_lib.signature_path(src, m, v), target)


def test_missing_or_unreadable_signature_fails_open_and_is_counted(tmp_path, store, leaves, root):
    keys = [k for k in MODELS if k not in {("save", "1"), ("hide", "2")}]
    copy_signatures(store, tmp_path, keys)
    broken_sig = store_lib.signature_path(tmp_path, "hide", "2")
    broken_sig.parent.mkdir(parents=True)
    broken_sig.write_text('{"format": "jaxscale.signature/1", "model": ')
    with Root(RootConfig(tmp_path, addresses(leaves))) as fail_open_root:
        status = {
            e["model"] + "/" + e["version"]: e["status"]
            for e in json.loads(get(fail_open_root.url + "/routes"))["models"]
        }
        assert status["save/1"] == "missing" and status["hide/2"] == "unreadable" and status["ctr/1"] == "ok"
        expected = outputs_of(post(root.url + "/predict", BODY)[2])  # the trimming root's answer
        received = leaves[("save", "1")].metrics.value("features_received")
        for _ in range(2):
            code, headers, body = post(fail_open_root.url + "/predict", BODY)
            assert code == 200, body
            fanout = json.loads(headers[FANOUT_HEADER])
            assert fanout["save/1"]["fail_open"] == "missing" and fanout["hide/2"]["fail_open"] == "unreadable"
            assert fanout["save/1"]["features"] is None and fanout["ctr/1"]["fail_open"] is None
            for name, value in outputs_of(body).items():
                assert value.tobytes() == expected[name].tobytes(), name
        assert fail_open_root.fail_open_count() == 4
        m = fail_open_root.metrics
        assert m.value("fail_open_requests", model="save", version="1", reason="missing") == 2
        assert m.value("fail_open_requests", model="hide", version="2", reason="unreadable") == 2
        assert m.value("features_sent", model="save", version="1") == 2 * len(REQUEST)
        assert m.value("signatures_unavailable") == 2
        assert leaves[("save", "1")].metrics.value("features_received") - received == 2 * len(REQUEST)
        text = get(fail_open_root.url + "/metrics").decode()
        assert 'jaxscale_root_fail_open_requests_total{model="save",reason="missing",version="1"} 2.0' in text
        # The root cannot check a request for a fail-open leaf; the leaf does, and the root relays its 400.
        hide2 = MODELS[("hide", "2")]
        victim = hide2.reads[0]
        code, _, body = post(
            fail_open_root.url + "/predict?models=hide/2",
            wire.encode({k: v for k, v in REQUEST.items() if k != victim}),
        )
        err = json.loads(body)
        assert code == 400 and (err["feature"], err["leaf"], err["reason"]) == (victim, "hide/2", "missing")


# ------------------------------------------------------------------------------------------------- atomic swaps


def widened(signature, extra):
    """The same signature declaring ``extra`` more features (present in every request; the leaf ignores them)."""
    declared = {s.name for s in signature.features}
    more = [s for s in UNIVERSE if s.name not in declared][:extra]
    return Signature(signature.model, signature.version, (*signature.features, *more), signature.outputs,
                     signature.unused, signature.artifact, signature.artifact_sha256)  # fmt: skip


def test_route_swaps_are_atomic_under_concurrent_requests(tmp_path, store, leaves):
    originals = {k: Signature.load(store_lib.signature_path(store, *k)) for k in MODELS}
    contents = {
        "A": originals,
        "B": {k: widened(sig, 1 + i) for i, (k, sig) in enumerate(originals.items())},
    }
    expected = {name: {s.label: len(s.required) for s in sigs.values()} for name, sigs in contents.items()}
    assert expected["A"] != expected["B"] and all(expected["A"][k] != expected["B"][k] for k in expected["A"])

    def write(name):
        for k, sig in contents[name].items():
            sig.save(store_lib.signature_path(tmp_path, *k))

    write("A")
    with Root(RootConfig(tmp_path, addresses(leaves))) as r:
        content_of = {r.routes.current().generation: "A"}
        stop, seen, failures = threading.Event(), [], []

        def client():
            while not stop.is_set():
                code, headers, body = post(r.url + "/predict", BODY)
                if code != 200:
                    failures.append(body)
                    continue
                fanout = json.loads(headers[FANOUT_HEADER])
                seen.append((int(headers[GENERATION_HEADER]), {k: v["features"] for k, v in fanout.items()}))

        threads = [threading.Thread(target=client) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            for i in range(10):
                name = "B" if i % 2 == 0 else "A"
                write(name)
                generation = json.loads(post(r.url + "/admin/reload", b"")[2])["generation"]
                content_of[generation] = name
                time.sleep(0.05)
            deadline = time.time() + 60
            while len({content_of[g] for g, _ in seen}) < 2 and time.time() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join()
    assert not failures
    assert len({content_of[g] for g, _ in seen}) == 2, "no request ran across a swap"
    for generation, counts in seen:  # every request used one whole map: all leaves from the same generation
        assert counts == expected[content_of[generation]], generation
    assert r.metrics.value("reloads") == 11


def test_background_rescan_picks_up_a_new_signature(tmp_path, store, leaves):
    keys = [k for k in MODELS if k != ("save", "1")]
    copy_signatures(store, tmp_path, keys)
    with Root(RootConfig(tmp_path, addresses(leaves), rescan_interval_s=0.05)) as r:
        assert r.routes.current().entry("save", "1").status == "missing"
        generation = r.routes.current().generation
        copy_signatures(store, tmp_path, [("save", "1")])
        deadline = time.time() + 30
        while r.routes.current().generation == generation and time.time() < deadline:
            time.sleep(0.05)
        assert r.routes.current().entry("save", "1").status == "ok"
        code, headers, _ = post(r.url + "/predict?models=save/1", BODY)
        assert code == 200 and json.loads(headers[FANOUT_HEADER])["save/1"]["features"] == len(
            MODELS[("save", "1")].reads
        )
        assert r.fail_open_count() == 0


# -------------------------------------------------------------------------------------------------------- metrics


def test_info_and_metrics_endpoints(root, leaves):
    leaf = leaves[("ctr", "1")]
    assert json.loads(get(leaf.url + "/signature")) == leaf.signature.to_json()
    assert json.loads(get(leaf.url + "/healthz")) == {"status": "ok", "model": "ctr", "version": "1"}
    assert json.loads(get(root.url + "/healthz")) == {"status": "ok"}
    routes = json.loads(get(root.url + "/routes"))
    ctr1 = next(e for e in routes["models"] if (e["model"], e["version"]) == ("ctr", "1"))
    assert ctr1["allowed"] == list(leaf.signature.required) and ctr1["unused"] == list(leaf.signature.unused)
    post(root.url + "/predict", BODY)
    families = {f.name: f for f in text_string_to_metric_families(get(root.url + "/metrics").decode())}
    snapshot = root.metrics.snapshot()
    for sample in families["jaxscale_root_leaf_request_bytes"].samples:
        key = f"model={sample.labels['model']},version={sample.labels['version']}"
        assert sample.value == snapshot["leaf_request_bytes"][key]
    assert families["jaxscale_root_routes_generation"].samples[0].value == root.routes.current().generation


def test_leaf_pads_to_its_batch_bucket_and_trims_the_outputs(leaves):
    leaf = leaves[("hide", "1")]
    for batch in (1, 3, BATCH, BATCH + 3):  # BATCH + 3 is past the largest bucket: it runs unpadded
        request = {k: np.concatenate([v] * 2)[:batch] for k, v in REQUEST.items()}
        out = leaf.predict(request)["output"]
        assert out.shape == (batch, 2)
        np.testing.assert_allclose(out, MODELS[("hide", "1")].reference(request), rtol=1e-5, atol=1e-6)
