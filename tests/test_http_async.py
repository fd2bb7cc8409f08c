"""The HTTP layer's fast path (`jaxscale.infra.http_server`): async handlers on the event loop (in the in-flight bound,
errors as JSON), `AsyncClient` (keep-alive, one retry on a connection the server dropped, clear errors), `Offload`
(short calls inline, long ones in threads) and uvloop; the leaf's predictions are the same inline and in threads."""

import asyncio
import json
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import free_port
from test_http_server import connection, get

from jaxscale.infra.http_server import (
    AsyncClient,
    BackgroundServer,
    HTTPError,
    Offload,
    Response,
    Route,
    ServerConfig,
    Service,
)
from jaxscale.serving import wire
from jaxscale.serving.export import UnusedFeatureWarning, export_model
from jaxscale.serving.leaf import Leaf, LeafConfig
from jaxscale.serving.signature import FeatureSpec


def serve(routes, **config) -> BackgroundServer:
    return BackgroundServer(Service(routes, ServerConfig(**config), name="t", metrics_prefix="t")).start()


# ------------------------------------------------------------------------------------------------ async handlers


def test_async_handlers_run_on_the_loop_and_count_in_the_in_flight_bound():
    server = None
    release = threading.Event()

    async def wait(request):
        while not release.is_set():
            await asyncio.sleep(0.01)
        return Response.json({"thread": threading.get_ident()})

    server = serve([Route("GET", "/wait", wait)], max_in_flight=3, retry_after_s=2)
    try:

        def call(_):
            conn = connection(server.url)
            try:
                status, headers, body = get(conn, "/wait")
                return status, headers.get("Retry-After"), body
            finally:
                conn.close()

        with ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(call, i) for i in range(12)]
            deadline = time.monotonic() + 10
            while server.service.in_flight < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)  # the others arrive while 3 are held
            release.set()
            results = [f.result() for f in futures]
        statuses = [s for s, _, _ in results]
        assert set(statuses) == {200, 503} and statuses.count(200) >= 3, statuses
        assert all(retry == "2" for s, retry, _ in results if s == 503)
        loop_thread = server._thread.ident
        assert all(json.loads(body)["thread"] == loop_thread for s, _, body in results if s == 200)
        assert server.service.in_flight == 0
    finally:
        release.set()
        server.stop()


def test_async_handler_errors_become_json_answers():
    async def refuse(request):
        raise HTTPError(418, {"error": "a teapot"})

    async def broken(request):
        raise KeyError("boom")

    server = serve([Route("GET", "/refuse", refuse), Route("GET", "/broken", broken)])
    try:
        conn = connection(server.url)
        status, _, body = get(conn, "/refuse")
        assert status == 418 and json.loads(body) == {"error": "a teapot"}
        status, _, body = get(conn, "/broken")
        assert status == 500 and json.loads(body)["error"] == "internal error"  # never the exception's text
        assert "boom" not in body.decode() and json.loads(body)["request_id"]
        assert get(conn, "/healthz")[0] == 200  # the same connection goes on
    finally:
        server.stop()
    with pytest.raises(ValueError, match="inline is for plain handlers"):
        Route("GET", "/x", refuse, inline=True)


def test_uvloop_by_default_asyncio_on_request():
    async def which(request):
        return Response.json({"loop": type(asyncio.get_running_loop()).__module__})

    for uvloop, expected in ((True, "uvloop"), (False, "asyncio.unix_events")):
        server = serve([Route("GET", "/loop", which)], uvloop=uvloop)
        try:
            assert json.loads(get(connection(server.url), "/loop")[2])["loop"] == expected
        finally:
            server.stop()


# ---------------------------------------------------------------------------------------------------- AsyncClient


class CountingServer:
    """A raw HTTP/1.1 server: counts connections and, after ``answers`` answers on one, drops it when the next
    request arrives (unannounced, as a server whose keep-alive timer fired just as the request was sent)."""

    def __init__(self, answers: int):
        self.answers, self.connections = answers, 0

    async def handle(self, reader, writer):
        self.connections += 1
        try:
            for _ in range(self.answers):
                head = (await reader.readuntil(b"\r\n\r\n")).lower().split(b"\r\n")
                length = next((int(h.split(b":")[1]) for h in head if h.startswith(b"content-length")), 0)
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok")
                await writer.drain()
            await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):  # the client closed first
            pass
        writer.close()


def test_async_client_keeps_alive_retries_a_dropped_connection_and_names_failures():
    async def scenario():
        raw = CountingServer(answers=4)
        tcp = await asyncio.start_server(raw.handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{tcp.sockets[0].getsockname()[1]}"
        client = AsyncClient(url, timeout_s=10)
        try:
            answers = [await client.request("POST", "/p", b"x" * 100) for _ in range(4)]
            assert [(s, b) for s, _, b in answers] == [(200, b"ok")] * 4 and raw.connections == 1  # kept alive
            status, headers, body = await client.request("POST", "/p", b"y")  # dropped, retried on a new one
            assert (status, body, headers["content-type"]) == (200, b"ok", "text/plain") and raw.connections == 2
        finally:
            await client.close()
            tcp.close()
        dead = AsyncClient(f"http://127.0.0.1:{free_port()}", timeout_s=5)
        with pytest.raises(ConnectionError, match="cannot connect to http://127.0.0.1"):
            await dead.request("GET", "/")
        await dead.close()

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="URL must be http"):
        AsyncClient("ftp://x")


def test_async_client_is_bound_to_one_loop():
    client = AsyncClient("http://127.0.0.1:9")

    async def first():
        client._session_here()

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(first())
        with pytest.raises(RuntimeError, match="bound to another event loop"):
            asyncio.run(first())
    finally:
        loop.run_until_complete(client.close())
        loop.close()


# -------------------------------------------------------------------------------------------------------- Offload


def test_offload_runs_short_calls_inline_and_long_ones_in_threads():
    async def scenario():
        here = threading.get_ident()
        fast = Offload(workers=2, budget_s=1.0)
        threads = [await fast.run("k", threading.get_ident) for _ in range(3)]
        assert threads[0] != here and threads[1:] == [here, here]  # unmeasured: a thread first, then inline
        assert (fast.inline_calls, fast.pooled_calls) == (2, 1) and fast.cost("k") < 1.0

        def slow():
            time.sleep(0.05)
            return threading.get_ident()

        tight = Offload(workers=2, budget_s=0.01)
        assert all([await tight.run("slow", slow) != here for _ in range(3)])
        assert tight.cost("slow") >= 0.05 and tight.inline_calls == 0
        tight.measure("seeded", lambda: None)  # a warm-up measurement: the first real call is inline
        assert await tight.run("seeded", threading.get_ident) == here

        never = Offload(workers=1, budget_s=0)
        assert all([await never.run("k", threading.get_ident) != here for _ in range(3)])
        for offload in (fast, tight, never):
            offload.shutdown()
        assert await fast.run("new", threading.get_ident) != here  # a shut-down pool restarts on demand
        fast.shutdown()

    asyncio.run(scenario())
    with pytest.raises(ValueError, match="budget_s must be a number >= 0"):
        Offload(1, -1.0)
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        Offload(0, 0.1)


# ------------------------------------------------------------------------------------------------------- the leaf

SPECS = (FeatureSpec("dense", "float32", (3,)), FeatureSpec("ids", "int32", (4,)))


def tiny(f):
    return {"score": jnp.tanh(f["dense"].sum(-1) + f["ids"].sum(-1).astype(jnp.float32) / 10)}


def test_leaf_predicts_the_same_inline_and_in_threads(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedFeatureWarning)
        export_model(tiny, SPECS, model="tiny", version="1", store=tmp_path)
    rng = np.random.default_rng(0)
    features = {"dense": rng.standard_normal((8, 3)).astype(np.float32), "ids": rng.integers(0, 9, (8, 4), np.int32)}
    expected = np.tanh(features["dense"].sum(-1) + features["ids"].sum(-1) / 10)
    answers = {}
    for budget in (10.0, 0.0):  # every warm call inline / every call in a thread
        config = LeafConfig(tmp_path, "tiny", "1", batch_buckets=(8,), warmup=True, inline_budget_s=budget)
        with Leaf(config) as leaf:
            conn = connection(leaf.url)
            for _ in range(3):
                conn.request("POST", "/predict", body=wire.encode(features), headers={"Content-Type": wire.MEDIA_TYPE})
                resp = conn.getresponse()
                assert resp.status == 200
                answers[budget] = wire.to_numpy(wire.decode(resp.read()), "score")
            calls = (leaf._offload.inline_calls, leaf._offload.pooled_calls)
        assert calls == ((3, 0) if budget else (0, 3))
        np.testing.assert_allclose(answers[budget], expected, rtol=1e-5, atol=1e-6)
    assert answers[10.0].tobytes() == answers[0.0].tobytes()
    with pytest.raises(ValueError, match="inline_budget_s must be a number >= 0"):
        LeafConfig(tmp_path, "tiny", "1", inline_budget_s=-1)
