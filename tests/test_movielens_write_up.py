"""docs/movielens.md's generated blocks are what experiments/movielens/write_up.py renders from the recorded JSON
today: a figure in the write-up cannot drift from its record (nor be typed in by hand)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def _write_up():
    spec = importlib.util.spec_from_file_location("movielens_write_up", ROOT / "experiments/movielens/write_up.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _block(text: str, start: str, end: str) -> str:
    a = text.index(start) + len(start)
    return text[a : text.index(end, a)]


def _load(name: str):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def test_the_docs_blocks_are_rendered_from_the_records():
    w = _write_up()
    doc = (ROOT / "docs" / "movielens.md").read_text()
    metrics, tuning = _load("movielens_metrics.json"), _load("movielens_tuning.json")
    assert _block(doc, w.START, w.END) == "\n" + w.render(metrics, tuning) + "\n"
    records = {p: r for p in w.ML1M_PROTOCOLS if (r := _load(f"movielens_ml1m_{p}.json")) is not None}
    ml1m = w.ml1m_section(records, _load("movielens_ml1m_tuning.json"), _load("movielens_ml1m_fairness.json"))
    assert _block(doc, w.ML1M_START, w.ML1M_END) == "\n" + "\n".join(ml1m) + "\n"


def test_the_ml1m_verdicts_follow_the_numbers():
    """The target sentence says 'met' exactly when the recorded NDCG@10 reaches the published row."""
    w = _write_up()
    record = {
        "protocol_detail": "x", "counts": {"users": 2, "items": 3, "interactions": 4}, "evaluated_users": 2,
        "candidates": 3, "mask_history": True, "run": {"seconds": 3601},
        "models": {"foundation": {"test": {"ndcg@10": 0.1820, "recall@10": 0.3}}},
    }  # fmt: skip
    text = "\n".join(w.ml1m_section({"literature": record}))
    assert "the target is missed" in text and "over the 60-minute budget" in text
    record["models"]["foundation"]["test"]["ndcg@10"] = 0.1821
    record["run"]["seconds"] = 3600
    text = "\n".join(w.ml1m_section({"literature": record}))
    assert "the target is met" in text and "within the 60-minute budget" in text
