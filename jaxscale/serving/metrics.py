"""Thread-safe counters for the root and leaf servers, readable from Python and as Prometheus text.

Each server owns one `Metrics` (declared names, types, help, label names). It is a prometheus_client collector:
the HTTP layer registers it in the server's registry, so `/metrics` shows it beside the layer's own request
metrics, and `snapshot()` / `value()` read the same numbers in-process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # "counter" or "gauge"
    help: str
    labels: tuple[str, ...] = ()


class Metrics:
    """Named counters/gauges with labels; ``inc``/``set`` are atomic under one lock."""

    def __init__(self, prefix: str, defs: tuple[MetricDef, ...]):
        self.prefix = prefix
        self._defs = {d.name: d for d in defs}
        self._values: dict[str, dict[tuple[str, ...], float]] = {d.name: {} for d in defs}
        self._lock = threading.Lock()
        for d in defs:
            if not d.labels:
                self._values[d.name][()] = 0.0

    def _key(self, name: str, labels: dict) -> tuple[str, ...]:
        d = self._defs[name]
        if len(labels) == len(d.labels):  # same size and every declared name present: the same set (no set built)
            try:
                return tuple(str(labels[k]) for k in d.labels)
            except KeyError:
                pass
        raise ValueError(f"metric {name!r} takes labels {d.labels}, got {sorted(labels)}")

    def inc(self, name: str, value: float = 1, **labels) -> None:
        key = self._key(name, labels)
        with self._lock:
            series = self._values[name]
            series[key] = series.get(key, 0.0) + value

    def set(self, name: str, value: float, **labels) -> None:
        key = self._key(name, labels)
        with self._lock:
            self._values[name][key] = float(value)

    def value(self, name: str, **labels) -> float:
        """One series' value (0 if it was never touched)."""
        key = self._key(name, labels)
        with self._lock:
            return self._values[name].get(key, 0.0)

    def total(self, name: str) -> float:
        """Sum over all label values of one metric."""
        with self._lock:
            return sum(self._values[name].values())

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{metric: {"label=value,...": value}}`` (unlabelled metrics use the key ``""``)."""
        with self._lock:
            return {
                name: {
                    ",".join(f"{k}={v}" for k, v in zip(self._defs[name].labels, key)): val for key, val in s.items()
                }
                for name, s in self._values.items()
            }

    def collect(self):  # prometheus_client collector protocol
        with self._lock:
            values = {name: dict(s) for name, s in self._values.items()}
        for name, d in self._defs.items():
            family = CounterMetricFamily if d.kind == "counter" else GaugeMetricFamily
            metric = family(f"{self.prefix}_{name}", d.help, labels=list(d.labels))
            for key, val in sorted(values[name].items()):
                metric.add_metric(list(key), val)
            yield metric
