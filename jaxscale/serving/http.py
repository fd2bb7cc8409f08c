"""Small HTTP/1.1 plumbing shared by the root and leaf servers: a threaded server run in the background and a
keep-alive client. Standard library only (`http.server`, `http.client`).

Handlers are plain functions ``(Request) -> Response``; an exception they raise becomes a JSON error body
(`HTTPError` for 4xx with a payload, anything else a 500 that names the exception).
"""

from __future__ import annotations

import http.client
import json
import logging
import sys
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)
JSON = "application/json"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes


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


Routes = dict[tuple[str, str], Callable[[Request], Response]]


def _handler_class(routes: Routes, max_body_bytes: int, server_name: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive between the root and its leaves
        server_version = server_name

        def _dispatch(self, method: str) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(url.query))
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > max_body_bytes:
                self.close_connection = True
                return self._send(
                    Response.json({"error": f"body of {length} bytes (limit {max_body_bytes})"}, status=413)
                )
            body = self.rfile.read(length) if length else b""
            fn = routes.get((method, url.path))
            if fn is None:
                allowed = sorted(m for m, p in routes if p == url.path)
                status = 405 if allowed else 404
                return self._send(Response.json({"error": f"no route {method} {url.path}", "allowed": allowed}, status))
            request = Request(method, url.path, query, {k.lower(): v for k, v in self.headers.items()}, body)
            try:
                response = fn(request)
            except HTTPError as e:
                response = Response.json(e.payload, e.status)
            except Exception as e:  # a bug must not kill the connection silently: answer 500 and log it
                log.exception("%s %s failed", method, url.path)
                response = Response.json({"error": f"internal error: {type(e).__name__}: {e}"}, 500)
            self._send(response)

        def _send(self, response: Response) -> None:
            self.send_response(response.status)
            self.send_header("Content-Type", response.content_type)
            self.send_header("Content-Length", str(len(response.body)))
            for k, v in response.headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(response.body)

        def do_GET(self):
            self._dispatch("GET")

        def do_POST(self):
            self._dispatch("POST")

        def log_message(self, format, *args):  # noqa: A002 - stdlib signature
            log.debug("%s %s", self.address_string(), format % args)

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        """A client that hung up mid-response is routine; anything else is logged with its traceback."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("client %s disconnected", client_address)
        else:
            log.exception("error serving %s", client_address)


class BackgroundServer:
    """A `ThreadingHTTPServer` on ``host:port`` (port 0 = a free one) serving in a daemon thread."""

    def __init__(self, routes: Routes, host: str = "127.0.0.1", port: int = 0, *, max_body_bytes: int, name: str):
        self._server = _Server((host, port), _handler_class(routes, max_body_bytes, name))
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self._server.server_address[:2]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> BackgroundServer:
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"http-{self.url}", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)


class Client:
    """Keep-alive HTTP client to one server, one connection per calling thread (thread-safe)."""

    def __init__(self, url: str, timeout_s: float = 30.0):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"leaf URL must be http://host:port, got {url!r}")
        self.url, self._host, self._port, self._timeout = url, parts.hostname, parts.port or 80, timeout_s
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        return conn

    def request(self, method: str, path: str, body: bytes = b"", headers: dict | None = None):
        """-> (status, headers, body). Retries once when a reused keep-alive connection was closed by the peer."""
        for attempt in (0, 1):
            conn = self._connection()
            reused = conn.sock is not None
            try:
                conn.request(method, path, body=body, headers=headers or {})
                resp = conn.getresponse()
                data = resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    conn.close()
                return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                conn.close()
                self._local.conn = None
                if attempt or not reused:
                    raise
            except Exception:
                conn.close()
                self._local.conn = None
                raise
        raise AssertionError("unreachable")
