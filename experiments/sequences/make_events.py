"""A realistic synthetic event log for the `engagement` example (and the benchmark).

    python experiments/sequences/make_events.py --out data/seq --events 1000000 --days 7

Writes <out>/events/dt=YYYY-MM-DD/part-NNNNN.parquet (partitioned by ARRIVAL day, rows in arrival order)
and <out>/items.parquet (item_id int64, category int64).

- Users and items are Zipf-popular; item ids are scattered 40-bit integers (so the training reader's
  int32 id mapping is exercised); a few items are missing from the items table (category -> -1).
- Every user prefers a category; events on items of that category are more often saves and clicks, which
  is the signal the foundation model's engagement head can learn.
- Event types include ones no sequence uses (impression, hide) and raw aliases (pin_click, repin).
- A fraction `--late` of events arrives hours to two days after its timestamp (late, out of order); the
  rest within seconds. A fraction `--bad` of rows has a null in a required column (reported by backfill).
- Every event carries `ingest_ts`, the epoch ms at which it reached the platform (its arrival time: the
  order of the log), so `as_of_mode="ingest"` can reproduce what serving saw.
- Extra columns (session_id, client) that the raw schema allows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

EVENT_TYPES = np.array(["impression", "click", "pin_click", "closeup", "save", "repin", "hide"])
BASE_WEIGHTS = np.array([0.40, 0.20, 0.04, 0.16, 0.10, 0.03, 0.07])
PREFERRED_BOOST = np.array([1.0, 1.5, 1.5, 1.3, 3.0, 3.0, 0.5])
SURFACES = np.array(["home_feed", "search", "related", "profile"])
SURFACE_WEIGHTS = np.array([0.5, 0.25, 0.2, 0.05])
START = dt.datetime(2026, 1, 5, tzinfo=dt.UTC)
MS_PER_DAY = 86_400_000


def zipf_ranks(rng, n: int, size: int, exponent: float) -> np.ndarray:
    """Ranks in [0, n) with P(k) proportional to (k + 1) ** -exponent (inverse CDF over an exact table)."""
    cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -exponent)
    return np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(size)), n - 1)


def sample_rows(rng, weights: np.ndarray) -> np.ndarray:
    """One categorical draw per row of `weights` [n, k]."""
    cdf = np.cumsum(weights, axis=1)
    u = rng.random(len(weights))[:, None] * cdf[:, -1:]
    return (u > cdf).sum(axis=1)


def make_log(
    events: int, days: int, users: int, items: int, categories: int, late: float, bad: float, seed: int
) -> tuple[pa.Table, pa.Table]:
    """(events in arrival order with their arrival time as `ingest_ts`, items table)."""
    rng = np.random.default_rng(seed)
    item_ids = rng.choice(2**40, size=items, replace=False).astype(np.int64)
    item_cat = rng.integers(0, categories, items)
    in_table = rng.random(items) >= 0.02
    user_ids = rng.choice(10**12, size=users, replace=False).astype(np.int64) + 10**9
    user_pref = rng.integers(0, categories, users)

    u = zipf_ranks(rng, users, events, 0.9)
    global_item = zipf_ranks(rng, items, events, 1.05)
    # 60% of events pick an item of the user's preferred category (popular ones first).
    by_cat = np.argsort(item_cat, kind="stable")
    cat_start = np.searchsorted(item_cat[by_cat], np.arange(categories + 1))
    pref = user_pref[u]
    span = np.maximum(cat_start[pref + 1] - cat_start[pref], 1)
    local = np.minimum(zipf_ranks(rng, 256, events, 1.1) % span, span - 1)
    pref_item = by_cat[np.minimum(cat_start[pref] + local, items - 1)]
    item = np.where(rng.random(events) < 0.6, pref_item, global_item)
    preferred = item_cat[item] == pref
    weights = BASE_WEIGHTS[None, :] * np.where(preferred[:, None], PREFERRED_BOOST[None, :], 1.0)
    etype = sample_rows(rng, weights)
    surface = sample_rows(rng, np.broadcast_to(SURFACE_WEIGHTS, (events, len(SURFACES))))

    t0 = int(START.timestamp() * 1000)
    ts = t0 + rng.integers(0, days * MS_PER_DAY, events)
    ts = np.where(rng.random(events) < 0.002, ts - ts % 1000, ts)  # some exact-second duplicates: ties
    delay = np.where(
        rng.random(events) < late, rng.integers(3_600_000, 2 * MS_PER_DAY, events), rng.integers(0, 5_000, events)
    )
    arrival = ts + delay
    order = np.argsort(arrival, kind="stable")

    n_bad = int(round(bad * events))
    null_masks = {c: np.zeros(events, bool) for c in ("user_id", "ts", "event_type", "item_id", "surface")}
    if n_bad:
        rows = rng.choice(events, n_bad, replace=False)
        cols = rng.integers(0, len(null_masks), n_bad)
        for j, c in enumerate(null_masks):
            null_masks[c][rows[cols == j]] = True

    def arr(values, col, typ=None):
        return pa.array(values[order], type=typ, mask=null_masks[col][order])

    table = pa.table(
        {
            "user_id": arr(user_ids[u], "user_id", pa.int64()),
            "ts": arr(ts, "ts", pa.int64()),
            "event_type": arr(EVENT_TYPES[etype], "event_type", pa.string()),
            "item_id": arr(item_ids[item], "item_id", pa.int64()),
            "surface": arr(SURFACES[surface], "surface", pa.string()),
            "session_id": pa.array(rng.integers(0, 2**31, events)[order]),
            "client": pa.array(np.array(["ios", "android", "web"])[rng.integers(0, 3, events)][order]),
            "ingest_ts": pa.array(arrival[order]),
        }
    )
    items_table = pa.table({"item_id": item_ids[in_table], "category": item_cat[in_table].astype(np.int64)})
    return table, items_table


def write_log(out: Path, table: pa.Table, items: pa.Table, rows_per_file: int) -> dict:
    """Events partitioned by arrival day (rows in arrival order within and across files), items table."""
    out = Path(out)
    (out / "events").mkdir(parents=True, exist_ok=True)
    arrival_day = table.column("ingest_ts").to_numpy() // MS_PER_DAY
    events = table
    files = 0
    for day in np.unique(arrival_day):
        lo, hi = np.searchsorted(arrival_day, [day, day + 1])
        name = (dt.date(1970, 1, 1) + dt.timedelta(days=int(day))).isoformat()
        folder = out / "events" / f"dt={name}"
        folder.mkdir(exist_ok=True)
        for k, start in enumerate(range(lo, hi, rows_per_file)):
            part = events.slice(start, min(rows_per_file, hi - start))
            pq.write_table(part, folder / f"part-{k:05d}.parquet", row_group_size=128 * 1024)
            files += 1
    pq.write_table(items, out / "items.parquet")
    return {"events": events.num_rows, "files": files, "items": items.num_rows, "path": str(out)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--days", type=int, default=7)
    ap.add_argument("--users", type=int, default=None, help="default: events // 100")
    ap.add_argument("--items", type=int, default=None, help="default: events // 20 (at least 1000)")
    ap.add_argument("--categories", type=int, default=64)
    ap.add_argument("--late", type=float, default=0.03, help="fraction of late events")
    ap.add_argument("--bad", type=float, default=0.0005, help="fraction of rows with a null required field")
    ap.add_argument("--rows-per-file", type=int, default=250_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.events < 1 or args.days < 1:
        ap.error("--events and --days must be >= 1")
    users = args.users or max(args.events // 100, 10)
    items = args.items or max(args.events // 20, 1000)
    table, items_table = make_log(args.events, args.days, users, items, args.categories, args.late, args.bad, args.seed)
    summary = write_log(Path(args.out), table, items_table, args.rows_per_file)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
