"""Early stopping and the best checkpoint (train.eval_metric, eval_mode, early_stopping_patience, keep_best):
a tiny foundation Trainer whose `evaluate` is scripted, so the stop step and the best step are known; the best
checkpoint restores to the state of the best step; a resumed run keeps the best and the patience spent."""

from pathlib import Path

import jax
import numpy as np
import pytest

import jaxscale
from jaxscale.training.config import ConfigError, load_config
from jaxscale.training.trainer import RUN_RECORD, Trainer, _progress, finished_run

TINY = Path(__file__).resolve().parent.parent / "jaxscale" / "configs" / "foundation_tiny.yaml"
BASE = ["train.steps=12", "train.eval_every=2", "train.checkpoint_every=0", "train.log_every=100"]
NDCG = {2: 0.1, 4: 0.3, 6: 0.2, 8: 0.3, 10: 0.35, 12: 0.9}  # ties do not improve
_COMPILED: dict = {}  # one compile of the tiny model's step for the whole module


def _trainer(workdir, *overrides):
    cfg = load_config(str(TINY), BASE + list(overrides))
    tr = Trainer(cfg, jaxscale.make_mesh(cfg.mesh.nodes, cfg.mesh.local), workdir=str(workdir), progress=False)
    tr._executables = _COMPILED  # same model, mesh and layout in every test: reuse the executables
    return tr


def _host_state(tr, state):
    return [np.array(x) for x in jax.tree.leaves(state["dense"])], {
        k: np.array(v) for k, v in tr.ec.to_dense(state["emb"]).items()
    }


@pytest.fixture
def scripted(monkeypatch):
    """Trainer.evaluate returns NDCG[step] (and a loss) and keeps a host copy of the state it saw."""
    seen = {}

    def evaluate(self, state):
        step = int(np.asarray(state["step"]))
        seen[step] = _host_state(self, state)
        return {"eval_loss": 1.0 - NDCG[step], "eval_ndcg@10": NDCG[step]}

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    return seen


def _assert_same(a, b):
    for x, y in zip(a[0], b[0]):
        np.testing.assert_array_equal(x, y)
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        np.testing.assert_array_equal(a[1][k], b[1][k])


def test_stops_when_patience_runs_out_and_restores_the_best(tmp_path, scripted):
    tr = _trainer(tmp_path, "train.eval_metric=eval_ndcg@10", "train.early_stopping_patience=2")
    out = tr.run()
    # evaluations at 2 (best), 4 (best), 6 (worse), 8 (tie: no improvement) -> patience 2 is spent at step 8
    assert out["final_step"] == 8 and out["stopped_early"] and out["stop_reason"] == "early_stopping"
    assert out["best"] == {"step": 4, "eval_ndcg@10": 0.3}
    assert [e["step"] for e in out["eval"]] == [2, 4, 6, 8]
    assert [e["best_step"] for e in out["eval"]] == [2, 4, 4, 4]
    assert tr.best_checkpointer.steps() == [4]  # one best kept, complete
    assert tr.best_record() == {"step": 4, "metric": "eval_ndcg@10", "value": 0.3, "mode": "max"}
    state, step = tr.restore_best()
    assert step == 4 and int(np.asarray(state["step"])) == 4
    _assert_same(_host_state(tr, state), scripted[4])
    assert tr.checkpointer.steps() == [8]  # the last state is saved as usual
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert sum('"best_step": 4' in line for line in lines) == 3
    record = {"final_step": 8, "stop_reason": "early_stopping", "stopped_early": True, "steps": 12}
    assert finished_run(tmp_path) == record | {"best": {"step": 4, "eval_ndcg@10": 0.3}}


def test_min_mode_without_patience_or_best_checkpoint(tmp_path, scripted):
    tr = _trainer(tmp_path, "train.eval_metric=eval_loss", "train.eval_mode=min", "train.keep_best=false")
    out = tr.run()
    assert out["final_step"] == 12 and not out["stopped_early"] and out["stop_reason"] == "steps"
    assert out["best"] == {"step": 12, "eval_loss": pytest.approx(0.1)}
    assert not (tmp_path / "best").exists() and tr.best_checkpointer.steps() == []
    plain = _trainer(tmp_path / "plain").run()  # no eval_metric: nothing monitored
    assert plain["best"] is None and "best_step" not in plain["eval"][0]


def test_resume_keeps_the_best_and_the_patience_spent(tmp_path, scripted):
    metric = "train.eval_metric=eval_ndcg@10"
    first = _trainer(tmp_path, metric, "train.early_stopping_patience=3").run(stop_at=6)
    assert first["final_step"] == 6 and first["stop_reason"] == "requested" and first["best"]["step"] == 4
    assert (tmp_path / "best").exists() and (tmp_path / RUN_RECORD).exists()
    assert finished_run(tmp_path) is None  # a best checkpoint, but the run was stopped: not finished
    # best at 4, and the evaluation at 6 did not improve: with patience 1 a resumed run stops without training
    out = _trainer(tmp_path, metric, "train.early_stopping_patience=1").run(resume=True)
    assert out["final_step"] == 6 and out["stop_reason"] == "early_stopping" and out["best"]["step"] == 4
    assert out["losses"] == [] and out["eval"] == []
    assert finished_run(tmp_path)["final_step"] == 6
    # with patience 3: 8 (tie) spends a second one, 10 (0.35 > 0.3) improves, 12 too
    tr = _trainer(tmp_path, metric, "train.early_stopping_patience=3")
    out = tr.run(resume=True)
    assert out["final_step"] == 12 and out["best"] == {"step": 12, "eval_ndcg@10": 0.9}
    assert [(e["step"], e["best_step"]) for e in out["eval"]] == [(8, 4), (10, 10), (12, 12)]
    assert finished_run(tmp_path)["stop_reason"] == "steps"
    assert tr.best_checkpointer.steps() == [12]
    state, step = tr.restore_best()
    assert step == 12
    _assert_same(_host_state(tr, state), scripted[12])


def test_a_killed_run_leaves_no_record_of_a_finished_one(tmp_path, scripted, monkeypatch):
    """run() removes the last record before it trains: a run killed midway (here: an evaluation that raises)
    never leaves an earlier run's run.json saying the folder's training is complete."""
    metric = "train.eval_metric=eval_ndcg@10"
    _trainer(tmp_path, metric, "train.steps=4").run()
    assert finished_run(tmp_path)["final_step"] == 4

    def dies(self, state):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "evaluate", dies)
    with pytest.raises(KeyboardInterrupt):
        _trainer(tmp_path, metric).run(resume=True)
    assert not (tmp_path / RUN_RECORD).exists() and finished_run(tmp_path) is None
    (tmp_path / RUN_RECORD).write_text('{"stop_reason": "requested", "final_step": 3}')
    assert finished_run(tmp_path) is None


def test_an_unknown_metric_is_a_clear_error(tmp_path, scripted):
    tr = _trainer(tmp_path, "train.eval_metric=eval_ndcg@20")
    with pytest.raises(ValueError, match=r"train.eval_metric='eval_ndcg@20' is not in the evaluation's output"):
        tr.run()
    tr = _trainer(tmp_path / "b", "train.eval_metric=eval_loss", "data.eval_batches=0")
    with pytest.raises(ValueError, match="no evaluation"):
        tr.run()


def test_config_validation():
    def load(*o):
        return load_config(str(TINY), list(o))

    cfg = load()
    assert (cfg.train.early_stopping_patience, cfg.train.eval_metric, cfg.train.eval_mode, cfg.train.keep_best) == (
        0,
        None,
        "max",
        True,
    )
    with pytest.raises(ConfigError, match=r"^train.eval_metric: is required when early_stopping_patience > 0"):
        load("train.early_stopping_patience=3")
    with pytest.raises(ConfigError, match=r"^train.eval_metric: 'eval_loss' is monitored, but eval_every=0"):
        load("train.eval_metric=eval_loss", "train.eval_every=0")
    with pytest.raises(ConfigError, match=r"^train.early_stopping_patience: must be >= 0"):
        load("train.early_stopping_patience=-1")
    with pytest.raises(ConfigError, match=r"^train.eval_mode: must be one of \['max', 'min'\]"):
        load("train.eval_mode=best")


def test_progress_note_shows_the_best():
    bar = _progress(10, 0, enabled=False)
    lines = []
    bar.bar = type("Bar", (), {"write": staticmethod(lines.append)})()
    bar.note({"eval_ndcg@10": 0.25, "step": 6, "best_step": 4, "best_eval_ndcg@10": 0.3}, "eval_ndcg@10")
    assert lines == ["eval @ step 6: eval_ndcg@10=0.2500 (best eval_ndcg@10=0.3000 @ step 4)"]
