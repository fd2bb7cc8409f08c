"""The contextual two-tower SPEC through the Trainer on 8 simulated devices: the loss falls, evaluation reports
exact full-corpus Recall@K, and the smoke config trains from the CLI."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxscale.training import registry
from jaxscale.training.config import load_config
from jaxscale.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "jaxscale" / "configs" / "two_tower_smoke.yaml"

# The smoke config, shrunk so that compiling dominates (a few seconds of steps).
TINY = [
    "model.contextual_two_tower.item_rows=400",
    "model.contextual_two_tower.num_categories=16",
    "model.contextual_two_tower.item_dim=8",
    "model.contextual_two_tower.d_model=16",
    "model.contextual_two_tower.num_layers=1",
    "model.contextual_two_tower.num_heads=2",
    "model.contextual_two_tower.mlp_ratio=2",
    "model.contextual_two_tower.max_seq_len=8",
    "model.contextual_two_tower.context_dim=8",
    "model.contextual_two_tower.head_hidden=[16]",
    "model.contextual_two_tower.item_hidden=[16]",
    "model.contextual_two_tower.embed_dim=8",
    "train.batch_size=64",
    "train.steps=40",
    "train.warmup_steps=2",
    "train.learning_rate=0.01",
    "train.eval_every=40",
    "train.log_every=10",
    "data.eval_batches=2",
    "embedding.capacity_factor=2.0",  # fixed exchange shapes: one compilation (overflow would grow it)
]


def test_smoke_config_loads_the_registered_spec():
    cfg = load_config(str(SMOKE))
    assert cfg.model.kind == "contextual_two_tower"
    spec = registry.get("contextual_two_tower")
    assert isinstance(cfg.model.params, spec.config)
    assert cfg.model.params.use_context and cfg.model.params.recall_ks == (10, 50, 100)
    assert [t.name for t in spec.tables(cfg.model.params)] == ["items", "categories"]
    with pytest.raises(ValueError, match="context_dropout"):
        load_config(str(SMOKE), ["model.contextual_two_tower.context_dropout=1.5"])
    with pytest.raises(ValueError, match="data.options"):
        load_config(str(SMOKE), TINY + ["data.options={p_ctx: 0.5}"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cfg = load_config(str(SMOKE), TINY)
    trainer = Trainer(cfg, workdir=str(tmp_path_factory.mktemp("tt") / "run"), progress=False)
    return trainer, trainer.run()


def test_trains_through_the_trainer_with_full_corpus_recall(trained):
    trainer, out = trained
    losses = np.asarray(out["losses"])
    assert np.all(np.isfinite(losses)) and len(losses) == 40
    assert losses[-5:].mean() < losses[:5].mean() - 0.3, losses
    ev = out["eval"][-1]
    for k in (10, 50, 100):
        assert 0.0 <= ev[f"eval_recall@{k}"] <= 1.0
    assert ev["eval_recall@10"] <= ev["eval_recall@50"] <= ev["eval_recall@100"]
    # 40 steps on 400 items learn far more than chance (100 / 400 at K=100)
    assert ev["eval_recall@100"] > 0.4
    log = [json.loads(line) for line in (trainer.workdir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_recall@10" in m for m in log)
    # the estimator's arrays are model state: in the trainer state, so in its checkpoints
    rest = out["final_state"]["rest"]
    assert set(rest["logq"]) == {"last_step", "gap", "step"}


def test_trainer_advances_the_logq_estimator(trained):
    _, out = trained
    assert int(np.asarray(out["final_state"]["rest"]["logq"]["step"])) == 40


@pytest.mark.slow
def test_cli_trains_the_smoke_config(tmp_path):
    from conftest import subprocess_env

    cmd = [sys.executable, "-m", "jaxscale.train", "--config", str(SMOKE), "--no-progress"]
    cmd += TINY + ["train.steps=30", "train.eval_every=0", f"train.workdir={tmp_path / 'cli'}"]
    r = subprocess.run(cmd, env=subprocess_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"first \d+ steps ([\d.]+) -> last \d+ steps ([\d.]+)", r.stdout)
    assert m and float(m.group(2)) < float(m.group(1)) - 0.3, r.stdout[-2000:]
