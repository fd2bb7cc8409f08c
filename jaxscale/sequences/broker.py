"""The streaming runtime's log broker: Redis Streams, a producer and a consumer-group consumer.

    python -m jaxscale.sequences produce --events DIR --target redis[s]://HOST:PORT/STREAM [--partitions N]
    python -m jaxscale.sequences stream --defs D --source redis[s]://HOST:PORT/STREAM --group G --out STORE \\
        [--partition i --partitions N] [--consumer NAME] --micro-batch N [--until-idle S] [--metrics-port P] \\
        [--claim-idle-ms MS] [--max-deliveries N] [--retain-ms MS] [--retain-entries N]
    (both: [--redis-user NAME] [--redis-password-file FILE] [--redis-ca-file FILE])

Login and TLS. A URL is logged and recorded in reports, so one with credentials (`user:pw@`) is refused
without repeating them; the password comes from `--redis-password-file` (first line) or the environment
variable JAXSCALE_REDIS_PASSWORD, the ACL user from `--redis-user` (`RedisAuth`; never in a repr, a message
or a report). `rediss://` is TLS, the server verified against `--redis-ca-file` (default: the system's CAs).

Retention. Without `retain_ms`/`retain_entries` (`--retain-ms`, `--retain-entries`) nothing is trimmed.
With them, the consumer trims its stream (at most every `trim_every_ms`, and at the end of a run) with an
exact XTRIM MINID at the lowest of: what the retention lets go (entries received more than `retain_ms` ago;
all but the newest `retain_entries`; both given: what either keeps) and `trim_floor`, the lowest id any
group still needs (its oldest pending entry, or the one after its last delivered one): an entry delivered
and not acknowledged, or not yet delivered to some group, is never removed. The dead-letter stream is not
trimmed.

Streams. With N partitions the events of user u go to stream `STREAM.{p}`, p = splitmix64(user_id) mod N (one
stream `STREAM` when N = 1), so one user's events stay in one stream, in publish order. The producer records
N under the key `STREAM:partitions`; a consumer started with another N fails instead of reading a subset.

Entry format (version 1), one Redis stream entry per up to `MAX_ENTRY_EVENTS` events of one partition:
    format = "jaxscale-events/1"
    n      = number of events (decimal)
    data   = an Arrow IPC stream holding them: the raw schema's columns (user_id, ts, event_type, item_id,
             surface, in the producer's types), `event_id` and `ingest_ts` when the source has them, and
             every other column of the source, since an event without an `event_id` is identified by its
             whole row (`jaxscale.sequences.eventid`): the consumer then gives it the id a backfill gives.
Several events per entry keep Redis' per-entry cost (parsing, acknowledging) off the per-event path.

Consumer. One consumer per partition, in a consumer group (created at the start of the stream if absent).
On start it re-reads its own pending entries (delivered to it before, never acknowledged), then reads new
entries; and every `claim_every_ms` (half of `claim_idle_ms`, within 50 ms .. 5 s) it sweeps the group's
pending entries with XAUTOCLAIM, taking those idle for at least `claim_idle_ms` (`--claim-idle-ms`), so the
entries of a consumer that died (or was replaced under another name) are stored while the group runs, not
only when a consumer starts. Like Kafka's max.poll.interval.ms, `claim_idle_ms` should exceed the time a
micro-batch takes: an entry idle that long is taken from whoever holds it (its events are then recognised by
id if both store them), and each claim counts as a delivery. A micro-batch is whole entries of up to
`micro_batch` events (more if one entry holds more); it is transformed, committed to the store
(`IncrementalWriter`: event-level de-duplication, atomic files) and only then acknowledged (XACK). A crash
at any point re-delivers exactly the unacknowledged entries; their events already stored are recognised by
event id and dropped, so the store holds each event once; the duplicates dropped are counted (report
`duplicates`, metric `jaxscale_stream_events_deduplicated_total`, and a log line per micro-batch that
dropped some).

Poison entries (Kafka's dead-letter queue). An entry that cannot be decoded (not `jaxscale-events/1`, not
an Arrow stream, a required column missing or of a type no row could convert, `n` disagreeing with its
rows) is moved at once to the dead-letter stream `<stream>:dead` and acknowledged, in one MULTI/EXEC, so it
never blocks the good entries of its batch. An entry that decodes but fails its transform stays pending
and is retried by the claim sweeps; an entry delivered `max_deliveries` times (`--max-deliveries`, Redis'
delivery count from XPENDING: a re-read or a claim counts, so does a consumer that died holding it) goes to
the dead-letter stream when next read, without being processed. A dead-letter entry holds the original
fields (a field named `dead-*` is kept as `orig-dead-*`) plus `dead-reason`, `dead-entry-id`,
`dead-stream`, `dead-group`, `dead-consumer`, `dead-deliveries` and `dead-at-ms`; each is counted
(`jaxscale_stream_entries_dead_lettered_total`, `..._events_dead_lettered_total`) and logged (a warning
naming the entry and the reason). Replay one with `XADD <stream> * <its original fields>`.

Arrival ids. Each broker event's `arrival` (the store's tie-break after ts) comes from a dense counter of
the store (`ArrivalCounter`, `<store>/_arrivals.json`): each micro-batch reserves as many ids as it holds
events, under the counter's own lock, and the reservation is made durable before the batch's files are
written, so an id is never given twice (a crash leaves a gap, no reuse). Ids follow the order in which
entries are committed (stream order for one consumer; entries claimed from a dead consumer come after what
was committed before them), and there is no limit on entries per millisecond or on the entry id's sequence
part: any valid id `MS-SEQ` (SEQ up to 2**64 - 1) is accepted. (The previous encoding packed
`(MS - 2020) << 22 | SEQ << 12 | index` into 64 bits and refused SEQ > 1023, i.e. more than 1,024 entries
in one millisecond of one stream.) Counter ids start at 2**62: a store written before keeps its events'
arrival ids, all below 2**62 (the old broker encoding until 2054, file logs of under 2**30 files), so
events added later sort after them, as they arrived: no rewrite is needed; a counter file of another
format is refused with an error naming it. `ingest_ts` = MS (the broker's receive time) where the event has
none. Several consumers may share one store: each commit takes the sequences' writer locks (waiting).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
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

from jaxscale.infra import atomic
from jaxscale.sequences.definitions import RAW_FIELDS, Definitions
from jaxscale.sequences.engine import Engine, load_enrichment_tables
from jaxscale.sequences.eventid import needs_row_identity, row_identity, splitmix64
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
"""Events per entry a producer writes at most (a consumer reads entries of any size)."""
ARRIVAL_BASE = 2**62
"""The first arrival id the store's counter gives (above every id written before it, see the module doc)."""
ARRIVALS_FILE = "_arrivals.json"
ARRIVALS_FORMAT = "jaxscale-arrivals/1"
DEAD_SUFFIX = ":dead"
MAX_DELIVERIES = 5
"""Deliveries of an entry before it goes to the dead-letter stream (`--max-deliveries`)."""
_ENTRY_ID = re.compile(rb"^([0-9]{1,20})-([0-9]{1,20})$")
log = logging.getLogger("jaxscale.sequences.broker")
_URL = re.compile(
    r"^(?P<scheme>rediss?)://(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]+):(?P<port>[0-9]{1,5})/(?P<stream>[^/?#\s@]+)$"
)
_STREAM_NAME = re.compile(r"^[A-Za-z0-9_.:\-]+$")
PASSWORD_ENV = "JAXSCALE_REDIS_PASSWORD"
"""The environment variable a broker password is read from when no password file is given."""


class BrokerError(ValueError):
    """The broker cannot be used as asked (a malformed URL, a mismatched partition count, a foreign entry)."""


# -------------------------------------------------------------------------------------------- addresses


@dataclasses.dataclass(frozen=True)
class RedisAuth:
    """How to authenticate to the broker: an ACL user (None: Redis' `default` user) and its password, read
    from a file or the environment, never from the URL (URLs are logged and recorded in run reports); a CA
    file for `rediss://` (None: the system's CAs). The password is never in the repr."""

    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    ca_file: str | None = None

    @classmethod
    def load(
        cls, *, username: str | None = None, password_file: str | None = None, ca_file: str | None = None, env=None
    ) -> RedisAuth:
        """The password from `password_file` (its first line, trailing newline stripped), else from the
        environment variable JAXSCALE_REDIS_PASSWORD, else none; BrokerError naming a file that is missing or
        empty. `ca_file` must exist."""
        env = os.environ if env is None else env
        password = None
        if password_file is not None:
            try:
                text = Path(password_file).read_text()
            except OSError as e:
                raise BrokerError(f"--redis-password-file {password_file}: cannot read it ({e.strerror})") from None
            password = text.splitlines()[0] if text.strip() else ""
            if not password:
                raise BrokerError(f"--redis-password-file {password_file} is empty")
        elif env.get(PASSWORD_ENV):
            password = env[PASSWORD_ENV]
        if ca_file is not None and not Path(ca_file).is_file():
            raise BrokerError(f"--redis-ca-file {ca_file} does not exist")
        return cls(username or None, password, ca_file)


@dataclasses.dataclass(frozen=True)
class RedisSource:
    """Where the events are: `redis://HOST:PORT/STREAM`, or `rediss://...` for TLS; `auth` (never part of the
    URL) says how to log in."""

    host: str
    port: int
    stream: str
    tls: bool = False
    auth: RedisAuth = RedisAuth()

    @classmethod
    def parse(cls, url: str, auth: RedisAuth | None = None) -> RedisSource:
        """The source of a URL, or BrokerError naming what is wrong with it (a password in it included,
        without repeating the password)."""
        form = "redis://HOST:PORT/STREAM or rediss://HOST:PORT/STREAM"
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://")):
            shown = url.split("@")[-1] if isinstance(url, str) else url
            raise BrokerError(f"broker URL must start with redis:// or rediss://, got {shown!r} (form: {form})")
        scheme, _, rest = url.partition("://")
        if "@" in rest.partition("/")[0]:
            raise BrokerError(
                f"broker URL {scheme}://...@{rest.rpartition('@')[2]} carries credentials: a URL is logged and "
                f"recorded in reports, so it may not hold a user or password; pass --redis-user, and the password "
                f"in --redis-password-file FILE or the environment variable {PASSWORD_ENV}"
            )
        m = _URL.match(url)
        if m is None:
            host_port, _, stream = rest.partition("/")
            if not stream:
                raise BrokerError(f"broker URL {url!r} names no stream (form: {form})")
            if ":" not in host_port:
                raise BrokerError(f"broker URL {url!r} has no port (form: {form})")
            raise BrokerError(
                f"broker URL {url!r} is malformed: expected {scheme}://HOST:PORT/STREAM with a host name, a numeric "
                "port and a stream name without '/', '?', '#' or spaces"
            )
        port = int(m["port"])
        if not 1 <= port <= 65535:
            raise BrokerError(f"broker URL {url!r}: port {port} is not in 1..65535")
        stream = m["stream"]
        if not _STREAM_NAME.match(stream):
            raise BrokerError(f"broker URL {url!r}: stream name {stream!r} may hold only letters, digits and _.:-")
        tls = m["scheme"] == "rediss"
        auth = auth or RedisAuth()
        if auth.ca_file is not None and not tls:
            raise BrokerError(f"--redis-ca-file is for rediss:// (TLS) URLs; {url!r} is plain redis://")
        return cls(m["host"].strip("[]"), port, stream, tls, auth)

    @property
    def url(self) -> str:
        """The URL (never any credential)."""
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/{self.stream}"

    def client(self):
        """A connected client (BrokerError naming the address when nothing answers there, or when the login
        or the TLS handshake fails; the password is never in a message)."""
        import redis

        kw = {}
        if self.tls:
            kw = {"ssl": True, "ssl_cert_reqs": "required", "ssl_ca_certs": self.auth.ca_file}
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        options = {
            "host": self.host,
            "port": self.port,
            "username": self.auth.username,
            "password": self.auth.password,
            "socket_keepalive": True,
            **kw,
        }
        who = f"as user {self.auth.username!r}" if self.auth.username else "as the default user"
        # The first ping without retries: a refused login or a failed handshake is not retried with backoff
        # (seconds) by the client's default retry policy, which stays for the connections that follow.
        probe = redis.Redis(**options, retry=Retry(NoBackoff(), 0))
        try:
            probe.ping()
        except redis.AuthenticationError as e:
            how = "with a password" if self.auth.password else "without a password"
            raise BrokerError(
                f"the broker at {self.host}:{self.port} refused the login {who} {how} ({e}); give the password in "
                f"--redis-password-file or {PASSWORD_ENV}"
            ) from None
        except redis.ResponseError as e:
            if "NOPERM" in str(e) or "NOAUTH" in str(e):
                raise BrokerError(f"the broker at {self.host}:{self.port} refused {who}: {e}") from None
            raise
        except redis.ConnectionError as e:
            tls = " over TLS (rediss://)" if self.tls else ""
            raise BrokerError(f"cannot reach the broker at {self.host}:{self.port}{tls} ({e})") from None
        finally:
            probe.close()
        client = redis.Redis(**options)
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


class PoisonEntry(BrokerError):
    """A stream entry that cannot be decoded into events (it goes to the dead-letter stream at once)."""


def decode_entry(entry_id: bytes, fields: dict | None) -> pa.Table | None:
    """The events of one entry; None for an entry deleted from the stream while pending; PoisonEntry naming
    the problem for anything that is not a readable jaxscale events entry (a foreign entry, a corrupt Arrow
    stream, a required column missing or of a type no row could convert, `n` disagreeing with the rows)."""
    if not fields:
        return None
    name = entry_id.decode(errors="replace")
    if fields.get(b"format") != ENTRY_FORMAT or b"data" not in fields:
        keys = sorted(k.decode(errors="replace") for k in fields)
        raise PoisonEntry(
            f"entry {name} is not a jaxscale events entry (fields {keys}; expected format={ENTRY_FORMAT.decode()}, "
            "n, data)"
        )
    try:
        table = pa.ipc.open_stream(pa.py_buffer(fields[b"data"])).read_all()
    except (pa.ArrowException, OSError, ValueError) as e:
        raise PoisonEntry(f"entry {name}: its data is not a readable Arrow IPC stream ({e})") from None
    missing = [c for c in RAW_FIELDS if c not in table.column_names]
    if missing:
        raise PoisonEntry(f"entry {name}: its events lack the raw columns {missing} (have {table.column_names})")
    for col in (*RAW_FIELDS, *OPTIONAL_FIELDS):
        if col in table.column_names and not can_hold(table.schema.field(col).type, col):
            raise PoisonEntry(f"entry {name}: column {col!r} has type {table.schema.field(col).type}")
    n = fields.get(b"n")
    if n is not None and n != str(table.num_rows).encode():
        raise PoisonEntry(f"entry {name}: n={n.decode(errors='replace')!r} but its data holds {table.num_rows} events")
    return table


def entry_time(entry_id: bytes) -> tuple[int, int]:
    """(milliseconds, sequence number) of a stream entry id `MS-SEQ` (each up to 2**64 - 1)."""
    m = _ENTRY_ID.match(entry_id)
    if m is None:
        raise BrokerError(f"{entry_id!r} is not a stream entry id MS-SEQ")
    return int(m[1]), int(m[2])


def entry_ms(entry_id: bytes) -> int:
    """The receive time of an entry in epoch ms, as int64 (an explicit id beyond 2**63 - 1 ms is clamped)."""
    return min(entry_time(entry_id)[0], 2**63 - 1)


def arrival_ids(start: int, counts) -> list[np.ndarray]:
    """Arrival ids of consecutive entries holding `counts` events, from `start` (a reservation of
    `ArrivalCounter`): entry after entry, event after event. Any entry id is fine: they do not enter."""
    out, at = [], int(start)
    for n in counts:
        out.append(np.arange(at, at + int(n), dtype=np.int64))
        at += int(n)
    return out


class ArrivalCounter:
    """The store's dense arrival counter for broker events (module doc): `reserve(n)` returns the first of
    n ids no one was given, durable before it returns; consumers of any stream share it."""

    def __init__(self, store):
        self.path = Path(store) / ARRIVALS_FILE
        self.lock_path = Path(store) / ".arrivals.lock"

    def reserve(self, n: int) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            start = self.peek()
            if n:
                atomic.write_json(self.path, {"format": ARRIVALS_FORMAT, "next": start + int(n)})
            return start
        finally:
            os.close(fd)

    def peek(self) -> int:
        """The next id the counter will give."""
        try:
            state = json.loads(self.path.read_text())
        except FileNotFoundError:
            return ARRIVAL_BASE
        except json.JSONDecodeError as e:
            raise BrokerError(f"{self.path} is corrupt ({e}); it holds the store's next broker arrival id") from None
        ok = isinstance(state, dict) and state.get("format") == ARRIVALS_FORMAT and isinstance(state.get("next"), int)
        if not ok:
            raise BrokerError(
                f"{self.path} holds {state!r}, not a {ARRIVALS_FORMAT} counter: the store was written by another "
                "version of jaxscale; consume into a new store"
            )
        return state["next"]


def with_ingest_time(table: pa.Table, received) -> pa.Table:
    """`ingest_ts` = the entry's receive time (`received`: epoch ms, one for all rows or one per row) where
    the event has none (a missing column or a null)."""
    received = pa.array(np.broadcast_to(np.asarray(received, np.int64), (table.num_rows,)))
    if INGEST_TS not in table.column_names:
        return table.append_column(INGEST_TS, received)
    col = table.column(INGEST_TS)
    if not pa.types.is_integer(col.type) or col.null_count == 0:
        return table
    i = table.column_names.index(INGEST_TS)
    return table.set_column(i, INGEST_TS, pc.coalesce(col.cast(pa.int64()), received))


# --------------------------------------------------------------------------------------------- producer


def publish_columns(schema: pa.Schema) -> list[str]:
    """The schema's columns the platform reads: the raw schema's, then the optional ones the source has."""
    return [*RAW_FIELDS, *(c for c in OPTIONAL_FIELDS if c in schema.names)]


def entry_columns(schema: pa.Schema) -> list[str]:
    """The columns a producer sends: `publish_columns`, then every other column of the source (an event
    without an `event_id` is identified by its whole row)."""
    known = publish_columns(schema)
    return [*known, *(c for c in schema.names if c not in known)]


class Producer:
    """Publishes raw events to the broker: partitioned by user, `batch` events per entry, pipelined XADDs;
    every column of the source travels (`entry_columns`)."""

    def __init__(
        self,
        target,
        *,
        partitions: int = 1,
        batch: int = 1024,
        pipeline: int = 256,
        client=None,
        auth: RedisAuth | None = None,
    ):
        self.source = target if isinstance(target, RedisSource) else RedisSource.parse(target, auth)
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
        table = table.select(entry_columns(table.schema))
        for col in publish_columns(table.schema):
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
            for batch in pf.iter_batches(batch_size=read_rows, columns=entry_columns(pf.schema_arrow)):
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
        self.dead_entries = counter(
            "jaxscale_stream_entries_dead_lettered", "Entries moved to the dead-letter stream <stream>:dead"
        )
        self.dead_events = counter(
            "jaxscale_stream_events_dead_lettered", "Events of the entries moved to the dead-letter stream"
        )
        self.failed = counter(
            "jaxscale_stream_entries_failed", "Entry deliveries whose transform failed (left pending, retried)"
        )
        self.claimed = counter(
            "jaxscale_stream_entries_claimed", "Entries claimed (XAUTOCLAIM) from the group's idle pending ones"
        )
        self.broker_down = counter(
            "jaxscale_stream_broker_outages", "Times the broker stopped answering mid-run (waited out, then re-read)"
        )
        self.trimmed = counter(
            "jaxscale_stream_entries_trimmed", "Entries removed from the stream by the retention (XTRIM MINID)"
        )
        self.commit_seconds = Histogram(
            "jaxscale_stream_commit_seconds",
            "Seconds to commit one micro-batch to the store",
            list(labels),
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        ).labels(**labels)

        self._values = dict.fromkeys(
            ("lag_entries", "pending_entries", "latency_seconds", "events_consumed", "events_acked",
             "events_stored", "events_deduplicated", "batches_committed", "entries_dead_lettered",
             "events_dead_lettered", "entries_failed", "entries_claimed", "entries_trimmed", "broker_outages"), 0
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

    def observe_dead(self, events: int) -> None:
        """One entry (holding `events` decodable events, 0 if none) moved to the dead-letter stream."""
        self.dead_entries.inc()
        self.dead_events.inc(events)
        self._values["entries_dead_lettered"] += 1
        self._values["events_dead_lettered"] += events

    def observe_failed(self) -> None:
        self.failed.inc()
        self._values["entries_failed"] += 1

    def observe_claimed(self, entries: int) -> None:
        self.claimed.inc(entries)
        self._values["entries_claimed"] += entries

    def observe_broker_down(self) -> None:
        self.broker_down.inc()
        self._values["broker_outages"] += 1

    def observe_trimmed(self, entries: int) -> None:
        self.trimmed.inc(entries)
        self._values["entries_trimmed"] += entries

    def snapshot(self) -> dict:
        """The current values (for the run report)."""
        return dict(self._values)


def serve_metrics(metrics: StreamMetrics, port: int, host: str = "127.0.0.1"):
    """Starts prometheus_client's exporter for this process' consumer metrics; returns (server, thread)."""
    from prometheus_client import start_http_server

    return start_http_server(port, addr=host, registry=metrics.registry)


# --------------------------------------------------------------------------------------------- consumer


def broker_down_errors() -> tuple[type[BaseException], ...]:
    """The Redis client's errors of a broker that does not answer (refused, reset, timed out): what a run waits
    out (`StreamConsumer._wait_for_broker`) instead of dying."""
    import redis

    return (redis.ConnectionError, redis.TimeoutError)


DATA_ERRORS = (BrokerError, ValueError, TypeError, KeyError, IndexError, pa.ArrowException, pl.exceptions.PolarsError)
"""What a transform raises for an entry's data (the entry fails, is retried, then dead-lettered); anything
else (the store's disk, a lost connection) stops the consumer, whose entries stay pending."""


@dataclasses.dataclass
class Entry:
    """One stream entry read: its id, fields and events (None for an entry deleted from the stream while
    pending) and the group's delivery count of it (this delivery included)."""

    id: bytes
    table: pa.Table | None
    fields: dict | None = None
    deliveries: int = 1

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
        claim_every_ms: int | None = None,
        max_deliveries: int = MAX_DELIVERIES,
        max_cached_ids: int = DEFAULT_CACHED_IDS,
        retain_ms: int | None = None,
        retain_entries: int | None = None,
        trim_every_ms: int = 1_000,
        client=None,
        auth: RedisAuth | None = None,
        broker_timeout_s: float = 300.0,
    ):
        if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch < 1:
            raise ValueError(f"--micro-batch must be a positive integer, got {micro_batch!r}")
        if not isinstance(claim_idle_ms, int) or isinstance(claim_idle_ms, bool) or claim_idle_ms < 0:
            raise ValueError(f"--claim-idle-ms must be a non-negative integer, got {claim_idle_ms!r}")
        if not isinstance(max_deliveries, int) or isinstance(max_deliveries, bool) or max_deliveries < 1:
            raise ValueError(f"--max-deliveries must be a positive integer, got {max_deliveries!r}")
        if claim_every_ms is None:
            claim_every_ms = min(max(claim_idle_ms // 2, 50), 5_000)
        if not isinstance(claim_every_ms, int) or isinstance(claim_every_ms, bool) or claim_every_ms < 1:
            raise ValueError(f"claim_every_ms must be a positive integer, got {claim_every_ms!r}")
        for name, value in (("--retain-ms", retain_ms), ("--retain-entries", retain_entries)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(trim_every_ms, int) or isinstance(trim_every_ms, bool) or trim_every_ms < 0:
            raise ValueError(f"trim_every_ms must be a non-negative integer, got {trim_every_ms!r}")
        if not isinstance(broker_timeout_s, (int, float)) or isinstance(broker_timeout_s, bool) or broker_timeout_s < 0:
            raise ValueError(f"--broker-timeout must be a number of seconds >= 0, got {broker_timeout_s!r}")
        self.broker_timeout_s = float(broker_timeout_s)
        if not group:
            raise BrokerError("--group must name the consumer group")
        self.source = source if isinstance(source, RedisSource) else RedisSource.parse(source, auth)
        check_partition(partition, partitions)
        self.defs, self.group, self.store = defs, group, Path(store)
        self.partition, self.partitions = partition, partitions
        self.key = stream_key(self.source.stream, partition, partitions)
        self.dead_key = self.key + DEAD_SUFFIX
        self.consumer = consumer or f"consumer-{partition}"
        self.micro_batch, self.block_ms = micro_batch, block_ms
        self.claim_idle_ms, self.claim_every_ms, self.max_deliveries = claim_idle_ms, claim_every_ms, max_deliveries
        self.retain_ms, self.retain_entries, self.trim_every_ms = retain_ms, retain_entries, trim_every_ms
        self._next_trim = 0.0
        self.client = client or self.source.client()
        self.engine = Engine(defs, load_enrichment_tables(defs, dict(sources or {})))
        self.writer = IncrementalWriter(
            defs, self.engine, self.store, max_files=max_files, shared=True, max_cached_ids=max_cached_ids
        )
        self.arrivals = ArrivalCounter(self.store)
        self.metrics = StreamMetrics(self.key, group)
        self.report = RunReport("stream", f"{self.source.url} partition {partition}/{partitions} group {group}")
        self._buffer: deque[Entry] = deque()
        self._phase, self._cursor, self._claim_cursor = "pending", b"0", b"0-0"
        self._next_claim = 0.0  # monotonic time of the next claim sweep: the first right after the own pending
        self._held: set[bytes] = set()  # entries read and not yet acknowledged or left pending (never re-claimed)
        self._errors: dict[bytes, str] = {}  # the last transform error of entries left pending
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
        self.arrivals.peek()  # a counter of another format fails the start, not the first batch
        self.writer.start()

    # -- reading

    def _deliveries(self, ids: list[bytes]) -> dict[bytes, int]:
        """The group's delivery count of each pending entry of `ids` (XPENDING); absent when not pending."""
        pipe = self.client.pipeline(transaction=False)
        for i in ids:
            pipe.xpending_range(self.key, self.group, min=i, max=i, count=1)
        out = {}
        for rows in pipe.execute():
            for r in rows:
                out[r["message_id"]] = int(r["times_delivered"])
        return out

    def _admit(self, items: list, *, redelivered: bool) -> list[Entry]:
        """The entries of a read to process: a poison entry, or one delivered more than `max_deliveries`
        times, is dead-lettered instead (module doc). `redelivered`: own pending or claimed entries, whose
        delivery counts are looked up (a new entry's is 1)."""
        counts = self._deliveries([i for i, _ in items]) if redelivered and items else {}
        out = []
        for entry_id, fields in items:
            deliveries = counts.get(entry_id, 1)
            if deliveries > self.max_deliveries and fields:
                last = self._errors.pop(entry_id, None)
                reason = (
                    f"delivered {deliveries} times without being committed (--max-deliveries {self.max_deliveries})"
                    + (f"; last error: {last}" if last else "")
                )
                self._dead_letter(entry_id, fields, reason, deliveries, self._countable_events(entry_id, fields))
                continue
            try:
                table = decode_entry(entry_id, fields)
            except PoisonEntry as e:
                self._dead_letter(entry_id, fields, str(e), deliveries, 0)
                continue
            out.append(Entry(entry_id, table, fields, deliveries))
            self._held.add(entry_id)
        return out

    @staticmethod
    def _countable_events(entry_id: bytes, fields) -> int:
        try:
            table = decode_entry(entry_id, fields)
        except PoisonEntry:
            return 0
        return 0 if table is None else table.num_rows

    def _read(self, count: int, block: int | None) -> tuple[list[Entry], bool]:
        """(the next entries, whether anything was read): own pending ones first (at start), then new ones;
        every `claim_every_ms` a claim sweep of the group's idle pending entries comes first."""
        if self._phase == "pending":
            items = [it for _stream, got in self.client.xreadgroup(
                self.group, self.consumer, {self.key: self._cursor}, count=count) or () for it in got]  # fmt: skip
            if items:
                self._cursor = items[-1][0]
                return self._admit(items, redelivered=True), True
            self._phase = "new"
        if time.monotonic() >= self._next_claim:
            claimed = self._claim(count)
            if claimed:
                return self._admit(claimed, redelivered=True), True
        items = [it for _stream, got in self.client.xreadgroup(
            self.group, self.consumer, {self.key: ">"}, count=count, block=block) or () for it in got]  # fmt: skip
        return self._admit(items, redelivered=False), bool(items)

    def _claim(self, count: int) -> list:
        """Entries of the group pending for at least `claim_idle_ms`, claimed by this consumer (XAUTOCLAIM),
        continuing the current sweep; when a sweep reaches the end of the pending list the next starts
        `claim_every_ms` later. Entries this consumer holds right now are left alone."""
        while True:
            cursor, claimed, *_ = self.client.xautoclaim(
                self.key, self.group, self.consumer, self.claim_idle_ms, start_id=self._claim_cursor, count=count
            )
            done = cursor in (b"0-0", "0-0")
            self._claim_cursor = b"0-0" if done else cursor
            if done:
                self._next_claim = time.monotonic() + self.claim_every_ms / 1000
            got = [(i, f) for i, f in claimed if f is not None and i not in self._held]
            if got:
                self.metrics.observe_claimed(len(got))
                log.info("%s: claimed %d idle pending entries (from %s)", self.key, len(got), got[0][0].decode())
                return got
            if done:
                return []

    def _next_batch(self) -> list[Entry]:
        """Whole entries of up to `micro_batch` events (at least one entry); [] when none arrived in block_ms."""
        batch, have = [], 0
        while True:
            if not self._buffer:
                want = self.micro_batch - have
                count = max(1, min(want // self._per_entry, 10_000)) if self._per_entry else 1
                got, read = self._read(count, None if batch else self.block_ms)
                if not read:
                    return batch
                if not got:  # everything read was dead-lettered: read on
                    continue
                self._per_entry = max(self._per_entry, max(e.events for e in got))
                self._buffer.extend(got)
            nxt = self._buffer[0]
            if batch and have + nxt.events > self.micro_batch:
                return batch
            batch.append(self._buffer.popleft())
            have += nxt.events
            if have >= self.micro_batch:
                return batch

    # -- poison entries

    def _dead_letter(self, entry_id: bytes, fields, reason: str, deliveries: int, events: int) -> None:
        """Moves one entry to the dead-letter stream and acknowledges it, atomically (MULTI/EXEC)."""
        original = {(b"orig-" + k if k.startswith(b"dead-") else k): v for k, v in (fields or {}).items()}
        meta = {
            b"dead-reason": reason.encode(),
            b"dead-entry-id": entry_id,
            b"dead-stream": self.key.encode(),
            b"dead-group": self.group.encode(),
            b"dead-consumer": self.consumer.encode(),
            b"dead-deliveries": str(deliveries).encode(),
            b"dead-at-ms": str(int(time.time() * 1000)).encode(),
        }
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.dead_key, {**original, **meta})
        pipe.xack(self.key, self.group, entry_id)
        pipe.execute()
        self._held.discard(entry_id)
        self._errors.pop(entry_id, None)
        self.metrics.observe_dead(events)
        log.warning(
            "%s: entry %s (%d events, delivery %d) moved to %s: %s",
            self.key, entry_id.decode(), events, deliveries, self.dead_key, reason,
        )  # fmt: skip

    def _failed(self, entry: Entry, reason: str) -> None:
        """An entry whose transform failed: dead-lettered on its last allowed delivery, else left pending
        (the claim sweeps deliver it again once it has been idle `claim_idle_ms`)."""
        self.metrics.observe_failed()
        self._held.discard(entry.id)
        if entry.deliveries >= self.max_deliveries:
            self._dead_letter(
                entry.id,
                entry.fields,
                f"{reason} (delivery {entry.deliveries} of at most {self.max_deliveries})",
                entry.deliveries,
                entry.events,
            )
            return
        self._errors[entry.id] = reason
        log.warning(
            "%s: entry %s failed on delivery %d of at most %d, left pending for a retry: %s",
            self.key, entry.id.decode(), entry.deliveries, self.max_deliveries, reason,
        )  # fmt: skip

    # -- processing

    def _transform(self, entries: list[Entry]) -> tuple[dict, dict[bytes, str]]:
        """({(sequence, day): frames} of the entries' events, {entry id: error} of the entries whose
        transform failed). Consecutive entries of one schema go in one transform; when that fails, each of
        them alone, so one bad entry fails alone. Arrival ids are reserved for all the entries first."""
        frames: dict = defaultdict(list)
        failed: dict[bytes, str] = {}
        with_events = [e for e in entries if e.table is not None and e.events]
        start = self.arrivals.reserve(sum(e.events for e in with_events))
        arrivals = dict(zip([e.id for e in with_events], arrival_ids(start, [e.events for e in with_events])))
        run: list[Entry] = []

        def transform(group: list[Entry]) -> None:
            raw = pa.concat_tables([e.table for e in group]) if len(group) > 1 else group[0].table
            # The whole-row identity of the events as sent, before the receive time is added to them.
            ids = row_identity(raw) if needs_row_identity(raw) else None
            received = np.repeat([entry_ms(e.id) for e in group], [e.events for e in group])
            table = with_ingest_time(raw, received)
            arrival = np.concatenate([arrivals[e.id] for e in group])
            out, stats = self.engine.transform(table, self.key, arrival, row_ids=ids)
            self.report.add(self.key, stats)
            add_frames(frames, out)

        def flush():
            if not run:
                return
            try:
                transform(run)
            except DATA_ERRORS as whole:
                for e in run if len(run) > 1 else ():
                    try:
                        transform([e])
                    except DATA_ERRORS as alone:
                        failed[e.id] = f"{type(alone).__name__}: {alone}"
                if len(run) == 1:
                    failed[run[0].id] = f"{type(whole).__name__}: {whole}"
            run.clear()

        for e in with_events:
            if run and e.table.schema != run[0].table.schema:
                flush()
            run.append(e)
        flush()
        return frames, failed

    def _ack(self, ids: list[bytes]) -> None:
        """Acknowledges committed entries (a separate step, so tests can stop a consumer right before it)."""
        if ids:
            self.client.xack(self.key, self.group, *ids)

    def process(self, entries: list[Entry]) -> None:
        """One micro-batch: transform, commit, then acknowledge (an entry whose transform failed: `_failed`)."""
        events = sum(e.events for e in entries)
        self.metrics.observe_consumed(events)
        frames, failed = self._transform(entries)
        self.batches += 1
        stats = self.writer.commit(frames, self.batches)
        done = [e for e in entries if e.id not in failed]
        self._ack([e.id for e in done])
        for e in done:
            self._held.discard(e.id)
            self._errors.pop(e.id, None)
        for e in entries:
            if e.id in failed:
                self._failed(e, failed[e.id])
        if done:
            latency = max(time.time() * 1000 - min(entry_ms(e.id) for e in done), 0) / 1000
            acked = sum(e.events for e in done)
            self.metrics.observe_batch(acked, stats.events, stats.duplicates, stats.seconds, latency)
        if stats.duplicates:
            log.info(
                "%s: micro-batch %d stored %d events, dropped %d duplicates (event ids stored or seen before)",
                self.key, self.batches, stats.events, stats.duplicates,
            )  # fmt: skip
        self.update_lag()

    # -- retention

    def trim_floor(self) -> bytes | None:
        """The lowest entry id any group of the stream may still need (XINFO GROUPS, XPENDING): each group's
        oldest pending entry (delivered, not acknowledged), or, with none pending, the id right after its
        last delivered one; the lowest over the groups. None when the stream has no group."""
        floor = None
        for g in self.client.xinfo_groups(self.key):
            name = g["name"]
            if int(g.get("pending") or 0):
                oldest = self.client.xpending(self.key, name)["min"]
                need = entry_time(oldest if isinstance(oldest, bytes) else oldest.encode())
            else:
                last = g["last-delivered-id"]
                ms, seq = entry_time(last if isinstance(last, bytes) else last.encode())
                need = (ms, seq + 1) if seq < 2**64 - 1 else (ms + 1, 0)
            floor = need if floor is None else min(floor, need)
        return None if floor is None else f"{floor[0]}-{floor[1]}".encode()

    def retention_floor(self) -> bytes | None:
        """The lowest entry id the retention keeps: entries received within `retain_ms` of now and the newest
        `retain_entries` are kept (both given: what either keeps); None when nothing is to be trimmed."""
        keep = []
        if self.retain_ms is not None:
            keep.append((max(int(time.time() * 1000) - self.retain_ms, 0), 0))
        if self.retain_entries is not None:
            if self.retain_entries == 0:
                keep.append((2**64 - 1, 2**64 - 1))
            else:
                newest = self.client.xrevrange(self.key, count=self.retain_entries)
                if len(newest) < self.retain_entries:
                    return None
                keep.append(entry_time(newest[-1][0]))
        if not keep:
            return None
        ms, seq = min(keep)
        return f"{ms}-{seq}".encode()

    def trim(self) -> int:
        """Trims the stream by the retention (XTRIM MINID, exact), never above `trim_floor`: an entry is
        removed only once every group has had it delivered and acknowledged and the retention lets it go.
        Safe without a transaction: the floor only rises (a group's last delivered id grows, its pending
        entries are acknowledged or re-claimed, never re-added below). Returns the entries removed."""
        retain = self.retention_floor()
        if retain is None:
            return 0
        floor = self.trim_floor()
        if floor is None:
            return 0
        minid = min(entry_time(retain), entry_time(floor))
        removed = int(self.client.xtrim(self.key, minid=f"{minid[0]}-{minid[1]}", approximate=False))
        if removed:
            self.metrics.observe_trimmed(removed)
            log.info("%s: trimmed %d entries below %d-%d (retention and the groups' progress)", self.key, removed,
                     *minid)  # fmt: skip
        return removed

    def _maybe_trim(self) -> None:
        if self.retain_ms is None and self.retain_entries is None:
            return
        if time.monotonic() >= self._next_trim:
            self._next_trim = time.monotonic() + self.trim_every_ms / 1000
            self.trim()

    def _wait_for_broker(self, error: Exception, stop: threading.Event) -> None:
        """The broker stopped answering mid-run (restarted, failed over, the network): wait for it with backoff,
        as a Kafka consumer does, then read again as a restarted consumer would: own pending entries from the
        start (what was read and not acknowledged, including a batch committed before its ack failed: stored
        once, by event id), then new ones. After `broker_timeout_s` without an answer, a `BrokerError` naming
        the broker ends the run (0: wait forever)."""
        import redis

        down_since, delay = time.monotonic(), 0.1
        self.metrics.observe_broker_down()
        log.warning("%s: the broker at %s:%s stopped answering (%s); waiting for it", self.key, self.source.host,
                    self.source.port, error)  # fmt: skip
        while not stop.is_set():
            waited = time.monotonic() - down_since
            if self.broker_timeout_s and waited >= self.broker_timeout_s:
                raise BrokerError(
                    f"the broker at {self.source.host}:{self.source.port} has not answered for {waited:.0f} s "
                    f"(--broker-timeout {self.broker_timeout_s:g}): {error}"
                ) from None
            stop.wait(delay)
            delay = min(delay * 2, 5.0)
            try:
                self.client.ping()
                self.client.xgroup_create(self.key, self.group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
            except broker_down_errors() as e:
                error = e
                continue
            break
        self._buffer.clear()
        self._held.clear()
        self._phase, self._cursor, self._claim_cursor, self._next_claim = "pending", b"0", b"0-0", 0.0
        log.warning("%s: the broker answers again after %.1f s; re-reading this consumer's pending entries",
                    self.key, time.monotonic() - down_since)  # fmt: skip

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
        broker_down = broker_down_errors()
        while not stop.is_set():
            try:
                entries = self._next_batch()
                if entries:
                    self.process(entries)
                    idle_since = time.monotonic()
                self._maybe_trim()
            except broker_down as e:
                self._wait_for_broker(e, stop)
                idle_since = time.monotonic()
                continue
            if not entries and until_idle is not None and time.monotonic() - idle_since >= until_idle:
                break
        self.writer.finish()
        if self.retain_ms is not None or self.retain_entries is not None:
            self.trim()
        self.update_lag()
        finish_stream_report(self.report, self.writer, self.store, t0)
        self.report.extra.update(
            {
                "stream": self.key,
                "group": self.group,
                "consumer": self.consumer,
                "micro_batch": self.micro_batch,
                "micro_batches": self.batches,
                "dead_letter_stream": self.dead_key,
                "dead_lettered": self.metrics.snapshot()["entries_dead_lettered"],
                "max_deliveries": self.max_deliveries,
                "claim_idle_ms": self.claim_idle_ms,
                "retain_ms": self.retain_ms,
                "retain_entries": self.retain_entries,
                "trimmed": self.metrics.snapshot()["entries_trimmed"],
                "metrics": self.metrics.snapshot(),
                "pid": os.getpid(),
            }
        )
        return self.report
