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

Training uses a direct loop over the model's `ModelSpec` (its tables, ids, build, loss) and a real
`EmbeddingCollection` on one device rather than the Trainer, because (1) the loop carries the model's
non-parameter state from step to step (the logQ frequency estimator and the dropout RNG counters; the
Trainer currently resets them every step) and (2) one device avoids the cost of eight simulated CPU devices
on a small machine. The run is deterministic given --seed (counter-based data, fixed init keys, XLA:CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from jaxscale import atomic

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


def train(cfg, data, *, steps: int, seed: int, lr: float, sparse_lr: float, log_every: int, label: str):
    """Direct training loop: returns (model, collection, table state, [(step, loss)])."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxscale
    from jaxscale.data import to_global
    from jaxscale_models.contextual_two_tower import SPEC

    mesh = jaxscale.make_mesh(1, 1, devices=jax.devices()[:1])
    ec = jaxscale.EmbeddingCollection(
        SPEC.tables(cfg),
        mesh,
        jaxscale.EmbeddingSettings(sharding="table_wise", optimizer=jaxscale.RowWiseAdagrad(sparse_lr)),
    )
    model = SPEC.build(cfg, nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), max(steps, 2), lr * 0.1)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt = tx.init(params)
    emb_state = ec.init(jax.random.key(seed))

    def step_fn(params, rest, opt, emb_state, ids, batch):
        emb = ec.lookup(emb_state, ids)

        def loss_fn(params, emb):
            m = nnx.merge(graphdef, params, rest, copy=True)  # fresh variables: the loss may update them
            loss, _ = SPEC.loss(m, emb, batch)
            _, _, new_rest = nnx.split(m, nnx.Param, ...)  # estimator arrays, RNG counters: carried forward
            return loss, new_rest

        (loss, new_rest), (g_params, g_emb) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(params, emb)
        updates, opt = tx.update(g_params, opt, params)
        params = optax.apply_updates(params, updates)
        return params, new_rest, opt, ec.update(emb_state, ids, g_emb), loss

    step_jit = jax.jit(step_fn, donate_argnums=(0, 1, 2, 3))
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        host = data.batch(step)
        # plain (checked) id arrays: one shape, so one compilation (the exchange is sized for the worst case,
        # free on one device)
        ids = to_global(ec.validate_ids(SPEC.ids(cfg, host)), mesh)
        batch = to_global(host, mesh)
        params, rest, opt, emb_state, loss = step_jit(params, rest, opt, emb_state, ids, batch)
        if (step + 1) % log_every == 0 or step == 0 or step + 1 == steps:
            losses.append((step + 1, float(loss)))
            print(f"  [{label}] step {step + 1}/{steps} loss {losses[-1][1]:.4f} ({time.perf_counter() - t0:.0f} s)")
    model = nnx.merge(graphdef, params, rest)
    if not np.isfinite(losses[-1][1]):
        raise FloatingPointError(f"{label}: training diverged (loss {losses[-1][1]})")
    return model, ec, emb_state, losses


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
    for name, use_context in (("context", True), ("no_context", False)):
        cfg = make_config(args, use_context)
        data = SyntheticContextualData(cfg, args.batch_size, args.seed)
        t0 = time.perf_counter()
        runs[name] = train(
            cfg,
            data,
            steps=args.steps,
            seed=args.seed,
            lr=args.lr,
            sparse_lr=args.sparse_lr,
            log_every=args.log_every,
            label=name,
        )
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
    from results import machine_lines

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
