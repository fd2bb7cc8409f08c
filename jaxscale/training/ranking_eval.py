"""Full-corpus ranking of a held-out split with a trainer's model, on the mesh: what the trainer's evaluation
(`train.eval_ranking_ks`) and the `python -m jaxscale.evaluate` CLI share. The metrics are `training.ranking`'s.

Both common protocols come out of one pass: the scores of a batch are ranked once as they are and once with
every item of the user's history removed (`mask_history`; the whole history before the target, not only the
model's window). The run's protocol (`data.sequences.protocol` / `mask_history`) says which of the two is the
result; the other is reported beside it (`other_metrics`), so no comparison mixes the two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxscale.training import ranking

DEFAULT_KS = (10, 20)


@dataclasses.dataclass(frozen=True)
class RankingResult:
    """What one evaluation found: per-example top-K item rows, targets and raw user ids, and the metrics."""

    users: np.ndarray  # int64 [U] raw user ids
    targets: np.ndarray  # int64 [U] item row of each held-out item
    topk: np.ndarray  # int64 [U, K] item rows, best first
    metrics: dict
    candidates: int
    mask_history: bool = False
    """Whether `topk` and `metrics` exclude every item of the user's history."""
    other_metrics: dict | None = None
    """The same examples ranked the other way (masked when `mask_history` is False, unmasked when True)."""

    def to_json(self) -> dict:
        out = {
            "examples": int(len(self.users)),
            "candidates": self.candidates,
            "mask_history": self.mask_history,
            "metrics": self.metrics,
        }
        if self.other_metrics is not None:
            out["metrics_other_masking"] = self.other_metrics
        return out


def history_masks(cfg) -> bool:
    """Whether a run's rankings mask the user's history: `data.sequences.mask_history`, else its protocol's."""
    seq = getattr(getattr(cfg, "data", None), "sequences", None)
    return bool(getattr(seq, "masks_history", False)) if cfg.data.source == "sequences" else False


def can_mask(examples) -> bool:
    """Whether an example source knows each example's whole history (a leave-one-out sequence source)."""
    return hasattr(examples, "seen_mask") and getattr(examples, "split_mode", None) == "leave_one_out"


def examples_of(source):
    """The random-access examples behind a trainer data source (a `SequenceBatches`' `source`)."""
    examples = getattr(source, "source", source)
    if not (hasattr(examples, "__getitem__") and hasattr(examples, "__len__") and hasattr(examples, "anchor")):
        raise ValueError(
            f"full-corpus evaluation needs a random-access example source (data.source: sequences), "
            f"got {type(source).__name__}"
        )
    return examples


class RankingEvaluator:
    """Scores every example of a random-access source against the whole corpus with a trainer's model.

    Each global batch of `train.batch_size` examples is prepared like a training batch (engine ids checked and
    sized on the host, placed over the mesh); the last one is padded by repeating its final example, and the
    padded rows are dropped on the host. In a multi-process run each process prepares its own rows of each
    batch and the results are gathered, so every process computes the same metrics.
    """

    def __init__(self, trainer, ks: Sequence[int] = DEFAULT_KS, *, mask_history: bool | None = None):
        import jax

        if trainer.spec.score is None:
            raise ValueError(f"model kind {trainer.spec.kind!r} registers no `score`: it cannot rank a corpus")
        self.trainer, self.ks = trainer, tuple(sorted(set(int(k) for k in ks)))
        self.top = max(self.ks)
        self.mask_history = history_masks(trainer.cfg) if mask_history is None else bool(mask_history)
        self._step = jax.jit(self._make_step())

    def _make_step(self):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        tr, top = self.trainer, self.top

        def top_rows(scores):
            value, best = jax.lax.top_k(scores, top)
            return jnp.where(jnp.isfinite(value), best, -1).astype(jnp.int32)  # fewer candidates than K: -1

        def rank_step(state, batch, ids, seen):
            emb = tr.ec.lookup(state["emb"], ids)
            model = nnx.merge(tr.graphdef, state["dense"], state["rest"])
            model.eval()
            scores, target = tr.spec.score(model, emb, batch)
            candidates = jnp.sum(jnp.isfinite(scores[:1]))
            if seen is None:
                return top_rows(scores), None, target.astype(jnp.int32), candidates
            if seen.shape != scores.shape:
                raise ValueError(f"history mask {seen.shape} does not match the scores {scores.shape}")
            return top_rows(scores), top_rows(jnp.where(seen, -jnp.inf, scores)), target.astype(jnp.int32), candidates

        return rank_step

    def evaluate(self, state, source) -> RankingResult:
        tr = self.trainer
        examples = examples_of(source)
        n = len(examples)
        if n == 0:
            raise ValueError("the split has no example to evaluate")
        gb = tr.cfg.train.batch_size
        local = gb // tr.process_count
        lo = tr.process_index * local
        both = can_mask(examples)
        if self.mask_history and not both:
            raise ValueError(
                "masking the history (data.sequences.protocol / mask_history) needs a leave-one-out sequence source"
            )
        tops, masked, targets, candidates = [], [], [], 0
        for start in range(0, n, gb):
            rows = [min(start + i, n - 1) for i in range(lo, lo + local)]  # pad with the last example
            items = [examples[i] for i in rows]
            host = {k: np.stack([it[k] for it in items]) for k in items[0]}
            if hasattr(source, "corpus_keys"):  # a model whose candidates ride in the batch (two-tower)
                host.update(source.corpus_keys(np.arange(lo, lo + local)))
            batch = tr.prepare(host)
            seen = None
            if both:
                from jaxscale.training.data import to_global

                seen = to_global({"seen": examples.seen_mask(rows, self._num_items())}, tr.mesh)["seen"]
            best, best_masked, target, cand = self._step(state, batch.data, batch.ids, seen)
            tops.append(_gather(best))
            if both:
                masked.append(_gather(best_masked))
            targets.append(_gather(target))
            candidates = int(_gather(cand))
        plain = np.concatenate(tops)[:n].astype(np.int64)
        target = np.concatenate(targets)[:n].astype(np.int64)
        users = np.asarray(examples.users, np.int64)
        lists = {False: plain, True: np.concatenate(masked)[:n].astype(np.int64) if both else None}
        topk = lists[self.mask_history]
        other = lists[not self.mask_history]
        metrics = ranking.ranking_metrics(topk, target, self.ks)
        other_metrics = None if other is None else ranking.ranking_metrics(other, target, self.ks)
        return RankingResult(users, target, topk, metrics, candidates, self.mask_history, other_metrics)

    def _num_items(self) -> int:
        """The width of the model's score rows: its item table (`item_rows` of the model config)."""
        rows = getattr(self.trainer.model_cfg, "item_rows", None)
        if rows is None:
            raise ValueError(f"model kind {self.trainer.spec.kind!r} has no item_rows: its history cannot be masked")
        return int(rows)


def _gather(x) -> np.ndarray:
    """A global array's value on every process (a process_allgather where the batch spans processes)."""
    import jax

    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
