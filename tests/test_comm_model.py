"""comm_model: collectives, the embedding step's bytes and the step time, against hand-computed cases and
brute-force references (device pairs of the mesh; the HLO byte split of comm_report)."""

import numpy as np
import pytest

from jaxscale.engine import comm_model as cm
from jaxscale.engine.cluster import ClusterSpec
from jaxscale.engine.comm_inspect import Collective
from jaxscale.engine.mesh import TOPOLOGIES, Topology, node_of_position
from jaxscale.training.comm_report import split_bytes

# A toy cluster with round numbers: 100 B/s per device inside a node, 800 B/s per node (200 B/s per device
# across nodes with 4 devices per node), 1 s / 2 s per message.
TOY = ClusterSpec(
    2, 4, 1e9, intra_node_bandwidth=100, inter_node_bandwidth=800, intra_node_latency=1, inter_node_latency=2
)


def test_all_to_all_hand_computed():
    t = cm.all_to_all(cm.Group(3, 4), 100)  # 1d on 2x4: 3 peers on the node, 4 on the other
    assert (t.intra_bytes, t.inter_bytes, t.intra_messages, t.inter_messages) == (300, 400, 3, 4)
    assert cm.link_seconds(t, TOY) == (3 * 1 + 300 / 100, 4 * 2 + 400 / 200)
    assert cm.seconds(t, TOY) == 10  # NVLink and NIC at once: the slower one
    assert cm.all_to_all(cm.Group(0, 0), 100) == cm.Traffic()


def test_all_reduce_and_all_gather_hand_computed():
    t = cm.all_reduce(cm.Group(3, 4), 800)  # k=2 nodes, m=4 per node
    assert (t.intra_bytes, t.inter_bytes, t.intra_messages, t.inter_messages) == (1200, 200, 6, 2)
    assert cm.seconds(t, TOY) == (6 * 1 + 1200 / 100) + (2 * 2 + 200 / 200)  # phases one after the other
    g = cm.all_gather(cm.Group(0, 1), 504)  # 2d_a2a replica group on 2 nodes: one device per node
    assert (g.intra_bytes, g.inter_bytes, g.intra_messages, g.inter_messages) == (0, 252, 0, 1)


def test_messages_per_all_to_all_are_group_size_minus_one():
    t = cm.all_to_all(cm.shard_group(Topology("1d", 64, 8)), 1.0)
    assert t.intra_messages + t.inter_messages == 511
    assert cm.all_to_all(cm.shard_group(Topology("2d_a2a", 64, 8)), 1.0).inter_messages == 0
    assert cm.all_to_all(cm.shard_group(Topology("2d_ar", 64, 8)), 1.0).inter_messages == 63


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2), (3, 5)])
@pytest.mark.parametrize("name", TOPOLOGIES)
def test_groups_match_brute_force_device_pairs(name, nodes, local):
    """Peers on / off the node of every device in its shard and replica groups, enumerated pairwise."""
    topo = Topology(name, nodes, local)
    for groups, model in ((topo.shard_groups(), cm.shard_group(topo)), (topo.replica_groups(), cm.replica_group(topo))):
        for group in groups:
            for d in group:
                same = sum(node_of_position(p, (nodes, local)) == node_of_position(d, (nodes, local)) for p in group)
                assert (same - 1, len(group) - same) == (model.intra_peers, model.inter_peers)


@pytest.mark.parametrize("kind", ["all-to-all", "all-reduce", "all-gather"])
@pytest.mark.parametrize("name,nodes,local", [("1d", 2, 4), ("1d", 4, 2), ("2d_ar", 4, 2), ("2d_a2a", 2, 4)])
def test_byte_split_equals_the_hlo_readers(kind, name, nodes, local):
    """comm_report.split_bytes reads the intra/inter split of a compiled collective; the model must agree."""
    topo = Topology(name, nodes, local)
    groups = topo.shard_groups() if name != "2d_a2a" or kind == "all-to-all" else topo.replica_groups()
    G = len(groups[0])
    R = 960.0 * G
    per_device = {"all-to-all": (G - 1) / G * R, "all-reduce": 2 * (G - 1) / G * R, "all-gather": (G - 1) / G * R}
    hlo = Collective(kind, ("f32",), ((1,),), G, groups, int(R), per_device[kind], True, "x")
    group = cm.Group(*(topo.shard_peers if groups == topo.shard_groups() else topo.replica_peers))
    model = {
        "all-to-all": cm.all_to_all(group, R / G),
        "all-reduce": cm.all_reduce(group, R),
        "all-gather": cm.all_gather(group, R),
    }[kind]
    assert split_bytes(hlo, (nodes, local)) == pytest.approx((model.intra_bytes, model.inter_bytes))


def test_group_rejects_irregular_shapes():
    with pytest.raises(ValueError, match="inter-node peers"):
        cm.Group(3, 5)
    with pytest.raises(ValueError, match="intra_peers"):
        cm.Group(-1, 0)


def test_capacity_ladder():
    ladder = sorted({int(np.ceil(1.25**i)) for i in range(60)})
    for n in range(0, 3000):
        got = cm.round_up_capacity(n)
        assert got == (0 if n == 0 else min(v for v in ladder if v >= n))
    assert cm.round_up_capacity(10_000_000) < 10_000_000 * 1.25 + 1
    with pytest.raises(ValueError):
        cm.round_up_capacity(-1)


def test_embedding_bytes_hand_computed_2d_a2a_owner_sync():
    counts = [cm.StackCounts(width=8, rows_per_shard=1000, requested=10, touched=9, owner_sent=5, owned=7)]
    comms = cm.embedding_comms(counts, Topology("2d_a2a", 2, 4), "fp32", "fp32", cm.ReplicaSync("exact", "owner"))
    b = cm.category_bytes(comms)
    assert b["emb_ids"] == (3 * 10 * 4, 0)  # S-1 = 3 peers, all on the node
    assert b["emb_rows"] == (3 * 10 * 32 * 2, 0)  # rows forward + gradients backward, fp32 x 8
    assert b["replica_sync"] == (0, 5 * 36 + 7 * 36)  # to the other replica's owner, then its owned union
    phases = {c.name: c.phase for c in comms}
    assert phases["stack0 ids"] == "forward" and phases["stack0 grads"] == "backward"


def test_embedding_bytes_gather_periodic_and_wire_precisions():
    counts = [cm.StackCounts(8, 1000, 10, touched=9, owner_sent=5, owned=7, touched_since_sync=300)]
    topo = Topology("2d_a2a", 4, 2)  # 4 replicas, one device per node
    gather = cm.category_bytes(cm.embedding_comms(counts, topo, "fp8", "bf16", cm.ReplicaSync("exact", "gather")))
    assert gather["replica_sync"] == (0, 3 * 9 * (4 + 16))  # (Rep-1) U (4 + wire_bwd), bf16 x 8 = 16 B
    assert gather["emb_rows"] == (1 * 10 * (9 + 16), 0)  # fp8 row = 8 + 1 B scale
    dense = cm.category_bytes(cm.embedding_comms(counts, topo, sync=cm.ReplicaSync("periodic", "dense", 4)))
    assert dense["replica_sync"] == (0, pytest.approx(2 * 3 / 4 * 1000 * (8 * 4 + 4) / 4))
    sparse = cm.category_bytes(cm.embedding_comms(counts, topo, sync=cm.ReplicaSync("periodic", "sparse", 4)))
    assert sparse["replica_sync"] == (0, pytest.approx(2 * 3 / 4 * 300 * 36 / 4))
    one_d = cm.category_bytes(cm.embedding_comms(counts, Topology("1d", 4, 2)))
    assert "replica_sync" not in one_d and one_d["emb_ids"] == (1 * 10 * 4, 6 * 10 * 4)


def test_partial_sum_counts():
    counts = [cm.StackCounts(8, 100, 0, pair_slots=20, bags=16)]
    b = cm.category_bytes(cm.embedding_comms(counts, Topology("1d", 1, 4), "fp32", "bf16"))
    assert b["emb_ids"] == (3 * (20 * 2 + 16), 0)  # narrow: a u16 per pair, a u8 count per bag
    assert b["emb_rows"] == (3 * 16 * (32 + 16), 0)
    assert cm.pair_id_bytes(20, 15, 2**16) == 20 * 2 + 16  # counts travel two to a u16 word
    assert cm.pair_id_bytes(20, 16, 2**16 + 1) == 20 * 4  # packed int32: row * bags + bag
    assert cm.pair_id_bytes(20, 2**15, 2**16 + 1) == 20 * 8  # two int32


def test_pair_id_bytes_match_the_engines_narrow_limit():
    from jaxscale.engine.embedding import routing

    assert cm.NARROW_SPAN == routing.NARROW_SPAN


def test_replica_sync_validation():
    with pytest.raises(ValueError, match="strategy"):
        cm.ReplicaSync("exact", "dense")
    with pytest.raises(ValueError, match="every"):
        cm.ReplicaSync("exact", "owner", 4)
    with pytest.raises(ValueError, match="mode"):
        cm.ReplicaSync("lazy", "owner")
    with pytest.raises(ValueError, match="comm_forward"):
        cm.embedding_comms([], Topology("1d", 1, 2), "int8")
    with pytest.raises(ValueError, match="requested"):
        cm.StackCounts(8, 10, -1)


def test_dense_all_reduce_is_hidden_by_backward_except_the_last_bucket():
    cluster = ClusterSpec(2, 4, inter_node_bandwidth=1e9, inter_node_latency=0, intra_node_latency=0)
    params = 100_000_000  # 400 MB fp32: 16 buckets of 25 MiB
    dense = cm.dense_allreduce(params, cluster)
    alone = cm.seconds(dense.traffic, cluster)
    assert dense.payload_bytes == 4 * params
    assert dense.traffic.inter_bytes == pytest.approx(2 * 1 / 2 * 4 * params / 4)
    long_compute = cm.step_time([dense], cluster, compute_s=10 * alone)
    assert long_compute.dense_exposed == pytest.approx(alone * cm.DDP_BUCKET_BYTES / (4 * params))
    short_compute = cm.step_time([dense], cluster, compute_s=0.6 * alone)
    assert short_compute.dense_exposed == pytest.approx(alone * (1 - 2 / 3 * 0.6))
    assert short_compute.total == pytest.approx(0.6 * alone + short_compute.dense_exposed)
    bf16 = cm.dense_allreduce(params, cluster, "bf16")
    assert bf16.traffic.inter_bytes == pytest.approx(dense.traffic.inter_bytes / 2)


def test_backward_phase_shares_the_busiest_link():
    cluster = ClusterSpec(
        2, 4, intra_node_bandwidth=100, inter_node_bandwidth=400, intra_node_latency=0, inter_node_latency=0
    )
    a2a = cm.Comm("emb_rows", "grads", "backward", cm.Traffic(0, 300, concurrent=True))  # 3 s on the NIC
    sync = cm.Comm("replica_sync", "sync", "backward", cm.Traffic(200, 0))  # 2 s on NVLink
    dense = cm.dense_allreduce(100, cluster)  # 400 B: 6 s NVLink + 1 s NIC, hides nothing with 0 compute
    step = cm.step_time([a2a, sync, dense], cluster, compute_s=0.0)
    assert step.backward == pytest.approx(max(3 + 2, 3 + 1, 2 + 6, 7))  # NVLink busiest: sync + dense intra
    assert step.by_category == pytest.approx({"emb_rows": 3, "replica_sync": 2, "dense_grad": 7})
    fwd = cm.Comm("emb_ids", "ids", "forward", cm.Traffic(100, 0, concurrent=True))
    assert cm.step_time([fwd], cluster, 1.0).total == pytest.approx(2.0)


def test_weak_scaling_speedup():
    assert cm.weak_scaling_speedup({1: 1.0, 2: 1.0, 4: 2.0}) == {1: 1.0, 2: 2.0, 4: 2.0}
    with pytest.raises(ValueError, match="1-node"):
        cm.weak_scaling_speedup({2: 1.0})


def test_all_to_all_bytes_equal_a_sum_over_sender_receiver_pairs():
    """Bytes per device of an all-to-all summed over explicit (sender, receiver) pairs of the mesh."""
    nodes, local, b = 3, 4, 7.0
    for name in TOPOLOGIES:
        topo = Topology(name, nodes, local)
        t = cm.all_to_all(cm.shard_group(topo), b)
        for group in topo.shard_groups():
            for sender in group:
                intra = sum(b for r in group if r != sender and r // local == sender // local)
                inter = sum(b for r in group if r // local != sender // local)
                assert (t.intra_bytes, t.inter_bytes) == (intra, inter)
