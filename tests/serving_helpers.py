"""Shared by the serving tests: the demo model store, exported once per test process, and its leaves."""

import atexit
import contextlib
import functools
import shutil
import tempfile
from pathlib import Path

from jaxscale.serving import demo


@functools.cache
def demo_store() -> tuple[Path, list]:
    """(store directory, signatures) of the six demo model versions; removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix="jaxscale-serving-store-"))
    atexit.register(shutil.rmtree, path, True)
    return path, demo.export_demo(path)


@contextlib.contextmanager
def running_leaves(store: Path, keys, batch: int):
    """One started, warmed-up `Leaf` per (model, version) in `keys`, serving `store` at batch `batch`;
    stopped on exit."""
    from jaxscale.serving.leaf import Leaf, LeafConfig

    started = {key: Leaf(LeafConfig(store, *key, batch_buckets=(batch,), warmup=True)).start() for key in keys}
    try:
        yield started
    finally:
        for leaf in started.values():
            leaf.stop()


_POLLER = r"""
import http.client, sys, time
host, port = sys.argv[1], int(sys.argv[2])
conn = http.client.HTTPConnection(host, port, timeout=60)
while True:
    t = time.monotonic()
    conn.request("GET", "/healthz")
    resp = conn.getresponse()
    resp.read()
    print(t, time.monotonic() - t, resp.status, flush=True)
    time.sleep(0.01)
"""


def healthz_during(url: str, work) -> tuple[list[float], float, object]:
    """(latencies of the /healthz requests that overlapped ``work()``, seconds ``work()`` took, what it returned).

    /healthz is asked by another process over one keep-alive connection: a client thread in this process would
    stall with the server whenever the server holds the GIL, and never see the stall."""
    import subprocess
    import sys
    import time

    host, port = url.split("//")[1].split(":")
    poller = subprocess.Popen([sys.executable, "-c", _POLLER, host, port], stdout=subprocess.PIPE, text=True)
    try:
        first = poller.stdout.readline()  # polling has started
        assert first.split()[2] == "200", first
        t0 = time.monotonic()
        out = work()
        t1 = time.monotonic()
        time.sleep(0.05)
    finally:
        poller.terminate()
        rest, _ = poller.communicate(timeout=30)
    samples = [tuple(map(float, line.split()[:2])) for line in rest.splitlines() if line.strip()]
    return [lat for t, lat in samples if t <= t1 and t + lat >= t0], t1 - t0, out


class StubLeaf:
    """A leaf stand-in on 127.0.0.1 (the shared HTTP layer, no model): ``/predict`` answers a score of 0.5 per row,
    ``:retrieve`` answers JSON naming ``label``; or as ``behave`` says (set per test): ("ok",), ("sleep", seconds),
    ("status", code, headers). Records each call's headers and cancellations; ``/readyz`` is the layer's own."""

    def __init__(self, label: str = "stub"):
        from jaxscale.infra.http_server import BackgroundServer, Route, ServerConfig, Service

        self.label, self.behave = label, ("ok",)
        self.calls, self.cancelled = [], []
        routes = [Route("POST", "/predict", self._predict), Route("POST", "/v1/models/{name}:retrieve", self._retrieve)]
        service = Service(routes, ServerConfig(), name="stub", metrics_prefix="stub", cancel_on_disconnect=True)
        self.server = BackgroundServer(service).start()
        self.url = self.server.url

    async def _misbehave(self):
        import asyncio
        import time

        from jaxscale.infra.http_server import Response

        kind, *args = self.behave
        if kind == "sleep":
            try:
                await asyncio.sleep(args[0])
            except asyncio.CancelledError:
                self.cancelled.append(time.monotonic())
                raise
        if kind == "status":
            return Response.json({"error": f"stub says {args[0]}"}, args[0], args[1])
        return None

    async def _predict(self, request):
        import numpy as np

        from jaxscale.infra.http_server import Response
        from jaxscale.serving import wire

        self.calls.append(request.headers)
        answer = await self._misbehave()
        if answer is not None:
            return answer
        rows = wire.decode(request.body).num_rows
        return Response(200, wire.encode({"score": np.full(rows, 0.5, np.float32)}), wire.MEDIA_TYPE)

    async def _retrieve(self, request):
        from jaxscale.infra.http_server import Response

        self.calls.append(request.headers)
        answer = await self._misbehave()
        return answer if answer is not None else Response.json({"item_ids": [[1, 2]], "stub": self.label})

    def stop(self):
        self.server.stop()
