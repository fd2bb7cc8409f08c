"""Contextual vs context-free two-tower retrieval on planted-context synthetic data.

    python experiments/two_tower/compare.py                    # records the "compare" section of RESULTS.md
    python experiments/two_tower/compare.py --json out.json    # also writes the recall JSON
    python experiments/two_tower/compare.py --steps 50 --results none   # quicker, records nothing

Trains the contextual model (`model.kind: contextual_two_tower`) and the same model without its context
layer (`use_context: false`) on the same synthetic stream (same seed, steps, batch and optimizers), then
evaluates both by exact full-corpus retrieval (every item scored, top-K, Recall@10/50/100) on held-out users
with their real request context; the contextual model is evaluated a second time with the context withheld
(every context feature missing). `--json` writes

    {"recall@10": {"context": x, "no_context": y, "context_withheld": z}, "recall@50": {...}, "recall@100": {...}}

The recipe (both models): context dropout 0.5 in its marginal form (every example's loss is the average of
its loss with and without its context; see `ContextualTwoTowerConfig.context_dropout_mode`), and an item
tower that reads the item id only, so the item vectors learn the category structure from the training
signal; this is where the context's clean signal carries over to requests without context. With
`--item-category` (ablation, its own RESULTS.md section) both item towers also read the category
embedding, get that structure for free, and the context-withheld model is only level with the context-free
one.

Training is the library's one training loop: `jaxscale.training.trainer.Trainer` on a one-device mesh, the model's
synthetic stream from the run config (`data.source: synthetic`), the trainer's dense optimizer (AdamW,
warmup-cosine schedule, gradient clipping) and row-wise AdaGrad on the tables; the trainer carries the
model's non-parameter state (the logQ frequency estimator, the dropout RNG counters) from step to step.
The run is deterministic given --seed (counter-based data, fixed init keys, XLA:CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from jaxscale.infra import atomic

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

KS = (10, 50, 100)
TARGET_RATIO = 2.0


def make_config(args, use_context: bool):
    from jaxscale_models.contextual_two_tower import ContextualTwoTowerConfig

    return ContextualTwoTowerConfig(
        item_rows=args.items,
        num_categories=args.categories,
        item_dim=32,
        d_model=64,
        num_layers=2,
        num_heads=4,
        mlp_ratio=2,
        max_seq_len=args.seq_len,
        context_dim=32,
        context_dropout=args.context_dropout,
        context_dropout_mode=args.context_dropout_mode,
        head_hidden=(128,),
        item_hidden=(128,),
        item_category_feature=args.item_category,
        embed_dim=32,
        temperature=0.05,
        use_context=use_context,
        recall_ks=KS,
    )


def run_config(cfg, args, label: str, workdir: str):
    """The `jaxscale.training.config.Config` of one arm: one device, the planted-context stream, the recipe's
    optimizers and schedule; no in-run evaluation (both arms are evaluated the same way afterwards)."""
    import jaxscale
    from jaxscale.training.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig

    return Config(
        mesh=MeshConfig(nodes=1, local=1),
        model=ModelConfig(kind="contextual_two_tower", sections={"contextual_two_tower": cfg}),
        # capacity_factor 1.0 on one device: every request fits (nothing can overflow) and the exchange has
        # one shape, so the step compiles once instead of once per batch's counted sizes
        embedding=jaxscale.EmbeddingSettings(
            sharding="table_wise", optimizer=jaxscale.RowWiseAdagrad(args.sparse_lr), capacity_factor=1.0
        ),
        data=DataConfig(source="synthetic", seed=args.seed, zipf_exponent=1.1, scramble_ids=True, eval_batches=0),
        train=TrainConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            learning_rate=args.lr,
            warmup_steps=max(1, args.steps // 20),
            weight_decay=0.01,
            grad_clip_norm=1.0,
            eval_every=0,
            checkpoint_every=0,
            log_every=args.log_every,
            seed=args.seed,
            workdir=str(Path(workdir) / label),
        ),
    )


def train(cfg, args, *, label: str, workdir: str):
    """One arm trained by the Trainer: returns (model, collection, table state, [(step, loss)])."""
    import jax
    import numpy as np
    from flax import nnx

    import jaxscale
    from jaxscale.training.trainer import Trainer

    mesh = jaxscale.make_mesh(1, 1, devices=jax.devices()[:1])
    trainer = Trainer(run_config(cfg, args, label, workdir), mesh, progress=False)
    history = trainer.run()
    state = history["final_state"]
    steps, losses = history["steps"], history["losses"]
    curve = [(s, loss) for s, loss in zip(steps, losses) if s == 1 or s % args.log_every == 0 or s == steps[-1]]
    for s, loss in curve:
        print(f"  [{label}] step {s}/{args.steps} loss {loss:.4f}")
    if history["final_step"] != args.steps or not np.isfinite(losses[-1]):
        raise FloatingPointError(f"{label}: training stopped at step {history['final_step']} (loss {losses[-1]})")
    model = nnx.merge(trainer.graphdef, state["dense"], state["rest"])
    return model, trainer.ec, state["emb"], curve


def evaluate(model, ec, emb_state, data, users: int, *, withhold: bool) -> dict:
    """Exact full-corpus Recall@K of `users` held-out requests."""
    import numpy as np

    from jaxscale_models.contextual_two_tower import full_corpus_recall, withhold_context
    from jaxscale_models.two_tower_inference import CorpusEncoder, EndToEndQueryTower

    corpus = CorpusEncoder(model, ec, emb_state)(data.item_category)
    tower = EndToEndQueryTower(model, ec, emb_state)
    queries, labels = [], []
    for step in range(-(-users // data.global_batch)):
        batch = data.batch(step)
        queries.append(tower(withhold_context(batch) if withhold else batch))
        labels.append(batch["label_item"])
    queries, labels = np.concatenate(queries)[:users], np.concatenate(labels)[:users]
    return full_corpus_recall(queries, corpus, labels, KS)


def run(args) -> dict:
    from jaxscale_models.contextual_two_tower_data import SyntheticContextualData

    runs, curves, timings = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="two_tower_compare_") as workdir:  # the runs' final checkpoints
        for name, use_context in (("context", True), ("no_context", False)):
            t0 = time.perf_counter()
            runs[name] = train(make_config(args, use_context), args, label=name, workdir=workdir)
            timings[name] = time.perf_counter() - t0
            curves[name] = runs[name][3]
    eval_data = SyntheticContextualData(make_config(args, True), args.batch_size, args.seed).held_out()
    eval_data = eval_data.with_options(corpus=False)
    recalls = {
        "context": evaluate(*runs["context"][:3], eval_data, args.eval_users, withhold=False),
        "no_context": evaluate(*runs["no_context"][:3], eval_data, args.eval_users, withhold=False),
        "context_withheld": evaluate(*runs["context"][:3], eval_data, args.eval_users, withhold=True),
    }
    table = {f"recall@{k}": {name: recalls[name][f"recall@{k}"] for name in recalls} for k in KS}
    return {"table": table, "curves": curves, "train_seconds": timings}


def render(args, result, machine, load_at_end) -> str:
    from jaxscale.benchmarks.machine import machine_lines

    t = result["table"]
    lines = [
        "## compare.py: contextual vs context-free retrieval (planted-context synthetic data)"
        + (" -- ablation: item tower with the category feature" if args.item_category else ""),
        "",
        f"Command: `python experiments/two_tower/compare.py {' '.join(args.argv)}`".replace(" `", "`").rstrip(),
        "",
        f"Same data stream, seed {args.seed}, {args.steps} steps of batch {args.batch_size} for both models; "
        f"context dropout {args.context_dropout} ({args.context_dropout_mode}); item tower reads "
        f"{'id and category' if args.item_category else 'the item id only'}; "
        f"{args.items} items in {args.categories} categories; exact full-corpus top-K over all {args.items} items "
        f"for {args.eval_users} held-out requests (real request context; 'context withheld' = every context "
        "feature missing).",
        "",
        "| metric | context | no context | ratio context / no context | context withheld | withheld / no context |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in t.items():
        ratio = row["context"] / row["no_context"] if row["no_context"] else float("inf")
        held = row["context_withheld"] / row["no_context"] if row["no_context"] else float("inf")
        lines.append(
            f"| {key} | {row['context']:.4f} | {row['no_context']:.4f} | {ratio:.2f}x | "
            f"{row['context_withheld']:.4f} | {held:.2f}x |"
        )
    r10 = t["recall@10"]
    ok_ratio = r10["context"] >= TARGET_RATIO * r10["no_context"]
    ok_withheld = r10["context_withheld"] >= r10["no_context"]
    lines += [
        "",
        f"- contextual Recall@10 >= {TARGET_RATIO:g}x the context-free model's: **{'yes' if ok_ratio else 'NO'}**",
        f"- with context withheld, Recall@10 at least the context-free level: **{'yes' if ok_withheld else 'NO'}**",
        "- training loss (first -> last logged): "
        + "; ".join(f"{n} {c[0][1]:.3f} -> {c[-1][1]:.3f}" for n, c in result["curves"].items()),
        "- training time: " + ", ".join(f"{n} {s:.0f} s" for n, s in result["train_seconds"].items()),
        *machine_lines(machine, load_at_end),
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the recall table as JSON here")
    p.add_argument("--results", default=None, help="RESULTS.md to update (default: next to this script; 'none')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--items", type=int, default=2000)
    p.add_argument("--categories", type=int, default=50)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--eval-users", type=int, default=16384)
    p.add_argument("--lr", type=float, default=3e-3, help="dense (adamw) peak learning rate")
    p.add_argument("--sparse-lr", type=float, default=0.05, help="tables (row-wise AdaGrad) learning rate")
    p.add_argument("--context-dropout", type=float, default=0.5)
    p.add_argument("--context-dropout-mode", default="marginal", choices=("sample", "marginal"))
    p.add_argument(
        "--item-category",
        action="store_true",
        help="ablation: the item tower also reads the category embedding (recorded as section compare_item_category)",
    )
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name in ("steps", "batch_size", "items", "categories", "eval_users", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.items < max(KS):
        p.error(f"--items must be >= {max(KS)} (Recall@{max(KS)} ranks the whole corpus)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from results import RESULTS, machine, write_section

    m = machine()
    result = run(args)
    t = result["table"]
    print(f"\n{'':12s} {'context':>10s} {'no_context':>10s} {'ratio':>7s} {'withheld':>10s}")
    for key, row in t.items():
        ratio = row["context"] / row["no_context"] if row["no_context"] else float("inf")
        print(
            f"{key:12s} {row['context']:10.4f} {row['no_context']:10.4f} {ratio:6.2f}x {row['context_withheld']:10.4f}"
        )
    if args.json:
        atomic.write_json(args.json, t)
        print(f"wrote {args.json}")
    if args.results != "none":
        section = "compare_item_category" if args.item_category else "compare"
        path = write_section(section, render(args, result, m, os.getloadavg()), Path(args.results or RESULTS))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
