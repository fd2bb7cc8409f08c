"""Full-corpus ranking of a held-out split with a trainer's model, on the mesh: what the trainer's evaluation
(`train.eval_ranking_ks`) and the `python -m jaxscale.evaluate` CLI share. The metrics are `jaxscale.ranking`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxscale import ranking

DEFAULT_KS = (10, 20)


@dataclasses.dataclass(frozen=True)
class RankingResult:
    """What one evaluation found: per-example top-K item rows, targets and raw user ids, and the metrics."""

    users: np.ndarray  # int64 [U] raw user ids
    targets: np.ndarray  # int64 [U] item row of each held-out item
    topk: np.ndarray  # int64 [U, K] item rows, best first
    metrics: dict
    candidates: int

    def to_json(self) -> dict:
        return {"examples": int(len(self.users)), "candidates": self.candidates, "metrics": self.metrics}


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

    def __init__(self, trainer, ks: Sequence[int] = DEFAULT_KS):
        import jax

        if trainer.spec.score is None:
            raise ValueError(f"model kind {trainer.spec.kind!r} registers no `score`: it cannot rank a corpus")
        self.trainer, self.ks = trainer, tuple(sorted(set(int(k) for k in ks)))
        self.top = max(self.ks)
        self._step = jax.jit(self._make_step())

    def _make_step(self):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        tr, top = self.trainer, self.top

        def rank_step(state, batch, ids):
            emb = tr.ec.lookup(state["emb"], ids)
            model = nnx.merge(tr.graphdef, state["dense"], state["rest"])
            model.eval()
            scores, target = tr.spec.score(model, emb, batch)
            _, best = jax.lax.top_k(scores, top)
            candidates = jnp.sum(jnp.isfinite(scores[:1]))
            return best.astype(jnp.int32), target.astype(jnp.int32), candidates

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
        tops, targets, candidates = [], [], 0
        for start in range(0, n, gb):
            rows = [min(start + i, n - 1) for i in range(lo, lo + local)]  # pad with the last example
            items = [examples[i] for i in rows]
            host = {k: np.stack([it[k] for it in items]) for k in items[0]}
            if hasattr(source, "corpus_keys"):  # a model whose candidates ride in the batch (two-tower)
                host.update(source.corpus_keys(np.arange(lo, lo + local)))
            batch = tr.prepare(host)
            best, target, cand = self._step(state, batch.data, batch.ids)
            tops.append(_gather(best))
            targets.append(_gather(target))
            candidates = int(_gather(cand))
        topk = np.concatenate(tops)[:n].astype(np.int64)
        target = np.concatenate(targets)[:n].astype(np.int64)
        users = np.asarray(examples.users, np.int64)
        metrics = ranking.ranking_metrics(topk, target, self.ks)
        return RankingResult(users, target, topk, metrics, candidates)


def _gather(x) -> np.ndarray:
    """A global array's value on every process (a process_allgather where the batch spans processes)."""
    import jax

    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
