"""The store: idempotent re-backfill, atomic partition replace under a real kill, one writer at a time."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_sequences_helpers import make_defs, random_log, write_defs

from jaxscale.sequences.runtime import backfill
from jaxscale.sequences.store import (
    STAGING,
    StoreError,
    list_partitions,
    partition_dir,
    read_partition,
    replace_partition,
    writer_lock,
)

REPO = Path(__file__).resolve().parents[1]


def _partitions(store, name="s1"):
    return {d: read_partition(p) for d, p in list_partitions(Path(store) / name).items()}


def test_rebackfill_is_idempotent(tmp_path):
    defs = make_defs()
    random_log(10, tmp_path, days=3)
    store = tmp_path / "store"
    backfill(defs, tmp_path / "events", store, sources={"items": tmp_path / "items.parquet"})
    first = {p.relative_to(store): p.read_bytes() for p in store.rglob("dt=*/*.parquet")}
    backfill(defs, tmp_path / "events", store, sources={"items": tmp_path / "items.parquet"})
    second = {p.relative_to(store): p.read_bytes() for p in store.rglob("dt=*/*.parquet")}
    assert first == second and first
    assert not list((store / "s1" / STAGING).iterdir())


def test_rebackfill_replaces_a_day_exactly(tmp_path):
    """A day whose events changed holds exactly the new ones; a day left without events disappears."""
    defs = make_defs()
    random_log(11, tmp_path, days=3, late=0.0, files=3)
    store = tmp_path / "store"
    items = tmp_path / "items.parquet"
    backfill(defs, tmp_path / "events", store, sources={"items": items})
    days = sorted(_partitions(store))
    # Rewrite the log so that only the first file remains, with its events moved to the first day.
    files = sorted((tmp_path / "events").glob("*.parquet"))
    t = pq.read_table(files[0])
    for f in files[1:]:
        f.unlink()
    backfill(defs, tmp_path / "events", store, sources={"items": items}, start=days[0], end=days[-1])
    import pandas as pd
    from test_sequences_helpers import reference_store

    raw = pd.DataFrame(t.to_pylist())
    raw["file_rank"], raw["row"], raw["file"] = 0, range(len(raw)), files[0].name
    want, _ = reference_store(raw, defs, pd.read_parquet(items))
    got = pa.concat_tables(_partitions(store).values()).to_pandas()
    assert len(got) == len(want["s1"]) and got.equals(want["s1"].astype(got.dtypes.to_dict()))
    expected_days = {pd.Timestamp(t, unit="ms", tz="UTC").date().isoformat() for t in want["s1"].ts}
    assert set(_partitions(store)) == expected_days


def test_partition_replace_survives_a_kill(tmp_path):
    """A backfill SIGKILLed while it writes leaves every partition whole: the old one or the new one."""
    defs_path = write_defs(tmp_path)
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    random_log(12, old_dir, files=2, rows=400, days=2, bad=False)
    random_log(13, new_dir, files=4, rows=30_000, days=2, bad=False, users=500, row_group_size=8192)
    store = tmp_path / "store"
    defs = make_defs()
    backfill(defs, old_dir / "events", store, sources={"items": old_dir / "items.parquet"})
    old = {n: _partitions(store, n) for n in ("s1", "s2")}
    cmd = [
        sys.executable,
        "-m",
        "jaxscale.sequences",
        "backfill",
        "--defs",
        str(defs_path),
        "--events",
        str(new_dir / "events"),
        "--items",
        str(new_dir / "items.parquet"),
        "--out",
        str(store),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    staging = [store / n / STAGING for n in ("s1", "s2")]
    deadline, seen = time.monotonic() + 120, False
    while time.monotonic() < deadline and proc.poll() is None:
        if any(s.exists() and any(e.name.startswith("new-") for e in s.iterdir()) for s in staging):
            seen = True
            break
        time.sleep(0.0005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert seen, f"the backfill never started writing a partition: {proc.stderr.read().decode()[-2000:]}"
    # Build the complete new store separately, to know what a finished partition holds.
    backfill(defs, new_dir / "events", tmp_path / "ref", sources={"items": new_dir / "items.parquet"})
    new = {n: _partitions(tmp_path / "ref", n) for n in ("s1", "s2")}
    kinds = []
    for n in ("s1", "s2"):
        for day, table in _partitions(store, n).items():
            is_old, is_new = day in old[n] and table.equals(old[n][day]), day in new[n] and table.equals(new[n][day])
            assert is_old or is_new, f"{n} {day} is neither the old nor the new partition"
            kinds.append("new" if is_new else "old")
    assert "old" in kinds, "the kill came after every partition was replaced"
    # The next writer cleans up, and a re-run completes the replacement.
    backfill(defs, new_dir / "events", store, sources={"items": new_dir / "items.parquet"})
    for n in ("s1", "s2"):
        got = _partitions(store, n)
        assert got.keys() == new[n].keys() and all(got[d].equals(new[n][d]) for d in got)
        assert not list((store / n / STAGING).iterdir())


def test_one_writer_at_a_time(tmp_path):
    seq = tmp_path / "store" / "s1"
    with writer_lock(seq):
        with pytest.raises(StoreError, match="being written by another process"):
            with writer_lock(seq):
                pass
    with writer_lock(seq):  # released
        pass


def test_recovery_puts_a_moved_aside_partition_back(tmp_path):
    """Without RENAME_EXCHANGE a crash between the two renames leaves `old-dt=...`; the next writer restores it."""
    seq = tmp_path / "s1"
    table = pa.table({"user_id": [1], "ts": [0], "arrival": [0]})
    replace_partition(seq, "2026-01-05", table)
    (seq / STAGING).mkdir(exist_ok=True)
    os.rename(partition_dir(seq, "2026-01-05"), seq / STAGING / "old-dt=2026-01-05-abcdef")
    (seq / STAGING / "new-dt=2026-01-05-123456").mkdir()  # half-written new partition
    with writer_lock(seq):
        pass
    assert read_partition(partition_dir(seq, "2026-01-05")).equals(table)
    assert not list((seq / STAGING).iterdir())


def test_reader_refresh_loads_only_new_files(tmp_path):
    """While a stream adds a file per micro-batch (and compacts), a reader refreshed after every commit loads
    exactly the files it has not seen (a compaction's hard-linked files are kept), drops the removed ones,
    and answers as a reader opened from scratch."""
    from jaxscale.sequences.query import SequenceReader
    from jaxscale.sequences.runtime import stream
    from jaxscale.sequences.store import partition_files

    defs = make_defs()
    random_log(44, tmp_path, files=2, rows=150, users=5, days=2, late=0.3, bad=False)
    reader = {}
    seen: set = set()
    loads = []

    def check(i, report):
        if "r" not in reader:
            reader["r"] = SequenceReader(tmp_path / "store", "s1")
        r = reader["r"]
        before = r.stats["files_loaded"]
        r.refresh()
        on_disk = {
            (f.parent.name, f.name, f.stat().st_ino)
            for p in list_partitions(tmp_path / "store" / "s1").values()
            for f in partition_files(p)
        }
        new = on_disk - seen
        seen.clear()
        seen.update(on_disk)
        loads.append((r.stats["files_loaded"] - before, len(new) if i > 1 else r.stats["files_loaded"] - before))
        fresh = SequenceReader(tmp_path / "store", "s1")
        for u in range(5):
            user = u * 7919 + 10**12
            for t in (None, 1_767_571_200_000 + 86_400_000, 1_767_571_200_000 + 2 * 86_400_000):
                assert r.events(user, t, 4) == fresh.events(user, t, 4)

    stream(
        defs,
        tmp_path / "events",
        tmp_path / "store",
        sources={"items": tmp_path / "items.parquet"},
        micro_batch=20,
        max_files=3,
        on_commit=check,
    )
    assert len(loads) >= 10
    assert all(got == want for got, want in loads[1:]), loads
    assert reader["r"].stats["files_dropped"] > 0  # compactions replaced files
