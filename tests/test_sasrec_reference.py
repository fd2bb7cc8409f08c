"""The SASRec reference (experiments/baselines/sasrec_recbole.py, run as the script it is) scores both maskings
from one pass and takes the foundation model's seen-item offset as an option: its masked lists hold no history
item (brute force from the raw ratings), its metrics are those of its lists, and the offset is trained."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from movielens_helpers import loo_targets, write_ml100k

from jaxscale.sequences import compile_definitions
from jaxscale.sequences.movielens import import_movielens
from jaxscale.sequences.runtime import backfill

pytest.importorskip("torch", reason="the SASRec reference needs torch (experiments/baselines/install_torchrec.sh)")
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "baselines" / "sasrec_recbole.py"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ml")
    rows = write_ml100k(tmp / "raw")
    import_movielens(tmp / "raw", tmp / "events")
    defs = compile_definitions(ROOT / "experiments/movielens/movielens_defs.py", tmp / "defs.json")
    backfill(defs, tmp / "events" / "events", tmp / "store", sources={"items": str(tmp / "events" / "items.parquet")})
    return tmp, rows


def _lists(path: Path) -> dict:
    t = pq.read_table(path).to_pydict()
    out: dict = {}
    for u, r, i in zip(t["user_id"], t["rank"], t["item_id"]):
        out.setdefault(u, {})[r] = i
    return {u: [v[r] for r in sorted(v)] for u, v in out.items()}


def _ndcg10(lists: dict, targets: dict) -> float:
    return float(
        np.mean([1 / np.log2(lists[u][:10].index(t) + 2) if t in lists[u][:10] else 0.0 for u, t in targets.items()])
    )


@pytest.mark.parametrize("mask_history", [True, False], ids=["masked", "unmasked"])
def test_reference_scores_both_maskings_with_the_offset(store, mask_history, tmp_path):
    tmp, rows = store
    out, top, other = tmp_path / "r.json", tmp_path / "top.parquet", tmp_path / "other.parquet"
    cmd = [sys.executable, str(SCRIPT), "--store", str(tmp / "store"), "--defs", str(tmp / "defs.json")]
    cmd += ["--json", str(out), "--topk", str(top), "--topk-other", str(other), "--max-epochs", "2", "--threads", "1"]
    cmd += ["--max-len", "8", "--seed", "0", "--seen-item-offset", *(["--mask-history"] if mask_history else [])]
    scale = 10.0 if mask_history else 1.0  # the foundation model's seen_item_bias_scale, both ways
    cmd += ["--seen-item-offset-scale", str(scale)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["mask_history"] is mask_history and results["seen_item_offset"] is True
    assert results["seen_offset_value"] != 0.0  # trained: the offset moved from its zero init
    assert results["seen_offset_scale"] == scale
    targets = loo_targets(rows, "test")
    history: dict[int, list] = {}
    for pos, (u, i, _, t) in enumerate(rows):
        history.setdefault(u, []).append((t, pos, i))
    seen = {u: {i for _, _, i in sorted(evs)[:-1]} for u, evs in history.items()}
    chosen, the_other = _lists(top), _lists(other)
    masked, unmasked = (chosen, the_other) if mask_history else (the_other, chosen)
    assert sum(len(set(masked[u]) & seen[u]) for u in masked) == 0
    assert sum(len(set(unmasked[u]) & seen[u]) for u in unmasked) > 0
    assert results["test"]["ndcg@10"] == pytest.approx(_ndcg10(chosen, targets))
    assert results["test_other_masking"]["ndcg@10"] == pytest.approx(_ndcg10(the_other, targets))
