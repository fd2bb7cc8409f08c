"""Renders the recorded MovieLens results into docs/movielens.md and the learning-curve picture.

Every figure is computed here from recorded files, none typed by hand:
  experiments/results/movielens_metrics.json   a copy of run.sh's OUT/metrics.json (+ "run": its timing)
  experiments/results/movielens_tuning.json    the validation-only tuning runs (tune.py)
Writes the part of docs/movielens.md between the `results:start` / `results:end` markers and
experiments/results/movielens_curve.png (validation NDCG@10 against training steps).

    python experiments/movielens/write_up.py [--metrics F] [--tuning F] [--doc docs/movielens.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
START, END = "<!-- results:start (written by experiments/movielens/write_up.py) -->", "<!-- results:end -->"
ORDER = ("foundation", "sasrec_recbole", "two_tower_context", "two_tower_no_context", "popularity")
LABELS = {
    "foundation": "jaxscale foundation model",
    "sasrec_recbole": "SASRec (RecBole 1.2.1 model and defaults, PyTorch)",
    "two_tower_context": "contextual two-tower, with context",
    "two_tower_no_context": "contextual two-tower, without context",
    "popularity": "popularity (train-split counts)",
}
COLUMNS = ("recall@10", "ndcg@10", "recall@20", "ndcg@20", "mrr@10")


def _f(x, digits=4) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def results_table(m: dict) -> list[str]:
    head = "| model | valid NDCG@10 | " + " | ".join(f"test {c}" for c in COLUMNS) + " | steps | train s |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 4)]
    for name in ORDER:
        if name not in m["models"]:
            continue
        r = m["models"][name]
        cells = [LABELS[name], _f(r["valid"].get("ndcg@10"))] + [_f(r["test"].get(c)) for c in COLUMNS]
        cells += [str(r.get("steps", "")), _f(r.get("train_seconds"), 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def findings(m: dict) -> list[str]:
    """The targets, each sentence computed (and worded by what the numbers say)."""
    models, out = m["models"], []
    f = models["foundation"]["test"]["ndcg@10"]
    pop = models["popularity"]["test"]["ndcg@10"]
    if "sasrec_recbole" in models:
        s = models["sasrec_recbole"]
        sn = s["test"]["ndcg@10"]
        verdict = "is met" if f >= sn else "is missed"
        out.append(
            f"- Foundation model vs SASRec: test NDCG@10 {f:.4f} vs {sn:.4f} ({f / sn:.2f}x): the target "
            f"(at least SASRec's) {verdict}. SASRec early-stopped at epoch {s['epochs']} (best epoch "
            f"{s['best_epoch']}, {s.get('threads', '?')} PyTorch thread(s))."
            + (
                ""
                if s.get("early_stopped", True)
                else f" SASRec's run ended at its epoch limit ({s['epochs']} epochs) before early stopping "
                f"(best epoch {s['best_epoch']}): its number is what it reached, not its converged value."
            )
        )
    else:
        out.append("- SASRec reference: not run in this recording (no torch, or MOVIELENS_SASREC=0).")
    out.append(f"- Foundation model vs popularity: test NDCG@10 {f:.4f} vs {pop:.4f} ({f / pop:.1f}x).")
    c = models["two_tower_context"]["test"]["recall@10"]
    n = models["two_tower_no_context"]["test"]["recall@10"]
    verdict = "is met" if c >= 2 * n else "is missed"
    out.append(
        f"- Contextual two-tower: test Recall@10 with context {c:.4f} vs without {n:.4f} ({c / n:.2f}x): the "
        f"target (at least 2x) {verdict}."
    )
    run = m.get("run", {})
    if "seconds" in run:
        verdict = "within" if run["seconds"] <= 25 * 60 else "over"
        out.append(
            f"- `run.sh` (fetch, import, backfill, the three trainings, every evaluation, popularity) took "
            f"{run['seconds'] / 60:.1f} minutes on {run.get('cores', '?')} cores "
            f"({run.get('cpu', 'CPU not recorded')}): {verdict} the 25-minute budget"
            + (
                ". The SASRec reference is not part of it: it is trained separately (`MOVIELENS_SASREC=1`, its "
                "train s above)."
                if "sasrec_recbole" in models
                else "."
            )
        )
    return out


def tuning_table(t: dict) -> list[str]:
    lines = [f"Starting config: {t.get('base') or 'the committed one'}.", ""]
    lines.append("| run | overrides | best valid NDCG@10 | at step | steps run |")
    lines.append("|---|---|---|---|---|")
    for r in t["runs"]:
        lines.append(
            f"| {r['name']} | {', '.join(r['overrides']) or '(none)'} | {_f(r['best'])} | {r['best_step']} | "
            f"{r['steps']} |"
        )
    return lines


def curve_png(m: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ORDER:
        r = m["models"].get(name, {})
        pts = r.get("curve") or []
        if pts:
            ax.plot([p["step"] for p in pts], [p["eval_ndcg@10"] for p in pts], marker="o", ms=3, label=LABELS[name])
    pop = m["models"]["popularity"]["valid"]["ndcg@10"]
    ax.axhline(pop, color="grey", ls="--", lw=1, label=LABELS["popularity"])
    ax.set_xlabel("training steps (batch 256)")
    ax.set_ylabel("validation NDCG@10 (full ranking)")
    ax.set_title(f"{m['dataset']}, leave-one-out, {m['evaluated_users']} users x {m['candidates']} items")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(metrics: dict, tuning: dict | None) -> str:
    lines = [START, ""]
    run = metrics.get("run", {})
    lines.append(
        f"Recorded {run.get('date', '(date not recorded)')} on {run.get('cores', '?')} cores "
        f"({run.get('cpu', 'CPU not recorded')}), jaxscale commit {run.get('commit', '?')}: "
        f"{metrics['dataset']}, {metrics['users']} users, {metrics['items']} items, {metrics['events']} ratings; "
        f"{metrics['evaluated_users']} users evaluated against {metrics['candidates']} candidates."
    )
    lines += ["", *results_table(metrics), "", *findings(metrics), ""]
    lines.append("![validation NDCG@10 against steps](../experiments/results/movielens_curve.png)")
    if tuning:
        lines += ["", "Tuning runs (validation split only; the test split was read once, by run.sh):", ""]
        lines += tuning_table(tuning)
    lines += ["", END]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metrics", default=str(RESULTS / "movielens_metrics.json"))
    ap.add_argument("--tuning", default=str(RESULTS / "movielens_tuning.json"))
    ap.add_argument("--doc", default=str(ROOT / "docs" / "movielens.md"))
    ap.add_argument("--png", default=str(RESULTS / "movielens_curve.png"))
    args = ap.parse_args(argv)
    metrics = json.loads(Path(args.metrics).read_text())
    tuning = json.loads(Path(args.tuning).read_text()) if Path(args.tuning).exists() else None
    doc = Path(args.doc)
    text = doc.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{doc} lacks the results markers")
    a, b = text.index(START), text.index(END) + len(END)
    doc.write_text(text[:a] + render(metrics, tuning) + text[b:])
    curve_png(metrics, Path(args.png))
    print(f"wrote {doc} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
