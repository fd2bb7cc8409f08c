"""Stages 2-3: the sharding options each table may take and their estimated cost (lookups, bytes per link
class, memory, time) under `CostParams`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jaxscale.engine.cluster import ClusterSpec
from jaxscale.engine.embedding.row_owner import part_rows
from jaxscale.engine.mesh import AXES, shard_axes
from jaxscale.engine.plan import SHARDING_TYPES
from jaxscale.engine.planner.checks import check_positive, cluster_topology
from jaxscale.engine.planner.id_stats import FeatureStats, distinct_ids_per_part
from jaxscale.engine.quantization import check_precision, wire_bytes
from jaxscale.engine.tables import TableConfig, check_tables

# Preference order when several options are cheap enough: fewer pieces first. Column-wise comes last
# because every column piece looks up all of the table's distinct ids.
_PREFERENCE = ("table_wise", "table_row_wise", "row_wise", "column_wise")


@dataclasses.dataclass(frozen=True)
class CostParams:
    """Constants that turn lookups and bytes into seconds (TorchRec planner defaults where it has them).

    Attributes:
      hbm_bandwidth: bytes/s of embedding-row reads (TorchRec HBM_MEM_BW, 897 GiB/s).
      comm_forward / comm_backward: wire precisions of the looked-up rows and of their gradients; bytes
        per row come from `jaxscale.engine.quantization.wire_bytes` (fp8 includes its per-row scale).
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
            check_positive("CostParams", field, getattr(self, field))
        for field in ("comm_forward", "comm_backward"):
            check_precision(getattr(self, field), f"CostParams.{field}")
        for field in (
            "optimizer_bytes_per_row",
            "index_bytes_per_lookup",
            "backward_compute_multiplier",
            "piece_overhead_s",
        ):
            check_positive("CostParams", field, getattr(self, field), allow_zero=True)
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


DEFAULT_COST = CostParams()
"""The cost constants every stage uses unless given others."""


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
        check_positive("ShardingOption", "row_parts", self.row_parts, integer=True)
        check_positive("ShardingOption", "col_parts", self.col_parts, integer=True)

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
    layout = cluster_topology(cluster, topology)
    shards, local = layout.num_shards, cluster.devices_per_node
    options = {}
    for t in tables:
        rows, dim = t.stored_rows, t.stored_dim
        wanted = overrides.get(t.name)
        if wanted is not None and wanted not in SHARDING_TYPES:
            raise ValueError(f"override for table {t.name!r}: sharding must be one of {SHARDING_TYPES}, got {wanted!r}")
        opts = [ShardingOption(t.name, "table_wise", 1, 1)]
        spans_both_axes = shard_axes(topology) == AXES  # table_row_wise: rows inside a node, tables across nodes
        if spans_both_axes and (cluster.nodes > 1 or wanted == "table_row_wise") and rows >= local > 1:
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


def features_stats(table: TableConfig, stats: Mapping[str, FeatureStats]) -> list[FeatureStats]:
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
    off the node come from `jaxscale.engine.mesh.Topology.shard_peers`.
    """
    layout = cluster_topology(cluster, topology)
    sources = layout.num_shards
    intra_peers, inter_peers = layout.shard_peers
    distinct = sum(
        distinct_ids_per_part(
            s, batch_size_per_device * s.mean_ids_per_example, option.row_parts, table.stored_rows, row_assignment
        )
        for s in features_stats(table, stats)
    )
    piece_dim = table.stored_dim // option.col_parts
    per_piece = np.repeat(distinct, option.col_parts)  # every column piece of a row part sees its ids
    held = part_rows(table.stored_rows, option.row_parts, row_assignment)
    piece_rows = np.repeat(held, option.col_parts).astype(np.float64)
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
