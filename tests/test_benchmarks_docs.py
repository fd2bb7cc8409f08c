"""docs/benchmarks.md's training-step block is exactly what experiments/bench/train_step_docs.py renders from
the recorded JSON (run as the script it is), and the check fails when one figure in it is changed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "bench" / "train_step_docs.py"
DOCS = ROOT / "docs" / "benchmarks.md"


def _check(docs: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), "--check", "--docs", str(docs)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def test_the_training_step_block_is_what_the_recorded_json_renders():
    proc = _check(DOCS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_changed_figure_fails_the_check(tmp_path):
    text = DOCS.read_text()
    start = text.index("<!-- train_step:begin -->")
    line = next(ln for ln in text[start:].splitlines() if ln.startswith("| 1x8 |"))
    tampered = tmp_path / "benchmarks.md"
    tampered.write_text(text.replace(line, line.replace("| 8 |", "| 7 |", 1), 1))
    proc = _check(tampered)
    assert proc.returncode == 1
    assert "differs from what the recorded JSON renders" in proc.stdout
