"""Alpha-beta model of a training step's collectives on a `ClusterSpec` (pure Python + NumPy, no JAX).

Three layers, each usable alone:

1. **Collectives** (`all_to_all`, `all_reduce`, `all_gather`) turn a payload and a device group into
   `Traffic`: bytes and sequential messages per link class for one device. A group is given by its
   (intra-node, inter-node) peers, as `jaxscale.engine.mesh.Topology.shard_peers` / `replica_peers` return them.
   - all-to-all, b bytes to each peer: intra (m-1) b, inter p_x b; one message per peer (G-1 messages:
     511 per device on 64 x 8). NCCL posts all of them in one group, so the NVLink and NIC parts run at
     the same time (`concurrent`), while the messages' start-up latencies add up.
   - all-reduce of R bytes over k nodes x m devices, hierarchical (reduce-scatter inside the node,
     all-reduce of R/m across nodes, all-gather inside the node): intra 2(m-1)/m R in 2(m-1) steps,
     inter 2(k-1)/k R/m in 2(k-1) steps, phases one after the other.
   - all-gather of R_out bytes: intra (m-1)/m R_out in m-1 steps, inter (k-1)/k R_out/m in k-1 steps.
   These byte splits are the ones `jaxscale.comm_report` reads off compiled HLO.
   `seconds(traffic, cluster)`: messages x latency + bytes / bandwidth; the NIC's line rate is shared by
   the node's devices (all of them run the same collective at once in SPMD). An all-to-all's messages are
   posted at once: with `ClusterSpec.a2a_extra_message_cost` c < 1 its G-1 messages cost 1 + (G-2) c
   latencies instead of G-1 (`latency_messages`; c = 1, the default, is the additive rule).

2. **The embedding step** (`embedding_comms`) as functions of per-step counts (`StackCounts`), one
   entry per embedding stack, for a jaxscale topology and comm precisions (wire sizes from
   `jaxscale.engine.quantization.wire_bytes`). With S = shard-group size, Rep = replicas, w = communicated dim:
     ids        all-to-all (S-1) C_req 4                      (one int32 id per requested row; without
                replicas the first one also carries the lookup's counters, 4 bytes each per destination)
     rows       all-to-all (S-1) C_req wire_fwd(w)           (forward)
     grads      all-to-all (S-1) C_req wire_bwd(w)           (backward)
     pooled features returning per-bag partial sums: ids (S-1) pair_id_bytes(...), sums (S-1) B wire(w);
     a pair is a u16 row offset + a u8 count per bag while the shard's stack spans <= 2**16 rows (the
     engine's 'narrow' codec; an upper bound: it checks each table piece), else an int32 or two
   Replica sync (2D topologies only):
     exact 'owner'    all-to-all over the replica group (Rep-1) C_own (4 + wire_bwd) to each row's owner
                      replica, then all-gather of the owned union (Rep-1) V_own (4 + wire_bwd)
     exact 'gather'   all-gather of every replica's touched rows (Rep-1) U (4 + wire_bwd)
     periodic 'dense' all-reduce of the whole shard (weights + row-wise AdaGrad accumulator, fp32) / k
     periodic 'sparse' all-reduce of the rows touched since the last sync (V_k rows) / k

3. **The step** (`step_time`): compute, then the forward exchanges, the backward pass (the dense
   gradient all-reduce overlaps it, DDP-style in buckets: only what does not fit in the backward window,
   and at least the last bucket, is exposed), then the embedding backward exchanges and the replica sync,
   which need the backward's output and share the links with the exposed dense remainder: that phase
   takes the longer of its dependency chain and the busiest link's total occupancy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jaxscale.engine.cluster import ClusterSpec
from jaxscale.engine.embedding.settings import ReplicaSync
from jaxscale.engine.mesh import Topology
from jaxscale.engine.quantization import PRECISIONS, wire_bytes

ID_BYTES = 4  # one int32 row id
NARROW_SPAN = 2**16  # = jaxscale.engine.embedding.routing.NARROW_SPAN (this module imports no JAX)
PAIR_ID_BYTES = 8  # (row, bag) of a partial-sum request as two int32 (the widest encoding)
ADAGRAD_STATE_BYTES = 4  # row-wise AdaGrad: one fp32 accumulator per row
WEIGHT_BYTES = 4  # fp32 stored weights
DDP_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb = 25
# An assumption, not measured: the backward pass takes 2/3 of compute (backward = 2x forward FLOPs, the 6 N D
# accounting), the window the dense all-reduce can hide in.
BACKWARD_FRACTION = 2 / 3
CAPACITY_LADDER = 1.25  # capacities are rounded up to the next step of this geometric ladder
LOOKUP_COUNTERS = 2  # the lookup's [overflow, invalid ids] int32 counters (jaxscale.engine.embedding.collection)


# --------------------------------------------------------------------------------------------------
# 1. Collectives.


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What one collective costs one device.

    intra_bytes / inter_bytes: bytes the device sends over each link class; intra_messages /
    inter_messages: messages (or ring steps) whose start-up latencies add up; concurrent: the two link
    classes are used at the same time (flat all-to-all) instead of one after the other (hierarchical).
    """

    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    intra_messages: int = 0
    inter_messages: int = 0
    concurrent: bool = False

    def scaled(self, fraction: float) -> Traffic:
        """The same collective on `fraction` of the payload (the messages stay: each still starts)."""
        return dataclasses.replace(
            self, intra_bytes=self.intra_bytes * fraction, inter_bytes=self.inter_bytes * fraction
        )

    @property
    def total_bytes(self) -> float:
        return self.intra_bytes + self.inter_bytes


@dataclasses.dataclass(frozen=True)
class Group:
    """A device group of a collective: each device's peers on its node and on other nodes."""

    intra_peers: int
    inter_peers: int

    def __post_init__(self):
        for field in ("intra_peers", "inter_peers"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"Group.{field} must be a non-negative integer, got {value!r}")
        if self.inter_peers % (self.intra_peers + 1):
            raise ValueError(
                f"Group: {self.inter_peers} inter-node peers do not split into nodes of {self.intra_peers + 1} members"
            )

    @property
    def size(self) -> int:
        return self.intra_peers + self.inter_peers + 1

    @property
    def per_node(self) -> int:
        """m: members on each node the group spans."""
        return self.intra_peers + 1

    @property
    def nodes(self) -> int:
        """k: nodes the group spans."""
        return self.size // self.per_node


def shard_group(topology: Topology) -> Group:
    """The all-to-all group of a topology."""
    return Group(*topology.shard_peers)


def replica_group(topology: Topology) -> Group:
    """The replica-sync group of a topology (a single device for '1d')."""
    return Group(*topology.replica_peers)


def all_to_all(group: Group, bytes_per_peer: float) -> Traffic:
    """Each device sends `bytes_per_peer` to every other member (one message each)."""
    if group.size == 1 or bytes_per_peer == 0:
        return Traffic()
    return Traffic(
        intra_bytes=group.intra_peers * bytes_per_peer,
        inter_bytes=group.inter_peers * bytes_per_peer,
        intra_messages=group.intra_peers,
        inter_messages=group.inter_peers,
        concurrent=True,
    )


def all_reduce(group: Group, nbytes: float) -> Traffic:
    """Hierarchical ring all-reduce of `nbytes` per device (see module docstring)."""
    k, m = group.nodes, group.per_node
    if group.size == 1 or nbytes == 0:
        return Traffic()
    return Traffic(
        intra_bytes=2 * (m - 1) / m * nbytes,
        inter_bytes=2 * (k - 1) / k * nbytes / m,
        intra_messages=2 * (m - 1),
        inter_messages=2 * (k - 1),
    )


def all_gather(group: Group, result_bytes: float) -> Traffic:
    """Hierarchical ring all-gather whose result is `result_bytes` per device."""
    k, m = group.nodes, group.per_node
    if group.size == 1 or result_bytes == 0:
        return Traffic()
    return Traffic(
        intra_bytes=(m - 1) / m * result_bytes,
        inter_bytes=(k - 1) / k * result_bytes / m,
        intra_messages=m - 1,
        inter_messages=k - 1,
    )


def latency_messages(messages: int, traffic: Traffic, cluster: ClusterSpec) -> float:
    """How many message latencies `messages` cost: all of them one after the other (ring steps), or, for
    a grouped all-to-all whose messages are posted at once (`concurrent`), the first one plus
    `cluster.a2a_extra_message_cost` of each further one."""
    if not traffic.concurrent or messages == 0:
        return messages
    return 1 + (messages - 1) * cluster.a2a_extra_message_cost


def link_seconds(traffic: Traffic, cluster: ClusterSpec) -> tuple[float, float]:
    """(intra-node, inter-node) seconds of one collective: latency x messages + bytes / bandwidth."""
    intra = (
        latency_messages(traffic.intra_messages, traffic, cluster) * cluster.intra_node_latency
        + traffic.intra_bytes / cluster.intra_bandwidth_per_device
    )
    inter = (
        latency_messages(traffic.inter_messages, traffic, cluster) * cluster.inter_node_latency
        + traffic.inter_bytes / cluster.inter_bandwidth_per_device
    )
    return intra, inter


def seconds(traffic: Traffic, cluster: ClusterSpec) -> float:
    """Time of one collective on `cluster`."""
    intra, inter = link_seconds(traffic, cluster)
    return max(intra, inter) if traffic.concurrent else intra + inter


# --------------------------------------------------------------------------------------------------
# 2. The embedding step as a function of per-step counts.


def round_up_capacity(n: int, ladder: float = CAPACITY_LADDER) -> int:
    """The smallest step of the ladder ceil(ladder**i), i >= 0, that holds `n` slots (0 stays 0).

    Capacities computed on the host from each batch are rounded up on this ladder so that a few
    executables serve every batch (a new capacity means a new compile).
    """
    if n < 0:
        raise ValueError(f"round_up_capacity: n must be >= 0, got {n}")
    if n == 0:
        return 0
    i = max(0, math.floor(math.log(n, ladder)) - 1)
    while math.ceil(ladder**i) < n:
        i += 1
    return math.ceil(ladder**i)


@dataclasses.dataclass(frozen=True)
class StackCounts:
    """Per-step counts of one embedding stack (tables of one communicated width), per device.

    Attributes:
      width: w, the communicated row width.
      rows_per_shard: stored rows of the stack on one device (the periodic dense sync averages them all).
      requested: C_req, row slots per destination of the id/row all-to-alls (max over requester device
        and owner shard of the unique rows requested, as the engine sizes it).
      touched: U, rows one replica's shard touched (max over replica and shard): the 'gather' sync.
      owner_sent: C_own, slots per owner replica of the 'owner' sync's all-to-all.
      owned: V_own, rows of the union one owner replica sums and all-gathers (max over shard, owner).
      touched_since_sync: V_k, rows touched on one shard by any replica since the last periodic sync.
      pair_slots: C_pair, (row, bag) slots per destination for pooled features returning partial sums.
      bags: B, bags per destination of the partial sums.
    """

    width: int
    rows_per_shard: int
    requested: int
    touched: int = 0
    owner_sent: int = 0
    owned: int = 0
    touched_since_sync: int = 0
    pair_slots: int = 0
    bags: int = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"StackCounts.{field.name} must be a non-negative integer, got {value!r}")
        if self.width < 1:
            raise ValueError(f"StackCounts.width must be >= 1, got {self.width}")


@dataclasses.dataclass(frozen=True)
class Comm:
    """One collective of the step: its category, phase and traffic.

    phase 'forward' runs before compute can start; 'backward' after the backward pass (it needs its
    output); 'dense' is the dense gradient all-reduce (overlaps the backward pass). payload_bytes: the
    collective's payload per device (what DDP cuts into buckets).
    """

    category: str
    name: str
    phase: str
    traffic: Traffic
    payload_bytes: float = 0.0


def pair_id_bytes(pair_slots: int, bags: int, rows_per_shard: int) -> int:
    """Bytes of one destination's (row, bag) pair buffer, as `jaxscale.engine.embedding.routing.PairCodec` encodes
    it: narrow (2 per pair + 1 per bag, u8 counts in u16 words) when the stack's rows per shard fit
    NARROW_SPAN, packed int32 when rows x bags < 2**31, else two int32."""
    if rows_per_shard <= NARROW_SPAN:
        return 2 * pair_slots + 2 * math.ceil(bags / 2)
    if rows_per_shard * bags < 2**31:
        return 4 * pair_slots
    return PAIR_ID_BYTES * pair_slots


def embedding_comms(
    stacks: Sequence[StackCounts],
    topology: Topology,
    comm_forward: str = "fp32",
    comm_backward: str = "fp32",
    sync: ReplicaSync | None = None,
    *,
    lookup_counters: int = 0,
) -> list[Comm]:
    """The embedding collectives of one step (see module docstring for the byte formulas); `sync` defaults to
    the exact owner sync. `lookup_counters`: int32 words the engine's lookup appends to every block of its
    first ids all-to-all when that all-to-all spans every device (no replicas): its overflow and invalid-id
    counters ride there instead of an all-reduce of their own (LOOKUP_COUNTERS for the engine's step)."""
    sync = ReplicaSync("exact", "owner") if sync is None else sync
    for what, p in (("comm_forward", comm_forward), ("comm_backward", comm_backward)):
        if p not in PRECISIONS:
            raise ValueError(f"{what} must be one of {PRECISIONS}, got {p!r}")
    shard, replica = shard_group(topology), replica_group(topology)
    S, rep = topology.num_shards, topology.num_replicas
    out = []
    riding = lookup_counters * ID_BYTES if rep == 1 else 0  # bytes per destination, on the first ids exchange
    for i, st in enumerate(stacks):
        wf, wb = wire_bytes(1, st.width, comm_forward), wire_bytes(1, st.width, comm_backward)
        tag = f"stack{i}"
        if S > 1 and st.requested:
            extra, riding = riding, 0
            out += [
                Comm("emb_ids", f"{tag} ids", "forward", all_to_all(shard, st.requested * ID_BYTES + extra)),
                Comm("emb_rows", f"{tag} rows", "forward", all_to_all(shard, st.requested * wf)),
                Comm("emb_rows", f"{tag} grads", "backward", all_to_all(shard, st.requested * wb)),
            ]
        if S > 1 and st.pair_slots:
            extra, riding = riding, 0
            out += [
                Comm(
                    "emb_ids",
                    f"{tag} pair ids",
                    "forward",
                    all_to_all(shard, pair_id_bytes(st.pair_slots, st.bags, st.rows_per_shard) + extra),
                ),
                Comm("emb_rows", f"{tag} partial sums", "forward", all_to_all(shard, st.bags * wf)),
                Comm("emb_rows", f"{tag} bag grads", "backward", all_to_all(shard, st.bags * wb)),
            ]
        if rep > 1:
            out += _sync_comms(st, replica, rep, wb, sync, tag)
    return out


def _sync_comms(st: StackCounts, replica: Group, rep: int, wb: int, sync: ReplicaSync, tag: str) -> list[Comm]:
    row = ID_BYTES + wb
    strategy = sync.strategy
    if strategy == "auto":  # the engine's per-batch choice (`embedding.capacity`): fewer slots moved
        strategy = "owner" if st.owner_sent + st.owned < st.touched else "gather"
    if sync.mode == "exact" and strategy == "owner":
        return [
            Comm("replica_sync", f"{tag} to owners", "backward", all_to_all(replica, st.owner_sent * row)),
            Comm("replica_sync", f"{tag} owned union", "backward", all_gather(replica, rep * st.owned * row)),
        ]
    if sync.mode == "exact":
        return [Comm("replica_sync", f"{tag} gather", "backward", all_gather(replica, rep * st.touched * row))]
    state_row = st.width * WEIGHT_BYTES + ADAGRAD_STATE_BYTES
    rows = st.rows_per_shard if sync.strategy == "dense" else st.touched_since_sync
    average = all_reduce(replica, rows * state_row)
    return [Comm("replica_sync", f"{tag} periodic {sync.strategy}", "backward", average.scaled(1 / sync.every))]


def dense_allreduce(params: int, cluster: ClusterSpec, precision: str = "fp32") -> Comm:
    """The data-parallel gradient all-reduce of `params` dense parameters over every device."""
    if params < 0:
        raise ValueError(f"dense_allreduce: params must be >= 0, got {params}")
    group = Group(cluster.devices_per_node - 1, (cluster.nodes - 1) * cluster.devices_per_node)
    payload = wire_bytes(params, 1, precision)
    return Comm("dense_grad", f"dense all-reduce {precision}", "dense", all_reduce(group, payload), payload)


# --------------------------------------------------------------------------------------------------
# 3. The step.


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step and where they go.

    compute: dense forward + backward; forward: exchanges before compute; backward: the phase after
    the backward pass (embedding gradients, replica sync, exposed dense remainder, sharing links);
    dense_exposed: the part of the dense all-reduce the backward window could not hide (inside
    `backward`); by_category: each category's time had it run alone.
    """

    compute: float
    forward: float
    backward: float
    dense_exposed: float
    by_category: dict

    @property
    def comm(self) -> float:
        """Communication on the critical path."""
        return self.forward + self.backward

    @property
    def total(self) -> float:
        return self.compute + self.comm


def step_time(
    comms: Sequence[Comm],
    cluster: ClusterSpec,
    compute_s: float,
    *,
    backward_fraction: float = BACKWARD_FRACTION,
    bucket_bytes: float = DDP_BUCKET_BYTES,
) -> StepTime:
    """The step time of `comms` on `cluster` after `compute_s` of compute (module docstring, item 3)."""
    if not compute_s >= 0:
        raise ValueError(f"step_time: compute_s must be >= 0, got {compute_s}")
    by_category: dict[str, float] = {}
    for c in comms:
        by_category[c.category] = by_category.get(c.category, 0.0) + seconds(c.traffic, cluster)
    forward = sum(seconds(c.traffic, cluster) for c in comms if c.phase == "forward")
    chain = [c.traffic for c in comms if c.phase == "backward"]
    exposed = []
    for c in comms:
        if c.phase != "dense" or c.traffic.total_bytes == 0:
            continue
        alone = seconds(c.traffic, cluster)
        last_bucket = min(1.0, bucket_bytes / c.payload_bytes) if c.payload_bytes > 0 else 1.0
        fraction = max(last_bucket, 1.0 - backward_fraction * compute_s / alone)
        exposed.append(c.traffic.scaled(fraction))
    dense_exposed = sum(seconds(t, cluster) for t in exposed)
    chain_s = sum(seconds(t, cluster) for t in chain)
    links = [link_seconds(t, cluster) for t in chain + exposed]
    busiest = max((sum(x[i] for x in links) for i in (0, 1)), default=0.0)
    backward = max(chain_s, dense_exposed, busiest)
    return StepTime(compute_s, forward, backward, dense_exposed, by_category)


def category_bytes(comms: Sequence[Comm]) -> dict[str, tuple[float, float]]:
    """{category: (intra-node, inter-node) bytes one device sends per step}."""
    out: dict[str, tuple[float, float]] = {}
    for c in comms:
        a, b = out.get(c.category, (0.0, 0.0))
        out[c.category] = (a + c.traffic.intra_bytes, b + c.traffic.inter_bytes)
    return out


def weak_scaling_speedup(step_by_nodes: dict[int, float]) -> dict[int, float]:
    """Throughput relative to one node at a fixed per-device batch: N x T(1) / T(N)."""
    if 1 not in step_by_nodes:
        raise ValueError("weak_scaling_speedup needs the 1-node step time")
    t1 = step_by_nodes[1]
    return {n: n * t1 / t for n, t in step_by_nodes.items()}
