"""Reliability: bad numbers never reach the tables, capacity overflow is never silent, a killed run resumes
bit for bit, a dead peer process ends the survivors with an error in bounded time, configs and checkpoints
are loaded without executing code. docs/reliability.md maps every fault to the test that shows it.

In-process tests use a tiny DLRM on conftest's 8 simulated devices (one compile per Trainer; policies are
switched on the same Trainer so the compiled step is reused). End-to-end tests run `python -m jaxscale.train`
as subprocesses on a tiny foundation model; they share one persistent compilation cache, use XLA:CPU
optimisation level 0 (compile time dominates) and never inherit conftest's 8-device XLA flag.
"""

import dataclasses
import json
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxscale.config import load_config
from jaxscale.data import to_global
from jaxscale.trainer import CapacityOverflowError, Trainer

ROOT = Path(__file__).resolve().parent.parent

DLRM = ["model.kind=dlrm", "model.dlrm.num_sparse_features=2", "model.dlrm.rows=512", "model.dlrm.emb_dim=8",
        "model.dlrm.bottom_mlp=[8]", "model.dlrm.top_mlp=[8]", "model.dlrm.num_dense=4", "train.batch_size=32",
        "train.eval_every=0", "train.log_every=1", "train.warmup_steps=1", "mesh.nodes=1", "mesh.local=8"]
TINY = ["model.foundation.item_rows=2000", "model.foundation.d_model=32", "model.foundation.num_layers=1",
        "model.foundation.num_heads=2", "model.foundation.mlp_ratio=2", "model.foundation.max_seq_len=16",
        "model.foundation.item_dim=16", "train.batch_size=32", "train.eval_every=0", "train.log_every=1",
        "train.warmup_steps=2", "data.eval_batches=0"]
RUN_TIMEOUT_S = 240  # one CLI run, compile included, on a busy 2-core machine
DEAD_PEER_BOUND_S = 90  # a survivor of a killed peer must have exited (non-zero) within this


# ------------------------------------------------------------------------------------------------ helpers


def host_tree(tree) -> dict:
    """{path: numpy copy} of every leaf (PRNG keys as their key data): taken before a donated step."""
    def leaf(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.array(x)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): leaf(v) for p, v in flat}


def assert_trees_equal(a: dict, b: dict, skip=()):
    assert sorted(a) == sorted(b)
    for k in a:
        if any(s in k for s in skip):
            continue
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


class Patched:
    """A data source that replaces chosen steps' batches: {step: fn(batch) -> batch}."""

    def __init__(self, source, edits):
        self.source, self.edits = source, edits

    def batch(self, step):
        b = {k: np.array(v) for k, v in self.source.batch(step).items()}
        return self.edits[step](b) if step in self.edits else b


def with_train(trainer, **kw):
    trainer.cfg = dataclasses.replace(trainer.cfg, train=dataclasses.replace(trainer.cfg.train, **kw))


class Spy:
    """Wraps trainer.train_step: records (state before, state after, metrics) of every call as host copies."""

    def __init__(self, trainer):
        self.trainer, self.calls, self.orig = trainer, [], trainer.train_step
        trainer.train_step = self

    def __call__(self, state, batch):
        before = host_tree(state)
        new_state, metrics = self.orig(state, batch)
        self.calls.append((before, host_tree(new_state), {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}))
        return new_state, metrics

    def remove(self):
        del self.trainer.train_step


def read_metrics(workdir) -> list[dict]:
    path = Path(workdir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def skewed(b):
    """Every id is a distinct multiple of 8: all of them live on shard 0 (row-wise puts row r on shard r % 8)."""
    for f in ("sparse_0", "sparse_1"):
        b[f] = (8 * np.arange(b[f].size, dtype=np.int32)).reshape(b[f].shape)
    return b


def poison(value, key="dense"):
    def edit(b):
        b[key][(3, 1) if b[key].ndim == 2 else 3] = value
        return b
    return edit


@pytest.fixture(scope="module")
def dlrm(tmp_path_factory):
    cfg = load_config(None, DLRM + [f"train.workdir={tmp_path_factory.mktemp('dlrm')}"])
    return Trainer(cfg, progress=False)


@pytest.fixture(scope="module")
def dlrm_overflow(tmp_path_factory):
    """Capacity 4x the uniform share: 4 slots per shard for 8 ids per device, so the skewed batch overflows."""
    cfg = load_config(None, DLRM + ["embedding.capacity_factor=4", f"train.workdir={tmp_path_factory.mktemp('dlrm_cf')}"])
    return Trainer(cfg, progress=False)


def fresh(trainer, tmp_path, name, data):
    trainer.workdir = tmp_path / name
    trainer.data = data
    return trainer


# ------------------------------------------------------------------------------------------------ numerical safety


@pytest.mark.parametrize("key,bad", [("dense", np.nan), ("dense", np.inf), ("label", np.nan)],
                         ids=["dense-nan", "dense-inf", "label-nan"])
def test_nonfinite_input_never_reaches_the_tables(dlrm, key, bad):
    """The step function itself: a NaN/Inf input -> non-finite loss/gradients -> nothing applied."""
    state = dlrm.init_state()
    state, _ = dlrm.train_step(state, dlrm.batch(0))  # a real step first: non-zero optimizer state
    before = host_tree(state)
    batch = poison(bad, key)({k: np.array(v) for k, v in dlrm.data.batch(1).items()})
    state, m = dlrm.train_step(state, to_global(batch, dlrm.mesh))
    after = host_tree(state)
    assert int(m["nonfinite"]) == 1 and not np.isfinite(float(m["loss"]))
    assert int(after["['skipped']"]) == 1 and int(after["['step']"]) == 2
    # tables, optimizer slots, dense params and optimizer state: bit-identical (only step counters move)
    assert_trees_equal(before, after, skip=("['step']", "['skipped']"))
    state, m = dlrm.train_step(state, dlrm.batch(2))  # the next good step trains again
    assert int(m["nonfinite"]) == 0 and np.isfinite(float(m["loss"]))
    moved = host_tree(state)
    assert not np.array_equal(moved["['emb']['weights']['w8']"], after["['emb']['weights']['w8']"])
    assert any(not np.array_equal(moved[k], after[k]) for k in moved if k.startswith("['dense']"))


def test_negative_infinite_dense_feature_is_clamped_like_zero(dlrm):
    """DLRM preprocesses dense features with log1p(max(x, 0)): -inf (like any negative) is read as 0."""
    losses = []
    for value in (-np.inf, 0.0):
        batch = poison(value)({k: np.array(v) for k, v in dlrm.data.batch(1).items()})
        _, m = dlrm.train_step(dlrm.init_state(), to_global(batch, dlrm.mesh))
        assert int(m["nonfinite"]) == 0
        losses.append(float(m["loss"]))
    assert np.isfinite(losses[0]) and losses[0] == losses[1]


def test_nonfinite_policy_skip_counts_and_is_a_no_op(dlrm, tmp_path):
    """policy 'skip': the run goes on; the step is counted in metrics ('nonfinite', 'skipped_total') and in the
    state ('skipped'), and the result equals a run that never saw that batch."""
    with_train(dlrm, nonfinite_policy="skip")
    src = dlrm.data
    try:
        fresh(dlrm, tmp_path, "nan", Patched(src, {2: poison(np.nan)}))
        out = dlrm.run(steps=4)
        with_nan = host_tree(out["final_state"])
        log = {m["step"]: m for m in read_metrics(tmp_path / "nan") if "loss" in m}
        assert [log[s]["nonfinite"] for s in (1, 2, 3, 4)] == [0, 0, 1, 0]
        assert log[3]["loss"] is None  # NaN is logged as null (valid JSON)
        assert [log[s]["skipped_total"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
        assert int(with_nan["['skipped']"]) == 1
        # the same run without the bad batch: steps 0, 1, then the batch of step 3
        fresh(dlrm, tmp_path, "clean", Patched(src, {2: lambda b: src.batch(3)}))
        clean = host_tree(dlrm.run(steps=3)["final_state"])
        assert_trees_equal(with_nan, clean, skip=("['step']", "['skipped']"))
    finally:
        dlrm.data = src


def test_nonfinite_policy_raise_names_the_step_and_applies_nothing(dlrm, tmp_path):
    with_train(dlrm, nonfinite_policy="raise")
    src, spy = dlrm.data, Spy(dlrm)
    try:
        fresh(dlrm, tmp_path, "raise", Patched(src, {1: poison(np.inf)}))
        with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient at step 1 \(loss=(nan|inf)\); "
                                                     r"the update was not applied"):
            dlrm.run(steps=3)
    finally:
        spy.remove()
        dlrm.data = src
        with_train(dlrm, nonfinite_policy="skip")
    assert len(spy.calls) == 2  # steps 0 and 1; step 2 never ran
    before, after, m = spy.calls[1]
    assert m["nonfinite"] == 1
    assert_trees_equal(before, after, skip=("['step']", "['skipped']"))


# ------------------------------------------------------------------------------------------------ capacity overflow


def test_overflow_error_counts_and_applies_nothing(dlrm_overflow, tmp_path):
    tr = dlrm_overflow
    src, spy = tr.data, Spy(tr)
    try:
        fresh(tr, tmp_path, "error", Patched(src, {1: skewed}))
        # both tables share one stack: 2 x 8 distinct rows per device, all for shard 0, whose capacity is
        # 2 x ceil(4 x 8 / 8) = 8 slots: 8 rows dropped on each of the 8 devices
        with pytest.raises(CapacityOverflowError, match=r"step 1: 64 looked-up rows did not fit the all-to-all "
                                                        r"capacity \(embedding.capacity_factor=4.0\); the step was not applied"):
            tr.run(steps=3)
    finally:
        spy.remove()
        tr.data = src
    before, after, m = spy.calls[-1]
    assert m["overflow"] == 64 and m["nonfinite"] == 0
    assert_trees_equal(before, after, skip=("['step']",))  # not even 'skipped' moved: overflow is not a NaN


def test_overflow_grow_reruns_the_step_and_matches_exact_capacity(dlrm, dlrm_overflow, tmp_path, capsys):
    tr = dlrm_overflow
    src_exact, src = dlrm.data, tr.data
    with_train(tr, overflow_policy="grow")
    try:
        fresh(tr, tmp_path, "grow", Patched(src, {1: skewed}))
        grown = tr.run(steps=3)
        fresh(dlrm, tmp_path, "exact", Patched(src_exact, {1: skewed}))
        exact = dlrm.run(steps=3)
    finally:
        tr.data, dlrm.data = src, src_exact
    assert "all-to-all overflow (64 rows); growing capacity_factor 4.0 -> None" in capsys.readouterr().out
    assert tr.ec.capacity_factor is None
    assert grown["steps"] == [1, 2, 3] and grown["losses"] == exact["losses"]
    log = [m for m in read_metrics(tmp_path / "grow") if "loss" in m]
    assert [m["step"] for m in log] == [1, 2, 3] and all(m["overflow"] == 0 for m in log)
    # nothing lost: tables, optimizer slots, dense params, every counter
    assert_trees_equal(host_tree(grown["final_state"]), host_tree(exact["final_state"]))
