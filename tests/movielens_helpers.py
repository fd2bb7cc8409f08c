"""Small MovieLens datasets for tests: ml-100k's u.data + u.item layout with many tied timestamps, and the
brute-force leave-one-out targets of its ratings."""

from pathlib import Path

import numpy as np

USERS, MOVIES = 40, 60


def write_ml100k(d: Path, seed: int = 0) -> list[tuple[int, int, int, int]]:
    """u.data + u.item in ml-100k's layout; ratings in file order (user, item, rating, ts in seconds)."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(1, USERS + 1):
        n = int(rng.integers(4, 14))
        t0 = 880_000_000 + int(rng.integers(0, 10**6))
        ts = t0 + np.sort(rng.integers(0, 6, n)) * 86_400 // 3  # few distinct times: many ties
        items = rng.choice(np.arange(1, MOVIES + 1), n, replace=False, p=zipf(MOVIES))
        rows += [(u, int(i), int(rng.integers(1, 6)), int(t)) for i, t in zip(items, ts)]
    order = rng.permutation(len(rows))  # users interleaved: file order is not (user, ts) order
    rows = [rows[i] for i in order]
    d.mkdir(parents=True)
    (d / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
    lines = []
    for m in range(1, MOVIES + 1):
        flags = ["0"] * 19
        if m % 7:  # every 7th movie has no genre: the 'missing' category
            flags[1 + m % 18] = "1"
        lines.append(f"{m}|Movie {m} (1995)|01-Jan-1995||http://x|{'|'.join(flags)}\n")
    (d / "u.item").write_text("".join(lines))
    return rows


def zipf(n):
    p = 1.0 / np.arange(1, n + 1)
    return p / p.sum()


def loo_targets(rows, split: str) -> dict[int, int]:
    """Brute force: per user, ratings ordered by (ts, file order); the last is test, the one before valid."""
    by_user: dict[int, list] = {}
    for pos, (u, i, _, t) in enumerate(rows):
        by_user.setdefault(u, []).append((t, pos, i))
    back = 1 if split == "test" else 2
    return {u: sorted(evs)[-back][2] for u, evs in by_user.items() if len(evs) > back}
