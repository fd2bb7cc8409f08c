"""experiments/movielens/tune.py (run as the script it is): each run's best validation NDCG@10 and its curve
come from the run's metrics log, and --append adds runs to a record without losing or duplicating any."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from movielens_helpers import render_write_up

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "movielens" / "tune.py"


def _run_dir(path: Path, curve: list) -> Path:
    path.mkdir(parents=True)
    rows = [{"step": s, "loss": 1.0} for s, _ in curve] + [{"step": s, "eval_ndcg@10": v} for s, v in curve]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _tune(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_records_best_and_appends_without_duplicates(tmp_path):
    a = _run_dir(tmp_path / "a", [(200, 0.05), (400, 0.07), (600, 0.06)])
    b = _run_dir(tmp_path / "b", [(200, 0.08)])
    out = tmp_path / "tuning.json"
    assert _tune("--out", out, "--base", "the start", f"A={a}:x=1 y=2").returncode == 0
    proc = _tune("--out", out, "--append", f"B={b}:z=3")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["base"] == "the start" and [r["name"] for r in record["runs"]] == ["A", "B"]
    first, second = record["runs"]
    assert (first["best"], first["best_step"], first["steps"], first["overrides"]) == (0.07, 400, 600, ["x=1", "y=2"])
    assert first["curve"] == [[200, 0.05], [400, 0.07], [600, 0.06]] and second["best"] == 0.08
    again = _tune("--out", out, "--append", f"B={b}:z=3")
    assert again.returncode != 0 and "'B'" in again.stderr
    assert [r["name"] for r in json.loads(out.read_text())["runs"]] == ["A", "B"]  # the record is untouched


def test_a_run_from_another_config_keeps_it_and_the_write_up_names_it(tmp_path):
    """--config: appended runs that start from another config carry it; the base and older runs stay; the
    write-up (run as the script it is, on a copy of the docs) names the config in the run's row."""
    a = _run_dir(tmp_path / "a", [(100, 0.05)])
    c = _run_dir(tmp_path / "c", [(250, 0.09), (500, 0.1)])
    results = tmp_path / "results"
    results.mkdir()
    out = results / "movielens_ml1m_tuning.json"
    assert _tune("--out", out, "--base", "the start", f"A={a}:x=1").returncode == 0
    proc = _tune("--out", out, "--append", "--config", "other.yaml", f"C={c}:train.steps=3000")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["base"] == "the start" and "config" not in record["runs"][0]
    assert record["runs"][1]["config"] == "other.yaml" and record["runs"][1]["best"] == 0.1
    shutil.copy(ROOT / "experiments" / "results" / "movielens_metrics.json", results)
    text = render_write_up(tmp_path, results)
    assert "| A | x=1 | 0.0500 | 100 |" in text
    assert "| C | config other.yaml; train.steps=3000 | 0.1000 | 500 |" in text
