"""Serving input paths read as an attacker would (issue 35, items 1, 5, 11), with real clients on 127.0.0.1:
compression bombs refused from the IPC metadata before anything is decompressed (413 naming the limit, on the
root's and the leaf's /predict, the learned-layout paths included), slow uploads that hold no in-flight slot
(408 after the body timeout), 500s that carry a request id and never the exception's text, every limit settable
from the CLI. The retrieve routes' cases are in test_retrieval_serving.py, the sequence server's in
test_http_server.py."""

import http.client
import json
import logging
import socket
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
from serving_helpers import demo_store

from jaxscale.infra.http_server import BackgroundServer, Response, Route, ServerConfig, Service, json_depth, parse_json
from jaxscale.serving import demo, wire
from jaxscale.serving.leaf import Leaf, LeafConfig
from jaxscale.serving.root import LeafAddress, Root, RootConfig

UNIVERSE = demo.feature_universe()
KEY = ("ctr", "1")
BATCH = 8


def bomb(rows: int = 64_000_000, width: int = 1, compression: str = "zstd") -> bytes:
    """A few kilobytes that decode to ``rows * width`` float32 zeros (256 MB by default)."""
    values = np.zeros((rows, width) if width > 1 else rows, np.float32)
    return wire.encode({"x": values}, compression)


@pytest.fixture(scope="module")
def big_bomb():
    return bomb()


def request_body(rows: int, seed: int = 0) -> bytes:
    return wire.encode(demo.make_request(UNIVERSE, rows, np.random.default_rng(seed)))


def post(url: str, path: str, body: bytes, headers=None, timeout=60):
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": wire.MEDIA_TYPE, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


# ------------------------------------------------------------------------------------------------------ wire


def test_a_compression_bomb_is_measured_and_refused_before_decompressing(big_bomb):
    assert len(big_bomb) < 16_000  # 8 KB on the wire, 256 MB decoded: what the body limit never sees
    for compression in ("zstd", "lz4", None):
        body = bomb(1000, 3, compression)
        assert wire.declared_size(body) == (1000, 12_000)  # exact, from the metadata and the buffers' prefixes
    allocated = pa.total_allocated_bytes()
    assert wire.declared_size(big_bomb) == (64_000_000, 256_000_000)
    with pytest.raises(wire.DecodeLimitError, match=r"64000000 rows, over the limit of 1048576 rows \(max_rows\)"):
        wire.decode(big_bomb, wire.DecodeLimits())
    # few rows, wide ones: the decoded bytes are the bound
    wide = bomb(100, 1 << 20)
    with pytest.raises(wire.DecodeLimitError, match=r"419430400 decoded bytes, over the limit of 268435456") as e:
        wire.decode(wide, wire.DecodeLimits())
    assert e.value.limit == "max_decoded_bytes" and e.value.to_json()["reason"] == "decode_limit"
    with pytest.raises(wire.DecodeLimitError):
        wire.check_limits(wide, wire.DecodeLimits())
    assert pa.total_allocated_bytes() - allocated < 1 << 20  # nothing was decompressed
    # within the limits it decodes as before; a body that is not Arrow is a plain PayloadError
    assert wire.decode(bomb(1000, 3), wire.DecodeLimits(max_rows=1000, max_decoded_bytes=12_000)).num_rows == 1000
    with pytest.raises(wire.DecodeLimitError, match="1000 rows, over the limit of 999"):
        wire.decode(bomb(1000, 3, None), wire.DecodeLimits(max_rows=999))
    for broken in (b"", b"junk", big_bomb[:100], big_bomb[:-20]):
        with pytest.raises(wire.PayloadError):
            wire.decode(broken, wire.DecodeLimits())


def test_a_learned_layout_is_bounded_like_decoding():
    body = wire.encode({"x": np.zeros((50, 4), np.float32)})
    cache = wire.LayoutCache()
    assert cache.learn(body, "seen", wire.decode(body))
    assert cache.find(body, wire.DecodeLimits(max_rows=50)) == "seen"
    with pytest.raises(wire.DecodeLimitError, match="max_rows"):
        cache.find(body, wire.DecodeLimits(max_rows=49))  # the layout's rows, without decoding the body
    with pytest.raises(wire.DecodeLimitError, match="max_decoded_bytes"):
        cache.find(body, wire.DecodeLimits(max_decoded_bytes=799))


def test_json_depth_and_parse_json():
    assert json_depth(b"1") == 0 and json_depth(b'"[[["') == 0 and json_depth(b'{"a": [1, {"b": "]"}]}') == 3
    assert json_depth(b'["\\"[", [[]]]') == 3  # an escaped quote does not end the string
    deep = b"[" * 100_000 + b"]" * 100_000
    assert json_depth(deep) == 100_000
    with pytest.raises(ValueError, match=r"nested 100000 deep, over the limit of 64 \(max_json_depth\)"):
        parse_json(deep, 64)
    doc = {"k": 3, "inputs": {"user_id": list(range(1000)), "x": [0.5, -1e300, 3]}}
    text = json.dumps(doc).encode()
    assert parse_json(text, 64) == parse_json(text, 64, yielding=True) == doc


# ------------------------------------------------------------------------------------------------------ HTTP


@pytest.fixture(scope="module")
def store():
    return demo_store()[0]


@pytest.fixture(scope="module")
def leaf(store):
    server = ServerConfig(max_rows=100, max_decoded_bytes=64 << 20, body_timeout_s=2.0)
    with Leaf(LeafConfig(store, *KEY, batch_buckets=(BATCH,), warmup=True, server=server)) as started:
        yield started


@pytest.fixture(scope="module")
def root(store, leaf):
    server = ServerConfig(max_rows=100, max_decoded_bytes=64 << 20)
    with Root(RootConfig(store, (LeafAddress(*KEY, leaf.url),), server=server)) as started:
        yield started


def test_compression_bombs_are_413_on_predict_at_the_root_and_the_leaf(root, leaf, big_bomb):
    for server in (root, leaf):
        for body, limit in ((big_bomb, "max_rows"), (bomb(50, 1 << 20, "lz4"), "max_decoded_bytes")):
            allocated = pa.total_allocated_bytes()
            status, _, answer = post(server.url, "/predict", body)
            assert status == 413, answer
            error = json.loads(answer)
            assert error["limit"] == limit and limit in error["error"] and error["reason"] == "decode_limit"
            assert pa.total_allocated_bytes() - allocated < 16 << 20  # refused before decompressing
    assert leaf.metrics.total("bad_requests") >= 2


def test_decode_limits_hold_on_the_learned_layout_paths(root, leaf):
    """A first request teaches the root a body recipe and the leaf a layout (no decoding for later bodies of that
    layout); bodies over the limit are refused before and after, and never learned."""
    for rows in (BATCH, 101, BATCH, 101):
        for server in (root, leaf):
            status, _, answer = post(server.url, "/predict", request_body(rows, seed=rows))
            if rows <= 100:
                assert status == 200, answer
            else:
                assert status == 413 and json.loads(answer)["limit"] == "max_rows", answer
    assert root._layouts.find(request_body(BATCH, 1)) is not None  # the fast path was taken
    assert leaf._layouts.find(request_body(BATCH, 1)) is not None
    assert root._layouts.find(request_body(101, 1)) is None and leaf._layouts.find(request_body(101, 1)) is None


class Trickle:
    """A client that sends a request's headers and then its body a byte at a time, slowly (slow loris)."""

    def __init__(self, url: str, path: str, length: int = 10_000):
        host, port = url.split("//")[1].split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {wire.MEDIA_TYPE}\r\nContent-Length: {length}\r\n\r\n"
        self.sock.sendall(head.encode())

    def drip(self) -> None:
        try:
            self.sock.sendall(b"\xff")
        except OSError:
            pass

    def answer(self) -> bytes:
        self.sock.settimeout(30)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def test_slow_uploads_hold_no_in_flight_slot(leaf):
    """64 connections trickling bodies (the default in-flight bound is 64) while a keep-alive client keeps getting
    200s; the trickling ones get 408 once the body timeout (2 s here) passes."""
    body = request_body(BATCH)
    slow = [Trickle(leaf.url, "/predict") for _ in range(64)]
    stop = threading.Event()

    def drip():
        while not stop.is_set():
            for t in slow:
                t.drip()
            time.sleep(0.1)

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        time.sleep(0.5)  # every slow request has arrived and is sending its body
        host, port = leaf.url.split("//")[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        statuses = []
        for _ in range(10):
            conn.request("POST", "/predict", body=body, headers={"Content-Type": wire.MEDIA_TYPE})
            resp = conn.getresponse()
            resp.read()
            statuses.append(resp.status)
        conn.close()
        assert statuses == [200] * 10
    finally:
        stop.set()
        dripper.join()
    try:
        answers = [t.answer() for t in slow]
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), {a[:12] for a in answers}
        assert b"body_timeout_s" in answers[0] or b"within 2 s" in answers[0]
    finally:
        for t in slow:
            t.close()


# ------------------------------------------------------------------------------------------------ request ids


def test_a_500_carries_a_request_id_never_the_exception_text(caplog):
    def broken(request):
        raise RuntimeError("secret path /etc/keys and another user's value 1234")

    async def echo(request):
        return Response.json({"request_id": request.request_id})

    service = Service(
        [Route("GET", "/broken", broken), Route("GET", "/echo", echo)], ServerConfig(), name="t", metrics_prefix="t"
    )
    server = BackgroundServer(service).start()
    try:
        host, port = server.url.split("//")[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        with caplog.at_level(logging.ERROR, logger="jaxscale.infra.http_server"):
            conn.request("GET", "/broken", headers={"X-Request-Id": "client-id-42"})
            resp = conn.getresponse()
            body = resp.read()
        assert resp.status == 500 and json.loads(body) == {"error": "internal error", "request_id": "client-id-42"}
        assert resp.getheader("X-Request-Id") == "client-id-42" and b"secret" not in body
        logged = [r for r in caplog.records if "client-id-42" in r.getMessage()]
        assert logged and "secret path" in str(logged[0].exc_info[1])  # the log has the exception, with the id
        conn.request("GET", "/broken")  # no id sent: one is made, answered and logged
        resp = conn.getresponse()
        made = json.loads(resp.read())["request_id"]
        assert len(made) == 32 and resp.getheader("X-Request-Id") == made
        assert any(made in r.getMessage() for r in caplog.records)
        conn.request("GET", "/echo", headers={"X-Request-Id": "bad id\twith spaces" + "x" * 200})
        resp = conn.getresponse()
        echoed = json.loads(resp.read())["request_id"]
        assert resp.status == 200 and echoed == resp.getheader("X-Request-Id") and " " not in echoed
    finally:
        server.stop()


def test_the_root_sends_its_request_id_to_the_leaves(store):
    """A leaf's bug answers the root's request id: the root passes X-Request-Id on (and the leaf's 500 as a 503 +
    Retry-After: every 5xx of the root is a 503 or a 504)."""
    seen = []

    async def broken_predict(request):
        seen.append(request.request_id)
        raise RuntimeError("leaf internals")

    stub = Service([Route("POST", "/predict", broken_predict)], ServerConfig(), name="stub", metrics_prefix="stub")
    leaf = BackgroundServer(stub).start()
    try:
        with Root(RootConfig(store, (LeafAddress(*KEY, leaf.url),))) as root:
            status, headers, answer = post(root.url, "/predict", request_body(BATCH), {"X-Request-Id": "trace-7"})
    finally:
        leaf.stop()
    assert status == 503 and headers["x-request-id"] == "trace-7" and seen == ["trace-7"]
    assert int(headers["retry-after"]) >= 1
    error = json.loads(answer)
    assert error["reason"] == "leaf_failed" and error["leaf_status"] == 500
    assert error["request_id"] == "trace-7" and error["leaf"] == "ctr/1" and b"internals" not in answer


# ---------------------------------------------------------------------------------------------------- the CLI


def test_every_limit_is_settable_from_every_server_cli(store, tmp_path):
    from jaxscale.sequences.cli import build_parser
    from jaxscale.serving.leaf import parse_config as leaf_config
    from jaxscale.serving.root import parse_config as root_config

    flags = [
        "--max-body-bytes", "1000", "--body-timeout", "2.5", "--max-decoded-bytes", "5000", "--max-rows", "7",
        "--max-json-depth", "9", "--parse-offload-bytes", "11",
    ]  # fmt: skip
    want = dict(
        max_body_bytes=1000, body_timeout_s=2.5, max_decoded_bytes=5000, max_rows=7, max_json_depth=9,
        parse_offload_bytes=11,
    )  # fmt: skip
    root = root_config(["--store", str(store), "--leaf", "ctr/1=http://127.0.0.1:1", "--leaf-timeout", "3", *flags])
    leaf = leaf_config(["--store", str(store), "--model", "ctr", "--version", "1", *flags])
    assert root.leaf_timeout_s == 3.0
    from jaxscale.infra.http_server import server_options

    args = build_parser().parse_args(["serve", "--store", str(tmp_path), "--port", "0", *flags])
    sequences = ServerConfig(**server_options(args))
    for config in (root.server, leaf.server, sequences):
        assert {k: getattr(config, k) for k in want} == want
    with pytest.raises(ValueError, match="body_timeout_s"):
        ServerConfig(body_timeout_s=0)
    with pytest.raises(ValueError, match="max_rows"):
        ServerConfig(max_rows=0)
