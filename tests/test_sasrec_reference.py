"""The SASRec reference (experiments/baselines/sasrec_recbole.py) scores both maskings from one pass and takes
the foundation model's seen-item offset as an option: its masked lists hold no history item (brute force
from the raw ratings), its metrics are those of its lists, and the offset is a trained parameter."""

import sys
from pathlib import Path

import numpy as np
import pytest
from movielens_helpers import loo_targets, write_ml100k

from jaxscale import ranking
from jaxscale.sequences import compile_definitions
from jaxscale.sequences.movielens import import_movielens
from jaxscale.sequences.query import SequenceReader
from jaxscale.sequences.runtime import backfill

torch = pytest.importorskip(
    "torch", reason="the SASRec reference needs torch (experiments/baselines/install_torchrec.sh)"
)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "baselines"))
import sasrec_recbole  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ml")
    rows = write_ml100k(tmp / "raw")
    import_movielens(tmp / "raw", tmp / "events")
    defs = compile_definitions(ROOT / "experiments/movielens/movielens_defs.py", tmp / "defs.json")
    backfill(defs, tmp / "events" / "events", tmp / "store", sources={"items": str(tmp / "events" / "items.parquet")})
    return tmp, rows


@pytest.mark.parametrize("mask_history", [True, False], ids=["masked", "unmasked"])
def test_reference_scores_both_maskings_with_the_offset(store, mask_history):
    tmp, rows = store
    results, (users, topk, other) = sasrec_recbole.train(
        tmp / "store", tmp / "defs.json", "ratings", seed=0, batch=16, max_epochs=2, patience=5, threads=1,
        log=lambda *_: None, max_len=8, mask_history=mask_history, seen_item_offset=True,
    )  # fmt: skip
    assert results["mask_history"] is mask_history and results["seen_item_offset"] is True
    assert results["seen_offset_value"] != 0.0  # trained: the offset moved from its zero init
    vocab = SequenceReader(tmp / "store", "ratings").vocabulary("item_id")
    targets = loo_targets(rows, "test")
    target_rows = np.array([vocab.encode(np.array([targets[int(u)]]))[0] for u in users])
    assert results["test"] == pytest.approx(ranking.ranking_metrics(topk, target_rows, (10, 20)))
    history: dict[int, set] = {}
    for pos, (u, i, _, t) in enumerate(rows):
        history.setdefault(u, []).append((t, pos, i))
    seen = {u: {i for _, _, i in sorted(evs)[:-1]} for u, evs in history.items()}
    lists = {int(u): set(vocab.decode(topk[j][topk[j] >= 0]).tolist()) for j, u in enumerate(users)}
    overlap = sum(len(lists[u] & seen[u]) for u in lists)
    assert (overlap == 0) if mask_history else (overlap > 0)
    assert results["test_other_masking"] == pytest.approx(ranking.ranking_metrics(other, target_rows, (10, 20)))
    other_lists = {int(u): set(vocab.decode(other[j][other[j] >= 0]).tolist()) for j, u in enumerate(users)}
    other_overlap = sum(len(other_lists[u] & seen[u]) for u in other_lists)
    assert (other_overlap > 0) if mask_history else (other_overlap == 0)
