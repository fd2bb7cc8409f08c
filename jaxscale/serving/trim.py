"""Feature trimming: decide, per leaf, which of a request's features to send, and cut the payload to them.

`plan_fanout` is the whole decision (pure, no I/O): for each target model version it checks the request against
the signature (a bad request fails here, naming the feature, before any leaf is called) and returns the feature
names to send, or None to send everything when the signature is missing or unreadable (fail open).
`trim_batch` applies it; selecting Arrow columns is zero-copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa

from jaxscale.serving.routes import OK, Routes


@dataclass(frozen=True)
class LeafPlan:
    model: str
    version: str
    send: tuple[str, ...] | None  # feature names to send; None = every feature of the request
    fail_open: str | None = None  # why the leaf gets everything: "missing" | "unreadable" (None when trimmed)

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
    for model, version in targets:
        entry = routes.entry(model, version)
        if entry.status != OK:
            plans.append(LeafPlan(model, version, None, fail_open=entry.status))
            continue
        entry.signature.check(columns)
        plans.append(LeafPlan(model, version, entry.allowed if trim else None))
    return plans


def trim_batch(batch: pa.RecordBatch, send: tuple[str, ...] | None) -> pa.RecordBatch:
    """The columns named in ``send`` (in that order), or the whole batch when ``send`` is None."""
    return batch if send is None else batch.select(list(send))
