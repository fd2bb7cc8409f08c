"""The engine and the backfill against a brute-force, row-by-row reference on random logs."""

import json
import shutil

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_sequences_helpers import (
    MS_PER_DAY,
    T0,
    assert_frames_equal,
    make_defs,
    random_log,
    reference_store,
    store_frame,
)

from jaxscale.sequences.engine import EnrichmentError
from jaxscale.sequences.events import EventsError
from jaxscale.sequences.runtime import backfill
from jaxscale.sequences.store import list_partitions, read_partition, read_sequence


def _snapshot(store):
    """{relative path: bytes} of every file of a store (to prove it did not change)."""
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backfill_equals_brute_force(tmp_path, seed):
    defs = make_defs()
    raw, items = random_log(seed, tmp_path, files=3, rows=250, days=3)
    report = backfill(defs, tmp_path / "events", tmp_path / "store", sources={"items": items})
    want, bad = reference_store(raw, defs, pd.read_parquet(items))
    for s in defs.sequences:
        assert_frames_equal(store_frame(read_sequence(tmp_path / "store", s.name)), want[s.name])
        assert report.totals().indexed[s.name] == len(want[s.name])
    got_bad = {name: dict(st.bad) for name, st in report.files.items() if st.bad}
    assert got_bad == bad and sum(sum(v.values()) for v in bad.values()) > 0
    assert report.totals().rows == len(raw)


def test_partitions_hold_their_day_sorted(tmp_path):
    defs = make_defs()
    random_log(3, tmp_path, days=4, late=0.3)
    backfill(defs, tmp_path / "events", tmp_path / "store", sources={"items": tmp_path / "items.parquet"})
    parts = list_partitions(tmp_path / "store" / "s1")
    assert len(parts) >= 3
    for day, path in parts.items():
        df = read_partition(path).to_pandas()
        days = {pd.Timestamp(t, unit="ms", tz="UTC").date().isoformat() for t in df.ts}
        assert days == {day}
        keys = list(zip(df.user_id, df.ts, df.arrival))
        assert keys == sorted(keys)


def test_range_backfill_rebuilds_only_its_days(tmp_path):
    defs = make_defs()
    raw, items = random_log(4, tmp_path, days=4, late=0.3)
    store = tmp_path / "store"
    backfill(defs, tmp_path / "events", store, sources={"items": items})
    before = {d: read_partition(p) for d, p in list_partitions(store / "s1").items()}
    # Change the log (drop the last file), then rebuild one day only.
    last = sorted((tmp_path / "events").glob("*.parquet"))[-1]
    last.unlink()
    raw = raw[raw.file != last.name]
    day = sorted(before)[1]
    lo = int(pd.Timestamp(day, tz="UTC").timestamp() * 1000)
    report = backfill(defs, tmp_path / "events", store, sources={"items": items}, start=day, end=day)
    want, _ = reference_store(raw, defs, pd.read_parquet(items), lo, lo + MS_PER_DAY)
    after = list_partitions(store / "s1")
    assert_frames_equal(store_frame(read_partition(after[day])), want["s1"])
    for d in before:
        if d != day:
            assert read_partition(after[d]).equals(before[d]), d
    assert report.totals().outside > 0


def test_missing_required_column_fails_naming_file_and_column(tmp_path):
    defs = make_defs()
    random_log(5, tmp_path)
    store = tmp_path / "store"
    backfill(defs, tmp_path / "events", store, sources={"items": tmp_path / "items.parquet"})
    snap = _snapshot(store)
    t = pq.read_table(tmp_path / "events" / "part-001.parquet").drop_columns(["surface"])
    pq.write_table(t, tmp_path / "events" / "part-001b.parquet")
    with pytest.raises(EventsError, match=r"part-001b\.parquet.*'surface'"):
        backfill(defs, tmp_path / "events", store, sources={"items": tmp_path / "items.parquet"})
    assert _snapshot(store) == snap


def test_column_of_unusable_type_fails(tmp_path):
    defs = make_defs()
    (tmp_path / "ev").mkdir()
    pq.write_table(
        pa.table(
            {
                "user_id": [1],
                "ts": pa.array([[T0]], pa.list_(pa.int64())),
                "event_type": ["a"],
                "item_id": [1],
                "surface": ["home"],
            }
        ),
        tmp_path / "ev" / "x.parquet",
    )
    with pytest.raises(EventsError, match=r"x\.parquet: column 'ts' has type list"):
        backfill(defs, tmp_path / "ev", tmp_path / "store", sources={"items": tmp_path / "i.parquet"})
    assert not (tmp_path / "store").exists()


def test_enrichment_table_errors(tmp_path):
    defs = make_defs()
    random_log(6, tmp_path, files=1)
    with pytest.raises(EnrichmentError, match="enrichment 'items' needs its source table 'items': pass --items"):
        backfill(defs, tmp_path / "events", tmp_path / "store")
    pq.write_table(pa.table({"item_id": [1, 1], "category": [2, 3], "score": [0.0, 1.0]}), tmp_path / "dup.parquet")
    with pytest.raises(EnrichmentError, match="duplicated 'item_id'"):
        backfill(defs, tmp_path / "events", tmp_path / "store", sources={"items": tmp_path / "dup.parquet"})
    pq.write_table(pa.table({"item_id": [1], "category": [2]}), tmp_path / "nocol.parquet")
    with pytest.raises(EnrichmentError, match="has no column 'score'"):
        backfill(defs, tmp_path / "events", tmp_path / "store", sources={"items": tmp_path / "nocol.parquet"})
    assert not (tmp_path / "store").exists()


def test_raw_types_and_layouts(tmp_path):
    """Timestamps stored as Arrow timestamps, dictionary strings, uint64 overflow, a nested dt= layout."""
    defs = make_defs()
    folder = tmp_path / "ev" / "dt=2026-01-05" / "hour=01"
    folder.mkdir(parents=True)
    t = pa.table(
        {
            "user_id": pa.array([1, 2, 2**63 + 5, 3], pa.uint64()),
            "ts": pa.array([T0, T0 + 5, T0 + 6, T0 + 7], pa.timestamp("ms")),
            "event_type": pa.array(["a", "b", "a", "zzz"]).dictionary_encode(),
            "item_id": [0, 10**9, 0, 0],
            "surface": ["home", "x", "home", "home"],
        }
    )
    pq.write_table(t, folder / "f.parquet")
    items = tmp_path / "items.parquet"
    pq.write_table(pa.table({"item_id": [0], "category": [7], "score": [0.5]}), items)
    report = backfill(defs, tmp_path / "ev", tmp_path / "store", sources={"items": items})
    got = read_sequence(tmp_path / "store", "s1").to_pylist()
    assert [(r["user_id"], r["ts"], r["event_type"], r["category"]) for r in got] == [
        (1, T0, "a", 7),
        (2, T0 + 5, "b", -1),
    ]
    st = report.files["dt=2026-01-05/hour=01/f.parquet"]
    assert dict(st.bad) == {"wrong type user_id": 1} and st.filtered == 1
    summary = json.loads(json.dumps(report.to_json()))
    assert summary["totals"]["bad_rows"] == 1


def test_rerun_into_store_of_other_definition_is_refused(tmp_path):
    from jaxscale.sequences.store import StoreError

    random_log(7, tmp_path, files=1)
    store = tmp_path / "store"
    backfill(make_defs(), tmp_path / "events", store, sources={"items": tmp_path / "items.parquet"})
    with pytest.raises(StoreError, match="different definition"):
        backfill(make_defs(max_length=9), tmp_path / "events", store, sources={"items": tmp_path / "items.parquet"})
    shutil.rmtree(store / "s1")
    backfill(make_defs(max_length=9), tmp_path / "events", store, sources={"items": tmp_path / "items.parquet"})


@pytest.mark.parametrize("spill_budget", [0, 4096, 1 << 30])
def test_backfill_spilling_to_disk_equals_brute_force(tmp_path, spill_budget):
    """The backfill keeps frames in memory up to its budget and spills the rest per day: every budget (all
    spilled, some, none) and thread count stores the brute force's rows, and leaves no spill file."""
    defs = make_defs()
    raw, items = random_log(7, tmp_path, files=3, rows=250, days=3, late=0.4, row_group_size=40)
    store = tmp_path / "store"
    report = backfill(defs, tmp_path / "events", store, sources={"items": items}, spill_budget=spill_budget, threads=2)
    want, _ = reference_store(raw, defs, pd.read_parquet(items))
    for s in defs.sequences:
        assert_frames_equal(store_frame(read_sequence(store, s.name)), want[s.name])
        assert not list((store / s.name / ".staging").rglob("*.arrow"))
    assert (report.extra["spilled_bytes"] > 0) == (spill_budget < 1 << 30)
    one = backfill(defs, tmp_path / "events", tmp_path / "one", sources={"items": items}, threads=1)
    for s in defs.sequences:
        assert read_sequence(tmp_path / "one", s.name).equals(read_sequence(store, s.name))
    assert one.partitions == report.partitions


def test_backfill_threads_must_be_positive(tmp_path):
    random_log(8, tmp_path, files=1, rows=20, days=1)
    with pytest.raises(ValueError, match="threads must be a positive integer"):
        backfill(
            make_defs(),
            tmp_path / "events",
            tmp_path / "store",
            sources={"items": tmp_path / "items.parquet"},
            threads=0,
        )


def _mixed_rows() -> pa.Table:
    """Good rows, a repeated event, and rows with a null in a hashed string column."""
    return pa.table(
        {
            "user_id": [7, 8, None, 9, 7, 10],
            "ts": [1000, 2000, 3000, 4000, 1000, 5000],
            "event_type": ["click", None, "save", "save", "click", "repin"],
            "item_id": [5, 6, 7, 8, 5, 9],
            "surface": ["home_feed", "search", "search", None, "home_feed", "related"],
        }
    )


def test_row_event_ids_are_pinned_and_equal_for_dictionary_encoded_strings():
    """Event ids are part of the store's contract (a restarted consumer must recognise stored events): the
    values (whole-row hashes, `jaxscale.sequences.eventid`) are pinned, and reading the string columns
    dictionary-encoded (as backfills do) changes nothing."""
    from jaxscale.sequences.events import validate_rows

    plain = _mixed_rows()
    encoded = plain.set_column(2, "event_type", plain.column("event_type").dictionary_encode())
    encoded = encoded.set_column(4, "surface", encoded.column("surface").dictionary_encode())
    want = [-7057318012852118057, -7057318012852118057, 608870729417864133]
    for table in (plain, encoded):
        df, bad = validate_rows(table, "log.parquet")
        assert df.get_column("event_id").to_list() == want
        assert df.get_column("row").to_list() == [0, 4, 5]
        assert df.get_column("surface").cast(str).to_list() == ["home_feed", "home_feed", "related"]
        assert bad == {"null user_id": 1, "null event_type": 1, "null surface": 1}


def test_enrichment_hash_and_sorted_lookups_agree(tmp_path, monkeypatch):
    """A small enrichment table is hashed per chunk, a large one binary-searched: the same rows either way."""
    import jaxscale.sequences.engine as engine_module
    from jaxscale.sequences.engine import Engine, load_enrichment_tables
    from jaxscale.sequences.events import find_event_files, read_chunks

    defs = make_defs()
    _, items = random_log(5, tmp_path, files=1, rows=400, row_group_size=400)
    engine = Engine(defs, load_enrichment_tables(defs, {"items": items}))
    chunk = next(read_chunks(find_event_files(tmp_path / "events")))
    outs = []
    for ratio in (0, 10**9):  # 0: always hashed; 10**9: always searched
        monkeypatch.setattr(engine_module, "HASH_LOOKUP_RATIO", ratio)
        outs.append(engine.transform(chunk.table, "f", chunk.arrival_start)[0])
    for name, frame in outs[0].items():
        assert frame.height and frame.equals(outs[1][name])


def test_days_assembled_during_the_map_give_the_same_bytes(tmp_path, monkeypatch):
    """Days completed by the row groups' ts statistics are assembled while the map runs (row groups read
    latest days first); the store is byte for byte what assembling every day after the map gives."""
    import jaxscale.sequences.spill as spill

    defs = make_defs()
    random_log(8, tmp_path, files=4, rows=300, days=4, late=0.3, row_group_size=50, bad=False)
    early = []
    complete = spill.DayWriter.complete
    monkeypatch.setattr(spill.DayWriter, "complete", lambda self, day: (early.append(day), complete(self, day)))
    kw = {"sources": {"items": tmp_path / "items.parquet"}, "threads": 2}
    backfill(defs, tmp_path / "events", tmp_path / "early", **kw)
    assert early, "no day completed before the map ended"
    monkeypatch.setattr(spill, "row_group_days", lambda pf, rg: None)  # statistics unknown: all days at the end
    backfill(defs, tmp_path / "events", tmp_path / "late", **kw)

    def stored(store):  # partitions, vocabularies and definitions: all but the run reports
        return {k: v for k, v in _snapshot(store).items() if not k.startswith("_reports/")}

    got, want = stored(tmp_path / "early"), stored(tmp_path / "late")
    assert any("/dt=" in k for k in got) and got == want


def test_spill_refuses_rows_for_a_day_already_assembled(tmp_path):
    """A row group whose rows fall outside its own ts statistics would add to a written day: an error."""
    import polars as pl

    from jaxscale.sequences.spill import DaySpill

    spill = DaySpill(tmp_path, ["s1"])
    frame = pl.DataFrame({"user_id": [1], "ts": [T0], "day": [T0 // MS_PER_DAY]}, schema_overrides={"day": pl.Int32})
    spill.add("s1", frame, 0)
    assert len(spill.take("s1", T0 // MS_PER_DAY)) == 1
    with pytest.raises(RuntimeError, match="already written"):
        spill.add("s1", frame, 1)
