"""The one HTTP layer of jaxscale: sequence serving (`jaxscale.sequences.server`) and the model-serving root and
leaves (`jaxscale.serving`) all run on it.

Why aiohttp: one maintained library gives the server and a client; its server protocol sets ``TCP_NODELAY`` on
every accepted connection and writes small responses (headers + body) in one send, so keep-alive requests do not
wait ~44 ms for Nagle's algorithm and the client's delayed ACK (the stall of the old ``http.server`` servers);
TLS is a plain `ssl.SSLContext`; graceful shutdown (stop accepting, let in-flight handlers finish within a bound)
is built into its runner; and it is plain asyncio, with no ASGI layer between the socket and the handler.

A handler takes a `Request` and returns a `Response`, in one of three ways (the `Route` says which):
  * ``async def`` handler: runs on the event loop, no thread hand-off. The fast path for handlers whose work is
    short CPU work plus awaiting other servers (`AsyncClient`) or blocking work handed to an `Offload` (which runs
    it on the loop while its measured cost is under a budget, else in threads). Counted in the in-flight bound;
  * plain function (the default): runs in the server's bounded thread pool (blocking work of unknown length);
  * plain function with ``inline=True``: runs on the loop (cheap handlers that never block: /healthz, /metrics).
An exception becomes a JSON error body: `HTTPError` for a 4xx with a payload, anything else a 500 that carries
the request's id and never the exception's text (the server logs the exception with that id).
Each hand-off between the loop and a thread costs a wake-up of each (tens of microseconds idle, milliseconds on a
busy machine, plus GIL convoys), which is why the serving root and leaves use async handlers end to end.

Every server also has:
  * a request id per request: ``X-Request-Id`` as the client sent it (when it is a short token) or a new one,
    returned in the response's ``X-Request-Id`` and in a 500's JSON body, and in the log line of its exception;
  * bodies read before admission: a request's body is read (at most ``max_body_bytes``, else 413; within
    ``body_timeout_s``, else 408) BEFORE it takes an in-flight slot, so clients that trickle their bodies (slow
    loris) cannot fill the in-flight bound; a JSON body (``Content-Type: application/json``) nested deeper than
    ``max_json_depth`` is a 400 before any handler parses it;
  * a bound on in-flight requests (`ServerConfig.max_in_flight`): over it the answer is 503 with ``Retry-After``
    at once, so no unbounded queue builds up;
  * ``GET /healthz`` (always open; an app may declare its own body) and Prometheus ``GET /metrics`` from one
    `CollectorRegistry` per server (request counts by route and status, a latency histogram, the in-flight gauge,
    refusals by status, plus the app's own collectors);
  * optional bearer tokens from a JSON file ``{"<token>": ["<resource>", ...] | "*"}``: 401 (with
    ``WWW-Authenticate: Bearer``) without a token or with an unknown one, 403 when the token does not grant a
    resource the route names (each `Route` says how: a sequence name, a model name; none = any valid token).
    ``/healthz`` is open; ``/metrics`` needs a valid token (any) when tokens are configured;
  * TLS from a certificate/key pair;
  * ``GET /readyz`` (readiness, apart from /healthz's liveness: 503 while the app's ``ready`` names a reason or
    while draining), a drain on SIGTERM (``drain_s``: /readyz answers 503 before the listener closes), admin
    routes refused beyond loopback without tokens (and a start-up warning for a server open to anyone).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import hashlib
import http.client
import inspect
import ipaddress
import json
import logging
import re
import signal
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger(__name__)
JSON = "application/json"
PROMETHEUS_MEDIA_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


# ---------------------------------------------------------------------------------------------- handler model


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # as sent (percent-encoded), without the query string
    query: dict[str, str]  # decoded; the last value of a repeated parameter wins
    headers: dict[str, str]  # lower-case names
    body: bytes
    params: dict[str, str] = field(default_factory=dict)  # the route's path parameters, percent-decoded
    query_string: str = ""  # raw, for handlers that parse it strictly
    request_id: str = ""  # X-Request-Id: the client's, or one made for this request


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = JSON
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, obj, status: int = 200, headers: dict | None = None) -> Response:
        return cls(status, (json.dumps(obj) + "\n").encode(), JSON, headers or {})


class HTTPError(Exception):
    """Raised by a handler to answer ``status`` with the JSON ``payload`` (which carries an "error" message)."""

    def __init__(self, status: int, payload: dict):
        super().__init__(payload.get("error", ""))
        self.status, self.payload = status, payload


Handler = Callable[[Request], Response] | Callable[[Request], Awaitable[Response]]
Resources = Callable[[Request], Iterable[str]]
_PARAM = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True)
class Route:
    """``path`` is a template such as ``/v1/users/{user_id}/sequences/{name}`` (a parameter matches one segment).

    ``resources`` names what a bearer token must grant to call it (e.g. the sequence in the path); None = any
    valid token. ``public`` routes need no token. An ``async def`` handler runs on the event loop and is counted
    in the in-flight bound. ``inline`` runs a plain handler on the event loop (cheap handlers only: it blocks
    every other request while it runs); inline requests cannot queue, so they are outside the in-flight bound
    (a saturated server still answers /healthz and /metrics). An ``admin`` route (e.g. ``/admin/reload``) is
    refused (403) on a server that binds beyond loopback without a tokens file."""

    method: str
    path: str
    handler: Handler
    resources: Resources | None = None
    public: bool = False
    inline: bool = False
    admin: bool = False
    pattern: re.Pattern = field(init=False, repr=False, compare=False)
    is_async: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "is_async", inspect.iscoroutinefunction(self.handler))
        if self.is_async and self.inline:
            raise ValueError(f"route {self.path}: inline is for plain handlers; an async handler already runs inline")
        parts, last = [], 0
        for m in _PARAM.finditer(self.path):
            parts += [re.escape(self.path[last : m.start()]), f"(?P<{m.group(1)}>[^/]+)"]
            last = m.end()
        parts.append(re.escape(self.path[last:]))
        object.__setattr__(self, "pattern", re.compile("^" + "".join(parts) + "$"))

    def match(self, path: str) -> dict[str, str] | None:
        m = self.pattern.match(path)
        return None if m is None else {k: urllib.parse.unquote(v) for k, v in m.groupdict().items()}


def path_resource(param: str) -> Resources:
    """A route's resource is one of its path parameters (e.g. the sequence name)."""
    return lambda request: (request.params[param],)


def default_unrouted(request: Request, allowed: list[str]) -> Response:
    """404 for an unknown path, 405 (listing the methods) for a known path with another method."""
    status = 405 if allowed else 404
    return Response.json({"error": f"no route {request.method} {request.path}", "allowed": allowed}, status)


# ----------------------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class ServerConfig:
    """How one server listens and protects itself. ``workers`` threads run non-inline handlers; at most
    ``max_in_flight`` requests are admitted at once (the rest get 503 + ``Retry-After: retry_after_s``)."""

    host: str = "127.0.0.1"
    port: int = 0
    max_in_flight: int = 64
    workers: int = 8
    retry_after_s: int = 1
    max_body_bytes: int = 256 << 20
    body_timeout_s: float = 30.0  # a body not received within this is answered 408 (slow uploads hold no slot)
    max_decoded_bytes: int = 256 << 20  # Arrow bodies: buffer bytes after decompression (413 above)
    max_rows: int = 1 << 20  # Arrow bodies: rows per request (413 above)
    max_json_depth: int = 64  # JSON bodies nested deeper are answered 400 before any handler parses them
    parse_offload_bytes: int = 1 << 20  # handlers parse bodies at least this long off the event loop
    tokens_file: str | Path | None = None
    tls_cert: str | Path | None = None
    tls_key: str | Path | None = None
    shutdown_timeout_s: float = 10.0
    drain_s: float = 0.0  # on SIGTERM: /readyz answers 503 this long before the listener closes
    access_log: bool = False
    uvloop: bool = True  # run on uvloop's event loop (libuv, C transports) when it is installed; else asyncio's

    def __post_init__(self):
        def check(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {what}, got {getattr(self, name)!r}")

        check(isinstance(self.host, str) and bool(self.host), "host", "must be a non-empty string")
        check(_is_int(self.port) and 0 <= self.port <= 65535, "port", "must be an integer in [0, 65535]")
        check(_is_int(self.max_in_flight) and self.max_in_flight >= 1, "max_in_flight", "must be an integer >= 1")
        check(_is_int(self.workers) and self.workers >= 1, "workers", "must be an integer >= 1")
        check(_is_int(self.retry_after_s) and self.retry_after_s >= 0, "retry_after_s", "must be an integer >= 0")
        check(_is_int(self.max_body_bytes) and self.max_body_bytes >= 0, "max_body_bytes", "must be an integer >= 0")
        check(
            isinstance(self.body_timeout_s, (int, float)) and self.body_timeout_s > 0,
            "body_timeout_s",
            "must be a number > 0",
        )
        for name in ("max_decoded_bytes", "max_rows", "max_json_depth"):
            check(_is_int(getattr(self, name)) and getattr(self, name) >= 1, name, "must be an integer >= 1")
        check(
            _is_int(self.parse_offload_bytes) and self.parse_offload_bytes >= 0,
            "parse_offload_bytes",
            "must be an integer >= 0",
        )
        check(
            isinstance(self.shutdown_timeout_s, (int, float)) and self.shutdown_timeout_s >= 0,
            "shutdown_timeout_s",
            "must be a number >= 0",
        )
        check(isinstance(self.drain_s, (int, float)) and self.drain_s >= 0, "drain_s", "must be a number >= 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"tls_cert: TLS needs both tls_cert and tls_key, got {self.tls_cert!r}, {self.tls_key!r}")
        for name in ("tokens_file", "tls_cert", "tls_key"):
            value = getattr(self, name)
            check(value is None or Path(value).is_file(), name, "must be an existing file")

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"

    @property
    def loopback(self) -> bool:
        """Whether the server binds only the loopback interface (reachable from this machine alone)."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_key(token: str) -> str:
    """Tokens are kept and looked up by their SHA-256, so lookups take the same time whatever the token."""
    return hashlib.sha256(token.encode()).hexdigest()


def load_tokens(path: str | Path) -> dict[str, frozenset[str] | None]:
    """``{sha256(token): resources}`` from ``{"<token>": ["<resource>", ...] | "*"}`` (None = every resource)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"tokens_file: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"tokens_file: {path} must hold a JSON object {{token: [resource, ...] | '*'}}")
    tokens = {}
    for i, (token, grants) in enumerate(data.items()):
        if not token.strip() or token != token.strip():
            raise ValueError(f"tokens_file: token #{i} in {path} is empty or has surrounding spaces")
        if grants == "*":
            tokens[_token_key(token)] = None
        elif isinstance(grants, list) and all(isinstance(g, str) and g for g in grants):
            tokens[_token_key(token)] = frozenset(grants)
        else:
            raise ValueError(f'tokens_file: token #{i} in {path} must map to "*" or a list of resource names')
    return tokens


def server_ssl_context(cert: str | Path, key: str | Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


# ----------------------------------------------------------------------------------------------------- metrics


class HTTPMetrics:
    """The layer's own Prometheus metrics, in the server's registry (which also holds the app's collectors)."""

    def __init__(self, prefix: str, registry: CollectorRegistry):
        self.requests = Counter(
            f"{prefix}_http_requests",
            "HTTP requests answered, by route, method and status",
            ("route", "method", "status"),
            registry=registry,
        )
        self.latency = Histogram(
            f"{prefix}_http_request_duration_seconds",
            "time from a request's arrival to its response, by route",
            ("route",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            f"{prefix}_http_in_flight_requests", "requests admitted and not yet answered", registry=registry
        )
        self.refused = Counter(
            f"{prefix}_http_refused_requests",
            "requests refused before their handler ran: 503 over the in-flight bound, 401 no or unknown token, "
            "403 token without access",
            ("status",),
            registry=registry,
        )

        self._children: dict[tuple[str, str, int], tuple] = {}

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        key = (route, method, status)
        children = self._children.get(key)
        if children is None:  # resolve the labelled series once per (route, method, status)
            refused = self.refused.labels(str(status)) if status in (401, 403, 503) else None
            children = (self.requests.labels(route, method, str(status)), self.latency.labels(route), refused)
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)
        if children[2] is not None:
            children[2].inc()


# ------------------------------------------------------------------------------------------------------ server


class Service:
    """An app's routes behind one `ServerConfig`, served by aiohttp on the calling event loop (`open`/`close`)."""

    def __init__(
        self,
        routes: Sequence[Route],
        config: ServerConfig,
        *,
        name: str,
        metrics_prefix: str,
        collectors: Iterable = (),
        unrouted: Callable[[Request, list[str]], Response] = default_unrouted,
        on_close: Iterable[Callable[[], Awaitable[None]]] = (),
        cancel_on_disconnect: bool = False,
        ready: Callable[[], Iterable[str]] | None = None,
    ):
        """``on_close``: coroutines run on the loop after the last in-flight request (close an `AsyncClient`).
        ``cancel_on_disconnect``: a handler whose client closes the connection is cancelled (a proxy's calls to
        its upstreams end with it); off by default, as a handler cancelled mid-way must leave nothing half done.
        ``ready``: why the app is not ready to serve (an empty list: ready), for ``GET /readyz``; /healthz says
        only that the process answers (liveness), /readyz whether to send it traffic (also 503 while draining)."""
        self.config, self.name, self.unrouted = config, name, unrouted
        self.cancel_on_disconnect = cancel_on_disconnect
        self.ready, self.draining = ready, False
        self.on_close = tuple(on_close)
        self.registry = CollectorRegistry(auto_describe=False)
        self.metrics = HTTPMetrics(metrics_prefix, self.registry)
        for c in collectors:
            self.registry.register(c)
        self.tokens = load_tokens(config.tokens_file) if config.tokens_file else None
        own = [Route("GET", "/metrics", self._metrics, inline=True)]
        if not any(r.path == "/healthz" for r in routes):
            own.append(Route("GET", "/healthz", lambda r: Response.json({"status": "ok"}), public=True, inline=True))
        if not any(r.path == "/readyz" for r in routes):
            own.append(Route("GET", "/readyz", self._readyz, public=True, inline=True))
        self.routes = (*routes, *own)
        self.in_flight = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(config.workers, thread_name_prefix=f"{name}-handler")
        self._runner: web.AppRunner | None = None
        self.address: tuple[str, int] | None = None

    @property
    def url(self) -> str:
        if self.address is None:
            raise RuntimeError(f"{self.name} is not listening")
        return f"{self.config.scheme}://{self.address[0]}:{self.address[1]}"

    def _metrics(self, request: Request) -> Response:
        return Response(200, generate_latest(self.registry), PROMETHEUS_MEDIA_TYPE)

    def not_ready(self) -> list[str]:
        """Why the server should get no traffic now (empty: ready)."""
        reasons = ["draining: shutting down"] if self.draining else []
        if self.ready is not None:
            reasons += list(self.ready())
        return reasons

    def _readyz(self, request: Request) -> Response:
        reasons = self.not_ready()
        if reasons:
            retry = {"Retry-After": str(self.config.retry_after_s)}
            return Response.json({"status": "not ready", "reasons": reasons}, 503, retry)
        return Response.json({"status": "ready"})

    # --------------------------------------------------------------------------------------------- lifecycle

    async def open(self) -> None:
        cfg = self.config
        app = web.Application(client_max_size=max(cfg.max_body_bytes, 1))
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            shutdown_timeout=cfg.shutdown_timeout_s,
            access_log=_access_logger(self.name) if cfg.access_log else None,
            handler_cancellation=self.cancel_on_disconnect,
        )
        await self._runner.setup()
        tls = server_ssl_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None
        site = web.TCPSite(self._runner, cfg.host, cfg.port, ssl_context=tls)
        await site.start()
        self.address = tuple(self._runner.addresses[0][:2])
        warning = self.exposure_warning()
        if warning:
            log.warning("%s", warning)

    def exposure_warning(self) -> str | None:
        """What the start-up warns about a server open to others (beyond loopback, no tokens); None when closed."""
        if self.config.loopback or self.tokens is not None:
            return None
        return (
            f"{self.name} binds {self.config.host} (beyond loopback) with no tokens file: every route is open to "
            "anyone who can reach it, except the admin routes, which are refused (pass --tokens-file)"
        )

    async def close(self) -> None:
        """Stop accepting, let in-flight requests finish (at most ``shutdown_timeout_s``), close connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            for close in self.on_close:
                await close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------------------------------------- requests

    def _match(self, method: str, path: str) -> tuple[Route | None, dict[str, str], list[str]]:
        allowed = []
        for route in self.routes:
            params = route.match(path)
            if params is not None:
                if route.method == method:
                    return route, params, []
                allowed.append(route.method)
        return None, {}, sorted(set(allowed))

    async def _handle(self, req: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        path = req.rel_url.raw_path
        route, params, allowed = self._match(req.method, path)
        headers = {k.lower(): v for k, v in req.headers.items()}
        request_id = request_id_of(headers.get("x-request-id"))
        request = Request(
            req.method, path, dict(req.query), headers, b"", params, req.rel_url.raw_query_string, request_id
        )
        if route is None:
            response = self.unrouted(request, allowed)
        else:
            response = self._refuse(route, request) or await self._admit(route, request, req)
        self.metrics.observe(route.path if route else "unrouted", req.method, response.status, time.perf_counter() - t0)
        headers = {**response.headers, "Content-Type": response.content_type, REQUEST_ID_HEADER: request_id}
        close = headers.pop("Connection", "").lower() == "close"
        answer = web.Response(status=response.status, body=response.body, headers=headers)
        if close:  # e.g. a refused body still on the wire: do not keep the connection
            answer.force_close()
        return answer

    def _refuse(self, route: Route, request: Request) -> Response | None:
        """401/403 from the bearer token (checked before the body is read); None = go on."""
        if route.admin and self.tokens is None and not self.config.loopback:
            message = f"{route.path} needs a bearer token: this server binds {self.config.host} and has no tokens file"
            return Response.json({"error": message}, 403)
        if self.tokens is not None and not route.public:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return _unauthorized("missing bearer token (Authorization: Bearer <token>)")
            key = _token_key(token.strip())
            if key not in self.tokens:
                return _unauthorized("unknown bearer token")
            grants = self.tokens[key]
            if grants is not None and route.resources is not None:
                denied = [r for r in route.resources(request) if r not in grants]
                if denied:
                    return Response.json({"error": f"token has no access to {denied[0]!r}"}, 403)
        return None

    async def _read_body(self, request: Request, req: web.Request) -> Request | Response:
        """The request with its body, read within ``body_timeout_s`` (408 after), at most ``max_body_bytes`` (413),
        a JSON body nested at most ``max_json_depth`` deep (400); read before the request takes an in-flight slot,
        so a slow upload holds a connection, never a slot."""
        cfg = self.config
        if req.content_length is not None and req.content_length > cfg.max_body_bytes:
            return _too_large(req.content_length, cfg.max_body_bytes)
        if not req.body_exists:
            return request
        try:
            async with asyncio.timeout(cfg.body_timeout_s):
                body = await req.read()  # aiohttp stops at client_max_size (max_body_bytes)
        except TimeoutError:
            message = f"request body not received within {cfg.body_timeout_s:g} s (the limit body_timeout_s)"
            return Response.json({"error": message}, 408, {"Connection": "close"})
        except web.HTTPRequestEntityTooLarge:
            return _too_large(None, cfg.max_body_bytes)
        except Exception as e:  # the client went away or sent a malformed body (chunking, length)
            message = f"request body unreadable: {type(e).__name__}"
            return Response.json({"error": message}, 400, {"Connection": "close"})
        if request.headers.get("content-type", "").split(";")[0].strip().lower() == JSON:
            measure = functools.partial(json_too_deep, body, cfg.max_json_depth)
            big = len(body) >= cfg.parse_offload_bytes  # measured off the event loop
            depth = await asyncio.to_thread(measure) if big else measure()
            if depth is not None:
                message = f"JSON body nested {depth} deep, over the limit of {cfg.max_json_depth} (max_json_depth)"
                return Response.json({"error": message, "reason": "json_depth", "limit": cfg.max_json_depth}, 400)
        return replace(request, body=body)

    async def _admit(self, route: Route, request: Request, req: web.Request) -> Response:
        read = await self._read_body(request, req)
        if isinstance(read, Response):
            return read
        request = read
        counted = not route.inline  # inline handlers finish before the loop takes the next request: no queue
        if counted and self.in_flight >= self.config.max_in_flight:
            return Response.json(
                {"error": f"server busy: {self.in_flight} requests in flight (limit {self.config.max_in_flight})"},
                503,
                {"Retry-After": str(self.config.retry_after_s)},
            )
        if counted:
            self.in_flight += 1
            self.metrics.in_flight.inc()
        try:
            if route.is_async:
                return await _call_async(route.handler, request)
            if route.inline:
                return _call(route.handler, request)
            return await asyncio.get_running_loop().run_in_executor(self._pool, _call, route.handler, request)
        finally:
            if counted:
                self.in_flight -= 1
                self.metrics.in_flight.dec()


def _access_logger(name: str) -> logging.Logger:
    """The access log; printed to stderr when the program has configured no logging of its own."""
    logger = logging.getLogger(f"{name}.access")
    if not logger.handlers and not logging.getLogger().handlers:
        logger.addHandler(logging.StreamHandler())
        logger.setLevel(logging.INFO)
    return logger


def _unauthorized(message: str) -> Response:
    return Response.json({"error": message}, 401, {"WWW-Authenticate": "Bearer"})


def _too_large(length: int | None, limit: int) -> Response:
    what = f"body of {length} bytes" if length is not None else "body"
    return Response.json({"error": f"{what} exceeds the limit of {limit} bytes"}, 413, {"Connection": "close"})


def _call(handler: Handler, request: Request) -> Response:
    try:
        return handler(request)
    except Exception as e:
        return _error_response(e, request)


async def _call_async(handler: Handler, request: Request) -> Response:
    try:
        return await handler(request)
    except Exception as e:
        return _error_response(e, request)


def _error_response(e: Exception, request: Request) -> Response:
    if isinstance(e, HTTPError):
        return Response.json(e.payload, e.status)
    # a bug: the exception goes to the log under the request's id, the client gets the id only (exception text
    # can hold paths, values of other requests, internals)
    log.exception("%s %s failed (request id %s)", request.method, request.path, request.request_id, exc_info=e)
    return Response.json({"error": "internal error", "request_id": request.request_id}, 500)


REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")


def request_id_of(sent: str | None) -> str:
    """The client's ``X-Request-Id`` when it is a short token (safe to log and echo), else a new random one."""
    if sent is not None and _REQUEST_ID.match(sent):
        return sent
    return uuid.uuid4().hex


# ------------------------------------------------------------------------------------------------ bodies


_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_DEPTH_CHUNK = 1 << 22


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings do not count; 0 for a
    scalar). Exact for valid JSON; the parser refuses invalid JSON anyway. Vectorized over the brackets and
    quotes only (NumPy, in chunks: the GIL is released on big bodies)."""
    if not (b"[" in body or b"{" in body):
        return 0
    depth = deepest = 0
    inside, run = False, 0  # within a string; backslashes ending the previous chunk
    data = np.frombuffer(body, np.uint8)
    for at in range(0, len(data), _DEPTH_CHUNK):
        chunk = data[at : at + _DEPTH_CHUNK]
        opens = (chunk == ord("[")) | (chunk == ord("{"))
        closes = (chunk == ord("]")) | (chunk == ord("}"))
        quotes = chunk == _QUOTE
        where = np.flatnonzero(opens | closes | quotes)
        is_quote = quotes[where]
        real = is_quote.copy()
        piece = body[at : at + _DEPTH_CHUNK]
        if b"\\" in piece:  # a quote preceded by an odd run of backslashes is escaped
            backslash = chunk == _BACKSLASH
            position = np.arange(len(chunk), dtype=np.int64)
            last_other = np.maximum.accumulate(np.where(backslash, -1, position))
            q = where[is_quote]
            before = np.where(q > 0, last_other[np.maximum(q - 1, 0)], -1)
            runs = np.where(q > 0, q - 1 - before, 0) + np.where(before < 0, run, 0)
            real[is_quote] = runs % 2 == 0
        elif run % 2 and len(where) and where[0] == 0 and is_quote[0]:
            real[0] = False  # escaped by the backslashes that ended the previous chunk
        in_string = (np.cumsum(real, dtype=np.int64) + inside) % 2 == 1
        step = (opens[where].astype(np.int64) - closes[where]) * ~in_string
        if len(where):
            levels = np.cumsum(step) + depth
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
            inside = bool(in_string[-1])
        tail = len(piece) - len(piece.rstrip(b"\\"))
        run = tail + (run if tail == len(piece) else 0)
    return deepest


def json_too_deep(body: bytes, max_depth: int) -> int | None:
    """The nesting depth of a JSON ``body`` when over ``max_depth``, else None (a body with at most ``max_depth``
    brackets in all is not scanned)."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return None
    depth = json_depth(body)
    return depth if depth > max_depth else None


def _json_int(text: str) -> int:
    return int(text)


def _json_float(text: str) -> float:
    return float(text)


def _json_object(pairs: list) -> dict:
    return dict(pairs)


YIELDING_JSON_BYTES = 1 << 20  # `parse_json` builds numbers and objects in Python from this body size on


def parse_json(body: bytes, max_depth: int | None = None, *, yielding: bool | None = None):
    """``json.loads(body)``, nested at most ``max_depth`` deep (`JSONDepthError`, a ValueError, above; also when
    the parser's own recursion limit is hit).

    ``yielding`` (default: for bodies of at least `YIELDING_JSON_BYTES`, which handlers parse in a thread):
    numbers and objects are built by Python functions, so the parsing thread hands the GIL to the event loop every
    few milliseconds. CPython's C JSON scanner otherwise holds the GIL for the whole parse, and a thread alone
    would not keep the loop answering (/healthz stalls for the whole parse). It costs about twice the time."""
    if max_depth is not None:
        depth = json_too_deep(body, max_depth)
        if depth is not None:
            raise JSONDepthError(depth, max_depth)
    if yielding is None:
        yielding = len(body) >= YIELDING_JSON_BYTES
    try:
        if yielding:
            return json.loads(body, parse_int=_json_int, parse_float=_json_float, object_pairs_hook=_json_object)
        return json.loads(body)
    except RecursionError:
        raise JSONDepthError(None, max_depth) from None


class JSONDepthError(ValueError):
    """A JSON body nested deeper than the server's ``max_json_depth`` (``depth`` None: than the parser can)."""

    def __init__(self, depth: int | None, limit: int | None):
        if depth is None:
            super().__init__("JSON body nested deeper than the parser's recursion limit")
        else:
            super().__init__(f"JSON body nested {depth} deep, over the limit of {limit} (max_json_depth)")
        self.depth, self.limit = depth, limit


# ---------------------------------------------------------------------------------------- blocking work off-loop


class Offload:
    """Runs blocking calls for async handlers: on the event loop while the call's measured cost is short, in a
    thread pool otherwise.

    A short call (a small model's prediction: under a millisecond) costs less than the two thread hand-offs around
    it, so it runs inline; a long one (a big batch, a first call that compiles) would stall every other request on
    the loop, so it goes to a thread. The cost is a moving average of wall time per ``key`` (e.g. a batch size);
    a key never seen runs in a thread first. ``budget_s=0`` = always a thread."""

    def __init__(self, workers: int, budget_s: float, name: str = "offload"):
        if not _is_int(workers) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        if not isinstance(budget_s, (int, float)) or budget_s < 0:
            raise ValueError(f"budget_s must be a number >= 0, got {budget_s!r}")
        self.workers, self.budget_s, self.name = workers, budget_s, name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # made on the first call that needs it
        self._pool_lock = threading.Lock()
        self._cost: dict[Hashable, float] = {}
        self.inline_calls = 0
        self.pooled_calls = 0

    def cost(self, key: Hashable) -> float | None:
        """The moving average of ``key``'s wall time in seconds (None = never measured)."""
        return self._cost.get(key)

    def measure(self, key: Hashable, fn: Callable, *args):
        """``fn(*args)`` on this thread, its wall time folded into ``key``'s cost (e.g. a warm-up call)."""
        t0 = time.perf_counter()
        out = fn(*args)
        seconds = time.perf_counter() - t0
        previous = self._cost.get(key)
        self._cost[key] = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        return out

    async def run(self, key: Hashable, fn: Callable, *args):
        """``fn(*args)``, inline or in a thread by the cost measured for ``key``."""
        cost = self._cost.get(key)
        if cost is not None and cost <= self.budget_s:
            self.inline_calls += 1
            return self.measure(key, fn, *args)
        self.pooled_calls += 1
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
            pool = self._pool
        return await asyncio.get_running_loop().run_in_executor(pool, self.measure, key, fn, *args)

    def shutdown(self) -> None:
        """Wait for the threads' calls to finish and end the threads (a later pooled call starts new ones)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


# ------------------------------------------------------------------------------------------------------ runners


class BackgroundServer:
    """A `Service` on its own event loop in a daemon thread (tests, notebooks, in-process roots and leaves)."""

    def __init__(self, service: Service):
        self.service = service
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.service.address

    @property
    def url(self) -> str:
        return self.service.url

    def start(self) -> BackgroundServer:
        self._loop = new_event_loop(self.service.config)
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"{self.service.name}-loop", daemon=True)
        self._thread.start()
        ready.result(timeout=60)  # re-raises a bind or TLS error here
        return self

    def _run(self, ready: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.service.open())
        except BaseException as e:
            ready.set_exception(e)
            self._loop.close()
            return
        ready.set_result(None)
        self._loop.run_forever()
        self._loop.close()

    def stop(self) -> None:
        """Graceful: in-flight requests finish (within ``shutdown_timeout_s``) before this returns."""
        if self._thread is None or not self._thread.is_alive():
            return
        timeout = self.service.config.shutdown_timeout_s + 30
        asyncio.run_coroutine_threadsafe(self.service.close(), self._loop).result(timeout=timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


def serve_until_signal(service: Service, announce: Callable[[str], None]) -> None:
    """Serve in the foreground until SIGTERM or SIGINT, then shut down gracefully and return (exit 0).

    ``announce(url)`` runs once the socket is bound (the CLIs print the URL for whoever started them)."""

    async def main() -> None:
        await service.open()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # everything loaded so far (modules, models, caches) lives as long as the process: out of the cyclic
        # collector's sight, a full collection scans only what requests allocate, not a ~30 ms pause
        gc.collect()
        gc.freeze()
        announce(service.url)
        await stop.wait()
        if service.config.drain_s > 0:  # /readyz says 503 first, so balancers stop sending before the listener closes
            service.draining = True
            log.info("%s: signal received, draining for %g s (/readyz 503)", service.name, service.config.drain_s)
            await asyncio.sleep(service.config.drain_s)
        log.info("%s: signal received, finishing %d in-flight requests", service.name, service.in_flight)
        await service.close()

    with asyncio.Runner(loop_factory=lambda: new_event_loop(service.config)) as runner:
        runner.run(main())


def new_event_loop(config: ServerConfig) -> asyncio.AbstractEventLoop:
    """uvloop's loop when ``config.uvloop`` and it is installed (it cuts the loop's and the transports' share of
    each request's CPU time), else asyncio's."""
    if config.uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


# ------------------------------------------------------------------------------------------------------ client


class Client:
    """Keep-alive HTTP(S) client to one server, one connection per calling thread (thread-safe).

    Sets ``TCP_NODELAY`` and sends each request in one write (`http.client` joins headers and a bytes body), so
    back-to-back requests on a connection do not stall. ``ca_file`` verifies an https server against that CA;
    ``token`` is sent as ``Authorization: Bearer``."""

    def __init__(self, url: str, timeout_s: float = 30.0, *, ca_file: str | Path | None = None, token: str = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"URL must be http(s)://host:port, got {url!r}")
        self.url, self._host, self._timeout = url, parts.hostname, timeout_s
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context(cafile=ca_file) if parts.scheme == "https" else None
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._ssl is not None:
                conn = http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout, context=self._ssl)
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn = conn
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None

    def request(self, method: str, path: str, body: bytes = b"", headers: dict | None = None):
        """-> (status, headers, body). Retries once when a reused keep-alive connection was closed by the peer."""
        for attempt in (0, 1):
            reused = getattr(self._local, "conn", None) is not None
            conn = self._connection()
            try:
                conn.request(method, path, body=body, headers={**self._auth, **(headers or {})})
                resp = conn.getresponse()
                data = resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    self._drop()
                return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._drop()
                if attempt or not reused:
                    raise
            except Exception:
                self._drop()
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._drop()


class AsyncClient:
    """`Client` for async handlers: aiohttp keep-alive connections to one server, on the event loop that first
    uses it (no thread hand-off per call). ``TCP_NODELAY`` is set on every connection (aiohttp does).

    ``request`` raises `ConnectionError` (an `OSError`) when the server is unreachable or drops the connection
    (after one retry when a pooled keep-alive connection turns out closed) and `TimeoutError` past ``timeout_s``.
    Close it on its loop (`close`, e.g. from `Service` ``on_close``)."""

    def __init__(self, url: str, timeout_s: float = 30.0, *, ca_file: str | Path | None = None, token: str = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"URL must be http(s)://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self._ssl = ssl.create_default_context(cafile=ca_file) if parts.scheme == "https" else None
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _session_here(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, ssl=self._ssl if self._ssl is not None else True)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout, auto_decompress=False)
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(f"AsyncClient for {self.url} is bound to another event loop")
        return self._session

    async def request(self, method: str, path: str, body: bytes = b"", headers: dict | None = None):
        """-> (status, headers with lower-case names, body)."""
        session = self._session_here()
        for attempt in (0, 1):
            try:
                async with session.request(
                    method, self.url + path, data=body, headers={**self._auth, **(headers or {})}
                ) as resp:
                    data = await resp.read()
                    return resp.status, {k.lower(): v for k, v in resp.headers.items()}, data
            except TimeoutError:
                raise TimeoutError(f"{self.url}: no answer within {self._timeout.total:g} s") from None
            except aiohttp.ClientConnectorError as e:  # could not connect at all: no retry
                raise ConnectionError(f"cannot connect to {self.url}: {e}") from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                if attempt:  # a pooled connection the server had closed gets one retry on a new one
                    raise ConnectionError(f"{self.url} closed the connection: {e}") from None
            except aiohttp.ClientError as e:
                raise ConnectionError(f"{self.url}: {type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# -------------------------------------------------------------------------------------------------- CLI flags


def add_server_arguments(parser) -> None:
    """The flags every jaxscale server shares (host/port stay with each command)."""
    d = ServerConfig()
    parser.add_argument(
        "--max-in-flight", type=int, default=d.max_in_flight, help="requests admitted at once (503 above)"
    )
    parser.add_argument("--workers", type=int, default=d.workers, help="threads running request handlers")
    parser.add_argument("--tokens-file", help='bearer tokens, JSON {"<token>": ["<resource>", ...] | "*"}')
    parser.add_argument("--tls-cert", help="PEM certificate chain (serve https; needs --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--shutdown-timeout", type=float, default=d.shutdown_timeout_s, help="seconds in-flight requests get on SIGTERM"
    )
    parser.add_argument(
        "--drain", type=float, default=d.drain_s, help="on SIGTERM: seconds /readyz is 503 before the listener closes"
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=d.max_body_bytes, help="request body bytes on the wire (413 above)"
    )
    parser.add_argument(
        "--body-timeout", type=float, default=d.body_timeout_s, help="seconds to receive a request body (408 after)"
    )
    parser.add_argument(
        "--max-decoded-bytes",
        type=int,
        default=d.max_decoded_bytes,
        help="Arrow bodies: bytes after decompression (413 above)",
    )
    parser.add_argument("--max-rows", type=int, default=d.max_rows, help="Arrow bodies: rows per request (413 above)")
    parser.add_argument(
        "--max-json-depth", type=int, default=d.max_json_depth, help="JSON bodies: nesting depth (400 above)"
    )
    parser.add_argument(
        "--parse-offload-bytes",
        type=int,
        default=d.parse_offload_bytes,
        help="bodies this long or longer are parsed off the event loop",
    )
    parser.add_argument("--no-uvloop", action="store_true", help="run on asyncio's own event loop, not uvloop's")


def server_options(args) -> dict:
    """`ServerConfig` keyword arguments from `add_server_arguments` flags."""
    return {
        "max_in_flight": args.max_in_flight,
        "workers": args.workers,
        "tokens_file": args.tokens_file,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "shutdown_timeout_s": args.shutdown_timeout,
        "drain_s": args.drain,
        "uvloop": not args.no_uvloop,
        "max_body_bytes": args.max_body_bytes,
        "body_timeout_s": args.body_timeout,
        "max_decoded_bytes": args.max_decoded_bytes,
        "max_rows": args.max_rows,
        "max_json_depth": args.max_json_depth,
        "parse_offload_bytes": args.parse_offload_bytes,
    }
