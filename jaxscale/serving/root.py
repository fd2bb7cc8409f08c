"""The root server: receives requests carrying many features and fans out to the leaves, sending each leaf only
the features its model's signature says it uses.

    POST /predict[?models=m/v,m,...] Arrow IPC features -> Arrow IPC outputs, columns "<model>/<version>/<output>"
    GET  /routes                     the current map model/version -> allowed features (JSON)
    POST /admin/reload               re-read the config file (leaves, versions), rescan the signatures; the new map
    POST /v1/models/{name}:retrieve  a retrieve request (`jaxscale.serving.retrieval`), trimmed to user_id + the
                                     query step's features, forwarded to the model's leaf (?version= picks one)
    GET  /metrics                    Prometheus text (the HTTP layer's metrics and the root's own)
    GET  /healthz                    liveness
    GET  /readyz                     readiness: not draining, and each model has a leaf whose /readyz answers 200

A client naming no version gets the one its model's policy picks (`jaxscale.serving.versions`: a default and a
weighted split per model, from the config file). A failing leaf is contained (`jaxscale.serving.resilience`):
deadlines (504), a concurrency bound and a circuit breaker per leaf (503 + Retry-After), partial answers for a
/predict naming no models (the failed leaves listed in ``X-Jaxscale-Failed``), leaf calls cancelled with the client.

Served by the shared HTTP layer (`jaxscale.infra.http_server`); with a tokens file, /predict needs a token granting
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
import contextvars
import functools
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from jaxscale.infra.http_server import (
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
    serve_until_signal,
    server_options,
)
from jaxscale.serving import wire
from jaxscale.serving.metrics import MetricDef, Metrics
from jaxscale.serving.resilience import STATES, TIMEOUT_HEADER, CircuitBreaker, Concurrency, budget_s
from jaxscale.serving.retrieval import TIMINGS_HEADER, trim_retrieve_request
from jaxscale.serving.routes import OK, RouteTable
from jaxscale.serving.signature import FeatureError, SignatureError, check_name
from jaxscale.serving.trim import FanoutPlanner, LeafPlan, trim_batch
from jaxscale.serving.versions import ConfigFileError, VersionPolicy, read_root_file

log = logging.getLogger(__name__)
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("jaxscale_root_request_id", default=None)


class _RequestIdFilter(logging.Filter):
    """Every log line the root writes while handling a request starts with that request's id."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = _REQUEST_ID.get()
        if rid and getattr(record, "request_id", None) is None:
            record.request_id = rid
            record.msg = f"[request {rid}] {record.msg}"
        return True


log.addFilter(_RequestIdFilter())

GENERATION_HEADER = "X-Jaxscale-Routes-Generation"
FANOUT_HEADER = "X-Jaxscale-Fanout"
FAILED_HEADER = "X-Jaxscale-Failed"  # a partial answer: {"model/version": {"status", "error", "reason"}} per leaf
FAILED_METADATA = b"jaxscale.failed"  # the same JSON in a partial answer's Arrow schema metadata
VERSIONS_HEADER = "X-Jaxscale-Versions"  # /predict: {"model": "version"} of the versions that answered
VERSIONS_METADATA = b"jaxscale.versions"  # the same JSON in the answer's Arrow schema metadata
VERSION_HEADER = "X-Jaxscale-Version"  # :retrieve: the version that answered

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
    MetricDef(
        "leaf_state", "gauge", "circuit breaker of each leaf: 1 for the state it is in", ("model", "version", "state")
    ),
    MetricDef(
        "leaf_refused",
        "counter",
        "leaf calls not made: circuit open, or the leaf's concurrency bound reached",
        ("model", "version", "reason"),
    ),
    MetricDef("leaf_deadlines", "counter", "leaf calls that ran out of their deadline (504)", ("model", "version")),
    MetricDef("leaf_cancelled", "counter", "leaf calls cancelled because the client went away", ("model", "version")),
    MetricDef("partial_answers", "counter", "predict requests answered without some leaves' outputs (listed)"),
)


@dataclass(frozen=True)
class LeafAddress:
    """One leaf; ``timeout_s`` / ``max_in_flight`` override the root's ``leaf_timeout_s`` / ``leaf_max_in_flight``
    for it (None = the root's)."""

    model: str
    version: str
    url: str
    timeout_s: float | None = None
    max_in_flight: int | None = None

    def __post_init__(self):
        check_name("model", self.model)
        check_name("version", self.version)
        if self.timeout_s is not None and not (_is_number(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"leaf {self.label}: timeout must be a number > 0, got {self.timeout_s!r}")
        if self.max_in_flight is not None and not (_is_count(self.max_in_flight) and self.max_in_flight >= 1):
            raise ValueError(f"leaf {self.label}: max_in_flight must be an integer >= 1, got {self.max_in_flight!r}")

    @property
    def label(self) -> str:
        return f"{self.model}/{self.version}"

    @classmethod
    def parse(cls, text: str) -> LeafAddress:
        """``model/version=http://host:port[,timeout=SECONDS][,max_in_flight=N]``"""
        key, sep, rest = text.partition("=")
        model, slash, version = key.partition("/")
        if not sep or not slash:
            raise ValueError(f"leaf must be model/version=http://host:port[,timeout=S][,max_in_flight=N], got {text!r}")
        url, *options = rest.split(",")
        known = {"timeout": float, "max_in_flight": int}
        values = {}
        for option in options:
            name, eq, value = option.partition("=")
            if not eq or name not in known:
                raise ValueError(f"leaf {key}: unknown option {option!r} (known: timeout=S, max_in_flight=N)")
            try:
                values[name] = known[name](value)
            except ValueError:
                raise ValueError(f"leaf {key}: option {name} must be a number, got {value!r}") from None
        return cls(model, version, url, values.get("timeout"), values.get("max_in_flight"))


def _check_policies(leaves: Sequence[LeafAddress], policies: Mapping[str, VersionPolicy]) -> None:
    served = {(a.model, a.version) for a in leaves}
    for model, policy in policies.items():
        if policy.model != model:
            raise ValueError(f"versions[{model!r}] is the policy of model {policy.model!r}")
        missing = sorted(v for v in policy.versions() if (model, v) not in served)
        if missing:
            raise ValueError(f"versions[{model!r}]: versions {missing} have no leaf")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class RootConfig:
    """``trim=False`` sends every leaf the whole request (the baseline; signatures are still checked).
    ``rescan_interval_s > 0`` rescans the store in the background; `/admin/reload` always works.

    Failing leaves (`jaxscale.serving.resilience`): each leaf call has at most ``leaf_timeout_s`` (per leaf:
    `LeafAddress.timeout_s`) and what is left of the request's deadline (the client's ``X-Request-Timeout-Ms``,
    else ``request_timeout_s``; None = no request deadline); at most ``leaf_max_in_flight`` calls per leaf at once
    (503 over it); after ``breaker_failures`` consecutive failures a leaf is not called for ``breaker_cooldown_s``
    (0 failures = no breaker)."""

    store: str | Path
    leaves: tuple[LeafAddress, ...]
    trim: bool = True
    compression: str | None = None  # None | "zstd" | "lz4": Arrow IPC buffer compression of leaf requests
    rescan_interval_s: float = 0.0
    leaf_timeout_s: float = 30.0
    server: ServerConfig = field(default_factory=ServerConfig)  # host, port, in-flight bound, tokens, TLS, ...
    leaf_ca_file: str | Path | None = None  # CA that signed the leaves' certificates (https leaves)
    leaf_token: str | None = field(default=None, repr=False)  # bearer token sent to the leaves
    request_timeout_s: float | None = None
    leaf_max_in_flight: int = 64
    breaker_failures: int = 5
    breaker_cooldown_s: float = 5.0
    # the version a client naming none gets, per model (`jaxscale.serving.versions`); none = every version
    versions: Mapping[str, VersionPolicy] = field(default_factory=dict)
    config_file: str | Path | None = None  # leaves and versions, re-read by /admin/reload (`read_root_file`)

    def __post_init__(self):
        object.__setattr__(self, "leaves", tuple(self.leaves))
        object.__setattr__(self, "versions", dict(self.versions))
        _check_policies(self.leaves, self.versions)
        keys = [(a.model, a.version) for a in self.leaves]
        if not keys:
            raise ValueError("a root needs at least one leaf")
        if len(set(keys)) != len(keys):
            raise ValueError(f"a model version is served by one leaf; duplicates in {keys}")
        if self.compression not in wire.COMPRESSIONS:
            raise ValueError(f"compression must be one of {wire.COMPRESSIONS}, got {self.compression!r}")
        if not _is_number(self.leaf_timeout_s) or not self.leaf_timeout_s > 0:
            raise ValueError(f"leaf_timeout_s must be a number > 0, got {self.leaf_timeout_s!r}")
        if self.request_timeout_s is not None and not (
            _is_number(self.request_timeout_s) and self.request_timeout_s > 0
        ):
            raise ValueError(f"request_timeout_s must be None or a number > 0, got {self.request_timeout_s!r}")
        if not _is_count(self.leaf_max_in_flight) or self.leaf_max_in_flight < 1:
            raise ValueError(f"leaf_max_in_flight must be an integer >= 1, got {self.leaf_max_in_flight!r}")
        if not _is_count(self.breaker_failures) or self.breaker_failures < 0:
            raise ValueError(f"breaker_failures must be an integer >= 0 (0 = off), got {self.breaker_failures!r}")
        if not _is_number(self.breaker_cooldown_s) or self.breaker_cooldown_s < 0:
            raise ValueError(f"breaker_cooldown_s must be a number >= 0, got {self.breaker_cooldown_s!r}")


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
    failed: dict[str, LeafCallError] = field(default_factory=dict)  # a partial answer: the leaves that failed

    def versions(self) -> dict[str, str | list[str]]:
        """``{model: version}`` of the leaves that answered (a list when several versions of a model did)."""
        out: dict[str, list[str]] = {}
        for r in self.leaves.values():
            out.setdefault(r.plan.model, []).append(r.plan.version)
        return {m: v[0] if len(v) == 1 else v for m, v in out.items()}

    def failures(self) -> dict[str, dict]:
        """``{"model/version": {"status", "error", "reason"}}`` of the leaves left out of a partial answer."""
        return {k: e.summary() for k, e in self.failed.items()}

    def outputs(self) -> dict[str, dict[str, np.ndarray]]:
        """``{"model/version": {output: array}}``"""
        return {k: {n: wire.to_numpy(r.outputs, n) for n in r.outputs.schema.names} for k, r in self.leaves.items()}

    def to_batch(self) -> pa.RecordBatch:
        """One column per leaf output, "<model>/<version>/<output>"; a partial answer lists the leaves that
        failed in the schema metadata (``jaxscale.failed``, as in the ``X-Jaxscale-Failed`` header)."""
        cols, names = [], []
        for key, r in self.leaves.items():
            for name, col in zip(r.outputs.schema.names, r.outputs.columns):
                cols.append(col)
                names.append(f"{key}/{name}")
        batch = pa.RecordBatch.from_arrays(cols, names=names)
        metadata = {VERSIONS_METADATA: json.dumps(self.versions()).encode()}
        if self.failed:
            metadata[FAILED_METADATA] = json.dumps(self.failures()).encode()
        return batch.replace_schema_metadata(metadata)


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


PROBE_TIMEOUT_S = 2.0  # /readyz: how long a leaf has to answer its own /readyz
_PASSED_ON = (400, 413)  # a leaf's answers about the request itself, passed on as they are (anything else: 503)
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
    feature or the limit, and the leaf); 503 + ``Retry-After`` (``headers``) when the leaf is unreachable, busy
    (its own 503, or the root's bound on calls to it) or its circuit is open, and when it failed otherwise (its
    500, a refused credential, an unusable answer: ``reason`` ``leaf_failed``, ``leaf_status`` its status): a
    client retries elsewhere or later, so every 5xx of the root is a 503 with ``Retry-After`` or a 504; 504 when
    a deadline ran out (the payload names it)."""

    def __init__(self, status: int, payload: dict, headers: dict | None = None):
        super().__init__(payload.get("error", ""))
        self.status, self.payload, self.headers = status, payload, dict(headers or {})

    def summary(self) -> dict:
        return {"status": self.status, "error": self.payload.get("error", ""), "reason": self.payload.get("reason")}

    def response(self) -> Response:
        return Response.json(self.payload, self.status, self.headers)


def _retry_after(seconds: float) -> dict:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


class _LeafGuard:
    """One leaf's timeout, concurrency bound and circuit breaker (`jaxscale.serving.resilience`)."""

    def __init__(self, address: LeafAddress, config: RootConfig, metrics: Metrics):
        self.label, self.labels = address.label, {"model": address.model, "version": address.version}
        self.timeout_s = address.timeout_s or config.leaf_timeout_s
        self.concurrency = Concurrency(address.max_in_flight or config.leaf_max_in_flight)
        self.metrics, self.retry_after_s = metrics, config.server.retry_after_s
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s, self._changed)
        self._show(self.breaker.state)

    def _show(self, state: str) -> None:
        for s in STATES:
            self.metrics.set("leaf_state", float(s == state), state=s, **self.labels)

    def _changed(self, old: str, new: str) -> None:
        self._show(new)
        log.warning("leaf %s: circuit %s -> %s", self.label, old, new)

    def enter(self) -> None:
        """Admits a call (then `exit` must follow) or raises the 503 that refuses it."""
        wait = self.breaker.admit()
        if wait is not None:
            self.metrics.inc("leaf_refused", reason="circuit_open", **self.labels)
            message = f"leaf {self.label}: circuit open after repeated failures; retry in {wait:.1f} s"
            raise LeafCallError(
                503, {"error": message, "reason": "circuit_open", "leaf": self.label}, _retry_after(wait)
            )
        if not self.concurrency.acquire():
            self.breaker.release()
            self.metrics.inc("leaf_refused", reason="leaf_busy", **self.labels)
            message = f"leaf {self.label}: {self.concurrency.limit} calls in flight (the limit leaf_max_in_flight)"
            raise LeafCallError(
                503, {"error": message, "reason": "leaf_busy", "leaf": self.label}, _retry_after(self.retry_after_s)
            )

    def exit(self, ok: bool | None) -> None:
        """``ok``: the call's verdict for the breaker (None: no verdict, e.g. cancelled)."""
        self.concurrency.release()
        if ok is None:
            self.breaker.release()
        else:
            self.breaker.record(ok)

    def timeout(self, deadline: float | None) -> tuple[float, str]:
        """(seconds this call may take, the name of the deadline that bounds it)."""
        if deadline is not None:
            left = deadline - time.monotonic()
            if left < self.timeout_s:
                return left, "request deadline (X-Request-Timeout-Ms or request_timeout_s)"
        return self.timeout_s, "leaf_timeout_s"


@dataclass(frozen=True)
class _Serving:
    """The leaves and version policies in use: swapped whole by a reload of the config file (a request reads the
    reference once per step; a leaf kept across reloads keeps its connections and its circuit breaker)."""

    addresses: dict[tuple[str, str], LeafAddress]
    guards: dict[tuple[str, str], _LeafGuard]
    clients: dict[tuple[str, str], Client]
    async_clients: dict[tuple[str, str], AsyncClient]
    policies: Mapping[str, VersionPolicy]

    @property
    def targets(self) -> tuple[tuple[str, str], ...]:
        return tuple(self.addresses)


class Root:
    """Checks each request against the target leaves' signatures, trims it per leaf and calls them in parallel."""

    def __init__(self, config: RootConfig):
        self.config = config
        self.metrics = Metrics("jaxscale_root", ROOT_METRICS)
        self._retired: list[AsyncClient] = []  # clients of leaves a reload removed: closed with the server
        self._serving = self._build(config.leaves, config.versions, None)
        self._service: Service | None = None
        self._planner = FanoutPlanner()
        self._layouts = wire.LayoutCache()  # request layouts seen (uncompressed leaf bodies are cut from the bytes)
        self._limits = wire.DecodeLimits(config.server.max_decoded_bytes, config.server.max_rows)
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.targets)), thread_name_prefix="root-fanout")
        self.routes = RouteTable(config.store, self.targets, on_publish=self._published)
        if config.rescan_interval_s > 0:
            self.routes.watch(config.rescan_interval_s)
        self._server: BackgroundServer | None = None

    def _build(self, leaves: Sequence[LeafAddress], policies, previous: _Serving | None) -> _Serving:
        cfg = self.config
        addresses, guards, clients, async_clients = {}, {}, {}, {}
        for a in leaves:
            key = (a.model, a.version)
            addresses[key] = a
            if previous is not None and previous.addresses.get(key) == a:  # unchanged: keep its state
                guards[key], clients[key] = previous.guards[key], previous.clients[key]
                async_clients[key] = previous.async_clients[key]
                continue
            guards[key] = guard = _LeafGuard(a, cfg, self.metrics)
            clients[key] = Client(a.url, guard.timeout_s, ca_file=cfg.leaf_ca_file, token=cfg.leaf_token)
            # the HTTP path's: bound to the server's event loop on first use; its own timeout is a backstop (the
            # guard's deadline comes first)
            async_clients[key] = AsyncClient(a.url, guard.timeout_s + 1, ca_file=cfg.leaf_ca_file, token=cfg.leaf_token)
        if previous is not None:
            self._retired += [c for k, c in previous.async_clients.items() if async_clients.get(k) is not c]
        return _Serving(addresses, guards, clients, async_clients, dict(policies))

    @property
    def targets(self) -> tuple[tuple[str, str], ...]:
        return self._serving.targets

    @property
    def _guards(self) -> dict:
        return self._serving.guards

    @property
    def _clients(self) -> dict:
        return self._serving.clients

    @property
    def _async_clients(self) -> dict:
        return self._serving.async_clients

    @property
    def policies(self) -> Mapping[str, VersionPolicy]:
        return self._serving.policies

    def _published(self, routes) -> None:
        self.metrics.inc("reloads")
        self.metrics.set("routes_generation", routes.generation)
        self.metrics.set("signatures_unavailable", sum(e.status != OK for e in routes.entries.values()))

    def reload(self):
        """Re-read the config file (when the root has one: its leaves and version policies; a file that does not
        check raises `ConfigFileError` and changes nothing), rescan the store and swap in the new map (also
        `POST /admin/reload`)."""
        if self.config.config_file is None:
            return self.routes.reload()
        read = read_root_file(self.config.config_file)
        try:
            leaves = [LeafAddress(**kw) for kw in read.leaves]
            _check_policies(leaves, read.policies)
        except ValueError as e:
            raise ConfigFileError(f"{self.config.config_file}: {e}") from None
        self._serving = self._build(leaves, read.policies, self._serving)
        log.info("config %s reloaded: %d leaves, versions %s", self.config.config_file, len(leaves),
                 {m: p.to_json() for m, p in read.policies.items()})  # fmt: skip
        return self.routes.set_keys(self.targets)

    def fail_open_count(self) -> int:
        """Leaf requests sent untrimmed because a signature was missing or unreadable."""
        return int(self.metrics.total("fail_open_requests"))

    # --------------------------------------------------------------------------------------------- fan-out

    def _select_targets(self, models: Sequence[str] | None, request_id: str = "") -> list[tuple[str, str]]:
        """The leaves a request goes to: each ``model/version`` it names; for a ``model`` it names without a
        version, and for every model when it names none, the version its policy picks for this request id (the
        default, or the split's pick); a model without a policy: every version of it when the request names no
        models, the only one when it names the model."""
        serving = self._serving
        served = [f"{a}/{b}" for a, b in serving.targets]

        def versions_of(model: str) -> list[tuple[str, str]]:
            policy = serving.policies.get(model)
            if policy is not None:
                return [(model, policy.pick(request_id))]
            return [key for key in serving.targets if key[0] == model]

        if not models:
            out = []
            for model in dict.fromkeys(m for m, _ in serving.targets):
                out += versions_of(model)
            return out
        out = []
        for m in models:
            model, slash, version = m.partition("/")
            if not slash:
                keys = versions_of(model)
                if not keys:
                    raise UnknownModelError(f"no leaf serves model {m!r} (served: {served})")
                if len(keys) > 1:
                    raise UnknownModelError(
                        f"model {model!r} has versions {[v for _, v in keys]}: name one ({model}/{keys[0][1]}) or "
                        "give it a default version in the root's config file"
                    )
                key = keys[0]
            else:
                key = (model, version)
                if key not in serving.addresses:
                    raise UnknownModelError(f"no leaf serves model {m!r} (served: {served})")
            if key in out:
                raise UnknownModelError(f"model {m!r} is listed twice")
            out.append(key)
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

    # ------------------------------------------------------------------------------------- one leaf call

    def _deadline_error(self, guard: _LeafGuard, named: str, seconds: float) -> LeafCallError:
        self.metrics.inc("leaf_deadlines", **guard.labels)
        message = f"leaf {guard.label} did not answer within {seconds * 1e3:.0f} ms: the {named} ran out"
        log.warning("%s", message)
        return LeafCallError(504, {"error": message, "reason": "deadline", "deadline": named, "leaf": guard.label})

    def _unreachable(self, guard: _LeafGuard, url: str, error: OSError) -> LeafCallError:
        self.metrics.inc("leaf_errors", **guard.labels)
        message = f"leaf {guard.label} at {url} unreachable: {error}"
        log.warning("%s", message)
        headers = _retry_after(self.config.server.retry_after_s)
        return LeafCallError(503, {"error": message, "reason": "unreachable", "leaf": guard.label}, headers)

    def _leaf_error(self, guard: _LeafGuard, status: int, headers: dict, data: bytes) -> LeafCallError:
        """A leaf's non-200 answer: its 400/413 passed on (the request's fault), its 503 passed on with its
        ``Retry-After``, its 504 (it ran out of the deadline it was sent) passed on; anything else a 503 +
        ``Retry-After`` (`_leaf_failed`)."""
        self.metrics.inc("leaf_errors", **guard.labels)
        try:
            payload = json.loads(data)
            if not isinstance(payload, dict):
                raise ValueError
        except ValueError:
            payload = {"error": data[:200].decode(errors="replace")}
        payload = {**payload, "leaf": guard.label}
        log.warning("leaf %s answered %d: %s", guard.label, status, str(payload.get("error", ""))[:200])
        if status == 503:
            retry = headers.get("retry-after")
            return LeafCallError(503, payload, {"Retry-After": retry} if retry else _retry_after(self.retry_after_s))
        if status in _PASSED_ON or status == 504:
            return LeafCallError(status, payload)
        return self._leaf_failed(payload, status)

    def _leaf_failed(self, payload: dict, leaf_status: int | None = None) -> LeafCallError:
        """A leaf that failed the call (not the request's fault, no deadline): 503 + ``Retry-After``."""
        payload = {**payload, "reason": "leaf_failed", **({"leaf_status": leaf_status} if leaf_status else {})}
        return LeafCallError(503, payload, _retry_after(self.retry_after_s))

    @property
    def retry_after_s(self) -> int:
        return self.config.server.retry_after_s

    def _exchange(self, key, path: str, body: bytes, headers: dict):
        """One blocking call to a leaf, guarded (`_LeafGuard`): -> (status 200, headers, body) or `LeafCallError`."""
        guard, client = self._guards[key], self._clients[key]
        guard.enter()
        ok = None
        try:
            headers = {**headers, TIMEOUT_HEADER: str(max(1, int(guard.timeout_s * 1e3)))}
            try:
                status, leaf_headers, data = client.request("POST", path, body, headers)
            except TimeoutError:
                ok = False
                raise self._deadline_error(guard, "leaf_timeout_s", guard.timeout_s) from None
            except OSError as e:
                ok = False
                raise self._unreachable(guard, client.url, e) from None
            ok = status < 500
            if status != 200:
                raise self._leaf_error(guard, status, leaf_headers, data)
            return status, leaf_headers, data
        finally:
            guard.exit(ok)

    async def _exchange_async(self, key, path: str, body: bytes, headers: dict, deadline: float | None):
        """One call to a leaf on the event loop, guarded: refused at once when its circuit is open or its bound is
        reached (503), bounded by its timeout and the request's ``deadline`` (504; the leaf is sent what is left
        in ``X-Request-Timeout-Ms``), cancelled with the request (the client went away). -> (200, headers, body)
        or raises `LeafCallError`."""
        serving = self._serving
        guard, client = serving.guards.get(key), serving.async_clients.get(key)
        if guard is None:  # a reload removed the leaf while the request was under way
            message = f"leaf {key[0]}/{key[1]} was removed by a config reload"
            raise LeafCallError(503, {"error": message, "reason": "removed"}, _retry_after(self.retry_after_s))
        guard.enter()
        ok = None
        try:
            timeout, named = guard.timeout(deadline)
            if timeout <= 0:
                raise self._deadline_error(guard, named, 0.0)
            headers = {**headers, TIMEOUT_HEADER: str(max(1, int(timeout * 1e3)))}
            try:
                async with asyncio.timeout(timeout):
                    status, leaf_headers, data = await client.request("POST", path, body, headers)
            except TimeoutError:
                ok = False
                raise self._deadline_error(guard, named, timeout) from None
            except OSError as e:
                ok = False
                raise self._unreachable(guard, client.url, e) from None
            except asyncio.CancelledError:
                self.metrics.inc("leaf_cancelled", **guard.labels)
                log.info("leaf %s: call cancelled (the client went away)", guard.label)
                raise
            ok = status < 500
            if status != 200:
                raise self._leaf_error(guard, status, leaf_headers, data)
            return status, leaf_headers, data
        finally:
            guard.exit(ok)

    def _leaf_result(self, plan: LeafPlan, batch: pa.RecordBatch, body: bytes, data: bytes) -> LeafResult:
        """A leaf's 200 answer -> `LeafResult`, or raises `LeafCallError` (503, `_leaf_failed`) when it is unusable."""
        labels = {"model": plan.model, "version": plan.version}
        try:
            outputs = wire.decode(data)
        except wire.PayloadError as e:
            self.metrics.inc("leaf_errors", **labels)
            message = f"leaf {plan.label} answered an unreadable body: {e}"
            raise self._leaf_failed({"error": message, "leaf": plan.label}) from None
        if outputs.num_rows != batch.num_rows:
            message = f"leaf {plan.label} answered {outputs.num_rows} rows for {batch.num_rows}"
            raise self._leaf_failed({"error": message, "leaf": plan.label})
        return LeafResult(plan, len(body), outputs)

    def _call_leaf(self, plan: LeafPlan, batch: pa.RecordBatch) -> LeafResult:
        body = self._leaf_body(plan, batch)
        _, _, data = self._exchange((plan.model, plan.version), "/predict", body, {"Content-Type": wire.MEDIA_TYPE})
        return self._leaf_result(plan, batch, body, data)

    async def _call_leaf_async(
        self,
        plan: LeafPlan,
        batch: pa.RecordBatch,
        body: bytes | None = None,
        request_id: str = "",
        deadline: float | None = None,
    ) -> LeafResult:
        body = self._leaf_body(plan, batch, body)
        headers = {"Content-Type": wire.MEDIA_TYPE, **({REQUEST_ID_HEADER: request_id} if request_id else {})}
        _, _, data = await self._exchange_async((plan.model, plan.version), "/predict", body, headers, deadline)
        return self._leaf_result(plan, batch, body, data)

    def _plan(self, batch, models: Sequence[str] | None, request_id: str = ""):
        """-> (the route map, one plan per target leaf); raises `FeatureError` / `UnknownModelError`."""
        targets = self._select_targets(models, request_id)
        routes = self.routes.current()  # one snapshot for the whole fan-out
        t0 = time.perf_counter()
        plans = self._planner.plan(batch, routes, targets, trim=self.config.trim)
        self.metrics.inc("trim_seconds", time.perf_counter() - t0)
        return routes, plans

    def _collect(self, generation: int, plans: list[LeafPlan], outcomes: list, partial: bool) -> FanoutResult:
        """The fan-out's result. A leaf's 400/413 (the request's fault) fails the request. Other failures: with
        ``partial`` (the request named no models) the leaves that answered are the answer and the others are listed
        in ``failed``; else (or when none answered) the first failure is the answer, listing every failed leaf."""
        result, errors = FanoutResult(generation), {}
        for plan, outcome in zip(plans, outcomes):
            if isinstance(outcome, LeafCallError):
                errors[plan.label] = outcome
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                result.leaves[plan.label] = outcome
        if not errors:
            return result
        refused = [e for e in errors.values() if e.status in _PASSED_ON]
        if refused:
            raise min(refused, key=lambda e: e.status)  # a leaf's 400 (bad request) wins
        if partial and result.leaves:
            result.failed = errors
            self.metrics.inc("partial_answers")
            log.warning("partial answer: %s failed, %s answered", sorted(errors), sorted(result.leaves))
            return result
        first = next(iter(errors.values()))
        if len(errors) > 1:
            first.payload = {**first.payload, "failed": {k: e.summary() for k, e in errors.items()}}
        raise first

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
        return self._collect(routes.generation, plans, outcomes, partial=not models)

    async def fan_out_async(self, batch: pa.RecordBatch, models: Sequence[str] | None = None) -> FanoutResult:
        """`fan_out` on the running event loop: the leaves are called concurrently over `AsyncClient`s."""
        routes, plans = self._plan(batch, models)
        return await self._send_async(routes, plans, batch, [None] * len(plans), partial=not models)

    async def _send_async(
        self, routes, plans: list[LeafPlan], batch, bodies: list, request_id="", deadline=None, partial=False
    ) -> FanoutResult:
        if len(plans) == 1:
            try:
                outcomes = [await self._call_leaf_async(plans[0], batch, bodies[0], request_id, deadline)]
            except LeafCallError as e:
                outcomes = [e]
        else:  # a cancelled request (the client went away) cancels every call still running
            calls = (
                self._call_leaf_async(plan, batch, body, request_id, deadline) for plan, body in zip(plans, bodies)
            )
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
        return self._collect(routes.generation, plans, outcomes, partial)

    async def _fan_out_body(
        self, body: bytes, models: Sequence[str], request_id: str = "", deadline: float | None = None
    ) -> FanoutResult:
        """`fan_out_async` of a request body: `_prepare_body` (in a thread for a body of at least
        ``parse_offload_bytes``: decoding and encoding a big one would stall the event loop), then the sends."""
        prepare = functools.partial(self._prepare_body, body, models, request_id)
        big = len(body) >= self.config.server.parse_offload_bytes
        routes, plans, batch, bodies = await asyncio.to_thread(prepare) if big else prepare()
        return await self._send_async(routes, plans, batch, bodies, request_id, deadline, partial=not models)

    def _prepare_body(self, body: bytes, models: Sequence[str], request_id: str = ""):
        """-> (routes, plans, batch or known layout, leaf bodies). A body laid out like one decoded before
        (`wire.LayoutCache`) is not decoded: it is planned from the known schema, bounded by what that layout
        decoded to, and each leaf's body is cut from its bytes by the recipe learned then (the same bytes
        `wire.encode` would write). Any other body is decoded within the decode limits, and its layout learned."""
        known = self._layouts.find(body, self._limits)
        if known is not None:
            routes, plans = self._plan(known, models, request_id)
            recipes = [known.recipes.get(plan) for plan in plans]
            if all(r is not None for r in recipes):
                t0 = time.perf_counter()
                bodies = [r.apply(body) for r in recipes]
                self.metrics.inc("trim_seconds", time.perf_counter() - t0)
                return routes, plans, known, bodies
        batch = wire.decode(body, self._limits)
        routes, plans = self._plan(batch, models, request_id)
        if known is None:
            known = _KnownLayout(batch.schema, batch.num_rows, batch.num_columns)
            self._layouts.learn(body, known, batch)
        bodies = [self._learn_leaf_body(known, body, batch, plan) for plan in plans]
        return routes, plans, batch, bodies

    # ------------------------------------------------------------------------------------------------- HTTP

    def _deadline(self, request: Request) -> float | None:
        """The request's deadline (monotonic seconds): now + the client's ``X-Request-Timeout-Ms``, else
        ``request_timeout_s``; None = none (each leaf call still has its own timeout)."""
        budget = budget_s(request.headers)
        if budget is None:
            budget = self.config.request_timeout_s
        return None if budget is None else time.monotonic() + budget

    async def _predict(self, request: Request) -> Response:
        token = _REQUEST_ID.set(request.request_id)
        try:
            return await self._predict_traced(request)
        finally:
            _REQUEST_ID.reset(token)

    async def _predict_traced(self, request: Request) -> Response:
        status = 200
        try:
            ctype = request.headers.get("content-type", wire.MEDIA_TYPE).split(";")[0].strip()
            if ctype != wire.MEDIA_TYPE:
                status = 415
                raise HTTPError(415, {"error": f"Content-Type must be {wire.MEDIA_TYPE}, got {ctype!r}"})
            models = [m for m in request.query.get("models", "").split(",") if m]
            try:
                result = await self._fan_out_body(request.body, models, request.request_id, self._deadline(request))
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
                return e.response()
            except UnknownModelError as e:
                status = 400
                self.metrics.inc("bad_requests", reason="model")
                raise HTTPError(400, {"error": str(e), "reason": "model"}) from None
            headers = {
                GENERATION_HEADER: str(result.generation),
                FANOUT_HEADER: json.dumps({k: r.summary() for k, r in result.leaves.items()}, separators=(",", ":")),
            }
            headers[VERSIONS_HEADER] = json.dumps(result.versions(), separators=(",", ":"))
            if result.failed:
                headers[FAILED_HEADER] = json.dumps(result.failures(), separators=(",", ":"))
            return Response(200, wire.encode(result.to_batch()), wire.MEDIA_TYPE, headers)
        finally:
            self.metrics.inc("requests", status=status)

    def _retrieve_target(self, request: Request) -> tuple[str, str]:
        """The ``?version=`` named, else the model's policy's pick for the request id, else its only version."""
        serving = self._serving
        name, version = request.params["name"], request.query.get("version")
        policy = serving.policies.get(name)
        if not version and policy is not None:
            version = policy.pick(request.request_id)
        keys = [(m, v) for m, v in serving.targets if m == name and (not version or v == version)]
        if not keys:
            served = [f"{m}/{v}" for m, v in serving.targets]
            raise HTTPError(404, {"error": f"no leaf serves model {name!r} (served: {served})", "reason": "model"})
        if len(keys) > 1:
            versions = [v for _, v in keys]
            message = f"model {name!r} has versions {versions}: pass ?version= or give it a default version"
            raise HTTPError(400, {"error": message, "reason": "model"})
        return keys[0]

    async def _retrieve(self, request: Request) -> Response:
        """``POST /v1/models/{name}:retrieve``: check and trim the request inline (fail open without a signature),
        forward it to the model's leaf over its `AsyncClient`, pass the answer on."""
        token = _REQUEST_ID.set(request.request_id)
        try:
            return await self._retrieve_traced(request)
        finally:
            _REQUEST_ID.reset(token)

    async def _retrieve_traced(self, request: Request) -> Response:
        deadline = self._deadline(request)
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
            trim = functools.partial(
                trim_retrieve_request, request.body, ctype, entry.signature if ok else None,
                trim=self.config.trim, fail_open=None if ok else entry.status, compression=self.config.compression,
            )  # fmt: skip
            big = len(request.body) >= self.config.server.parse_offload_bytes  # parsed off the event loop
            trimmed = await asyncio.to_thread(trim) if big else trim()
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
        path = f"/v1/models/{model}:retrieve" + (f"?{request.query_string}" if request.query_string else "")
        headers = {"Content-Type": ctype, REQUEST_ID_HEADER: request.request_id}
        try:
            _, leaf_headers, data = await self._exchange_async((model, version), path, trimmed.body, headers, deadline)
        except LeafCallError as e:
            return e.response()
        fanout = {"features": trimmed.features_sent, "bytes": len(trimmed.body), "fail_open": trimmed.fail_open}
        headers = {
            GENERATION_HEADER: str(routes.generation),
            FANOUT_HEADER: json.dumps({f"{model}/{version}": fanout}, separators=(",", ":")),
            VERSION_HEADER: version,
        }
        if TIMINGS_HEADER.lower() in leaf_headers:
            headers[TIMINGS_HEADER] = leaf_headers[TIMINGS_HEADER.lower()]
        return Response(200, data, leaf_headers.get("content-type", ctype), headers)

    def _retrieve_model(self, request: Request) -> list[str]:
        return [request.params["name"]]

    async def _reload(self, request: Request) -> Response:
        """On the event loop, so no request sees the leaves change between its steps."""
        try:
            routes = self.reload()
        except ConfigFileError as e:
            log.warning("reload refused, the previous config stays: %s", e)
            return Response.json({"error": str(e), "reason": "config"}, 400)
        return Response.json({**routes.to_json(), "versions": {m: p.to_json() for m, p in self.policies.items()}})

    def _predict_models(self, request: Request) -> list[str]:
        """The model names a /predict request targets (what its bearer token must grant)."""
        wanted = [m for m in request.query.get("models", "").split(",") if m]
        return [m.partition("/")[0] for m in wanted] if wanted else [m for m, _ in self.targets]

    def routes_http(self) -> list[Route]:
        return [
            Route("POST", "/predict", self._predict, resources=self._predict_models),
            Route("POST", "/v1/models/{name}:retrieve", self._retrieve, resources=self._retrieve_model),
            Route("GET", "/routes", lambda r: Response.json(self.routes.current().to_json())),
            Route("POST", "/admin/reload", self._reload, resources=lambda r: ("admin",), admin=True),
            Route("GET", "/healthz", lambda r: Response(200, b'{"status": "ok"}\n', JSON), public=True, inline=True),
            Route("GET", "/readyz", self._readyz, public=True),
        ]

    async def _readyz(self, request: Request) -> Response:
        """Readiness, apart from liveness (/healthz): not draining, and every model with at least one leaf that
        answers its own /readyz 200 (model warmed, states of its version) within ``probe_timeout_s``. Each leaf's
        state is listed; one leaf down leaves the root ready while its model has another."""
        reasons = self._service.not_ready() if self._service is not None else []
        serving = self._serving

        async def probe(key) -> str | None:
            client = serving.async_clients[key]
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_S):
                    status, _, data = await client.request("GET", "/readyz")
            except (TimeoutError, OSError) as e:
                return f"unreachable: {type(e).__name__}: {e}"
            if status == 200:
                return None
            try:
                return "not ready: " + "; ".join(json.loads(data).get("reasons", [])) or str(status)
            except (ValueError, AttributeError, TypeError):
                return f"answered {status}"

        states = dict(zip(serving.targets, await asyncio.gather(*(probe(k) for k in serving.targets))))
        for model in dict.fromkeys(m for m, _ in serving.targets):
            mine = {k: why for k, why in states.items() if k[0] == model}
            if all(why is not None for why in mine.values()):
                reasons.append(
                    f"model {model}: no leaf ready ({'; '.join(f'{m}/{v}: {w}' for (m, v), w in mine.items())})"
                )
        leaves = {f"{m}/{v}": why or "ready" for (m, v), why in states.items()}
        if reasons:
            retry = {"Retry-After": str(self.retry_after_s)}
            return Response.json({"status": "not ready", "reasons": reasons, "leaves": leaves}, 503, retry)
        return Response.json({"status": "ready", "leaves": leaves})

    def service(self) -> Service:
        self._service = Service(
            self.routes_http(), self.config.server, name="jaxscale-root", metrics_prefix="jaxscale_root",
            collectors=[self.metrics], on_close=[self._close_leaf_connections], cancel_on_disconnect=True,
        )  # fmt: skip
        return self._service

    async def _close_leaf_connections(self) -> None:
        for client in [*self._async_clients.values(), *self._retired]:
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
    p.add_argument(
        "--config",
        help="root config file (YAML/JSON): leaves and each model's default version and split; re-read by "
        "POST /admin/reload (see jaxscale.serving.versions)",
    )
    p.add_argument(
        "--leaf",
        action="append",
        default=[],
        help="model/version=http://host:port[,timeout=S][,max_in_flight=N] (repeat; the options override "
        "--leaf-timeout and --leaf-max-in-flight for that leaf)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--compression", choices=["none", "zstd", "lz4"], default="none")
    p.add_argument("--no-trim", action="store_true", help="send every feature to every leaf (baseline)")
    p.add_argument("--rescan-interval", type=float, default=10.0, help="seconds between store rescans (0 = off)")
    p.add_argument("--leaf-ca-file", help="CA certificate (PEM) that signed https leaves' certificates")
    p.add_argument("--leaf-token-file", help="file holding the bearer token sent to the leaves")
    p.add_argument("--leaf-timeout", type=float, default=RootConfig.leaf_timeout_s, help="seconds a leaf has to answer")
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request has in all when the client sends no X-Request-Timeout-Ms (default: none)",
    )
    p.add_argument(
        "--leaf-max-in-flight",
        type=int,
        default=RootConfig.leaf_max_in_flight,
        help="calls to one leaf at once (503 + Retry-After over it)",
    )
    p.add_argument(
        "--breaker-failures",
        type=int,
        default=RootConfig.breaker_failures,
        help="consecutive failures that open a leaf's circuit (0 = never)",
    )
    p.add_argument(
        "--breaker-cooldown",
        type=float,
        default=RootConfig.breaker_cooldown_s,
        help="seconds an open circuit waits before one probe call",
    )
    add_server_arguments(p)
    args = p.parse_args(argv)
    if bool(args.leaf) == bool(args.config):
        p.error("give the leaves in one place: --leaf (repeat) or --config FILE (which /admin/reload re-reads)")
    leaves, versions = [LeafAddress.parse(s) for s in args.leaf], {}
    if args.config:
        read = read_root_file(args.config)
        try:
            leaves += [LeafAddress(**kw) for kw in read.leaves]
        except ValueError as e:
            raise ConfigFileError(f"{args.config}: {e}") from None
        versions = read.policies
    cfg = RootConfig(
        store=args.store,
        leaves=tuple(leaves),
        versions=versions,
        config_file=args.config,
        trim=not args.no_trim,
        compression=None if args.compression == "none" else args.compression,
        rescan_interval_s=args.rescan_interval,
        leaf_timeout_s=args.leaf_timeout,
        request_timeout_s=args.request_timeout,
        leaf_max_in_flight=args.leaf_max_in_flight,
        breaker_failures=args.breaker_failures,
        breaker_cooldown_s=args.breaker_cooldown,
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
