"""Rewrites the generated part of docs/benchmarks.md's training-step section from the recorded JSON.

    python experiments/bench/train_step_docs.py [--check]

Reads experiments/results/train_step_breakdown.json (`experiments/bench/train_step_breakdown.py`) and every
experiments/results/bench_train_step*.json (`python -m jaxscale.bench --parts train_step --out ...`), renders
them with the renderers that wrote their own Markdown, and replaces what lies between the
`<!-- train_step:begin -->` and `<!-- train_step:end -->` markers. Nothing in that block is typed by hand.
`--check` writes nothing and fails (exit 1) if the docs' block is not exactly what the recorded JSON renders.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
from pathlib import Path

from jaxscale.benchmarks.machine import describe_machine
from jaxscale.benchmarks.report import render_train_step
from jaxscale.infra import atomic

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- train_step:begin -->", "<!-- train_step:end -->"


def _breakdown_render():
    spec = importlib.util.spec_from_file_location("breakdown", Path(__file__).with_name("train_step_breakdown.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.render


def block() -> str:
    out = [""]
    bd = RESULTS / "train_step_breakdown.json"
    if bd.exists():
        out += [_breakdown_render()(json.loads(bd.read_text())).replace("### ", "#### "), ""]
    runs = sorted(RESULTS.glob("bench_train_step*.json"))
    out += summary(runs)
    for path in runs:
        res = json.loads(path.read_text())
        part = res["parts"]["train_step"]
        lines = render_train_step(part)
        lines[0] = f"#### `{res['command']}` ({path.name})"
        m = res["machine"]
        lines.insert(2, f"Machine: {describe_machine(m)}; load average (1/5/15 min) at start {m['load_average']}.")
        lines.insert(3, "")
        out += lines
    return "\n".join(out)


def _speed(speeds: dict, peer: str) -> str:
    s = speeds.get(peer)
    return f"{s['speed']:.2f}x; {s['worst_round']:.2f}x" if s else "not run"


def summary(paths) -> list[str]:
    """One row per recorded run: its load, whether the load gate passed, and jaxscale's speed per peer."""
    rows = [
        "#### Every recorded run at a glance",
        "",
        "| run | CPU | mesh | load average at start | timings valid | vs torch (median; worst round) "
        "| vs torch.compile (median; worst round) |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        res = json.loads(path.read_text())
        part = res["parts"]["train_step"]
        ratio = functools.partial(_speed, part["speed"])

        valid = "yes" if not part["problems"] else "no (" + "; ".join(part["problems"]) + ")"
        load = res["machine"]["load_average"][0]
        rows.append(
            f"| {path.name} | {res['machine'].get('cpu_model', '?')} | {part['shape'].get('mesh', '1x1')} | {load:.2f} "
            f"| {valid} | {ratio('torch')} "
            f"| {ratio('torch_compile')} |"
        )
    return rows + ["", verdict(paths), ""]


TARGET = 2.0
"""Issue 34: the foundation model's training examples per second >= 2x the PyTorch SASRec+ reference."""


def verdict(paths) -> str:
    """Whether a valid run (load gate passed) shows the 2x target against eager PyTorch, and its best."""
    valid = []
    for path in paths:
        part = json.loads(path.read_text())["parts"]["train_step"]
        if not part["problems"] and "torch" in part["speed"]:
            valid.append((part["speed"]["torch"]["speed"], path.name, part["speed"]))
    if not valid:
        return "Target (2x eager PyTorch SASRec+ at equal threads): no valid run recorded."
    best, name, speed = max(valid)
    met = sum(s >= TARGET for s, _, _ in valid)
    compiled = speed.get("torch_compile")
    against = f"{compiled['speed']:.2f}x `torch.compile`" if compiled else "`torch.compile` not run"
    state = "met" if best >= TARGET else "not met"
    return (
        f"Target (2x eager PyTorch SASRec+ at equal threads): **{state}**. Valid runs: {len(valid)}, "
        f"{met} at or above 2x; the fastest, {name}: {best:.2f}x eager (worst round "
        f"{speed['torch']['worst_round']:.2f}x), {against}."
    )


def current_block(docs: Path) -> str:
    """What lies between the markers in `docs` (as `atomic.replace_between` writes it: newline, body, newline)."""
    text = docs.read_text()
    a = text.find(BEGIN)
    b = text.find(END, a + len(BEGIN)) if a >= 0 else -1
    if b < 0:
        raise SystemExit(f"{docs} lacks the marker {END if a >= 0 else BEGIN!r}")
    return text[a + len(BEGIN) : b]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail if the docs' block is stale; write nothing")
    ap.add_argument("--docs", type=Path, default=DOCS, help="the page holding the block (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.check:
        if current_block(args.docs) != f"\n{block()}\n":
            print(f"{args.docs}: the training-step block differs from what the recorded JSON renders; run {__file__}")
            return 1
        return 0
    atomic.replace_between(args.docs, BEGIN, END, block())
    return 0


if __name__ == "__main__":
    sys.exit(main())
