"""What keeps one bad leaf from taking the root down: deadlines, a per-leaf concurrency bound, a circuit breaker.

Modelled on what Envoy and gRPC do:
  * deadlines: a request's budget is the client's ``X-Request-Timeout-Ms`` (gRPC's ``grpc-timeout``; Envoy's
    ``x-envoy-expected-rq-timeout-ms``) or the root's own timeout; every leaf call gets what is left of it (capped
    by the leaf's own timeout) and is told so in the same header, so a leaf gives up on work nobody will read.
    A call that runs out is answered 504 naming the deadline;
  * a concurrency bound per leaf (Envoy's ``max_requests`` circuit breaker): over it a call fails at once (503 +
    ``Retry-After``) instead of queueing behind a slow leaf;
  * a circuit breaker per leaf (Envoy's outlier ejection, simplified): after ``failures`` consecutive failures
    (unreachable, deadline, 5xx) the leaf is not called for ``cooldown_s``; then one probe call is let through
    (half-open): its success closes the circuit, its failure opens it again.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

TIMEOUT_HEADER = "X-Request-Timeout-Ms"

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATES = (CLOSED, OPEN, HALF_OPEN)


def budget_s(headers: dict) -> float | None:
    """The seconds a request's sender still waits for (``X-Request-Timeout-Ms``; lower-case header names), None
    without one. A header that is not a number is ignored (None): a deadline is a hint, not a reason to refuse."""
    text = headers.get(TIMEOUT_HEADER.lower())
    if text is None:
        return None
    try:
        ms = float(text)
    except ValueError:
        return None
    if not math.isfinite(ms):
        return None
    return max(ms, 0.0) / 1000.0


class CircuitBreaker:
    """closed -> (``failures`` consecutive failures) -> open -> (``cooldown_s``) -> half-open: one probe call ->
    closed on its success, open again on its failure. ``failures=0`` never opens. Thread-safe.

    ``on_change(old, new)`` is called (under no lock) when the state changes (metrics, log lines)."""

    def __init__(self, failures: int, cooldown_s: float, on_change: Callable[[str, str], None] | None = None):
        self.failures, self.cooldown_s = failures, cooldown_s
        self._on_change = on_change
        self._lock = threading.Lock()
        self.state = CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False

    def _move(self, new: str) -> tuple[str, str] | None:
        old, self.state = self.state, new
        return (old, new) if old != new else None

    def _changed(self, change) -> None:
        if change is not None and self._on_change is not None:
            self._on_change(*change)

    def admit(self) -> float | None:
        """None when a call may go; else the seconds until one may (the ``Retry-After`` to answer)."""
        change = None
        with self._lock:
            if self.state == OPEN:
                left = self._opened_at + self.cooldown_s - time.monotonic()
                if left > 0:
                    return left
                change = self._move(HALF_OPEN)
            if self.state == HALF_OPEN:
                if self._probing:
                    return max(self.cooldown_s, 0.001)
                self._probing = True
        self._changed(change)
        return None

    def record(self, ok: bool) -> None:
        """The outcome of an admitted call."""
        change = None
        with self._lock:
            self._probing = False
            if ok:
                self._consecutive = 0
                change = self._move(CLOSED)
            else:
                self._consecutive += 1
                if self.state == HALF_OPEN or (self.failures and self._consecutive >= self.failures):
                    self._opened_at = time.monotonic()
                    change = self._move(OPEN)
        self._changed(change)

    def release(self) -> None:
        """An admitted call ended with no verdict (cancelled: the client left): a probe may be tried again."""
        with self._lock:
            self._probing = False


class Concurrency:
    """At most ``limit`` calls at once (thread-safe); `acquire` never waits."""

    def __init__(self, limit: int):
        self.limit, self.in_flight = limit, 0
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        with self._lock:
            if self.in_flight >= self.limit:
                return False
            self.in_flight += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.in_flight -= 1
