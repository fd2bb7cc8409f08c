"""Feature trimming: decide, per leaf, which of a request's features to send, and cut the payload to them.

`plan_fanout` is the whole decision (pure, no I/O): for each target model version it checks the request against
the signature (a bad request fails here, naming the feature, before any leaf is called) and returns the feature
names to send, or None to send everything when the signature is missing or unreadable (fail open).
`trim_batch` applies it; selecting Arrow columns is zero-copy.

`FanoutPlanner` memoizes plans by request schema: the schema fixes every feature's dtype and shape, so a request
whose schema equals one already checked under the same route map reuses that plan (a C++ schema comparison)
instead of re-reading the schema and re-checking every signature.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

from jaxscale.serving import wire
from jaxscale.serving.routes import OK, Routes


@dataclass(frozen=True)
class LeafPlan:
    model: str
    version: str
    send: tuple[str, ...] | None  # feature names to send; None = every feature of the request
    fail_open: str | None = None  # why the leaf gets everything: "missing" | "unreadable" (None when trimmed)
    indices: tuple[int, ...] | None = None  # column positions of ``send`` in the request, when known

    @property
    def label(self) -> str:
        return f"{self.model}/{self.version}"


def plan_fanout(
    columns: Mapping[str, tuple[str, tuple[int, ...]]],
    routes: Routes,
    targets: Sequence[tuple[str, str]],
    *,
    trim: bool = True,
) -> list[LeafPlan]:
    """Per target: check the request's ``{feature: (dtype, shape)}`` against its signature; choose what to send.

    With ``trim=False`` every leaf gets every feature (the baseline), but known signatures are still checked.
    """
    plans = []
    position = {name: i for i, name in enumerate(columns)}
    for model, version in targets:
        entry = routes.entry(model, version)
        if entry.status != OK:
            plans.append(LeafPlan(model, version, None, fail_open=entry.status))
            continue
        entry.signature.check(columns)
        if not trim:
            plans.append(LeafPlan(model, version, None))
            continue
        send = entry.allowed
        plans.append(LeafPlan(model, version, send, indices=tuple(position[n] for n in send)))
    return plans


def trim_batch(batch: pa.RecordBatch, plan: LeafPlan | tuple[str, ...] | None) -> pa.RecordBatch:
    """The columns a plan sends (in the signature's order), or the whole batch when it sends everything."""
    if isinstance(plan, LeafPlan):
        if plan.send is None:
            return batch
        return batch.select(list(plan.indices) if plan.indices is not None else list(plan.send))
    return batch if plan is None else batch.select(list(plan))


class FanoutPlanner:
    """`plan_fanout` memoized by request schema, for one route-map generation at a time (thread-safe)."""

    def __init__(self, max_schemas: int = 32):
        self.max_schemas = max_schemas
        self._lock = threading.Lock()
        self._generation = None
        self._cache: dict[tuple, list[tuple[pa.Schema, list[LeafPlan]]]] = {}
        self.hits = self.misses = 0

    def plan(self, batch: pa.RecordBatch, routes: Routes, targets: Sequence[tuple[str, str]], *, trim: bool = True):
        key = (tuple(targets), trim)
        schema = batch.schema
        with self._lock:
            if self._generation != routes.generation:
                self._generation, self._cache = routes.generation, {}
            for seen, plans in self._cache.get(key, ()):
                if seen.equals(schema):
                    self.hits += 1
                    return plans
            self.misses += 1
        plans = plan_fanout(wire.describe(batch), routes, targets, trim=trim)  # raises on a bad request
        with self._lock:
            if self._generation == routes.generation:
                entries = self._cache.setdefault(key, [])
                entries.insert(0, (schema, plans))
                del entries[self.max_schemas :]
        return plans
