"""Records validation-only tuning runs of the MovieLens foundation model into a JSON the write-up renders.

Each run is a `python -m jaxscale.train --config jaxscale/configs/movielens_foundation.yaml ...` with a few
overrides (train.workdir=DIR); this reads each run's metrics log and keeps the best validation NDCG@10.

    python experiments/movielens/tune.py --out experiments/results/movielens_tuning.json \\
        NAME=DIR:"override override ..." ...   [--append: keep the runs already in --out, add these]
        [--config PATH: these runs start from PATH, not from the record's base; kept with each run]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def summarize(name: str, run_dir: Path, overrides: list[str], config: str | None = None) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_ndcg@10"]) for r in rows if "eval_ndcg@10" in r]
    steps = max((r["step"] for r in rows if "loss" in r and "eval_ndcg@10" not in r), default=0)
    best_step, best = max(evals, key=lambda e: e[1]) if evals else (0, None)
    out = {"name": name, "overrides": overrides, "best": best, "best_step": best_step, "steps": steps, "curve": evals}
    return out | ({"config": config} if config else {})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default="", help="what the runs' overrides apply to (the starting config)")
    ap.add_argument("--append", action="store_true", help="keep the runs already recorded in --out")
    ap.add_argument("--config", help="the config these runs start from, when it is not the record's base")
    ap.add_argument("runs", nargs="+", metavar='NAME=DIR:"OVERRIDES"')
    args = ap.parse_args(argv)
    old = json.loads(Path(args.out).read_text()) if args.append and Path(args.out).exists() else None
    runs = list(old["runs"]) if old else []
    for spec in args.runs:
        name, _, rest = spec.partition("=")
        run_dir, _, overrides = rest.partition(":")
        if any(r["name"] == name for r in runs):
            raise SystemExit(f"{args.out} already holds a run named {name!r}")
        runs.append(summarize(name, Path(run_dir), overrides.split(), args.config))
    record = {"metric": "eval_ndcg@10 (validation)", "base": old["base"] if old else args.base, "runs": runs}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps([{k: r[k] for k in ("name", "best", "best_step")} for r in runs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
