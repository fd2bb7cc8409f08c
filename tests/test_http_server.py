"""The shared HTTP layer (`jaxscale.infra.http_server`) with real clients on 127.0.0.1: no per-request stall on a
keep-alive connection, 503 + Retry-After over the in-flight bound, bearer tokens, TLS, graceful SIGTERM, the
sequence server's batchGet and Prometheus /metrics."""

import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import trustme
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import healthz_during
from test_sequences_helpers import make_defs, random_log

from jaxscale.benchmarks import http_load
from jaxscale.infra.http_server import BackgroundServer, Client, Response, Route, ServerConfig, Service, load_tokens
from jaxscale.sequences.query import SequenceReader
from jaxscale.sequences.runtime import backfill
from jaxscale.sequences.server import MAX_BATCH_USERS, serve_in_thread
from jaxscale.sequences.store import read_sequence
from jaxscale.serving import wire
from jaxscale.serving.export import UnusedFeatureWarning, export_model
from jaxscale.serving.leaf import Leaf, LeafConfig
from jaxscale.serving.root import LeafAddress, Root, RootConfig
from jaxscale.serving.signature import FeatureSpec

REPO = Path(__file__).resolve().parents[1]
LIMIT = 256


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store whose users have more than 256 events in sequence s1."""
    tmp = tmp_path_factory.mktemp("http")
    random_log(7, tmp, files=2, rows=1500, users=4, days=2, late=0.0, bad=False)
    backfill(make_defs(max_length=400), tmp / "events", tmp / "store", sources={"items": tmp / "items.parquet"})
    return tmp / "store"


@pytest.fixture(scope="module")
def users(store):
    return sorted(set(read_sequence(store, "s1").column("user_id").to_pylist()))


@pytest.fixture(scope="module")
def server(store):
    srv = serve_in_thread(store)
    yield srv
    srv.stop()


def connection(url, **kw):
    host, port = url.split("//")[1].split(":")
    return http.client.HTTPConnection(host, int(port), timeout=10, **kw)


def get(conn, path, headers=None):
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    return resp.status, dict(resp.getheaders()), resp.read()


def post(conn, path, doc):
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def metric_families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def totals(family, label: str) -> dict:
    """A counter family's ``_total`` samples by one label's value."""
    return {s.labels[label]: s.value for s in family.samples if s.name.endswith("_total")}


# ------------------------------------------------------------------------------------------- no per-request stall


def sequential_keepalive(conn, n, send) -> float:
    """Seconds for ``n`` requests one after the other on ``conn``; asserts its socket is never replaced."""
    send()
    sock = conn.sock
    t0 = time.perf_counter()
    for _ in range(n):
        send()
        assert conn.sock is sock, "the keep-alive connection was not reused"
    return time.perf_counter() - t0


def test_200_keepalive_requests_for_256_event_answers_take_under_2s(server, users):
    conn = connection(server.url)
    user = next(u for u in users if len(SequenceReader(server.store.path, "s1").events(u)) > LIMIT)

    def send():
        status, _, body = get(conn, f"/v1/users/{user}/sequences/s1?limit={LIMIT}")
        assert status == 200 and len(json.loads(body)["events"]) == LIMIT

    elapsed = sequential_keepalive(conn, 200, send)
    assert elapsed < 2.0, f"200 keep-alive requests took {elapsed:.2f} s: a per-request stall (Nagle?)"


SPECS = (FeatureSpec("dense", "float32", (3,)), FeatureSpec("ids", "int32", (4,)), FeatureSpec("spare", "float32"))


def tiny_model(f):
    return {"score": jnp.tanh(f["dense"].sum(-1) + f["ids"].sum(-1).astype(jnp.float32) / 10)}


@pytest.fixture(scope="module")
def model_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("models")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedFeatureWarning)
        export_model(tiny_model, SPECS, model="tiny", version="1", store=path)
    return path


FEATURES = {
    "dense": np.ones((8, 3), np.float32),
    "ids": np.arange(32, dtype=np.int32).reshape(8, 4),
    "other": np.zeros((8, 5), np.float32),
}


def test_200_keepalive_root_to_leaf_predictions_take_under_2s(model_store):
    with Leaf(LeafConfig(model_store, "tiny", "1", batch_buckets=(8,), warmup=True)) as leaf:
        with Root(RootConfig(model_store, (LeafAddress("tiny", "1", leaf.url),))) as root:
            conn, body = connection(root.url), wire.encode(FEATURES)

            def send():
                conn.request("POST", "/predict", body=body, headers={"Content-Type": wire.MEDIA_TYPE})
                resp = conn.getresponse()
                assert resp.status == 200 and wire.decode(resp.read()).num_rows == 8

            elapsed = sequential_keepalive(conn, 200, send)
            assert root.metrics.value("leaf_requests", model="tiny", version="1") == 201
    assert elapsed < 2.0, f"200 root->leaf requests took {elapsed:.2f} s: a per-request stall (Nagle?)"


# --------------------------------------------------------------------------------------------------- overload


def test_a_burst_over_the_in_flight_bound_gets_503_with_retry_after(tmp_path):
    release = threading.Event()

    def slow(request):
        release.wait(10)
        return Response.json({"ok": True})

    config = ServerConfig(max_in_flight=4, workers=4, retry_after_s=2)
    server = BackgroundServer(Service([Route("GET", "/slow", slow)], config, name="t", metrics_prefix="t")).start()
    try:

        def call(_):
            conn = connection(server.url)
            try:
                status, headers, _ = get(conn, "/slow")
                return status, headers.get("Retry-After")
            finally:
                conn.close()

        with ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(call, i) for i in range(24)]
            deadline = time.monotonic() + 10
            while server.service.in_flight < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # the other 20 arrive while 4 are held
            release.set()
            results = [f.result() for f in futures]
        statuses = [s for s, _ in results]
        assert set(statuses) == {200, 503} and statuses.count(200) >= 4, statuses
        assert all(retry == "2" for s, retry in results if s == 503)
        conn = connection(server.url)
        assert get(conn, "/slow")[0] == 200 and get(conn, "/healthz")[0] == 200  # still serving
        families = metric_families(get(conn, "/metrics")[2].decode())
        assert families["t_http_in_flight_requests"].samples[0].value == 0
        refused = totals(families["t_http_refused_requests"], "status")
        assert refused["503"] == statuses.count(503)
    finally:
        release.set()
        server.stop()


def test_a_body_over_the_limit_gets_413_and_the_server_goes_on():
    echo = Route("POST", "/echo", lambda r: Response(200, r.body, "application/octet-stream"))
    config = ServerConfig(max_body_bytes=100)
    server = BackgroundServer(Service([echo], config, name="t", metrics_prefix="t")).start()
    try:
        conn = connection(server.url)
        conn.request("POST", "/echo", body=b"x" * 101)
        resp = conn.getresponse()
        assert resp.status == 413 and "limit of 100 bytes" in json.loads(resp.read())["error"]
        conn = connection(server.url)
        conn.request("POST", "/echo", body=b"y" * 100)
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == b"y" * 100
        status, _, body = get(conn, "/nope")
        assert status == 404 and json.loads(body) == {"error": "no route GET /nope", "allowed": []}
        status, _, body = get(conn, "/echo")
        assert status == 405 and json.loads(body)["allowed"] == ["POST"]
    finally:
        server.stop()


# --------------------------------------------------------------------------------------------------- auth + TLS


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokens") / "tokens.json"
    path.write_text(json.dumps({"all-seqs": "*", "s1-only": ["s1"]}))
    return path


def test_bearer_tokens_401_403_200(store, tokens_file):
    srv = serve_in_thread(store, tokens_file=str(tokens_file))
    try:
        conn = connection(srv.url)
        path = "/v1/users/1/sequences/s2?limit=3"
        status, headers, body = get(conn, path)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer" and "missing" in json.loads(body)["error"]
        status, headers, _ = get(conn, path, {"Authorization": "Bearer nope"})
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        status, _, body = get(conn, path, {"Authorization": "Bearer s1-only"})
        assert status == 403 and "'s2'" in json.loads(body)["error"]
        status, _, body = get(conn, path, {"Authorization": "Bearer all-seqs"})
        assert status == 200 and json.loads(body)["sequence"] == "s2"
        assert get(conn, "/v1/users/1/sequences/s1", {"Authorization": "Bearer s1-only"})[0] == 200
        assert get(conn, "/healthz")[0] == 200  # always open
        assert get(conn, "/metrics")[0] == 401  # needs a valid token (any)
        families = metric_families(get(conn, "/metrics", {"Authorization": "Bearer s1-only"})[2].decode())
        refused = totals(families["jaxscale_sequences_http_refused_requests"], "status")
        assert refused["401"] == 3 and refused["403"] == 1
    finally:
        srv.stop()


def test_bad_tokens_files_and_configs_name_the_field(tmp_path):
    for content in ("[]", '{"t": "all"}', '{"t": [1]}', '{" t": "*"}', "{"):
        (tmp_path / "t.json").write_text(content)
        with pytest.raises(ValueError, match="^tokens_file: "):
            load_tokens(tmp_path / "t.json")
    for kw, field in [
        ({"max_in_flight": 0}, "max_in_flight"),
        ({"port": 70000}, "port"),
        ({"tls_cert": str(tmp_path / "t.json")}, "tls_cert"),
        ({"tokens_file": str(tmp_path / "missing.json")}, "tokens_file"),
        ({"shutdown_timeout_s": -1}, "shutdown_timeout_s"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            ServerConfig(**kw)


def test_tls_with_a_real_client_and_plain_http_refused(store, tokens_file, tmp_path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    pem = str(tmp_path / "server.pem")
    srv = serve_in_thread(store, tls_cert=pem, tls_key=pem, tokens_file=str(tokens_file))
    try:
        assert srv.url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        host, port = srv.server_address
        conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=10)
        status, _, body = get(conn, "/v1/users/1/sequences/s1?limit=2", {"Authorization": "Bearer s1-only"})
        assert status == 200 and json.loads(body)["user_id"] == 1
        client = Client(srv.url, ca_file=tmp_path / "ca.pem", token="all-seqs")
        status, _, body = client.request("GET", "/v1/users/1/sequences/s2?limit=2")
        assert status == 200 and json.loads(body)["sequence"] == "s2"
        with pytest.raises(ssl.SSLCertVerificationError):  # a client that does not trust the CA
            get(http.client.HTTPSConnection(host, port, context=ssl.create_default_context(), timeout=10), "/healthz")
        with pytest.raises((http.client.HTTPException, OSError)):  # plain http on the TLS port
            get(connection(srv.url.replace("https", "http")), "/healthz")
    finally:
        srv.stop()


def test_root_calls_a_tls_leaf_with_its_token(model_store, tmp_path):
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "leaf.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "tokens.json").write_text(json.dumps({"root-token": ["tiny"], "other": ["ctr"]}))
    pem, ca_file = str(tmp_path / "leaf.pem"), str(tmp_path / "ca.pem")
    tls = ServerConfig(tls_cert=pem, tls_key=pem, tokens_file=str(tmp_path / "tokens.json"))
    body = wire.encode(FEATURES)
    with Leaf(LeafConfig(model_store, "tiny", "1", server=tls)) as leaf:
        assert leaf.url.startswith("https://")
        for token, expected in (("root-token", 200), ("other", 503), (None, 503)):
            address = (LeafAddress("tiny", "1", leaf.url),)
            with Root(RootConfig(model_store, address, leaf_ca_file=ca_file, leaf_token=token)) as root:
                conn = connection(root.url)
                conn.request("POST", "/predict", body=body, headers={"Content-Type": wire.MEDIA_TYPE})
                resp = conn.getresponse()
                answer = resp.read()
                assert resp.status == expected, (token, answer)
                if expected == 200:
                    assert wire.decode(answer).num_rows == 8
                else:  # the leaf's 403 / 401 reaches the caller as the root's 503 naming the leaf
                    assert json.loads(answer)["leaf"] == "tiny/1"


# ---------------------------------------------------------------------------------------------- graceful SIGTERM


def test_sigterm_lets_the_in_flight_request_finish_and_exits_0():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "http_slow_server.py"), "10"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().rsplit(" ", 1)[1].strip()
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(lambda: get(connection(url), "/slow?s=1.5"))
            time.sleep(0.5)  # the request is in its handler
            proc.send_signal(signal.SIGTERM)
            status, _, body = slow.result(timeout=20)
        assert status == 200 and json.loads(body) == {"slept": 1.5}
        assert proc.wait(timeout=20) == 0
        assert proc.stdout.read().strip() == "stopped"
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------------------------------------- batchGet


def test_batch_get_equals_the_per_user_gets(server, users):
    conn = connection(server.url)
    rng = np.random.default_rng(0)
    reader = SequenceReader(server.store.path, "s1")
    ts = [e["ts"] for u in users for e in reader.events(u)]
    candidates = [*users, 0, 99, -5, 2**63 - 1]  # known users and unknown ones
    for trial in range(6):
        chosen = [candidates[i] for i in rng.integers(0, len(candidates), size=int(rng.integers(0, 12)))]
        params = {}
        if trial % 2:
            params["as_of"] = int(rng.choice(ts))
        if trial % 3:
            params["limit"] = int(rng.integers(0, 300))
        if trial == 5:
            params["as_of_mode"] = "event"
        status, answer = post(conn, "/v1/sequences/s1:batchGet", {"user_ids": chosen, **params})
        assert status == 200 and answer["sequence"] == "s1" and [r["user_id"] for r in answer["results"]] == chosen
        query = "&".join(f"{k}={v}" for k, v in params.items())
        for u, result in zip(chosen, answer["results"]):
            status, _, body = get(conn, f"/v1/users/{u}/sequences/s1?{query}")
            assert status == 200 and result["events"] == json.loads(body)["events"], (u, params)


@pytest.mark.parametrize(
    "body, field",
    [
        (b"not json", "body"),
        ([1, 2], "body"),
        ({}, "user_ids"),
        ({"user_ids": 5}, "user_ids"),
        ({"user_ids": [1, "2"]}, "user_ids[1]"),
        ({"user_ids": [True]}, "user_ids[0]"),
        ({"user_ids": [1.5]}, "user_ids[0]"),
        ({"user_ids": [2**63]}, "user_ids[0]"),
        ({"user_ids": [1], "as_of": "5"}, "as_of"),
        ({"user_ids": [1], "limit": -1}, "limit"),
        ({"user_ids": [1], "ids": "hashed"}, "ids"),
        ({"user_ids": [1], "as_of_mode": "arrival"}, "as_of_mode"),
        ({"user_ids": [1], "asof": 5}, "asof"),
    ],
)
def test_batch_get_400_names_the_field(server, body, field):
    status, answer = post(connection(server.url), "/v1/sequences/s1:batchGet", body)
    assert status == 400 and answer["error"].startswith(f"{field}: "), answer


def test_batch_get_caps_user_ids_and_knows_its_sequences(server):
    conn = connection(server.url)
    status, answer = post(conn, "/v1/sequences/s1:batchGet", {"user_ids": list(range(MAX_BATCH_USERS + 1))})
    assert status == 413 and f"limit of {MAX_BATCH_USERS}" in answer["error"]
    assert post(conn, "/v1/sequences/s1:batchGet", {"user_ids": list(range(MAX_BATCH_USERS))})[0] == 200
    status, answer = post(conn, "/v1/sequences/nope:batchGet", {"user_ids": [1]})
    assert status == 404 and "nope" in answer["error"]
    status, _, body = get(conn, "/v1/users/1/sequences/s1?as_of_mode=arrival")
    assert status == 400 and "as_of_mode must be one of ['event', 'ingest', 'visible']" in json.loads(body)["error"]
    assert get(conn, "/v1/users/1/sequences/s1?as_of_mode=event")[2] == get(conn, "/v1/users/1/sequences/s1")[2]


def test_batch_get_refuses_deeply_nested_json_and_parses_big_bodies_off_the_loop(server):
    """A body 100k deep is a 400 naming max_json_depth (whatever its Content-Type; it was a 500 with a
    traceback), and /healthz answers promptly while a 30 MB body is parsed (CPython's JSON parser holds the GIL:
    the server parses big bodies letting the event loop run)."""
    deep = b'{"user_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for content_type in ("application/json", "text/plain"):
        conn = connection(server.url)
        conn.request("POST", "/v1/sequences/s1:batchGet", body=deep, headers={"Content-Type": content_type})
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
        assert resp.status == 400 and "over the limit of 64 (max_json_depth)" in error, error
    big = b'{"user_ids": [' + ",".join(map(str, range(4_000_000))).encode() + b"]}"

    def upload():
        conn = connection(server.url)
        conn.timeout = 60
        return post(conn, "/v1/sequences/s1:batchGet", big)[0]

    during, took, status = healthz_during(server.url, upload)
    assert status == 413  # parsed, then refused: more than MAX_BATCH_USERS users
    assert len(during) >= 5 and max(during) < max(0.25, took / 4), (took, len(during), sorted(during)[-5:])


def test_as_of_mode_ingest_is_passed_to_the_reader(tmp_path):
    raw, items = random_log(11, tmp_path, files=2, rows=300, users=5, days=3, late=0.3, bad=False, ingest=True)
    backfill(make_defs(max_length=50), tmp_path / "events", tmp_path / "store", sources={"items": items})
    reader = SequenceReader(tmp_path / "store", "s1")
    srv = serve_in_thread(tmp_path / "store")
    try:
        conn, rng = connection(srv.url), np.random.default_rng(3)
        users = sorted({int(u) for u in raw.user_id.dropna()})
        times = [int(t) for t in rng.choice(raw.ts.dropna().astype("int64").to_numpy(), 8)]
        differs = 0
        for t in times:
            doc = {"user_ids": users, "as_of": t, "as_of_mode": "ingest"}
            status, answer = post(conn, "/v1/sequences/s1:batchGet", doc)
            assert status == 200
            for u, result in zip(users, answer["results"]):
                want = reader.events(u, t, as_of_mode="ingest")
                status, _, body = get(conn, f"/v1/users/{u}/sequences/s1?as_of={t}&as_of_mode=ingest")
                assert status == 200 and json.loads(body)["events"] == want == result["events"], (u, t)
                differs += want != reader.events(u, t)
        assert differs, "no late event made ingest mode differ from event mode: the test shows nothing"
    finally:
        srv.stop()


# ------------------------------------------------------------------------------------------------ the benchmark


def test_the_open_loop_benchmark_counts_queueing_and_errors():
    """http_load.load (bench_serving.py's client) times each request from its scheduled send: a server slower
    than the rate shows it."""

    def slow(request):
        time.sleep(0.02)
        return Response.json({}, 500 if request.query.get("fail") else 200)

    config = ServerConfig(workers=1)
    server = BackgroundServer(Service([Route("GET", "/slow", slow)], config, name="b", metrics_prefix="b")).start()
    try:
        requests = [("GET", "/slow", None, None)] * 4 + [("GET", "/slow?fail=1", None, None)]
        result = http_load.load(server.url, requests, [100], seconds=0.5, connections=2)
    finally:
        server.stop()
    (run,) = result["runs"]
    # 50 requests of 20 ms on one worker take >= 1 s against a 0.5 s schedule: the last ones waited ~0.5 s
    assert run["requests"] == 50 and run["errors"] == 10 and run["status_counts"] == {"200": 40, "500": 10}
    assert run["max_ms"] > 400 and run["p50_ms"] > 100 and run["achieved_rps"] < 60
    assert result["best_rate_p99_le_10ms"] is None


# -------------------------------------------------------------------------------------------------------- metrics


def test_metrics_parse_and_count_requests_by_route_and_status(server):
    conn = connection(server.url)
    before = metric_families(get(conn, "/metrics")[2].decode())

    def count(families, status):
        samples = families["jaxscale_sequences_http_requests"].samples
        return sum(
            s.value
            for s in samples
            if s.name.endswith("_total") and s.labels["route"] == "/v1/users/{user_id}/sequences/{name}"
            and s.labels["status"] == status
        )  # fmt: skip

    for _ in range(3):
        get(conn, "/v1/users/1/sequences/s1")
    get(conn, "/v1/users/1/sequences/s1?limit=x")
    after = metric_families(get(conn, "/metrics")[2].decode())
    assert count(after, "200") - count(before, "200") == 3 and count(after, "400") - count(before, "400") == 1
    latency = after["jaxscale_sequences_http_request_duration_seconds"].samples
    assert any(s.name.endswith("_count") and s.value >= 4 for s in latency)
    assert after["jaxscale_sequences_http_in_flight_requests"].samples[0].value == 0
