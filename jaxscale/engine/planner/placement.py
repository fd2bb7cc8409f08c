"""Stage 4: choose an option per table and place the pieces (greedy largest-first, then local-search
moves and swaps that lower the slowest device): `plan_sharding` returns a `ShardingPlan`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxscale.engine.cluster import ClusterSpec
from jaxscale.engine.plan import ShardingPlan, TableShards
from jaxscale.engine.planner.checks import check_positive, cluster_topology, max_over_mean
from jaxscale.engine.planner.costs import (
    DEFAULT_COST,
    CostParams,
    PieceCosts,
    ShardingOption,
    enumerate_options,
    estimate_option,
)
from jaxscale.engine.planner.id_stats import FeatureStats
from jaxscale.engine.tables import TableConfig, check_tables


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
    n = cluster_topology(cluster, topology).num_shards
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
    cost: CostParams = DEFAULT_COST,
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
    layout = cluster_topology(cluster, topology)
    check_positive("plan_sharding", "batch_size_per_device", batch_size_per_device, integer=True)
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
        key = (max_over_mean(placement.lookups) > balance_target, placement.cost.max(), pieces)
        if best_key is None or _better(key, best_key):
            best, best_key = placement, key
    if best is None:  # every threshold ran out of memory: the first error names the table
        raise error
    specs = {}
    for t in tables:
        o = best.costs[t.name].option
        specs[t.name] = TableShards(o.sharding, o.row_parts, o.col_parts, tuple(best.shards[t.name]))
    return ShardingPlan(topology, layout.num_shards, specs)
