"""Stage 5: the per-device load of any plan (the planner's, or a naive baseline's)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jaxscale.engine.cluster import ClusterSpec
from jaxscale.engine.plan import ShardingPlan
from jaxscale.engine.planner.checks import cluster_topology, max_over_mean
from jaxscale.engine.planner.costs import DEFAULT_COST, CostParams, ShardingOption, estimate_option
from jaxscale.engine.planner.id_stats import FeatureStats
from jaxscale.engine.tables import TableConfig, check_tables


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
        return max_over_mean(np.array(self.lookups))

    @property
    def bytes_imbalance(self) -> float:
        return max_over_mean(np.array(self.bytes_intra) + np.array(self.bytes_inter))

    @property
    def cost_imbalance(self) -> float:
        """max / mean estimated step time per shard: the planner's objective."""
        return max_over_mean(np.array(self.cost_s))

    @property
    def memory_imbalance(self) -> float:
        return max_over_mean(np.array(self.memory_bytes))

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
    cost: CostParams = DEFAULT_COST,
    row_assignment: str = "modulo",
) -> PlanReport:
    """Per-shard lookups, bytes sent, memory and time of any plan under the planner's cost model.

    The plan carries its topology. row_assignment='contiguous' scores the same pieces as TorchRec's
    contiguous row blocks would hold them, for baselines; the engine itself is 'modulo'.
    """
    tables = check_tables(tables)
    layout = cluster_topology(cluster, plan.topology)
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
