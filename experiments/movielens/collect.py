"""Collects one MovieLens run (experiments/movielens/run.sh OUT) into OUT/metrics.json.

Every number comes from a file the run wrote: the evaluator's JSON per model and split
(`OUT/eval/<model>_<split>.json`), the trainer's metrics log (`OUT/runs/<model>/metrics.jsonl`: steps, the
validation curve), the import manifest (users, items) and the SASRec reference's JSON when it ran.

    python experiments/movielens/collect.py OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

TEST_KEYS = ("recall@10", "ndcg@10", "recall@20", "ndcg@20", "mrr@10")
TRAINED = ("foundation", "two_tower_context", "two_tower_no_context")


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _pick(metrics: dict) -> dict:
    return {k: metrics[k] for k in sorted(metrics) if k.split("@")[0] in ("recall", "ndcg", "mrr")}


def curve(run_dir: Path, metric: str = "eval_ndcg@10") -> list[dict]:
    """The trainer's validation evaluations: [{"step", metric}] in step order."""
    rows = []
    log = run_dir / "metrics.jsonl"
    for line in log.read_text().splitlines() if log.exists() else ():
        row = json.loads(line)
        if metric in row:
            rows.append({"step": int(row["step"]), metric: row[metric]})
    return rows


def trained_model(out: Path, name: str) -> dict:
    ev = out / "eval"
    run = out / "runs" / name
    valid, test = _json(ev / f"{name}_valid.json"), _json(ev / f"{name}_test.json")
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    return {
        "valid": _pick(valid["metrics"]),
        "test": _pick(test["metrics"]),
        "train_seconds": _json(ev / f"{name}_train.json")["train_seconds"],
        "steps": max(steps) if steps else 0,
        "best_step": test["step"],
        "curve": curve(run),
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect(out: Path, seconds: float | None = None, commit: str = "unknown") -> dict:
    manifest = _json(out / "events" / "movielens.json")
    models = {name: trained_model(out, name) for name in TRAINED}
    models["popularity"] = {
        "valid": _pick(_json(out / "eval" / "popularity_valid.json")["popularity"]),
        "test": _pick(_json(out / "eval" / "popularity_test.json")["popularity"]),
    }
    sasrec = out / "eval" / "sasrec_recbole.json"
    if sasrec.exists():
        s = _json(sasrec)
        models["sasrec_recbole"] = {
            "valid": _pick(s["valid"]),
            "test": _pick(s["test"]),
            "train_seconds": s["train_seconds"],
            "steps": s["steps"],
            "epochs": s["epochs"],
            "best_epoch": s["best_epoch"],
            "early_stopped": s.get("early_stopped"),
            "threads": s.get("threads"),
            "curve": [{"step": c["steps"], "eval_ndcg@10": c["ndcg@10"]} for c in s["curve"]],
        }
    for m in models.values():
        missing = [k for k in TEST_KEYS if k not in m["test"]]
        if missing:
            raise ValueError(f"test metrics lack {missing}")
    test = _json(out / "eval" / "foundation_test.json")
    return {
        "dataset": manifest["dataset"],
        "protocol": "leave_one_out_full_ranking",
        "users": manifest["counts"]["users"],
        "items": manifest["counts"]["items"],
        "events": manifest["counts"]["events"],
        "evaluated_users": test["examples"],
        "candidates": test["candidates"],
        "models": models,
        "run": {
            "seconds": seconds,
            "cores": os.cpu_count(),
            "cpu": cpu_model(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit,
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seconds", type=float, default=None, help="wall time of the run (run.sh passes it)")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args(argv)
    out = Path(args.out)
    metrics = collect(out, args.seconds, args.commit)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    table = {k: {s: v["test"].get(s) for s in ("recall@10", "ndcg@10")} for k, v in metrics["models"].items()}
    print(json.dumps(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
