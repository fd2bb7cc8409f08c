"""Collects one MovieLens run (experiments/movielens/run.sh OUT) into OUT/metrics.json.

Every number comes from a file the run wrote: the evaluator's JSON per model and split
(`OUT/eval/<model>_<split>.json`), the trainer's metrics log (`OUT/runs/<model>/metrics.jsonl`: steps, the
validation curve), the import manifest (users, items, the protocol and its counts after its filters) and the
SASRec reference's JSON when it ran. Each model gives `test` under the run's protocol and, beside it,
`test_other_masking` (the same model's ranking scored with the history masked the other way), so no
comparison mixes the two.

    python experiments/movielens/collect.py OUT
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from jaxscale.benchmarks.machine import machine

TEST_KEYS = ("recall@10", "ndcg@10", "recall@20", "ndcg@20", "mrr@10")
TRAINED = ("foundation", "two_tower_context", "two_tower_no_context")
BASELINES = ("popularity", "genre_hint")


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _pick(metrics: dict) -> dict:
    return {k: metrics[k] for k in sorted(metrics) if k.split("@")[0] in ("recall", "ndcg", "mrr")}


def curve(run_dir: Path, metric: str = "eval_ndcg@10") -> list[dict]:
    """The trainer's validation evaluations: [{"step", metric, "wall_s"}] in step order (wall_s: seconds of
    training and evaluation since the run started, when the trainer recorded it)."""
    rows = []
    log = run_dir / "metrics.jsonl"
    for line in log.read_text().splitlines() if log.exists() else ():
        row = json.loads(line)
        if metric in row:
            rows.append({"step": int(row["step"]), metric: row[metric], **{k: row[k] for k in ("wall_s",) if k in row}})
    return rows


def trained_model(out: Path, name: str) -> dict:
    ev = out / "eval"
    run = out / "runs" / name
    valid, test = _json(ev / f"{name}_valid.json"), _json(ev / f"{name}_test.json")
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    return {
        **_scored(valid, test),
        "train_seconds": _json(ev / f"{name}_train.json")["train_seconds"],
        "steps": max(steps) if steps else 0,
        "best_step": test["step"],
        "curve": curve(run),
    }


def _scored(valid: dict, test: dict, key: str = "metrics") -> dict:
    """valid / test under the run's protocol, and test scored the other way (absent when it was not computed)."""
    out = {"valid": _pick(valid[key]), "test": _pick(test[key]), "mask_history": test.get("mask_history", False)}
    other = test.get("metrics_other_masking")
    if other is not None:
        out["test_other_masking"] = _pick(other)
    return out


def baseline(out: Path, name: str) -> dict:
    """A baseline scored alone (`python -m jaxscale.evaluate --baseline NAME`) on both held-out splits."""
    return _scored(_json(out / "eval" / f"{name}_valid.json"), _json(out / "eval" / f"{name}_test.json"))


def collect(out: Path, seconds: float | None = None, commit: str = "unknown") -> dict:
    manifest = _json(out / "events" / "movielens.json")
    models = {name: trained_model(out, name) for name in TRAINED}
    models.update({name: baseline(out, name) for name in BASELINES if (out / "eval" / f"{name}_test.json").exists()})
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
        if "test_other_masking" in s:  # absent in a record written before the script scored both maskings
            models["sasrec_recbole"]["test_other_masking"] = _pick(s["test_other_masking"])
    for m in models.values():
        missing = [k for k in TEST_KEYS if k not in m["test"]]
        if missing:
            raise ValueError(f"test metrics lack {missing}")
    test = _json(out / "eval" / "foundation_test.json")
    counts = manifest.get("protocol_counts") or {
        "users": manifest["counts"]["users"],
        "items": manifest["counts"]["rated_items"],
        "interactions": manifest["counts"]["events"],
    }
    return {
        "dataset": manifest["dataset"],
        "protocol": manifest.get("protocol") or "none",
        "protocol_detail": manifest.get("protocol_detail")
        or "leave-one-out by (timestamp, file order), full ranking over every item, history not masked",
        "mask_history": test.get("mask_history", False),
        "counts": counts,
        "users": manifest["counts"]["users"],
        "items": manifest["counts"]["items"],
        "events": manifest["counts"]["events"],
        "evaluated_users": test["examples"],
        "candidates": test["candidates"],
        "models": models,
        "run": {
            "seconds": seconds,
            "cores": os.cpu_count(),
            "cpu": machine()["cpu_model"],
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
