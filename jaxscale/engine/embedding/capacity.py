"""How big the static send buffers are: the worst case, a fixed factor, or counted from the batch's ids.

XLA needs static shapes, so every exchange has a capacity: slots per destination. Three sources:

* worst case (no ids known, `capacity_factor=None`): every request of a device could go to one owner.
  Never overflows, but pads every destination to that bound.
* a fixed factor (`capacity_factor=f`): f times a destination's uniform share. Smaller messages; a batch
  that does not fit is counted as overflow (the trainer refuses or grows).
* counted (the default for host ids): the host counts, for this batch, the unique rows each device asks
  of each owner (and the rows each replica touches, for the replica sync) with the same request builders
  the device runs (`routing.row_requests`, `routing.pair_requests`), then rounds each count UP on the one
  capacity ladder (`jaxscale.engine.comm_model.round_up_capacity`: x1.25 steps, shared with the planner and the
  scaling model) so a run compiles a handful of executables. The counts are exact, so a counted
  batch can never overflow. They travel as static metadata of the batch pytree (`ids.ShardedIds`), and
  `jit` selects the executable compiled for them; in multi-process runs the processes exchange their
  counts (and touched-row keys, for the sync) so every process picks the same executable.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from jaxscale.engine.comm_model import CAPACITY_LADDER, round_up_capacity
from jaxscale.engine.embedding import routing
from jaxscale.engine.embedding.layout import Layout
from jaxscale.engine.mesh import Topology

SYNC_STRATEGIES = ("gather", "owner")


@dataclasses.dataclass(frozen=True)
class StackCapacity:
    """Static buffer sizes of one stack's exchanges (0 where the stack has no such traffic).

    rows: slots per destination of the row exchange (ids out, rows back, gradients out).
    pairs: slots per destination of the (row, bag) exchange of partial-sum features.
    sync: exact replica sync; strategy 'gather': unique rows one shard of one replica touched (all of them
      are all-gathered); 'owner': unique rows one shard of one replica sends to one owner replica.
    owned: strategy 'owner' only: rows of the union over replicas that one owner replica sums and
      broadcasts, per shard.
    sync_strategy: 'gather' or 'owner' (see `jaxscale.engine.embedding.sync`).
    """

    rows: int = 0
    pairs: int = 0
    sync: int = 0
    owned: int = 0
    sync_strategy: str = "gather"

    def covers(self, other: StackCapacity) -> bool:
        """True when every buffer is at least as large as `other`'s (same sync strategy)."""
        return self.sync_strategy == other.sync_strategy and all(
            getattr(self, f) >= getattr(other, f) for f in ("rows", "pairs", "sync", "owned")
        )

    def slots(self) -> int:
        return self.rows + self.pairs + self.sync + self.owned


@dataclasses.dataclass(frozen=True)
class Capacities:
    """Per-stack capacities of one batch (hashable: it is jit's static metadata)."""

    stacks: tuple[tuple[str, StackCapacity], ...]
    counted: bool  # True: counted from the batch's ids (exact; nothing can overflow)

    def __getitem__(self, key: str) -> StackCapacity:
        return dict(self.stacks)[key]

    def covers(self, other: Capacities) -> bool:
        mine = dict(self.stacks)
        return all(k in mine and mine[k].covers(c) for k, c in other.stacks)

    def slots(self) -> int:
        return sum(c.slots() for _, c in self.stacks)


class CapacityCache:
    """The capacities a collection has compiled for, reused when a batch fits one of them.

    Each new set of counted capacities is another executable (seconds of compile time on CPU). A batch
    therefore runs the smallest already-used set that covers its exact needs. The first batch gets exactly
    its own (ladder-rounded) needs; a later batch that fits no set shows the needs vary, so the new set
    covers everything seen so far with one more ladder step of headroom (x1.25, capped by the worst case):
    a run converges to one or two executables. Every process sees the same sequence of counts, so they all
    choose alike.
    """

    def __init__(self):
        self.seen: list[Capacities] = []

    def choose(self, need: Capacities, worst: Capacities | None = None) -> Capacities:
        fitting = [c for c in self.seen if c.covers(need)]
        if fitting:
            return min(fitting, key=Capacities.slots)
        if self.seen:
            need = self._grown(need, worst)
        self.seen.append(need)
        return need

    def _grown(self, need: Capacities, worst: Capacities | None) -> Capacities:
        stacks = []
        for key, cap in need.stacks:
            grown = {}
            for field in ("rows", "pairs", "sync", "owned"):
                seen = [
                    getattr(dict(c.stacks)[key], field)
                    for c in self.seen
                    if key in dict(c.stacks) and dict(c.stacks)[key].sync_strategy == cap.sync_strategy
                ]
                value = max([getattr(cap, field), *seen])
                if value:
                    value = round_up_capacity(math.ceil(value * CAPACITY_LADDER))
                    if worst is not None and key in dict(worst.stacks):
                        bound = getattr(worst[key], field) or value
                        value = min(value, max(bound, getattr(cap, field)))
                grown[field] = value
            stacks.append((key, dataclasses.replace(cap, **grown)))
        return Capacities(tuple(stacks), counted=need.counted)


def pair_features(layout: Layout, feature_table, feats: Sequence[str], lengths: Mapping[str, int], pooled_comm: str):
    """Pooled features whose output comes back as per-bag partial sums (see `pooled_comm`)."""
    if layout.num_shards == 1 or pooled_comm == "rows":
        return frozenset()
    out = set()
    for f in feats:
        t = layout.tables[feature_table[f]]
        if t.pooling is not None and (pooled_comm == "partial_sums" or lengths[f] > 1):
            out.add(f)
    return frozenset(out)


# ------------------------------------------------------------------------------------------ static


def static_rows(layout: Layout, feature_table, key, feats, shapes, capacity_factor) -> int:
    """Slots per destination of the row exchange without looking at ids: the worst case, or
    capacity_factor x the uniform share of a row-wise piece."""
    st = layout.stacks[key]
    S = layout.num_shards
    need = np.zeros(S, np.int64)
    for f in feats:
        t_idx = feature_table[f]
        route = layout.routes[t_idx]
        if route.stack != key:
            continue
        n = int(np.prod(shapes[f]))
        for c in range(route.col_parts):
            for s in range(S):
                parts = [p for p in range(route.row_parts) if route.shard[p, c] == s]
                if not parts:
                    continue
                held = sum(len(range(p, layout.tables[t_idx].stored_rows, route.row_parts)) for p in parts)
                bound = n
                if capacity_factor is not None and route.row_parts > 1:
                    bound = math.ceil(capacity_factor * n * len(parts) / route.row_parts)
                need[s] += min(bound, held, n)
    return int(max(1, min(need.max(), st.rows * S)))


def static_pairs(layout: Layout, feature_table, key, feats, shapes, capacity_factor) -> int:
    """(row, bag) slots per destination without looking at ids (worst case, or the factor's share)."""
    S = layout.num_shards
    need = np.zeros(S, np.int64)
    for f in feats:
        route = layout.routes[feature_table[f]]
        if route.stack != key:
            continue
        n = int(np.prod(shapes[f]))
        for c in range(route.col_parts):
            for s in range(S):
                parts = sum(1 for p in range(route.row_parts) if route.shard[p, c] == s)
                if parts:
                    bound = n
                    if capacity_factor is not None and route.row_parts > 1:
                        bound = min(n, math.ceil(capacity_factor * n * parts / route.row_parts))
                    need[s] += bound
    return int(max(1, need.max()))


def static_capacities(
    layout: Layout,
    feature_table,
    topology: Topology,
    shapes: Mapping[str, tuple[int, int]],
    pooled_comm: str,
    capacity_factor: float | None,
    sync: bool,
) -> Capacities:
    """Capacities for per-device id shapes `shapes` ({feature: (b, L)}) when the ids are not known."""
    feats = tuple(sorted(shapes))
    partial = pair_features(layout, feature_table, feats, {f: s[1] for f, s in shapes.items()}, pooled_comm)
    row_feats = [f for f in feats if f not in partial]
    out = []
    for key, st in layout.stacks.items():
        reads = [f for f in feats if layout.routes[feature_table[f]].stack == key]
        if not reads:
            continue
        rows = static_rows(layout, feature_table, key, row_feats, shapes, capacity_factor) if row_feats else 0
        pairs = static_pairs(layout, feature_table, key, sorted(partial), shapes, capacity_factor) if partial else 0
        if not any(layout.routes[feature_table[f]].stack == key for f in row_feats):
            rows = 0
        if not any(layout.routes[feature_table[f]].stack == key for f in partial):
            pairs = 0
        received = layout.num_shards * (rows + pairs)  # slots that can reach one owner
        touched = min(st.rows, received) if sync else 0
        # owned: only a bound here (the owner strategy is chosen from counted ids, never statically)
        out.append((key, StackCapacity(rows, pairs, touched, touched, "gather")))
    return Capacities(tuple(out), counted=False)


# ------------------------------------------------------------------------------------------ counted


def _device_of_requests(segments, shapes, devices_per_batch: int, first_device: int, xp=np):
    """Flat mesh position of every request of a request list (requests follow their segments)."""
    parts = []
    for seg in segments:
        b, L = shapes[seg.feature]
        per = b // devices_per_batch
        parts.append(first_device + np.repeat(np.arange(b) // per, L))
    return np.concatenate(parts)


def _pair_count_max(layout: Layout, feature_table, key: str, feats, ids, devices: int) -> int:
    """The most valid (row, bag) pairs one device sends one owner for stack `key` (0: no feature reads it);
    what `pair_requests` + `_max_count` give, without building the pairs."""
    S = layout.num_shards
    counts, reads = np.zeros((devices, S + 1), np.int64), False
    for f in feats:
        t_idx = feature_table[f]
        route = layout.routes[t_idx]
        if route.stack != key:
            continue
        reads, x = True, ids[f]
        b = x.shape[0]
        valid = (x >= 0) & (x < layout.tables[t_idx].stored_rows)
        part = np.where(valid, x, 0) % route.row_parts if route.row_parts > 1 else np.zeros(x.shape, np.int64)
        dev = (np.arange(b) // (b // devices))[:, None] * (S + 1)
        for c in range(route.col_parts):
            dest = np.where(valid, route.shard[:, c][part], S)
            counts += np.bincount((dev + dest).ravel(), minlength=devices * (S + 1)).reshape(devices, S + 1)
    return max(1, int(counts[:, :S].max())) if reads else 0


def _max_count(keys: np.ndarray) -> int:
    return int(np.bincount(keys).max()) if keys.size else 0


@dataclasses.dataclass(frozen=True)
class LocalCounts:
    """What one process counted: per stack the (rows, pairs) slots it needs (`maxima`, flat int64, the
    vector every process exchanges), the exact sync's capacities, and the worst-case bounds."""

    stacks: tuple[str, ...]
    maxima: np.ndarray  # [2 * len(stacks)]: rows, pairs per stack
    sync_caps: Mapping[str, dict]
    worst: Capacities

    def capacities(self, every: np.ndarray) -> Capacities:
        """The batch's capacities from every process's `maxima` ([processes, 2 * stacks]; one row in a
        single process): the maxima over processes, rounded up the ladder, capped by the worst case."""
        if not self.stacks:
            return Capacities((), counted=True)
        top = np.asarray(every, np.int64).reshape(-1, len(self.stacks), 2).max(axis=0)
        out = []
        for key, (rows_cap, pairs_cap) in zip(self.stacks, top):
            bound = self.worst[key]
            cap = StackCapacity(
                rows=min(round_up_capacity(int(rows_cap)), bound.rows) if rows_cap else 0,
                pairs=min(round_up_capacity(int(pairs_cap)), bound.pairs) if pairs_cap else 0,
            )
            out.append((key, dataclasses.replace(cap, **self.sync_caps.get(key, {}))))
        return Capacities(tuple(out), counted=True)


def count_local(
    layout: Layout,
    feature_table,
    topology: Topology,
    ids: Mapping[str, np.ndarray],
    pooled_comm: str,
    sync: bool,
    sync_strategy: str,
    wire_bytes,
    *,
    first_device: int = 0,
    num_devices: int | None = None,
    exchange=None,
) -> LocalCounts:
    """What this process's host ids (devices first_device...) need from every exchange, before the
    processes combine their counts: `LocalCounts.capacities(every process's maxima)` gives the batch's
    exact capacities (`local.capacities(local.maxima[None])` in a single process). The caller exchanges
    the maxima and may overlap that with other work (`EmbeddingCollection.shard_batch` places the ids
    meanwhile).

    `exchange(keys, same_size=False) -> keys of every process` (multi-process runs) merges the exact
    sync's row keys, which every process needs before it can count its sync capacities; None in a
    single process. `sync_strategy` 'auto' picks the cheaper of 'gather' and 'owner' for this batch from
    the counts, with `wire_bytes(width)` the bytes of one gradient row on the wire. Counts are capped by
    the worst case (`static_capacities`).
    """
    S, R = layout.num_shards, {k: st.rows for k, st in layout.stacks.items()}
    rep_count = topology.num_replicas
    devices = num_devices or (topology.nodes * topology.local)
    shapes = {f: x.shape for f, x in ids.items()}
    feats = tuple(sorted(ids))
    partial = pair_features(layout, feature_table, feats, {f: s[1] for f, s in shapes.items()}, pooled_comm)
    row_feats = [f for f in feats if f not in partial]
    local_shapes = {f: (s[0] // devices, s[1]) for f, s in shapes.items()}
    worst = static_capacities(layout, feature_table, topology, local_shapes, pooled_comm, None, sync)
    local_max: dict[str, tuple[int, int]] = {}  # stack -> (rows, pairs) slots this process needs
    sync_caps: dict[str, dict] = {}  # stack -> the exact sync's capacities and strategy
    for key, st in layout.stacks.items():
        if not any(layout.routes[feature_table[f]].stack == key for f in feats):
            continue
        touched = []  # (device, shard, row) of every request reaching an owner of this stack
        maxima = {"rows": 0, "pairs": 0}
        for mode, builder, mfeats in (
            ("rows", routing.row_requests, row_feats),
            ("pairs", routing.pair_requests, sorted(partial)),
        ):
            if mode == "pairs" and mfeats and not (sync and rep_count > 1):
                # Pairs are not de-duplicated and no sync needs their rows: count (device, owner) directly.
                maxima["pairs"] = _pair_count_max(layout, feature_table, key, mfeats, ids, devices)
                continue
            req = builder(layout, feature_table, key, mfeats, ids, xp=np) if mfeats else None
            if req is None:
                continue
            if mode == "rows":
                dev = _device_of_requests(req.segments, shapes, devices, first_device)
            else:
                dev = np.concatenate(
                    [
                        first_device + np.repeat(np.arange(seg.bags) // (seg.bags // devices), shapes[seg.feature][1])
                        for seg in req.segments
                    ]
                )
            ok = req.dest < S
            dev, dest, row = dev[ok].astype(np.int64), req.dest[ok].astype(np.int64), req.row[ok].astype(np.int64)
            if mode == "rows":
                per_dest = np.unique((dev * S + dest) * R[key] + row) // R[key]
            else:
                per_dest = dev * S + dest
            maxima[mode] = max(1, _max_count(per_dest))
            touched.append(np.stack([dev, dest, row]))
        local_max[key] = (maxima["rows"], maxima["pairs"])
        if sync and rep_count > 1:
            dev, dest, row = np.concatenate(touched, axis=1) if touched else np.zeros((3, 0), np.int64)
            rep = topology.replica_of(dev).astype(np.int64)
            # unique (replica, shard, row): what each replica's owner shards aggregate. A replica's devices
            # can sit on several processes (2d_ar), which then send the same key: unique again after merging.
            keys = np.unique((rep * S + dest) * R[key] + row)
            if exchange is not None:
                keys = np.unique(exchange(keys))
            rep_k, rest = np.divmod(keys, S * R[key])
            dest_k, row_k = np.divmod(rest, R[key])
            gather_cap = _max_count(rep_k * S + dest_k)
            owner = row_k % rep_count
            owner_cap = _max_count((rep_k * S + dest_k) * rep_count + owner)
            union = np.unique(dest_k * R[key] + row_k)
            owned_cap = _max_count((union // R[key]) * rep_count + (union % R[key]) % rep_count)
            g, o, u = (round_up_capacity(v) if v else 1 for v in (gather_cap, owner_cap, owned_cap))
            if sync_strategy == "auto":
                row_bytes = 4 + wire_bytes(st.width)
                gather_bytes = (rep_count - 1) * g * row_bytes
                owner_bytes = (rep_count - 1) * (o + u) * row_bytes
                strategy = "owner" if owner_bytes < gather_bytes else "gather"
            else:
                strategy = sync_strategy
            if strategy == "owner":
                sync_caps[key] = dict(sync=min(o, st.rows), owned=min(u, st.rows), sync_strategy="owner")
            else:
                sync_caps[key] = dict(sync=min(g, st.rows), sync_strategy="gather")
    stacks = tuple(local_max)
    mine = np.array([local_max[k] for k in stacks], np.int64).reshape(-1)
    return LocalCounts(stacks, mine, sync_caps, worst)
