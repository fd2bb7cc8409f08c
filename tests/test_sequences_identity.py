"""Event identity without an `event_id` column is the whole source row: rows that agree on the sequence's
fields but differ in any other column are different events, kept by the backfill, the file stream and the
Redis consumer alike; only exact duplicate rows collapse, and each run reports how many did. The row hash
is checked against a row-by-row Python reimplementation of its definition (`jaxscale.sequences.eventid`)."""

from __future__ import annotations

import hashlib
import math
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from redis_helpers import redis_port  # noqa: F401  (the fixture)
from test_sequences_helpers import MS_PER_DAY, T0, make_defs, random_log

from jaxscale.sequences.broker import Producer, StreamConsumer
from jaxscale.sequences.eventid import row_identity
from jaxscale.sequences.events import validate_rows
from jaxscale.sequences.runtime import backfill, stream
from jaxscale.sequences.store import read_sequence

DEFS = make_defs()
RAW_TO_TYPE = {r: et.name for et in DEFS.event_types for r in et.raw}
RAW = ("user_id", "ts", "event_type", "item_id", "surface")

# --------------------------------------------------------------------------------- the brute force


def _log(seed: int) -> list[dict]:
    """Rows in arrival order: random events with a request id, a position and a score; pairs that agree on
    the five sequence fields and differ only elsewhere (another request id, another position, a null beside
    a value); exact copies of earlier rows (re-deliveries)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(160):
        rows.append(
            {
                "user_id": int(rng.integers(0, 6)) + 10**12,
                "ts": T0 + int(rng.integers(0, 2 * MS_PER_DAY)),
                "event_type": str(rng.choice(["a", "a2", "b", "c", "noise"])),
                "item_id": int(rng.integers(0, 40)) * 10**9,
                "surface": str(rng.choice(["home", "search", "related"])),
                "request_id": f"req-{i}",
                "position": int(rng.integers(0, 20)),
                "score": float(rng.random()),
            }
        )
    twins = []
    for i in rng.choice(len(rows), 40, replace=False):
        twin = dict(rows[i])
        change = ("request_id", "position", "score", "null")[len(twins) % 4]
        if change == "request_id":
            twin["request_id"] = f"req-{i}-second-click"
        elif change == "position":
            twin["position"] = rows[i]["position"] + 1
        elif change == "score":
            twin["score"] = -rows[i]["score"]
        else:
            twin["position"] = None  # a null beside the original's value
        twins.append(twin)
    rows += twins
    rows += [dict(rows[i]) for i in rng.choice(len(rows), 50, replace=False)]  # re-deliveries: exact copies
    zero = dict(rows[0], score=0.0)
    rows += [zero, dict(zero, score=-0.0)]  # -0.0 is the value 0.0: the same row
    return rows


def _write(rows: list[dict], folder: Path, files: int = 2) -> Path:
    """The rows in `files` Parquet files (arrival order: file, then row); position as int32."""
    folder.mkdir(parents=True, exist_ok=True)
    schema = pa.schema(
        [("user_id", pa.int64()), ("ts", pa.int64()), ("event_type", pa.string()), ("item_id", pa.int64()),
         ("surface", pa.string()), ("request_id", pa.string()), ("position", pa.int32()), ("score", pa.float64())]
    )  # fmt: skip
    bounds = np.linspace(0, len(rows), files + 1).astype(int)
    for f in range(files):
        part = rows[bounds[f] : bounds[f + 1]]
        pq.write_table(pa.Table.from_pylist(part, schema), folder / f"part-{f}.parquet", row_group_size=37)
    return folder


def _key(row: dict) -> tuple:
    return tuple(sorted((k, 0.0 if isinstance(v, float) and v == 0 else v) for k, v in row.items()))


def _expected(rows: list[dict]) -> tuple[dict[str, Counter], int]:
    """({sequence: multiset of (user_id, ts, item_id, event type, surface)}, rows collapsed) of the log:
    every source row minus the exact duplicates of an earlier row, computed row by row."""
    want = {s.name: Counter() for s in DEFS.sequences}
    seen, collapsed = set(), 0
    for row in rows:
        etype = RAW_TO_TYPE.get(row["event_type"])
        key = _key(row)
        for s in DEFS.sequences:
            if etype not in s.event_types:
                continue
            if (s.name, key) in seen:
                collapsed += 1
                continue
            seen.add((s.name, key))
            want[s.name][(row["user_id"], row["ts"], row["item_id"], etype, row["surface"])] += 1
    return want, collapsed


def _stored(store: Path) -> dict[str, Counter]:
    out = {}
    for s in DEFS.sequences:
        t = read_sequence(store, s.name, ["user_id", "ts", "arrival", "item_id"]).to_pylist()
        out[s.name] = Counter((r["user_id"], r["ts"], r["item_id"]) for r in t)
    return out


def _project(want: dict[str, Counter]) -> dict[str, Counter]:
    out = {}
    for name, c in want.items():
        p = Counter()
        for (u, ts, item, _etype, _surface), n in c.items():
            p[(u, ts, item)] += n
        out[name] = p
    return out


@pytest.fixture
def items(tmp_path) -> Path:
    return random_log(1, tmp_path / "items", files=1, rows=10)[1]


def test_brute_force_log_has_what_the_tests_need():
    rows = _log(0)
    want, collapsed = _expected(rows)
    five = Counter(tuple(r[c] for c in RAW) for r in rows)
    assert collapsed > 30  # re-deliveries collapse
    assert sum(n > 1 for n in five.values()) > 30  # rows that agree on the five fields
    by_five = Counter()
    for c in want.values():
        for (u, ts, item, _etype, surface), n in c.items():
            by_five[(u, ts, item, surface)] += n
    assert sum(n > 1 for n in by_five.values()) > 20  # ... and are stored as distinct events


def test_backfill_keeps_every_distinct_row_and_counts_the_collapsed(tmp_path, items):
    rows = _log(1)
    want, collapsed = _expected(rows)
    events = _write(rows, tmp_path / "events", files=3)
    report = backfill(DEFS, events, tmp_path / "b", sources={"items": items})
    assert _stored(tmp_path / "b") == _project(want)
    s1 = read_sequence(tmp_path / "b", "s1").to_pylist()
    got = Counter((r["user_id"], r["ts"], r["item_id"], r["event_type"], r["surface"]) for r in s1)
    assert got == want["s1"]
    assert report.to_json()["duplicates"] == collapsed
    indexed = report.totals().indexed
    assert report.extra["duplicates_by_sequence"] == {
        s.name: indexed[s.name] - sum(want[s.name].values()) for s in DEFS.sequences
    }


@pytest.mark.parametrize("micro_batch", [7, 1000])
def test_file_stream_keeps_every_distinct_row_and_counts_the_collapsed(tmp_path, items, micro_batch):
    rows = _log(2)
    want, collapsed = _expected(rows)
    events = _write(rows, tmp_path / "events")
    report = stream(DEFS, events, tmp_path / "s", sources={"items": items}, micro_batch=micro_batch, max_files=3)
    assert _stored(tmp_path / "s") == _project(want)
    assert report.extra["commits"]["duplicates"] == report.to_json()["duplicates"] == collapsed
    backfill(DEFS, events, tmp_path / "b", sources={"items": items})
    for s in DEFS.sequences:  # the same ids as a backfill's: a stream on top of it adds nothing
        cols = ["user_id", "ts", "arrival", "event_id"]
        a, b = read_sequence(tmp_path / "s", s.name, cols), read_sequence(tmp_path / "b", s.name, cols)
        assert a.equals(b)


def test_redis_consumer_keeps_every_distinct_row_and_counts_the_collapsed(tmp_path, items, redis_port):  # noqa: F811
    rows = _log(3)
    want, collapsed = _expected(rows)
    events = _write(rows, tmp_path / "events")
    backfill(DEFS, events, tmp_path / "b", sources={"items": items})
    url = f"redis://127.0.0.1:{redis_port}/ev"
    Producer(url, batch=16).publish_files(events)
    consumer = StreamConsumer(DEFS, url, "g", tmp_path / "s", micro_batch=40, sources={"items": items}, block_ms=50)
    report = consumer.run(until_idle=0.3)
    assert _stored(tmp_path / "s") == _project(want)
    assert report.extra["metrics"]["events_deduplicated"] == report.to_json()["duplicates"] == collapsed
    for s in DEFS.sequences:  # the ids a backfill of the same files gives
        a = read_sequence(tmp_path / "s", s.name, ["user_id", "ts", "arrival", "event_id"]).column("event_id")
        b = read_sequence(tmp_path / "b", s.name, ["user_id", "ts", "arrival", "event_id"]).column("event_id")
        assert sorted(a.to_pylist()) == sorted(b.to_pylist())


def test_event_id_column_path_is_unchanged():
    """A row with an `event_id` keeps it (an integer as is): rows differing elsewhere with one id are one event."""
    t = pa.table({**{c: [1, 1] if c != "event_type" and c != "surface" else ["a", "a"] for c in RAW},
                  "event_id": pa.array([77, 77], pa.int64()), "request_id": ["x", "y"]})  # fmt: skip
    df, _ = validate_rows(t, "f")
    assert df.get_column("event_id").to_list() == [77, 77]


# ------------------------------------------------------------------------- the hash, by its definition

_M = 2**64
_SEED = 0x6A09E667F3BCC908


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) % _M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % _M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % _M
    return x ^ (x >> 31)


def _b2(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _value(kind: str, v) -> int:
    if kind in ("int", "bool"):
        return int(v) % _M
    if kind == "float":
        if math.isnan(v):
            return 0x7FF8000000000000
        return struct.unpack("<Q", struct.pack("<d", 0.0 if v == 0 else float(v)))[0]
    if kind == "string":
        return _bytes(v.encode())
    if kind == "binary":
        return _bytes(bytes(v))
    raise AssertionError(kind)


def _bytes(data: bytes) -> int:
    """A string's or binary's hash: splitmix64 of seed ^ length, then of each 8-byte word (zero-padded)."""
    h = _splitmix(0xBB67AE8584CAA73B ^ len(data))
    for k in range(0, len(data), 8):
        h = _splitmix(h ^ int.from_bytes(data[k : k + 8] + bytes(8 - len(data[k : k + 8])), "little"))
    return h


def _reference_id(row: dict[str, tuple[str, object]]) -> int:
    """The row hash of the module doc, one Python integer at a time: {column: (kind, value or None)}."""
    h = _SEED
    for name in sorted(row):
        kind, v = row[name]
        if v is None:
            h = _splitmix(h ^ _b2(f"{name}\x00{kind}\x00null".encode()))
            h = _splitmix(h)
        else:
            h = _splitmix(h ^ _b2(f"{name}\x00{kind}".encode()))
            h = _splitmix(h ^ _value(kind, v))
    return h - _M if h >= 2**63 else h


_KINDS = {"i8": "int", "u64": "int", "f32": "float", "f64": "float", "s": "string", "ls": "string",
          "b": "binary", "flag": "bool", "text": "string"}  # fmt: skip


def _typed_table(rng, n: int) -> pa.Table:
    def maybe(values):
        return [None if rng.random() < 0.2 else v for v in values]

    return pa.table(
        {
            "i8": pa.array(maybe(rng.integers(-128, 128, n).tolist()), pa.int8()),
            "u64": pa.array(maybe([2**64 - 1 - int(x) for x in rng.integers(0, 5, n)]), pa.uint64()),
            "f32": pa.array(maybe(rng.choice([0.5, -0.0, 0.0, np.nan, 1e30], n).tolist()), pa.float32()),
            "f64": pa.array(maybe(rng.normal(size=n).tolist()), pa.float64()),
            "s": pa.array(maybe(rng.choice(["", "a", "é", "0"], n).tolist()), pa.string()),
            "ls": pa.array(maybe([f"long-{x}" for x in rng.integers(0, 3, n)]), pa.large_string()),
            "b": pa.array(maybe([bytes([x]) for x in rng.integers(0, 3, n)]), pa.binary()),
            "flag": pa.array(maybe(rng.integers(0, 2, n).astype(bool).tolist()), pa.bool_()),
            "text": pa.array(maybe(["ü" * int(k) + "x" * int(j) for k, j in rng.integers(0, 30, (n, 2))])),
        }
    )


def test_row_identity_equals_its_definition_row_by_row():
    rng = np.random.default_rng(0)
    table = _typed_table(rng, 300)
    got = row_identity(table).tolist()
    want = [_reference_id({c: (_KINDS[c], r[c]) for c in table.column_names}) for r in table.to_pylist()]
    assert got == want
    distinct = {tuple((k, repr(v)) for k, v in sorted(r.items())) for r in table.to_pylist()}
    assert len(set(got)) >= len(distinct) - 2  # NaN and -0.0/0.0 rows may coincide with others by design


def test_row_identity_is_pinned_and_ignores_layout():
    """Stable across versions (pinned), independent of column order, integer width, dictionary encoding and
    chunking; every type, null and value count."""
    t = pa.table({"user_id": pa.array([7, 7, 7, None], pa.int64()), "s": ["x", "x", None, "x"],
                  "n": pa.array([0, None, 0, 0], pa.int64())})  # fmt: skip
    ids = row_identity(t).tolist()
    assert len(set(ids)) == 4  # a null differs from 0 and from ""
    assert ids == [_reference_id({"user_id": ("int", u), "s": ("string", s), "n": ("int", n)})
                   for u, s, n in zip([7, 7, 7, None], ["x", "x", None, "x"], [0, None, 0, 0])]  # fmt: skip
    assert ids[0] == 4958409606238181195  # pinned: part of the store's contract
    reordered = t.select(["n", "s", "user_id"])
    narrow = t.set_column(0, "user_id", t.column("user_id").cast(pa.int32()))
    encoded = t.set_column(1, "s", t.column("s").dictionary_encode())
    chunked = pa.concat_tables([t.slice(0, 1), t.slice(1)])
    for other in (reordered, narrow, encoded, chunked):
        assert row_identity(other).tolist() == ids
    as_text = t.set_column(0, "user_id", pa.array(["7", "7", "7", None]))
    as_float = t.set_column(0, "user_id", pa.array([7.0, 7.0, 7.0, None]))
    renamed = t.rename_columns(["user_id", "s2", "n"])
    for other in (as_text, as_float, renamed):  # another type or another column: another row
        assert row_identity(other).tolist()[:3] != ids[:3]
    ts = pa.table({"t": pa.array([1, 2], pa.timestamp("ms")), "d": pa.array([1, None], pa.date32())})
    dec = pa.table({"x": pa.array([1, 2], pa.decimal128(5, 2)), "l": pa.array([[1], [1, 2]])})
    assert len(set(row_identity(ts).tolist())) == 2 and len(set(row_identity(dec).tolist())) == 2
