"""Parity with TorchRec (the baseline jaxscale replaces).

The TorchRec side runs in a fresh interpreter (`jaxscale.benchmarks.torchrec_runner`: DMP over gloo on
127.0.0.1, FBGEMM fused TBE optimizers), never in this JAX process. One subprocess runs every TorchRec
configuration, so torch/torchrec are imported once. The reference is `jaxscale.engine.reference` (the one NumPy
reference of FBGEMM semantics).

Checked, float32, rtol=1e-5 / atol=1e-6:
  * TorchRec (world size 1, and 2 gloo ranks row_wise / table_wise) == NumPy reference of FBGEMM semantics
    (lookup outputs of every step, tables after 5 steps of EXACT_SGD and EXACT_ROWWISE_ADAGRAD).
  * TorchRec column_wise + row-wise AdaGrad == the reference with one accumulator per column shard (TorchRec
    semantics: the accumulator is the mean of g^2 over the shard's columns only, not the whole row).
  * jaxscale == TorchRec: pooled sum, pooled mean (with a table shared by two features, empty bags,
    duplicate ids, a row count that does not divide the shards) and sequence lookups; tables and per-step
    outputs over 5 steps of SGD and of row-wise AdaGrad (same loss gradient G every step).

Install TorchRec with `bash experiments/baselines/install_torchrec.sh` (venv active).
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest

from jaxscale.benchmarks import torchrec_runner as runner  # NumPy at import time; torch only in its subprocess
from jaxscale.engine import reference
from jaxscale.engine.tables import TableConfig


def _torchrec_importable() -> bool:
    # find_spec only: importing torch into the JAX test process is exactly what we avoid.
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "torchrec", "fbgemm_gpu"))


pytestmark = pytest.mark.skipif(
    not _torchrec_importable(),
    reason="torchrec is not installed (bash experiments/baselines/install_torchrec.sh with the venv active)",
)

RTOL, ATOL = 1e-5, 1e-6
STEPS = 5
B, L = 16, 6  # B divisible by the 8 simulated devices and by 2 gloo ranks
LR_SGD, LR_ADAGRAD, EPS = 0.05, 0.05, 1e-8


# name, rows, dim, pooling, features. t_sum is shared by two features; 37 rows do not divide 2 or 8 shards.
TABLES = [
    TableConfig("t_sum", 64, 8, "sum", ("a", "b")),
    TableConfig("t_mean", 37, 16, "mean", ("c",)),
    TableConfig("t_seq", 40, 8, None, ("s",)),
]


def _data(seed=0):
    rng = np.random.default_rng(seed)
    weights = {t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in TABLES}
    batches = []
    for _ in range(STEPS):
        b = {}
        for t in TABLES:
            for f in t.features:
                # small id range relative to B*L: many duplicate ids (exact dedup matters for AdaGrad)
                ids = rng.integers(0, t.rows, (B, L))
                keep = rng.random((B, L)) < 0.7  # padding anywhere, not only trailing
                keep[0] = False  # an empty bag / all-padding sequence
                b[f] = np.where(keep, ids, -1).astype(np.int32)
        batches.append(b)
    G = {
        f: rng.normal(size=(B, t.dim) if t.pooling else (B, L, t.dim)).astype(np.float32)
        for t in TABLES
        for f in t.features
    }
    return weights, batches, G


WEIGHTS, BATCHES, G = _data()

# TorchRec configurations: name -> (world_size, sharding, optimizer, lr)
CONFIGS = {
    "ws1-sgd": (1, "row_wise", "sgd", LR_SGD),
    "ws1-adagrad": (1, "row_wise", "rowwise_adagrad", LR_ADAGRAD),
    "ws2-row_wise-sgd": (2, "row_wise", "sgd", LR_SGD),
    "ws2-row_wise-adagrad": (2, "row_wise", "rowwise_adagrad", LR_ADAGRAD),
    "ws2-table_wise-sgd": (2, "table_wise", "sgd", LR_SGD),
    "ws2-table_wise-adagrad": (2, "table_wise", "rowwise_adagrad", LR_ADAGRAD),
    "ws2-column_wise-adagrad": (2, "column_wise", "rowwise_adagrad", LR_ADAGRAD),
}


@pytest.fixture(scope="module")
def torchrec_results():
    jobs = [
        dict(
            tables=TABLES,
            weights=WEIGHTS,
            batches=BATCHES,
            grads=G,
            world_size=ws,
            sharding=sh,
            optimizer=opt,
            lr=lr,
            eps=EPS,
            timeout_s=240,
        )
        for ws, sh, opt, lr in CONFIGS.values()
    ]
    results = runner.run_torchrec_subprocess(jobs=jobs, timeout_s=600)
    return dict(zip(CONFIGS, results))


def _reference(optimizer, lr, col_blocks=1):
    col_parts = {t.name: col_blocks for t in TABLES} if col_blocks > 1 else None
    return reference.train(WEIGHTS, TABLES, BATCHES, G, optimizer=optimizer, lr=lr, eps=EPS, col_parts=col_parts)


def _assert_same(got, want, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL, err_msg=what)


def _assert_run_matches(got, want, label):
    assert len(got["outputs"]) == len(want["outputs"]) == STEPS
    for s in range(STEPS):
        for f in want["outputs"][s]:
            _assert_same(got["outputs"][s][f], want["outputs"][s][f], f"{label}: step {s} output {f}")
    for name in want["tables"]:
        _assert_same(got["tables"][name], want["tables"][name], f"{label}: table {name} after {STEPS} steps")


def test_reference_sanity():
    """The data exercises what it should: empty bags, duplicates, padding in the middle."""
    ids = BATCHES[0]["a"]
    assert (ids[0] == -1).all()
    valid = ids[ids >= 0]
    assert len(np.unique(valid)) < len(valid)
    assert ((ids[:, :-1] == -1) & (ids[:, 1:] >= 0)).any()
    ref = _reference("sgd", LR_SGD)
    assert ref["outputs"][0]["a"].shape == (B, 8) and ref["outputs"][0]["s"].shape == (B, L, 8)
    np.testing.assert_array_equal(ref["outputs"][0]["c"][0], 0)  # empty mean bag -> zeros


@pytest.mark.parametrize("config", list(CONFIGS))
def test_torchrec_matches_numpy_reference(torchrec_results, config):
    res = torchrec_results[config]
    assert "error" not in res, res.get("error")
    ws, sharding, optimizer, lr = CONFIGS[config]
    col_blocks = ws if sharding == "column_wise" and optimizer == "rowwise_adagrad" else 1
    _assert_run_matches(res, _reference(optimizer, lr, col_blocks), f"TorchRec {config}")


def test_torchrec_column_wise_adagrad_differs_from_unsharded(torchrec_results):
    """TorchRec's column_wise row-wise AdaGrad keeps one accumulator per column shard (documented finding)."""
    res = torchrec_results["ws2-column_wise-adagrad"]
    full = _reference("rowwise_adagrad", LR_ADAGRAD)
    assert not np.allclose(res["tables"]["t_sum"], full["tables"]["t_sum"], rtol=RTOL, atol=ATOL)


def test_torchrec_runner_counts_collectives(torchrec_results):
    res = torchrec_results["ws2-row_wise-sgd"]
    step0 = res["comm"][0][0]  # rank 0, step 0
    assert any(k.startswith("all_to_all_single[int64]") for k in step0), step0  # ids (KJTAllToAll)
    assert any(k.startswith("reduce_scatter") for k in step0), step0  # row-wise pooled outputs
    assert all(len(t) == STEPS for t in res["step_times"])
    assert not torchrec_results["ws1-sgd"]["comm"][0][0]  # world size 1: no collectives


# ------------------------------------------------------------------------------------- jaxscale side
@functools.cache  # each jaxscale run compiles; the lookup test reuses step 0 of training
def _jaxscale_run(sharding, optimizer, steps=STEPS, mesh_shape=(1, 8)):
    import jaxscale

    mesh = jaxscale.make_mesh(*mesh_shape)
    opt = jaxscale.SGD(LR_SGD) if optimizer == "sgd" else jaxscale.RowWiseAdagrad(LR_ADAGRAD, eps=EPS)
    ec = jaxscale.EmbeddingCollection(
        TABLES, mesh, jaxscale.EmbeddingSettings(topology="1d", sharding=sharding, optimizer=opt)
    )
    state = ec.from_dense(WEIGHTS)
    outputs = []
    for s in range(steps):
        out = ec.lookup(state, BATCHES[s])
        outputs.append({f: np.asarray(v) for f, v in out.items()})
        state = ec.update(state, BATCHES[s], G)
    return {"outputs": outputs, "tables": ec.to_dense(state)}


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_jaxscale_lookup_matches_torchrec(torchrec_results, sharding):
    """Pooled sum, pooled mean and sequence lookups: same weights, same ids, same outputs."""
    got = _jaxscale_run(sharding, "sgd")["outputs"][0]
    for config in ("ws1-sgd", f"ws2-{sharding}-sgd"):
        want = torchrec_results[config]["outputs"][0]
        assert set(got) == set(want)
        for f in want:
            assert got[f].shape == want[f].shape, (f, got[f].shape, want[f].shape)
            _assert_same(got[f], want[f], f"jaxscale {sharding} vs TorchRec {config}: lookup {f}")


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_jaxscale_training_matches_torchrec(torchrec_results, optimizer):
    """5 steps of the fused optimizer: per-step outputs and final tables equal TorchRec's (2 gloo ranks)."""
    short = "sgd" if optimizer == "sgd" else "adagrad"
    got = _jaxscale_run("row_wise", optimizer)
    _assert_run_matches(got, torchrec_results[f"ws2-row_wise-{short}"], f"jaxscale row_wise vs TorchRec {optimizer}")
    got_tw = _jaxscale_run("table_wise", optimizer)
    _assert_run_matches(
        got_tw, torchrec_results[f"ws2-table_wise-{short}"], f"jaxscale table_wise vs TorchRec {optimizer}"
    )
