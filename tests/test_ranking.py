"""Ranking metrics against brute-force Python loops on random scores with many ties."""

import math

import numpy as np
import pytest

from jaxscale.training import ranking
from jaxscale.training.ranking import (
    item_counts,
    popularity_scores,
    popularity_topk,
    ranking_metrics,
    target_ranks,
    topk_from_scores,
)


def _brute_topk(scores, k, excluded=None):
    out = []
    for u, row in enumerate(scores):
        cand = [j for j in range(len(row)) if excluded is None or j not in excluded[u]]
        best = sorted(cand, key=lambda j: (-float(row[j]), j))[:k]
        out.append(best + [-1] * (k - len(best)))
    return np.array(out, np.int64)


def _brute_metrics(topk, targets, ks):
    out = {}
    for k in ks:
        rec = nd = mr = 0.0
        for row, t in zip(topk.tolist(), targets.tolist()):
            if t in row[:k]:
                rank = row.index(t) + 1
                rec += 1
                nd += 1 / math.log2(rank + 1)
                mr += 1 / rank
        n = len(targets)
        out |= {f"recall@{k}": rec / n, f"ndcg@{k}": nd / n, f"mrr@{k}": mr / n}
    return out


@pytest.mark.parametrize("seed", range(6))
def test_topk_equals_brute_force_with_ties_and_chunks(seed):
    rng = np.random.default_rng(seed)
    U, N = int(rng.integers(1, 30)), int(rng.integers(1, 40))
    scores = rng.integers(-3, 4, (U, N)).astype(rng.choice([np.float32, np.float64]))  # many ties
    if seed % 2:
        scores[rng.random((U, N)) < 0.1] = -np.inf
    for k in sorted({1, min(N, 3), N}):
        want = _brute_topk(scores, k)
        for chunk in (1, 7, 1 << 22):
            np.testing.assert_array_equal(topk_from_scores(scores, k, chunk_elements=chunk), want)


@pytest.mark.parametrize("seed", range(6))
def test_exclusions(seed):
    rng = np.random.default_rng(100 + seed)
    U, N = int(rng.integers(1, 20)), int(rng.integers(2, 25))
    scores = rng.integers(0, 3, (U, N)).astype(np.float64)
    scores[rng.random((U, N)) < 0.15] = -np.inf  # real -inf scores still rank before excluded items
    mask = rng.random((U, N)) < 0.4
    excluded = [set(np.flatnonzero(m).tolist()) for m in mask]
    k = int(rng.integers(1, N + 1))
    want = _brute_topk(scores, k, excluded)
    np.testing.assert_array_equal(topk_from_scores(scores, k, mask, chunk_elements=5), want)
    # the same as per-user index lists padded with -1
    M = max(1, max(len(e) for e in excluded))
    idx = np.full((U, M), -1, np.int64)
    for u, e in enumerate(excluded):
        idx[u, : len(e)] = sorted(e)
    np.testing.assert_array_equal(topk_from_scores(scores, k, idx), want)
    # one list for every user: [M] indices or an [N] mask
    shared = {0, N - 1}
    want = _brute_topk(scores, k, [shared] * U)
    np.testing.assert_array_equal(topk_from_scores(scores, k, np.array(sorted(shared))), want)
    np.testing.assert_array_equal(topk_from_scores(scores, k, np.isin(np.arange(N), list(shared))), want)


@pytest.mark.parametrize("seed", range(6))
def test_metrics_equal_brute_force(seed):
    rng = np.random.default_rng(200 + seed)
    U, N = int(rng.integers(1, 40)), int(rng.integers(20, 60))
    scores = rng.integers(0, 5, (U, N)).astype(np.float32)
    targets = rng.integers(0, N, U)
    top = topk_from_scores(scores, 20)
    got = ranking_metrics(top, targets, ks=(1, 5, 10, 20))
    want = _brute_metrics(top, targets, (1, 5, 10, 20))
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12), key
    ranks = target_ranks(top, targets)
    for u in range(U):
        row = top[u].tolist()
        assert ranks[u] == (row.index(targets[u]) + 1 if targets[u] in row else 0)
    assert all(got[f"recall@{k}"] <= got[f"recall@{k2}"] for k, k2 in [(1, 5), (5, 10), (10, 20)])
    assert got["mrr@20"] <= got["ndcg@20"] <= got["recall@20"]


def test_known_values_and_errors():
    top = np.array([[3, 1, 2], [0, 1, 2]])
    m = ranking_metrics(top, np.array([1, 7]), ks=(1, 3))
    assert m == {
        "recall@1": 0.0,
        "ndcg@1": 0.0,
        "mrr@1": 0.0,
        "recall@3": 0.5,
        "ndcg@3": pytest.approx(0.5 / math.log2(3)),
        "mrr@3": 0.25,
    }
    with pytest.raises(ValueError, match="every k must be in"):
        ranking_metrics(top, np.array([1, 7]), ks=(10,))
    with pytest.raises(ValueError, match="k must be an integer"):
        topk_from_scores(np.zeros((2, 3)), 4)
    with pytest.raises(ValueError, match="NaN"):
        topk_from_scores(np.array([[0.0, np.nan]]), 1)
    with pytest.raises(ValueError, match="only 3 items"):
        topk_from_scores(np.zeros((2, 3)), 1, np.array([5]))
    with pytest.raises(ValueError, match="targets"):
        target_ranks(top, np.array([1]))


def test_popularity_baseline():
    counts = item_counts(np.array([[4, 4, 2, -1], [2, 4, 0, -1]]), 6)
    np.testing.assert_array_equal(counts, [1, 0, 2, 0, 3, 0])
    assert popularity_scores(counts).dtype == np.float64
    top = popularity_topk(counts, 4, num_users=3)
    np.testing.assert_array_equal(top, [[4, 2, 0, 1]] * 3)  # ties (count 0) by the lower index
    per_user = popularity_topk(counts, 2, num_users=2, exclude=np.array([[4, -1], [0, 2]]))
    np.testing.assert_array_equal(per_user, [[2, 0], [4, 1]])
    np.testing.assert_array_equal(popularity_topk(counts, 2, 2, exclude=np.array([0, 1])), [[4, 2]] * 2)
    with pytest.raises(ValueError, match="num_items"):
        item_counts(np.array([6]), 6)


def test_user_ndcg_averages_to_ranking_metrics():
    rng = np.random.default_rng(3)
    topk = np.stack([rng.permutation(30)[:10] for _ in range(50)])
    targets = rng.integers(0, 30, 50)
    for k in (1, 5, 10):
        per_user = ranking.user_ndcg(topk, targets, k)
        assert per_user.mean() == pytest.approx(ranking.ranking_metrics(topk, targets, (k,))[f"ndcg@{k}"])
        for u in range(50):  # brute force
            hit = [j for j in range(k) if topk[u, j] == targets[u]]
            assert per_user[u] == pytest.approx(1 / np.log2(hit[0] + 2) if hit else 0.0)


def test_ndcg_from_ranks_counts_only_ranks_inside_k():
    """The per-user NDCG a stored rank gives (fairness records keep ranks): 1 / log2(rank + 1) for ranks 1..k,
    0 beyond k and for an unranked target (0, or -1)."""
    got = ranking.ndcg_from_ranks([1, 0, 11, 3, -1, 10], 10)
    np.testing.assert_allclose(got, [1.0, 0.0, 0.0, 0.5, 0.0, 1 / np.log2(11)])
    assert ranking.ndcg_from_ranks(np.array([], np.int64), 10).shape == (0,)


def test_paired_bootstrap_brackets_the_true_difference_and_keeps_pairs():
    rng = np.random.default_rng(0)
    base = rng.random(2000)
    a, b = base + 0.05 + rng.normal(0, 0.01, 2000), base
    out = ranking.paired_bootstrap(a, b, rounds=2000, seed=1)
    assert out["low"] < 0.05 < out["high"] and out["high"] - out["low"] < 0.002  # pairing removes `base`'s spread
    unpaired = ranking.paired_bootstrap(a, rng.permutation(b), rounds=2000, seed=1)
    assert unpaired["high"] - unpaired["low"] > 10 * (out["high"] - out["low"])
    same = ranking.paired_bootstrap(b, b, rounds=100)
    assert same["mean"] == same["low"] == same["high"] == 0.0
    with pytest.raises(ValueError, match="equal-length"):
        ranking.paired_bootstrap(a, b[:-1])
