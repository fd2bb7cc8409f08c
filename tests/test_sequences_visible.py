"""Commit-time point in time (`as_of_mode='visible'`, issue 35 item 8): what a reader of the store could see.

`ingest` bounds by when the platform received an event; an event becomes readable only when a commit writes
it. These tests stream a log whose events were all received long before, take what a reader of the store
answered right after each commit, and check that the visible mode at that moment answers exactly that
(while the ingest mode claims more), against a brute force over the stored `visible_ts`, in the reader,
the server, the training examples and the config.
"""

import json
import time
import urllib.request

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from redis_helpers import redis_port  # noqa: F401  (the fixture)
from test_sequences_helpers import assert_frames_equal, by_user, make_defs, reference_query, reference_store

from jaxscale.sequences.examples import PointInTimeExamples, SequenceBatches
from jaxscale.sequences.query import SequenceReader
from jaxscale.sequences.runtime import backfill, stream
from jaxscale.sequences.server import serve_in_thread
from jaxscale.sequences.store import VISIBLE_TS, list_partitions, partition_files, read_sequence

USERS = [10**12 + 7919 * k for k in range(5)]


def _log(tmp, seed: int, rows: int = 240, spread_ms: int = 4000):
    """A log around now: ts within [now - spread, now + spread] (some in the future, so event time and
    commit time interleave), ingest_ts a little after ts (received long before it is committed)."""
    rng = np.random.default_rng(seed)
    now = time.time_ns() // 1_000_000
    ts = np.sort(now + rng.integers(-spread_ms, spread_ms, rows))
    ts[1] = ts[0]
    table = pa.table(
        {
            "user_id": rng.choice(USERS, rows).astype(np.int64),
            "ts": ts.astype(np.int64),
            "event_type": rng.choice(["a", "a2", "b", "c", "other"], rows),
            "item_id": rng.integers(0, 30, rows).astype(np.int64) * 10**9,
            "surface": rng.choice(["home", "search", "x"], rows),
            "ingest_ts": (ts - 60_000 + rng.integers(0, 1000, rows)).astype(np.int64),
        }
    )
    (tmp / "events").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, tmp / "events" / "part-000.parquet", row_group_size=64)
    items = pa.table(
        {"item_id": np.arange(30, dtype=np.int64) * 10**9, "category": rng.integers(0, 6, 30), "score": rng.random(30)}
    )
    pq.write_table(items, tmp / "items.parquet")
    raw = pd.DataFrame(table.to_pylist())
    raw["file_rank"], raw["row"], raw["file"] = 0, np.arange(rows), "part-000.parquet"
    return raw, tmp / "items.parquet"


def reference_visible_query(rows, fields, max_length: int, user: int, as_of=None, limit=None) -> list[dict]:
    """As `reference_query` among the events committed before as_of (visible_ts < as_of), brute force."""
    grouped = by_user(rows) if isinstance(rows, pd.DataFrame) else rows
    if as_of is not None:
        grouped = {int(user): [r for r in grouped.get(int(user), []) if r[VISIBLE_TS] < as_of]}
    return reference_query(grouped, fields, max_length, user, as_of, limit)


def _stored(store, s) -> pd.DataFrame:
    cols = [*SequenceReader(store, s.name).columns, VISIBLE_TS]
    return read_sequence(store, s.name, cols).to_pandas()


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """A log streamed in micro-batches; after each commit, (wall-clock ms, what a fresh reader answered)."""
    tmp = tmp_path_factory.mktemp("visible")
    defs = make_defs(max_length=6)
    raw, items = _log(tmp, seed=5)
    seen = []

    def snapshot(i, report):
        time.sleep(0.003)  # the next commit's visible_ts is later than this moment
        at = time.time_ns() // 1_000_000
        answers = {}
        for s in defs.sequences:
            if (tmp / "store" / s.name / "_sequence.json").exists():
                r = SequenceReader(tmp / "store", s.name)
                answers[s.name] = {u: r.events(u, at) for u in USERS}
        seen.append((at, answers))
        time.sleep(0.003)

    stream(
        defs, tmp / "events", tmp / "store", sources={"items": items}, micro_batch=20, max_files=3, on_commit=snapshot
    )
    return tmp / "store", defs, raw, items, seen


def test_visible_mode_answers_what_a_reader_saw_while_streaming(streamed):
    store, defs, raw, items, seen = streamed
    assert len(seen) >= 10
    claims_more = 0
    for s in defs.sequences:
        reader = SequenceReader(store, s.name)  # after the run: its partitions compacted, visible_ts kept
        for at, answers in seen:
            for u in USERS:
                then = answers.get(s.name, {}).get(u, [])
                assert reader.events(u, at, as_of_mode="visible") == then, (s.name, at, u)
                claims_more += reader.events(u, at, as_of_mode="ingest") != then
    assert claims_more > 10, "ingest mode must claim events no reader could see yet (what item 8 is about)"


def test_visible_mode_equals_brute_force(streamed):
    store, defs, raw, items, seen = streamed
    want, _ = reference_store(raw, defs, pd.read_parquet(items))
    rng = np.random.default_rng(3)
    for s in defs.sequences:
        stored = _stored(store, s)
        assert_frames_equal(stored.drop(columns=[VISIBLE_TS]), want[s.name])
        assert (stored[VISIBLE_TS] >= stored["ingest_ts"]).all()
        assert stored[VISIBLE_TS].nunique() >= 5  # one commit time per micro-batch, kept through merges
        grouped = by_user(stored)
        reader = SequenceReader(store, s.name)
        picks = np.concatenate([stored.ts, stored[VISIBLE_TS], stored[VISIBLE_TS] + 1, stored.ingest_ts])
        for _ in range(300):
            u = int(rng.choice([*USERS, 5]))
            t = int(rng.choice(picks))
            limit = [None, 0, 1, 3, 100][int(rng.integers(5))]
            got = reader.events(u, t, limit, as_of_mode="visible")
            assert got == reference_visible_query(grouped, s.fields, s.max_length, u, t, limit), (u, t, limit)
            assert json.loads(reader.events_json(u, t, limit, as_of_mode="visible")) == got
            q = reader.query(u, t, limit, as_of_mode="visible")
            assert np.all(q[VISIBLE_TS] < t) and np.all(q["ts"] < t)


def test_server_takes_the_visible_mode(streamed):
    store, defs, raw, items, seen = streamed
    reader = SequenceReader(store, "s1")
    server = serve_in_thread(store, refresh_seconds=0)
    try:
        for at, _ in seen[::3]:
            u = USERS[at % len(USERS)]
            url = f"{server.url}/v1/users/{u}/sequences/s1?as_of={at}&as_of_mode=visible"
            with urllib.request.urlopen(url, timeout=30) as r:
                assert json.loads(r.read())["events"] == reader.events(u, at, as_of_mode="visible")
            body = json.dumps({"user_ids": USERS, "as_of": at, "as_of_mode": "visible"}).encode()
            req = urllib.request.Request(f"{server.url}/v1/sequences/s1:batchGet", body, method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                got = [x["events"] for x in json.loads(r.read())["results"]]
            assert got == [reader.events(u, at, as_of_mode="visible") for u in USERS]
    finally:
        server.shutdown()
        server.server_close()


def test_training_history_in_visible_mode_equals_brute_force(streamed):
    store, defs, raw, items, seen = streamed
    seq = defs.sequence("s1")
    stored = _stored(store, seq)
    kw = dict(max_seq_len=4, num_actions=3, num_surfaces=4)
    src = PointInTimeExamples(store, "s1", defs, as_of_mode="visible", split="eval", **kw)
    event_src = PointInTimeExamples(store, "s1", defs, split="eval", **kw)
    assert len(src) > 0
    shorter = 0
    for i in range(0, len(src), max(len(src) // 40, 1)):
        user, ts = src.anchor(i)
        events = reference_visible_query(stored, [*seq.fields], seq.max_length, user, ts, 4)
        got = src[i]
        assert int(got["mask"].sum()) == len(events)
        np.testing.assert_array_equal(got["timestamps"][: len(events)], [e["ts"] // 1000 for e in events])
        shorter += int(event_src[i]["mask"].sum()) > len(events)
    assert shorter > 0, "some anchor must see fewer events than were stored by its time"
    at = seen[len(seen) // 2][0]
    batch = src.sequences(USERS, [at] * len(USERS))
    for k, u in enumerate(USERS):
        n = len(reference_visible_query(stored, [*seq.fields], seq.max_length, u, at, 4))
        assert int(batch["mask"][k].sum()) == n
    sb = SequenceBatches(store, "s1", defs, global_batch_size=4, as_of_mode="visible", split="eval", **kw)
    assert sb.source.as_of_mode == "visible"


def test_config_takes_visible(streamed):
    from jaxscale.training.config import ConfigError, load_config

    store, defs = streamed[0], streamed[1]
    defs_path = store.parent / "defs.json"
    defs_path.write_text(defs.dumps())
    base = ["data.source=sequences", f"data.sequences.store={store}", "data.sequences.sequence=s1"]
    base += [f"data.sequences.defs={defs_path}", "train.batch_size=8"]
    cfg = load_config(None, [*base, "data.sequences.as_of_mode=visible"])
    assert cfg.data.sequences.as_of_mode == "visible"

    class Model:
        max_seq_len, num_actions, num_surfaces = 4, 3, 4

    assert SequenceBatches.from_config(Model, cfg, "eval", 0, 1).source.as_of_mode == "visible"
    with pytest.raises(ConfigError, match="visible"):
        load_config(None, [*base, "data.sequences.as_of_mode=commit"])


def test_files_without_visible_ts_count_from_their_write(tmp_path):
    """A backfill's files carry no commit time: visible from their modification time (documented)."""
    defs = make_defs()
    raw, items = _log(tmp_path, seed=9, rows=60)
    before = time.time_ns() // 1_000_000
    backfill(defs, tmp_path / "events", tmp_path / "store", sources={"items": items})
    reader = SequenceReader(tmp_path / "store", "s1")
    files = [f for p in list_partitions(tmp_path / "store" / "s1").values() for f in partition_files(p)]
    assert files and all(VISIBLE_TS not in pq.read_schema(f).names for f in files)
    mtimes = {-(-f.stat().st_mtime_ns // 1_000_000) for f in files}
    late = max(raw.ts) + 1
    for u in USERS:
        assert reader.events(u, min(before, min(raw.ts)), as_of_mode="visible") == []
        assert reader.events(u, max(max(mtimes), late) + 1, as_of_mode="visible") == reader.events(u, late)


def test_broker_consumer_visible_mode_answers_what_a_reader_saw(tmp_path, redis_port):  # noqa: F811
    """The broker's ingest_ts is Redis' receive time: every event below was received before the consumer
    started, yet committed micro-batch by micro-batch. The visible mode at each moment answers what a reader
    of the store saw then; the ingest mode claims every received event."""
    from jaxscale.sequences.broker import Producer, StreamConsumer

    defs = make_defs(max_length=6)
    raw, items = _log(tmp_path, seed=21, rows=200, spread_ms=60_000)
    url = f"redis://127.0.0.1:{redis_port}/ev"
    Producer(url, batch=10).publish_files(tmp_path / "events")
    consumer = StreamConsumer(defs, url, "g", tmp_path / "store", sources={"items": items}, micro_batch=30)
    seen, real = [], consumer.process

    def process_then_look(entries):
        real(entries)
        time.sleep(0.003)
        at = time.time_ns() // 1_000_000
        reader = SequenceReader(tmp_path / "store", "s1")
        seen.append((at, {u: reader.events(u, at) for u in USERS}))
        time.sleep(0.003)

    consumer.process = process_then_look
    consumer.run(until_idle=0.3)
    assert len(seen) >= 5
    reader = SequenceReader(tmp_path / "store", "s1")
    stored = _stored(tmp_path / "store", defs.sequence("s1"))
    assert (stored[VISIBLE_TS] > stored["ingest_ts"]).all()
    claims_more = 0
    for at, then in seen:
        for u in USERS:
            assert reader.events(u, at, as_of_mode="visible") == then[u], (at, u)
            claims_more += reader.events(u, at, as_of_mode="ingest") != then[u]
    assert claims_more > 5
