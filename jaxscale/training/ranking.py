"""Ranking metrics of next-item recommendation: top-K lists from scores, Recall / NDCG / MRR at k, the
popularity baseline, and a classifier's ROC AUC. Pure NumPy (no JAX), so an evaluator can run it on any host.

The protocol is full ranking with one held-out target per user (leave-one-out): every item of the corpus is
a candidate, and the items of the user's history are NOT masked (a user's already-seen items stay
candidates; mask them yourself through `exclude` for the other common protocol). Ties in score are broken
by the lower item index, so every list is deterministic.

    top = topk_from_scores(scores, k=20)           # [U, 20] item indices, best first
    ranking_metrics(top, targets, ks=(10, 20))     # {'recall@10': ..., 'ndcg@10': ..., 'mrr@10': ..., ...}
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "auc",
    "item_counts",
    "paired_bootstrap",
    "popularity_scores",
    "popularity_topk",
    "ranking_metrics",
    "target_ranks",
    "topk_from_scores",
    "user_ndcg",
]

CHUNK_ELEMENTS = 1 << 22
"""`topk_from_scores` works on row blocks of about this many scores (its temporaries are a few blocks)."""


def _exclusion_mask(exclude, rows: slice, n_users: int, n_items: int) -> np.ndarray | None:
    """bool [rows, N] (True = excluded) of `exclude` rows `rows` (see `topk_from_scores`)."""
    if exclude is None:
        return None
    ex = np.asarray(exclude)
    if ex.dtype == bool:
        if ex.ndim == 1:
            return np.broadcast_to(ex, (rows.stop - rows.start, n_items))
        return ex[rows]
    ex = ex.astype(np.int64)
    out = np.zeros((rows.stop - rows.start, n_items), bool)
    if ex.ndim == 1:
        out[:, ex[ex >= 0]] = True
        return out
    block = ex[rows]
    r, c = np.nonzero(block >= 0)
    out[r, block[r, c]] = True
    return out


def _check_exclude(exclude, n_users: int, n_items: int) -> None:
    if exclude is None:
        return
    ex = np.asarray(exclude)
    if ex.dtype == bool:
        if ex.shape not in ((n_items,), (n_users, n_items)):
            raise ValueError(f"a bool exclude must be [N] or [U, N] = [{n_users}, {n_items}], got {ex.shape}")
        return
    if not np.issubdtype(ex.dtype, np.integer):
        raise ValueError(f"exclude must be a bool mask or integer item indices, got dtype {ex.dtype}")
    if ex.ndim not in (1, 2) or (ex.ndim == 2 and ex.shape[0] != n_users):
        raise ValueError(f"integer exclude must be [M] or [U={n_users}, M] item indices, got shape {ex.shape}")
    if ex.size and ex.max() >= n_items:
        raise ValueError(f"exclude holds item index {int(ex.max())} but there are only {n_items} items")


def topk_from_scores(scores, k: int, exclude=None, *, chunk_elements: int = CHUNK_ELEMENTS) -> np.ndarray:
    """int64 [U, k]: each row's k best item indices, by descending score, ties by the lower item index.

    `scores`: [U, N] (N items, NaN refused). `exclude` (optional) removes candidates: a bool mask [N] or
    [U, N] (True = excluded), or integer item indices [M] (every user) or [U, M] (per user; negative entries
    are padding). A row with fewer than k candidates left ends in -1. History items are not excluded unless
    passed here. Rows are processed in blocks of about `chunk_elements` scores (O(N) per row, plus a sort of
    the k kept), so a large U x N never gets a second full-size copy.
    """
    scores = np.asarray(scores)
    if scores.ndim != 2:
        raise ValueError(f"scores must be [users, items], got shape {scores.shape}")
    U, N = scores.shape
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= N:
        raise ValueError(f"k must be an integer in [1, {N}] (the number of items), got {k!r}")
    k = int(k)
    _check_exclude(exclude, U, N)
    out = np.empty((U, k), np.int64)
    step = max(1, int(chunk_elements) // max(N, 1))
    for lo in range(0, U, step):
        rows = slice(lo, min(U, lo + step))
        block = np.asarray(scores[rows], np.float64)
        if np.isnan(block).any():
            r, c = np.argwhere(np.isnan(block))[0]
            raise ValueError(f"scores[{lo + r}, {c}] is NaN")
        excl = _exclusion_mask(exclude, rows, U, N)
        if excl is not None:
            block = np.where(excl, -np.inf, block)
        out[rows] = _topk_block(block, k, excl)
    return out


def _topk_block(block: np.ndarray, k: int, excl: np.ndarray | None) -> np.ndarray:
    n_rows, N = block.shape
    # the k-th best score of each row; everything above it is in, ties at it fill by increasing index
    # (candidates before excluded items, which sit at -inf)
    thr = -np.partition(-block, k - 1, axis=1)[:, k - 1 : k]
    gt = block > thr
    need = k - gt.sum(axis=1, keepdims=True)
    eq = block == thr
    if excl is None:
        sel = gt | (eq & (np.cumsum(eq, axis=1) <= need))
    else:
        eq_ok, eq_ex = eq & ~excl, eq & excl
        take_ok = eq_ok & (np.cumsum(eq_ok, axis=1) <= need)
        need = need - take_ok.sum(axis=1, keepdims=True)
        sel = gt | take_ok | (eq_ex & (np.cumsum(eq_ex, axis=1) <= need))
    idx = np.nonzero(sel)[1].reshape(n_rows, k)  # increasing index within each row
    vals = np.take_along_axis(block, idx, axis=1)
    flag = np.zeros_like(idx, bool) if excl is None else np.take_along_axis(excl, idx, axis=1)
    order = np.lexsort((idx, -vals, flag), axis=-1)  # not excluded first, then score desc, then index
    idx, flag = np.take_along_axis(idx, order, axis=1), np.take_along_axis(flag, order, axis=1)
    return np.where(flag, -1, idx)


def target_ranks(topk, targets) -> np.ndarray:
    """int64 [U]: the 1-based rank of each user's target in its top-K row, 0 when it is not there."""
    topk, targets = np.asarray(topk), np.asarray(targets)
    if topk.ndim != 2 or targets.shape != (topk.shape[0],):
        raise ValueError(f"topk must be [U, K] and targets [U]; got {topk.shape} and {targets.shape}")
    hit = topk == targets[:, None]
    first = np.argmax(hit, axis=1)
    return np.where(hit.any(axis=1), first + 1, 0).astype(np.int64)


def ranking_metrics(topk, targets, ks=(10, 20)) -> dict[str, float]:
    """{'recall@k', 'ndcg@k', 'mrr@k'} for each k in `ks` (k <= K), averaged over users, one target each.

    recall@k is the hit rate (target in the top k); ndcg@k = 1 / log2(rank + 1) and mrr@k = 1 / rank when
    rank <= k (1-based), else 0. History items are not masked (see the module docstring).
    """
    ranks = target_ranks(topk, targets)
    K = np.shape(topk)[1]
    if len(ranks) == 0:
        raise ValueError("ranking_metrics needs at least one user")
    out = {}
    for k in ks:
        if not isinstance(k, (int, np.integer)) or not 1 <= k <= K:
            raise ValueError(f"every k must be in [1, {K}] (the top-K lists' length), got {k!r}")
        hit = (ranks > 0) & (ranks <= k)
        safe = np.maximum(ranks, 1)
        out[f"recall@{k}"] = float(hit.mean())
        out[f"ndcg@{k}"] = float(np.where(hit, 1.0 / np.log2(safe + 1.0), 0.0).mean())
        out[f"mrr@{k}"] = float(np.where(hit, 1.0 / safe, 0.0).mean())
    return out


def item_counts(item_ids, num_items: int) -> np.ndarray:
    """int64 [num_items]: occurrences of each item index in `item_ids` (negative entries, the padding, are
    ignored; an index >= num_items is a ValueError)."""
    ids = np.asarray(item_ids).ravel().astype(np.int64)
    ids = ids[ids >= 0]
    if ids.size and ids.max() >= num_items:
        raise ValueError(f"item index {int(ids.max())} is >= num_items={num_items}")
    return np.bincount(ids, minlength=num_items).astype(np.int64)


def popularity_scores(train_item_counts) -> np.ndarray:
    """float64 [N]: the popularity baseline's score of every item, its train count (ties: the lower index
    ranks first, as in `topk_from_scores`)."""
    counts = np.asarray(train_item_counts)
    if counts.ndim != 1:
        raise ValueError(f"train_item_counts must be [N], got shape {counts.shape}")
    return counts.astype(np.float64)


def popularity_topk(train_item_counts, k: int, num_users: int, exclude=None) -> np.ndarray:
    """int64 [num_users, k]: the popularity baseline's top-k (the same list for every user unless a per-user
    `exclude` is given; see `topk_from_scores`). History items are not masked."""
    scores = popularity_scores(train_item_counts)[None]
    if exclude is None or (np.asarray(exclude).ndim == 1):
        return np.repeat(topk_from_scores(scores, k, exclude), num_users, axis=0)
    return topk_from_scores(np.broadcast_to(scores, (num_users, scores.shape[1])), k, exclude)


def user_ndcg(topk, targets, k: int) -> np.ndarray:
    """float64 [U]: each user's NDCG@k (1 / log2(rank + 1) when its target ranks <= k, else 0): the per-user
    values `ranking_metrics` averages, for paired comparisons of two models on the same users."""
    return ndcg_from_ranks(target_ranks(topk, targets), k)


def ndcg_from_ranks(ranks, k: int) -> np.ndarray:
    """float64 [U]: NDCG@k of each user from its target's 1-based rank (`target_ranks`; 0 or -1: not ranked)."""
    ranks = np.asarray(ranks)
    hit = (ranks > 0) & (ranks <= k)
    return np.where(hit, 1.0 / np.log2(np.maximum(ranks, 1) + 1.0), 0.0)


def paired_bootstrap(a, b, *, rounds: int = 10_000, level: float = 0.95, seed: int = 0) -> dict:
    """The mean of a - b over paired per-user values and its percentile bootstrap interval: users are resampled
    with replacement `rounds` times (the same draw for both sides, so the pairing is kept).

    {"mean": mean(a - b), "low", "high": the (1 - level) / 2 and (1 + level) / 2 quantiles of the resampled
    means, "level", "rounds", "users"}. An interval that excludes 0 says the difference is not resampling noise.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or a.shape != b.shape or not len(a):
        raise ValueError(f"paired values must be two equal-length 1-D arrays, got {a.shape} and {b.shape}")
    if not 0.0 < level < 1.0 or int(rounds) < 1:
        raise ValueError(f"level must be in (0, 1) and rounds >= 1, got {level} and {rounds}")
    diff = a - b
    rng = np.random.default_rng(seed)
    means = np.empty(int(rounds))
    step = max(1, (1 << 22) // len(diff))  # resample in blocks of about 4M draws
    for lo in range(0, int(rounds), step):
        n = min(step, int(rounds) - lo)
        means[lo : lo + n] = diff[rng.integers(0, len(diff), (n, len(diff)))].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return {
        "mean": float(diff.mean()),
        "low": float(low),
        "high": float(high),
        "level": level,
        "rounds": int(rounds),
        "users": len(diff),
    }


def auc(labels, scores) -> float:
    """ROC AUC via the Mann-Whitney rank statistic (ties get average ranks). NaN if a class is missing."""
    labels = np.asarray(labels).reshape(-1) > 0.5
    scores = np.asarray(scores, np.float64).reshape(-1)
    if labels.shape != scores.shape:
        raise ValueError(f"labels and scores differ in size: {labels.shape} vs {scores.shape}")
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, np.float64)
    # average 1-based ranks over runs of equal scores
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
