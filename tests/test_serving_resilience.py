"""One bad leaf cannot take the root down (issue 35 item 4): partial answers, deadlines (504 naming them, the budget
sent on, honoured by a leaf), a leaf's 503 + Retry-After passed on, a per-leaf concurrency bound, a circuit
breaker per leaf, leaf calls cancelled with the client, the request id in every root log line.

Leaves are stub servers on 127.0.0.1 (the shared HTTP layer) whose behaviour each test sets: fast, no model."""

import http.client
import json
import logging
import socket
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import StubLeaf, demo_store

from jaxscale.serving import demo, wire
from jaxscale.serving.resilience import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from jaxscale.serving.root import FAILED_HEADER, LeafAddress, Root, RootConfig, parse_config

UNIVERSE = demo.feature_universe()
GOOD, BAD = ("ctr", "1"), ("ctr", "2")
ROWS = 4


@pytest.fixture(scope="module")
def store():
    return demo_store()[0]


def request_body(rows: int = ROWS) -> bytes:
    return wire.encode(demo.make_request(UNIVERSE, rows, np.random.default_rng(0)))


def post(url: str, path: str = "/predict", body: bytes | None = None, headers=None, timeout=60):
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        body = request_body() if body is None else body
        conn.request("POST", path, body=body, headers={"Content-Type": wire.MEDIA_TYPE, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.fixture
def stubs():
    started = {GOOD: StubLeaf(), BAD: StubLeaf()}
    yield started
    for stub in started.values():
        stub.stop()


def make_root(store, stubs, **kw) -> Root:
    leaves = tuple(LeafAddress(*key, stub.url) for key, stub in stubs.items())
    return Root(RootConfig(store, leaves, **kw)).start()


def metric(root: Root, name: str, **labels) -> float:
    return root.metrics.value(name, **labels)


def test_a_failing_leaf_gives_a_partial_answer_when_the_request_names_no_models(store, stubs):
    stubs[BAD].behave = ("status", 500, {})
    root = make_root(store, stubs)
    try:
        status, headers, body = post(root.url)
        assert status == 200, body
        out = wire.decode(body)
        assert out.schema.names == ["ctr/1/score"] and out.num_rows == ROWS
        failed = json.loads(headers[FAILED_HEADER.lower()])
        assert set(failed) == {"ctr/2"} and failed["ctr/2"]["status"] == 503  # a failed leaf: retry later
        assert json.loads(out.schema.metadata[b"jaxscale.failed"]) == failed
        assert metric(root, "partial_answers") == 1
        # naming the models asks for all of them: no partial answer
        status, headers, body = post(root.url, "/predict?models=ctr/1,ctr/2")
        assert status == 503 and json.loads(body)["leaf"] == "ctr/2" and int(headers["retry-after"]) >= 1
        assert json.loads(body)["reason"] == "leaf_failed" and json.loads(body)["leaf_status"] == 500
        # every leaf failing is no answer at all: the failure, listing each leaf
        stubs[GOOD].behave = ("status", 500, {})
        status, _, body = post(root.url)
        assert status == 503 and set(json.loads(body)["failed"]) == {"ctr/1", "ctr/2"}
    finally:
        root.stop()


def test_a_slow_leaf_is_a_504_naming_the_deadline_and_the_budget_is_sent_on(store, stubs):
    stubs[BAD].behave = ("sleep", 30)
    root = make_root(store, stubs, leaf_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        status, headers, body = post(root.url)  # partial: the fast leaf's answer, within the leaf timeout
        assert status == 200 and time.monotonic() - t0 < 10
        assert json.loads(headers[FAILED_HEADER.lower()])["ctr/2"]["status"] == 504
        status, _, body = post(root.url, "/predict?models=ctr/2")
        error = json.loads(body)
        assert status == 504 and error["reason"] == "deadline" and error["deadline"] == "leaf_timeout_s", error
        assert "leaf_timeout_s" in error["error"] and metric(root, "leaf_deadlines", model="ctr", version="2") >= 2
        # the client's own deadline, shorter than the leaf timeout: it bounds the call and is sent on
        stubs[GOOD].behave = ("sleep", 30)
        t0 = time.monotonic()
        status, _, body = post(root.url, "/predict?models=ctr/1", headers={"X-Request-Timeout-Ms": "200"})
        assert status == 504 and "request deadline" in json.loads(body)["deadline"]
        assert time.monotonic() - t0 < 5
        sent = int(stubs[GOOD].calls[-1]["x-request-timeout-ms"])
        assert 0 < sent <= 200
    finally:
        root.stop()


def test_a_leafs_503_is_passed_on_with_its_retry_after_and_an_unreachable_leaf_is_503(store, stubs):
    stubs[BAD].behave = ("status", 503, {"Retry-After": "7"})
    root = make_root(store, stubs)
    try:
        status, headers, body = post(root.url, "/predict?models=ctr/2")
        assert status == 503 and headers["retry-after"] == "7" and json.loads(body)["leaf"] == "ctr/2"
    finally:
        root.stop()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there
    leaves = (LeafAddress(*GOOD, f"http://127.0.0.1:{port}"),)
    with Root(RootConfig(store, leaves)) as root:
        status, headers, body = post(root.url)
        assert status == 503 and headers["retry-after"] == "1" and json.loads(body)["reason"] == "unreachable"


def test_a_leafs_concurrency_bound_refuses_at_once(store, stubs):
    stubs[BAD].behave = ("sleep", 5)
    leaves = (LeafAddress(*GOOD, stubs[GOOD].url), LeafAddress(*BAD, stubs[BAD].url, max_in_flight=1))
    with Root(RootConfig(store, leaves)) as root:
        import threading

        first = threading.Thread(target=post, args=(root.url, "/predict?models=ctr/2"))
        first.start()
        deadline = time.monotonic() + 20
        while not stubs[BAD].calls and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        status, headers, body = post(root.url, "/predict?models=ctr/2")
        assert status == 503 and json.loads(body)["reason"] == "leaf_busy" and "retry-after" in headers
        assert time.monotonic() - t0 < 3  # refused, not queued behind the slow call (5 s)
        status, _, _ = post(root.url, "/predict?models=ctr/1")  # the other leaf is not bounded by it
        assert status == 200
        first.join()
        assert metric(root, "leaf_refused", model="ctr", version="2", reason="leaf_busy") == 1


def test_the_circuit_opens_after_consecutive_failures_and_a_probe_closes_it(store, stubs):
    stubs[BAD].behave = ("status", 500, {})
    root = make_root(store, stubs, breaker_failures=2, breaker_cooldown_s=3.0)
    try:
        for _ in range(2):
            assert post(root.url, "/predict?models=ctr/2")[0] == 503
        calls = len(stubs[BAD].calls)
        status, headers, body = post(root.url, "/predict?models=ctr/2")
        assert status == 503 and json.loads(body)["reason"] == "circuit_open" and int(headers["retry-after"]) >= 1
        assert len(stubs[BAD].calls) == calls  # not called while open
        status, headers, _ = post(root.url)  # the other leaf still answers; the open one is listed
        assert status == 200 and json.loads(headers[FAILED_HEADER.lower()])["ctr/2"]["reason"] == "circuit_open"
        assert metric(root, "leaf_state", model="ctr", version="2", state="open") == 1
        assert metric(root, "leaf_state", model="ctr", version="1", state="closed") == 1
        text = urlopen_text(root.url + "/metrics")
        series = {
            (s.labels["version"], s.labels["state"]): s.value
            for f in text_string_to_metric_families(text)
            if f.name == "jaxscale_root_leaf_state"
            for s in f.samples
        }
        assert series[("2", "open")] == 1 and series[("2", "closed")] == 0
        stubs[BAD].behave = ("ok",)
        time.sleep(3.3)  # the cool-down: the next call is the probe
        assert post(root.url, "/predict?models=ctr/2")[0] == 200
        assert metric(root, "leaf_state", model="ctr", version="2", state="closed") == 1
    finally:
        root.stop()


def urlopen_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def test_circuit_breaker_states():
    changes = []
    breaker = CircuitBreaker(2, 0.2, on_change=lambda old, new: changes.append(new))
    assert breaker.admit() is None
    breaker.record(False)
    assert breaker.state == CLOSED and breaker.admit() is None
    breaker.record(False)
    assert breaker.state == OPEN and 0 < breaker.admit() <= 0.2
    time.sleep(0.25)
    assert breaker.admit() is None and breaker.state == HALF_OPEN
    assert breaker.admit() is not None  # one probe at a time
    breaker.record(False)  # the probe failed: open again
    assert breaker.state == OPEN
    time.sleep(0.25)
    assert breaker.admit() is None
    breaker.release()  # the probe was cancelled: another may go
    assert breaker.admit() is None
    breaker.record(True)
    assert breaker.state == CLOSED and changes == [OPEN, HALF_OPEN, OPEN, HALF_OPEN, CLOSED]


def test_a_client_that_goes_away_cancels_the_leaf_calls(store, stubs):
    stubs[BAD].behave = ("sleep", 30)
    stubs[GOOD].behave = ("sleep", 30)
    root = make_root(store, stubs)
    try:
        with pytest.raises(TimeoutError):
            post(root.url, timeout=1.0)  # the client gives up and closes its connection
        deadline = time.monotonic() + 15
        while len(stubs[BAD].cancelled) + len(stubs[GOOD].cancelled) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(stubs[BAD].cancelled) == 1 and len(stubs[GOOD].cancelled) == 1
        assert metric(root, "leaf_cancelled", model="ctr", version="2") == 1
    finally:
        root.stop()


def test_every_root_log_line_of_a_request_carries_its_id(store, stubs, caplog):
    stubs[BAD].behave = ("status", 500, {})
    root = make_root(store, stubs, breaker_failures=1)
    try:
        with caplog.at_level(logging.INFO, logger="jaxscale.serving.root"):
            caplog.clear()
            assert post(root.url, headers={"X-Request-Id": "trace-41"})[0] == 200
            lines = [r.getMessage() for r in caplog.records if r.name == "jaxscale.serving.root"]
        # the leaf's failure, its circuit opening and the partial answer: each says which request
        assert len(lines) >= 3 and all("trace-41" in line for line in lines), lines
    finally:
        root.stop()


def test_the_resilience_settings_are_cli_flags(store):
    cfg = parse_config(
        [
            "--store", str(store), "--leaf", "ctr/1=http://127.0.0.1:1,timeout=0.25,max_in_flight=3",
            "--leaf", "ctr/2=http://127.0.0.1:2", "--leaf-timeout", "2", "--request-timeout", "1.5",
            "--leaf-max-in-flight", "9", "--breaker-failures", "4", "--breaker-cooldown", "0.5",
        ]
    )  # fmt: skip
    assert cfg.leaves[0] == LeafAddress("ctr", "1", "http://127.0.0.1:1", 0.25, 3)
    assert cfg.leaves[1].timeout_s is None and cfg.leaf_timeout_s == 2 and cfg.request_timeout_s == 1.5
    assert (cfg.leaf_max_in_flight, cfg.breaker_failures, cfg.breaker_cooldown_s) == (9, 4, 0.5)
    with pytest.raises(ValueError, match="unknown option"):
        LeafAddress.parse("ctr/1=http://127.0.0.1:1,retries=3")
    with pytest.raises(ValueError, match="breaker_failures"):
        RootConfig(store, cfg.leaves, breaker_failures=-1)


def test_a_leaf_honours_the_deadline_it_is_sent(store):
    """X-Request-Timeout-Ms at a real leaf: nothing left is a 504 without running the model; a deadline shorter
    than the call (a first call compiles) is a 504 naming the header; none, or a long one, is answered."""
    from jaxscale.serving.leaf import Leaf, LeafConfig

    with Leaf(LeafConfig(store, *GOOD)) as leaf:  # no warm-up: the first call of each batch size compiles
        status, _, body = post(leaf.url, headers={"X-Request-Timeout-Ms": "0"})
        assert status == 504 and json.loads(body)["deadline"] == "X-Request-Timeout-Ms"
        status, _, body = post(leaf.url, body=request_body(5), headers={"X-Request-Timeout-Ms": "1"})
        assert status == 504 and json.loads(body)["reason"] == "deadline"
        assert leaf.metrics.value("deadlines", route="predict") == 2
        assert post(leaf.url, headers={"X-Request-Timeout-Ms": "60000"})[0] == 200
        assert post(leaf.url)[0] == 200
