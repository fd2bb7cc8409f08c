"""The streaming writer: commits one micro-batch into the store, each event at most once.

Both streams (the file replay in `runtime.stream` and the broker consumer in `jaxscale.sequences.broker`)
hand it a micro-batch's transformed frames ({(sequence, day): [frames]}). `commit`:

1. assembles each (sequence, day) (sorted; an event id seen twice in the batch keeps its first arrival),
2. drops the events whose id is already stored in that partition (`StoredIds`: the ids of the partition's
   files, cached per file and bounded), so a re-delivered batch adds nothing it already added,
3. extends the vocabularies by what is left, then adds one sorted file per (sequence, day) by an atomic
   rename, merging a partition's small files once it has more than `max_files`.

Each file's events carry the commit's time, `visible_ts` (epoch ms, one per commit): taken after the
vocabularies are saved, right before the commit's first file is written, so every event of the commit
became visible to readers of the store at most one commit's write time (its files' write + fsync +
rename, milliseconds) after its `visible_ts`, and none of it was visible before. A merge keeps each
event's `visible_ts` (`as_of_mode='visible'` in `jaxscale.sequences.query`).

With `shared=True` (several consumers writing one store, one per broker partition) every commit takes the
sequences' writer locks, waiting for them, and reloads the vocabularies under them; a run that owns the
store (the file replay) takes the locks once for the whole run instead (`runtime.open_sequences`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from jaxscale.sequences.definitions import Definitions
from jaxscale.sequences.engine import Engine
from jaxscale.sequences.eventid import EVENT_ID
from jaxscale.sequences.store import (
    VISIBLE_TS,
    add_partition_file,
    day_name,
    merge_partition_files,
    partition_dir,
    partition_files,
    with_visible_ts,
    writer_lock,
)
from jaxscale.sequences.vocabulary import IdCounter, VocabularyWriter

DEFAULT_CACHED_IDS = 20_000_000
"""Event ids the de-duplication cache holds at most (8 bytes each: 160 MB)."""


def file_ids(path: Path) -> np.ndarray:
    """The sorted event ids of one partition file (none for a file written before event ids existed)."""
    pf = pq.ParquetFile(path)
    if EVENT_ID not in pf.schema_arrow.names:
        return np.zeros(0, np.int64)
    return np.sort(pf.read(columns=[EVENT_ID]).column(EVENT_ID).to_numpy())


def _file_key(path: Path) -> tuple:
    st = os.stat(path)
    return (path.name, st.st_ino, st.st_size, st.st_mtime_ns)


class StoredIds:
    """The event ids stored per (sequence, day) partition, cached per file (a file is immutable; a merge or
    a backfill makes a new one, recognised by name, inode, size and mtime), least recently used evicted
    beyond `max_ids`. Always checked against the partition's current files, so it stays right when another
    writer adds or merges files."""

    def __init__(self, max_ids: int = DEFAULT_CACHED_IDS):
        self.max_ids = max_ids
        self._parts: OrderedDict[Path, dict[tuple, np.ndarray]] = OrderedDict()
        self.loaded_files = 0

    def contains(self, part: Path, ids: np.ndarray) -> np.ndarray:
        """Mask of `ids` already stored in partition directory `part`."""
        hit = np.zeros(len(ids), bool)
        if not part.exists():
            self._parts.pop(part, None)
            return hit
        for stored in self._current(part).values():
            if len(stored):
                pos = np.minimum(np.searchsorted(stored, ids), len(stored) - 1)
                hit |= stored[pos] == ids
        return hit

    def added(self, part: Path, name: str, ids: np.ndarray) -> None:
        """Records the file `name` just written to `part` (saves reading it back)."""
        if part in self._parts:
            self._parts[part][_file_key(part / name)] = np.sort(ids)

    def _current(self, part: Path) -> dict[tuple, np.ndarray]:
        old = self._parts.pop(part, {})
        new = {}
        for f in partition_files(part):
            key = _file_key(f)
            if key not in old:
                self.loaded_files += 1
            new[key] = old[key] if key in old else file_ids(f)
        self._parts[part] = new
        self._evict()
        return new

    def _evict(self) -> None:
        total = sum(len(a) for files in self._parts.values() for a in files.values())
        while total > self.max_ids and len(self._parts) > 1:
            _, files = self._parts.popitem(last=False)
            total -= sum(len(a) for a in files.values())


@dataclasses.dataclass
class CommitStats:
    """What one or more commits did (summed into the run report and the metrics)."""

    events: int = 0
    """Events written."""
    duplicates: int = 0
    """Events dropped because their id was already stored or seen earlier in the batch."""
    files: int = 0
    merges: int = 0
    seconds: float = 0.0

    def add(self, other: CommitStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "seconds": round(self.seconds, 3)}


class IncrementalWriter:
    """Commits micro-batches of one run into the store (see the module doc)."""

    def __init__(
        self,
        defs: Definitions,
        engine: Engine,
        store,
        *,
        max_files: int = 8,
        shared: bool = False,
        max_cached_ids: int = DEFAULT_CACHED_IDS,
    ):
        self.defs, self.engine, self.store = defs, engine, Path(store)
        self.max_files, self.shared = max_files, shared
        self.ids = StoredIds(max_cached_ids)
        self.token = uuid.uuid4().hex[:8]
        self.touched: dict[str, set[str]] = {s.name: set() for s in defs.sequences}
        self.totals = CommitStats()
        self.vocab: VocabularyWriter | None = None

    @contextlib.contextmanager
    def locked(self):
        """The sequences' writer locks (waiting for them) when the store is shared; nothing otherwise."""
        if not self.shared:
            yield
            return
        with contextlib.ExitStack() as stack:
            for s in sorted(self.defs.sequences, key=lambda s: s.name):  # one order: no deadlock
                stack.enter_context(writer_lock(self.store / s.name, wait=True))
            yield

    def start(self) -> None:
        """Makes sure every declared vocabulary exists (maybe empty) from the start of the run."""
        with self.locked():
            vocab = VocabularyWriter(self.store, self.defs)
            for s in self.defs.sequences:
                for f in s.vocabularies:
                    if vocab.current[(s.name, f)] is None:
                        vocab.update(s.name, f, IdCounter())
            self.vocab = vocab

    def commit(self, frames: dict[tuple[str, int], list[pl.DataFrame]], batch: int) -> CommitStats:
        """Writes one micro-batch (its frames per (sequence, day)); returns what it did."""
        t0 = time.perf_counter()
        stats = CommitStats()
        with self.locked():
            tables = self._new_events(frames, stats)
            self._update_vocabularies(tables)
            visible = time.time_ns() // 1_000_000  # the commit's time (module doc)
            for (name, day), table in sorted(tables.items()):
                table = table.append_column(VISIBLE_TS, pa.array(np.full(table.num_rows, visible, np.int64)))
                self._add_file(name, day, table, f"part-{batch:010d}-{self.token}.parquet", stats)
        stats.seconds = time.perf_counter() - t0
        self.totals.add(stats)
        return stats

    def _new_events(self, frames, stats: CommitStats) -> dict[tuple[str, str], pa.Table]:
        """{(sequence, day): assembled events not stored yet}."""
        out = {}
        for (name, day_num), parts in sorted(frames.items()):
            day = day_name(day_num)
            table = self.engine.assemble(name, parts)
            stats.duplicates += sum(len(p) for p in parts) - table.num_rows
            ids = table.column(EVENT_ID).to_numpy()
            stored = self.ids.contains(partition_dir(self.store / name, day), ids)
            if stored.any():
                stats.duplicates += int(stored.sum())
                table = table.filter(pa.array(~stored))
            if table.num_rows:
                out[(name, day)] = table
        return out

    def _update_vocabularies(self, tables: dict[tuple[str, str], pa.Table]) -> None:
        """Appends the batch's new ids before its files are added (readers never see an id the vocabulary
        lacks); a shared store's vocabularies are reloaded first (another consumer may have extended them)."""
        if not any(s.vocabularies for s in self.defs.sequences):
            return
        if self.shared or self.vocab is None:
            self.vocab = VocabularyWriter(self.store, self.defs)
        for s in self.defs.sequences:
            if not s.vocabularies:
                continue
            counters = {f: IdCounter() for f in s.vocabularies}
            for (name, _day), table in sorted(tables.items()):
                if name == s.name:
                    arrival = table.column("arrival").to_numpy()
                    for f in s.vocabularies:
                        counters[f].add(table.column(f).to_numpy(), arrival)
            for f in s.vocabularies:
                self.vocab.update(s.name, f, counters[f])

    def _add_file(self, name: str, day: str, table: pa.Table, file: str, stats: CommitStats) -> None:
        seq_dir = self.store / name
        add_partition_file(seq_dir, day, table, file)
        part = partition_dir(seq_dir, day)
        self.ids.added(part, file, table.column(EVENT_ID).to_numpy())
        self.touched[name].add(day)
        stats.events += table.num_rows
        stats.files += 1
        if len(partition_files(part)) > self.max_files:
            self.compact(name, day, keep_largest=True)
            stats.merges += 1

    def compact(self, name: str, day: str, *, keep_largest: bool = False) -> None:
        """Merges a partition's files (see `compact_partition`); the caller holds the lock."""
        compact_partition(self.engine, self.store, name, day, keep_largest=keep_largest)

    def finish(self) -> None:
        """Merges every partition the run touched into one file."""
        with self.locked():
            for name, days in self.touched.items():
                for day in sorted(days):
                    self.compact(name, day)


def compact_partition(engine: Engine, store: Path, name: str, day: str, *, keep_largest: bool = False) -> None:
    """Merges a partition's files into one, atomically; `keep_largest` leaves the biggest file alone (a
    size-tiered merge while streaming, so an old day's base file is not rewritten for every late event)."""
    seq_dir = Path(store) / name
    files = partition_files(partition_dir(seq_dir, day))
    if keep_largest:
        files = sorted(files, key=lambda f: f.stat().st_size)[:-1]
    if len(files) < 2:
        return
    merged = engine.assemble(name, [pl.from_arrow(with_visible_ts(pq.read_table(f), f)) for f in files])
    merge_partition_files(seq_dir, day, files, merged, f"part-m{uuid.uuid4().hex[:12]}.parquet")
