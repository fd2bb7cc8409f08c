"""Full-corpus ranking evaluation: every held-out user scored against every item, the standard protocol.

    python -m jaxscale.evaluate --config C --checkpoint DIR --split valid|test --k 10,20 --json OUT \\
        [--topk FILE.parquet] [key=value ...]

For each example of the split (a leave-one-out split has one per user: its held-out event), the model's
`ModelSpec.score` scores every candidate item (the whole item table, sharded like training: the corpus is
looked up through the engine and the scores are computed on the mesh), the top K come back to the host,
and Recall@K (= hit rate: one target per user), NDCG@K and MRR@K are averaged over the examples
(`jaxscale.ranking`). Items of the user's history are NOT masked: an item the user already rated stays a
candidate (the protocol RecBole and most papers report as "full ranking"; masking them raises every number).
Ties in score rank the lower item index first, on device and in the reference alike.

A popularity baseline is scored by the same code: every user gets the items ranked by how often they occur
in the train split (ties: lower index first).

`--checkpoint` is a run directory (its `checkpoints/` or `best/`), or a checkpoints directory; the latest
complete checkpoint is restored (`--step` picks another). The JSON:

    {"split": "test", "examples": 943, "candidates": 1682, "k": [10, 20], "checkpoint": ..., "step": ...,
     "metrics": {"recall@10": ..., "ndcg@10": ..., "mrr@10": ..., ...}, "popularity": {...}}

`--topk` writes Parquet rows (user_id: the raw id, rank: 1..K, item_id: the raw id) for every example.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxscale import atomic, ranking
from jaxscale.ranking_eval import DEFAULT_KS, RankingEvaluator, RankingResult, examples_of


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


def popularity(cfg, source, ks: Sequence[int] = DEFAULT_KS) -> RankingResult:
    """The popularity baseline on `source`'s examples: every user gets the items ranked by their count in the
    train split (leave-one-out: every event except the valid and test targets); reserved rows never rank."""
    from jaxscale.data import make_data

    examples = examples_of(source)
    if getattr(examples, "split_mode", "day") != "leave_one_out":
        raise ValueError("the popularity baseline needs data.sequences.split: leave_one_out")
    mcfg = cfg.model.params
    rows = mcfg.item_rows
    held_out = [source if examples.split == s else make_data(cfg, split=s) for s in ("valid", "test")]
    counts = train_item_counts(held_out, rows)
    scores = ranking.popularity_scores(counts).astype(np.float64)
    scores[: getattr(mcfg, "reserved_rows", 0)] = -np.inf
    ks = tuple(sorted(set(ks)))
    top = ranking.topk_from_scores(scores[None], max(ks))[0]
    target = target_items(examples)
    topk = np.repeat(top[None], len(examples), axis=0)
    users = np.asarray(examples.users, np.int64)
    return RankingResult(users, target, topk, ranking.ranking_metrics(topk, target, ks), int(np.isfinite(scores).sum()))


def item_decoder(examples):
    """item row -> raw item id: the store's vocabulary when it has one, else the identity."""
    reader = getattr(examples, "reader", None)
    vocab = reader.vocabulary("item_id") if reader is not None and hasattr(reader, "vocabulary") else None
    if vocab is None:
        return lambda rows: np.asarray(rows, np.int64)
    return vocab.decode


def write_topk(path, result: RankingResult, decode) -> None:
    """Parquet rows (user_id raw, rank 1..K, item_id raw), written atomically."""
    import pyarrow as pa

    from jaxscale.sequences.store import write_table

    u, k = result.topk.shape
    table = pa.table(
        {
            "user_id": np.repeat(result.users, k),
            "rank": np.tile(np.arange(1, k + 1, dtype=np.int32), u),
            "item_id": np.asarray(decode(result.topk.reshape(-1)), np.int64),
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
    from jaxscale.checkpoint import Checkpointer

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
    ap.add_argument("--popularity-only", action="store_true", help="only the popularity baseline (no checkpoint)")
    ap.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    from jaxscale.config import ConfigError, load_config

    try:
        ks = parse_ks(args.k)
        cfg = load_config(args.config, args.overrides)
        if not args.checkpoint and not args.popularity_only:
            raise ValueError("--checkpoint is required (unless --popularity-only)")
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not _backends_started():  # a fresh process (the CLI): the simulated CPU device count, as the trainer
        from jaxscale import distributed

        distributed.initialize(None, None, None, local_devices=cfg.mesh.nodes * cfg.mesh.local)
    try:
        if args.popularity_only:
            result = evaluate_popularity(cfg, args.split, ks, topk=args.topk)
        else:
            result = evaluate_checkpoint(
                cfg, args.checkpoint, args.split, ks, step=args.step, topk=args.topk, baseline=not args.no_popularity
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


def evaluate_checkpoint(cfg, checkpoint, split: str, ks=DEFAULT_KS, *, step=None, topk=None, baseline=True) -> dict:
    """Restores a run's checkpoint and ranks the whole corpus for every example of `split`: the JSON dict."""
    from jaxscale.data import make_data
    from jaxscale.trainer import Trainer

    checkpoints = find_checkpoints(checkpoint)
    trainer = Trainer(cfg, workdir=str(checkpoints.parent), progress=False, log=False)
    source = make_data(cfg, split=split, process_index=trainer.process_index, process_count=trainer.process_count)
    state, restored = restore(trainer, checkpoints, step)
    ev = RankingEvaluator(trainer, ks)
    result = ev.evaluate(state, source)
    out = {"split": split, "k": list(ev.ks), "checkpoint": str(checkpoints), "step": restored, **result.to_json()}
    if baseline:
        out["popularity"] = popularity(cfg, source, ev.ks).metrics
    if topk:
        write_topk(topk, result, item_decoder(examples_of(source)))
        out["topk"] = str(topk)
    return out


def evaluate_popularity(cfg, split: str, ks=DEFAULT_KS, *, topk=None) -> dict:
    """The popularity baseline alone on `split` (no model): the JSON dict (its metrics under "popularity")."""
    from jaxscale.data import make_data

    source = make_data(cfg, split=split)
    result = popularity(cfg, source, ks)
    out = {"split": split, "k": sorted(set(ks)), **result.to_json(), "popularity": result.metrics}
    if topk:
        write_topk(topk, result, item_decoder(examples_of(source)))
        out["topk"] = str(topk)
    return out


if __name__ == "__main__":
    sys.exit(main())
