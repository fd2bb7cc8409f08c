"""The root's map model/version -> allowed features, built from exported signatures and swapped atomically.

A `Routes` object is immutable: a reload builds a complete new one (every signature read and checked) and then
replaces the reference in one assignment. A request takes the reference once and uses that snapshot for its
whole fan-out, so it never sees a half-built map nor two generations at once.

An entry whose signature is missing or unreadable has ``allowed = None``: the root sends that leaf every feature
of the request (fail open) and counts it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from jaxscale.infra.periodic import PeriodicTask
from jaxscale.serving import store as store_lib
from jaxscale.serving.signature import Signature, SignatureError

log = logging.getLogger(__name__)

OK, MISSING, UNREADABLE = "ok", "missing", "unreadable"


@dataclass(frozen=True)
class RouteEntry:
    """How the root treats one model version: ``allowed`` features in the signature's order, or None (fail open)."""

    model: str
    version: str
    status: str  # ok | missing | unreadable
    signature: Signature | None = None
    reason: str = ""

    @property
    def allowed(self) -> tuple[str, ...] | None:
        return self.signature.required if self.signature is not None else None

    def to_json(self) -> dict:
        out = {"model": self.model, "version": self.version, "status": self.status}
        if self.signature is not None:
            out.update(allowed=list(self.allowed), unused=list(self.signature.unused))
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True)
class Routes:
    generation: int
    entries: Mapping[tuple[str, str], RouteEntry]

    def entry(self, model: str, version: str) -> RouteEntry:
        return self.entries.get((model, version)) or RouteEntry(
            model, version, MISSING, reason="no signature for this model version in the store"
        )

    def to_json(self) -> dict:
        return {"generation": self.generation, "models": [e.to_json() for e in self.entries.values()]}


def read_entry(store: str | Path, model: str, version: str) -> RouteEntry:
    """One model version's entry from ``<store>/<model>/<version>/signature.json``."""
    path = store_lib.signature_path(store, model, version)
    if not path.exists():
        return RouteEntry(model, version, MISSING, reason=f"{path} does not exist")
    try:
        signature = Signature.load(path)
    except SignatureError as e:
        return RouteEntry(model, version, UNREADABLE, reason=str(e))
    if signature.key != (model, version):
        return RouteEntry(model, version, UNREADABLE, reason=f"{path} describes {signature.label}")
    return RouteEntry(model, version, OK, signature)


def build_routes(store: str | Path, keys: Iterable[tuple[str, str]], generation: int) -> Routes:
    entries = {key: read_entry(store, *key) for key in keys}
    return Routes(generation, MappingProxyType(entries))


class RouteTable:
    """Holds the current `Routes`; `reload()` rebuilds it from the store and swaps it in; `watch()` rescans."""

    def __init__(self, store: str | Path, keys: Iterable[tuple[str, str]], on_publish=None):
        self.store = Path(store)
        self._on_publish = on_publish  # called with each new Routes, after it is published
        self.keys = tuple(keys)
        self._reload_lock = threading.Lock()
        self._watcher = PeriodicTask(self.reload_if_changed, f"routes-watch-{self.store}")
        self._fingerprint = None
        self._routes = Routes(0, MappingProxyType({}))
        self.reload()

    def current(self) -> Routes:
        """The snapshot to use for one request (a single reference read: atomic)."""
        return self._routes

    def reload(self) -> Routes:
        """Read every signature, build a complete new map, then publish it in one assignment."""
        with self._reload_lock:
            fingerprint = store_lib.fingerprint(self.store)
            routes = build_routes(self.store, self.keys, self._routes.generation + 1)
            self._routes = routes
            self._fingerprint = fingerprint
            if self._on_publish is not None:
                self._on_publish(routes)
            for e in routes.entries.values():
                if e.status != OK:
                    log.warning(
                        "routes generation %d: %s/%s %s (fail open): %s",
                        routes.generation,
                        e.model,
                        e.version,
                        e.status,
                        e.reason,
                    )
            return routes

    def set_keys(self, keys: Iterable[tuple[str, str]]) -> Routes:
        """Serve another set of model versions (the root's config reloaded): a new map of those, published whole."""
        with self._reload_lock:
            self.keys = tuple(keys)
        return self.reload()

    def reload_if_changed(self) -> bool:
        if store_lib.fingerprint(self.store) == self._fingerprint:
            return False
        self.reload()
        return True

    def watch(self, interval_s: float) -> None:
        """Rescan the store every ``interval_s`` seconds in a daemon thread; reload when a signature changed."""
        self._watcher.start(interval_s)

    def close(self) -> None:
        self._watcher.close()
