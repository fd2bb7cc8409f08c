"""Shared by the sequence tests: random raw logs on disk and a brute-force (row-by-row Python) reference
of what the store must hold and what a query must return."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from jaxscale.sequences import Definitions, Enrichment, EventType, Sequence

MS_PER_DAY = 86_400_000
T0 = 1_767_571_200_000  # 2026-01-05T00:00:00Z
RAW_TYPES = ["a", "a2", "b", "c", "noise", "other"]
SURFACES = ["home", "search", "related", "x"]


def make_defs(max_length: int = 5) -> Definitions:
    """Two sequences over three event types (one with a raw alias), one enrichment with two fields."""
    return Definitions(
        event_types=(EventType("a", raw=("a", "a2")), EventType("b"), EventType("c")),
        enrichments=(Enrichment("items", fields={"category": "int64", "score": "float64"}, defaults={"category": -1}),),
        sequences=(
            Sequence(
                "s1", ("a", "b"), ("item_id", "ts", "event_type", "surface", "category"), max_length, engaged=("b",)
            ),
            Sequence("s2", ("b", "c"), ("ts", "item_id", "score"), 3),
        ),
        surfaces=("home", "search", "related"),
    )


def write_defs(tmp_path: Path, defs: Definitions | None = None) -> Path:
    path = Path(tmp_path) / "defs.json"
    path.write_text((defs or make_defs()).dumps())
    return path


def random_log(
    seed: int,
    folder: Path,
    *,
    files: int = 3,
    rows: int = 300,
    users: int = 12,
    days: int = 3,
    items: int = 40,
    late: float = 0.1,
    bad: bool = True,
    row_group_size: int = 64,
    ingest: bool = False,
) -> tuple[pd.DataFrame, Path]:
    """Writes `files` raw Parquet files (arrival order) and an items table; returns (all raw rows with
    their file rank and row index, items path). With `bad`, some rows have nulls or unparsable values
    (one file stores ts as strings, one item_id as floats). With `ingest`, files carry an `ingest_ts` column
    (the arrival clock: late events arrive up to 2 days after their ts; 5% nulls, which mean ingest_ts = ts)."""
    rng = np.random.default_rng(seed)
    folder = Path(folder)
    (folder / "events").mkdir(parents=True, exist_ok=True)
    frames = []
    clock = T0
    for f in range(files):
        n = int(rng.integers(rows // 2, rows + 1))
        arrival = clock + np.sort(rng.integers(0, days * MS_PER_DAY // files, n))
        clock = int(arrival[-1]) if n else clock
        ts = arrival - np.where(rng.random(n) < late, rng.integers(0, 2 * MS_PER_DAY, n), rng.integers(0, 3, n))
        ts = np.where(rng.random(n) < 0.15, ts - ts % 1000, ts)  # ties in ts
        if n > 4:
            ts[1] = ts[0]  # an exact tie inside the file
        df = pd.DataFrame(
            {
                "user_id": rng.integers(0, users, n).astype(object) * 7919 + 10**12,
                "ts": ts.astype(object),
                "event_type": rng.choice(RAW_TYPES, n).astype(object),
                "item_id": rng.integers(0, items + 5, n).astype(object) * 10**9,
                "surface": rng.choice(SURFACES, n).astype(object),
                "extra": rng.random(n),
            }
        )
        if n > 4:  # an exact tie in ts for one user, both events in s1
            df.loc[1, "user_id"], df.loc[[0, 1], "event_type"] = df.loc[0, "user_id"], "a"
        if bad:
            for col in ("user_id", "ts", "event_type", "item_id", "surface"):
                df.loc[rng.random(n) < 0.02, col] = None
        table = _to_arrow(df, f, rng, bad)
        if ingest:
            nulls = rng.random(n) < 0.05
            table = table.append_column("ingest_ts", pa.array(arrival.astype(np.int64), pa.int64(), mask=nulls))
        pq.write_table(table, folder / "events" / f"part-{f:03d}.parquet", row_group_size=row_group_size)
        raw = pd.DataFrame(table.to_pylist())
        raw["file_rank"], raw["row"], raw["file"] = f, np.arange(len(raw)), f"part-{f:03d}.parquet"
        frames.append(raw)
    item_ids = np.arange(items, dtype=np.int64) * 10**9
    items_table = pa.table(
        {
            "item_id": item_ids,
            "category": rng.integers(0, 6, items).astype(np.int64),
            "score": rng.random(items),
        }
    )
    pq.write_table(items_table, folder / "items.parquet")
    return pd.concat(frames, ignore_index=True), folder / "items.parquet"


def _to_arrow(df: pd.DataFrame, f: int, rng, bad: bool) -> pa.Table:
    cols = {}
    for col in ("user_id", "ts", "event_type", "item_id", "surface", "extra"):
        values = [None if isinstance(v, float) and math.isnan(v) and col != "extra" else v for v in df[col]]
        if bad and col == "ts" and f == 1:  # ts as strings, some garbage
            strs = [None if v is None else str(v) for v in values]
            for i in np.flatnonzero(rng.random(len(strs)) < 0.05):
                strs[i] = "not-a-time"
            cols[col] = pa.array(strs, pa.string())
        elif bad and col == "item_id" and f == 2:  # floats, some fractional
            fl = [None if v is None else float(v) for v in values]
            for i in np.flatnonzero(rng.random(len(fl)) < 0.05):
                fl[i] = fl[i] + 0.5 if fl[i] is not None else None
            cols[col] = pa.array(fl, pa.float64())
        elif col in ("user_id", "ts", "item_id"):
            cols[col] = pa.array([None if v is None else int(v) for v in values], pa.int64())
        elif col == "extra":
            cols[col] = pa.array(values, pa.float64())
        else:
            cols[col] = pa.array(values, pa.string())
    return pa.table(cols)


# ------------------------------------------------------------------------------------------ reference


def _is_null(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _as_int(v):
    """Brute-force conversion of one raw value to int64 (None if it is not one)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    if isinstance(v, float):
        return int(v) if v.is_integer() else None
    return int(v)


_BOOKKEEPING = ("file_rank", "row", "file")
"""Columns random_log adds to the raw rows (not in the files)."""


def reference_store(
    raw: pd.DataFrame, defs: Definitions, items: pd.DataFrame, lo_ms=None, hi_ms=None
) -> tuple[dict[str, pd.DataFrame], dict[str, dict[str, int]]]:
    """({sequence: stored rows in store order}, {file: {bad reason: count}}), one row at a time.

    An event is stored once per (sequence, day), its first arrival: events are the same when their
    `event_id`s are (if the row has one), else when their whole source rows (every column) are."""
    raw_map = {r: et.name for et in defs.event_types for r in et.raw}
    seen: set = set()
    lookup = {int(r["item_id"]): r for r in items.to_dict("records")}
    enriched = defs.enriched_fields()
    out = {s.name: [] for s in defs.sequences}
    bad: dict[str, dict[str, int]] = {}
    for rec in raw.to_dict("records"):
        vals, problem = {}, None
        for col in ("user_id", "ts", "event_type", "item_id", "surface"):
            v = rec[col]
            if v is None or (isinstance(v, float) and math.isnan(v)):
                problem = problem or f"null {col}"
                continue
            if col in ("event_type", "surface"):
                vals[col] = v
            else:
                vals[col] = _as_int(v)
                if vals[col] is None:
                    problem = problem or f"wrong type {col}"
        ingest = _as_int(rec.get("ingest_ts"))
        if rec.get("ingest_ts") is not None and not _is_null(rec["ingest_ts"]) and ingest is None:
            problem = problem or "wrong type ingest_ts"
        if problem:
            bad.setdefault(rec["file"], {}).setdefault(problem, 0)
            bad[rec["file"]][problem] += 1
            continue
        if (lo_ms is not None and vals["ts"] < lo_ms) or (hi_ms is not None and vals["ts"] >= hi_ms):
            continue
        etype = raw_map.get(vals["event_type"])
        given = rec.get("event_id")
        row = tuple(sorted((k, None if _is_null(v) else v) for k, v in rec.items() if k not in _BOOKKEEPING))
        ident = ("id", given) if given is not None and not _is_null(given) else row  # else the whole source row
        for s in defs.sequences:
            if etype not in s.event_types or (s.name, vals["ts"] // MS_PER_DAY, ident) in seen:
                continue
            seen.add((s.name, vals["ts"] // MS_PER_DAY, ident))
            row = {"user_id": vals["user_id"], "ts": vals["ts"], "arrival": (rec["file_rank"] << 32) + rec["row"]}
            row["ingest_ts"] = vals["ts"] if ingest is None else ingest  # absent or null: received when it happened
            for f in s.fields:
                if f == "event_type":
                    row[f] = etype
                elif f in vals:
                    row[f] = vals[f]
                else:
                    en = enriched[f]
                    hit = lookup.get(vals[en.key])
                    row[f] = en.defaults[f] if hit is None else hit[f]
            out[s.name].append(row)
    result = {}
    for s in defs.sequences:
        df = pd.DataFrame(out[s.name])
        if len(df):
            df = df.sort_values(["user_id", "ts", "arrival"], kind="mergesort").reset_index(drop=True)
        result[s.name] = df
    return result, bad


def reference_ingest_query(rows, fields, max_length: int, user: int, as_of=None, limit=None) -> list[dict]:
    """As `reference_query` in as_of_mode='ingest': among the events that happened (ts < as_of) AND had
    reached the platform (ingest_ts < as_of) before as_of (brute force)."""
    if isinstance(rows, pd.DataFrame):
        rows = by_user(rows)
    if as_of is not None:
        rows = {int(user): [r for r in rows.get(int(user), []) if r["ingest_ts"] < as_of]}
    return reference_query(rows, fields, max_length, user, as_of, limit)


def by_user(rows: pd.DataFrame) -> dict[int, list[dict]]:
    """Stored rows as records grouped by user (for reference_query)."""
    out: dict[int, list[dict]] = {}
    for r in rows.to_dict("records") if len(rows) else []:
        out.setdefault(int(r["user_id"]), []).append(r)
    return out


def reference_query(rows, fields, max_length: int, user: int, as_of=None, limit=None) -> list[dict]:
    """The user's last min(limit, max_length) events with ts < as_of, oldest first (brute force).

    `rows`: a stored-rows DataFrame, or its `by_user` grouping."""
    if isinstance(rows, pd.DataFrame):
        rows = by_user(rows)
    sel = [r for r in rows.get(int(user), []) if as_of is None or r["ts"] < as_of]
    sel.sort(key=lambda r: (r["ts"], r["arrival"]))
    n = max_length if limit is None else min(limit, max_length)
    sel = sel[max(len(sel) - n, 0) :] if n > 0 else []
    return [{f: _plain(r[f]) for f in fields} for r in sel]


def _plain(v):
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    return v


def store_frame(table: pa.Table | None) -> pd.DataFrame:
    """A stored table as a DataFrame comparable with reference_store's."""
    if table is None:
        return pd.DataFrame()
    return table.to_pandas().reset_index(drop=True)


def assert_frames_equal(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert len(got) == len(want), f"{len(got)} rows stored, {len(want)} expected"
    if len(want) == 0:
        return
    assert list(got.columns) == list(want.columns), (list(got.columns), list(want.columns))
    pd.testing.assert_frame_equal(got, want.astype(got.dtypes.to_dict()), check_dtype=False)
