"""Full-corpus ranking evaluation: every held-out user scored against every item, the standard protocol.

    python -m jaxscale.evaluate --config C --checkpoint DIR --split valid|test --k 10,20 --json OUT \\
        [--topk FILE.parquet] [key=value ...]

For each example of the split (a leave-one-out split has one per user: its held-out event), the model's
`ModelSpec.score` scores every candidate item (the whole item table, sharded like training: the corpus is
looked up through the engine and the scores are computed on the mesh), the top K come back to the host,
and Recall@K (= hit rate: one target per user), NDCG@K and MRR@K are averaged over the examples
(`jaxscale.training.ranking`). Whether items of the user's history are candidates is the protocol's choice:
`--mask-history` removes every item the user interacted with before the target (the SASRec / BERT4Rec
replications' protocol), `--no-mask-history` keeps them (RecBole's "full ranking"); the default is the
config's `data.sequences.protocol` / `mask_history`. Both are computed in the same pass: `metrics` is the
chosen one and `metrics_other_masking` the other, so no comparison mixes the two. Ties in score rank the
lower item index first, on device and in the reference alike.

Baselines, scored by the same code and under the same masking (`--baseline NAME` scores one alone, with no
checkpoint; `--popularity-only` is `--baseline popularity`):
- `popularity`: every user gets the items ranked by how often they occur in the train split (ties: lower
  index first);
- `genre_hint`: the items whose category equals the example's context category (the contextual two-tower's
  test context: the held-out item's first genre) ranked by train-split count, then every other item by
  count; no model, exactly the context the two-tower gets at test (a config of that model is needed).

`--checkpoint` is a run directory (its `checkpoints/` or `best/`), or a checkpoints directory; the latest
complete checkpoint is restored (`--step` picks another). The JSON:

    {"split": "test", "examples": 943, "candidates": 1682, "k": [10, 20], "checkpoint": ..., "step": ...,
     "mask_history": false, "metrics": {"recall@10": ..., "ndcg@10": ..., "mrr@10": ..., ...},
     "metrics_other_masking": {...}, "popularity": {...}, "popularity_other_masking": {...}}

`--topk` writes Parquet rows (user_id, rank: 1..K, item_id) of the chosen masking for every example, in the
source's raw ids: the store's ids, or, with `--raw-ids IMPORT_DIR` (an import whose source ids were strings,
e.g. MovieLens-1M's `1m_1` and titles), the source's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxscale.infra import atomic
from jaxscale.training import ranking
from jaxscale.training.ranking_eval import DEFAULT_KS, RankingResult, can_mask, examples_of, history_masks


def parse_ks(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(k) for k in str(text).split(","))
    except ValueError:
        raise ValueError(f"--k takes comma-separated positive integers, got {text!r}") from None
    if not ks or min(ks) < 1:
        raise ValueError(f"--k takes comma-separated positive integers, got {text!r}")
    return tuple(sorted(set(ks)))


def target_items(examples) -> np.ndarray:
    """The item row of every example's target, in example order (vectorised per partition)."""
    parts = examples.reader.partitions
    out = np.full(len(examples), -1, np.int64)
    for k in np.unique(examples.anchor_part):
        at = np.flatnonzero(examples.anchor_part == k)
        out[at] = examples._model_columns(parts[int(k)])["item_ids"][examples.anchor_row[at]]
    return out


def train_item_counts(held_out: Sequence, rows: int) -> np.ndarray:
    """How often each item row occurs among the train split's events: every stored event of the sequence
    minus the held-out targets (a leave-one-out split's valid and test examples, given as `held_out`)."""
    first = examples_of(held_out[0])
    counts = np.zeros(rows, np.int64)
    for part in first.reader.partitions:
        ids = np.asarray(first._model_columns(part)["item_ids"], np.int64)
        counts += np.bincount(ids[(ids >= 0) & (ids < rows)], minlength=rows)
    for source in held_out:
        ids = target_items(examples_of(source))
        counts -= np.bincount(ids[(ids >= 0) & (ids < rows)], minlength=rows)
    assert counts.min() >= 0, "a held-out target is not a stored event"
    return counts


BASELINES = ("popularity", "genre_hint")


def _train_counts(cfg, source) -> np.ndarray:
    """Train-split counts of every item row (a leave-one-out source's examples; see `train_item_counts`)."""
    from jaxscale.training.data import make_data

    examples = examples_of(source)
    if getattr(examples, "split_mode", "day") != "leave_one_out":
        raise ValueError("the baselines need data.sequences.split: leave_one_out")
    held_out = [source if examples.split == s else make_data(cfg, split=s) for s in ("valid", "test")]
    return train_item_counts(held_out, cfg.model.params.item_rows)


def _rank(examples, scores: np.ndarray, ks, mask_history: bool) -> RankingResult:
    """A baseline's result from its host scores ([N] for every user alike, or [U, N]; -inf never ranks), both
    maskings computed (the chosen one in `metrics`, the other in `other_metrics`)."""
    ks = tuple(sorted(set(ks)))
    k, n = max(ks), len(examples)
    target = target_items(examples)
    users = np.asarray(examples.users, np.int64)
    per_user = np.broadcast_to(scores, (n, scores.shape[-1]))
    plain = ranking.topk_from_scores(per_user, k, exclude=~np.isfinite(per_user))
    masked = None
    if can_mask(examples):
        seen = examples.seen_mask(np.arange(n), scores.shape[-1])
        masked = ranking.topk_from_scores(per_user, k, exclude=seen | ~np.isfinite(per_user))
    elif mask_history:
        raise ValueError("masking the history needs a leave-one-out sequence source")
    lists = {False: plain, True: masked}
    topk, other = lists[mask_history], lists[not mask_history]
    metrics = ranking.ranking_metrics(topk, target, ks)
    other_metrics = None if other is None else ranking.ranking_metrics(other, target, ks)
    candidates = int(np.isfinite(per_user[0]).sum()) if n else 0
    return RankingResult(users, target, topk, metrics, candidates, mask_history, other_metrics)


def popularity(cfg, source, ks: Sequence[int] = DEFAULT_KS, *, mask_history: bool | None = None) -> RankingResult:
    """The popularity baseline on `source`'s examples: every user gets the items ranked by their count in the
    train split (leave-one-out: every event except the valid and test targets); reserved rows never rank."""
    counts = _train_counts(cfg, source)
    scores = ranking.popularity_scores(counts).astype(np.float64)
    scores[: getattr(cfg.model.params, "reserved_rows", 0)] = -np.inf
    mask = history_masks(cfg) if mask_history is None else bool(mask_history)
    return _rank(examples_of(source), scores, ks, mask)


def genre_hint(cfg, source, ks: Sequence[int] = DEFAULT_KS, *, mask_history: bool | None = None) -> RankingResult:
    """The context's own answer without a model: items whose category is the example's context category
    (what the contextual two-tower is given at test), ranked by train-split count, then the other items by
    count. An example without a context (-1) gets the popularity ranking."""
    examples = examples_of(source)
    if not hasattr(examples, "catalogue"):
        raise ValueError(
            "the genre_hint baseline needs a source with item categories and a request context "
            "(a contextual_two_tower config with data.source: sequences)"
        )
    counts = _train_counts(cfg, source).astype(np.float64)
    rows = len(counts)
    category, _ = examples.catalogue(rows)
    context = np.array([int(examples[i]["context_category"]) for i in range(len(examples))], np.int64)
    bonus = counts.max(initial=0.0) + 1.0  # a hinted item outranks every other one; counts order within each
    scores = counts[None] + bonus * ((context[:, None] >= 0) & (category[None] == context[:, None]))
    scores[:, : getattr(cfg.model.params, "reserved_rows", 0)] = -np.inf
    mask = history_masks(cfg) if mask_history is None else bool(mask_history)
    return _rank(examples, scores, ks, mask)


def item_decoder(examples):
    """item row -> raw item id: the store's vocabulary when it has one, else the identity."""
    reader = getattr(examples, "reader", None)
    vocab = reader.vocabulary("item_id") if reader is not None and hasattr(reader, "vocabulary") else None
    if vocab is None:
        return lambda rows: np.asarray(rows, np.int64)
    return vocab.decode


def write_topk(path, result: RankingResult, decode, raw_ids=None) -> None:
    """Parquet rows (user_id, rank 1..K, item_id) in raw ids, written atomically. `raw_ids`: the import's
    mapping to the source's own ids (`jaxscale.sequences.movielens.RawIds`) when those were strings. A row
    with fewer than K candidates ends early (no row for a missing rank)."""
    import pyarrow as pa

    from jaxscale.sequences.store import write_table

    u, k = result.topk.shape
    flat = result.topk.reshape(-1)
    keep = flat >= 0
    users = np.repeat(result.users, k)[keep]
    items = np.asarray(decode(flat[keep]), np.int64)
    if raw_ids is not None:
        users, items = raw_ids.users(users), raw_ids.items(items)
    table = pa.table(
        {
            "user_id": pa.array(users),
            "rank": np.tile(np.arange(1, k + 1, dtype=np.int32), u)[keep],
            "item_id": pa.array(items),
        }
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_table(path, table)


def find_checkpoints(path) -> Path:
    """The checkpoints directory `--checkpoint` names: a run directory (its `checkpoints/`), a run's best
    checkpoint (`<run>/best`, holding `checkpoints/`), or a `checkpoints/` directory itself."""
    p = Path(path).absolute()
    if not p.exists():
        raise FileNotFoundError(f"--checkpoint {path}: no such directory")
    if (p / "checkpoints").is_dir():
        return p / "checkpoints"
    if p.name == "checkpoints":
        return p
    raise FileNotFoundError(f"--checkpoint {path}: neither a run directory (with checkpoints/) nor a checkpoints dir")


def restore(trainer, checkpoints: Path, step: int | None = None):
    """(state, step): the trainer's state restored from a checkpoints directory (latest complete step by
    default), resharded onto the trainer's mesh and layout."""
    from jaxscale.training.checkpoint import Checkpointer

    ck = Checkpointer(checkpoints.parent, process_index=trainer.process_index, process_count=trainer.process_count)
    if not ck.steps():
        raise FileNotFoundError(f"no complete checkpoint in {checkpoints}")
    template = trainer.init_state()
    state, meta, _ = ck.restore(template, trainer._meta(template), trainer.ec, step)
    return state, int(meta["step"])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxscale.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the run's YAML config")
    ap.add_argument("--checkpoint", help="run directory, or its checkpoints/ or best/ directory")
    ap.add_argument("--split", required=True, choices=("valid", "test"))
    ap.add_argument("--k", default="10,20", help="cut-offs, comma-separated (default 10,20)")
    ap.add_argument("--json", required=True, help="output JSON path")
    ap.add_argument("--topk", default=None, help="write each example's top-K (raw ids) to this Parquet file")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest complete one)")
    ap.add_argument("--no-popularity", action="store_true", help="skip the popularity baseline")
    ap.add_argument("--baseline", choices=BASELINES, default=None, help="score only this baseline (no checkpoint)")
    ap.add_argument("--popularity-only", action="store_true", help="the same as --baseline popularity")
    ap.add_argument(
        "--mask-history",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="remove every item of the user's history from its candidates (default: the config's protocol)",
    )
    ap.add_argument(
        "--raw-ids", default=None, metavar="IMPORT_DIR", help="write --topk in the source ids of this import"
    )
    ap.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    from jaxscale.training.config import ConfigError, load_config

    baseline = "popularity" if args.popularity_only else args.baseline
    try:
        ks = parse_ks(args.k)
        cfg = load_config(args.config, args.overrides)
        if not args.checkpoint and baseline is None:
            raise ValueError("--checkpoint is required (unless --baseline NAME or --popularity-only)")
        raw_ids = _raw_ids(args.raw_ids)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not _backends_started():  # a fresh process (the CLI): the simulated CPU device count, as the trainer
        from jaxscale.infra import distributed

        distributed.initialize(None, None, None, local_devices=cfg.mesh.nodes * cfg.mesh.local)
    try:
        options = {"topk": args.topk, "mask_history": args.mask_history, "raw_ids": raw_ids}
        if baseline is not None:
            result = evaluate_baseline(cfg, baseline, args.split, ks, **options)
        else:
            result = evaluate_checkpoint(
                cfg, args.checkpoint, args.split, ks, step=args.step, baseline=not args.no_popularity, **options
            )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)

    atomic.write_json(out, result)
    print(json.dumps(result))
    return 0


def _backends_started() -> bool:
    """Whether JAX already runs here (main() called in a process that used JAX: its devices are set)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _raw_ids(import_dir):
    """The import's mapping to its source's string ids (None: no mapping given, or the source's ids were ints)."""
    if import_dir is None:
        return None
    from jaxscale.sequences.movielens import RawIds

    if not Path(import_dir).is_dir():
        raise FileNotFoundError(f"--raw-ids {import_dir}: no such directory (an import's output)")
    return RawIds.load(import_dir)


def evaluate_checkpoint(
    cfg, checkpoint, split: str, ks=DEFAULT_KS, *, step=None, topk=None, baseline=True, mask_history=None, raw_ids=None
) -> dict:
    """Restores a run's checkpoint and ranks the whole corpus for every example of `split`: the JSON dict."""
    from jaxscale.training.data import make_data
    from jaxscale.training.ranking_eval import RankingEvaluator
    from jaxscale.training.trainer import Trainer

    checkpoints = find_checkpoints(checkpoint)
    trainer = Trainer(cfg, workdir=str(checkpoints.parent), progress=False, log=False)
    source = make_data(cfg, split=split, process_index=trainer.process_index, process_count=trainer.process_count)
    state, restored = restore(trainer, checkpoints, step)
    ev = RankingEvaluator(trainer, ks, mask_history=mask_history)
    result = ev.evaluate(state, source)
    out = {"split": split, "k": list(ev.ks), "checkpoint": str(checkpoints), "step": restored, **result.to_json()}
    if baseline:
        pop = popularity(cfg, source, ev.ks, mask_history=ev.mask_history)
        out["popularity"] = pop.metrics
        if pop.other_metrics is not None:
            out["popularity_other_masking"] = pop.other_metrics
    if topk:
        write_topk(topk, result, item_decoder(examples_of(source)), raw_ids)
        out["topk"] = str(topk)
    return out


def evaluate_baseline(cfg, name: str, split: str, ks=DEFAULT_KS, *, topk=None, mask_history=None, raw_ids=None) -> dict:
    """One baseline alone on `split` (no model): the JSON dict (its metrics also under its name)."""
    from jaxscale.training.data import make_data

    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; the baselines are {list(BASELINES)}")
    source = make_data(cfg, split=split)
    result = {"popularity": popularity, "genre_hint": genre_hint}[name](cfg, source, ks, mask_history=mask_history)
    out = {"split": split, "k": sorted(set(ks)), "baseline": name, **result.to_json(), name: result.metrics}
    if topk:
        write_topk(topk, result, item_decoder(examples_of(source)), raw_ids)
        out["topk"] = str(topk)
    return out


def evaluate_popularity(cfg, split: str, ks=DEFAULT_KS, *, topk=None, mask_history=None, raw_ids=None) -> dict:
    """The popularity baseline alone on `split` (no model): the JSON dict (its metrics under "popularity")."""
    return evaluate_baseline(cfg, "popularity", split, ks, topk=topk, mask_history=mask_history, raw_ids=raw_ids)


if __name__ == "__main__":
    sys.exit(main())
