"""Stage 1: id statistics of a data sample (ids per example, hot ids, the Zipf tail), and the distinct
ids a piece of a table sees per step, estimated from them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxscale.engine.embedding.row_owner import check_row_assignment, part_rows, row_part
from jaxscale.engine.planner.checks import check_positive
from jaxscale.engine.tables import TableConfig, check_tables

_EXACT_TAIL_TERMS = 20_000  # Zipf ranks summed term by term before switching to an integral


_TAIL_GRID_POINTS = 4097


@dataclasses.dataclass(frozen=True)
class FeatureStats:
    """Id statistics of one feature: enough to estimate the distinct ids per batch on each row part.

    The id distribution is modelled as the measured hot ids (known ids, so we know which part each
    lands on) plus a tail of the remaining mass over the other rows, shaped like Zipf(exponent) by
    rank and spread evenly over row positions (the tail's ids are unknown individually).

    Attributes:
      num_rows: rows of the table the ids index (ids are in [0, num_rows)).
      mean_ids_per_example: mean non-padding ids per example.
      hot_ids: the most frequent ids, hottest first.
      hot_freqs: fraction of all lookups that hit each hot id.
      zipf_exponent: s in freq ~ rank^-s, fitted on the measured ranks; shapes the tail.
      num_examples: examples in the measured sample (0: analytic stats).
    """

    num_rows: int
    mean_ids_per_example: float
    hot_ids: tuple[int, ...] = ()
    hot_freqs: tuple[float, ...] = ()
    zipf_exponent: float = 0.0
    num_examples: int = 0

    def __post_init__(self):
        check_positive("FeatureStats", "num_rows", self.num_rows, integer=True)
        check_positive("FeatureStats", "mean_ids_per_example", self.mean_ids_per_example, allow_zero=True)
        check_positive("FeatureStats", "zipf_exponent", self.zipf_exponent, allow_zero=True)
        check_positive("FeatureStats", "num_examples", self.num_examples, integer=True, allow_zero=True)
        hot_ids = tuple(int(i) for i in self.hot_ids)
        hot_freqs = tuple(float(f) for f in self.hot_freqs)
        if len(hot_ids) != len(hot_freqs):
            raise ValueError(f"FeatureStats.hot_ids has {len(hot_ids)} entries but hot_freqs has {len(hot_freqs)}")
        if len(set(hot_ids)) != len(hot_ids) or any(not 0 <= i < self.num_rows for i in hot_ids):
            raise ValueError(f"FeatureStats.hot_ids must be distinct ids in [0, {self.num_rows})")
        if any(f < 0 for f in hot_freqs) or sum(hot_freqs) > 1 + 1e-6:
            raise ValueError(f"FeatureStats.hot_freqs must be non-negative and sum to <= 1, sum is {sum(hot_freqs)}")
        object.__setattr__(self, "hot_ids", hot_ids)
        object.__setattr__(self, "hot_freqs", hot_freqs)

    @classmethod
    def zipf(cls, num_rows: int, mean_ids_per_example: float, exponent: float, top_k: int = 1024) -> FeatureStats:
        """Analytic stats of Zipf(exponent) ids where id i has rank i + 1 (id 0 hottest).

        Hot ids being the low ids is the worst case for contiguous row ranges, as with raw catalogue ids.
        """
        k = min(top_k, num_rows)
        weights = np.arange(1, k + 1, dtype=np.float64) ** -exponent
        total = weights.sum() + _zipf_weight_sum(k + 1, num_rows, exponent)
        return cls(num_rows, float(mean_ids_per_example), tuple(range(k)), tuple(weights / total), float(exponent))

    @property
    def tail_mass(self) -> float:
        return max(0.0, 1.0 - sum(self.hot_freqs))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"hot_ids": list(self.hot_ids), "hot_freqs": list(self.hot_freqs)}


def _zipf_weight_sum(first_rank: int, last_rank: int, exponent: float) -> float:
    """sum_{r=first}^{last} r^-s, exact for the first terms, an integral after (rows go to 1e8+)."""
    if last_rank < first_rank:
        return 0.0
    split = min(last_rank, first_rank + _EXACT_TAIL_TERMS - 1)
    total = float((np.arange(first_rank, split + 1, dtype=np.float64) ** -exponent).sum())
    if split < last_rank:
        a, b = split + 0.5, last_rank + 0.5
        total += math.log(b / a) if exponent == 1 else (b ** (1 - exponent) - a ** (1 - exponent)) / (1 - exponent)
    return total


def _tail_distinct(draws: float, tail_mass: float, exponent: float, first_rank: int, last_rank: int) -> float:
    """Expected distinct tail ids among `draws` lookups: sum over ranks of 1 - exp(-draws * p_r)."""
    if tail_mass <= 0 or draws <= 0 or last_rank < first_rank:
        return 0.0
    scale = draws * tail_mass / _zipf_weight_sum(first_rank, last_rank, exponent)
    split = min(last_rank, first_rank + _EXACT_TAIL_TERMS - 1)
    ranks = np.arange(first_rank, split + 1, dtype=np.float64)
    total = float(-np.expm1(-scale * ranks**-exponent).sum())
    if split < last_rank:
        x = np.geomspace(split + 0.5, last_rank + 0.5, _TAIL_GRID_POINTS)
        y = -np.expm1(-scale * x**-exponent)
        total += float(((y[1:] + y[:-1]) * np.diff(x)).sum() / 2)
    return total


def measure_feature_stats(
    samples: Mapping[str, np.ndarray], tables: Sequence[TableConfig], top_k: int = 1024, min_fit_count: int = 3
) -> dict[str, FeatureStats]:
    """Measures ids per example and the id frequency distribution of each sampled feature.

    Args:
      samples: {feature: int array [N, L]}, -1 is padding; ids index the table's stored rows (a
        half_dim table's ids are in [0, 2 x rows)), as the engine receives them.
      tables: the tables; each sampled feature must be read by one of them.
      top_k: hot ids kept individually (their row part is then known exactly).
      min_fit_count: ranks seen fewer times than this are too noisy for the Zipf fit.
    """
    tables = check_tables(tables)
    table_of = {f: t for t in tables for f in t.features}
    stats = {}
    for feature, ids in samples.items():
        if feature not in table_of:
            raise ValueError(f"sample feature {feature!r} is not read by any table")
        table = table_of[feature]
        ids = np.asarray(ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"sample of feature {feature!r} must be an int array [N, L], got {ids.dtype} {ids.shape}")
        if ids.shape[0] == 0:
            raise ValueError(f"sample of feature {feature!r} has no examples")
        valid = ids[ids >= 0]
        if valid.size and valid.max() >= table.stored_rows:  # half_dim tables: ids index the stored rows
            raise ValueError(
                f"sample of feature {feature!r} has id {valid.max()} >= table {table.name!r} rows {table.stored_rows}"
            )
        uniq, counts = _counts_by_value(valid)
        order = np.lexsort((uniq, -counts))  # most frequent first, ties by id: deterministic
        uniq, counts = uniq[order], counts[order]
        total = max(int(counts.sum()), 1)
        stats[feature] = FeatureStats(
            num_rows=table.stored_rows,
            mean_ids_per_example=valid.size / ids.shape[0],
            hot_ids=tuple(uniq[:top_k].tolist()),
            hot_freqs=tuple((counts[:top_k] / total).tolist()),
            zipf_exponent=_fit_zipf_exponent(counts, min_fit_count),
            num_examples=int(ids.shape[0]),
        )
    return stats


def _counts_by_value(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values, occurrences), like np.unique(return_counts=True) but by sorting (numpy 2.4's
    hash-based unique is far slower on millions of ids)."""
    values = np.sort(values)
    if values.size == 0:
        return values, np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
    return values[starts], np.diff(np.append(starts, values.size))


def _fit_zipf_exponent(sorted_counts: np.ndarray, min_count: int) -> float:
    """Least-squares slope of log(count) against log(rank) over the ranks seen >= min_count times."""
    reliable = sorted_counts[sorted_counts >= min_count]
    if reliable.size < 3:
        return 0.0  # no evidence of skew: the tail is treated as uniform
    log_rank = np.log(np.arange(1, reliable.size + 1, dtype=np.float64))
    slope = np.polyfit(log_rank, np.log(reliable.astype(np.float64)), 1)[0]
    return float(np.clip(-slope, 0.0, 5.0))


def distinct_ids_per_part(
    stats: FeatureStats,
    draws: float,
    row_parts: int,
    stored_rows: int | None = None,
    row_assignment: str = "modulo",
) -> np.ndarray:
    """Expected distinct ids of one source's batch slice (`draws` lookups) that land on each row part.

    row_assignment 'modulo' is the engine (row r -> part r % row_parts); 'contiguous' is TorchRec's
    ceil(rows / parts) blocks, kept to score baselines. If the table stores more rows than ids
    (reshape='half_dim'), the hot ids' stored rows are unknown and are spread evenly.
    """
    check_row_assignment(row_assignment)
    rows = stats.num_rows if stored_rows is None else stored_rows
    hot_ids = np.asarray(stats.hot_ids, dtype=np.int64)
    hot_freqs = np.asarray(stats.hot_freqs, dtype=np.float64)
    hot_distinct = -np.expm1(draws * np.log1p(-np.minimum(hot_freqs, 1 - 1e-15)))  # 1 - (1-q)^n
    tail = _tail_distinct(draws, stats.tail_mass, stats.zipf_exponent, len(hot_ids) + 1, stats.num_rows)
    held = part_rows(rows, row_parts, row_assignment)
    if rows != stats.num_rows:  # hot ids hashed to unknown stored rows: spread them like the tail
        return (hot_distinct.sum() + tail) * held / rows
    hot_part, _ = row_part(hot_ids, row_parts, row_assignment, rows)
    hot_per_part = np.bincount(hot_part, weights=hot_distinct, minlength=row_parts)
    tail_rows = held - np.bincount(hot_part, minlength=row_parts)
    tail_rows_total = max(rows - len(hot_ids), 1)
    return hot_per_part + tail * tail_rows / tail_rows_total
