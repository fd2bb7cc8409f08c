"""The scaling model (jaxscale.studies.scaling_model): the technique ladder, the byte formulas (== compiled HLO), the
Monte Carlo counts (jaxscale.studies.scaling_counts == jaxscale.engine.planner.measure_step_counts), the checks
against the published figures on the cached counts, and the experiments/scaling scripts run as subprocesses."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxscale.engine import comm_model as cm
from jaxscale.engine.cluster import ClusterSpec
from jaxscale.engine.embedding.settings import EmbeddingSettings, ReplicaSync
from jaxscale.engine.mesh import Topology
from jaxscale.engine.plan import ShardingPlan, TableShards
from jaxscale.engine.quantization import CommConfig
from jaxscale.engine.tables import TableConfig
from jaxscale.engine.techniques import STAGE_NAMES, STAGES, Stage, stage
from jaxscale.studies import link_emulation as E
from jaxscale.studies import scaling_counts as C
from jaxscale.studies import scaling_model as M

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALING = os.path.join(ROOT, "experiments", "scaling")


def _script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs experiments/scaling/<name> as the user would (from the repository root)."""
    return subprocess.run(
        [sys.executable, os.path.join(SCALING, name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ------------------------------------------------------------------------------------------ ladder


def _facts(st: Stage) -> dict:
    """What a stage sets, as comparable values."""
    e = st.settings
    return {
        "topology": e.topology,
        "comm": (e.comm.forward, e.comm.backward),
        "replica_sync": e.replica_sync,
        "balanced": st.balanced,
        "half_dim": st.half_dim,
    }


def test_ladder_adds_one_technique_per_stage():
    assert STAGE_NAMES == ("baseline", "+fp8", "+balanced", "+half_dim", "2d_ar", "2d_a2a")
    changed = [
        {k for k, v in _facts(a).items() if v != _facts(b)[k]} - ({"replica_sync"} if b.name == "2d_ar" else set())
        for a, b in zip(STAGES, STAGES[1:])
    ]
    assert changed == [{"comm"}, {"balanced"}, {"half_dim"}, {"topology"}, {"topology"}]
    assert stage("+fp8").settings.comm == CommConfig("fp8", "bf16")
    assert stage("baseline").settings.replica_sync == ReplicaSync()  # nothing to sync on 1d
    assert stage("2d_a2a").settings.replica_sync == ReplicaSync("exact", "owner")
    with pytest.raises(ValueError, match="unknown stage"):
        stage("+fp4")


def test_stage_config_overrides_load():
    from jaxscale.training.config import load_config

    unbalanced = stage("+fp8").config_overrides()
    assert "embedding.comm.forward=fp8" in unbalanced and "embedding.sharding=row_wise" in unbalanced
    with pytest.raises(ValueError, match="plan_file"):
        stage("+balanced").config_overrides()
    a2a = stage("2d_a2a").config_overrides(plan_file="plan.json")
    assert "embedding.plan_file=plan.json" in a2a and "model.foundation.item_reshape=half_dim" in a2a
    cfg = load_config(M.CONFIG, M.compiled_overrides(stage("2d_a2a"), 2, 4))
    assert cfg.embedding.topology == "2d_a2a" and cfg.model.foundation.item_reshape == "half_dim"
    assert cfg.embedding.comm.forward == "fp8" and cfg.mesh.nodes == 2
    for st in STAGES:  # the overrides load back to exactly the stage's settings
        loaded = load_config(None, [*st.config_overrides(plan_file="p.json"), "mesh.nodes=2", "mesh.local=4"])
        assert st.applied_to(loaded.embedding) == loaded.embedding
        assert loaded.embedding.replica_sync == st.settings.replica_sync


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(topology="3d"), "topology"),
        (dict(topology="auto"), "a topology"),
        (dict(comm=CommConfig("fp32", "fp32"), replica_sync=ReplicaSync("periodic")), "needs replicas"),
    ],
)
def test_stage_validation(settings, match):
    with pytest.raises(ValueError, match=match):
        Stage("x", EmbeddingSettings(**settings), balanced=False, half_dim=False)


def test_with_sync():
    periodic = stage("2d_a2a").with_sync(ReplicaSync("periodic", "sparse", 16))
    assert periodic.settings.replica_sync.every == 16
    assert "embedding.replica_sync={mode: periodic, strategy: sparse, every: 16, sparse_rows: null}" in (
        periodic.config_overrides(plan_file="p")
    )


# ------------------------------------------------------------------------------------------ byte formulas


def tiny(half_dim=False, devices=8):
    from jaxscale_models.foundation import FoundationConfig

    return M.foundation_workload(FoundationConfig(**M.TINY), M.TINY_BATCH // devices, "tiny", M.CAPACITY_FACTOR)


def test_padded_counts_hand_computed():
    w = tiny()
    n = w.batch_per_device * w.seq_len  # 2 x 4 = 8 ids per table per device
    got = M.padded_counts(w, Topology("2d_a2a", 2, 4), half_dim=False)[0]
    per_table = min(-(-5 * n // (4 * 4)), -(-256 // 4), n)  # ceil(1.25 n / S), ceil(rows / S), n
    assert got.requested == 2 * per_table and got.touched == 4 * 2 * per_table
    assert got.width == 8 and got.rows_per_shard == 2 * 64
    half = M.padded_counts(w, Topology("2d_a2a", 2, 4), half_dim=True)[0]
    assert half.width == 4 and half.rows_per_shard == 2 * 128 and half.requested == got.requested
    one = M.padded_counts(w, Topology("1d", 1, 1), half_dim=False)[0]
    assert one.requested == 0 and one.touched == 2 * n


def test_compiled_cache_agrees_with_the_formulas():
    """Every compiled entry of compiled_bytes.json (collect.py) equals the closed-form bytes."""
    path = os.path.join(SCALING, "compiled_bytes.json")
    assert os.path.exists(path), (
        "experiments/scaling/compiled_bytes.json is missing: run experiments/scaling/collect.py"
    )
    with open(path) as f:
        compiled = json.load(f)
    for key, entry in compiled.items():  # the cache was compiled from today's overrides
        nodes, local = map(int, key.split("|")[0].split("x"))
        st = next(s for s in M.distinct_compiled_stages() if M.compiled_entry_key(nodes, local, s) == key)
        assert entry["overrides"] == M.compiled_overrides(st, nodes, local), key
    rows = M.cross_check(compiled)
    assert len(rows) == len(M.distinct_compiled_stages()) * len(M.COMPILED_MESHES) * len(M.CATS)
    bad = [r for r in rows if not M.agrees(r)]
    assert not bad, bad
    assert any(r["category"] == "replica_sync" and r["compiled"][1] > 0 for r in rows)


def test_live_compile_equals_formula_2x4_half_dim_2d_a2a():
    """The closed-form bytes equal the compiled HLO's for the real half_dim path (item_up) on 2x4."""
    from jaxscale.training.comm_report import comm_report
    from jaxscale.training.config import load_config

    st = stage("2d_a2a")
    rep = comm_report(load_config(M.CONFIG, M.compiled_overrides(st, 2, 4)))
    assert rep["config"]["item_reshape"] == "half_dim"
    w = tiny(True)
    cluster = ClusterSpec(2, 4)
    pred = M.merge_dense(
        M.category_bytes(
            M.step_comms(w, st, M.padded_counts(w, cluster.topology("2d_a2a"), True), cluster, M.PADDED_SYNC)
        )
    )
    got = M.merge_dense({k: (v["intra_node"], v["inter_node"]) for k, v in rep["per_step"]["by_category"].items()})
    for cat in M.CATS:
        row = {"category": cat, "compiled": got.get(cat, (0.0, 0.0)), "formula": pred.get(cat, (0.0, 0.0))}
        assert M.agrees(row), row
    assert pred["replica_sync"][1] > 0 and pred["emb_rows"][1] == 0


def test_exact_batch_counts_of_a_compiled_config_fit_under_the_padded_worst_case():
    from jaxscale.training.config import load_config

    for name, (nodes, local) in (("2d_a2a", (2, 4)), ("+fp8", (4, 2))):
        st = stage(name)
        cfg = load_config(M.CONFIG, M.compiled_overrides(st, nodes, local))
        exact = M.batch_counts(cfg)[0]
        padded = M.padded_counts(
            tiny(devices=nodes * local), ClusterSpec(nodes, local).topology(st.settings.topology), st.half_dim
        )
        n_ids = 2 * tiny(devices=nodes * local).batch_per_device * M.TINY["max_seq_len"]  # 2 tables
        assert 0 < exact.requested <= cm.round_up_capacity(n_ids) and exact.width == padded[0].width
        assert exact.touched <= padded[0].touched and exact.owned <= exact.touched_since_sync


def test_large_preset_bytes_follow_the_techniques():
    w = M.Workload(
        "t",
        32,
        2048,
        (TableConfig("a", 10**8, 64, pooling=None),),
        (TableConfig("a", 10**8, 64, pooling=None, reshape="half_dim"),),
        150_000_000,
        150_000_000,
        128,
        8192,
    )
    cluster = ClusterSpec(8, 8)
    counts = [cm.StackCounts(64, 10**7, 1000, 30000, 5000, 25000)]
    half = [cm.StackCounts(32, 2 * 10**7, 1000, 30000, 5000, 25000)]
    inter = []
    for name in ("baseline", "+fp8", "+half_dim"):
        st = stage(name)
        b = M.category_bytes(M.step_comms(w, st, half if st.half_dim else counts, cluster, cm.ReplicaSync()))
        inter.append(b["emb_rows"][1])
    assert inter[0] > inter[1] > inter[2] > 0
    # fp8 rows: 1 byte per element + a 1-byte scale exponent; bf16 gradients 2 bytes per element
    assert inter[1] == pytest.approx(56 * 1000 * (65 + 128)) and inter[2] == pytest.approx(56 * 1000 * (33 + 64))
    a2a = M.category_bytes(M.step_comms(w, stage("2d_a2a"), half, cluster, cm.ReplicaSync("exact", "owner")))
    assert a2a["emb_rows"][1] == 0 and a2a["replica_sync"][1] == pytest.approx(7 * (5000 + 25000) * 68)
    assert a2a["dense_grad"][1] == pytest.approx(2 * 7 / 8 * 4 * (150_000_000 + 8192 * 128) / 8)


# ------------------------------------------------------------------------------------------ Monte Carlo counts


@pytest.mark.parametrize("row_assignment", ["modulo", "contiguous"])
def test_nested_counts_equal_the_library_counts(row_assignment):
    rng = np.random.default_rng(0)
    local, max_nodes = 4, 4
    tables = [
        TableConfig("a", 997, 16, pooling=None, features=("fa",)),
        TableConfig("b", 501, 16, pooling=None, features=("fb",)),
        TableConfig("c", 300, 8, pooling=None, features=("fc",)),
    ]
    p = np.arange(1, 998.0) ** -1.1
    ids = {
        "fa": rng.choice(997, size=(max_nodes * local, 50), p=p / p.sum()),
        "fb": rng.integers(-1, 501, (max_nodes * local, 30)),
        "fc": rng.integers(-1, 300, (max_nodes * local, 10)),
    }
    for nodes in (1, 2, 3, 4):
        for topology in ("1d", "2d_a2a", "2d_ar"):
            shards = ClusterSpec(nodes, local).topology(topology).num_shards
            plan = ShardingPlan(
                topology,
                shards,
                {
                    "a": TableShards("row_wise", shards, 1, tuple(range(shards))),
                    "b": TableShards("row_wise", shards, 1, tuple(rng.permutation(shards))),
                    "c": TableShards("table_wise", 1, 1, (shards - 1,)),
                },
            )
            fast, ref = C.check_nested_against_library(ids, tables, plan, nodes, local, row_assignment)
            assert fast == ref, (nodes, topology)


def test_recount_generates_the_models_own_ids_node_slice_by_node_slice():
    """`run_ablation.py --recount`'s first steps on a small config: one global batch, each node's slice the
    trainer's own batch for that process, hashed into the model's tables."""
    from jaxscale_models.foundation import FoundationConfig
    from jaxscale_models.foundation_data import SyntheticFoundationData

    cfg = FoundationConfig()
    raw = C.generate_ids(cfg, 2, 2, 4, seed=3, log=lambda _: None)
    assert raw.shape[0] == 2 * 2 * 4
    data = SyntheticFoundationData(cfg, global_batch=16, seed=3)
    np.testing.assert_array_equal(raw[8:], data.batch(0, 1, 2)["item_ids"])
    ids = C.device_ids(cfg, raw, 4)
    assert all(a.shape[0] == 4 for a in ids.values()) and C.ids_per_device(raw, 4) > 0


def test_raw_row_ids_keep_hot_ids_in_the_first_block():
    raw = np.array([[0, 1, 5, -1], [7, 3, 1, 2]])
    t = TableConfig("a", 4, 8, pooling=None, features=("f",))
    assert C.raw_row_ids(raw, [t], 2)["f"].tolist() == [[0, 1, 1, -1], [3, 3, 1, 2]]


# ------------------------------------------------------------------------------------------ calibration


def _toy_predictor():
    """Speedups of a fixed step (1 MB inter-node per GPU + 20 us latency at 2 nodes, 2.5 MB at 4)."""
    fabric = {"no_efa_2_nodes": 12.5e9 / 8, "before_2_nodes": 400e9 / 8, "before_4_nodes": 400e9 / 8}
    inter = {"no_efa_2_nodes": 1e6, "before_2_nodes": 1e6, "before_4_nodes": 2.5e6}
    nodes = {"no_efa_2_nodes": 2, "before_2_nodes": 2, "before_4_nodes": 4}

    def predict(name, compute_s, efficiency, efficiency_tcp):
        eff = efficiency_tcp if name == "no_efa_2_nodes" else efficiency
        comm = 20e-6 + inter[name] / (fabric[name] * eff / 8)
        return nodes[name] * compute_s / (compute_s + comm)

    return predict


def test_fit_recovers_known_parameters_and_reproduces_its_points():
    predict = _toy_predictor()
    truth = (0.004, 0.35, 0.35)
    published = {p: predict(p, *truth) for p in M.FITTED_POINTS}
    cal = M.fit(predict, published=published)
    assert cal.compute_s == pytest.approx(truth[0], rel=1e-4) and cal.efficiency == pytest.approx(truth[1], rel=1e-4)
    assert cal.efficiency_tcp == cal.efficiency and cal.residual_log_rms < 1e-6
    assert cal.fitted_values == pytest.approx(published, rel=1e-6)
    # with the efficiencies given, compute alone is fitted
    alone = M.fit(predict, published=published, efficiencies=(0.35, 0.35))
    assert alone.compute_s == pytest.approx(0.004, rel=1e-4) and (alone.efficiency, alone.efficiency_tcp) == (
        0.35,
        0.35,
    )


def test_a_calibration_from_no_published_figure_is_not_checked():
    """The 'compute from FLOPs' calibration came from no published figure: its gate has nothing to reproduce
    and fails ('not checked'); it used to pass vacuously (all([]) is True) and call every check a prediction."""
    predict = _toy_predictor()
    flops = M.pinned_calibration(predict, 0.2, 0.8, 0.4, (), name="compute from FLOPs")
    assert flops.fitted_values == {} and flops.points_used == ()
    assert not flops.gate_passed and flops.gate_reason().startswith("not checked")
    # a calibration that came from a figure passes its gate only by reproducing it
    c = M.fit(predict, points=("before_2_nodes",), efficiencies=(0.8, 0.4)).compute_s
    assert predict("before_2_nodes", c, 0.8, 0.4) == pytest.approx(M.PUBLISHED["before_2_nodes"], rel=1e-3)
    assert M.pinned_calibration(predict, c, 0.8, 0.4, ("before_2_nodes",)).gate_passed
    assert not M.pinned_calibration(predict, c * 10, 0.8, 0.4, ("before_2_nodes",)).gate_passed


def test_compute_from_flops_is_the_models_flops_at_the_sourced_utilisation():
    w = tiny()
    flops = M.transformer_step_flops(w, 8, 1)
    assert M.flops_compute_s(w, 8, 1) == pytest.approx(flops / (0.40 * 989e12))
    assert M.flops_compute_s(w, 8, 1, utilisation=0.2) == pytest.approx(2 * M.flops_compute_s(w, 8, 1))
    assert "Llama 3" in M.FLOPS_UTILISATION_SOURCE
    with pytest.raises(ValueError, match="utilisation"):
        M.flops_compute_s(w, 8, 1, utilisation=0.0)


def test_link_efficiencies_read_nccl_tests_through_the_model():
    # alltoall over 2 nodes x 8: half of each rank's bytes cross nodes; 400 GB/s per node = 50 GB/s per GPU
    assert M.link_efficiency("alltoall", 2, 8, 80.0, 3200) == pytest.approx(40 / 50)
    # hierarchical all-reduce over 4 nodes: algbw = NIC x eff x 4 / 6
    assert M.link_efficiency("all_reduce", 4, 8, 200.0, 3200) == pytest.approx(200 * 1.5 / 400)
    assert M.busbw_efficiency(5.0, 100) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="kind"):
        M.link_efficiency("broadcast", 2, 8, 1.0, 100)
    with pytest.raises(ValueError, match="2 nodes"):
        M.link_efficiency("alltoall", 1, 8, 1.0, 100)
    spec = M.with_link_efficiency(M.FABRICS["400 Gbps/node"], 0.5)
    assert spec.inter_node_bandwidth == 25e9 and spec.intra_node_bandwidth == M.H100_NODES.intra_node_bandwidth
    assert M.compute_from_throughput(490e3, 64, 32) == pytest.approx(64 * 32 / 490e3)


def test_check_rows_have_the_published_json_fields():
    # the 8-node throughput is where compute comes from, so it is not a check
    assert M.COMPUTE_SOURCE == "throughput_8_nodes" and M.COMPUTE_SOURCE in M.PUBLISHED
    assert M.CHECK_NAMES == (
        "no_efa_2_nodes",
        "before_2_nodes",
        "before_4_nodes",
        "fp8_2_nodes",
        "final_2_nodes",
        "final_4_nodes",
        "final_8_nodes",
        "a2a_latency_ratio",
        "fp8_gain_2_nodes",
        "final_over_before_2_nodes",
        "final_over_before_4_nodes",
    )
    assert M.RATIO_CHECKS == ("fp8_gain_2_nodes", "final_over_before_2_nodes", "final_over_before_4_nodes")
    assert M.PUBLISHED["a2a_latency_ratio"] == pytest.approx(6.0)
    assert M.PUBLISHED["fp8_gain_2_nodes"] == pytest.approx(1.39, abs=0.005)
    assert M.PUBLISHED["final_over_before_2_nodes"] == pytest.approx(1.77, abs=0.005)
    assert M.PUBLISHED["final_over_before_4_nodes"] == pytest.approx(3.22, abs=0.005)
    rows = [M.check_row(p, M.PUBLISHED[p] * 1.17, "predicted") for p in M.PUBLISHED]
    for r in json.loads(json.dumps(rows)):
        assert {"name", "published", "predicted", "kind", "relative_error", "within_15_percent"} <= set(r)
        assert not r["within_15_percent"] and r["passed"] == (r["name"] in M.RATIO_CHECKS)  # 17%: 20% only
    assert M.check_row("fp8_gain_2_nodes", M.PUBLISHED["fp8_gain_2_nodes"] * 0.82, "predicted")["passed"]  # -18%
    assert "why" in M.check_row("final_8_nodes", 5.0, "not a prediction", why="gate")


@pytest.fixture(scope="module")
def large_scenario():
    """The large preset on the cached Monte Carlo counts (experiments/scaling/mc_counts.json)."""
    from jaxscale_models.foundation import FoundationConfig

    with open(os.path.join(SCALING, "mc_counts.json")) as f:
        mc = json.load(f)
    with open(os.path.join(SCALING, "link_benchmarks.json")) as f:
        eff = M.link_efficiencies(json.load(f))
    large = M.foundation_workload(FoundationConfig.large(), mc["params"]["batch_per_device"], "large")
    return M.Scenario(large, M.cached_counts_fn(mc), M.cached_stats(mc, True), mc["params"]["batch_per_device"]), eff


# What the pinned model gives on the cached counts (run_ablation.py's checks), recorded: a change of the model,
# the counts or the benchmark rows shows up here. Values and pass / fail at each check's tolerance.
RECORDED_CHECKS = {
    "no_efa_2_nodes": (0.025848, False),
    "before_2_nodes": (1.0876, True),
    "before_4_nodes": (1.1178, True),
    "fp8_2_nodes": (1.3934, True),
    "final_2_nodes": (1.5029, False),
    "final_4_nodes": (2.5616, False),
    "final_8_nodes": (4.6791, False),
    "a2a_latency_ratio": (24.679, False),
    "fp8_gain_2_nodes": (1.2813, True),
    "final_over_before_2_nodes": (1.3819, False),
    "final_over_before_4_nodes": (2.2916, False),
}
RECORDED_THROUGHPUT_8_NODES = 268_920  # the gate: what the model gives for the throughput compute came from


def test_real_checks_on_the_cached_counts(large_scenario):
    sc, eff = large_scenario
    assert eff["efa"] == pytest.approx(0.8453, abs=1e-4) and eff["tcp"] == pytest.approx(0.4)
    cal = M.published_calibration(sc, eff)
    assert cal.compute_s == pytest.approx(64 * 32 / 490e3) and cal.points_used == ("throughput_8_nodes",)
    rows = M.run_checks(sc, cal)
    got = {r["name"]: (r["predicted"], r["passed"]) for r in rows}
    assert set(got) == set(RECORDED_CHECKS)
    for name, (value, passed) in RECORDED_CHECKS.items():
        assert got[name][0] == pytest.approx(value, rel=2e-4), name
        assert got[name][1] == passed, name
    # the throughput compute was assumed from is missed by more than 15%: nothing is called a prediction
    got_tp = cal.fitted_values["throughput_8_nodes"]
    assert got_tp == pytest.approx(RECORDED_THROUGHPUT_8_NODES, rel=2e-4)
    assert not cal.gate_passed and "NOT within 15%" in cal.gate_reason()
    assert {r["kind"] for r in rows} == {"not a prediction"}
    assert all("throughput_8_nodes" in r["why"] for r in rows)
    # of the three independent ratio checks, one holds
    assert [n for n in M.RATIO_CHECKS if got[n][1]] == ["fp8_gain_2_nodes"]


def test_a2a_latency_ratio_under_the_measured_latency_shape(large_scenario):
    """The all-to-all time 1d / 2d_a2a at 8 nodes: 24.7 when each of 1d's 63 peers' latencies adds up (the
    additive rule), 7.5 when a grouped all-to-all pays one latency (c = 0, what the emulated cluster
    measured: experiments/scaling/EMULATION.md); published 6.0. Recorded values."""
    sc, eff = large_scenario
    cal = M.published_calibration(sc, eff)
    efa = cal.cluster(M.CALIBRATION_FABRICS["with EFA"])
    sync, fn, w = M.EXACT_SYNCS[0], sc.counts_fn, sc.workload

    def ratio(cost):
        c = dataclasses.replace(efa, a2a_extra_message_cost=cost)
        return M.a2a_seconds(w, stage("+half_dim"), fn, c, 8, sync) / M.a2a_seconds(w, stage("2d_a2a"), fn, c, 8, sync)

    assert ratio(1.0) == pytest.approx(RECORDED_CHECKS["a2a_latency_ratio"][0], rel=2e-4)
    assert ratio(0.0) == pytest.approx(7.4846, rel=2e-4)
    assert ratio(0.0) < ratio(0.5) < ratio(1.0)


def test_compute_sweep_finds_where_a_check_flips(large_scenario):
    sc, eff = large_scenario
    cal = M.published_calibration(sc, eff)
    sweep = M.compute_sweep(sc, cal, (0.004, 0.008), names=("final_8_nodes",), tol_s=1e-4)
    v = sweep["checks"]["final_8_nodes"]
    assert v["passed"] == [False, True] and len(v["flips"]) == 1 and v["flips"][0]["to"] == "pass"
    flip = v["flips"][0]["compute_s"]
    assert flip == pytest.approx(0.00643, abs=2e-4)  # the exposed dense all-reduce hides above ~6.4 ms
    assert v["pass_intervals_s"] == [(flip, 0.008)]
    for c, ok in ((flip - 2e-4, False), (flip + 2e-4, True)):
        value = M.check_values(sc, c, cal.efficiency, cal.efficiency_tcp, ("final_8_nodes",))["final_8_nodes"]
        assert (abs(value / 7.5 - 1) <= 0.15) == ok


def test_dense_sweep_scales_only_the_dense_model_and_bisects_the_flip(large_scenario):
    """The diagnosis sweep: half the preset's dense model makes every ratio check hold (recorded), the
    embedding bytes do not move, and the bisected flip separates pass from fail."""
    sc, eff = large_scenario
    cal = M.published_calibration(sc, eff)
    w = sc.workload
    half = M.with_dense_scale(w, 0.5)
    assert half.dense_params_full == round(w.dense_params_full / 2)
    assert half.dense_params_half - half.dense_params_full == w.dense_params_half - w.dense_params_full
    with pytest.raises(ValueError, match="dense scale"):
        M.with_dense_scale(w, 0.0)
    efa = cal.cluster(M.CALIBRATION_FABRICS["with EFA"])

    def category(workload, prefix):
        st = stage("+half_dim")
        comms = M.step_comms(workload, st, sc.counts_fn(st, 4), efa.with_nodes(4), M.EXACT_SYNCS[0])
        return {k: v for k, v in M.category_bytes(comms).items() if k.startswith(prefix)}

    assert category(half, "emb") == category(w, "emb") and category(w, "emb")
    assert category(half, "dense") != category(w, "dense")

    names = (*M.RATIO_CHECKS, "final_8_nodes")
    ds = M.dense_sweep(sc, cal, (1.0, 0.5), names=names)
    assert ds["scales"] == [1.0, 0.5] and ds["dense_params"] == [w.dense_params_full, half.dense_params_full]
    for n in M.RATIO_CHECKS:
        assert ds["checks"][n]["passed"][1], n  # every ratio check holds at half the dense model
        assert ds["checks"][n]["values"][0] == pytest.approx(RECORDED_CHECKS[n][0], rel=2e-4)
    assert ds["checks"]["final_over_before_4_nodes"]["values"][1] == pytest.approx(3.13, abs=0.01)
    v = ds["checks"]["final_8_nodes"]
    assert v["passed"] == [False, True] and len(v["flips"]) == 1 and v["flips"][0]["to"] == "fail"
    flip = v["flips"][0]["scale"]
    assert 0.5 < flip < 1.0
    for scale, ok in ((flip / 1.02, True), (flip * 1.02, False)):
        scaled = dataclasses.replace(sc, workload=M.with_dense_scale(w, scale))
        value = M.check_values(scaled, cal.compute_s, cal.efficiency, cal.efficiency_tcp, ("final_8_nodes",))
        assert (abs(value["final_8_nodes"] / 7.5 - 1) <= 0.15) == ok
    assert ds["passing"] == [sum(ds["checks"][n]["passed"][i] for n in names) for i in range(2)]


def test_weak_scaling_of_a_stage_is_bounded_by_the_node_count():
    w = tiny()
    fn = lambda st, n: M.padded_counts(w, ClusterSpec(n, 8).topology(st.settings.topology), st.half_dim)  # noqa: E731
    for name in STAGE_NAMES:
        sync = cm.ReplicaSync("exact", "gather")
        sp = [M.speedup(w, stage(name), fn, M.FABRICS["400 Gbps/node"], n, 0.01, sync) for n in (2, 4, 8)]
        assert all(0 < s <= n + 1e-9 for s, n in zip(sp, (2, 4, 8)))
    spec = dataclasses.replace(M.FABRICS["400 Gbps/node"], inter_node_bandwidth=1e15, inter_node_latency=0)
    assert M.speedup(w, stage("baseline"), fn, spec, 4, 0.01, cm.ReplicaSync()) == pytest.approx(4, rel=1e-3)


# ------------------------------------------------------------------------------------------ emulation


def test_emulation_prediction_and_link_helpers():
    assert E.rate_bytes("8mbit") == 1e6 and E.rate_bytes("1gbit") == 125e6 and E.rate_bytes("800kbit") == 1e5
    with pytest.raises(ValueError, match="mbit"):
        E.rate_bytes("8MB")
    assert E.tbf_burst("4mbit") == 3000 and E.tbf_burst("1gbit") == 500_000
    collectives = [
        {"kind": "all-to-all", "group": "all", "inter": 1000.0, "intra": 5.0, "per_step": 1.0},
        {"kind": "all-reduce", "group": "node", "inter": 500.0, "intra": 0.0, "per_step": 0.25},
        {"kind": "all-to-all", "group": "local", "inter": 0.0, "intra": 900.0, "per_step": 1.0},
    ]
    # (1000 + 500 / 4) B per device x 2 devices per node, sent + received, at 1e6 B/s
    assert E.predicted_delta(collectives, 2, "8mbit") == pytest.approx((1000 + 125) * 2 * 2 / 1e6)
    assert E.predicted_delta(collectives, 2, "8mbit", {"all_to_all@all": 1.0}) == pytest.approx(
        (1000 * 1.0 + 125 * 2) * 2 / 1e6
    )
    assert E.bytes_by_category(
        [dict(c, category=cat) for c, cat in zip(collectives, ("emb_rows", "replica_sync", "emb_rows"))]
    ) == {"emb_rows": (905.0, 1000.0), "replica_sync": (0.0, 125.0)}
    periodic = M.stage_from_spec("2d_a2a@periodic:sparse:8")
    assert periodic.settings.replica_sync == ReplicaSync("periodic", "sparse", 8)
    assert periodic.name == "2d_a2a@periodic:sparse:8"
    with pytest.raises(ValueError, match="unknown stage"):
        M.stage_from_spec("3d")
    with pytest.raises(ValueError, match="expected"):
        M.stage_from_spec("2d_a2a@periodic:dense")


def test_emulation_plans_a_balanced_stage():
    """bench_step.py's per-stage setup outside the namespaces (--print-config): the config and the planner's plan."""
    out = _script("bench_step.py", "--stage", "2d_a2a", "--nodes", "2", "--local", "2", "--print-config")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["topology"] == "2d_a2a" and got["plan"]["topology"] == "2d_a2a" and got["plan"]["num_shards"] == 2
    assert got["plan_file"] and not os.path.exists(got["plan_file"])  # the temp plan is removed after reading
    out = _script("bench_step.py", "--stage", "+fp8", "--nodes", "2", "--local", "2", "--print-config")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["plan"] is None and got["plan_file"] is None  # unbalanced stages keep their sharding
    out = _script("bench_step.py", "--stage", "2d_a2a")
    assert out.returncode != 0 and "--process-id" in out.stderr


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_emulation_report_computes_its_tables(tmp_path):
    """EMULATION.md from a stage run plus the earlier calibration runs it names: the latency fit, the
    a-priori prediction of each limited step, standard errors, the 1-node speedup, failures kept."""
    latency = [{"run": "machine", "platform": "test", "cpus": 2, "loadavg_at_start": [0.1, 0, 0]}]
    for d in (0.0, 5.0):
        for n in (2, 4):
            extra = 0.01 if d else 0.0  # one latency whatever the peers: c = 0
            latency.append(
                {"run": "a2a_latency", "nodes": n, "local": 1, "devices": n, "inter_node_peers": n - 1,
                 "delay_ms": d, "bytes_per_peer": 64, "repeats": 5, "all_to_all_median_s": 0.001 + extra,
                 "permute_median_s": 0.001 + extra, "all_reduce_median_s": 0.002 + extra * 2 * (n - 1)}
            )  # fmt: skip
    duplex = {"nodes": 4, "local": 2, "rate": "4mbit", "bytes_per_device": 500000, "repeats": 3}
    duplex |= {k: {"factor": f, "wire_ratio": 1.0} for k, f in (("one_way@node", 1.02), ("exchange@node", 2.04))}
    duplex["all_to_all@all"] = {"factor": 1.25, "wire_ratio": 1.0}
    _write_jsonl(tmp_path / "latency_a.jsonl", latency)
    _write_jsonl(tmp_path / "transport_a.jsonl", [duplex])
    a2a = [{"kind": "all-to-all", "group": "all", "category": "emb_rows", "inter": 40e3, "intra": 0.0, "per_step": 1}]
    stage = dict(
        nodes=4, local=2, rate="4mbit", delay_ms=5.0, steps=4, batch_per_device=8, sharding={"a": "row_wise"},
        inter_bytes_per_node=80_000.0, collectives=a2a,
        unlimited_s=[0.1, 0.1, 0.1, 0.1], limited_s=[0.29, 0.31, 0.29, 0.31],
    )  # fmt: skip
    rows = [
        {"run": "machine", "platform": "test", "cpus": 2, "loadavg_at_start": [0.5, 0, 0]},
        {"run": "calibration", "latency": "latency_a.jsonl", "transport": "transport_a.jsonl"},
        dict(stage, nodes=1, stage="+fp8", rate=None, unlimited_mean_s=0.05, unlimited_s=[0.05] * 4),
        dict(stage, stage="+fp8", unlimited_mean_s=0.1, limited_mean_s=0.3, predicted_delta_s=0.32),
        dict(stage, stage="2d_a2a", unlimited_mean_s=0.1, limited_mean_s=0.6, predicted_delta_s=0.2),
        {"run": "2d_ar_4", "nodes": 4, "error": "a process exited 1"},
        {"run": "end", "loadavg_at_end": [0.7, 0, 0], "seconds": 600},
    ]
    path = _write_jsonl(tmp_path / "run.jsonl", rows)
    out_md = tmp_path / "EMULATION.md"
    done = _script("emulation_report.py", str(path), "--out", str(out_md))
    assert done.returncode == 0, done.stderr
    text = out_md.read_text()
    assert "alpha = 10.00 ms per message" in text and "c = 0.000" in text and "not additive" in text
    # +fp8: 40 kB per device to every other device, x 1.25 (the calibration's all_to_all@all), over a NIC of
    # 0.5 MB/s shared by 2 devices = 0.2 s; one 10 ms latency (c = 0); compute 0.1 - 0.01 = 0.09 s:
    # predicted 0.3 s = measured. Exchange rule: 0.1 + 0.32. 1 node: speedup 4 x 0.05 / 0.3.
    fp8 = "| +fp8 | - | 80,000 | 100 ms +- 0 ms | 300 ms +- 6 ms | 300 ms | 1.00 | yes | 420 ms | 50 ms | "
    fp8 += "0.667x (0.667x) |"
    assert fp8 in text, text
    assert "| 2d_a2a | - | 80,000 | 100 ms +- 0 ms | 600 ms +- 6 ms | 300 ms | 2.00 | **no** | 300 ms | - | - |" in text
    assert "1 of 2 stages' limited steps within 20%" in text and "failed: a process exited 1" in text
    # the bandwidth part beside the whole step: what the rate limit adds, measured vs predicted (+fp8: 0.2 s
    # both; the model's own unlimited step is its 0.09 s compute + one 10 ms latency = the measured 0.1 s)
    assert "| +fp8 | 200 ms | 200 ms | 1.00 | yes | 200 ms | 1.00 |" in text, text
    assert "| 2d_a2a | 500 ms | 200 ms | 2.50 | **no** |" in text
    assert "Bandwidth part: 1 of 2 within 20% (measured / predicted 1.00-2.50)" in text
    assert "BACKWARD_FRACTION" in text and "10 us (EFA) / 50 us (TCP)" in text  # the unsourced constants
    assert "an exchange of the same bytes 2.04-2.04 x" in text and "10 min in all" in text
    assert "latency_a.jsonl" in text and json.dumps(rows[3]) in text  # the headline run's raw lines are quoted
    other = _write_jsonl(tmp_path / "run2.jsonl", [{"run": "calibration", "latency": "x.jsonl", "transport": "y"}])
    done = _script("emulation_report.py", str(path), str(other), "--out", str(out_md))
    assert done.returncode != 0 and "different calibrations" in done.stderr
    path.write_text("not json\n")
    done = _script("emulation_report.py", str(path), "--out", str(out_md))
    assert done.returncode != 0 and "run.jsonl:1: not a JSON line" in done.stderr


def test_k_study_results_are_read_and_rendered(tmp_path):
    """write_results.py renders RESULTS.md's periodic-sync section from the recorded JSON files."""
    runs = [
        {"name": "exact", "k": 1, "steps": 300, "eval_loss": 2.0, "eval_recall": 0.5, "sync_bytes_inter": 4096.0},
        {"name": "periodic k=4", "k": 4, "steps": 300, "eval_loss": 2.02, "eval_recall": 0.49, "sync_bytes_inter": 1e6},
    ]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"machine": "test box", "runs": runs}))
    preds = tmp_path / "scaling.json"  # run_ablation.py --json's shape: node counts are JSON keys
    preds.write_text(
        json.dumps(
            {"predictions": {"400 Gbps/node": {"variants": {"2d_a2a periodic dense k=4": {"8": 1.5, "64": 3.0}}}}}
        )
    )
    done = _script("write_results.py", "--k-study", str(path), "--predictions", str(preds))
    assert done.returncode == 0, done.stderr
    assert "| periodic k=4 | 4 | 300 | 2.0200 | +1.00% | 0.4900 | 1.00 MB |" in done.stdout
    assert "test box" in done.stdout and "periodic dense k=4 1.50x / 3.00x" in done.stdout
    pending = _script("write_results.py", "--predictions", str(preds))
    assert pending.returncode == 0 and "Pending" in pending.stdout
    path.write_text(json.dumps({"machine": "x", "runs": [{"name": "exact"}]}))
    done = _script("write_results.py", "--k-study", str(path), "--predictions", str(preds))
    assert done.returncode != 0 and "runs[0] lacks" in done.stderr
