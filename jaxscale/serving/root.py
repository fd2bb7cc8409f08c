"""The root server: receives requests carrying many features and fans out to the leaves, sending each leaf only
the features its model's signature says it uses.

    POST /predict[?models=m/v,...]   Arrow IPC features -> Arrow IPC outputs, columns "<model>/<version>/<output>"
    GET  /routes                     the current map model/version -> allowed features (JSON)
    POST /admin/reload               rescan the signatures now; answers the new map
    POST /v1/models/{name}:retrieve  a retrieve request (`jaxscale.serving.retrieval`), trimmed to user_id + the
                                     query step's features, forwarded to the model's leaf (?version= picks one)
    GET  /metrics                    Prometheus text (the HTTP layer's metrics and the root's own)
    GET  /healthz

Served by the shared HTTP layer (`jaxscale.http_server`); with a tokens file, /predict needs a token granting
every model it targets (all served models when ``models`` is absent), /admin/reload one granting "admin".

The fast path: /predict is an ``async def`` handler on the server's event loop from end to end. Decoding,
checking and trimming run inline (the schema and the per-leaf plans are cached, trimming is zero-copy), and the
leaves are called concurrently over keep-alive `AsyncClient` connections (aiohttp, ``TCP_NODELAY``; https with
``leaf_ca_file``, a bearer token with ``leaf_token``) on the same loop: no thread hand-off anywhere on the
request's path. `Root.fan_out` is the same fan-out for Python callers (blocking `Client`s, threads).
A body laid out like one already decoded (same length, framing, schema and batch metadata: `wire.LayoutCache`)
is not decoded at all: it is planned from the known schema, and each uncompressed leaf body is cut from its bytes
by a recipe learned (and checked byte for byte against `wire.encode`) on the layout's first request.

Bodies are bounded by the server's `ServerConfig` limits: bytes on the wire and the time to send them (the HTTP
layer: 413, 408), and what an Arrow body decodes to (``max_decoded_bytes``, ``max_rows``: `wire.DecodeLimits`,
413 naming the limit), checked from the IPC metadata before anything is decompressed, and on the learned-layout
path (which does not decode) from what the layout decoded to when learned, so a body re-encoded per leaf is
bounded too. A body of at least ``parse_offload_bytes`` is decoded, planned and cut into leaf bodies in a thread,
off the event loop.

Adding a route (e.g. ``POST /v1/models/{name}:retrieve``) the same way: an ``async def`` handler that decodes
inline, gets its plans from ``self._plan(batch, models)`` (or its own planner), sends each leaf's body with
``await self._async_clients[(model, version)].request("POST", path, body, headers)`` (through a helper like
`_call_leaf_async`, which counts the metrics and turns a leaf's failure into `LeafCallError`) and maps the
errors to statuses as `_predict` does; then list it in `routes_http` with its ``resources``.

A request's ``X-Request-Id`` (the client's or the one the HTTP layer made) is sent on to the leaves it calls, so a
leaf's log line and its 500's ``request_id`` carry the root's id.

Response headers: ``X-Jaxscale-Routes-Generation`` (the map the request used) and ``X-Jaxscale-Fanout``
(JSON: per leaf, the features and bytes sent and whether it failed open).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from jaxscale.http_server import (
    JSON,
    REQUEST_ID_HEADER,
    AsyncClient,
    BackgroundServer,
    Client,
    HTTPError,
    Request,
    Response,
    Route,
    ServerConfig,
    Service,
    add_server_arguments,
    off_loop,
    serve_until_signal,
    server_options,
)
from jaxscale.serving import wire
from jaxscale.serving.metrics import MetricDef, Metrics
from jaxscale.serving.retrieval import TIMINGS_HEADER, trim_retrieve_request
from jaxscale.serving.routes import OK, RouteTable
from jaxscale.serving.signature import FeatureError, SignatureError, check_name
from jaxscale.serving.trim import FanoutPlanner, LeafPlan, trim_batch

log = logging.getLogger(__name__)

GENERATION_HEADER = "X-Jaxscale-Routes-Generation"
FANOUT_HEADER = "X-Jaxscale-Fanout"

ROOT_METRICS = (
    MetricDef("requests", "counter", "predict requests answered, by HTTP status", ("status",)),
    MetricDef("bad_requests", "counter", "predict requests refused (400), by reason", ("reason",)),
    MetricDef("leaf_requests", "counter", "requests sent to a leaf", ("model", "version")),
    MetricDef("leaf_request_bytes", "counter", "body bytes sent to a leaf (on the wire)", ("model", "version")),
    MetricDef("features_sent", "counter", "feature columns sent to a leaf", ("model", "version")),
    MetricDef("features_trimmed", "counter", "request feature columns not sent to a leaf", ("model", "version")),
    MetricDef(
        "fail_open_requests",
        "counter",
        "leaf requests sent untrimmed because the signature was missing or unreadable",
        ("model", "version", "reason"),
    ),
    MetricDef("leaf_errors", "counter", "leaf calls that failed (connection error or non-200)", ("model", "version")),
    MetricDef("trim_seconds", "counter", "wall time spent checking signatures, planning and cutting payloads"),
    MetricDef("reloads", "counter", "route map reloads"),
    MetricDef("routes_generation", "gauge", "generation of the route map in use"),
    MetricDef("signatures_unavailable", "gauge", "model versions whose signature is missing or unreadable"),
)


@dataclass(frozen=True)
class LeafAddress:
    model: str
    version: str
    url: str

    def __post_init__(self):
        check_name("model", self.model)
        check_name("version", self.version)

    @classmethod
    def parse(cls, text: str) -> LeafAddress:
        """``model/version=http://host:port``"""
        key, sep, url = text.partition("=")
        model, slash, version = key.partition("/")
        if not sep or not slash:
            raise ValueError(f"leaf must be model/version=http://host:port, got {text!r}")
        return cls(model, version, url)


@dataclass(frozen=True)
class RootConfig:
    """``trim=False`` sends every leaf the whole request (the baseline; signatures are still checked).
    ``rescan_interval_s > 0`` rescans the store in the background; `/admin/reload` always works."""

    store: str | Path
    leaves: tuple[LeafAddress, ...]
    trim: bool = True
    compression: str | None = None  # None | "zstd" | "lz4": Arrow IPC buffer compression of leaf requests
    rescan_interval_s: float = 0.0
    leaf_timeout_s: float = 30.0
    server: ServerConfig = field(default_factory=ServerConfig)  # host, port, in-flight bound, tokens, TLS, ...
    leaf_ca_file: str | Path | None = None  # CA that signed the leaves' certificates (https leaves)
    leaf_token: str | None = field(default=None, repr=False)  # bearer token sent to the leaves

    def __post_init__(self):
        object.__setattr__(self, "leaves", tuple(self.leaves))
        keys = [(a.model, a.version) for a in self.leaves]
        if not keys:
            raise ValueError("a root needs at least one leaf")
        if len(set(keys)) != len(keys):
            raise ValueError(f"a model version is served by one leaf; duplicates in {keys}")
        if self.compression not in wire.COMPRESSIONS:
            raise ValueError(f"compression must be one of {wire.COMPRESSIONS}, got {self.compression!r}")
        if not isinstance(self.leaf_timeout_s, (int, float)) or not self.leaf_timeout_s > 0:
            raise ValueError(f"leaf_timeout_s must be a number > 0, got {self.leaf_timeout_s!r}")


@dataclass
class LeafResult:
    """What one leaf was sent (plan, body bytes) and what it answered."""

    plan: LeafPlan
    bytes_sent: int
    outputs: pa.RecordBatch | None = None

    def summary(self) -> dict:
        return {
            "features": len(self.plan.send) if self.plan.send is not None else None,
            "bytes": self.bytes_sent,
            "fail_open": self.plan.fail_open,
        }


@dataclass
class FanoutResult:
    """One request's fan-out: the route-map generation it used and each leaf's result, keyed "model/version"."""

    generation: int
    leaves: dict[str, LeafResult] = field(default_factory=dict)

    def outputs(self) -> dict[str, dict[str, np.ndarray]]:
        """``{"model/version": {output: array}}``"""
        return {k: {n: wire.to_numpy(r.outputs, n) for n in r.outputs.schema.names} for k, r in self.leaves.items()}

    def to_batch(self) -> pa.RecordBatch:
        cols, names = [], []
        for key, r in self.leaves.items():
            for name, col in zip(r.outputs.schema.names, r.outputs.columns):
                cols.append(col)
                names.append(f"{key}/{name}")
        return pa.RecordBatch.from_arrays(cols, names=names)


class _Run:
    """A call made now on the calling thread, read back like a `Future` (``result()`` returns or re-raises)."""

    def __init__(self, fn, *args):
        try:
            self._value, self._error = fn(*args), None
        except Exception as e:
            self._value, self._error = None, e

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value


_PASSED_ON = (400, 413)  # a leaf's answers about the request itself, passed on as they are (anything else: 502)
_MAX_RECIPES = 16  # leaf plans per request layout whose body recipe the root keeps


@dataclass(frozen=True)
class _LeafBodyRecipe:
    """A leaf body cut from the request's bytes: the body encoded for the first request of a layout, with the
    ranges holding column values zeroed (``template``), and where each range's bytes come from in the request."""

    template: bytes
    copies: tuple[tuple[int, int, int], ...]  # (offset in the leaf body, offset in the request, length)

    def apply(self, body: bytes) -> bytes:
        out, src = bytearray(self.template), memoryview(body)
        for to, at, n in self.copies:
            out[to : to + n] = src[at : at + n]
        return bytes(out)

    @classmethod
    def learn(cls, request: bytes, payload: pa.RecordBatch, encoded: bytes) -> _LeafBodyRecipe | None:
        """The recipe that turns ``request`` into ``encoded`` (``payload``, zero-copy columns of the request, as
        `wire.encode` wrote it, uncompressed), or None when some value bytes are not a plain copy of the request's."""
        sent = wire.decode(encoded)  # its buffers are views of ``encoded``
        request_at, encoded_at = pa.py_buffer(request).address, pa.py_buffer(encoded).address
        if payload.num_columns != sent.num_columns or payload.num_rows != sent.num_rows:
            return None
        copies = []  # must cover every buffer written: any other byte of ``encoded`` is metadata or padding
        for ours, theirs in zip(payload.columns, sent.columns):
            mine, written = ours.buffers(), theirs.buffers()
            if len(mine) != len(written) or ours.offset != 0:
                return None
            for a, b in zip(mine, written):
                if b is None or b.size == 0:
                    continue
                if a is None or b.size > a.size:
                    return None
                at, to = a.address - request_at, b.address - encoded_at
                if at < 0 or at + b.size > len(request) or to < 0 or to + b.size > len(encoded):
                    return None
                copies.append((to, at, b.size))
        template = bytearray(encoded)
        for to, _, n in copies:
            template[to : to + n] = bytes(n)
        recipe = cls(bytes(template), tuple(copies))
        return recipe if recipe.apply(request) == encoded else None


@dataclass
class _KnownLayout:
    """A request layout the root decoded before (`wire.LayoutCache`): what planning and counting read of the
    batch (schema and shape), and per leaf plan the recipe of its body (None = encode from a decoded batch)."""

    schema: pa.Schema
    num_rows: int
    num_columns: int
    recipes: dict[LeafPlan, _LeafBodyRecipe | None] = field(default_factory=dict)


class UnknownModelError(ValueError):
    """A request names a model version no leaf of this root serves."""


class LeafCallError(Exception):
    """A leaf call failed: ``status`` 400 (413) when the leaf refused the request (its JSON ``payload`` names the
    feature or the limit, and the leaf), 502 when it was unreachable or answered something unusable."""

    def __init__(self, status: int, payload: dict):
        super().__init__(payload.get("error", ""))
        self.status, self.payload = status, payload


class Root:
    """Checks each request against the target leaves' signatures, trims it per leaf and calls them in parallel."""

    def __init__(self, config: RootConfig):
        self.config = config
        self.metrics = Metrics("jaxscale_root", ROOT_METRICS)
        self.targets = tuple((a.model, a.version) for a in config.leaves)
        self._clients = {
            (a.model, a.version): Client(
                a.url, config.leaf_timeout_s, ca_file=config.leaf_ca_file, token=config.leaf_token
            )
            for a in config.leaves
        }
        self._async_clients = {  # the HTTP path's: bound to the server's event loop on first use
            (a.model, a.version): AsyncClient(
                a.url, config.leaf_timeout_s, ca_file=config.leaf_ca_file, token=config.leaf_token
            )
            for a in config.leaves
        }
        self._planner = FanoutPlanner()
        self._layouts = wire.LayoutCache()  # request layouts seen (uncompressed leaf bodies are cut from the bytes)
        self._limits = wire.DecodeLimits(config.server.max_decoded_bytes, config.server.max_rows)
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.targets)), thread_name_prefix="root-fanout")
        self.routes = RouteTable(config.store, self.targets, on_publish=self._published)
        if config.rescan_interval_s > 0:
            self.routes.watch(config.rescan_interval_s)
        self._server: BackgroundServer | None = None

    def _published(self, routes) -> None:
        self.metrics.inc("reloads")
        self.metrics.set("routes_generation", routes.generation)
        self.metrics.set("signatures_unavailable", sum(e.status != OK for e in routes.entries.values()))

    def reload(self):
        """Rescan the store now and swap in the new map (also `POST /admin/reload`)."""
        return self.routes.reload()

    def fail_open_count(self) -> int:
        """Leaf requests sent untrimmed because a signature was missing or unreadable."""
        return int(self.metrics.total("fail_open_requests"))

    # --------------------------------------------------------------------------------------------- fan-out

    def _select_targets(self, models: Sequence[str] | None) -> list[tuple[str, str]]:
        if not models:
            return list(self.targets)
        out = []
        for m in models:
            model, _, version = m.partition("/")
            if (model, version) not in self._clients:
                served = [f"{a}/{b}" for a, b in self.targets]
                raise UnknownModelError(f"no leaf serves model {m!r} (served: {served})")
            if (model, version) in out:
                raise UnknownModelError(f"model {m!r} is listed twice")
            out.append((model, version))
        return out

    def _trimmed(self, plan: LeafPlan, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, bytes]:
        """(what one leaf is sent, its encoded body): the batch trimmed to the leaf's plan (timed in the metrics)."""
        t0 = time.perf_counter()
        payload = trim_batch(batch, plan)
        self.metrics.inc("trim_seconds", time.perf_counter() - t0)
        return payload, wire.encode(payload, self.config.compression)

    def _leaf_body(self, plan: LeafPlan, batch: pa.RecordBatch, body: bytes | None = None) -> bytes:
        """The body one leaf is sent (trimmed, encoded; or ``body`` when already cut), counted in the metrics."""
        if body is None:
            _, body = self._trimmed(plan, batch)
        labels = {"model": plan.model, "version": plan.version}
        self.metrics.inc("leaf_requests", **labels)
        self.metrics.inc("leaf_request_bytes", len(body), **labels)
        sent = len(plan.send) if plan.send is not None else batch.num_columns
        self.metrics.inc("features_sent", sent, **labels)
        self.metrics.inc("features_trimmed", batch.num_columns - sent, **labels)
        if plan.fail_open:
            self.metrics.inc("fail_open_requests", reason=plan.fail_open, **labels)
        return body

    def _learn_leaf_body(self, known: _KnownLayout, request: bytes, batch: pa.RecordBatch, plan: LeafPlan) -> bytes:
        """The body a leaf is sent (trimmed, encoded), and the recipe that cuts it from the request's bytes learned
        for the request's layout (once per plan: None when it sends everything, compresses or cannot be cut)."""
        payload, body = self._trimmed(plan, batch)
        if plan not in known.recipes and len(known.recipes) < _MAX_RECIPES:
            cut = plan.send is not None and self.config.compression is None
            known.recipes[plan] = _LeafBodyRecipe.learn(request, payload, body) if cut else None
        return body

    def _leaf_failed(self, plan: LeafPlan, url: str, error: OSError) -> LeafCallError:
        self.metrics.inc("leaf_errors", model=plan.model, version=plan.version)
        return LeafCallError(502, {"error": f"leaf {plan.label} at {url} unreachable: {error}"})

    def _leaf_result(self, plan: LeafPlan, batch: pa.RecordBatch, body: bytes, status: int, data: bytes):
        """A leaf's answer -> `LeafResult`, or raises `LeafCallError` (its 400 passed on, anything else 502)."""
        labels = {"model": plan.model, "version": plan.version}
        if status != 200:
            self.metrics.inc("leaf_errors", **labels)
            try:
                payload = json.loads(data)
            except ValueError:
                payload = {"error": data[:200].decode(errors="replace")}
            payload = {**payload, "leaf": plan.label}
            raise LeafCallError(status if status in _PASSED_ON else 502, payload)
        try:
            outputs = wire.decode(data)
        except wire.PayloadError as e:
            self.metrics.inc("leaf_errors", **labels)
            raise LeafCallError(502, {"error": f"leaf {plan.label} answered an unreadable body: {e}"}) from None
        if outputs.num_rows != batch.num_rows:
            raise LeafCallError(
                502,
                {
                    "error": f"leaf {plan.label} answered {outputs.num_rows} rows for {batch.num_rows}",
                    "leaf": plan.label,
                },
            )
        return LeafResult(plan, len(body), outputs)

    def _call_leaf(self, plan: LeafPlan, batch: pa.RecordBatch) -> LeafResult:
        body = self._leaf_body(plan, batch)
        client = self._clients[(plan.model, plan.version)]
        try:
            status, _, data = client.request("POST", "/predict", body, {"Content-Type": wire.MEDIA_TYPE})
        except OSError as e:
            raise self._leaf_failed(plan, client.url, e) from None
        return self._leaf_result(plan, batch, body, status, data)

    async def _call_leaf_async(
        self, plan: LeafPlan, batch: pa.RecordBatch, body: bytes | None = None, request_id: str = ""
    ) -> LeafResult:
        body = self._leaf_body(plan, batch, body)
        client = self._async_clients[(plan.model, plan.version)]
        headers = {"Content-Type": wire.MEDIA_TYPE, **({REQUEST_ID_HEADER: request_id} if request_id else {})}
        try:
            status, _, data = await client.request("POST", "/predict", body, headers)
        except OSError as e:
            raise self._leaf_failed(plan, client.url, e) from None
        return self._leaf_result(plan, batch, body, status, data)

    def _plan(self, batch, models: Sequence[str] | None):
        """-> (the route map, one plan per target leaf); raises `FeatureError` / `UnknownModelError`."""
        targets = self._select_targets(models)
        routes = self.routes.current()  # one snapshot for the whole fan-out
        t0 = time.perf_counter()
        plans = self._planner.plan(batch, routes, targets, trim=self.config.trim)
        self.metrics.inc("trim_seconds", time.perf_counter() - t0)
        return routes, plans

    @staticmethod
    def _collect(generation: int, plans: list[LeafPlan], outcomes: list) -> FanoutResult:
        result, errors = FanoutResult(generation), []
        for plan, outcome in zip(plans, outcomes):
            if isinstance(outcome, LeafCallError):
                errors.append(outcome)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                result.leaves[plan.label] = outcome
        if errors:
            raise min(errors, key=lambda e: e.status)  # a leaf's 400 (bad request) wins over a 502
        return result

    def fan_out(self, batch: pa.RecordBatch | Mapping[str, np.ndarray], models: Sequence[str] | None = None):
        """Check, trim and send one request to every target leaf (in parallel threads); -> `FanoutResult`.

        For Python callers; the HTTP route runs `fan_out_async` on the server's event loop.
        Raises `FeatureError` (bad request, names the feature and model) before calling any leaf.
        """
        if not isinstance(batch, pa.RecordBatch):
            batch = wire.to_record_batch(batch)
        routes, plans = self._plan(batch, models)
        # the last leaf is called on this thread (one leaf: no hand-off to the pool at all)
        futures = [self._pool.submit(self._call_leaf, plan, batch) for plan in plans[:-1]]
        futures.append(_Run(self._call_leaf, plans[-1], batch))
        outcomes = []
        for fut in futures:
            try:
                outcomes.append(fut.result())
            except LeafCallError as e:
                outcomes.append(e)
        return self._collect(routes.generation, plans, outcomes)

    async def fan_out_async(self, batch: pa.RecordBatch, models: Sequence[str] | None = None) -> FanoutResult:
        """`fan_out` on the running event loop: the leaves are called concurrently over `AsyncClient`s."""
        routes, plans = self._plan(batch, models)
        return await self._send_async(routes, plans, batch, [None] * len(plans))

    async def _send_async(self, routes, plans: list[LeafPlan], batch, bodies: list, request_id="") -> FanoutResult:
        if len(plans) == 1:
            try:
                outcomes = [await self._call_leaf_async(plans[0], batch, bodies[0], request_id)]
            except LeafCallError as e:
                outcomes = [e]
        else:
            calls = (self._call_leaf_async(plan, batch, body, request_id) for plan, body in zip(plans, bodies))
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
        return self._collect(routes.generation, plans, outcomes)

    async def _fan_out_body(self, body: bytes, models: Sequence[str], request_id: str = "") -> FanoutResult:
        """`fan_out_async` of a request body: `_prepare_body` (in a thread for a body of at least
        ``parse_offload_bytes``: decoding and encoding a big one would stall the event loop), then the sends."""
        threshold = self.config.server.parse_offload_bytes
        routes, plans, batch, bodies = await off_loop(len(body), threshold, self._prepare_body, body, models)
        return await self._send_async(routes, plans, batch, bodies, request_id)

    def _prepare_body(self, body: bytes, models: Sequence[str]):
        """-> (routes, plans, batch or known layout, leaf bodies). A body laid out like one decoded before
        (`wire.LayoutCache`) is not decoded: it is planned from the known schema, bounded by what that layout
        decoded to, and each leaf's body is cut from its bytes by the recipe learned then (the same bytes
        `wire.encode` would write). Any other body is decoded within the decode limits, and its layout learned."""
        known = self._layouts.find(body, self._limits)
        if known is not None:
            routes, plans = self._plan(known, models)
            recipes = [known.recipes.get(plan) for plan in plans]
            if all(r is not None for r in recipes):
                t0 = time.perf_counter()
                bodies = [r.apply(body) for r in recipes]
                self.metrics.inc("trim_seconds", time.perf_counter() - t0)
                return routes, plans, known, bodies
        batch = wire.decode(body, self._limits)
        routes, plans = self._plan(batch, models)
        if known is None:
            known = _KnownLayout(batch.schema, batch.num_rows, batch.num_columns)
            self._layouts.learn(body, known, batch)
        bodies = [self._learn_leaf_body(known, body, batch, plan) for plan in plans]
        return routes, plans, batch, bodies

    # ------------------------------------------------------------------------------------------------- HTTP

    async def _predict(self, request: Request) -> Response:
        status = 200
        try:
            ctype = request.headers.get("content-type", wire.MEDIA_TYPE).split(";")[0].strip()
            if ctype != wire.MEDIA_TYPE:
                status = 415
                raise HTTPError(415, {"error": f"Content-Type must be {wire.MEDIA_TYPE}, got {ctype!r}"})
            models = [m for m in request.query.get("models", "").split(",") if m]
            try:
                result = await self._fan_out_body(request.body, models, request.request_id)
            except wire.DecodeLimitError as e:
                status = 413
                self.metrics.inc("bad_requests", reason="decode_limit")
                raise HTTPError(413, e.to_json()) from None
            except wire.PayloadError as e:
                status = 400
                self.metrics.inc("bad_requests", reason="payload")
                raise HTTPError(400, {"error": str(e), "reason": "payload"}) from None
            except FeatureError as e:
                status = 400
                self.metrics.inc("bad_requests", reason=e.reason)
                raise HTTPError(400, e.to_json()) from None
            except LeafCallError as e:
                status = e.status
                if e.status == 400:
                    self.metrics.inc("bad_requests", reason=str(e.payload.get("reason", "leaf")))
                raise HTTPError(e.status, e.payload) from None
            except UnknownModelError as e:
                status = 400
                self.metrics.inc("bad_requests", reason="model")
                raise HTTPError(400, {"error": str(e), "reason": "model"}) from None
            headers = {
                GENERATION_HEADER: str(result.generation),
                FANOUT_HEADER: json.dumps({k: r.summary() for k, r in result.leaves.items()}, separators=(",", ":")),
            }
            return Response(200, wire.encode(result.to_batch()), wire.MEDIA_TYPE, headers)
        finally:
            self.metrics.inc("requests", status=status)

    def _retrieve_target(self, request: Request) -> tuple[str, str]:
        name, version = request.params["name"], request.query.get("version")
        keys = [(m, v) for m, v in self.targets if m == name and (not version or v == version)]
        if not keys:
            served = [f"{m}/{v}" for m, v in self.targets]
            raise HTTPError(404, {"error": f"no leaf serves model {name!r} (served: {served})", "reason": "model"})
        if len(keys) > 1:
            versions = [v for _, v in keys]
            raise HTTPError(
                400, {"error": f"model {name!r} has versions {versions}: pass ?version=", "reason": "model"}
            )
        return keys[0]

    async def _retrieve(self, request: Request) -> Response:
        """``POST /v1/models/{name}:retrieve``: check and trim the request inline (fail open without a signature),
        forward it to the model's leaf over its `AsyncClient`, pass the answer on."""
        model, version = self._retrieve_target(request)
        routes = self.routes.current()
        entry = routes.entry(model, version)
        labels = {"model": model, "version": version}
        ctype = request.headers.get("content-type", wire.MEDIA_TYPE).split(";")[0].strip()
        ok = entry.status == OK
        try:
            t0 = time.perf_counter()
            if ctype == wire.MEDIA_TYPE:  # refused from the metadata, before anything is decompressed
                wire.check_limits(request.body, self._limits)
            size, threshold = len(request.body), self.config.server.parse_offload_bytes
            trimmed = await off_loop(
                size, threshold, trim_retrieve_request, request.body, ctype, entry.signature if ok else None,
                trim=self.config.trim, fail_open=None if ok else entry.status, compression=self.config.compression,
            )  # fmt: skip
            self.metrics.inc("trim_seconds", time.perf_counter() - t0)
        except wire.DecodeLimitError as e:
            self.metrics.inc("bad_requests", reason="decode_limit")
            raise HTTPError(413, {**e.to_json(), **labels}) from None
        except (wire.PayloadError, SignatureError) as e:
            self.metrics.inc("bad_requests", reason="payload")
            raise HTTPError(400, {"error": str(e), "reason": "payload", **labels}) from None
        except FeatureError as e:
            self.metrics.inc("bad_requests", reason=e.reason)
            raise HTTPError(400, e.to_json()) from None
        except ValueError as e:  # the content type
            raise HTTPError(415, {"error": str(e)}) from None
        self.metrics.inc("leaf_requests", **labels)
        self.metrics.inc("leaf_request_bytes", len(trimmed.body), **labels)
        self.metrics.inc("features_sent", trimmed.features_sent, **labels)
        self.metrics.inc("features_trimmed", trimmed.features_received - trimmed.features_sent, **labels)
        if trimmed.fail_open:
            self.metrics.inc("fail_open_requests", reason=trimmed.fail_open, **labels)
        client = self._async_clients[(model, version)]
        path = f"/v1/models/{model}:retrieve" + (f"?{request.query_string}" if request.query_string else "")
        try:
            headers = {"Content-Type": ctype, REQUEST_ID_HEADER: request.request_id}
            status, leaf_headers, data = await client.request("POST", path, trimmed.body, headers)
        except OSError as e:
            self.metrics.inc("leaf_errors", **labels)
            raise HTTPError(502, {"error": f"leaf {model}/{version} at {client.url} unreachable: {e}"}) from None
        if status != 200:
            self.metrics.inc("leaf_errors", **labels)
            try:
                payload = json.loads(data)
            except ValueError:
                payload = {"error": data[:200].decode(errors="replace")}
            raise HTTPError(status if status in _PASSED_ON else 502, {**payload, "leaf": f"{model}/{version}"})
        fanout = {"features": trimmed.features_sent, "bytes": len(trimmed.body), "fail_open": trimmed.fail_open}
        headers = {
            GENERATION_HEADER: str(routes.generation),
            FANOUT_HEADER: json.dumps({f"{model}/{version}": fanout}, separators=(",", ":")),
        }
        if TIMINGS_HEADER.lower() in leaf_headers:
            headers[TIMINGS_HEADER] = leaf_headers[TIMINGS_HEADER.lower()]
        return Response(200, data, leaf_headers.get("content-type", ctype), headers)

    def _retrieve_model(self, request: Request) -> list[str]:
        return [request.params["name"]]

    def _reload(self, request: Request) -> Response:
        return Response.json(self.reload().to_json())

    def _predict_models(self, request: Request) -> list[str]:
        """The model names a /predict request targets (what its bearer token must grant)."""
        wanted = [m for m in request.query.get("models", "").split(",") if m]
        return [m.partition("/")[0] for m in wanted] if wanted else [m for m, _ in self.targets]

    def routes_http(self) -> list[Route]:
        return [
            Route("POST", "/predict", self._predict, resources=self._predict_models),
            Route("POST", "/v1/models/{name}:retrieve", self._retrieve, resources=self._retrieve_model),
            Route("GET", "/routes", lambda r: Response.json(self.routes.current().to_json())),
            Route("POST", "/admin/reload", self._reload, resources=lambda r: ("admin",)),
            Route("GET", "/healthz", lambda r: Response(200, b'{"status": "ok"}\n', JSON), public=True, inline=True),
        ]

    def service(self) -> Service:
        return Service(
            self.routes_http(), self.config.server, name="jaxscale-root", metrics_prefix="jaxscale_root",
            collectors=[self.metrics], on_close=[self._close_leaf_connections],
        )  # fmt: skip

    async def _close_leaf_connections(self) -> None:
        for client in self._async_clients.values():
            await client.close()

    def start(self) -> Root:
        self._server = BackgroundServer(self.service()).start()
        return self

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("root not started")
        return self._server.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        self.routes.close()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Root:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def parse_config(argv=None) -> RootConfig:
    """The `RootConfig` of ``python -m jaxscale.serving root`` arguments."""
    p = argparse.ArgumentParser(prog="python -m jaxscale.serving root", description="Fan requests out to leaves.")
    p.add_argument("--store", required=True, help="directory of exported signatures (<store>/<model>/<version>/)")
    p.add_argument("--leaf", action="append", required=True, help="model/version=http://host:port (repeat)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--compression", choices=["none", "zstd", "lz4"], default="none")
    p.add_argument("--no-trim", action="store_true", help="send every feature to every leaf (baseline)")
    p.add_argument("--rescan-interval", type=float, default=10.0, help="seconds between store rescans (0 = off)")
    p.add_argument("--leaf-ca-file", help="CA certificate (PEM) that signed https leaves' certificates")
    p.add_argument("--leaf-token-file", help="file holding the bearer token sent to the leaves")
    p.add_argument("--leaf-timeout", type=float, default=RootConfig.leaf_timeout_s, help="seconds a leaf has to answer")
    add_server_arguments(p)
    args = p.parse_args(argv)
    cfg = RootConfig(
        store=args.store,
        leaves=tuple(LeafAddress.parse(s) for s in args.leaf),
        trim=not args.no_trim,
        compression=None if args.compression == "none" else args.compression,
        rescan_interval_s=args.rescan_interval,
        leaf_timeout_s=args.leaf_timeout,
        server=ServerConfig(host=args.host, port=args.port, **server_options(args)),
        leaf_ca_file=args.leaf_ca_file,
        leaf_token=Path(args.leaf_token_file).read_text().strip() if args.leaf_token_file else None,
    )
    return cfg


def main(argv=None) -> None:
    root = Root(parse_config(argv))
    try:
        serve_until_signal(root.service(), lambda url: print(f"root serving on {url}", flush=True))
    finally:
        root.stop()
