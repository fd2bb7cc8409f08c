"""The serving API over the store's in-memory index, on the shared HTTP layer (`jaxscale.infra.http_server`).

    GET /v1/users/{user_id}/sequences/{name}?as_of=T&limit=N&ids=raw|dense&as_of_mode=event|ingest|visible
      200 {"user_id": 42, "sequence": "engagement", "events": [{"item_id": ..., "ts": ..., ...}, ...]}
          the user's last min(N, max_length) events with ts < T (epoch ms; every indexed event when as_of
          is absent), oldest first, ties in ts in arrival order; a user without events gets an empty list.
          ids=dense (default raw): the sequence's vocabulary fields hold dense indices (OOV = 1)
          as_of_mode=ingest (default event): only events the platform had received before T (ingest_ts < T);
          as_of_mode=visible: only events committed to the store before T (visible_ts < T: what a reader
          of the store could have answered at T; see jaxscale.sequences.query)
      400 {"error": ...}  user_id, as_of or limit malformed (not an integer, out of range, negative limit),
                          ids neither raw nor dense, ids=dense on a sequence without a stored vocabulary,
                          as_of_mode not event, ingest or visible, a parameter repeated or unknown
      404 {"error": ...}  unknown sequence (or path)
      422 {"error": ...}  the answer needs events older than the server's per-user window (--hold-events N:
                          each user's last N events are held in memory, the store keeps every event); the
                          message names the window and the time of the user's newest event not held
      405 {"error": ...}  a method other than GET (except batchGet below)
    POST /v1/sequences/{name}:batchGet   body {"user_ids": [...], "as_of": T?, "limit": N?, "ids": "raw|dense"?,
                                               "as_of_mode": "event|ingest|visible"?}
      200 {"sequence": name, "results": [{"user_id": u, "events": [...]}, ...]}  in request order, each result's
          events equal to the GET answer for that user; at most MAX_BATCH_USERS user ids (413 above)
      400 {"error": "<field>: ..."}  a malformed body or field, an unknown field, a body nested deeper than
                                     max_json_depth
      408 / 413  a body not received within body_timeout_s / longer than max_body_bytes (the HTTP layer)
    GET /v1/sequences   the store's sequences with their fields, max_length, days and event counts
    GET /healthz        {"status": "ok"}     GET /metrics   Prometheus text

With a tokens file, a token must grant the sequence named in the path (401 without/unknown token, 403 without
access). The index reloads changed partitions in the background every `refresh_seconds`, so a running backfill or
stream becomes visible without a restart (each partition is swapped in whole).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from urllib.parse import parse_qs

from jaxscale.infra.http_server import (
    BackgroundServer,
    JSONDepthError,
    Request,
    Response,
    Route,
    ServerConfig,
    Service,
    parse_json,
    path_resource,
    serve_until_signal,
)
from jaxscale.infra.periodic import PeriodicTask
from jaxscale.sequences.query import AS_OF_MODES, ID_MODES, INT64_MAX, INT64_MIN, OutsideWindow, SequenceReader
from jaxscale.sequences.store import list_sequences

_INT = re.compile(r"^[+-]?[0-9]+$")
PARAMS = ("as_of", "limit", "ids", "as_of_mode")
BATCH_FIELDS = ("user_ids", "as_of", "limit", "ids", "as_of_mode")
MAX_BATCH_USERS = 1000
USER_ROUTE = "/v1/users/{user_id}/sequences/{name}"
log = logging.getLogger("jaxscale.sequences.server")


class BadRequest(ValueError):
    pass


class TooLarge(ValueError):
    pass


def parse_int(name: str, raw: str, minimum: int = INT64_MIN) -> int:
    """A decimal int64 >= minimum, or BadRequest naming the parameter and value."""
    if not _INT.match(raw):
        raise BadRequest(f"{name} must be an integer, got {raw!r}")
    value = int(raw)
    if not minimum <= value <= INT64_MAX:
        low = "0" if minimum == 0 else "-2**63"
        raise BadRequest(f"{name} must be in [{low}, 2**63 - 1], got {raw!r}")
    return value


def parse_query(query: str) -> tuple[int | None, int | None, str, str]:
    """(as_of, limit, ids, as_of_mode) from a query string, strictly (defaults: ids 'raw', as_of_mode 'event')."""
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=16)
    except ValueError as e:
        raise BadRequest(f"malformed query string {query!r}: {e}") from None
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise BadRequest(f"unknown query parameter {unknown[0]!r} (known: {list(PARAMS)})")
    for k, v in params.items():
        if len(v) > 1:
            raise BadRequest(f"query parameter {k!r} is given {len(v)} times")
    as_of = parse_int("as_of", params["as_of"][0]) if "as_of" in params else None
    limit = parse_int("limit", params["limit"][0], minimum=0) if "limit" in params else None
    ids = params["ids"][0] if "ids" in params else "raw"
    if ids not in ID_MODES:
        raise BadRequest(f"ids must be one of {list(ID_MODES)}, got {ids!r}")
    mode = params["as_of_mode"][0] if "as_of_mode" in params else "event"
    if mode not in AS_OF_MODES:
        raise BadRequest(f"as_of_mode must be one of {list(AS_OF_MODES)}, got {mode!r}")
    return as_of, limit, ids, mode


def _json_int(name: str, value, minimum: int = INT64_MIN) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{name}: must be an integer, got {json.dumps(value)[:80]}")
    if not minimum <= value <= INT64_MAX:
        low = "0" if minimum == 0 else "-2**63"
        raise BadRequest(f"{name}: must be in [{low}, 2**63 - 1], got {value}")
    return value


def _json_choice(name: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise BadRequest(f"{name}: must be one of {list(choices)}, got {json.dumps(value)[:80]}")
    return value


def parse_batch(body: bytes, max_depth: int = 64) -> tuple[list[int], int | None, int | None, str, str]:
    """(user_ids, as_of, limit, ids, as_of_mode) from a batchGet body, strictly; BadRequest names the field.
    The body is nested at most ``max_depth`` deep; a big one is parsed letting the event loop run meanwhile
    (`jaxscale.infra.http_server.parse_json`: the handler runs in a thread)."""
    try:
        doc = parse_json(body, max_depth)
    except JSONDepthError as e:
        raise BadRequest(f"body: {e}") from None
    except ValueError as e:
        raise BadRequest(f"body: must be a JSON object: {e}") from None
    if not isinstance(doc, dict):
        raise BadRequest('body: must be a JSON object {"user_ids": [...], ...}')
    unknown = sorted(set(doc) - set(BATCH_FIELDS))
    if unknown:
        raise BadRequest(f"{unknown[0]}: unknown field (known: {list(BATCH_FIELDS)})")
    if "user_ids" not in doc:
        raise BadRequest("user_ids: required")
    users = doc["user_ids"]
    if not isinstance(users, list):
        raise BadRequest(f"user_ids: must be a list of integers, got {json.dumps(users)[:80]}")
    if len(users) > MAX_BATCH_USERS:
        raise TooLarge(f"user_ids: {len(users)} users exceed the limit of {MAX_BATCH_USERS} per request")
    user_ids = [_json_int(f"user_ids[{i}]", u) for i, u in enumerate(users)]
    as_of = None if doc.get("as_of") is None else _json_int("as_of", doc["as_of"])
    limit = None if doc.get("limit") is None else _json_int("limit", doc["limit"], minimum=0)
    ids = _json_choice("ids", doc.get("ids", "raw"), ID_MODES)
    mode = _json_choice("as_of_mode", doc.get("as_of_mode", "event"), AS_OF_MODES)
    return user_ids, as_of, limit, ids, mode


class SequenceStore:
    """The readers of every sequence of a store, refreshed from disk on demand. `hold`: each reader keeps
    only every user's last `hold` events in memory (None: all; see `jaxscale.sequences.query`). A sequence
    whose refresh fails keeps what it had (or stays absent) and the others still refresh; each failure is
    logged and counted per sequence (`jaxscale_sequences_refresh_failures_total{sequence}`)."""

    def __init__(self, store, hold: int | None = None):
        self.path, self.hold = Path(store), hold
        if not self.path.is_dir():
            raise FileNotFoundError(f"store {self.path} does not exist")
        self.readers: dict[str, SequenceReader] = {}
        self.failures: dict[str, int] = {}
        self.last_error: dict[str, str | None] = {}
        self.refresh()

    def refresh(self) -> None:
        for name in list_sequences(self.path):
            try:
                if name in self.readers:
                    self.readers[name].refresh()
                else:
                    self.readers[name] = SequenceReader(self.path, name, hold=self._hold(name))
                self.last_error[name] = None
            except Exception as e:  # one sequence's failure must not stop the others' refresh
                self.failures[name] = self.failures.get(name, 0) + 1
                self.last_error[name] = f"{type(e).__name__}: {e}"
                log.warning("refresh of sequence %r failed (it keeps what it had): %s", name, self.last_error[name])

    def _hold(self, name: str) -> int | None:
        """The window for `name`: `hold`, raised to the sequence's max_length (a window must hold one answer)."""
        if self.hold is None:
            return None
        from jaxscale.sequences.store import read_sequence_meta

        return max(self.hold, int(read_sequence_meta(self.path / name)["sequence"]["max_length"]))

    def collector(self):
        """A Prometheus collector of `metrics()` (this class's `describe` is the store's, not a collector's)."""
        return _Collector(self.metrics)

    def metrics(self):
        """Per sequence, refresh failures, whether the last refresh worked, events and
        bytes held in memory."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        failures = CounterMetricFamily(
            "jaxscale_sequences_refresh_failures", "Refreshes of a sequence that failed", labels=["sequence"]
        )
        ok = GaugeMetricFamily("jaxscale_sequences_refresh_ok", "1 if the last refresh worked", labels=["sequence"])
        events = GaugeMetricFamily("jaxscale_sequences_events_held", "Events held in memory", labels=["sequence"])
        held = GaugeMetricFamily("jaxscale_sequences_held_bytes", "Bytes of events held in memory", labels=["sequence"])
        for name in sorted(set(self.readers) | set(self.failures)):
            failures.add_metric([name], self.failures.get(name, 0))
            ok.add_metric([name], 0 if self.last_error.get(name) else 1)
            if name in self.readers:
                events.add_metric([name], self.readers[name].num_events)
                held.add_metric([name], self.readers[name].memory_bytes)
        return [failures, ok, events, held]

    def describe(self) -> dict:
        return {
            name: {
                "fields": list(r.fields),
                "max_length": r.max_length,
                "days": r.days,
                "events": r.num_events,
                **({"vocabularies": {f: _describe(v) for f, v in r.vocabularies.items()}} if r.vocabularies else {}),
            }
            for name, r in sorted(self.readers.items())
        }


class _Collector:
    def __init__(self, collect):
        self.collect = collect


def _describe(vocab) -> dict | None:
    return None if vocab is None else {"version": vocab.version, "size": vocab.size, "num_indices": vocab.num_indices}


def _compact(body, status: int = 200) -> Response:
    text = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return Response(status, text.encode())


def _unrouted(request: Request, allowed: list[str]) -> Response:
    """The API's historical answers: 405 for any method but GET, else 404 naming the path."""
    if request.method != "GET":
        return _compact({"error": f"method {request.method} not allowed; use GET"}, 405)
    return _compact({"error": f"no route {request.path!r}; use /v1/users/{{user_id}}/sequences/{{name}}"}, 404)


class SequenceAPI:
    """The route handlers over one `SequenceStore`."""

    def __init__(self, store: SequenceStore, max_json_depth: int = 64):
        self.store, self.max_json_depth = store, max_json_depth

    def routes(self) -> list[Route]:
        seq = path_resource("name")
        return [
            Route("GET", "/healthz", lambda r: _compact({"status": "ok"}), public=True, inline=True),
            Route("GET", "/v1/sequences", lambda r: _compact({"sequences": self.store.describe()})),
            Route("GET", USER_ROUTE, self._guard(self.get_user), resources=seq),
            Route("POST", "/v1/sequences/{name}:batchGet", self._guard(self.batch_get), resources=seq),
        ]

    @staticmethod
    def _guard(handler):
        def guarded(request: Request) -> Response:
            try:
                return handler(request)
            except BadRequest as e:
                return _compact({"error": str(e)}, 400)
            except TooLarge as e:
                return _compact({"error": str(e)}, 413)
            except OutsideWindow as e:
                return _compact({"error": str(e)}, 422)

        return guarded

    def _reader(self, name: str) -> SequenceReader | Response:
        reader = self.store.readers.get(name)
        if reader is None:
            return _compact({"error": f"unknown sequence {name!r}; the store has {sorted(self.store.readers)}"}, 404)
        return reader

    @staticmethod
    def _events(reader, user_id: int, as_of, limit, ids: str, mode: str) -> str:
        kw = {"as_of_mode": mode} if mode != "event" else {}
        try:
            return reader.events_json(user_id, as_of, limit, ids=ids, **kw)
        except ValueError as e:  # ids=dense without a vocabulary
            raise BadRequest(str(e)) from None

    def get_user(self, request: Request) -> Response:
        name = request.params["name"]
        reader = self._reader(name)
        if isinstance(reader, Response):
            return reader
        user_id = parse_int("user_id", request.params["user_id"])
        as_of, limit, ids, mode = parse_query(request.query_string)
        events = self._events(reader, user_id, as_of, limit, ids, mode)
        return _compact(f'{{"user_id":{user_id},"sequence":{json.dumps(name)},"events":{events}}}')

    def batch_get(self, request: Request) -> Response:
        name = request.params["name"]
        reader = self._reader(name)
        if isinstance(reader, Response):
            return reader
        user_ids, as_of, limit, ids, mode = parse_batch(request.body, self.max_json_depth)
        results = ",".join(
            f'{{"user_id":{u},"events":{self._events(reader, u, as_of, limit, ids, mode)}}}' for u in user_ids
        )
        return _compact(f'{{"sequence":{json.dumps(name)},"results":[{results}]}}')


class SequenceServer:
    """The API over a store on the shared HTTP layer, with a background refresh thread.

    ``SequenceServer(store, host, port, refresh_seconds=..., **options)``: ``options`` are `ServerConfig` fields
    (max_in_flight, tokens_file, tls_cert, tls_key, ...). `start()` serves on a background thread (then
    `shutdown()` + `server_close()`, or `stop()`); `serve_forever()` serves in the foreground until SIGTERM."""

    def __init__(
        self,
        store,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        refresh_seconds: float = 1.0,
        hold_events: int | None = None,
        **options,
    ):
        self.config = ServerConfig(host=host, port=port, **options)
        self.store = SequenceStore(store, hold_events)
        self.refresh_seconds = refresh_seconds
        self.service = Service(
            SequenceAPI(self.store, self.config.max_json_depth).routes(),
            self.config,
            name="jaxscale-sequences",
            metrics_prefix="jaxscale_sequences",
            collectors=(self.store.collector(),),
            unrouted=_unrouted,
        )
        self._background: BackgroundServer | None = None
        self._refresher = PeriodicTask(self.store.refresh, "store-refresh")

    @property
    def url(self) -> str:
        return self.service.url

    @property
    def server_address(self) -> tuple[str, int]:
        return self.service.address

    def _start_refresh(self) -> None:
        if self.refresh_seconds > 0:  # 0: the index stays as loaded at start
            self._refresher.start(self.refresh_seconds)

    def start(self) -> SequenceServer:
        self._background = BackgroundServer(self.service).start()
        self._start_refresh()
        return self

    def stop(self) -> None:
        """Graceful: in-flight requests finish first."""
        self._refresher.close()
        if self._background is not None:
            self._background.stop()
            self._background = None

    shutdown = stop

    def server_close(self) -> None:
        self.stop()

    def serve_forever(self, announce=lambda url: None) -> None:
        """Serve until SIGTERM/SIGINT, then finish in-flight requests and return."""
        self._start_refresh()
        try:
            serve_until_signal(self.service, announce)
        finally:
            self._refresher.close()


def serve_in_thread(store, host: str = "127.0.0.1", port: int = 0, **kw) -> SequenceServer:
    """Starts a server on a background thread (tests, notebooks); `shutdown()` + `server_close()` stop it."""
    return SequenceServer(store, host, port, **kw).start()
