"""jaxscale.comm_report: per-collective bytes of the compiled train step (small DLRM config, 2x4 mesh)."""

import json
import os
import subprocess
import sys

import pytest

from jaxscale.engine.comm_inspect import Collective
from jaxscale.training import comm_report as cr
from jaxscale.training.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "jaxscale", "configs", "dlrm_smoke.yaml")
SMALL = [
    "mesh.nodes=2",
    "mesh.local=4",
    "model.dlrm.num_sparse_features=2",
    "model.dlrm.rows=512",
    "model.dlrm.bottom_mlp=[16]",
    "model.dlrm.top_mlp=[8]",
    "model.dlrm.num_dense=2",
    "train.batch_size=16",
]


def _a2a_rows(rep):
    return [r for r in rep["collectives"] if r["category"] == "emb_rows"]


@pytest.fixture(scope="module")
def fp32_fp8():
    reps = {}
    for prec in ("fp32", "fp8"):
        cfg = load_config(
            CONFIG,
            SMALL + ["embedding.topology=1d", f"embedding.comm.forward={prec}", f"embedding.comm.backward={prec}"],
        )
        reps[prec] = cr.comm_report(cfg)
    return reps


def test_fp8_sends_u8_and_fewer_bytes(fp32_fp8):
    f32, f8 = fp32_fp8["fp32"], fp32_fp8["fp8"]
    assert _a2a_rows(f32) and _a2a_rows(f8)
    assert all(set(r["dtypes"]) == {"u8"} for r in _a2a_rows(f8)), [r["dtypes"] for r in _a2a_rows(f8)]
    assert all(set(r["dtypes"]) == {"f32"} for r in _a2a_rows(f32))
    b32 = sum(r["bytes_per_device"] for r in _a2a_rows(f32))
    b8 = sum(r["bytes_per_device"] for r in _a2a_rows(f8))
    # rows of dim 16: fp32 64 B, fp8 16 + 1 (per-row scale exponent) = 17 B
    assert b8 == pytest.approx(b32 * 17 / 64)
    assert f8["per_step"]["total_bytes_per_device"] < f32["per_step"]["total_bytes_per_device"]
    # 1d on 2x4: an all-to-all sends 3/7 of its bytes to same-node peers, 4/7 across nodes
    for r in _a2a_rows(f32):
        assert r["where"] == "mixed"
        assert r["inter_node"] == pytest.approx(r["bytes_per_device"] * 4 / 7)
    s = f32["per_step"]
    assert s["intra_node_bytes_per_example"] == pytest.approx(s["intra_node_bytes_per_device"] * 8 / 16)
    assert s["intra_node_bytes_per_device"] + s["inter_node_bytes_per_device"] == pytest.approx(
        s["comm_inspect_cross_node"] + s["comm_inspect_intra_node"]
    )


def test_cli_json_2d_a2a_keeps_all_to_all_inside_the_node():
    env = dict(os.environ, XLA_FLAGS="", PYTHONPATH=ROOT)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxscale.comm_report",
            "--config",
            CONFIG,
            *SMALL,
            "embedding.topology=2d_a2a",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout)
    assert rep["config"]["topology"] == "2d_a2a" and rep["config"]["devices"] == 8
    a2a = [r for r in rep["collectives"] if r["kind"] == "all-to-all"]
    assert a2a and all(r["inter_node"] == 0 and r["intra_node"] > 0 for r in a2a)
    assert rep["per_step"]["by_category"]["replica_sync"]["inter_node"] > 0  # replicas live on other nodes


def _coll(kind, groups, result_bytes, bytes_per_device):
    return Collective(
        kind=kind,
        dtypes=("f32",),
        shapes=((1,),),
        group_size=len(groups[0]),
        groups=groups,
        result_bytes=result_bytes,
        bytes_per_device=bytes_per_device,
        cross_node=True,
        name="x",
    )


def test_split_bytes_rules():
    shape = (2, 4)  # positions 0-3 on node 0, 4-7 on node 1
    every = (tuple(range(8)),)
    a = cr.split_bytes(_coll("all-to-all", every, 800, 700), shape)
    assert a == pytest.approx((300, 400))
    r = cr.split_bytes(_coll("all-reduce", every, 800, 1400), shape)
    assert r == pytest.approx((1400 - 2 * 0.5 * 800 / 4, 2 * 0.5 * 800 / 4))
    cols = tuple((i, i + 4) for i in range(4))  # one member per node: everything crosses
    assert cr.split_bytes(_coll("all-gather", cols, 800, 400), shape) == pytest.approx((0, 400))
    rows = ((0, 1, 2, 3), (4, 5, 6, 7))
    assert cr.split_bytes(_coll("all-to-all", rows, 800, 600), shape) == pytest.approx((600, 0))
