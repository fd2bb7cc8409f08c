"""The sequence store: Parquet partitioned by day, replaced atomically, one writer at a time.

Layout (`<store>/<sequence>/`):

    _sequence.json                 the sequence's definition and column types (the store describes itself)
    dt=YYYY-MM-DD/part-*.parquet   the day's events (UTC day of `ts`); each file sorted by (user_id, ts, arrival)
    .staging/                      partitions being written (never read; cleaned by the next writer)
    .lock                          flock held by the one writer (backfill or stream)

A partition is replaced by writing the new one under `.staging/` and exchanging the two directories with
one `renameat2(RENAME_EXCHANGE)` call (Linux), so a reader or a crash sees either the old partition or the
new one, whole. New files (stream deltas) appear by an atomic rename inside the partition. Where
RENAME_EXCHANGE is unavailable, the old partition is moved aside first and put back by the next writer if
the run died in between.

The serving and training index is the sort order: every file is sorted by (user_id, ts, arrival), so a
user's events are one contiguous run per file, found by binary search.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import errno
import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jaxscale.infra import atomic
from jaxscale.infra.atomic import fsync_dir
from jaxscale.sequences.definitions import SCHEMA_VERSION
from jaxscale.sequences.eventid import EVENT_ID

MS_PER_DAY = 86_400_000
SEQUENCE_META = "_sequence.json"
STAGING = ".staging"
LOCK = ".lock"
PARQUET_ROW_GROUP = 65_536
DELTA_COMPRESSION = "lz4"
"""Stream micro-batch files are written fast (lz4); merged and backfilled partitions use zstd."""
STORE_SORT_KEYS = ("user_id", "ts", "arrival")
VISIBLE_TS = "visible_ts"
"""A file-only column (like the event id, outside the sequence's meta): the epoch ms of the commit that made
the event visible in the store (`as_of_mode='visible'`, see `jaxscale.sequences.query`)."""
FILE_ONLY_COLUMNS = (EVENT_ID, VISIBLE_TS)


class StoreError(RuntimeError):
    """The store cannot be used as asked (another writer, a different definition, a corrupt partition)."""


# ---------------------------------------------------------------------------------------------- days


def day_number(day: str) -> int:
    """Days since 1970-01-01 of 'YYYY-MM-DD' (ValueError naming the value if malformed)."""
    try:
        d = _dt.date.fromisoformat(day)
    except (TypeError, ValueError):
        raise ValueError(f"not a YYYY-MM-DD date: {day!r}") from None
    if len(day) != 10:
        raise ValueError(f"not a YYYY-MM-DD date: {day!r}")
    return (d - _dt.date(1970, 1, 1)).days


def day_name(day_num: int) -> str:
    return (_dt.date(1970, 1, 1) + _dt.timedelta(days=int(day_num))).isoformat()


# ---------------------------------------------------------------------------------- atomic primitives


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2_exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux renameat2). False where the call is unavailable."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def partition_dir(seq_dir: Path, day: str) -> Path:
    return Path(seq_dir) / f"dt={day}"


STATISTICS_COLUMNS = ("user_id", "ts")
"""Columns whose min/max each row group records (a user's or a time range's row groups can be found)."""


def write_table(path: Path, table: pa.Table, compression: str = "zstd", *, sync: bool = True) -> None:
    """One Parquet file, fsynced unless `sync` is False (the caller then fsyncs it before any rename, see
    `sync_staged`) (row groups of PARQUET_ROW_GROUP rows carry user_id and ts min/max statistics). Only
    string columns are dictionary encoded: the int64 columns (ids, times) are nearly distinct, where trying
    a dictionary first cost a backfill a third of its write time."""
    strings = [f.name for f in table.schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    stats = [c for c in STATISTICS_COLUMNS if c in table.column_names]
    # Written by Arrow's own file (a Python file object took the GIL for every write, stalling the other
    # threads of a backfill); then reopened to fsync.
    pq.write_table(
        table,
        str(path),
        row_group_size=PARQUET_ROW_GROUP,
        compression=compression,
        use_dictionary=strings or False,
        write_statistics=stats or False,
    )
    if sync:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_partition(seq_dir: Path, day: str, table: pa.Table | None) -> None:
    """Makes partition `day` hold exactly `table` (None or empty: removes it), atomically."""
    seq_dir = Path(seq_dir)
    target = partition_dir(seq_dir, day)
    staging_root = seq_dir / STAGING
    staging_root.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:12]
    if table is None or table.num_rows == 0:
        if target.exists():
            trash = staging_root / f"trash-dt={day}-{token}"
            os.rename(target, trash)
            fsync_dir(seq_dir)
            shutil.rmtree(trash, ignore_errors=True)
        return
    install_partition(seq_dir, day, stage_partition(seq_dir, day, table))


def stage_partition(seq_dir: Path, day: str, table: pa.Table, *, sync: bool = True) -> Path:
    """Writes `table` as partition `day`'s complete directory under .staging, not yet visible
    (`install_partition` makes it so): a backfill writes days while its vocabularies are still being saved,
    and installs them after. Fsynced, unless `sync` is False: then `sync_staged` must run before the
    install (a backfill leaves that wait on the disk to another thread)."""
    staging_root = Path(seq_dir) / STAGING
    staging_root.mkdir(parents=True, exist_ok=True)
    new = staging_root / f"new-dt={day}-{uuid.uuid4().hex[:12]}"
    new.mkdir()
    write_table(new / "part-00000000.parquet", table, sync=sync)
    if sync:
        fsync_dir(new)
    return new


def sync_staged(new: Path) -> None:
    """Fsyncs a staged partition directory's files, then the directory: what `install_partition` needs."""
    for path in partition_files(new):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(new)


def install_partition(seq_dir: Path, day: str, new: Path, *, sync: bool = True) -> None:
    """Puts the complete directory `new` (under .staging) in place of partition `day`, atomically; the
    rename is made durable (`seq_dir` fsynced) unless `sync` is False (a backfill fsyncs once after
    installing all its days)."""
    target = partition_dir(seq_dir, day)
    if not target.exists():
        os.rename(new, target)
    elif _renameat2_exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)  # `new` now holds the old partition
    else:
        aside = new.with_name(f"old-dt={day}-{uuid.uuid4().hex[:12]}")
        os.rename(target, aside)  # a crash here is repaired by recover_staging()
        os.rename(new, target)
        shutil.rmtree(aside, ignore_errors=True)
    if sync:
        fsync_dir(seq_dir)


def add_partition_file(seq_dir: Path, day: str, table: pa.Table, name: str) -> None:
    """Adds one sorted file to partition `day` (created if absent) by an atomic rename."""
    target = partition_dir(seq_dir, day)
    if not target.exists():
        staging_root = Path(seq_dir) / STAGING
        staging_root.mkdir(parents=True, exist_ok=True)
        new = staging_root / f"new-dt={day}-{uuid.uuid4().hex[:12]}"
        new.mkdir()
        write_table(new / name, table, DELTA_COMPRESSION)
        fsync_dir(new)
        install_partition(seq_dir, day, new)
        return
    with atomic.replacing(target / name) as tmp:
        write_table(tmp, table, DELTA_COMPRESSION, sync=False)  # replacing() fsyncs it


def merge_partition_files(seq_dir: Path, day: str, merge: list[Path], merged: pa.Table, name: str) -> None:
    """Replaces the files `merge` of partition `day` by one file holding `merged` (their rows, sorted), atomically.

    The partition's other files are hard-linked into the new directory, so only the merged rows are written.
    """
    target = partition_dir(seq_dir, day)
    staging_root = Path(seq_dir) / STAGING
    staging_root.mkdir(parents=True, exist_ok=True)
    new = staging_root / f"new-dt={day}-{uuid.uuid4().hex[:12]}"
    new.mkdir()
    for f in partition_files(target):
        if f not in merge:
            os.link(f, new / f.name)
    write_table(new / name, merged)
    fsync_dir(new)
    install_partition(seq_dir, day, new)


def recover_staging(seq_dir: Path) -> None:
    """Cleans what a dead writer left: puts moved-aside partitions back, deletes unfinished ones."""
    staging_root = Path(seq_dir) / STAGING
    if not staging_root.exists():
        return
    for entry in sorted(staging_root.iterdir()):
        if entry.name.startswith("old-dt="):
            day = entry.name[len("old-dt=") :].rsplit("-", 1)[0]
            target = partition_dir(seq_dir, day)
            if not target.exists():
                os.rename(entry, target)
                continue
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
    for part in Path(seq_dir).glob("dt=*"):
        for tmp in part.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------- the writer


@contextlib.contextmanager
def writer_lock(seq_dir: Path, *, wait: bool = False) -> Iterator[None]:
    """Exclusive writer lock on one sequence of a store (released when the process dies). `wait` blocks
    until the lock is free (stream consumers sharing a store take it per commit); otherwise StoreError."""
    seq_dir = Path(seq_dir)
    seq_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(seq_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"{seq_dir} is being written by another process (backfill or stream)") from None
        recover_staging(seq_dir)
        yield
    finally:
        os.close(fd)


def sequence_meta(sequence, columns: dict[str, str]) -> dict:
    return {"schema_version": SCHEMA_VERSION, "sequence": sequence.to_json(), "columns": columns}


def ensure_sequence_meta(seq_dir: Path, meta: dict) -> None:
    """Writes `_sequence.json`, or checks that the store was built with the same definition."""
    path = Path(seq_dir) / SEQUENCE_META
    if path.exists():
        old = read_sequence_meta(seq_dir)
        if old != meta:
            raise StoreError(
                f"{seq_dir} holds sequence {meta['sequence']['name']!r} built from a different definition "
                f"({json.dumps(old['sequence'], sort_keys=True)} with columns {old['columns']}); "
                "write to another store or delete this sequence's directory"
            )
        return
    atomic.write_json(path, meta)


def read_sequence_meta(seq_dir: Path) -> dict:
    path = Path(seq_dir) / SEQUENCE_META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreError(f"{seq_dir} is not a sequence of a store (no {SEQUENCE_META})") from None
    except json.JSONDecodeError as e:
        raise StoreError(f"{path} is corrupt: {e}") from None
    if meta.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(
            f"{path} has schema_version {meta.get('schema_version')!r}; this jaxscale reads {SCHEMA_VERSION}"
        )
    return meta


# -------------------------------------------------------------------------------------- the readers


def list_sequences(store: Path) -> list[str]:
    store = Path(store)
    if not store.is_dir():
        return []
    return sorted(p.name for p in store.iterdir() if (p / SEQUENCE_META).is_file())


def list_partitions(seq_dir: Path) -> dict[str, Path]:
    """{day: directory} of the complete partitions, in day order."""
    seq_dir = Path(seq_dir)
    if not seq_dir.is_dir():
        return {}
    out = {}
    for p in seq_dir.iterdir():
        if p.name.startswith("dt=") and p.is_dir():
            out[p.name[3:]] = p
    return dict(sorted(out.items()))


def partition_files(part: Path) -> list[Path]:
    return sorted(f for f in Path(part).iterdir() if f.name.endswith(".parquet") and not f.name.startswith("."))


def file_visible_ms(path: Path) -> int:
    """When a file without a `visible_ts` column (a backfill's, or one written before the column existed)
    counts as visible: its modification time, rounded up to the millisecond (it was written then and
    installed after)."""
    return -(-os.stat(path).st_mtime_ns // 1_000_000)


def with_visible_ts(table: pa.Table, path: Path) -> pa.Table:
    """`table` (read from `path`) with its `visible_ts` column: the file's own, else `file_visible_ms`."""
    if VISIBLE_TS in table.column_names:
        return table
    return table.append_column(VISIBLE_TS, pa.array([file_visible_ms(path)] * table.num_rows, pa.int64()))


def read_partition(part: Path, columns: list[str] | None = None) -> pa.Table:
    """A partition's events sorted by (user_id, ts, arrival) (merging a stream's files); by default every
    column but the files' own `event_id` (what de-duplication reads, see `jaxscale.sequences.eventid`) and
    `visible_ts` (what `as_of_mode='visible'` reads)."""
    files = partition_files(part)
    if columns is None and files:
        columns = [c for c in pq.read_schema(files[0]).names if c not in FILE_ONLY_COLUMNS]
    tables = [pq.read_table(f, columns=columns) for f in files]
    if not tables:
        raise StoreError(f"partition {part} has no Parquet file")
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    if len(tables) > 1:
        table = table.sort_by([(k, "ascending") for k in STORE_SORT_KEYS])
    return table


def read_sequence(store: Path, name: str, columns: list[str] | None = None) -> pa.Table:
    """Every stored event of one sequence, sorted by (user_id, ts, arrival) (for tests and tools); by default
    the sequence's declared columns (not the files' `event_id`)."""
    seq_dir = Path(store) / name
    meta = read_sequence_meta(seq_dir)
    columns = columns or list(meta["columns"])
    parts = [read_partition(p, columns) for p in list_partitions(seq_dir).values()]
    if not parts:
        types = {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string()}
        cols = columns or list(meta["columns"])
        return pa.schema([(c, types[meta["columns"][c]]) for c in cols]).empty_table()
    table = pa.concat_tables(parts)
    return table.sort_by([(k, "ascending") for k in STORE_SORT_KEYS])
