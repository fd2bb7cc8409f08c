"""Per-step counts of a plan (rows requested per destination, touched per replica, their union across
replicas): estimated from the statistics (`step_counts`) or counted exactly from ids
(`measure_step_counts`, the reference the estimate and the scaling model are checked against).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxscale.engine import comm_model
from jaxscale.engine.cluster import ClusterSpec
from jaxscale.engine.embedding.row_owner import check_row_assignment, row_part
from jaxscale.engine.plan import ShardingPlan
from jaxscale.engine.planner.checks import cluster_topology
from jaxscale.engine.planner.costs import features_stats
from jaxscale.engine.planner.id_stats import FeatureStats, distinct_ids_per_part
from jaxscale.engine.tables import TableConfig, check_tables


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
    layout = cluster_topology(cluster, plan.topology)
    S, rep = layout.num_shards, layout.num_replicas
    plan.check(tables, cluster.nodes, cluster.devices_per_node)
    draws = {"requested": 1, "touched": S, "union": cluster.devices, "since_sync": cluster.devices * sync_every}
    acc: dict[int, dict[str, np.ndarray]] = {}
    for t in tables:
        ts = plan.tables[t.name]
        width = t.stored_dim // ts.col_parts
        a = acc.setdefault(width, {k: np.zeros(S) for k in (*draws, "rows", "pairs", "bags")})
        for s in features_stats(t, stats):
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
    check_row_assignment(row_assignment)
    layout = cluster_topology(cluster, plan.topology)
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
            part, _ = row_part(row, ts.row_parts, row_assignment, t.stored_rows)
            for c in range(ts.col_parts):
                _tally(a["pairs"], dev, shard_of_piece[part, c])
                for s in set(shard_of_piece[:, c].tolist()):
                    a["bags"][s] += x.shape[1]
        if not rows_steps:
            continue
        now = np.concatenate([x[0].reshape(D, -1) for x in rows_steps], axis=1)
        dev, row = _unique_pairs(np.repeat(np.arange(D), now.shape[1]), now.reshape(-1), t.stored_rows)
        part, local = row_part(row, ts.row_parts, row_assignment, t.stored_rows)
        for c in range(ts.col_parts):
            _tally(a["requested"], dev, shard_of_piece[part, c])
        rr, row_r = _unique_pairs(replica_of[dev], row, t.stored_rows)
        part_r, local_r = row_part(row_r, ts.row_parts, row_assignment, t.stored_rows)
        union = sorted_unique(row_r)
        history = [x[i].reshape(D, -1) for x in rows_steps for i in range(1, len(steps))]
        since = sorted_unique(np.concatenate([union] + [h[h >= 0] for h in history]))
        part_u, local_u = row_part(union, ts.row_parts, row_assignment, t.stored_rows)
        part_s, _ = row_part(since, ts.row_parts, row_assignment, t.stored_rows)
        for c in range(ts.col_parts):
            shard_r = shard_of_piece[part_r, c]
            _tally(a["touched"], rr, shard_r)
            _tally(a["owner_sent"], rr, shard_r, local_r % rep)
            _tally(a["owned"], shard_of_piece[part_u, c], local_u % rep)
            _tally(a["since_sync"], shard_of_piece[part_s, c])

    return [stack_counts(width, a, S, round_capacities) for width, a in sorted(acc.items())]


def stack_counts(
    width: int, tallies: Mapping[str, np.ndarray], shards: int, round_capacities: bool = True
) -> comm_model.StackCounts:
    """One stack's counts from its tallies ('rows' per shard; 'requested', 'touched', 'owner_sent', 'owned',
    'since_sync' and, optionally, 'pairs' and 'bags' per (source, shard[, owner])): each capacity is the max of
    its tally, rounded up on the capacity ladder; one shard has no all-to-all."""

    def cap(key: str) -> int:
        x = tallies.get(key)
        n = int(np.max(x)) if x is not None and np.size(x) else 0
        return comm_model.round_up_capacity(n) if round_capacities else n

    return comm_model.StackCounts(
        width=width,
        rows_per_shard=int(tallies["rows"].max()),
        requested=cap("requested") if shards > 1 else 0,
        touched=cap("touched"),
        owner_sent=cap("owner_sent"),
        owned=cap("owned"),
        touched_since_sync=cap("since_sync"),
        pair_slots=cap("pairs"),
        bags=cap("bags"),
    )


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
    keys = sorted_unique(group[keep].astype(np.int64) * rows + row[keep])
    return keys // rows, keys % rows


def sorted_unique(keys: np.ndarray) -> np.ndarray:
    """np.unique by sorting (numpy 2.4's default hash-based unique is far slower on large int64 arrays)."""
    keys = np.sort(keys)
    return keys[np.concatenate([[True], keys[1:] != keys[:-1]])] if keys.size else keys
