"""Ingestion-time point in time (`as_of_mode='ingest'`) against brute force on logs with many late events:
the stored ingest_ts, the reader in both modes, and a training example built in ingest mode."""

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_sequences_helpers import (
    T0,
    assert_frames_equal,
    by_user,
    make_defs,
    random_log,
    reference_ingest_query,
    reference_query,
    reference_store,
    store_frame,
)

from jaxscale.sequences.examples import PointInTimeExamples, SequenceBatches, model_item_ids
from jaxscale.sequences.query import SequenceReader
from jaxscale.sequences.runtime import backfill, stream
from jaxscale.sequences.store import read_sequence


@pytest.fixture(scope="module")
def late_store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ingest")
    defs = make_defs(max_length=6)
    raw, items = random_log(41, tmp, files=4, rows=300, users=6, days=4, late=0.5, ingest=True)
    report = backfill(defs, tmp / "events", tmp / "store", sources={"items": items})
    want, bad = reference_store(raw, defs, pd.read_parquet(items))
    return tmp / "store", defs, want, bad, report


def _queries(rows: pd.DataFrame, seed: int, n: int):
    """Random (user, as_of, limit): as_of around the stored ts and ingest_ts (late events' windows)."""
    rng = np.random.default_rng(seed)
    users = sorted(by_user(rows)) + [12345]
    lo, hi = int(rows.ts.min()) - 10, int(rows.ingest_ts.max()) + 10
    picks = np.concatenate([rows.ts.to_numpy(), rows.ingest_ts.to_numpy(), rows.ingest_ts.to_numpy() + 1])
    for _ in range(n):
        u = int(rng.choice(users))
        t = int(rng.choice(picks)) if rng.random() < 0.6 else int(rng.integers(lo, hi))
        yield u, t, [None, 0, 1, 2, 4, 100][int(rng.integers(6))]


def test_stored_ingest_ts_equals_brute_force(late_store):
    store, defs, want, bad, report = late_store
    for s in defs.sequences:
        got = store_frame(read_sequence(store, s.name))
        assert list(got.columns[:4]) == ["user_id", "ts", "arrival", "ingest_ts"]
        assert_frames_equal(got, want[s.name])
    late = want["s1"].ingest_ts - want["s1"].ts
    assert (late > 3_600_000).mean() > 0.2  # many events arrived hours after they happened
    assert {k: dict(v.bad) for k, v in report.files.items() if v.bad} == bad


def test_reader_both_modes_equal_brute_force(late_store):
    store, defs, want, _, _ = late_store
    differ = 0
    for s in defs.sequences:
        reader = SequenceReader(store, s.name)
        grouped = by_user(want[s.name])
        for u, t, limit in _queries(want[s.name], seed=len(s.name), n=400):
            event = reader.events(u, t, limit)
            ingest = reader.events(u, t, limit, as_of_mode="ingest")
            assert event == reference_query(grouped, s.fields, s.max_length, u, t, limit), (s.name, u, t, limit)
            assert ingest == reference_ingest_query(grouped, s.fields, s.max_length, u, t, limit), (u, t, limit)
            assert json.loads(reader.events_json(u, t, limit, "raw", as_of_mode="ingest")) == ingest
            got = reader.query(u, t, limit, as_of_mode="ingest")
            assert np.all(got["ingest_ts"] < t) and np.all(got["ts"] < t)
            differ += event != ingest
        assert reader.events(int(want[s.name].user_id.iloc[0]), None, None, as_of_mode="ingest") == reader.events(
            int(want[s.name].user_id.iloc[0])
        )
    assert differ > 50, "late events must make the two modes answer differently"


def test_unknown_mode_is_refused(late_store):
    reader = SequenceReader(late_store[0], "s1")
    with pytest.raises(ValueError, match="as_of_mode must be one of"):
        reader.events(1, 5, 1, as_of_mode="arrival")


def test_ingest_mode_equals_brute_force_while_streaming(tmp_path):
    """A stream's partitions hold several files (one per micro-batch): one reader refreshed after every
    commit answers both modes as a brute force over the events that have arrived."""
    defs = make_defs(max_length=5)
    raw, items = random_log(43, tmp_path, files=2, rows=160, users=4, days=3, late=0.5, ingest=True, bad=False)
    items_df = pd.read_parquet(items)
    readers = {}
    checked = []

    def check(i, report):
        rows = report.totals().rows
        want, _ = reference_store(raw.iloc[:rows], defs, items_df)
        for s in defs.sequences:
            if s.name not in readers:
                readers[s.name] = SequenceReader(tmp_path / "store", s.name)
            reader = readers[s.name]
            reader.refresh()
            grouped = by_user(want[s.name])
            if not grouped:
                continue
            for u, t, limit in _queries(want[s.name], seed=i, n=25):
                assert reader.events(u, t, limit) == reference_query(grouped, s.fields, s.max_length, u, t, limit)
                assert reader.events(u, t, limit, as_of_mode="ingest") == reference_ingest_query(
                    grouped, s.fields, s.max_length, u, t, limit
                )
        checked.append(max(len(p.segments) for p in readers["s1"].partitions))

    stream(defs, tmp_path / "events", tmp_path / "store", sources={"items": items}, micro_batch=23, on_commit=check)
    assert len(checked) >= 10 and max(checked) >= 3  # days of several files were queried


def test_absent_null_and_bad_ingest_ts(tmp_path):
    """No column: ingest_ts = ts; a null: ts; an unparsable value: a bad row, counted."""
    (tmp_path / "events").mkdir()
    base = {
        "user_id": [1, 1, 1, 1],
        "ts": [T0 + 10, T0 + 20, T0 + 30, T0 + 40],
        "event_type": ["a", "a", "b", "a"],
        "item_id": [0, 0, 0, 0],
        "surface": ["home"] * 4,
    }
    pq.write_table(pa.table(base), tmp_path / "events" / "part-0.parquet")
    ingest = pa.array(["5000", None, "soon", str(T0 + 999)], pa.string())
    later = pa.table({**base, "ts": [t + 100 for t in base["ts"]]})  # other events (not redeliveries)
    pq.write_table(later.append_column("ingest_ts", ingest), tmp_path / "events" / "part-1.parquet")
    pq.write_table(pa.table({"item_id": [0], "category": [1], "score": [0.5]}), tmp_path / "items.parquet")
    report = backfill(
        make_defs(), tmp_path / "events", tmp_path / "store", sources={"items": tmp_path / "items.parquet"}
    )
    assert dict(report.files["part-1.parquet"].bad) == {"wrong type ingest_ts": 1}
    got = read_sequence(tmp_path / "store", "s1").to_pandas()
    first = got[got.arrival < 2**32]
    second = got[got.arrival >= 2**32]
    assert first.ingest_ts.tolist() == first.ts.tolist()
    assert second.ingest_ts.tolist() == [5000, T0 + 120, T0 + 999]


def _brute_force_history(rows: pd.DataFrame, defs, seq, user: int, as_of: int, max_len: int) -> dict:
    events = reference_ingest_query(rows, [*seq.fields], seq.max_length, user, as_of, max_len)
    return {
        "item_ids": model_item_ids(np.array([e["item_id"] for e in events], np.int64)),
        "timestamps": np.array([e["ts"] // 1000 for e in events], np.int32),
        "actions": np.array([seq.event_types.index(e["event_type"]) for e in events], np.int32),
        "engaged": np.array([e["event_type"] in seq.engaged for e in events], np.float32),
    }


def test_training_history_in_ingest_mode_equals_brute_force(late_store):
    store, defs, want, _, _ = late_store
    seq = defs.sequence("s1")
    kw = dict(max_seq_len=4, num_actions=3, num_surfaces=4)
    src = PointInTimeExamples(store, "s1", defs, as_of_mode="ingest", **kw)
    event_src = PointInTimeExamples(store, "s1", defs, **kw)
    shorter = 0
    for i in range(0, len(src), max(len(src) // 60, 1)):
        user, ts = src.anchor(i)
        got = src[i]
        want_h = _brute_force_history(want["s1"], defs, seq, user, ts, 4)
        n = len(want_h["timestamps"])
        assert int(got["mask"].sum()) == n
        for k, v in want_h.items():
            np.testing.assert_array_equal(got[k][:n], v, err_msg=f"example {i} {k}")
        shorter += int(event_src[i]["mask"].sum()) > n
    assert shorter > 0, "some anchor must see fewer events in ingest mode"
    u, t = int(want["s1"].user_id.iloc[0]), int(want["s1"].ingest_ts.median())
    batch = src.sequences([u], [t])
    n = int(batch["mask"][0].sum())
    np.testing.assert_array_equal(
        batch["timestamps"][0, :n], _brute_force_history(want["s1"], defs, seq, u, t, 4)["timestamps"]
    )


def test_batches_take_the_mode(late_store):
    store, defs = late_store[0], late_store[1]
    sb = SequenceBatches(
        store, "s1", defs, global_batch_size=4, max_seq_len=4, num_actions=3, num_surfaces=4, as_of_mode="ingest"
    )
    assert sb.source.as_of_mode == "ingest"
    assert sb.batch(0)["mask"].shape == (4, 4)
    with pytest.raises(ValueError, match="needs split_mode='day'"):
        PointInTimeExamples(
            store,
            "s1",
            defs,
            max_seq_len=4,
            num_actions=3,
            num_surfaces=4,
            split_mode="leave_one_out",
            split="test",
            as_of_mode="ingest",
        )


def test_config_as_of_mode_reaches_the_source(late_store):
    from jaxscale.training.config import ConfigError, load_config

    store, defs = late_store[0], late_store[1]
    defs_path = store.parent / "defs.json"
    defs_path.write_text(defs.dumps())
    base = ["data.source=sequences", f"data.sequences.store={store}", "data.sequences.sequence=s1"]
    base += [f"data.sequences.defs={defs_path}", "train.batch_size=8"]
    cfg = load_config(None, [*base, "data.sequences.as_of_mode=ingest"])
    assert cfg.data.sequences.as_of_mode == "ingest"
    assert load_config(None, base).data.sequences.as_of_mode == "event"

    class Model:
        max_seq_len, num_actions, num_surfaces = 4, 3, 4

    sb = SequenceBatches.from_config(Model, cfg, "train", 0, 1)
    assert sb.source.as_of_mode == "ingest"
    with pytest.raises(ConfigError, match="as_of_mode"):
        load_config(None, [*base, "data.sequences.as_of_mode=arrival"])
