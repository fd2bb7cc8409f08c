"""One function called every few seconds on a daemon thread until closed: how the serving tables (the root's
routes, a leaf's hybrid states) and the sequence server's store follow new publications. A failing call is
logged and the last good version keeps serving; the next tick retries."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class PeriodicTask:
    """`start(interval_s)` calls `fn()` every `interval_s` seconds (the first call one interval after start);
    `close()` stops the thread and waits for a call in progress. Starting twice keeps the first thread."""

    def __init__(self, fn: Callable[[], object], name: str):
        self.fn, self.name = fn, name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"{self.name}: the interval must be positive seconds, got {interval_s}")
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), name=self.name, daemon=True)
        self._thread.start()

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.fn()
            except Exception:  # keep the last good version; the next tick retries
                log.exception("%s failed", self.name)

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None
