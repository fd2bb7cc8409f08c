"""The backfill on Ray Data: the same engine functions, distributed over a cluster (or local processes).

    python -m jaxscale.sequences backfill --engine ray [--ray-address HOST:6379] --defs ... --events ... --out ...

Work units are the row groups of the raw files. `map_batches` runs `Engine.transform` on each unit (each
worker loads the definitions and enrichment tables once), emitting one Arrow IPC payload per
(sequence, day); `groupby(sequence, day).map_groups` runs `Engine.assemble` on each day and installs the
partition atomically. The driver holds the store's writer lock, checks every file's schema before any
work starts, sums the per-file row accounting and removes the days of the range that have no events, so
the store ends byte-for-byte what the embedded backfill writes (tested in local mode). For a sequence with
vocabularies each unit also emits its distinct ids (events, first arrival); the driver merges them with the
stored days outside the range and writes the vocabulary before the partitions are installed, the same
bytes as the embedded backfill's.

On a cluster the store and the raw files must be on a filesystem every node mounts at the same path, and
jaxscale importable on every node (installed, or shipped with `runtime_env={"py_modules": [...]}`).
"""

from __future__ import annotations

import functools
import json
import time
from collections import Counter
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from jaxscale.sequences.definitions import Definitions, definitions_from_json
from jaxscale.sequences.engine import ChunkStats, Engine, load_enrichment_tables, split_days
from jaxscale.sequences.events import EventFile, read_chunks
from jaxscale.sequences.runtime import (
    RunReport,
    day_range_ms,
    install_days,
    open_sequences,
    prepare,
    update_vocabularies,
)
from jaxscale.sequences.store import day_name, day_number, replace_partition
from jaxscale.sequences.vocabulary import IdCounter, VocabularyWriter

UNIT_SCHEMA = pa.schema(
    [
        ("kind", pa.string()),
        ("sequence", pa.string()),
        ("day", pa.int32()),
        ("file", pa.string()),
        ("payload", pa.binary()),
        ("stats", pa.string()),
    ]
)


@functools.lru_cache(maxsize=4)
def _engine(defs_json: str, sources_json: str) -> Engine:
    """One engine per worker process (definitions and enrichment tables loaded once)."""
    defs = definitions_from_json(json.loads(defs_json))
    return Engine(defs, load_enrichment_tables(defs, json.loads(sources_json)))


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def transform_units(batch: pa.Table, defs_json: str, sources_json: str, lo_ms, hi_ms) -> pa.Table:
    """map_batches function: raw row groups -> per-(sequence, day) payloads and per-file stats rows."""
    engine = _engine(defs_json, sources_json)
    rows = {name: [] for name in UNIT_SCHEMA.names}

    def emit(kind, sequence, day, file, payload, stats):
        for k, v in zip(UNIT_SCHEMA.names, (kind, sequence, day, file, payload, stats)):
            rows[k].append(v)

    for unit in batch.to_pylist():
        f = EventFile(Path(unit["path"]), unit["rank"], unit["name"])
        for chunk in read_chunks([f], lo_ms=lo_ms, hi_ms=hi_ms, row_groups={f.rank: [unit["row_group"]]}):
            out, stats = engine.transform(chunk.table, f.name, chunk.arrival_start, lo_ms, hi_ms)
            emit("stats", "", 0, f.name, b"", json.dumps(_stats_json(stats)))
            for name, df in out.items():
                for day, part in split_days(df).items():
                    emit("events", name, day, f.name, _ipc(part.to_arrow()), "")
                for field in engine.defs.sequence(name).vocabularies:
                    counter = IdCounter()
                    counter.add(df.get_column(field).to_numpy(), df.get_column("arrival").to_numpy())
                    ids, counts, first = counter.totals()
                    emit("vocab", name, 0, f.name, _ipc(pa.table({"id": ids, "count": counts, "first": first})), field)
    return pa.table(rows, schema=UNIT_SCHEMA)


def _stats_json(st: ChunkStats) -> dict:
    return {
        "rows": st.rows,
        "bad": dict(st.bad),
        "filtered": st.filtered,
        "outside": st.outside,
        "indexed": dict(st.indexed),
        "first_day": st.first_day,
        "last_day": st.last_day,
    }


def _stats_from_json(d: dict) -> ChunkStats:
    return ChunkStats(
        rows=d["rows"],
        bad=Counter(d["bad"]),
        filtered=d["filtered"],
        outside=d["outside"],
        indexed=Counter(d["indexed"]),
        first_day=d["first_day"],
        last_day=d["last_day"],
    )


def write_day(group: pa.Table, defs_json: str, sources_json: str, store: str, days_json: str) -> pa.Table:
    """map_groups function: one (sequence, day)'s payloads -> the assembled, atomically installed partition."""
    engine = _engine(defs_json, sources_json)
    name, day = group.column("sequence")[0].as_py(), group.column("day")[0].as_py()
    if day not in set(json.loads(days_json)):
        return pa.table({"sequence": [name], "day": [day], "rows": [0]})
    frames = [pl.from_arrow(_from_ipc(p)) for p in group.column("payload").to_pylist()]
    table = engine.assemble(name, frames)
    replace_partition(Path(store) / name, day_name(day), table)
    return pa.table({"sequence": [name], "day": [day], "rows": [table.num_rows]})


def backfill_ray(
    defs: Definitions,
    events,
    store,
    *,
    sources: dict[str, str] | None = None,
    start: str | None = None,
    end: str | None = None,
    address: str | None = None,
    num_cpus: int | None = None,
) -> RunReport:
    """`runtime.backfill` with the engine's work on Ray Data (connects to `address`, or starts locally)."""
    import ray
    import ray.data
    from ray.data.expressions import col

    t0 = time.perf_counter()
    lo_ms, hi_ms = day_range_ms(start, end)
    files, engine = prepare(defs, events, sources)
    sources_json = json.dumps({k: str(Path(v).resolve()) for k, v in (sources or {}).items()})
    defs_json = json.dumps(defs.to_json())
    units = [
        {"path": str(f.path.resolve()), "rank": f.rank, "name": f.name, "row_group": rg}
        for f in files
        for rg in range(pq.ParquetFile(f.path).num_row_groups)
    ]
    started = False
    if not ray.is_initialized():
        ray.init(
            address=address, num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False
        )
        started = True
    report = RunReport("backfill", str(events), extra={"engine": "ray"})
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        # Task-based sort shuffle: the default hash shuffle starts aggregator actors (seconds each).
        ctx.shuffle_strategy = ray.data.context.ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
        with open_sequences(defs, engine, store):
            mapped = (
                ray.data.from_items(units, override_num_blocks=max(1, min(len(units), 64)))
                .map_batches(
                    transform_units,
                    batch_size=1,
                    batch_format="pyarrow",
                    fn_kwargs={"defs_json": defs_json, "sources_json": sources_json, "lo_ms": lo_ms, "hi_ms": hi_ms},
                )
                .materialize()
            )
            for row in mapped.filter(expr=col("kind") == "stats").select_columns(["file", "stats"]).take_all():
                report.add(row["file"], _stats_from_json(json.loads(row["stats"])))
            total = report.totals()
            first = day_number(start) if start else total.first_day
            last = day_number(end) if end else total.last_day
            days = list(range(first, last + 1)) if first is not None and last is not None else []
            vocab = VocabularyWriter(store, defs)
            for s in defs.sequences:
                if not s.vocabularies:
                    continue
                counters = {field: IdCounter() for field in s.vocabularies}
                found = mapped.filter(expr=(col("kind") == "vocab") & (col("sequence") == s.name))
                for row in found.select_columns(["stats", "payload"]).take_all():
                    t = _from_ipc(row["payload"])
                    counters[row["stats"]].add_counts(*(t.column(c).to_numpy() for c in ("id", "count", "first")))
                update_vocabularies(vocab, Path(store) / s.name, {}, days, counters)
            written = (
                mapped.filter(expr=col("kind") == "events")
                .groupby(["sequence", "day"], num_partitions=max(1, min(len(days) * len(defs.sequences), 16)))
                .map_groups(
                    write_day,
                    batch_format="pyarrow",
                    fn_kwargs={
                        "defs_json": defs_json,
                        "sources_json": sources_json,
                        "store": str(store),
                        "days_json": json.dumps(days),
                    },
                )
                .take_all()
            )
            done: dict[str, dict[int, int]] = {s.name: {} for s in defs.sequences}
            for row in written:
                if row["rows"]:
                    done[row["sequence"]][row["day"]] = row["rows"]
            for s in defs.sequences:
                # Days of the range that no worker wrote have no events: remove them, as the embedded run does.
                empty = [d for d in days if d not in done[s.name]]
                _, removed = install_days(engine, Path(store) / s.name, empty, {})
                report.partitions[s.name] = {day_name(d): n for d, n in sorted(done[s.name].items())}
                report.removed[s.name] = removed
    finally:
        if started:
            ray.shutdown()
    report.seconds = time.perf_counter() - t0
    report.extra["range"] = {"start": day_name(days[0]), "end": day_name(days[-1])} if days else None
    return report
