"""experiments/scaling/model.py: the alpha-beta arithmetic and the byte extrapolation."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments", "scaling"))

import model as M  # noqa: E402

LINKS = M.FABRICS["100 Gbps/node"]
SHAPE = M.Shape(
    batch=32,
    seq_len=2048,
    tables=2,
    dim=64,
    rows=100_000_000,
    capacity_factor=1.25,
    dense_params=150_000_000,
    item_out_dim=128,
    max_negatives=8192,
)


def test_no_cross_node_bytes_scales_perfectly():
    b = {"emb_rows": (1e6, 0.0), "dense_grad": (1e7, 0.0)}
    times = {n: M.step_time(b, 0.1, LINKS, n, 8)["total"] for n in (1, 2, 4, 8)}
    assert M.speedup(times) == pytest.approx({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})


def test_cross_node_bytes_cost_time_and_bandwidth_helps():
    b = {"emb_rows": (1e6, 5e7)}
    slow = M.step_time(b, 0.1, LINKS, 2, 8)["total"]
    fast = M.step_time(b, 0.1, M.FABRICS["3200 Gbps/node"], 2, 8)["total"]
    assert slow > fast > 0.1
    # 5e7 B over a 100 Gbps NIC shared by 8 GPUs: 5e7 / (12.5e9 / 8) = 32 ms (+ latency and NVLink)
    assert slow - 0.1 == pytest.approx(5e7 / (12.5e9 / 8) + 1e6 / 450e9 + 15e-6)


def test_speedup_is_monotone_in_bytes_and_bounded_by_nodes():
    for topo, fwd, bwd, half in (
        ("1d", "fp32", "fp32", False),
        ("1d", "fp8", "bf16", False),
        ("1d", "fp8", "bf16", True),
        ("2d_a2a", "fp8", "bf16", True),
    ):
        times = {
            n: M.step_time(M.step_bytes(SHAPE, n, 8, topo, fwd, bwd, half), 0.2, LINKS, n, 8)["total"]
            for n in (1, 2, 4, 8, 16)
        }
        sp = M.speedup(times)
        assert all(sp[n] <= n + 1e-9 for n in sp)
        assert all(sp[a] < sp[b] for a, b in ((1, 2), (2, 4), (4, 8)))
    # each cumulative 1d technique lowers the cross-node embedding bytes at 8 nodes
    inter = [
        sum(M.step_bytes(SHAPE, 8, 8, "1d", f, b, h)[c][1] for c in M.EMBEDDING_CATEGORIES)
        for f, b, h in (("fp32", "fp32", False), ("fp8", "bf16", False), ("fp8", "bf16", True))
    ]
    assert inter[0] > inter[1] > inter[2] > 0
    assert M.step_bytes(SHAPE, 8, 8, "2d_a2a", "fp8", "bf16", True)["emb_rows"][1] == 0


def test_wire_and_capacity_arithmetic():
    assert M.WIRE_BYTES["fp8"](64) == 68 and M.WIRE_BYTES["bf16"](64) == 128 and M.WIRE_BYTES["fp32"](64) == 256
    n = 32 * 2048
    assert M.capacity(SHAPE, 64, False) == 2 * -(-5 * n // (4 * 64))
    assert M.capacity(SHAPE, 64, True) == M.capacity(SHAPE, 64, False)  # rows double, the id count does not
    b32 = M.step_bytes(SHAPE, 4, 8, "1d", "fp32", "fp32", False)["emb_rows"]
    b32h = M.step_bytes(SHAPE, 4, 8, "1d", "fp32", "fp32", True)["emb_rows"]
    assert b32h == pytest.approx((b32[0] / 2, b32[1] / 2))
    # 1d on 4x8: 24 of the 31 peers are on other nodes
    assert b32[1] / (b32[0] + b32[1]) == pytest.approx(24 / 31)


def test_extrapolation_matches_compiled_2x4_bytes():
    """The closed-form bytes equal the compiled HLO's for a tiny foundation step on the 2x4 mesh."""
    from run_ablation import agrees, shape_of
    from stages import STAGES, TINY, TINY_BATCH, overrides

    from jaxscale.comm_report import comm_report
    from jaxscale.config import load_config
    from jaxscale_models.foundation import FoundationConfig

    st = dict(STAGES)["2d_a2a"] | {"half_dim": False}
    rep = comm_report(load_config(os.path.join(ROOT, "experiments/configs/foundation_smoke.yaml"), overrides(st, 2, 4)))
    shape = M.Shape(**{**shape_of(FoundationConfig(**TINY), None).__dict__, "batch": TINY_BATCH // 8})
    pred = M.step_bytes(shape, 2, 4, "2d_a2a", st["fwd"], st["bwd"], False)
    got = rep["per_step"]["by_category"]
    for cat in ("emb_ids", "emb_rows", "replica_sync", "dense_grad", "model_gather"):
        g = got.get(cat, {"intra_node": 0.0, "inter_node": 0.0})
        row = {"category": cat, "compiled": (g["intra_node"], g["inter_node"]), "formula": pred[cat]}
        assert agrees(row), row
    assert pred["replica_sync"][1] > 0 and pred["emb_rows"][1] == 0
