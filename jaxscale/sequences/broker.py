"""The streaming runtime's log broker: Redis Streams, a producer and a consumer-group consumer.

    python -m jaxscale.sequences produce --events DIR --target redis://HOST:PORT/STREAM [--partitions N]
    python -m jaxscale.sequences stream --defs D --source redis://HOST:PORT/STREAM --group G --out STORE \\
        [--partition i --partitions N] [--consumer NAME] --micro-batch N [--until-idle S] [--metrics-port P]

Streams. With N partitions the events of user u go to stream `STREAM.{p}`, p = splitmix64(user_id) mod N (one
stream `STREAM` when N = 1), so one user's events stay in one stream, in publish order. The producer records
N under the key `STREAM:partitions`; a consumer started with another N fails instead of reading a subset.

Entry format (version 1), one Redis stream entry per up to `MAX_ENTRY_EVENTS` events of one partition:
    format = "jaxscale-events/1"
    n      = number of events (decimal)
    data   = an Arrow IPC stream holding them: the raw schema's columns (user_id, ts, event_type, item_id,
             surface, in the producer's types) and, when the source has them, `event_id` and `ingest_ts`.
Several events per entry keep Redis' per-entry cost (parsing, acknowledging) off the per-event path.

Consumer. One consumer per partition, in a consumer group (created at the start of the stream if absent).
On start it re-reads its own pending entries (delivered to it before, never acknowledged), then claims those
another consumer of the group left pending for longer than `claim_idle_ms` (XAUTOCLAIM), then reads new
entries. A micro-batch is whole entries of up to `micro_batch` events (more if one entry holds more); it is
transformed, committed to the store (`IncrementalWriter`: event-level de-duplication, atomic files) and only
then acknowledged (XACK). A crash at any point re-delivers exactly the unacknowledged entries; their events
already stored are recognised by event id and dropped, so the store holds each event once.

Arrival and ingestion time of a broker event come from its entry id `MS-SEQ` (the broker's receive time):
`arrival = (MS - 2020-01-01) << 22 | SEQ << 12 | index in entry`, and `ingest_ts = MS` where the event has
none. Several consumers may share one store: each commit takes the sequences' writer locks (waiting for them).
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from collections import defaultdict, deque
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from jaxscale.sequences.definitions import RAW_FIELDS, Definitions
from jaxscale.sequences.engine import Engine, load_enrichment_tables
from jaxscale.sequences.eventid import splitmix64
from jaxscale.sequences.events import (
    INGEST_TS,
    OPTIONAL_FIELDS,
    can_hold,
    check_schema,
    find_event_files,
)
from jaxscale.sequences.incremental import DEFAULT_CACHED_IDS, IncrementalWriter
from jaxscale.sequences.runtime import RunReport, add_frames, finish_stream_report
from jaxscale.sequences.store import ensure_sequence_meta, sequence_meta, writer_lock

ENTRY_FORMAT = b"jaxscale-events/1"
MAX_ENTRY_EVENTS = 4096
"""Events per entry at most (12 bits of the arrival id)."""
MAX_ENTRY_SEQ = 1023
"""Entries per millisecond per stream at most (10 bits of the arrival id)."""
ARRIVAL_EPOCH_MS = 1_577_836_800_000
"""2020-01-01T00:00:00Z: broker arrival ids count milliseconds from here (41 bits last until 2089)."""
_URL = re.compile(r"^redis://(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+):(?P<port>[0-9]{1,5})/(?P<stream>[^/?#\s]+)$")
_STREAM_NAME = re.compile(r"^[A-Za-z0-9_.:\-]+$")


class BrokerError(ValueError):
    """The broker cannot be used as asked (a malformed URL, a mismatched partition count, a foreign entry)."""


# -------------------------------------------------------------------------------------------- addresses


@dataclasses.dataclass(frozen=True)
class RedisSource:
    """Where the events are: `redis://HOST:PORT/STREAM`."""

    host: str
    port: int
    stream: str

    @classmethod
    def parse(cls, url: str) -> RedisSource:
        """The source of a URL, or BrokerError naming what is wrong with it."""
        if not isinstance(url, str) or not url.startswith("redis://"):
            raise BrokerError(f"broker URL must start with redis://, got {url!r} (form: redis://HOST:PORT/STREAM)")
        m = _URL.match(url)
        if m is None:
            rest = url[len("redis://") :]
            host_port, _, stream = rest.partition("/")
            if not stream:
                raise BrokerError(f"broker URL {url!r} names no stream (form: redis://HOST:PORT/STREAM)")
            if ":" not in host_port:
                raise BrokerError(f"broker URL {url!r} has no port (form: redis://HOST:PORT/STREAM)")
            raise BrokerError(
                f"broker URL {url!r} is malformed: expected redis://HOST:PORT/STREAM with a host name, a numeric "
                "port and a stream name without '/', '?', '#' or spaces"
            )
        port = int(m["port"])
        if not 1 <= port <= 65535:
            raise BrokerError(f"broker URL {url!r}: port {port} is not in 1..65535")
        stream = m["stream"]
        if not _STREAM_NAME.match(stream):
            raise BrokerError(f"broker URL {url!r}: stream name {stream!r} may hold only letters, digits and _.:-")
        return cls(m["host"].strip("[]"), port, stream)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/{self.stream}"

    def client(self):
        """A connected client (BrokerError naming the address when nothing answers there)."""
        import redis

        client = redis.Redis(host=self.host, port=self.port, socket_keepalive=True)
        try:
            client.ping()
        except redis.ConnectionError as e:
            raise BrokerError(f"cannot reach the broker at {self.host}:{self.port} ({e})") from None
        return client


def stream_key(stream: str, partition: int, partitions: int) -> str:
    """The Redis stream of one partition: STREAM when there is one, STREAM.{partition} otherwise."""
    check_partition(partition, partitions)
    return stream if partitions == 1 else f"{stream}.{partition}"


def check_partition(partition: int, partitions: int) -> None:
    if not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1:
        raise BrokerError(f"--partitions must be a positive integer, got {partitions!r}")
    if not isinstance(partition, int) or isinstance(partition, bool) or not 0 <= partition < partitions:
        raise BrokerError(f"--partition must be in 0..{partitions - 1}, got {partition!r}")


def user_partitions(user_ids: pa.ChunkedArray | pa.Array, partitions: int) -> np.ndarray:
    """Partition of each event: splitmix64(user_id) mod N (a user id that is not an integer: partition 0)."""
    s = pl.Series(pa.chunked_array([user_ids]) if isinstance(user_ids, pa.Array) else user_ids)
    if s.dtype == pl.String:
        s = s.str.strip_chars()
    ids = s.cast(pl.Int64, strict=False).fill_null(0).to_numpy().view(np.uint64)
    return (splitmix64(ids) % np.uint64(partitions)).astype(np.int64)


def _partitions_key(stream: str) -> str:
    return f"{stream}:partitions"


def check_partition_count(client, stream: str, partitions: int, *, record: bool) -> None:
    """Records (producer) or checks (consumer) the stream's partition count under STREAM:partitions."""
    key = _partitions_key(stream)
    if record:
        client.set(key, partitions, nx=True)
    stored = client.get(key)
    if stored is not None and int(stored) != partitions:
        raise BrokerError(
            f"stream {stream!r} is published in {int(stored)} partitions (key {key!r}); this run says "
            f"--partitions {partitions}"
        )


# ------------------------------------------------------------------------------------------ entry format


def encode_entry(table: pa.Table) -> dict[bytes, bytes]:
    """One stream entry holding `table`'s events (see the module doc)."""
    if table.num_rows > MAX_ENTRY_EVENTS:
        raise BrokerError(f"an entry holds at most {MAX_ENTRY_EVENTS} events, got {table.num_rows}")
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return {b"format": ENTRY_FORMAT, b"n": str(table.num_rows).encode(), b"data": sink.getvalue().to_pybytes()}


def decode_entry(entry_id: bytes, fields: dict | None) -> pa.Table | None:
    """The events of one entry; None for an entry deleted from the stream while pending."""
    if not fields:
        return None
    if fields.get(b"format") != ENTRY_FORMAT or b"data" not in fields:
        raise BrokerError(
            f"entry {entry_id.decode()} is not a jaxscale events entry (fields {sorted(k.decode() for k in fields)}; "
            f"expected format={ENTRY_FORMAT.decode()}, n, data)"
        )
    return pa.ipc.open_stream(pa.py_buffer(fields[b"data"])).read_all()


def entry_time(entry_id: bytes) -> tuple[int, int]:
    """(milliseconds, sequence number) of a stream entry id `MS-SEQ`."""
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq)


def arrival_ids(entry_id: bytes, n: int) -> np.ndarray:
    """Arrival ids of the n events of one entry: increasing with the entry id, then the event's index."""
    ms, seq = entry_time(entry_id)
    if seq > MAX_ENTRY_SEQ or n > MAX_ENTRY_EVENTS:
        raise BrokerError(
            f"entry {entry_id.decode()} ({n} events): arrival ids hold at most {MAX_ENTRY_SEQ + 1} entries per "
            f"millisecond per stream and {MAX_ENTRY_EVENTS} events per entry"
        )
    return (((ms - ARRIVAL_EPOCH_MS) << 22) | (seq << 12)) + np.arange(n, dtype=np.int64)


def with_ingest_time(table: pa.Table, entry_ms: int) -> pa.Table:
    """`ingest_ts` = the entry's receive time where the event has none (a missing column or a null)."""
    received = pa.array(np.full(table.num_rows, entry_ms, np.int64))
    if INGEST_TS not in table.column_names:
        return table.append_column(INGEST_TS, received)
    col = table.column(INGEST_TS)
    if not pa.types.is_integer(col.type) or col.null_count == 0:
        return table
    i = table.column_names.index(INGEST_TS)
    return table.set_column(i, INGEST_TS, pc.coalesce(col.cast(pa.int64()), received))


# --------------------------------------------------------------------------------------------- producer


def publish_columns(schema: pa.Schema) -> list[str]:
    """The columns a producer sends: the raw schema's, then the optional ones the source has."""
    return [*RAW_FIELDS, *(c for c in OPTIONAL_FIELDS if c in schema.names)]


class Producer:
    """Publishes raw events to the broker: partitioned by user, `batch` events per entry, pipelined XADDs."""

    def __init__(self, target, *, partitions: int = 1, batch: int = 1024, pipeline: int = 256, client=None):
        self.source = target if isinstance(target, RedisSource) else RedisSource.parse(target)
        check_partition(0, partitions)
        if not isinstance(batch, int) or not 1 <= batch <= MAX_ENTRY_EVENTS:
            raise BrokerError(f"--batch must be in 1..{MAX_ENTRY_EVENTS} events per entry, got {batch!r}")
        self.partitions, self.batch, self.pipeline_entries = partitions, batch, pipeline
        self.client = client or self.source.client()
        check_partition_count(self.client, self.source.stream, partitions, record=True)
        self.keys = [stream_key(self.source.stream, p, partitions) for p in range(partitions)]
        self.events = self.entries = 0

    def publish(self, table: pa.Table) -> int:
        """Publishes `table`'s events in row order (the order they arrived); returns how many."""
        missing = [c for c in RAW_FIELDS if c not in table.column_names]
        if missing:
            raise BrokerError(f"events to publish lack the raw columns {missing} (have {table.column_names})")
        table = table.select(publish_columns(table.schema))
        for col in table.column_names:
            if not can_hold(table.schema.field(col).type, col):
                raise BrokerError(f"column {col!r} of the events to publish has type {table.schema.field(col).type}")
        parts = user_partitions(table.column("user_id"), self.partitions) if self.partitions > 1 else None
        pipe, queued = self.client.pipeline(transaction=False), 0
        for p, key in enumerate(self.keys):
            rows = table if parts is None else table.take(np.flatnonzero(parts == p))
            for start in range(0, rows.num_rows, self.batch):
                pipe.xadd(key, encode_entry(rows.slice(start, self.batch)))
                queued += 1
                self.entries += 1
                if queued == self.pipeline_entries:
                    pipe.execute()
                    queued = 0
        if queued:
            pipe.execute()
        self.events += table.num_rows
        return table.num_rows

    def publish_files(self, events, *, read_rows: int = 65_536) -> dict:
        """Publishes every raw file under `events` in arrival order (sorted path, then row)."""
        t0 = time.perf_counter()
        files = find_event_files(events)
        for f in files:
            pf = check_schema(f)
            for batch in pf.iter_batches(batch_size=read_rows, columns=publish_columns(pf.schema_arrow)):
                self.publish(pa.Table.from_batches([batch]))
        seconds = time.perf_counter() - t0
        return {
            "target": self.source.url,
            "streams": self.keys,
            "files": len(files),
            "events": self.events,
            "entries": self.entries,
            "seconds": round(seconds, 3),
            "events_per_second": round(self.events / seconds, 1) if seconds > 0 else None,
        }


# --------------------------------------------------------------------------------------------- metrics


class StreamMetrics:
    """The consumer's Prometheus metrics, in their own registry (exported with --metrics-port)."""

    def __init__(self, stream: str, group: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = {"stream": stream, "group": group}

        def gauge(name, doc):
            return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name, doc):
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        self.lag = gauge("jaxscale_stream_lag_entries", "Entries of the stream not yet delivered to the group")
        self.pending = gauge("jaxscale_stream_pending_entries", "Entries delivered to the group, not acknowledged")
        self.latency = gauge(
            "jaxscale_stream_latency_seconds", "Last micro-batch: acknowledged minus broker receive time of its oldest"
        )
        self.consumed = counter("jaxscale_stream_events_consumed", "Events read from the stream")
        self.acked = counter("jaxscale_stream_events_acked", "Events acknowledged after their commit")
        self.stored = counter("jaxscale_stream_events_stored", "Events written to the store")
        self.deduplicated = counter(
            "jaxscale_stream_events_deduplicated", "Events dropped: their id was stored already or earlier in the batch"
        )
        self.batches = counter("jaxscale_stream_batches_committed", "Micro-batches committed and acknowledged")
        self.commit_seconds = Histogram(
            "jaxscale_stream_commit_seconds",
            "Seconds to commit one micro-batch to the store",
            list(labels),
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        ).labels(**labels)

        self._values = dict.fromkeys(
            ("lag_entries", "pending_entries", "latency_seconds", "events_consumed", "events_acked",
             "events_stored", "events_deduplicated", "batches_committed"), 0
        )  # fmt: skip

    def observe_lag(self, lag: int, pending: int) -> None:
        self.lag.set(lag)
        self.pending.set(pending)
        self._values.update(lag_entries=lag, pending_entries=pending)

    def observe_consumed(self, events: int) -> None:
        self.consumed.inc(events)
        self._values["events_consumed"] += events

    def observe_batch(self, events: int, stored: int, duplicates: int, commit_seconds: float, latency: float) -> None:
        """One micro-batch committed and acknowledged."""
        self.acked.inc(events)
        self.stored.inc(stored)
        self.deduplicated.inc(duplicates)
        self.batches.inc()
        self.commit_seconds.observe(commit_seconds)
        self.latency.set(latency)
        v = self._values
        v["events_acked"] += events
        v["events_stored"] += stored
        v["events_deduplicated"] += duplicates
        v["batches_committed"] += 1
        v["latency_seconds"] = round(latency, 4)

    def snapshot(self) -> dict:
        """The current values (for the run report)."""
        return dict(self._values)


def serve_metrics(metrics: StreamMetrics, port: int, host: str = "127.0.0.1"):
    """Starts prometheus_client's exporter for this process' consumer metrics; returns (server, thread)."""
    from prometheus_client import start_http_server

    return start_http_server(port, addr=host, registry=metrics.registry)


# --------------------------------------------------------------------------------------------- consumer


@dataclasses.dataclass
class Entry:
    """One stream entry read: its id and events (None for an entry deleted from the stream while pending)."""

    id: bytes
    table: pa.Table | None

    @property
    def events(self) -> int:
        return 0 if self.table is None else self.table.num_rows


class StreamConsumer:
    """One consumer of one partition's stream in a consumer group, writing into a store (module doc)."""

    def __init__(
        self,
        defs: Definitions,
        source,
        group: str,
        store,
        *,
        micro_batch: int,
        consumer: str | None = None,
        partition: int = 0,
        partitions: int = 1,
        sources: dict[str, str] | None = None,
        max_files: int = 8,
        block_ms: int = 200,
        claim_idle_ms: int = 60_000,
        max_cached_ids: int = DEFAULT_CACHED_IDS,
        client=None,
    ):
        if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch < 1:
            raise ValueError(f"--micro-batch must be a positive integer, got {micro_batch!r}")
        if not group:
            raise BrokerError("--group must name the consumer group")
        self.source = source if isinstance(source, RedisSource) else RedisSource.parse(source)
        check_partition(partition, partitions)
        self.defs, self.group, self.store = defs, group, Path(store)
        self.partition, self.partitions = partition, partitions
        self.key = stream_key(self.source.stream, partition, partitions)
        self.consumer = consumer or f"consumer-{partition}"
        self.micro_batch, self.block_ms, self.claim_idle_ms = micro_batch, block_ms, claim_idle_ms
        self.client = client or self.source.client()
        self.engine = Engine(defs, load_enrichment_tables(defs, dict(sources or {})))
        self.writer = IncrementalWriter(
            defs, self.engine, self.store, max_files=max_files, shared=True, max_cached_ids=max_cached_ids
        )
        self.metrics = StreamMetrics(self.key, group)
        self.report = RunReport("stream", f"{self.source.url} partition {partition}/{partitions} group {group}")
        self._buffer: deque[Entry] = deque()
        self._phase, self._cursor, self._claim_cursor = "pending", b"0", b"0-0"
        self._per_entry = 0
        self.batches = 0

    # -- setup

    def _setup(self) -> None:
        import redis

        check_partition_count(self.client, self.source.stream, self.partitions, record=False)
        try:
            self.client.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        for s in self.defs.sequences:
            with writer_lock(self.store / s.name, wait=True):
                ensure_sequence_meta(self.store / s.name, sequence_meta(s, self.engine.columns[s.name]))
        self.writer.start()

    # -- reading

    def _entries(self, reply) -> list[Entry]:
        out = []
        for _stream, items in reply or ():
            for entry_id, fields in items:
                out.append(Entry(entry_id, decode_entry(entry_id, fields)))
        return out

    def _read(self, count: int, block: int | None) -> list[Entry]:
        """The next entries: own pending ones first, then claimed ones, then new ones."""
        if self._phase == "pending":
            got = self._entries(
                self.client.xreadgroup(self.group, self.consumer, {self.key: self._cursor}, count=count)
            )
            if got:
                self._cursor = got[-1].id
                return got
            self._phase = "claim"
        while self._phase == "claim":
            cursor, claimed, *_ = self.client.xautoclaim(
                self.key, self.group, self.consumer, self.claim_idle_ms, start_id=self._claim_cursor, count=count
            )
            self._claim_cursor = cursor
            if cursor in (b"0-0", "0-0"):
                self._phase = "new"
            got = [Entry(i, decode_entry(i, f)) for i, f in claimed if f is not None]
            if got:
                return got
        return self._entries(
            self.client.xreadgroup(self.group, self.consumer, {self.key: ">"}, count=count, block=block)
        )

    def _next_batch(self) -> list[Entry]:
        """Whole entries of up to `micro_batch` events (at least one entry); [] when none arrived in block_ms."""
        batch, have = [], 0
        while True:
            if not self._buffer:
                want = self.micro_batch - have
                count = max(1, min(want // self._per_entry, 10_000)) if self._per_entry else 1
                got = self._read(count, None if batch else self.block_ms)
                if not got:
                    return batch
                self._per_entry = max(self._per_entry, max(e.events for e in got))
                self._buffer.extend(got)
            nxt = self._buffer[0]
            if batch and have + nxt.events > self.micro_batch:
                return batch
            batch.append(self._buffer.popleft())
            have += nxt.events
            if have >= self.micro_batch:
                return batch

    # -- processing

    def _transform(self, entries: list[Entry]) -> dict:
        """{(sequence, day): frames} of the entries' events; consecutive entries of one schema in one go."""
        frames: dict = defaultdict(list)
        run: list[Entry] = []

        def flush():
            if not run:
                return
            tables = [with_ingest_time(e.table, entry_time(e.id)[0]) for e in run]
            table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
            arrivals = np.concatenate([arrival_ids(e.id, e.events) for e in run])
            out, stats = self.engine.transform(table, self.key, arrivals)
            self.report.add(self.key, stats)
            add_frames(frames, out)
            run.clear()

        for e in entries:
            if e.table is None or e.events == 0:
                continue
            if run and e.table.schema != run[0].table.schema:
                flush()
            run.append(e)
        flush()
        return frames

    def _ack(self, ids: list[bytes]) -> None:
        """Acknowledges committed entries (a separate step, so tests can stop a consumer right before it)."""
        self.client.xack(self.key, self.group, *ids)

    def process(self, entries: list[Entry]) -> None:
        """One micro-batch: transform, commit, then acknowledge."""
        events = sum(e.events for e in entries)
        self.metrics.observe_consumed(events)
        frames = self._transform(entries)
        self.batches += 1
        stats = self.writer.commit(frames, self.batches)
        self._ack([e.id for e in entries])
        latency = max(time.time() * 1000 - min(entry_time(e.id)[0] for e in entries), 0) / 1000
        self.metrics.observe_batch(events, stats.events, stats.duplicates, stats.seconds, latency)
        self.update_lag()

    def update_lag(self) -> None:
        """Lag and pending entries of the group (XINFO GROUPS)."""
        for g in self.client.xinfo_groups(self.key):
            name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
            if name == self.group:
                self.metrics.observe_lag(int(g.get("lag") or 0), int(g.get("pending") or 0))

    def run(self, *, until_idle: float | None = None, stop: threading.Event | None = None) -> RunReport:
        """Consumes until `stop` is set (finishing the micro-batch in hand) or, with `until_idle`, until no
        entry arrived for that many seconds; then merges the partitions it wrote. Returns the run report."""
        t0 = time.perf_counter()
        stop = stop or threading.Event()
        self._setup()
        self.update_lag()
        idle_since = time.monotonic()
        while not stop.is_set():
            entries = self._next_batch()
            if entries:
                self.process(entries)
                idle_since = time.monotonic()
            elif until_idle is not None and time.monotonic() - idle_since >= until_idle:
                break
        self.writer.finish()
        self.update_lag()
        finish_stream_report(self.report, self.writer, self.store, t0)
        self.report.extra.update(
            {
                "stream": self.key,
                "group": self.group,
                "consumer": self.consumer,
                "micro_batch": self.micro_batch,
                "micro_batches": self.batches,
                "metrics": self.metrics.snapshot(),
                "pid": os.getpid(),
            }
        )
        return self.report
