"""The shipped `engagement` example trains both models end to end: a small store (make_events -> compile ->
backfill, with the example's item_id vocabulary and its -1 categories for items missing from the items
table), then a few Trainer steps of the foundation model (jaxscale/configs/foundation_sequences.yaml) and
of the contextual two-tower (jaxscale/configs/two_tower_sequences.yaml), shrunk to CPU size."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxscale.sequences import compile_definitions
from jaxscale.sequences.query import SequenceReader
from jaxscale.sequences.runtime import backfill
from jaxscale.sequences.store import read_sequence
from jaxscale.training.config import load_config
from jaxscale.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "jaxscale" / "configs"
ITEMS, L = 300, 8
ITEM_ROWS = 304  # >= the vocabulary's num_indices (at most 300 ids + 2), a multiple of the 8 devices


@pytest.fixture(scope="module")
def engagement(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engagement")
    script = ROOT / "experiments" / "sequences" / "make_events.py"  # run as the script it is, never imported
    args = ["--out", str(tmp / "data"), "--events", "6000", "--days", "3", "--items", str(ITEMS)]
    made = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, cwd=ROOT)
    assert made.returncode == 0, made.stderr[-3000:]
    defs = compile_definitions(ROOT / "experiments/sequences/engagement.py", tmp / "defs.json")
    backfill(defs, tmp / "data" / "events", tmp / "store", sources={"items": str(tmp / "data" / "items.parquet")})
    return tmp / "store", tmp / "defs.json"


def test_the_example_store_has_a_dense_item_vocabulary(engagement):
    store, _ = engagement
    vocab = SequenceReader(store, "engagement").vocabulary("item_id")
    table = read_sequence(store, "engagement")
    ids = table.column("item_id").to_numpy()
    assert vocab is not None and vocab.size == len(np.unique(ids)) and vocab.num_indices <= ITEM_ROWS
    assert ids.max() >= 2**31  # 40-bit raw ids: out of any int32 table without the vocabulary
    assert (vocab.encode(ids) >= 2).all()
    assert (table.column("category").to_numpy() == -1).any()  # items missing from the items table


def _run(config: str, overrides: list[str], workdir: Path) -> dict:
    cfg = load_config(str(CONFIGS / config), overrides)
    trainer = Trainer(cfg, workdir=str(workdir), progress=False)
    out = trainer.run()
    losses = np.asarray(out["losses"])
    assert len(losses) == cfg.train.steps and np.all(np.isfinite(losses)), losses
    return out


def _data(store, defs) -> list[str]:
    return [f"data.sequences.store={store}", f"data.sequences.defs={defs}", "data.eval_batches=1"]


def test_foundation_trains_on_dense_ids(engagement, tmp_path):
    store, defs = engagement
    m = "model.foundation."
    out = _run(
        "foundation_sequences.yaml",
        _data(store, defs)
        + [f"{m}item_rows={ITEM_ROWS}", f"{m}item_dim=8", f"{m}max_seq_len={L}", f"{m}d_model=16"]
        + [f"{m}num_layers=1", f"{m}num_heads=2", f"{m}mlp_ratio=2"]
        + ["train.batch_size=16", "train.steps=6", "train.eval_every=0", "train.checkpoint_every=0"]
        + ["train.warmup_steps=1", "train.log_every=2"],
        tmp_path,
    )
    assert np.mean(out["losses"][-2:]) < np.mean(out["losses"][:2]) + 0.5


def test_contextual_two_tower_trains_with_missing_categories(engagement, tmp_path):
    store, defs = engagement
    m = "model.contextual_two_tower."
    out = _run(
        "two_tower_sequences.yaml",
        _data(store, defs)
        + [f"{m}item_rows={ITEM_ROWS}", f"{m}item_dim=8", f"{m}max_seq_len={L}", f"{m}d_model=16"]
        + [f"{m}num_layers=1", f"{m}num_heads=2", f"{m}mlp_ratio=2", f"{m}context_dim=8", f"{m}embed_dim=8"]
        + [f"{m}head_hidden=[16]", f"{m}item_hidden=[16]", f"{m}recall_ks=[5,10]"]
        + ["train.batch_size=32", "train.steps=6", "train.eval_every=6", "train.checkpoint_every=0"]
        + ["train.warmup_steps=1", "train.log_every=2", "embedding.capacity_factor=2.0"],
        tmp_path,
    )
    ev = out["eval"][-1]
    assert 0.0 <= ev["eval_recall@5"] <= ev["eval_recall@10"] <= 1.0


def test_two_tower_refuses_a_table_smaller_than_the_vocabulary(engagement, tmp_path):
    store, defs = engagement
    cfg = load_config(
        str(CONFIGS / "two_tower_sequences.yaml"),
        _data(store, defs) + ["model.contextual_two_tower.item_rows=64", "train.batch_size=32"],
    )
    with pytest.raises(ValueError, match=r"item_rows=64.*'item_id' vocabulary.*indices"):
        Trainer(cfg, workdir=str(tmp_path), progress=False)
