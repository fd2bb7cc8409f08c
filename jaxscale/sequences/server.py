"""The serving API: a threaded HTTP server over the store's in-memory index.

    GET /v1/users/{user_id}/sequences/{name}?as_of=T&limit=N&ids=raw|dense
      200 {"user_id": 42, "sequence": "engagement", "events": [{"item_id": ..., "ts": ..., ...}, ...]}
          the user's last min(N, max_length) events with ts < T (epoch ms; every indexed event when as_of
          is absent), oldest first, ties in ts in arrival order; a user without events gets an empty list.
          ids=dense (default raw): the sequence's vocabulary fields hold dense indices (OOV = 1)
      400 {"error": ...}  user_id, as_of or limit malformed (not an integer, out of range, negative limit),
                          ids neither raw nor dense, ids=dense on a sequence without a stored vocabulary,
                          a parameter repeated or unknown
      404 {"error": ...}  unknown sequence (or path)
    GET /v1/sequences   the store's sequences with their fields, max_length, days and event counts
    GET /healthz        {"status": "ok"}

The index reloads changed partitions in the background every `refresh_seconds`, so a running backfill or
stream becomes visible without a restart (each partition is swapped in whole).
"""

from __future__ import annotations

import json
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from jaxscale.sequences.query import ID_MODES, INT64_MAX, INT64_MIN, SequenceReader
from jaxscale.sequences.store import list_sequences

_ROUTE = re.compile(r"^/v1/users/([^/]+)/sequences/([^/]+)$")
_INT = re.compile(r"^[+-]?[0-9]+$")
PARAMS = ("as_of", "limit", "ids")


class BadRequest(ValueError):
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


def parse_query(query: str) -> tuple[int | None, int | None, str]:
    """(as_of, limit, ids) from a query string, strictly (ids: 'raw', the default, or 'dense')."""
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
    return as_of, limit, ids


class SequenceStore:
    """The readers of every sequence of a store, refreshed from disk on demand."""

    def __init__(self, store):
        self.path = Path(store)
        if not self.path.is_dir():
            raise FileNotFoundError(f"store {self.path} does not exist")
        self.readers: dict[str, SequenceReader] = {}
        self.refresh()

    def refresh(self) -> None:
        for name in list_sequences(self.path):
            if name in self.readers:
                self.readers[name].refresh()
            else:
                self.readers[name] = SequenceReader(self.path, name)

    def describe(self) -> dict:
        return {
            name: {
                "fields": list(r.fields),
                "max_length": r.max_length,
                "days": [p.day for p in r.partitions],
                "events": r.num_events,
                **({"vocabularies": {f: _describe(v) for f, v in r.vocabularies.items()}} if r.vocabularies else {}),
            }
            for name, r in sorted(self.readers.items())
        }


def _describe(vocab) -> dict | None:
    return None if vocab is None else {"version": vocab.version, "size": vocab.size, "num_indices": vocab.num_indices}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client reuses its connection
    server_version = "jaxscale-sequences/1"

    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        if self.server.access_log:
            super().log_message(format, *args)

    def _send(self, status: int, body) -> None:
        data = (body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's naming
        try:
            status, body = self.route()
        except BadRequest as e:
            status, body = HTTPStatus.BAD_REQUEST, {"error": str(e)}
        except Exception as e:  # never leave the client without an answer
            status, body = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(e).__name__}: {e}"}
        self._send(status, body)

    def _not_allowed(self):
        length = self.headers.get("Content-Length")
        if length and length.isdigit() and int(length) <= 1 << 20:
            self.rfile.read(int(length))  # keep the connection's framing intact
        else:
            self.close_connection = True
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"method {self.command} not allowed; use GET"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _not_allowed

    def route(self) -> tuple[int, dict]:
        url = urlsplit(self.path)
        store: SequenceStore = self.server.store
        if url.path == "/healthz":
            return HTTPStatus.OK, {"status": "ok"}
        if url.path == "/v1/sequences":
            return HTTPStatus.OK, {"sequences": store.describe()}
        m = _ROUTE.match(url.path)
        if not m:
            return HTTPStatus.NOT_FOUND, {
                "error": f"no route {url.path!r}; use /v1/users/{{user_id}}/sequences/{{name}}"
            }
        name = unquote(m.group(2))
        reader = store.readers.get(name)
        if reader is None:
            return HTTPStatus.NOT_FOUND, {"error": f"unknown sequence {name!r}; the store has {sorted(store.readers)}"}
        user_id = parse_int("user_id", unquote(m.group(1)))
        as_of, limit, ids = parse_query(url.query)
        try:
            events = reader.events_json(user_id, as_of, limit, ids=ids)
        except ValueError as e:  # ids=dense without a vocabulary
            raise BadRequest(str(e)) from None
        return HTTPStatus.OK, f'{{"user_id":{user_id},"sequence":{json.dumps(name)},"events":{events}}}'


class SequenceServer(ThreadingHTTPServer):
    """`ThreadingHTTPServer` over a store, with a background refresh thread."""

    daemon_threads = True

    def __init__(
        self, store, host: str = "127.0.0.1", port: int = 0, *, refresh_seconds: float = 1.0, access_log=False
    ):
        self.store = SequenceStore(store)
        self.access_log = access_log
        self.refresh_seconds = refresh_seconds
        self._stop = threading.Event()
        super().__init__((host, port), Handler)
        self._refresher = threading.Thread(target=self._refresh_loop, name="store-refresh", daemon=True)
        self._refresher.start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_seconds):
            try:
                self.store.refresh()
            except Exception as e:  # keep serving the last good index
                print(f"warning: store refresh failed: {e}", flush=True)

    def server_close(self) -> None:
        self._stop.set()
        super().server_close()


def serve_in_thread(store, host: str = "127.0.0.1", port: int = 0, **kw) -> SequenceServer:
    """Starts a server on a background thread (tests, notebooks); `shutdown()` + `server_close()` stop it."""
    server = SequenceServer(store, host, port, **kw)
    threading.Thread(target=server.serve_forever, name="sequence-server", daemon=True).start()
    return server
