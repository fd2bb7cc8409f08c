"""Balanced sharding planner: a cost model over measured id statistics, pure Python + NumPy.

Why it exists: TorchRec's row-wise sharding cuts tables into contiguous row blocks, so the hot ids
of a skewed (Zipf) feature pile onto one shard, and table-wise placement by size ignores how often
a table is read. The jaxscale engine hashes rows by modulo (row r -> part r % row_parts) and
deduplicates ids per source device per batch, so a shard's work per step is the number of DISTINCT
ids of each source's batch slice that land on it. This planner estimates exactly that from a data
sample and places pieces so that the slowest device is as fast as possible.

Stages (each a small function, so each can be tested alone):
  1. `measure_feature_stats`  ids per example + id frequency distribution (hot ids, Zipf tail).
  2. `enumerate_options`      the sharding types each table may take (or its override).
  3. `estimate_option`        per-piece lookups, bytes sent per link class, memory and time.
  4. `plan_sharding`          choose types + greedy largest-first placement + local-search
                              moves/swaps that lower the slowest device; returns a `ShardingPlan`.
  5. `report`                 per-device load of any plan (also of naive baselines).

Topology recommendation (`recommend_topology`): the same id statistics give per-step counts (rows
requested per destination, rows touched per replica, their union across replicas), which
`jaxscale.comm_model` turns into the predicted communication time of 1d, 2d_ar and 2d_a2a on a
`ClusterSpec`, with exact and periodic replica sync.

Nothing here imports JAX: plans are made and tested on fake clusters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxscale import comm_model
from jaxscale.cluster import ClusterSpec
from jaxscale.mesh import TOPOLOGIES, Topology
from jaxscale.plan import SHARDING_TYPES, ShardingPlan, TableShards
from jaxscale.quantization import CommConfig, check_precision, wire_bytes
from jaxscale.tables import TableConfig, check_tables

ROW_ASSIGNMENTS = ("modulo", "contiguous")
# Preference order when several options are cheap enough: fewer pieces first. Column-wise comes last
# because every column piece looks up all of the table's distinct ids.
_PREFERENCE = ("table_wise", "table_row_wise", "row_wise", "column_wise")
_EXACT_TAIL_TERMS = 20_000  # Zipf ranks summed term by term before switching to an integral
_TAIL_GRID_POINTS = 4097


def _positive(owner: str, field: str, value, integer: bool = False, allow_zero: bool = False):
    kind = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    ok = isinstance(value, kind) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok or (not integer and not math.isfinite(float(value))):
        need = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{owner}.{field} must be a {need} {'integer' if integer else 'number'}, got {value!r}")


# --------------------------------------------------------------------------------------------------
# Inputs: topology, cost constants, feature statistics.


def _layout(cluster: ClusterSpec, topology: str) -> Topology:
    """What `topology` means on the cluster's mesh (shard count, peers): `jaxscale.mesh.Topology`."""
    if not isinstance(cluster, ClusterSpec):
        raise TypeError(f"expected a jaxscale.cluster.ClusterSpec, got {type(cluster).__name__}")
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    return cluster.topology(topology)


@dataclasses.dataclass(frozen=True)
class CostParams:
    """Constants that turn lookups and bytes into seconds (TorchRec planner defaults where it has them).

    Attributes:
      hbm_bandwidth: bytes/s of embedding-row reads (TorchRec HBM_MEM_BW, 897 GiB/s).
      comm_forward / comm_backward: wire precisions of the looked-up rows and of their gradients; bytes
        per row come from `jaxscale.quantization.wire_bytes` (fp8 includes its per-row scale).
      weight_bytes_per_element: bytes per stored weight (fp32).
      optimizer_bytes_per_row: row-wise AdaGrad state, one fp32 per row.
      index_bytes_per_lookup: bytes of id/offset read per lookup whatever the dim (TorchRec counts the
        int64 index read), so narrow column pieces are not free.
      backward_compute_multiplier: backward + optimizer work relative to the forward lookup (TorchRec: 2).
      piece_overhead_s: fixed cost of one piece per step (kernel bookkeeping, ragged offsets); the only
        term that makes splitting a table not free, so small tables stay whole.
      small_dim_penalties: (min piece dim, factor) from largest to smallest: TorchRec's compute
        penalties 1.15x for dims 64-127, 1.75x for 32-63 (kept at 1.75x below 32).
    """

    hbm_bandwidth: float = 897 * 1024**3
    comm_forward: str = "fp32"
    comm_backward: str = "fp32"
    weight_bytes_per_element: float = 4.0
    optimizer_bytes_per_row: float = 4.0
    index_bytes_per_lookup: float = 8.0
    backward_compute_multiplier: float = 2.0
    piece_overhead_s: float = 2e-6
    small_dim_penalties: tuple[tuple[int, float], ...] = ((128, 1.0), (64, 1.15), (32, 1.75), (0, 1.75))

    def __post_init__(self):
        for field in ("hbm_bandwidth", "weight_bytes_per_element"):
            _positive("CostParams", field, getattr(self, field))
        for field in ("comm_forward", "comm_backward"):
            check_precision(getattr(self, field), f"CostParams.{field}")
        for field in (
            "optimizer_bytes_per_row",
            "index_bytes_per_lookup",
            "backward_compute_multiplier",
            "piece_overhead_s",
        ):
            _positive("CostParams", field, getattr(self, field), allow_zero=True)
        penalties = tuple((int(d), float(f)) for d, f in self.small_dim_penalties)
        if not penalties or penalties[-1][0] != 0 or any(a[0] <= b[0] for a, b in zip(penalties, penalties[1:])):
            raise ValueError(
                f"CostParams.small_dim_penalties must list (min dim, factor) with strictly decreasing dims "
                f"ending at 0, got {self.small_dim_penalties!r}"
            )
        object.__setattr__(self, "small_dim_penalties", penalties)

    def dim_penalty(self, dim: int) -> float:
        return next(f for d, f in self.small_dim_penalties if dim >= d)

    def comm_bytes_per_row(self, dim: int) -> int:
        """Wire bytes of one row of width `dim` over both passes (forward row + backward gradient)."""
        return wire_bytes(1, dim, self.comm_forward) + wire_bytes(1, dim, self.comm_backward)


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
        _positive("FeatureStats", "num_rows", self.num_rows, integer=True)
        _positive("FeatureStats", "mean_ids_per_example", self.mean_ids_per_example, allow_zero=True)
        _positive("FeatureStats", "zipf_exponent", self.zipf_exponent, allow_zero=True)
        _positive("FeatureStats", "num_examples", self.num_examples, integer=True, allow_zero=True)
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
    if row_assignment not in ROW_ASSIGNMENTS:
        raise ValueError(f"row_assignment must be one of {ROW_ASSIGNMENTS}, got {row_assignment!r}")
    rows = stats.num_rows if stored_rows is None else stored_rows
    hot_ids = np.asarray(stats.hot_ids, dtype=np.int64)
    hot_freqs = np.asarray(stats.hot_freqs, dtype=np.float64)
    hot_distinct = -np.expm1(draws * np.log1p(-np.minimum(hot_freqs, 1 - 1e-15)))  # 1 - (1-q)^n
    tail = _tail_distinct(draws, stats.tail_mass, stats.zipf_exponent, len(hot_ids) + 1, stats.num_rows)
    parts = np.arange(row_parts)
    if row_assignment == "modulo":
        part_rows = (rows - parts + row_parts - 1) // row_parts
    else:
        block = -(-rows // row_parts)
        part_rows = np.clip(rows - parts * block, 0, block)
    if rows != stats.num_rows:  # hot ids hashed to unknown stored rows: spread them like the tail
        return (hot_distinct.sum() + tail) * part_rows / rows
    hot_part = hot_ids % row_parts if row_assignment == "modulo" else hot_ids // (-(-rows // row_parts))
    hot_per_part = np.bincount(hot_part, weights=hot_distinct, minlength=row_parts)
    tail_rows = part_rows - np.bincount(hot_part, minlength=row_parts)
    tail_rows_total = max(rows - len(hot_ids), 1)
    return hot_per_part + tail * tail_rows / tail_rows_total


# --------------------------------------------------------------------------------------------------
# Stages 2-3: options and their estimated cost.


@dataclasses.dataclass(frozen=True)
class ShardingOption:
    """One way to cut a table: `row_parts x col_parts` pieces of a TorchRec sharding type."""

    table: str
    sharding: str
    row_parts: int
    col_parts: int

    def __post_init__(self):
        if self.sharding not in SHARDING_TYPES:
            raise ValueError(f"ShardingOption.sharding must be one of {SHARDING_TYPES}, got {self.sharding!r}")
        _positive("ShardingOption", "row_parts", self.row_parts, integer=True)
        _positive("ShardingOption", "col_parts", self.col_parts, integer=True)

    @property
    def num_pieces(self) -> int:
        return self.row_parts * self.col_parts


@dataclasses.dataclass(frozen=True)
class PieceCosts:
    """Per-piece estimates of one option, indexed like `TableShards.shards` (p * col_parts + c).

    All per training step and per shard; lookups count distinct ids summed over the group's sources.
    """

    option: ShardingOption
    lookups: np.ndarray
    bytes_intra: np.ndarray
    bytes_inter: np.ndarray
    memory_bytes: np.ndarray
    compute_s: np.ndarray
    comm_s: np.ndarray

    @property
    def cost_s(self) -> np.ndarray:
        return self.compute_s + self.comm_s


def enumerate_options(
    tables: Sequence[TableConfig],
    cluster: ClusterSpec,
    overrides: Mapping[str, str] | None = None,
    min_column_dim: int = 128,
    topology: str = "1d",
) -> dict[str, tuple[ShardingOption, ...]]:
    """The options each table may take, in preference order (fewest pieces first).

    An override {table: sharding type} restricts the table to that type; it raises ValueError when
    the type cannot serve the table on this topology. Column-wise pieces narrower than
    `min_column_dim` (TorchRec's MIN_CW_DIM) are only offered when column_wise is forced.
    """
    tables = check_tables(tables)
    overrides = dict(overrides or {})
    unknown = set(overrides) - {t.name for t in tables}
    if unknown:
        raise ValueError(f"overrides name unknown tables {sorted(unknown)}")
    layout = _layout(cluster, topology)
    shards, local = layout.num_shards, cluster.devices_per_node
    options = {}
    for t in tables:
        rows, dim = t.stored_rows, t.stored_dim
        wanted = overrides.get(t.name)
        if wanted is not None and wanted not in SHARDING_TYPES:
            raise ValueError(f"override for table {t.name!r}: sharding must be one of {SHARDING_TYPES}, got {wanted!r}")
        opts = [ShardingOption(t.name, "table_wise", 1, 1)]
        if topology == "1d" and (cluster.nodes > 1 or wanted == "table_row_wise") and rows >= local > 1:
            opts.append(ShardingOption(t.name, "table_row_wise", local, 1))
        if shards > 1 and rows >= shards:
            opts.append(ShardingOption(t.name, "row_wise", shards, 1))
        column_counts = [c for c in range(2, min(shards, dim) + 1) if dim % c == 0 and (c & (c - 1)) == 0]
        wide = [c for c in column_counts if dim // c >= min_column_dim]  # narrower pieces waste lookups
        opts += [ShardingOption(t.name, "column_wise", 1, c) for c in (column_counts if wanted and not wide else wide)]
        if wanted is not None:
            opts = [o for o in opts if o.sharding == wanted]
            if not opts:
                raise ValueError(
                    f"override for table {t.name!r}: {wanted} cannot serve {rows} rows x {dim} dims on "
                    f"{shards} shards of topology {topology!r}"
                )
        options[t.name] = tuple(sorted(opts, key=lambda o: (_PREFERENCE.index(o.sharding), o.num_pieces)))
    return options


def _features_stats(table: TableConfig, stats: Mapping[str, FeatureStats]) -> list[FeatureStats]:
    missing = [f for f in table.features if f not in stats]
    if missing:
        raise ValueError(f"no FeatureStats for feature(s) {missing} of table {table.name!r}")
    return [stats[f] for f in table.features]


def estimate_option(
    table: TableConfig,
    option: ShardingOption,
    stats: Mapping[str, FeatureStats],
    cluster: ClusterSpec,
    batch_size_per_device: int,
    cost: CostParams = CostParams(),
    row_assignment: str = "modulo",
    topology: str = "1d",
) -> PieceCosts:
    """Per-piece lookups, bytes sent (intra/inter), memory and seconds of one option.

    A piece serves every source of its group: lookups = sources x distinct ids per source on its row
    part; it returns each remote source its distinct rows (forward) and receives their gradients
    (backward): distinct ids x wire bytes of a piece row in both precisions. The group's peers on and
    off the node come from `jaxscale.mesh.Topology.shard_peers`.
    """
    layout = _layout(cluster, topology)
    sources = layout.num_shards
    intra_peers, inter_peers = layout.shard_peers
    distinct = sum(
        distinct_ids_per_part(
            s, batch_size_per_device * s.mean_ids_per_example, option.row_parts, table.stored_rows, row_assignment
        )
        for s in _features_stats(table, stats)
    )
    piece_dim = table.stored_dim // option.col_parts
    per_piece = np.repeat(distinct, option.col_parts)  # every column piece of a row part sees its ids
    if row_assignment == "modulo":
        part_rows = np.array([len(range(p, table.stored_rows, option.row_parts)) for p in range(option.row_parts)])
    else:
        block = -(-table.stored_rows // option.row_parts)
        part_rows = np.clip(table.stored_rows - np.arange(option.row_parts) * block, 0, block)
    piece_rows = np.repeat(part_rows, option.col_parts).astype(np.float64)
    lookups = per_piece * sources
    sent_per_source = per_piece * cost.comm_bytes_per_row(piece_dim)
    read_bytes = lookups * (
        piece_dim * cost.weight_bytes_per_element * cost.dim_penalty(piece_dim) + cost.index_bytes_per_lookup
    )
    compute = read_bytes * (1 + cost.backward_compute_multiplier) / cost.hbm_bandwidth + cost.piece_overhead_s
    bytes_intra, bytes_inter = sent_per_source * intra_peers, sent_per_source * inter_peers
    return PieceCosts(
        option=option,
        lookups=lookups,
        bytes_intra=bytes_intra,
        bytes_inter=bytes_inter,
        memory_bytes=piece_rows * (piece_dim * cost.weight_bytes_per_element + cost.optimizer_bytes_per_row),
        compute_s=compute,
        comm_s=bytes_intra / cluster.intra_bandwidth_per_device + bytes_inter / cluster.inter_bandwidth_per_device,
    )


# --------------------------------------------------------------------------------------------------
# Stage 4: choose and place.


class _Placement:
    """Per-shard loads while placing: step time and distinct-id lookups, each normalised by its mean.

    A shard's load is max(cost / mean cost, lookups / mean lookups), so minimising the largest load
    balances time and lookup work together (dims differ, so balancing one alone leaves the other skewed).
    """

    def __init__(self, num_shards: int, memory_budget: float, cost_scale: float, lookup_scale: float):
        self.cost = np.zeros(num_shards)
        self.lookups = np.zeros(num_shards)
        self.memory = np.zeros(num_shards)
        self.budget = memory_budget
        self.cost_scale, self.lookup_scale = cost_scale, lookup_scale
        self.shards: dict[str, list[int]] = {}
        self.costs: dict[str, PieceCosts] = {}

    def load(self, extra_cost=0.0, extra_lookups=0.0) -> np.ndarray:
        return np.maximum(
            (self.cost + extra_cost) / self.cost_scale, (self.lookups + extra_lookups) / self.lookup_scale
        )

    def add(self, pc: PieceCosts, shards: Sequence[int]) -> None:
        shards = np.asarray(shards, dtype=np.int64)
        np.add.at(self.cost, shards, pc.cost_s)
        np.add.at(self.lookups, shards, pc.lookups)
        np.add.at(self.memory, shards, pc.memory_bytes)
        self.shards[pc.option.table] = shards.tolist()
        self.costs[pc.option.table] = pc

    def assign_distinct(self, pc: PieceCosts, candidates: Sequence[int]) -> list[int] | None:
        """Heaviest piece first, each onto the candidate whose load stays lowest, one piece per shard.

        None when some piece fits on no free candidate's memory.
        """
        candidates = np.asarray(candidates)
        cost, lookups = pc.cost_s, pc.lookups
        size = np.maximum(cost / self.cost_scale, lookups / self.lookup_scale)
        shards, free = [0] * pc.option.num_pieces, np.ones(len(candidates), dtype=bool)
        for i in sorted(range(len(cost)), key=lambda i: (-size[i], i)):
            ok = free & (self.memory[candidates] + pc.memory_bytes[i] <= self.budget)
            if not ok.any():
                return None
            after = np.where(ok, self.load(cost[i], lookups[i])[candidates], np.inf)
            j = int(np.argmin(after))  # ties -> lowest shard index: deterministic
            shards[i] = int(candidates[j])
            free[j] = False
        return shards

    def best_shards(self, pc: PieceCosts, cluster: ClusterSpec) -> list[int] | None:
        """Where this option's pieces go now, or None if they do not fit in memory."""
        if pc.option.sharding != "table_row_wise":
            return self.assign_distinct(pc, range(len(self.cost)))
        local, best, best_key = cluster.devices_per_node, None, None
        for node in range(cluster.nodes):
            shards = self.assign_distinct(pc, range(node * local, (node + 1) * local))
            if shards is None:
                continue
            trial = self.load()
            trial[shards] = np.maximum(
                (self.cost[shards] + pc.cost_s) / self.cost_scale,
                (self.lookups[shards] + pc.lookups) / self.lookup_scale,
            )
            key = (trial[shards].max(), trial[node * local : (node + 1) * local].sum(), node)
            if best_key is None or key < best_key:
                best, best_key = shards, key
        return best


def _local_search(placement: _Placement, max_steps: int) -> None:
    """Moves and swaps pieces off the most loaded shard while that lowers it below its current load.

    Table- and column-wise pieces move or swap freely (a table never holds two pieces on one shard);
    pieces of row-split tables only swap among themselves, which keeps row_wise on every shard and
    table_row_wise on one node. Each step lowers the sorted load vector, so it terminates.
    """
    names = list(placement.shards)
    table_idx, piece_idx, shard, cost, lookups, memory, movable = [], [], [], [], [], [], []
    for ti, name in enumerate(names):
        pc = placement.costs[name]
        single = pc.option.sharding in ("table_wise", "column_wise")
        for i, s in enumerate(placement.shards[name]):
            table_idx.append(ti), piece_idx.append(i), shard.append(s), movable.append(single)
            cost.append(pc.cost_s[i]), lookups.append(pc.lookups[i]), memory.append(pc.memory_bytes[i])
    table_idx, shard = np.array(table_idx), np.array(shard)
    cost, lookups, memory, movable = np.array(cost), np.array(lookups), np.array(memory), np.array(movable)
    cs, ls, budget = placement.cost_scale, placement.lookup_scale, placement.budget
    holds = np.zeros((len(names), len(placement.cost)), dtype=bool)  # holds[t, s]: table t has a piece on s
    holds[table_idx, shard] = True
    load_c, load_l, mem = placement.cost, placement.lookups, placement.memory

    def norm(c, l):
        return np.maximum(c / cs, l / ls)

    for _ in range(max_steps):
        load = norm(load_c, load_l)
        d = int(np.argmax(load))
        top = load[d]
        tol = 1e-9 * top
        best = None  # (new max load of the two shards, kind, piece a, target shard or piece b)
        for a in np.flatnonzero(shard == d):
            ta, ca, la, ma = table_idx[a], cost[a], lookups[a], memory[a]
            # Move a to shard e (vectorised over every e): a table never has two pieces on one shard
            # (~holds[ta]), e must have memory for a, and e != d. `after` is the larger of the two
            # changed loads (d without a, e with a), which must end below d's current load.
            if movable[a]:
                after = np.maximum(norm(load_c[d] - ca, load_l[d] - la), norm(load_c + ca, load_l + la))
                ok = ~holds[ta] & (mem + ma <= budget)
                ok[d] = False
                if ok.any():
                    after = np.where(ok, after, np.inf)
                    e = int(np.argmin(after))
                    if after[e] < top - tol and (best is None or after[e] < best[0]):
                        best = (after[e], "move", a, e)
            # Swap a with b, vectorised over every piece b (arrays indexed by b). After the swap d holds b
            # instead of a and shard[b] holds a instead of b, so d's load drops by (dc, dl) and shard[b]'s
            # rises by the same amount. Masks, in order:
            #   shard != d          b lives elsewhere (a swap within d changes nothing);
            #   same                b is another piece of a's own table: each shard still holds one piece
            #                       of it, and this is the only swap open to row-split pieces (so row_wise
            #                       stays on every shard and table_row_wise on its node);
            #   otherwise           both pieces are whole/column pieces (movable), a's table has no piece
            #                       on b's shard yet (~holds[ta][shard]) and b's table none on d
            #                       (~holds[table_idx, d]): still one piece per table per shard;
            #   memory              each shard fits after trading its piece for the other.
            dc, dl = ca - cost, la - lookups
            ok = shard != d
            same = table_idx == ta
            ok &= same | (movable[a] & movable & ~holds[ta][shard] & ~holds[table_idx, d])
            ok &= (mem[shard] - memory + ma <= budget) & (mem[d] - ma + memory <= budget)
            if ok.any():
                after = np.maximum(norm(load_c[d] - dc, load_l[d] - dl), norm(load_c[shard] + dc, load_l[shard] + dl))
                after = np.where(ok, after, np.inf)
                b = int(np.argmin(after))
                if after[b] < top - tol and (best is None or after[b] < best[0]):
                    best = (after[b], "swap", a, b)
        if best is None:
            break
        _, kind, a, x = best
        if kind == "move":
            e = x
            load_c[d] -= cost[a]
            load_c[e] += cost[a]
            load_l[d] -= lookups[a]
            load_l[e] += lookups[a]
            mem[d] -= memory[a]
            mem[e] += memory[a]
            holds[table_idx[a], d], holds[table_idx[a], e] = False, True
            shard[a] = e
        else:
            b, e = x, shard[x]
            for arr, vals in ((load_c, cost), (load_l, lookups), (mem, memory)):
                arr[d] += vals[b] - vals[a]
                arr[e] += vals[a] - vals[b]
            if table_idx[a] != table_idx[b]:
                holds[table_idx[a], d], holds[table_idx[a], e] = False, True
                holds[table_idx[b], e], holds[table_idx[b], d] = False, True
            shard[a], shard[b] = e, d
    for k in range(len(shard)):
        placement.shards[names[table_idx[k]]][piece_idx[k]] = int(shard[k])


def _place_all(
    chosen: Mapping[str, list[PieceCosts]],
    pinned: Mapping[str, tuple[PieceCosts, tuple[int, ...]]],
    cluster: ClusterSpec,
    local_search_steps: int,
    topology: str = "1d",
) -> _Placement:
    """Greedy largest-first placement (more split options when memory runs short), then local search."""
    first = [pcs[0] for pcs in chosen.values()] + [pc for pc, _ in pinned.values()]
    n = _layout(cluster, topology).num_shards
    cost_scale = max(sum(pc.cost_s.sum() for pc in first) / n, 1e-30)
    lookup_scale = max(sum(pc.lookups.sum() for pc in first) / n, 1e-30)
    placement = _Placement(n, cluster.device_memory_bytes, cost_scale, lookup_scale)
    for name, (pc, shards) in pinned.items():
        placement.add(pc, shards)
        over = np.flatnonzero(placement.memory > placement.budget)
        if over.size:
            raise ValueError(f"table {name!r}: pinned placement exceeds device memory on shards {over.tolist()}")

    def size(name):
        pc = chosen[name][0]
        return max(pc.cost_s.max() / cost_scale, pc.lookups.max() / lookup_scale)

    for name in sorted(chosen, key=lambda n: (-size(n), n)):
        for pc in chosen[name]:
            shards = placement.best_shards(pc, cluster)
            if shards is not None:
                placement.add(pc, shards)
                break
        else:
            need = min(pc.memory_bytes.max() for pc in chosen[name])
            raise ValueError(
                f"table {name!r} does not fit: its smallest piece needs {need / 1e9:.3f} GB but no shard has "
                f"that much of its {cluster.device_memory_bytes / 1e9:.3f} GB left"
            )
    _local_search(placement, local_search_steps)
    return placement


def _better(key, than, rel_tol: float = 1e-6) -> bool:
    """(unbalanced, max cost, pieces) order; costs within rel_tol tie, so fewer pieces win a near tie."""
    if key[0] != than[0]:
        return key[0] < than[0]
    if abs(key[1] - than[1]) > rel_tol * max(key[1], than[1]):
        return key[1] < than[1]
    return key[2] < than[2]


def plan_sharding(
    tables: Sequence[TableConfig],
    stats: Mapping[str, FeatureStats],
    cluster: ClusterSpec,
    batch_size_per_device: int,
    overrides: Mapping[str, str | TableShards] | None = None,
    cost: CostParams = CostParams(),
    balance_target: float = 1.05,
    local_search_steps: int = 5000,
    topology: str = "1d",
) -> ShardingPlan:
    """A plan that minimises the slowest shard's estimated step time within device memory.

    Sharding types are chosen by a split threshold: a table stays whole (or least split) while its
    heaviest piece costs at most `threshold x` the ideal per-shard load, else it is split further.
    Each threshold's plan is placed greedily and refined by local search (which balances time and
    lookups together); the winner is the fastest plan (lowest max step time, then fewest pieces)
    among those whose max/mean lookups are within `balance_target`, or the fastest of all if none is.

    Args:
      tables: the tables to place.
      stats: {feature: FeatureStats} for every feature of every table.
      cluster: nodes, devices, device memory and link figures.
      batch_size_per_device: examples per device per step.
      overrides: {table: sharding type} to restrict a table's type, or {table: TableShards} to pin it.
      cost: constants of the cost model.
      balance_target: max/mean distinct-id lookups per shard a plan should stay within.
      local_search_steps: cap on moves/swaps after the greedy placement.
      topology: the jaxscale topology ('1d', '2d_ar', '2d_a2a'): the plan is for its shard group.
    """
    tables = check_tables(tables)
    layout = _layout(cluster, topology)
    _positive("plan_sharding", "batch_size_per_device", batch_size_per_device, integer=True)
    if not balance_target >= 1:
        raise ValueError(f"plan_sharding.balance_target must be >= 1, got {balance_target!r}")
    overrides = dict(overrides or {})
    pinned_specs = {n: ts for n, ts in overrides.items() if isinstance(ts, TableShards)}
    by_name = {t.name: t for t in tables}
    options = enumerate_options(
        tables, cluster, {n: v for n, v in overrides.items() if n not in pinned_specs}, topology=topology
    )
    pinned = {}
    for name, ts in pinned_specs.items():
        if any(s >= layout.num_shards for s in ts.shards):
            raise ValueError(f"override for table {name!r}: shards {ts.shards} outside [0, {layout.num_shards})")
        option = ShardingOption(name, ts.sharding, ts.row_parts, ts.col_parts)
        pinned[name] = (
            estimate_option(by_name[name], option, stats, cluster, batch_size_per_device, cost, topology=topology),
            ts.shards,
        )
    costs = {
        t.name: [
            estimate_option(t, o, stats, cluster, batch_size_per_device, cost, topology=topology)
            for o in options[t.name]
        ]
        for t in tables
        if t.name not in pinned
    }
    budget = cluster.device_memory_bytes
    fitting = {n: [pc for pc in pcs if pc.memory_bytes.max() <= budget] for n, pcs in costs.items()}
    for n, pcs in fitting.items():
        if not pcs:
            need = min(pc.memory_bytes.max() for pc in costs[n])
            raise ValueError(
                f"table {n!r} does not fit: its smallest piece needs {need / 1e9:.3f} GB, more than the "
                f"{budget / 1e9:.3f} GB device memory"
            )
    total = sum(pcs[0].cost_s.sum() for pcs in fitting.values()) + sum(pc.cost_s.sum() for pc, _ in pinned.values())
    ideal = total / layout.num_shards
    best, best_key, seen, error = None, None, set(), None
    for threshold in (math.inf, 1.0, 0.5, 0.25, 0.125, 1 / 16, 1 / 32, 1 / 64, 0.0):
        chosen = {}
        for n, pcs in fitting.items():
            cheap = [i for i, pc in enumerate(pcs) if pc.cost_s.max() <= threshold * ideal]
            first = cheap[0] if cheap else int(np.argmin([pc.cost_s.max() for pc in pcs]))
            rest = sorted((i for i in range(len(pcs)) if i != first), key=lambda i: (pcs[i].memory_bytes.max(), i))
            chosen[n] = [pcs[first]] + [pcs[i] for i in rest]
        signature = tuple(chosen[n][0].option for n in sorted(chosen))
        if signature in seen:
            continue
        seen.add(signature)
        try:
            placement = _place_all(chosen, pinned, cluster, local_search_steps, topology)
        except ValueError as e:
            error = error or e
            continue
        pieces = sum(len(s) for s in placement.shards.values())
        key = (_ratio(placement.lookups) > balance_target, placement.cost.max(), pieces)
        if best_key is None or _better(key, best_key):
            best, best_key = placement, key
    if best is None:  # every threshold ran out of memory: the first error names the table
        raise error
    specs = {}
    for t in tables:
        o = best.costs[t.name].option
        specs[t.name] = TableShards(o.sharding, o.row_parts, o.col_parts, tuple(best.shards[t.name]))
    return ShardingPlan(topology, layout.num_shards, specs)


# --------------------------------------------------------------------------------------------------
# Stage 5: report.


def _ratio(values: np.ndarray) -> float:
    mean = float(np.mean(values))
    return float(np.max(values)) / mean if mean > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """Estimated per-shard load of a plan (each shard is one device per replica)."""

    topology: str
    num_shards: int
    batch_size_per_device: int
    row_assignment: str
    memory_budget_bytes: float
    lookups: tuple[float, ...]
    bytes_intra: tuple[float, ...]
    bytes_inter: tuple[float, ...]
    memory_bytes: tuple[float, ...]
    compute_s: tuple[float, ...]
    comm_s: tuple[float, ...]
    sharding_counts: Mapping[str, int]

    @property
    def cost_s(self) -> tuple[float, ...]:
        return tuple(a + b for a, b in zip(self.compute_s, self.comm_s))

    @property
    def lookup_imbalance(self) -> float:
        """max / mean distinct-id lookups per shard."""
        return _ratio(np.array(self.lookups))

    @property
    def bytes_imbalance(self) -> float:
        return _ratio(np.array(self.bytes_intra) + np.array(self.bytes_inter))

    @property
    def cost_imbalance(self) -> float:
        """max / mean estimated step time per shard: the planner's objective."""
        return _ratio(np.array(self.cost_s))

    @property
    def memory_imbalance(self) -> float:
        return _ratio(np.array(self.memory_bytes))

    @property
    def max_cost_s(self) -> float:
        return max(self.cost_s)

    @property
    def over_memory(self) -> tuple[int, ...]:
        """Shards whose pieces exceed the device memory budget (possible for naive baselines)."""
        return tuple(i for i, m in enumerate(self.memory_bytes) if m > self.memory_budget_bytes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {
            "sharding_counts": dict(self.sharding_counts),
            "cost_s": list(self.cost_s),
            "max_cost_s": self.max_cost_s,
            "lookup_imbalance": self.lookup_imbalance,
            "bytes_imbalance": self.bytes_imbalance,
            "cost_imbalance": self.cost_imbalance,
            "memory_imbalance": self.memory_imbalance,
            "over_memory": list(self.over_memory),
        }

    def to_text(self) -> str:
        head = (
            f"{'shard':>5} {'lookups':>12} {'intra MB':>10} {'inter MB':>10} {'memory GB':>10} "
            f"{'compute ms':>11} {'comm ms':>9} {'cost ms':>9}"
        )
        lines = [
            f"topology {self.topology}: {self.num_shards} shards, batch {self.batch_size_per_device}/device, "
            f"{self.row_assignment} rows, types {dict(self.sharding_counts)}",
            head,
        ]
        for i in range(self.num_shards):
            flag = " !mem" if i in self.over_memory else ""
            lines.append(
                f"{i:>5} {self.lookups[i]:>12.0f} {self.bytes_intra[i] / 1e6:>10.3f} "
                f"{self.bytes_inter[i] / 1e6:>10.3f} "
                f"{self.memory_bytes[i] / 1e9:>10.3f} {self.compute_s[i] * 1e3:>11.4f} {self.comm_s[i] * 1e3:>9.4f} "
                f"{self.cost_s[i] * 1e3:>9.4f}{flag}"
            )
        lines.append(
            f"max/mean: lookups {self.lookup_imbalance:.3f}, bytes {self.bytes_imbalance:.3f}, cost "
            f"{self.cost_imbalance:.3f}, memory {self.memory_imbalance:.3f}; "
            f"slowest shard {self.max_cost_s * 1e3:.4f} ms"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()


def report(
    plan: ShardingPlan,
    tables: Sequence[TableConfig],
    stats: Mapping[str, FeatureStats],
    cluster: ClusterSpec,
    batch_size_per_device: int,
    cost: CostParams = CostParams(),
    row_assignment: str = "modulo",
) -> PlanReport:
    """Per-shard lookups, bytes sent, memory and time of any plan under the planner's cost model.

    The plan carries its topology. row_assignment='contiguous' scores the same pieces as TorchRec's
    contiguous row blocks would hold them, for baselines; the engine itself is 'modulo'.
    """
    tables = check_tables(tables)
    layout = _layout(cluster, plan.topology)
    if plan.num_shards != layout.num_shards:
        raise ValueError(
            f"plan is for {plan.num_shards} shards of {plan.topology!r}, but {plan.topology!r} on a "
            f"{cluster.nodes}x{cluster.devices_per_node} cluster has {layout.num_shards}"
        )
    plan.check(tables, cluster.nodes, cluster.devices_per_node)
    n = layout.num_shards
    acc = {k: np.zeros(n) for k in ("lookups", "bytes_intra", "bytes_inter", "memory_bytes", "compute_s", "comm_s")}
    counts: dict[str, int] = {}
    for t in tables:
        ts = plan.tables[t.name]
        counts[ts.sharding] = counts.get(ts.sharding, 0) + 1
        pc = estimate_option(
            t,
            ShardingOption(t.name, ts.sharding, ts.row_parts, ts.col_parts),
            stats,
            cluster,
            batch_size_per_device,
            cost,
            row_assignment,
            topology=plan.topology,
        )
        shards = np.array(ts.shards)
        for k, arr in acc.items():
            np.add.at(arr, shards, getattr(pc, k))
    return PlanReport(
        topology=plan.topology,
        num_shards=n,
        batch_size_per_device=batch_size_per_device,
        row_assignment=row_assignment,
        memory_budget_bytes=float(cluster.device_memory_bytes),
        sharding_counts=dict(sorted(counts.items())),
        **{k: tuple(float(x) for x in v) for k, v in acc.items()},
    )


# --------------------------------------------------------------------------------------------------
# Topology recommendation: per-step counts from the id statistics -> comm_model times.


def step_counts(
    tables: Sequence[TableConfig],
    stats: Mapping[str, FeatureStats],
    cluster: ClusterSpec,
    plan: ShardingPlan,
    batch_size_per_device: int,
    sync_every: int = 1,
) -> list[comm_model.StackCounts]:
    """Expected per-step counts of each embedding stack of `plan` (see `comm_model.StackCounts`).

    From the same distinct-id estimate as the cost model (`distinct_ids_per_part`), for draws of one
    device (rows it requests from each shard), of one replica's shard group (rows a replica's shard
    touches), of every device (their union across replicas) and of every device over `sync_every`
    steps (rows touched since the last periodic sync). Owner-replica counts split a shard's rows evenly
    over the replicas. Capacities are rounded up on the engine's ladder. Expected values: the maximum
    over devices of a random count is a little larger (the Monte Carlo of experiments/scaling measures
    it). Pooled features with several ids per bag are counted as (row, bag) pairs and per-bag sums.
    """
    tables = check_tables(tables)
    layout = _layout(cluster, plan.topology)
    S, rep = layout.num_shards, layout.num_replicas
    plan.check(tables, cluster.nodes, cluster.devices_per_node)
    draws = {"requested": 1, "touched": S, "union": cluster.devices, "since_sync": cluster.devices * sync_every}
    acc: dict[int, dict[str, np.ndarray]] = {}
    for t in tables:
        ts = plan.tables[t.name]
        width = t.stored_dim // ts.col_parts
        a = acc.setdefault(width, {k: np.zeros(S) for k in (*draws, "rows", "pairs", "bags")})
        for s in _features_stats(t, stats):
            per_source = batch_size_per_device * s.mean_ids_per_example
            distinct = {
                k: distinct_ids_per_part(s, per_source * m, ts.row_parts, t.stored_rows) for k, m in draws.items()
            }
            partial = t.pooling is not None and s.mean_ids_per_example > 1 and S > 1
            for c in range(ts.col_parts):
                if partial:  # one partial sum per bag on each shard holding a piece of this column block
                    for shard in {ts.shard_of(p, c) for p in range(ts.row_parts)}:
                        a["bags"][shard] += batch_size_per_device
                for p in range(ts.row_parts):
                    shard = ts.shard_of(p, c)
                    if partial:  # (row, bag) requests: every id of a bag, not de-duplicated across bags
                        a["pairs"][shard] += per_source / ts.row_parts
                        continue
                    for k in draws:
                        a[k][shard] += distinct[k][p]
        for p in range(ts.row_parts):
            for c in range(ts.col_parts):
                a["rows"][ts.shard_of(p, c)] += ts.piece_rows(t.stored_rows, p)

    def cap(x) -> int:
        return comm_model.round_up_capacity(math.ceil(float(np.max(x)) - 1e-9))

    return [
        comm_model.StackCounts(
            width=width,
            rows_per_shard=int(a["rows"].max()),
            requested=cap(a["requested"]),
            touched=cap(a["touched"]),
            owner_sent=cap(a["touched"] / rep),
            owned=cap(a["union"] / rep),
            touched_since_sync=cap(a["since_sync"]),
            pair_slots=cap(a["pairs"]),
            bags=cap(a["bags"]),
        )
        for width, a in sorted(acc.items())
    ]


def measure_step_counts(
    ids: Mapping[str, np.ndarray],
    tables: Sequence[TableConfig],
    plan: ShardingPlan,
    cluster: ClusterSpec,
    *,
    previous: Sequence[Mapping[str, np.ndarray]] = (),
    row_assignment: str = "modulo",
    round_capacities: bool = True,
) -> list[comm_model.StackCounts]:
    """Exact per-step counts of each embedding stack for one batch (see `comm_model.StackCounts`).

    Args:
      ids: {feature: int array [devices, B, L] or [devices, n]}: each device's stored-row ids (after any
        hashing / half_dim mapping), devices in flat mesh order, -1 = padding.
      tables, plan, cluster: the layout (the plan carries the topology).
      previous: the ids of the steps since the last periodic sync (for `touched_since_sync`).
      row_assignment: 'modulo' (the engine) or 'contiguous' (TorchRec's row blocks, for baselines).
      round_capacities: round capacities up on the engine's ladder (`comm_model.round_up_capacity`).

    Counts: requested = max over (device, owner shard) of the device's unique rows on that shard;
    touched = max over (replica, shard) of unique rows requested from that shard by the replica's
    devices; owner_sent = the same split by owner replica (a row's owner is its local index on the
    shard mod the replica count); owned = max over (shard, owner) of the union over replicas;
    touched_since_sync = max over shards of that union over this and the previous steps. Pooled
    features with several ids per bag return per-bag partial sums (`pooled_comm='auto'`): their
    (bag, row) pairs per destination and the bags each owner sums are counted instead.
    """
    tables = check_tables(tables)
    if row_assignment not in ROW_ASSIGNMENTS:
        raise ValueError(f"row_assignment must be one of {ROW_ASSIGNMENTS}, got {row_assignment!r}")
    layout = _layout(cluster, plan.topology)
    plan.check(tables, cluster.nodes, cluster.devices_per_node)
    S, rep, D = layout.num_shards, layout.num_replicas, cluster.devices
    replica_of = np.empty(D, np.int64)
    for r, group in enumerate(layout.shard_groups()):
        replica_of[list(group)] = r
    steps = [ids, *previous]
    acc: dict[int, dict[str, np.ndarray]] = {}
    for t in tables:
        ts = plan.tables[t.name]
        width = t.stored_dim // ts.col_parts
        a = acc.setdefault(width, _empty_counts(D, S, rep))
        for p in range(ts.row_parts):
            for c in range(ts.col_parts):
                a["rows"][ts.shard_of(p, c)] += ts.piece_rows(t.stored_rows, p)
        feats = [f for f in t.features if f in ids]
        if not feats:
            continue
        shard_of_piece = np.asarray(ts.shards, np.int64).reshape(ts.row_parts, ts.col_parts)
        rows_steps, partial = [], []
        for f in feats:
            x = [_device_ids(step, f, t, D) for step in steps]
            if t.pooling is not None and S > 1 and x[0].shape[2] > 1:
                partial.append(x[0])
            else:
                rows_steps.append(x)
        for x in partial:  # (bag, row) pairs, not de-duplicated across bags; one partial sum per bag
            dev, row = np.nonzero(x >= 0)[0], x[x >= 0]
            part, _ = _row_part(row, t.stored_rows, ts.row_parts, row_assignment)
            for c in range(ts.col_parts):
                _tally(a["pairs"], dev, shard_of_piece[part, c])
                for s in set(shard_of_piece[:, c].tolist()):
                    a["bags"][s] += x.shape[1]
        if not rows_steps:
            continue
        now = np.concatenate([x[0].reshape(D, -1) for x in rows_steps], axis=1)
        dev, row = _unique_pairs(np.repeat(np.arange(D), now.shape[1]), now.reshape(-1), t.stored_rows)
        part, local = _row_part(row, t.stored_rows, ts.row_parts, row_assignment)
        for c in range(ts.col_parts):
            _tally(a["requested"], dev, shard_of_piece[part, c])
        rr, row_r = _unique_pairs(replica_of[dev], row, t.stored_rows)
        part_r, local_r = _row_part(row_r, t.stored_rows, ts.row_parts, row_assignment)
        union = _sorted_unique(row_r)
        history = [x[i].reshape(D, -1) for x in rows_steps for i in range(1, len(steps))]
        since = _sorted_unique(np.concatenate([union] + [h[h >= 0] for h in history]))
        part_u, local_u = _row_part(union, t.stored_rows, ts.row_parts, row_assignment)
        part_s, _ = _row_part(since, t.stored_rows, ts.row_parts, row_assignment)
        for c in range(ts.col_parts):
            shard_r = shard_of_piece[part_r, c]
            _tally(a["touched"], rr, shard_r)
            _tally(a["owner_sent"], rr, shard_r, local_r % rep)
            _tally(a["owned"], shard_of_piece[part_u, c], local_u % rep)
            _tally(a["since_sync"], shard_of_piece[part_s, c])

    def cap(x) -> int:
        n = int(np.max(x)) if np.size(x) else 0
        return comm_model.round_up_capacity(n) if round_capacities else n

    return [
        comm_model.StackCounts(
            width=width,
            rows_per_shard=int(a["rows"].max()),
            requested=cap(a["requested"]) if S > 1 else 0,
            touched=cap(a["touched"]),
            owner_sent=cap(a["owner_sent"]),
            owned=cap(a["owned"]),
            touched_since_sync=cap(a["since_sync"]),
            pair_slots=cap(a["pairs"]),
            bags=cap(a["bags"]),
        )
        for width, a in sorted(acc.items())
    ]


def _empty_counts(devices: int, shards: int, replicas: int) -> dict[str, np.ndarray]:
    return {
        "rows": np.zeros(shards, np.int64),
        "requested": np.zeros((devices, shards), np.int64),
        "touched": np.zeros((replicas, shards), np.int64),
        "owner_sent": np.zeros((replicas, shards, replicas), np.int64),
        "owned": np.zeros((shards, replicas), np.int64),
        "since_sync": np.zeros(shards, np.int64),
        "pairs": np.zeros((devices, shards), np.int64),
        "bags": np.zeros(shards, np.int64),
    }


def _tally(counts: np.ndarray, *index: np.ndarray) -> None:
    """counts[index] += 1 for every (repeated) index tuple; a bincount (np.add.at is slow on large inputs)."""
    flat = np.ravel_multi_index(tuple(np.asarray(i, np.int64) for i in index), counts.shape)
    counts += np.bincount(flat, minlength=counts.size).reshape(counts.shape)


def _device_ids(step: Mapping[str, np.ndarray], feature: str, table: TableConfig, devices: int) -> np.ndarray:
    """The feature's ids as [devices, bags, ids per bag], checked against the table's stored rows."""
    if feature not in step:
        raise ValueError(f"ids of feature {feature!r} missing from a step")
    x = np.asarray(step[feature])
    if not np.issubdtype(x.dtype, np.integer) or x.ndim not in (2, 3) or x.shape[0] != devices:
        raise ValueError(
            f"ids of feature {feature!r} must be an int array [devices={devices}, B, L] or [devices, n], "
            f"got {x.dtype} {x.shape}"
        )
    bad = (x < -1) | (x >= table.stored_rows)
    if bad.any():
        raise ValueError(
            f"ids of feature {feature!r} hold {int(x[bad][0])}, outside [-1, {table.stored_rows}) of table "
            f"{table.name!r}"
        )
    return x if x.ndim == 3 else x[:, :, None]


def _unique_pairs(group: np.ndarray, row: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Unique (group, row) pairs of the valid (row >= 0) entries, as two arrays."""
    keep = row >= 0
    keys = _sorted_unique(group[keep].astype(np.int64) * rows + row[keep])
    return keys // rows, keys % rows


def _sorted_unique(keys: np.ndarray) -> np.ndarray:
    """np.unique by sorting (numpy 2.4's default hash-based unique is far slower on large int64 arrays)."""
    keys = np.sort(keys)
    return keys[np.concatenate([[True], keys[1:] != keys[:-1]])] if keys.size else keys


def _row_part(row: np.ndarray, rows: int, parts: int, row_assignment: str) -> tuple[np.ndarray, np.ndarray]:
    """(row part, local index within the part) of stored rows under the row assignment."""
    if row_assignment == "modulo":
        return row % parts, row // parts
    block = -(-rows // parts)
    return row // block, row % block


@dataclasses.dataclass(frozen=True)
class TopologyCandidate:
    """One (topology, replica sync) option with its predicted communication per step.

    embedding_s: the embedding collectives alone, one after the other; comm_s: communication on the
    critical path of a step with `compute_s` of compute and the dense all-reduce (0 params: none)
    sharing the links; step_s: compute + comm; intra_bytes / inter_bytes: embedding bytes one device
    sends per step; feasible / note: whether the tables fit the topology's shards, and why not.
    """

    topology: str
    sync: comm_model.ReplicaSync | None
    embedding_s: float
    comm_s: float
    step_s: float
    intra_bytes: float
    inter_bytes: float
    exact: bool
    feasible: bool = True
    note: str = ""

    @property
    def label(self) -> str:
        return self.topology if self.sync is None else f"{self.topology} ({self.sync.label})"


@dataclasses.dataclass(frozen=True)
class TopologyChoice:
    """What `recommend_topology` chose and why: every candidate with its predicted times."""

    topology: str
    sync: comm_model.ReplicaSync | None
    reason: str
    candidates: tuple[TopologyCandidate, ...]
    cluster: ClusterSpec

    @property
    def chosen(self) -> TopologyCandidate:
        return next(c for c in self.candidates if c.topology == self.topology and c.sync == self.sync)

    def report(self) -> str:
        c = self.cluster
        lines = [
            f"cluster {c.nodes}x{c.devices_per_node}: intra {c.intra_node_bandwidth / 1e9:.0f} GB/s/device, inter "
            f"{c.inter_node_bandwidth * 8 / 1e9:.0f} Gbit/s/node, latency {c.intra_node_latency * 1e6:.0f}/"
            f"{c.inter_node_latency * 1e6:.0f} us, efficiency {c.efficiency:.2f}",
            f"{'candidate':<34} {'embedding ms':>12} {'comm ms':>9} {'step ms':>9} {'intra MB':>9} {'inter MB':>9}",
        ]
        for x in self.candidates:
            mark = "*" if x.topology == self.topology and x.sync == self.sync else " "
            if not x.feasible:
                lines.append(f"{mark}{x.label:<33} infeasible: {x.note}")
                continue
            lines.append(
                f"{mark}{x.label:<33} {x.embedding_s * 1e3:>12.3f} {x.comm_s * 1e3:>9.3f} {x.step_s * 1e3:>9.3f} "
                f"{x.intra_bytes / 1e6:>9.3f} {x.inter_bytes / 1e6:>9.3f}" + (f"  ({x.note})" if x.note else "")
            )
        lines.append(f"recommended: {self.chosen.label}: {self.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()

    def to_dict(self) -> dict:
        def sync(s):
            return None if s is None else dataclasses.asdict(s)

        return {
            "topology": self.topology,
            "sync": sync(self.sync),
            "reason": self.reason,
            "cluster": self.cluster.to_dict(),
            "candidates": [dataclasses.asdict(x) | {"sync": sync(x.sync), "label": x.label} for x in self.candidates],
        }


def recommend_topology(
    tables: Sequence[TableConfig],
    stats: Mapping[str, FeatureStats],
    cluster: ClusterSpec,
    batch_size_per_device: int,
    comm: CommConfig | None = None,
    *,
    periodic_every: Sequence[int] = (),
    allow_periodic: bool = False,
    dense_params: int = 0,
    dense_precision: str = "fp32",
    compute_s: float = 0.0,
    cost: CostParams = CostParams(),
) -> TopologyChoice:
    """Predicts the communication per step of 1d, 2d_ar and 2d_a2a and recommends the fastest.

    Each topology gets its own plan (`plan_sharding` for its shard group); its per-step counts
    (`step_counts`) go through `jaxscale.comm_model`. 2D topologies are scored with both exact sync
    strategies ('owner' and 'gather': which is cheaper depends on how much the replicas' ids overlap)
    and, for each k in `periodic_every`, with periodic averaging (dense and sparse). Periodic sync
    changes training (replicas drift between syncs), so it is recommended only with
    `allow_periodic=True`; otherwise it is reported for comparison. The criterion is the
    communication on the critical path (`comm_s`): with `dense_params` > 0 and `compute_s` > 0 the
    dense gradient all-reduce overlaps the backward pass and shares the links, as in a real step.

    The trainer's `embedding.topology=auto` calls this with the mesh's ClusterSpec, statistics of a
    data sample (`measure_feature_stats`) and the run's per-device batch and comm precisions, then
    builds the collection with `choice.topology` and `choice.sync`.
    """
    tables = check_tables(tables)
    _positive("recommend_topology", "batch_size_per_device", batch_size_per_device, integer=True)
    comm = CommConfig() if comm is None else comm
    if not isinstance(comm, CommConfig):
        raise TypeError(f"recommend_topology: comm must be a jaxscale.quantization.CommConfig, got {type(comm)}")
    for k in periodic_every:
        _positive("recommend_topology", "periodic_every", k, integer=True)
    check_precision(dense_precision, "recommend_topology.dense_precision")
    _positive("recommend_topology", "compute_s", compute_s, allow_zero=True)
    dense = [comm_model.dense_allreduce(dense_params, cluster, dense_precision)] if dense_params else []
    plan_cost = dataclasses.replace(cost, comm_forward=comm.forward, comm_backward=comm.backward)
    candidates = []
    for topology in TOPOLOGIES:
        layout = cluster.topology(topology)
        try:
            plan = plan_sharding(tables, stats, cluster, batch_size_per_device, cost=plan_cost, topology=topology)
        except ValueError as e:
            candidates.append(
                TopologyCandidate(topology, None, math.inf, math.inf, math.inf, 0, 0, True, False, str(e))
            )
            continue
        syncs: list[comm_model.ReplicaSync | None] = [None]
        if layout.num_replicas > 1:
            syncs = [comm_model.ReplicaSync("exact", s) for s in ("owner", "gather")]
            syncs += [comm_model.ReplicaSync("periodic", s, k) for k in periodic_every for s in ("dense", "sparse")]
        for sync in syncs:
            every = sync.every if sync is not None else 1
            counts = step_counts(tables, stats, cluster, plan, batch_size_per_device, every)
            comms = comm_model.embedding_comms(
                counts, layout, comm.forward, comm.backward, sync or comm_model.ReplicaSync()
            )
            alone = sum(comm_model.seconds(c.traffic, cluster) for c in comms)
            step = comm_model.step_time(comms + dense, cluster, compute_s)
            nbytes = comm_model.category_bytes(comms)
            candidates.append(
                TopologyCandidate(
                    topology,
                    sync,
                    alone,
                    step.comm,
                    step.total,
                    sum(v[0] for v in nbytes.values()),
                    sum(v[1] for v in nbytes.values()),
                    exact=sync is None or sync.mode == "exact",
                )
            )
    eligible = [c for c in candidates if c.feasible and (c.exact or allow_periodic)]
    if not eligible:
        notes = "; ".join(f"{c.topology}: {c.note}" for c in candidates if not c.feasible)
        raise ValueError(f"recommend_topology: no topology can hold the tables ({notes})")
    best = min(eligible, key=lambda c: (c.comm_s, c.embedding_s, TOPOLOGIES.index(c.topology)))
    return TopologyChoice(
        best.topology, best.sync, _reason(best, candidates, allow_periodic), tuple(candidates), cluster
    )


def _reason(best: TopologyCandidate, candidates: Sequence[TopologyCandidate], allow_periodic: bool) -> str:
    """Why `best` won: the runner-up of each other topology and the margin, in words."""
    others = {}
    for c in candidates:
        if c.feasible and c.topology != best.topology and (c.exact or allow_periodic):
            if c.topology not in others or c.comm_s < others[c.topology].comm_s:
                others[c.topology] = c
    parts = [
        f"{best.comm_s * 1e3:.3f} ms of communication per step on the critical path "
        f"({best.inter_bytes / 1e6:.3f} MB/device across nodes, {best.intra_bytes / 1e6:.3f} MB inside a node)"
    ]
    for c in sorted(others.values(), key=lambda c: c.comm_s):
        ratio = c.comm_s / best.comm_s if best.comm_s > 0 else math.inf
        parts.append(f"{c.label} {c.comm_s * 1e3:.3f} ms ({ratio:.2f}x)")
    infeasible = [c.topology for c in candidates if not c.feasible]
    if infeasible:
        parts.append(f"{', '.join(infeasible)} cannot hold the tables")
    periodic = [c for c in candidates if c.feasible and not c.exact]
    if periodic and not allow_periodic:
        fastest = min(periodic, key=lambda c: c.comm_s)
        parts.append(
            f"periodic sync not considered (it changes training; fastest: {fastest.label} "
            f"{fastest.comm_s * 1e3:.3f} ms): pass allow_periodic=True to allow it"
        )
    return "; ".join(parts)
