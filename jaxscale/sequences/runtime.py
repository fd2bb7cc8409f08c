"""The batch and streaming runtimes: both feed raw chunks through the same `Engine` into the store.

backfill: every chunk of the log (row groups whose ts statistics fall outside --start/--end are skipped),
grouped by (sequence, day), each day assembled and installed atomically. Days of the range with no events
are removed, so re-running a day replaces it exactly. Transformed chunks are spilled per day and each day
is assembled as soon as no row group left to read can hold it (`jaxscale.sequences.spill`), so memory is
bounded by a few days, not the log.

stream: the log replayed in arrival order in micro-batches of N rows; each micro-batch's events are
assembled per (sequence, day) and added to their partitions as new sorted files (late events go to their
own, older, day) by `jaxscale.sequences.incremental.IncrementalWriter`, which drops events already stored
(by event id), so a re-run adds only what is missing; the report's `duplicates` counts the rows dropped so.
A partition with more than `max_files` files is merged into one; at the end every touched partition is
merged, so the final store holds what a backfill of the same log holds. The broker consumer
(`jaxscale.sequences.broker`) commits through the same writer.

Vocabularies (`Sequence.vocabularies`, see `jaxscale.sequences.vocabulary`) are written before the
partitions they cover: the backfill counts the whole store as it will be after the run (the days it writes
plus the stored days outside its range) and appends the ids the vocabulary lacks in frequency order; the
stream appends each micro-batch's new ids before adding its files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import sys
import time
import uuid
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import polars as pl

from jaxscale.infra import atomic
from jaxscale.sequences.definitions import Definitions
from jaxscale.sequences.engine import ChunkStats, Engine, load_enrichment_tables, split_days
from jaxscale.sequences.events import check_schema, find_event_files, read_stream
from jaxscale.sequences.incremental import IncrementalWriter
from jaxscale.sequences.spill import SPILL_BUDGET, DaySpill, DayWriter, WorkerPool, default_threads, spill_chunks
from jaxscale.sequences.store import (
    MS_PER_DAY,
    day_name,
    day_number,
    ensure_sequence_meta,
    list_partitions,
    partition_dir,
    partition_files,
    read_partition,
    replace_partition,
    sequence_meta,
    writer_lock,
)
from jaxscale.sequences.vocabulary import IdCounter, VocabularyWriter

REPORTS = "_reports"


@dataclasses.dataclass
class RunReport:
    """Per-file row accounting and what was written; saved to <store>/_reports/ and printed."""

    runtime: str
    events: str
    files: dict[str, ChunkStats] = dataclasses.field(default_factory=dict)
    partitions: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    removed: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    extra: dict = dataclasses.field(default_factory=dict)

    def add(self, file: str, stats: ChunkStats) -> None:
        self.files.setdefault(file, ChunkStats()).add(stats)

    def totals(self) -> ChunkStats:
        total = ChunkStats()
        for st in self.files.values():
            total.add(st)
        return total

    def to_json(self) -> dict:
        total = self.totals()
        return {
            "runtime": self.runtime,
            "events": self.events,
            "seconds": round(self.seconds, 3),
            "events_per_second": round(total.rows / self.seconds, 1) if self.seconds > 0 else None,
            "totals": total.to_json(),
            "files": {k: v.to_json() for k, v in self.files.items()},
            "partitions": self.partitions,
            "removed": self.removed,
            **self.extra,
        }

    def save(self, store: Path) -> Path:

        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S")
        path = Path(store) / REPORTS / f"{self.runtime}-{stamp}-{uuid.uuid4().hex[:6]}.json"
        atomic.write_json(path, self.to_json())
        return path

    def warn_bad_rows(self, stream=sys.stderr) -> None:
        """Prints the bad rows skipped per file, and the rows collapsed as duplicates, to `stream`."""
        for name, st in self.files.items():
            if st.bad:
                detail = ", ".join(f"{k}: {v}" for k, v in sorted(st.bad.items()))
                print(f"warning: {name}: {sum(st.bad.values())} bad rows skipped ({detail})", file=stream)
        if self.extra.get("duplicates"):
            print(
                f"note: {self.extra['duplicates']} rows collapsed as duplicates (an event id already stored or seen "
                "earlier in the run: the same event_id, or without one the same whole row)",
                file=stream,
            )


def day_range_ms(start: str | None, end: str | None) -> tuple[int | None, int | None]:
    """[lo, hi) in epoch ms for the inclusive day range --start .. --end (either may be open)."""
    lo = day_number(start) * MS_PER_DAY if start else None
    hi = (day_number(end) + 1) * MS_PER_DAY if end else None
    if lo is not None and hi is not None and hi <= lo:
        raise ValueError(f"--end {end} is before --start {start}")
    return lo, hi


@contextlib.contextmanager
def open_sequences(defs: Definitions, engine: Engine, store: Path):
    """Locks every sequence of `defs` in the store and checks/writes their definitions."""
    store = Path(store)
    with contextlib.ExitStack() as stack:
        for s in defs.sequences:
            stack.enter_context(writer_lock(store / s.name))
            ensure_sequence_meta(store / s.name, sequence_meta(s, engine.columns[s.name]))
        yield


def prepare(defs: Definitions, events, sources: dict[str, str] | None):
    """Files (schemas checked, so a bad file fails before anything is written) and the engine."""
    files = find_event_files(events)
    for f in files:
        check_schema(f)
    engine = Engine(defs, load_enrichment_tables(defs, dict(sources or {})))
    return files, engine


def backfill(
    defs: Definitions,
    events,
    store,
    *,
    sources: dict[str, str] | None = None,
    start: str | None = None,
    end: str | None = None,
    threads: int | None = None,
    spill_budget: int = SPILL_BUDGET,
) -> RunReport:
    """Indexes the log into the store, replacing each day of the range exactly (see module doc). Memory is
    bounded by `spill_budget` bytes of transformed frames plus the chunks and days in flight, not by the
    log (`jaxscale.sequences.spill`); `threads` worker threads (default: the usable CPUs)."""
    t0 = time.perf_counter()
    lo_ms, hi_ms = day_range_ms(start, end)
    files, engine = prepare(defs, events, sources)
    report = RunReport("backfill", str(events))
    threads = default_threads() if threads is None else _check_threads(threads)
    with open_sequences(defs, engine, store), WorkerPool(threads) as pool:
        vocab = VocabularyWriter(store, defs)
        counters = {s.name: {f: IdCounter() for f in vocab.fields(s.name)} for s in defs.sequences}
        spill = DaySpill(Path(store), [s.name for s in defs.sequences], spill_budget)
        writer = DayWriter(engine, Path(store), spill, pool)
        try:
            chunks = spill_chunks(engine, files, spill, counters, lo_ms, hi_ms, pool, threads, writer.complete)
            for file, stats in chunks:
                report.add(file, stats)
            total = report.totals()
            first = day_number(start) if start else total.first_day
            last = day_number(end) if end else total.last_day
            days = range(first, last + 1) if first is not None and last is not None else range(0)
            # On a thread of its own: a worker keeps assembling days meanwhile (they are installed after it).
            with ThreadPoolExecutor(1, thread_name_prefix="vocab") as saver:
                saved = saver.submit(save_vocabularies, vocab, defs, Path(store), days, counters)
                saved.add_done_callback(lambda f: _copy_outcome(f, writer.vocabularies))
                for s in defs.sequences:
                    report.partitions[s.name], report.removed[s.name] = writer.finish(s.name, days)
                saved.result()
        finally:
            writer.close()
            spill.remove()
    report.seconds = time.perf_counter() - t0
    report.extra["threads"] = threads
    report.extra["spilled_bytes"] = spill.spilled_bytes
    report.extra["range"] = {"start": day_name(days[0]), "end": day_name(days[-1])} if len(days) else None
    report.extra["duplicates"] = sum(engine.collapsed.values())
    report.extra["duplicates_by_sequence"] = {s.name: engine.collapsed[s.name] for s in defs.sequences}
    return report


def save_vocabularies(vocab: VocabularyWriter, defs: Definitions, store: Path, days, counters) -> None:
    """A backfill's vocabularies (the ids counted in its map phase) extended and saved, every sequence."""
    for s in defs.sequences:
        if s.vocabularies:
            update_vocabularies(vocab, store / s.name, {}, days, counters[s.name])


def _copy_outcome(src: Future, dst: Future) -> None:
    """Completes `dst` as `src` completed (its result or its exception)."""
    if src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


def _check_threads(threads) -> int:
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    return threads


def update_vocabularies(vocab: VocabularyWriter, seq_dir: Path, frames, days=None, counters=None) -> None:
    """Extends one sequence's vocabularies by the ids of `frames` ({(sequence, day): [frames]}) and, for a
    backfill of `days`, of the stored partitions outside them: the store as the run leaves it. Called
    before any of the frames' partitions is installed. `counters` ({field: IdCounter}) may hold ids
    counted elsewhere (the Ray workers)."""
    fields = vocab.fields(seq_dir.name)
    counters = counters if counters is not None else {f: IdCounter() for f in fields}
    for (name, _day), parts in sorted(frames.items()):
        if name == seq_dir.name:
            for df in parts:
                for f in fields:
                    counters[f].add(df.get_column(f).to_numpy(), df.get_column("arrival").to_numpy())
    inside = {day_name(d) for d in days} if days is not None else None
    for day, part in list_partitions(seq_dir).items() if inside is not None else ():
        if day not in inside:
            table = read_partition(part, [*fields, "arrival"])
            for f in fields:
                counters[f].add(table.column(f).to_numpy(), table.column("arrival").to_numpy())
    for f in fields:
        vocab.update(seq_dir.name, f, counters[f])


def install_days(engine: Engine, seq_dir: Path, days, frames) -> tuple[dict[str, int], list[str]]:
    """Replaces each day of `days` of one sequence with its assembled frames (removing days without events)."""
    written, removed = {}, []
    for day in days:
        parts = frames.pop((seq_dir.name, day), None)
        name = day_name(day)
        if parts:
            table = engine.assemble(seq_dir.name, parts)
            replace_partition(seq_dir, name, table)
            written[name] = table.num_rows
        elif partition_dir(seq_dir, name).exists():
            replace_partition(seq_dir, name, None)
            removed.append(name)
    return written, removed


def stream(
    defs: Definitions,
    events,
    store,
    *,
    sources: dict[str, str] | None = None,
    micro_batch: int,
    max_files: int = 8,
    on_commit=None,
) -> RunReport:
    """Replays the log in arrival order, `micro_batch` rows at a time, indexing each incrementally.

    `on_commit(i, report)` is called after micro-batch i is in the store (tests and monitoring).
    """
    if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch < 1:
        raise ValueError(f"--micro-batch must be a positive integer, got {micro_batch!r}")
    t0 = time.perf_counter()
    files, engine = prepare(defs, events, sources)
    report = RunReport("stream", str(events))
    with open_sequences(defs, engine, store):
        writer = IncrementalWriter(defs, engine, store, max_files=max_files)
        writer.start()
        batches = 0
        for batches, chunks in enumerate(read_stream(files, micro_batch), start=1):
            frames: dict[tuple[str, int], list[pl.DataFrame]] = defaultdict(list)
            for chunk in chunks:
                out, stats = engine.transform(chunk.table, chunk.file.name, chunk.arrival_start)
                report.add(chunk.file.name, stats)
                add_frames(frames, out)
            writer.commit(frames, batches)
            if on_commit is not None:
                on_commit(batches, report)
        writer.finish()
    finish_stream_report(report, writer, store, t0)
    report.extra["micro_batches"] = batches
    report.extra["micro_batch"] = micro_batch
    return report


def add_frames(frames: dict[tuple[str, int], list[pl.DataFrame]], out: dict[str, pl.DataFrame]) -> None:
    """Files one transformed chunk ({sequence: frame}) under its (sequence, day) keys."""
    for name, df in out.items():
        for day, part in split_days(df).items():
            frames[(name, day)].append(part)


def finish_stream_report(report: RunReport, writer: IncrementalWriter, store, t0: float) -> None:
    """Rows of every partition the stream touched, what its commits did, and the run's time."""
    for name, days in writer.touched.items():
        parts = list_partitions(Path(store) / name)
        report.partitions[name] = {d: sum(_rows(f) for f in partition_files(p)) for d, p in parts.items() if d in days}
    report.extra["commits"] = writer.totals.to_json()
    report.extra["duplicates"] = writer.totals.duplicates
    report.seconds = time.perf_counter() - t0


def _rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows
