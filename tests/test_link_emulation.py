"""The emulated cluster's pure parts (jaxscale.studies.link_emulation): the user-space delay line that stands in for
netem, the latency fit, the a-priori step prediction from the recorded collectives, and the non-additive
all-to-all latency it feeds into `comm_model` (`ClusterSpec.a2a_extra_message_cost`)."""

import os
import socket
import struct
import threading
import time

import pytest

from jaxscale.engine import comm_model as cm
from jaxscale.engine.cluster import ClusterSpec
from jaxscale.studies import link_emulation as E


def ipv4(dst: str, payload: bytes = b"x") -> bytes:
    """A minimal IPv4 packet to `dst` (header fields beyond version and addresses are not read)."""
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), 0, 0, 64, 17, 0, bytes(4), socket.inet_aton(dst))
    return header + payload


# ------------------------------------------------------------------------------------------ delay line


def test_delay_line_holds_each_packet_for_the_delay_in_arrival_order():
    line = E.DelayLine(0.005)
    assert line.wait(0.0) is None and len(line) == 0
    line.push(1.000, "a", b"1")
    line.push(1.002, "b", b"2")
    assert line.due(1.004) == [] and line.wait(1.004) == pytest.approx(0.001)
    assert line.due(1.005) == [("a", b"1")]
    assert line.due(1.010) == [("b", b"2")] and line.wait(1.01) is None
    with pytest.raises(ValueError, match="delay must be >= 0"):
        E.DelayLine(-1e-3)


def test_run_delay_line_routes_by_destination_after_the_delay():
    """Three 'nodes' as datagram socket pairs: what node 0 sends reaches node 1 or 2 by its IPv4
    destination, no earlier than the delay; IPv6 and unknown addresses are counted, not forwarded."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(3)]
    inner = {bytes([10, 200, 0, i + 1]): a.fileno() for i, (a, _) in enumerate(pairs)}
    for a, _ in pairs:
        a.setblocking(False)
    stop = threading.Event()
    result = {}
    t = threading.Thread(target=lambda: result.update(E.run_delay_line(inner, 0.05, stop=stop.is_set)))
    t.start()
    try:
        node0, node1, node2 = (b for _, b in pairs)
        sent = time.monotonic()
        node0.send(ipv4("10.200.0.2", b"to-1"))
        node0.send(ipv4("10.200.0.3", b"to-2"))
        node0.send(ipv4("10.200.0.9"))  # nobody
        node0.send(b"\x60" + bytes(39))  # an IPv6 header
        node1.settimeout(2)
        node2.settimeout(2)
        got1 = node1.recv(100)
        waited = time.monotonic() - sent
        got2 = node2.recv(100)
        assert got1.endswith(b"to-1") and got2.endswith(b"to-2")
        assert waited >= 0.05
    finally:
        stop.set()
        t.join(5)
        for a, b in pairs:
            a.close()
            b.close()
    assert result == {"packets": 2, "bytes": 2 * 24, "unroutable": 2}


# ------------------------------------------------------------------------------------------ latency model


def test_all_to_all_latency_additive_by_default_and_overlapped_when_measured_so():
    group = cm.Group(7, 56)  # 8 nodes x 8 devices
    a2a = cm.all_to_all(group, 0.0 + 1e-9)
    ring = cm.all_reduce(group, 1e-9)
    additive = ClusterSpec(8, 8, inter_node_latency=1e-5, intra_node_latency=0.0)
    posted = ClusterSpec(8, 8, inter_node_latency=1e-5, intra_node_latency=0.0, a2a_extra_message_cost=0.0)
    half = ClusterSpec(8, 8, inter_node_latency=1e-5, intra_node_latency=0.0, a2a_extra_message_cost=0.5)
    assert cm.link_seconds(a2a, additive)[1] == pytest.approx(56 * 1e-5, rel=1e-6)
    assert cm.link_seconds(a2a, posted)[1] == pytest.approx(1e-5, rel=1e-6)
    assert cm.link_seconds(a2a, half)[1] == pytest.approx((1 + 55 * 0.5) * 1e-5, rel=1e-6)
    # a ring's steps wait for each other whatever the all-to-all does
    assert cm.link_seconds(ring, posted)[1] == pytest.approx(cm.link_seconds(ring, additive)[1])
    assert cm.latency_messages(0, a2a, posted) == 0
    with pytest.raises(ValueError, match="a2a_extra_message_cost must be in"):
        ClusterSpec(2, 8, a2a_extra_message_cost=1.5)
    with pytest.raises(ValueError, match="a2a_extra_message_cost"):
        ClusterSpec(2, 8, a2a_extra_message_cost=-0.1)


def test_cluster_yaml_reads_the_extra_message_cost(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("nodes: 2\ndevices_per_node: 4\na2a_extra_message_cost: 0.25\n")
    assert ClusterSpec.from_yaml(str(path)).a2a_extra_message_cost == 0.25


def _latency_rows(alpha=0.008, cost=0.1, base=0.001, ring_step=0.011, delay=5.0):
    rows = []
    for d in (0.0, delay):
        for n, m in ((2, 1), (4, 1), (8, 1), (2, 2)):
            g = n * m
            extra = d > 0
            a2a = base * g + (alpha * (1 + (n - 2) * cost) if extra else 0.0)
            row = {"run": "a2a_latency", "nodes": n, "local": m, "devices": g, "inter_node_peers": g - m,
                   "delay_ms": d, "bytes_per_peer": 64, "repeats": 5,
                   "all_to_all_median_s": a2a, "permute_median_s": base + (alpha if extra else 0.0),
                   "all_reduce_median_s": base * 3 + (ring_step * 2 * (g - 1) if extra else 0.0)}  # fmt: skip
            rows.append(row)
    return rows


def test_fit_latency_recovers_alpha_and_the_extra_message_cost():
    fit = E.fit_latency(_latency_rows())
    assert fit["alpha_s"] == pytest.approx(0.008) and fit["a2a_extra_message_cost"] == pytest.approx(0.1)
    assert fit["delay_ms"] == 5.0 and [p["inter_node_peers"] for p in fit["points"]] == [1, 3, 7]
    assert fit["additive_prediction_s"][-1] == pytest.approx(7 * 0.008)
    assert fit["ring_step_s"] == pytest.approx(0.011)
    assert {(q["nodes"], q["local"], q["steps"]) for q in fit["ring"]} == {(2, 1, 2), (4, 1, 6), (8, 1, 14), (2, 2, 6)}
    additive = E.fit_latency(_latency_rows(cost=1.0))
    assert additive["a2a_extra_message_cost"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="delay 0 and at one delay"):
        E.fit_latency([r for r in _latency_rows() if r["delay_ms"] > 0])
    with pytest.raises(ValueError, match=">= 2 node counts"):
        E.fit_latency([r for r in _latency_rows() if r["nodes"] == 2])


# ------------------------------------------------------------------------------------------ a-priori step


def test_emulated_comm_counts_the_transports_messages():
    a2a = {"kind": "all-to-all", "group": "all", "category": "emb_rows", "intra": 10.0, "inter": 30.0, "per_step": 1}
    ar = {"kind": "all-reduce", "group": "all", "category": "dense_grad", "intra": 5.0, "inter": 7.0, "per_step": 1,
          "operands": 3}  # fmt: skip
    ag = {"kind": "all-gather", "group": "node", "category": "replica_sync", "intra": 0.0, "inter": 4.0, "per_step": 1}
    local = {"kind": "all-to-all", "group": "local", "category": "emb_rows", "intra": 9.0, "inter": 0.0, "per_step": 1}
    c = E.emulated_comm(a2a, 4, 2, {"all_to_all@all": 1.5}, "forward")
    assert (c.traffic.inter_messages, c.traffic.intra_messages, c.traffic.concurrent) == (6, 1, True)
    assert c.traffic.inter_bytes == 45.0 and c.phase == "forward"
    c = E.emulated_comm(ar, 4, 2, None, "dense")
    assert c.traffic.inter_messages == 3 * 2 * 7 and c.traffic.inter_bytes == 7.0 * E.GLOO_DIRECTIONS
    assert E.emulated_comm(ag, 4, 2, None, "backward").traffic.inter_messages == 3
    assert E.emulated_comm(local, 4, 2, None, "forward").traffic.inter_messages == 0


def test_step_phases_follow_program_order():
    cats = ["scalars", "emb_ids", "emb_rows", "model_gather", "dense_grad", "emb_rows", "replica_sync"]
    got = E.step_phases([{"category": c} for c in cats])
    assert got == ["forward", "forward", "forward", "forward", "dense", "backward", "backward"]


def test_predicted_step_latency_rate_and_periodic_weighting():
    a2a = {"kind": "all-to-all", "group": "node", "category": "emb_rows", "intra": 0.0, "inter": 1e5, "per_step": 1}
    sync = {"kind": "all-reduce", "group": "node", "category": "replica_sync", "intra": 0.0, "inter": 4e5,
            "per_step": 0.25}  # fmt: skip
    free = E.emulated_cluster(4, 1, None, 0.01, 0.0)
    limited = E.emulated_cluster(4, 1, "8mbit", 0.01, 0.0)  # 1e6 B/s
    # posted at once: one latency for 3 peers; 1e5 B x factor 1 at 1e6 B/s
    assert E.predicted_step([a2a], free, 0.2, {"all_to_all@node": 1.0}) == pytest.approx(0.21, rel=1e-6)
    assert E.predicted_step([a2a], limited, 0.2, {"all_to_all@node": 1.0}) == pytest.approx(0.31, rel=1e-6)
    additive = E.emulated_cluster(4, 1, "8mbit", 0.01, 1.0)
    assert E.predicted_step([a2a], additive, 0.2, {"all_to_all@node": 1.0}) == pytest.approx(0.33, rel=1e-6)
    # the sync runs one step in 4: a 4-node ring of 6 steps x 10 ms + 4e5 x 2 / 1e6 B/s, a quarter of it
    with_sync = E.predicted_step([a2a, sync], limited, 0.2, {"all_to_all@node": 1.0})
    assert with_sync == pytest.approx(0.31 + 0.25 * (6 * 0.01 + 0.8), rel=1e-6)


def test_delay_link_script_needs_root_arguments():
    """The TUN side is Linux + root only (emulate.sh runs it); its argument errors need neither."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, os.path.join(root, "experiments", "scaling", "delay_link.py"), "--nodes", "2"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert done.returncode == 2 and "--delay-ms" in done.stderr


def test_compute_for_reproduces_the_measured_step():
    ar = {"kind": "all-reduce", "group": "all", "category": "dense_grad", "intra": 0.0, "inter": 2e5, "per_step": 1}
    cluster = E.emulated_cluster(2, 2, None, 0.01, 0.0)
    compute = E.compute_for([ar], cluster, 0.5, None)
    assert E.predicted_step([ar], cluster, compute, None) == pytest.approx(0.5, rel=1e-6)
    assert E.compute_for([ar], cluster, 0.001, None) == 0.0  # the ring's latency alone is longer
