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
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import free_port, subprocess_env

from jaxscale.training.config import load_config
from jaxscale.training.data import to_global
from jaxscale.training.trainer import CapacityOverflowError, Trainer

ROOT = Path(__file__).resolve().parent.parent

DLRM = [
    "model.kind=dlrm",
    "model.dlrm.num_sparse_features=2",
    "model.dlrm.rows=512",
    "model.dlrm.emb_dim=8",
    "model.dlrm.bottom_mlp=[8]",
    "model.dlrm.top_mlp=[8]",
    "model.dlrm.num_dense=4",
    "train.batch_size=32",
    "train.eval_every=0",
    "train.log_every=1",
    "train.warmup_steps=1",
    "mesh.nodes=1",
    "mesh.local=8",
]
TINY = [
    "model.foundation.item_rows=2000",
    "model.foundation.d_model=32",
    "model.foundation.num_layers=1",
    "model.foundation.num_heads=2",
    "model.foundation.mlp_ratio=2",
    "model.foundation.max_seq_len=16",
    "model.foundation.item_dim=16",
    "train.batch_size=32",
    "train.eval_every=0",
    "train.log_every=1",
    "train.warmup_steps=2",
    "data.eval_batches=0",
]
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


def fresh(trainer, tmp_path, name, data):
    trainer.workdir = tmp_path / name
    trainer.data = data
    return trainer


# ------------------------------------------------------------------------------------------------ numerical safety


@pytest.mark.parametrize(
    "key,bad", [("dense", np.nan), ("dense", np.inf), ("label", np.nan)], ids=["dense-nan", "dense-inf", "label-nan"]
)
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
        with pytest.raises(
            FloatingPointError,
            match=r"non-finite loss or gradient at step 1 \(loss=(nan|inf)\); "
            r"the update was not applied",
        ):
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


# (overrides, capacity factor): the factor fits the ordinary batches and not the skewed one, whose rows all
# live on shard 0 (a factor >= the shard count would be the worst case, which never overflows).
LAYOUTS = {
    "1x8-1d": (["mesh.nodes=1", "mesh.local=8", "embedding.topology=1d"], 4.0),
    "2x4-2d_a2a": (["mesh.nodes=2", "mesh.local=4", "embedding.topology=2d_a2a"], 2.0),
    "4x2-2d_a2a": (["mesh.nodes=4", "mesh.local=2", "embedding.topology=2d_a2a"], 1.5),
    "2x4-2d_ar": (["mesh.nodes=2", "mesh.local=4", "embedding.topology=2d_ar"], 1.5),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_pair(request, tmp_path_factory):
    """(exact-capacity trainer, capacity_factor=4 trainer) of the tiny DLRM on one mesh/topology."""
    over, cf = LAYOUTS[request.param]
    wd = tmp_path_factory.mktemp(request.param)
    exact = Trainer(load_config(None, DLRM + over + [f"train.workdir={wd / 'exact'}"]), progress=False)
    small = load_config(None, DLRM + over + [f"embedding.capacity_factor={cf}", f"train.workdir={wd / 'cf'}"])
    return request.param, exact, Trainer(small, progress=False)


def _expected_overflow(tr, host_batch) -> int:
    """Unique rows that do not fit the trainer's fixed capacities, counted by brute force from the plan."""
    from capacity_reference import dropped

    from jaxscale.engine.embedding import capacity

    ids = tr.spec.ids(tr.model_cfg, host_batch)
    devices = tr.mesh.size
    shapes = {f: (x.shape[0] // devices, x.shape[1]) for f, x in ids.items()}
    ec = tr.ec
    caps = capacity.static_capacities(
        ec.layout,
        ec.feature_table,
        ec.topology,
        shapes,
        ec.settings.pooled_comm,
        ec.settings.capacity_factor,
        ec._exact_sync,
    )
    partial = capacity.pair_features(
        ec.layout, ec.feature_table, tuple(ids), {f: x.shape[1] for f, x in ids.items()}, ec.settings.pooled_comm
    )
    return dropped(ec, ids, caps, partial)


def test_overflow_error_counts_and_applies_nothing(layout_pair, tmp_path):
    """On every mesh/topology the reported overflow is the number of rows really dropped (each device counts
    its own requests; nothing is divided by the replica count), the step is refused and nothing applied."""
    name, _, tr = layout_pair
    src, spy = tr.data, Spy(tr)
    expected = _expected_overflow(tr, skewed({k: np.array(v) for k, v in src.batch(1).items()}))
    assert expected > 0
    try:
        fresh(tr, tmp_path, "error", Patched(src, {1: skewed}))
        with pytest.raises(
            CapacityOverflowError,
            match=rf"step 1: {expected} looked-up rows did not fit the all-to-all "
            rf"capacity \(embedding.capacity_factor={tr.ec.settings.capacity_factor}\); the step was not applied",
        ):
            tr.run(steps=3)
    finally:
        spy.remove()
        tr.data = src
    before, after, m = spy.calls[-1]
    assert m["overflow"] == expected and m["nonfinite"] == 0, name
    assert_trees_equal(before, after, skip=("['step']",))  # not even 'skipped' moved: overflow is not a NaN


def test_overflow_grow_reruns_the_step_and_matches_exact_capacity(layout_pair, tmp_path, capsys):
    name, exact_tr, tr = layout_pair
    src_exact, src = exact_tr.data, tr.data
    expected = _expected_overflow(tr, skewed({k: np.array(v) for k, v in src.batch(1).items()}))
    with_train(tr, overflow_policy="grow")
    try:
        fresh(tr, tmp_path, "grow", Patched(src, {1: skewed}))
        grown = tr.run(steps=3)
        fresh(exact_tr, tmp_path, "exact", Patched(src_exact, {1: skewed}))
        exact = exact_tr.run(steps=3)
    finally:
        tr.data, exact_tr.data = src, src_exact
    out = capsys.readouterr().out
    assert f"all-to-all overflow ({expected} rows); growing capacity_factor" in out, out
    assert tr.ec.settings.capacity_factor is None or tr.ec.settings.capacity_factor > LAYOUTS[name][1]
    assert grown["steps"] == [1, 2, 3] and grown["losses"] == exact["losses"], name
    log = [m for m in read_metrics(tmp_path / "grow") if "loss" in m]
    assert [m["step"] for m in log] == [1, 2, 3] and all(m["overflow"] == 0 for m in log)
    # nothing lost: tables, optimizer slots, dense params, every counter
    assert_trees_equal(host_tree(grown["final_state"]), host_tree(exact["final_state"]))


@pytest.mark.parametrize(
    "over",
    [
        ["mesh.nodes=1", "mesh.local=8", "embedding.topology=1d"],
        ["mesh.nodes=2", "mesh.local=4", "embedding.topology=2d_a2a", "embedding.replica_sync=periodic"],
    ],
    ids=["1x8-1d", "2x4-2d_a2a-periodic"],
)
def test_reused_capacities_rerun_an_overflowing_step_counted_and_match_counting_every_batch(over, tmp_path):
    """embedding.reuse_capacities: step 1's batch (every id on one shard) does not fit the capacities
    counted for step 0, so its attempt is skipped and re-run counted; losses and the whole final state equal
    a run that counts every batch. Step 2 reuses the grown capacities without counting."""
    trainers = {
        r: Trainer(
            load_config(None, DLRM + over + [f"embedding.reuse_capacities={r}", f"train.workdir={tmp_path / r}"]),
            progress=False,
        )
        for r in ("true", "false")
    }
    for tr in trainers.values():
        tr.data = Patched(tr.data, {1: skewed})
    reused, counted = (trainers[r].run(steps=3) for r in ("true", "false"))
    assert trainers["true"].reruns == 1 and trainers["false"].reruns == 0
    assert reused["steps"] == [1, 2, 3] and reused["losses"] == counted["losses"]
    assert all(m["overflow"] == 0 for m in read_metrics(tmp_path / "true") if "loss" in m)
    assert_trees_equal(host_tree(reused["final_state"]), host_tree(counted["final_state"]))


def test_reused_capacities_refuse_the_exact_replica_sync(tmp_path):
    over = ["mesh.nodes=2", "mesh.local=4", "embedding.topology=2d_a2a", "embedding.reuse_capacities=true"]
    with pytest.raises(
        ValueError, match="reuse_capacities=True cannot run the exact replica sync of topology '2d_a2a'"
    ):
        Trainer(load_config(None, DLRM + over + [f"train.workdir={tmp_path}"]), progress=False)


# ------------------------------------------------------------------------------------------------ subprocesses


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    return subprocess_env(tmp_path_factory.mktemp("jax_cache"))


class Cli:
    """`python -m jaxscale.train ARGS` in the background, output to a log file."""

    def __init__(self, args, env, log: Path):
        self.args, self.log = [str(a) for a in args], log
        self.f = open(log, "w")
        self.p = subprocess.Popen(
            [sys.executable, "-m", "jaxscale.train", *self.args],
            cwd=ROOT,
            env=env,
            stdout=self.f,
            stderr=subprocess.STDOUT,
        )
        self.t0 = time.monotonic()

    def text(self) -> str:
        if not self.f.closed:
            self.f.flush()
        lines = [ln for ln in self.log.read_text().splitlines() if not ln.startswith("[Gloo]")]
        return "\n".join(lines[-60:])

    def wait(self, timeout=RUN_TIMEOUT_S) -> int:
        try:
            rc = self.p.wait(max(1.0, timeout - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            pytest.fail(f"{' '.join(self.args)}: still running after {timeout} s (killed)\n{self.text()}")
        self.f.close()
        return rc

    def expect(self, rc=0):
        got = self.wait()
        assert got == rc, f"{' '.join(self.args)}: exit {got}, expected {rc}\n{self.text()}"

    def stop(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self.f.close()


def _steps_logged(workdir) -> list[int]:
    path = Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for ln in path.read_text().splitlines():
        try:
            out.append(json.loads(ln)["step"])
        except (ValueError, KeyError):
            pass  # a line being written
    return out


def _checkpoints(workdir):
    d = Path(workdir) / "checkpoints"
    names = os.listdir(d) if d.exists() else []
    return sorted(int(n) for n in names if n.isdigit()), sorted(n for n in names if "tmp" in n)


def _wait_for(cli, cond, what, timeout=RUN_TIMEOUT_S, poll=0.002):
    while not cond():
        if cli.p.poll() is not None:
            pytest.fail(f"{' '.join(cli.args)} exited {cli.p.returncode} before {what}\n{cli.text()}")
        if time.monotonic() - cli.t0 > timeout:
            cli.stop()
            pytest.fail(f"{' '.join(cli.args)}: no {what} within {timeout} s\n{cli.text()}")
        time.sleep(poll)


def _listening_inodes(pid) -> set:
    """Inodes of the TCP sockets process `pid` listens on (state 0A in /proc/net/tcp*)."""
    own = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            own.add(link[8:-1])
    listening = {}
    for table in ("tcp", "tcp6"):
        for ln in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = ln.split()
            if cols[3] == "0A":
                listening[cols[9]] = int(cols[1].rsplit(":", 1)[1], 16)
    return {port for inode, port in listening.items() if inode in own}


def _read_state(step_dir: Path) -> dict:
    """A checkpoint's state as {path: numpy}, with unpickling made impossible (it must not be needed)."""
    import orbax.checkpoint as ocp

    def refuse(*a, **k):
        raise AssertionError("a checkpoint restore tried to unpickle")

    saved = pickle.load, pickle.loads, pickle.Unpickler
    pickle.load = pickle.loads = pickle.Unpickler = refuse
    try:
        with ocp.StandardCheckpointer() as c:
            return host_tree(c.restore(step_dir / "state"))
    finally:
        pickle.load, pickle.loads, pickle.Unpickler = saved


def _assert_no_pickle(root: Path):
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files
    for p in files:
        assert p.suffix not in (".pkl", ".pickle", ".pk", ".p"), p
        head = p.read_bytes()[:2]
        assert not (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5), f"{p} looks like a pickle"


def _losses(workdir) -> dict:
    """{step: [loss of every time this step was logged]} (a resumed run re-does steps after its checkpoint)."""
    out = {}
    for m in read_metrics(workdir):
        if "loss" in m:
            out.setdefault(m["step"], []).append(m["loss"])
    return out


CRASH_STEPS = 40


@pytest.mark.slow  # three CLI runs killed and resumed (~75 s)
def test_sigkill_mid_save_then_sigterm_then_resume_is_bit_exact(cli_env, tmp_path):
    """SIGKILL at a random step, aimed at a moment a checkpoint is being written; resume (the partial
    checkpoint is ignored, the last complete one used); SIGTERM the resumed run (it saves and exits 0);
    resume again to the end. Every logged loss and the final state equal an uninterrupted run bit for bit."""
    args = TINY + ["train.checkpoint_every=2", "train.keep_checkpoints=3", "--steps", CRASH_STEPS, "--no-progress"]
    straight = Cli(args + ["--workdir", tmp_path / "straight"], cli_env, tmp_path / "straight.log")
    wd = tmp_path / "crash"
    crash = Cli(args + ["--workdir", wd], cli_env, tmp_path / "crash.log")  # runs alongside `straight`
    kill_at = random.Random(20240611).randint(6, 24)
    try:
        _wait_for(crash, lambda: len(_steps_logged(wd)) >= 1, "a first step")
        ports = _listening_inodes(crash.p.pid)  # single process: no port is opened at all
        _wait_for(
            crash,
            lambda: (
                len(_steps_logged(wd)) >= kill_at and (_checkpoints(wd)[1] or len(_steps_logged(wd)) >= kill_at + 8)
            ),
            f"step {kill_at}",
        )
        crash.p.send_signal(signal.SIGKILL)
        assert crash.wait() == -signal.SIGKILL
    finally:
        crash.stop()
    assert ports == set(), f"a single-process run listens on TCP ports {ports}"
    complete, partial = _checkpoints(wd)
    assert complete and max(_steps_logged(wd)) < CRASH_STEPS
    last = max(complete)
    if not partial:  # the kill missed the save window: leave a partial checkpoint the way a kill would
        import shutil

        shutil.copytree(wd / "checkpoints" / str(last), wd / "checkpoints" / f"{last + 2}.orbax-checkpoint-tmp-1")
        (wd / "checkpoints" / f"{last + 2}.orbax-checkpoint-tmp-1" / "state" / "manifest.ocdbt").write_bytes(b"torn")
    straight.expect(0)

    logged = len(_steps_logged(wd))
    resumed = Cli(args + ["--workdir", wd, "--resume"], cli_env, tmp_path / "resumed.log")
    _wait_for(resumed, lambda: len(_steps_logged(wd)) > logged + 1, "a resumed step")
    resumed.p.send_signal(signal.SIGTERM)
    resumed.expect(0)  # SIGTERM: save and exit 0
    steps = _steps_logged(wd)
    assert steps[logged] == last + 1, f"resumed from step {steps[logged] - 1}, not the last complete checkpoint {last}"
    stopped = steps[-1]
    assert stopped < CRASH_STEPS and max(_checkpoints(wd)[0]) == stopped, "SIGTERM did not stop with a checkpoint"

    Cli(args + ["--workdir", wd, "--resume"], cli_env, tmp_path / "final.log").expect(0)
    steps = _steps_logged(wd)
    assert steps[-1] == CRASH_STEPS and steps[len(steps) - (CRASH_STEPS - stopped)] == stopped + 1

    ref, got = _losses(tmp_path / "straight"), _losses(wd)
    assert sorted(ref) == list(range(1, CRASH_STEPS + 1)) and sorted(got) == sorted(ref)
    for s, losses in got.items():  # steps re-done after the kill included
        assert all(v == ref[s][0] for v in losses), (s, losses, ref[s])
    a = _read_state(tmp_path / "straight" / "checkpoints" / str(CRASH_STEPS))
    b = _read_state(wd / "checkpoints" / str(CRASH_STEPS))
    assert int(a["['step']"]) == CRASH_STEPS
    assert_trees_equal(a, b)
    _assert_no_pickle(tmp_path / "straight" / "checkpoints")


def _two_processes(args, env, tmp_path, tag):
    port = free_port()
    mp = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", 2, "mesh.nodes=2", "mesh.local=4"]
    return port, [Cli(args + mp + ["--process-id", i], env, tmp_path / f"{tag}{i}.log") for i in range(2)]


@pytest.mark.slow  # two 2-process CLI runs (~65 s)
def test_dead_peer_ends_the_survivor_with_an_error_then_both_resume(cli_env, tmp_path):
    """2 processes x 4 devices; SIGKILL process 1 mid-run: process 0 (the coordinator) exits non-zero within
    DEAD_PEER_BOUND_S, not hanging in a collective or a checkpoint barrier (JAXSCALE_HEARTBEAT_TIMEOUT_S=10
    here; the default is 30 s). Relaunching both with --resume continues from the last complete checkpoint
    and re-does the lost steps exactly."""
    env = dict(cli_env, JAXSCALE_HEARTBEAT_TIMEOUT_S="10")
    wd = tmp_path / "mp"
    args = TINY + ["train.checkpoint_every=2", "--workdir", wd, "--no-progress"]
    port, procs = _two_processes(args + ["--steps", 100000], env, tmp_path, "first")
    try:
        _wait_for(procs[0], lambda: len(_steps_logged(wd)) >= 4 and _checkpoints(wd)[0], "4 steps and a checkpoint")
        ports = _listening_inodes(procs[0].p.pid)
        peer_ports = _listening_inodes(procs[1].p.pid)
        procs[1].p.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rc = procs[0].wait(timeout=(t0 - procs[0].t0) + DEAD_PEER_BOUND_S)
        waited = time.monotonic() - t0
    finally:
        for c in procs:
            c.stop()
    log = procs[0].log.read_text()
    assert rc != 0 and waited < DEAD_PEER_BOUND_S, (rc, waited, log[-6000:])
    assert re.search(r"Task 1 heartbeat timeout|tasks are unhealthy \(stopped sending heartbeats\):\s*1", log), log[
        -6000:
    ]
    # What listens (docs/training.md, "On N hosts"): the explicit coordinator port, on process 0 only; besides it only
    # the CPU collectives' transport (gloo), on ports the kernel picks from its ephemeral range.
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert port in ports and port not in peer_ports, (port, ports, peer_ports)
    others = (ports - {port}) | peer_ports
    assert all(low <= p <= high for p in others), (sorted(others), (low, high))

    complete, _ = _checkpoints(wd)
    last, before = max(complete), _losses(wd)
    assert max(before) > last  # steps after the last checkpoint were lost and must be re-done
    logged = len(_steps_logged(wd))
    _, procs = _two_processes(args + ["--steps", last + 3, "--resume"], env, tmp_path, "again")
    try:
        for c in procs:
            c.expect(0)
    finally:
        for c in procs:
            c.stop()
    steps = _steps_logged(wd)[logged:]
    assert steps == [last + 1, last + 2, last + 3], steps
    after = _losses(wd)
    for s in steps:
        if s in before:
            assert after[s][-1] == before[s][0], (s, after[s], before[s])
    assert max(_checkpoints(wd)[0]) == last + 3


def test_python_yaml_tags_are_refused_by_the_cli(cli_env, tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.yaml"
    evil.write_text(f'train: !!python/object/apply:os.system ["touch {marker}"]\n')
    p = subprocess.run(
        [sys.executable, "-m", "jaxscale.train", "--config", str(evil)],
        cwd=ROOT,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert p.returncode == 2 and "config error" in p.stderr and "safe" in p.stderr, p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "jaxscale.train", f'train.workdir=!!python/object/apply:os.system ["touch {marker}"]'],
        cwd=ROOT,
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert p.returncode == 2 and "train.workdir" in p.stderr, p.stderr
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ launch errors


def test_mesh_that_does_not_fit_the_processes(monkeypatch):
    cfg = load_config(None, DLRM)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(
        ValueError, match="mesh.nodes=1 but 2 processes are running; in a multi-process run each process is one node"
    ):
        Trainer(cfg, progress=False)


def test_incomplete_or_impossible_launch_is_refused(monkeypatch):
    from jaxscale.infra import distributed

    for k in list(os.environ):
        if k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAXSCALE_", "SLURM_")):
            monkeypatch.delenv(k)
    with pytest.raises(ValueError, match="multi-process launch needs number of processes, process id"):
        distributed.resolve("127.0.0.1:1234")
    with pytest.raises(ValueError, match=r"process id 2 is outside \[0, 2\)"):
        distributed.resolve("127.0.0.1:1234", 2, 2)
    with pytest.raises(ValueError, match="number of processes must be >= 1, got 0"):
        distributed.resolve(None, 0, 0)
    assert distributed.resolve(None, None, None) == (None, 1, 0, "single")
    monkeypatch.setenv("JAXSCALE_HEARTBEAT_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="JAXSCALE_HEARTBEAT_TIMEOUT_S must be a whole number of seconds, got 'soon'"):
        distributed.initialize()
    with pytest.raises(ValueError, match="heartbeat timeout must be >= 1 s, got 0"):
        distributed.initialize(heartbeat_timeout_s=0)
