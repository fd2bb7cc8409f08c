"""Topology recommendation: each topology's own balanced plan, its per-step counts and
`jaxscale.engine.comm_model` times, with exact and periodic replica sync; the fastest is chosen, and the plan it
was scored with is kept (`TopologyChoice.plan`), so the run executes what was predicted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from jaxscale.engine import comm_model
from jaxscale.engine.cluster import ClusterSpec
from jaxscale.engine.embedding.settings import ReplicaSync
from jaxscale.engine.mesh import TOPOLOGIES
from jaxscale.engine.plan import ShardingPlan
from jaxscale.engine.planner.checks import check_positive
from jaxscale.engine.planner.costs import DEFAULT_COST, CostParams
from jaxscale.engine.planner.id_stats import FeatureStats
from jaxscale.engine.planner.placement import plan_sharding
from jaxscale.engine.planner.step_counts import step_counts
from jaxscale.engine.quantization import CommConfig, check_precision
from jaxscale.engine.tables import TableConfig, check_tables


@dataclasses.dataclass(frozen=True)
class TopologyCandidate:
    """One (topology, replica sync) option with its predicted communication per step.

    embedding_s: the embedding collectives alone, one after the other; comm_s: communication on the
    critical path of a step with `compute_s` of compute and the dense all-reduce (0 params: none)
    sharing the links; step_s: compute + comm; intra_bytes / inter_bytes: embedding bytes one device
    sends per step; feasible / note: whether the tables fit the topology's shards, and why not.
    """

    topology: str
    sync: ReplicaSync | None
    embedding_s: float
    comm_s: float
    step_s: float
    intra_bytes: float
    inter_bytes: float
    exact: bool
    feasible: bool = True
    note: str = ""
    plan: ShardingPlan | None = dataclasses.field(default=None, repr=False, compare=False)
    """The plan this candidate was scored with (None when infeasible)."""

    @property
    def label(self) -> str:
        return self.topology if self.sync is None else f"{self.topology} ({self.sync.label})"


@dataclasses.dataclass(frozen=True)
class TopologyChoice:
    """What `recommend_topology` chose and why: every candidate with its predicted times."""

    topology: str
    sync: ReplicaSync | None
    reason: str
    candidates: tuple[TopologyCandidate, ...]
    cluster: ClusterSpec

    @property
    def chosen(self) -> TopologyCandidate:
        return next(c for c in self.candidates if c.topology == self.topology and c.sync == self.sync)

    @property
    def plan(self) -> ShardingPlan:
        """The sharding plan the chosen topology was scored with: the one a run must execute."""
        return self.chosen.plan

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
            "candidates": [
                {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.name not in ("sync", "plan")}
                | {"sync": sync(x.sync), "label": x.label}
                for x in self.candidates
            ],
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
    cost: CostParams = DEFAULT_COST,
) -> TopologyChoice:
    """Predicts the communication per step of 1d, 2d_ar and 2d_a2a and recommends the fastest.

    Each topology gets its own plan (`plan_sharding` for its shard group); its per-step counts
    (`step_counts`) go through `jaxscale.engine.comm_model`. 2D topologies are scored with both exact sync
    strategies ('owner' and 'gather': which is cheaper depends on how much the replicas' ids overlap)
    and, for each k in `periodic_every`, with periodic averaging (dense and sparse). Periodic sync
    changes training (replicas drift between syncs), so it is recommended only with
    `allow_periodic=True`; otherwise it is reported for comparison. The criterion is the
    communication on the critical path (`comm_s`): with `dense_params` > 0 and `compute_s` > 0 the
    dense gradient all-reduce overlaps the backward pass and shares the links, as in a real step.

    `jaxscale.engine.planner.resolve` calls this for `embedding.topology: auto` with the mesh's ClusterSpec,
    statistics of a data sample (`measure_feature_stats`) and the run's per-device batch and comm
    precisions; the run then executes `choice.plan` with `choice.topology` and `choice.sync`.
    """
    tables = check_tables(tables)
    check_positive("recommend_topology", "batch_size_per_device", batch_size_per_device, integer=True)
    comm = CommConfig() if comm is None else comm
    if not isinstance(comm, CommConfig):
        raise TypeError(f"recommend_topology: comm must be a jaxscale.engine.quantization.CommConfig, got {type(comm)}")
    for k in periodic_every:
        check_positive("recommend_topology", "periodic_every", k, integer=True)
    check_precision(dense_precision, "recommend_topology.dense_precision")
    check_positive("recommend_topology", "compute_s", compute_s, allow_zero=True)
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
        syncs: list[ReplicaSync | None] = [None]
        if layout.num_replicas > 1:
            syncs = [ReplicaSync("exact", s) for s in ("owner", "gather")]
            syncs += [ReplicaSync("periodic", s, k) for k in periodic_every for s in ("dense", "sparse")]
        for sync in syncs:
            every = sync.every if sync is not None else 1
            counts = step_counts(tables, stats, cluster, plan, batch_size_per_device, every)
            comms = comm_model.embedding_comms(counts, layout, comm.forward, comm.backward, sync)
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
                    exact=sync is None or sync.exact,
                    plan=plan,
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
