"""A second model version does not break clients (issue 35 item 7): the root's config file (leaves, a default
version and a weighted split per model; errors naming the key), reloaded without a restart, a client naming no
version gets the default or the split's pick (deterministic per request id) and is told which version answered,
/readyz apart from /healthz, admin routes closed beyond loopback without tokens.

Leaves are stub servers on 127.0.0.1 (`serving_helpers.StubLeaf`); the root checks the demo store's signatures
(ctr/1, ctr/2) and fails open for the retrieval model ``tt`` (no signature)."""

import http.client
import json

import pytest
from serving_helpers import StubLeaf, demo_store

from jaxscale.infra.http_server import Request, Response, Route, ServerConfig, Service
from jaxscale.serving import demo, wire
from jaxscale.serving.root import VERSIONS_HEADER, Root, RootConfig, parse_config
from jaxscale.serving.versions import ConfigFileError, VersionPolicy, parse_root_file, read_root_file

KEYS = (("ctr", "1"), ("ctr", "2"), ("tt", "a"), ("tt", "b"))
RETRIEVE = json.dumps({"k": 2, "inputs": {"user_id": [1]}}).encode()


@pytest.fixture(scope="module")
def store():
    return demo_store()[0]


@pytest.fixture(scope="module")
def stubs():
    started = {key: StubLeaf(f"{key[0]}/{key[1]}") for key in KEYS}
    yield started
    for stub in started.values():
        stub.stop()


def body(rows: int = 3) -> bytes:
    import numpy as np

    return wire.encode(demo.make_request(demo.feature_universe(), rows, np.random.default_rng(0)))


def call(url: str, method: str, path: str, data: bytes = b"", headers=None):
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=data, headers={"Content-Type": wire.MEDIA_TYPE, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def write_config(path, stubs, keys=KEYS, models=None):
    leaves = [{"model": m, "version": v, "url": stubs[m, v].url} for m, v in keys]
    path.write_text(json.dumps({"leaves": leaves, "models": models or {}}))
    return path


def predict_columns(root_url, query="", request_id=None):
    headers = {"X-Request-Id": request_id} if request_id else {}
    status, headers, answer = call(root_url, "POST", f"/predict{query}", body(), headers)
    assert status == 200, answer
    return wire.decode(answer), headers


@pytest.mark.parametrize(
    "doc, key",
    [
        ({"leaves": []}, "leaves"),
        ({"leaves": [{"model": "ctr", "version": "1"}]}, r"leaves\[0\].url: missing"),
        ({"leaves": [{"model": "ctr", "version": "1", "url": "http://x:1", "timeout_s": "1"}]}, r"timeout_s"),
        ({"leaves": [{"model": "ctr", "version": "1", "url": "http://x:1"}] * 2}, r"leaves\[1\]"),
        ({"leaves": [{"model": "ctr", "version": "1", "url": "http://x:1"}], "model": {}}, "model: unknown key"),
        ({"leaves": [{"model": "ctr", "version": 1, "url": "http://x:1"}], "models": {"ctr": {"default": "3"}}},
         "models.ctr.default: version '3' has no leaf"),
        ({"leaves": [{"model": "ctr", "version": "1", "url": "http://x:1"}], "models": {"ctr": {"split": {"1": -1}}}},
         r"models.ctr.split.1: weight"),
        ({"leaves": [{"model": "ctr", "version": "1", "url": "http://x:1"}], "models": {"ctr": {"split": {"1": 0}}}},
         "models.ctr.split: weights must not all be 0"),
        ({"leaves": [{"model": "ctr", "version": "1", "url": "http://x:1"}], "models": {"ads": {"default": "1"}}},
         "models.ads: no leaf serves this model"),
        ({"leaves": [{"model": "ctr", "version": "1", "url": "http://x:1"}], "models": {"ctr": {}}},
         "models.ctr: needs a default or a split"),
    ],
)  # fmt: skip
def test_config_file_errors_name_the_key(doc, key):
    with pytest.raises(ConfigFileError, match=key):
        parse_root_file(doc, "root.yaml")


def test_a_yaml_config_file_and_the_cli(tmp_path, store):
    path = tmp_path / "root.yaml"
    path.write_text(
        "leaves:\n"
        "  - {model: ctr, version: 1, url: 'http://127.0.0.1:1', timeout_s: 0.5}\n"
        "  - {model: ctr, version: 2, url: 'http://127.0.0.1:2'}\n"
        "models:\n  ctr: {default: 1, split: {1: 90, 2: 10}}\n"
    )
    read = read_root_file(path)
    assert read.policies["ctr"] == VersionPolicy("ctr", "1", (("1", 90.0), ("2", 10.0)))
    cfg = parse_config(["--store", str(store), "--config", str(path)])
    assert [(a.model, a.version, a.timeout_s) for a in cfg.leaves] == [("ctr", "1", 0.5), ("ctr", "2", None)]
    assert cfg.versions["ctr"].default == "1" and cfg.config_file == str(path)
    with pytest.raises(SystemExit):  # the leaves in one place only
        parse_config(["--store", str(store), "--config", str(path), "--leaf", "ctr/3=http://127.0.0.1:3"])


def test_the_split_is_deterministic_per_request_id_and_follows_the_weights():
    policy = VersionPolicy("ctr", "1", (("1", 20.0), ("2", 80.0)))
    picks = [policy.pick(f"req-{i}") for i in range(4000)]
    assert abs(picks.count("2") / len(picks) - 0.8) < 0.03
    assert all(policy.pick(f"req-{i}") == picks[i] for i in range(100))
    assert VersionPolicy("ctr", "2").pick("anything") == "2"


def test_a_client_naming_no_version_gets_the_default_or_the_splits_pick(tmp_path, store, stubs):
    path = write_config(tmp_path / "root.json", stubs, models={"ctr": {"default": "1"}, "tt": {"default": "b"}})
    leaves = parse_config(["--store", str(store), "--config", str(path)])
    with Root(leaves) as root:
        out, headers = predict_columns(root.url)  # every model, its default version: not every version
        assert out.schema.names == ["ctr/1/score", "tt/b/score"]
        assert json.loads(headers[VERSIONS_HEADER.lower()]) == {"ctr": "1", "tt": "b"}
        assert json.loads(out.schema.metadata[b"jaxscale.versions"]) == {"ctr": "1", "tt": "b"}
        assert predict_columns(root.url, "?models=ctr")[0].schema.names == ["ctr/1/score"]
        assert predict_columns(root.url, "?models=ctr/2")[0].schema.names == ["ctr/2/score"]  # named: served
        status, headers, answer = call(
            root.url, "POST", "/v1/models/tt:retrieve", RETRIEVE, {"Content-Type": "application/json"}
        )
        assert status == 200 and headers["x-jaxscale-version"] == "b" and json.loads(answer)["stub"] == "tt/b"
        status, headers, answer = call(
            root.url, "POST", "/v1/models/tt:retrieve?version=a", RETRIEVE, {"Content-Type": "application/json"}
        )
        assert status == 200 and headers["x-jaxscale-version"] == "a"

        # a rollout: 25% -> version 2, reloaded without a restart
        write_config(path, stubs, models={"ctr": {"default": "1", "split": {"1": 75, "2": 25}}})
        status, _, answer = call(root.url, "POST", "/admin/reload")
        assert status == 200 and json.loads(answer)["versions"]["ctr"]["split"] == {"1": 75.0, "2": 25.0}
        answered = [
            json.loads(predict_columns(root.url, "?models=ctr", f"user-{i}")[1][VERSIONS_HEADER.lower()])["ctr"]
            for i in range(200)
        ]
        assert 0.13 < answered.count("2") / len(answered) < 0.37
        again = [
            json.loads(predict_columns(root.url, "?models=ctr", f"user-{i}")[1][VERSIONS_HEADER.lower()])["ctr"]
            for i in range(20)
        ]
        assert again == answered[:20]  # the same request id, the same version
        # tt has no policy now: two versions, so a client must name one (and /predict asks both)
        status, _, answer = call(
            root.url, "POST", "/v1/models/tt:retrieve", RETRIEVE, {"Content-Type": "application/json"}
        )
        assert status == 400 and "default version" in json.loads(answer)["error"]
        assert {n for n in predict_columns(root.url)[0].schema.names if n.startswith("tt")} == {
            "tt/a/score", "tt/b/score"
        }  # fmt: skip


def test_a_reload_changes_the_leaves_and_a_bad_file_changes_nothing(tmp_path, store, stubs):
    path = write_config(tmp_path / "root.json", stubs, keys=KEYS[:1])
    with Root(parse_config(["--store", str(store), "--config", str(path)])) as root:
        assert predict_columns(root.url)[0].schema.names == ["ctr/1/score"]
        write_config(path, stubs, keys=KEYS[:2], models={"ctr": {"split": {"2": 1}}})
        assert call(root.url, "POST", "/admin/reload")[0] == 200
        assert predict_columns(root.url)[0].schema.names == ["ctr/2/score"]
        path.write_text(json.dumps({"leaves": [{"model": "ctr", "version": "1"}]}))
        status, _, answer = call(root.url, "POST", "/admin/reload")
        assert status == 400 and "leaves[0].url: missing" in json.loads(answer)["error"]
        assert predict_columns(root.url)[0].schema.names == ["ctr/2/score"]  # the previous config stays


def test_readyz_is_apart_from_healthz_and_one_leaf_down_leaves_the_model_served(store):
    keys = KEYS[:2]
    stubs = {key: StubLeaf() for key in keys}
    from jaxscale.serving.root import LeafAddress

    try:
        with Root(RootConfig(store, tuple(LeafAddress(*k, s.url) for k, s in stubs.items()))) as root:
            status, _, answer = call(root.url, "GET", "/readyz")
            assert status == 200 and json.loads(answer)["leaves"] == {"ctr/1": "ready", "ctr/2": "ready"}
            stubs["ctr", "2"].stop()
            status, _, answer = call(root.url, "GET", "/readyz")
            assert status == 200 and "unreachable" in json.loads(answer)["leaves"]["ctr/2"]
            stubs["ctr", "1"].stop()
            status, headers, answer = call(root.url, "GET", "/readyz")
            assert status == 503 and "model ctr: no leaf ready" in json.loads(answer)["reasons"][0]
            assert "retry-after" in headers
            assert call(root.url, "GET", "/healthz")[0] == 200  # live all along
    finally:
        for s in stubs.values():
            s.stop()


def test_admin_routes_need_a_token_beyond_loopback(tmp_path):
    route = Route("POST", "/admin/reload", lambda r: Response.json({}), resources=lambda r: ("admin",), admin=True)
    request = Request("POST", "/admin/reload", {}, {}, b"")
    for host, refused in (("127.0.0.1", False), ("localhost", False), ("::1", False), ("0.0.0.0", True),
                          ("10.1.2.3", True)):  # fmt: skip
        service = Service([route], ServerConfig(host=host), name="root", metrics_prefix="t")  # not bound
        answer = service._refuse(route, request)
        assert (answer is not None and answer.status == 403) == refused, host
        assert (service.exposure_warning() is not None) == refused
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"secret": ["admin"]}))
    service = Service([route], ServerConfig(host="0.0.0.0", tokens_file=tokens), name="root", metrics_prefix="t")
    assert service.exposure_warning() is None
    assert service._refuse(route, request).status == 401  # tokens on: the token decides
    with_token = Request("POST", "/admin/reload", {}, {"authorization": "Bearer secret"}, b"")
    assert service._refuse(route, with_token) is None
