"""Numbers the benchmarks draw and report: Zipf ids, timing spread, and per-round ratios between engines.

Sessions alternate in rounds (`sessions.alternate`), so session r of one engine ran next to session r of
the other: the ratio of their medians within a round is free of the drift between rounds, and the worst
round's ratio says how far a pooled median can be trusted.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np


def zipf_ids(rng: np.random.Generator, rows: int, shape, a: float) -> np.ndarray:
    """Zipf(a) ranks scattered over the table by a multiplicative hash (hot rows are not adjacent)."""
    rank = rng.zipf(a, size=shape).astype(np.int64) - 1
    return ((rank * 2654435761) % rows).astype(np.int32)


def median_ms(seconds: Sequence[float]) -> float:
    return 1e3 * statistics.median(seconds) if len(seconds) else float("nan")


def spread(seconds: Sequence[float]) -> dict:
    """Median, p10, p90, min and max in ms, and the count."""
    ts = sorted(seconds)
    if not ts:
        return {"n": 0}
    pick = lambda q: 1e3 * ts[min(len(ts) - 1, int(q * len(ts)))]  # noqa: E731
    return {
        "median_ms": median_ms(ts),
        "p10_ms": pick(0.1),
        "p90_ms": pick(0.9),
        "min_ms": 1e3 * ts[0],
        "max_ms": 1e3 * ts[-1],
        "n": len(ts),
    }


def round_ratios(numerator_ms: Sequence[float], denominator_ms: Sequence[float]) -> list[float]:
    """Per round r: numerator's session median / denominator's (both engines ran round r side by side)."""
    if len(numerator_ms) != len(denominator_ms):
        raise ValueError(f"rounds differ: {len(numerator_ms)} sessions against {len(denominator_ms)}")
    return [a / b for a, b in zip(numerator_ms, denominator_ms)]
