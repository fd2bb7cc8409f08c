"""Raw event logs: the schema, file discovery in arrival order, and per-row validation.

Raw events are Parquet files with columns `user_id` int64, `ts` int64 (epoch ms), `event_type` string,
`item_id` int64, `surface` string; extra columns are ignored. Optional columns (`OPTIONAL_FIELDS`) are used
when a file has them: `ingest_ts` int64 is the epoch ms at which the platform received the event (its
ingestion time, what `as_of_mode="ingest"` reads). A log that never recorded arrival has no `ingest_ts`:
every event then counts as received when it happened (ingest_ts = ts), and so does a null in the column.
`event_id` (an integer or a string) identifies an event that a log or a broker may deliver twice; without
it (or where it is null) an event is identified by the hash of its whole row, every column of the file
(`jaxscale.sequences.eventid`): the readers therefore read every column of a file unless its row groups'
statistics prove that each row has an `event_id`.

Files are found recursively (any layout, `dt=` partitions included) and read in sorted path order: that
order, then row order, is arrival order. Each event's `arrival` = file rank * 2**32 + row index, a total
order that breaks ties in `ts`.

A file missing a required column, or holding it in a type that no row could convert (a list, a bool),
fails the run before anything is written. Row-level problems (a null, an unparsable string, a float that is
not an integer, an out-of-range value) make that row bad: it is counted per file and reason, never
silently dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from jaxscale.sequences.definitions import RAW_FIELDS
from jaxscale.sequences.eventid import HASHED_STRINGS, event_ids, needs_row_identity, row_identity

ARRIVAL_ROW_BITS = 32
INGEST_TS = "ingest_ts"
EVENT_ID = "event_id"
OPTIONAL_FIELDS: dict[str, str] = {INGEST_TS: "int64", EVENT_ID: "int64 or string"}
"""Raw columns read when present: column -> type (see the module doc)."""
MAX_FILES = 2**31 - 1


class EventsError(ValueError):
    """The raw events cannot be read as asked; the message names the file and column."""


@dataclasses.dataclass(frozen=True)
class EventFile:
    path: Path
    rank: int
    """Position in sorted path order (arrival order of files)."""
    name: str
    """Path relative to the events root (for reports)."""


def find_event_files(events) -> list[EventFile]:
    """The Parquet files of `events` (a file or a directory, searched recursively) in arrival order."""
    root = Path(events)
    if root.is_file():
        return [EventFile(root, 0, root.name)]
    if not root.is_dir():
        raise EventsError(f"events path {root} does not exist")
    paths = sorted(
        p
        for p in root.rglob("*.parquet")
        if p.is_file() and not any(part.startswith((".", "_")) for part in p.relative_to(root).parts)
    )
    if not paths:
        raise EventsError(f"no .parquet files under {root}")
    if len(paths) > MAX_FILES:
        raise EventsError(f"{len(paths)} files under {root}; at most {MAX_FILES} are supported")
    return [EventFile(p, i, str(p.relative_to(root))) for i, p in enumerate(paths)]


def _convertible(typ: pa.DataType, target: str) -> bool:
    if pa.types.is_dictionary(typ):
        return _convertible(typ.value_type, target)
    if target == "int64 or string":  # `event_id`: an integer, or a string (hashed, jaxscale.sequences.eventid)
        return pa.types.is_integer(typ) or pa.types.is_null(typ) or _convertible(typ, "string")
    if target == "int64":
        return (
            pa.types.is_integer(typ)
            or pa.types.is_floating(typ)
            or pa.types.is_string(typ)
            or pa.types.is_large_string(typ)
            or pa.types.is_string_view(typ)
            or pa.types.is_timestamp(typ)
            or pa.types.is_null(typ)
        )
    return (
        pa.types.is_string(typ)
        or pa.types.is_large_string(typ)
        or pa.types.is_string_view(typ)
        or pa.types.is_binary(typ)
        or pa.types.is_large_binary(typ)
        or pa.types.is_null(typ)
    )


def can_hold(typ: pa.DataType, column: str) -> bool:
    """Whether an Arrow type can hold a raw column (required or optional) of the schema."""
    return _convertible(typ, {**RAW_FIELDS, **OPTIONAL_FIELDS}[column])


def check_schema(f: EventFile) -> pq.ParquetFile:
    """Opens a raw file and checks its required columns exist in a usable type (EventsError otherwise)."""
    try:
        pf = pq.ParquetFile(f.path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise EventsError(f"events file {f.path}: not a readable Parquet file ({e})") from None
    schema = pf.schema_arrow
    for col, target in {**RAW_FIELDS, **OPTIONAL_FIELDS}.items():
        if col not in schema.names:
            if col in OPTIONAL_FIELDS:
                continue
            raise EventsError(
                f"events file {f.path}: required column {col!r} is missing (has {schema.names}); "
                f"raw events need {dict(RAW_FIELDS)}"
            )
        typ = schema.field(col).type
        if not _convertible(typ, target):
            raise EventsError(f"events file {f.path}: column {col!r} has type {typ}, which cannot hold {target}")
    if pf.metadata.num_rows >= 2**ARRIVAL_ROW_BITS:
        raise EventsError(f"events file {f.path}: {pf.metadata.num_rows} rows; at most 2**32 - 1 per file")
    return pf


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Rows [offset, offset + len(table)) of one raw file."""

    file: EventFile
    offset: int
    table: pa.Table

    @property
    def arrival_start(self) -> int:
        return (self.file.rank << ARRIVAL_ROW_BITS) + self.offset


def _ts_range_disjoint(pf: pq.ParquetFile, rg: int, lo_ms: int | None, hi_ms: int | None) -> bool:
    """True when row group `rg`'s ts statistics prove it has no event in [lo_ms, hi_ms)."""
    if lo_ms is None and hi_ms is None:
        return False
    if not pa.types.is_integer(pf.schema_arrow.field("ts").type):
        return False
    leaves = [pf.metadata.schema.column(i).path for i in range(pf.metadata.num_columns)]
    st = pf.metadata.row_group(rg).column(leaves.index("ts")).statistics
    if st is None or not st.has_min_max or st.null_count is None or st.null_count > 0:
        return False  # a null ts is a bad row that must be counted: read the group
    return (hi_ms is not None and st.min >= hi_ms) or (lo_ms is not None and st.max < lo_ms)


def dictionary_columns(pf: pq.ParquetFile) -> list[str]:
    """The hashed string columns of a file that `read_chunks` reads dictionary-encoded: decoding a string
    page into a dictionary skips building each row's string, and the event id then hashes each distinct
    value once (`validate_rows`)."""
    schema = pf.schema_arrow
    return [c for c in HASHED_STRINGS if pa.types.is_string(schema.field(c).type)]


def read_columns(pf: pq.ParquetFile) -> list[str]:
    """The raw columns to read from a file: the required ones, then the optional ones it has; and every
    other column too unless each row has an `event_id` (`all_rows_have_ids`), since an event without one is
    identified by its whole row (`jaxscale.sequences.eventid.row_identity`)."""
    known = [*RAW_FIELDS, *(c for c in OPTIONAL_FIELDS if c in pf.schema_arrow.names)]
    if all_rows_have_ids(pf):
        return known
    return [*known, *(c for c in pf.schema_arrow.names if c not in known)]


def all_rows_have_ids(pf: pq.ParquetFile) -> bool:
    """Whether the file's statistics prove every row has an `event_id` (no null in any row group)."""
    names = pf.schema_arrow.names
    if EVENT_ID not in names:
        return False
    leaves = [pf.metadata.schema.column(i).path for i in range(pf.metadata.num_columns)]
    if EVENT_ID not in leaves:
        return False
    col = leaves.index(EVENT_ID)
    for rg in range(pf.num_row_groups):
        st = pf.metadata.row_group(rg).column(col).statistics
        if st is None or st.null_count is None or st.null_count > 0:
            return False
    return True


def read_chunks(
    files: list[EventFile], *, lo_ms: int | None = None, hi_ms: int | None = None, row_groups=None
) -> Iterator[Chunk]:
    """Row groups of `files` in arrival order; row groups whose statistics exclude [lo_ms, hi_ms) skipped.

    `row_groups` ({rank: [row group indices]}) restricts the read (the distributed runtime's work units).
    """
    for f in files:
        pf = check_schema(f)
        columns = read_columns(pf)
        dictionaries = dictionary_columns(pf)
        if dictionaries:
            pf = pq.ParquetFile(f.path, read_dictionary=dictionaries)
        offset = 0
        for rg in range(pf.num_row_groups):
            n = pf.metadata.row_group(rg).num_rows
            wanted = row_groups is None or rg in row_groups.get(f.rank, ())
            if wanted and n and not _ts_range_disjoint(pf, rg, lo_ms, hi_ms):
                yield Chunk(f, offset, pf.read_row_group(rg, columns=columns))
            offset += n


def read_stream(files: list[EventFile], micro_batch: int) -> Iterator[list[Chunk]]:
    """Arrival-order replay: lists of chunks totalling exactly `micro_batch` rows (the last may be short)."""
    if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch < 1:
        raise ValueError(f"micro_batch must be a positive integer, got {micro_batch!r}")
    pending, have = [], 0
    for f in files:
        pf = check_schema(f)
        offset = 0
        for batch in pf.iter_batches(batch_size=max(micro_batch, 1024), columns=read_columns(pf)):
            table = pa.Table.from_batches([batch])
            while table.num_rows:
                take = min(micro_batch - have, table.num_rows)
                pending.append(Chunk(f, offset, table.slice(0, take)))
                have, offset, table = have + take, offset + take, table.slice(take)
                if have == micro_batch:
                    yield pending
                    pending, have = [], 0
    if pending:
        yield pending


# ------------------------------------------------------------------------------------ row validation


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _no_rows(s: pl.Series) -> pl.Series:
    return pl.Series(np.zeros(len(s), bool))


def _int_column(s: pl.Series) -> tuple[pl.Series, pl.Series]:
    """(values as Int64 with null where bad, bad mask) for one required integer column."""
    dtype = s.dtype
    if dtype == pl.Null:
        return pl.Series(s.name, [None] * len(s), pl.Int64), _no_rows(s)
    if isinstance(dtype, pl.Datetime):
        unit = {"ns": 1_000_000, "us": 1_000, "ms": 1}[dtype.time_unit]
        v = s.dt.epoch("ms") if unit != 1 else s.cast(pl.Int64)
        return v.cast(pl.Int64), _no_rows(s)
    if dtype.is_integer():
        if dtype == pl.UInt64:
            bad = s.is_not_null() & (s > _INT64_MAX)
            return s.cast(pl.Int64, strict=False), bad.fill_null(False)
        return s.cast(pl.Int64), _no_rows(s)
    if dtype.is_float():
        ok = s.is_finite() & (s.floor() == s) & (s >= -(2.0**63)) & (s < 2.0**63)
        ok = ok.fill_null(True)
        v = pl.select(pl.when(ok).then(s).otherwise(None).cast(pl.Int64)).to_series()
        return v, (~ok & s.is_not_null())
    if dtype in (pl.String, pl.Categorical) or isinstance(dtype, pl.Enum):
        text = s.cast(pl.String).str.strip_chars()
        v = text.cast(pl.Int64, strict=False)
        return v, (v.is_null() & s.is_not_null())
    raise TypeError(f"unsupported dtype {dtype}")


def _str_column(s: pl.Series) -> tuple[pl.Series, pl.Series]:
    dtype = s.dtype
    if dtype == pl.Null:
        return pl.Series(s.name, [None] * len(s), pl.String), _no_rows(s)
    if dtype == pl.Binary:
        v = s.cast(pl.String, strict=False)
        return v, (v.is_null() & s.is_not_null())
    if dtype == pl.Categorical:  # kept encoded: only the rows that are stored are decoded (`Engine.assemble`)
        return s, _no_rows(s)
    return s.cast(pl.String), _no_rows(s)


def _ingest_column(df: pl.DataFrame, optional: list[str], ts: pl.Series, reasons: list, file: str) -> pl.Series:
    """`ingest_ts` as Int64: the column's values (null -> ts), or ts when the table has no such column.
    Appends its 'wrong type' reason to `reasons`."""
    if INGEST_TS not in optional:
        return ts.alias(INGEST_TS)
    s = df.get_column(INGEST_TS)
    try:
        v, wrong = _int_column(s)
    except TypeError:
        raise EventsError(
            f"events file {file}: column {INGEST_TS!r} has type {s.dtype}, which cannot hold int64"
        ) from None
    reasons.append((f"wrong type {INGEST_TS}", wrong.to_numpy()))
    return pl.select(pl.coalesce(v, ts).alias(INGEST_TS)).to_series()


def validate_rows(table: pa.Table, file: str, row_ids: np.ndarray | None = None) -> tuple[pl.DataFrame, dict[str, int]]:
    """The required columns coerced to their types plus `row` (position in `table`), good rows only,
    and {reason: count} of the bad ones ('null <col>', 'bad <col>' for a value of the wrong type).

    A row with several problems is counted once, under its first problem in schema order. `ingest_ts` is
    always in the output: the table's (a null -> ts, an unconvertible value -> 'wrong type ingest_ts'), or
    ts for a table without it. So is `event_id` (int64): the log's, else the hash of the whole row as given
    in `table` (every column; see `jaxscale.sequences.eventid`), or `row_ids` when the caller computed it
    before adding columns of its own (the broker's receive time).
    """
    optional = [c for c in OPTIONAL_FIELDS if c in table.column_names]
    if row_ids is None:
        row_ids = row_identity(table) if needs_row_identity(table) else np.zeros(table.num_rows, np.int64)
    elif len(row_ids) != table.num_rows:
        raise ValueError(f"{file}: {len(row_ids)} row ids for {table.num_rows} rows")
    table = table.select([*RAW_FIELDS, *optional])
    df = pl.from_arrow(table, rechunk=False)
    if not isinstance(df, pl.DataFrame):  # pragma: no cover - one-column edge of from_arrow
        df = df.to_frame()
    n = df.height
    cols, reasons = {}, []
    for col, target in RAW_FIELDS.items():
        s = df.get_column(col)
        try:
            v, wrong = _int_column(s) if target == "int64" else _str_column(s)
        except TypeError:
            raise EventsError(
                f"events file {file}: column {col!r} has type {s.dtype}, which cannot hold {target}"
            ) from None
        null = s.is_null()
        reasons.append((f"null {col}", null.to_numpy()))
        reasons.append((f"wrong type {col}", wrong.to_numpy()))
        cols[col] = v
    cols[INGEST_TS] = _ingest_column(df, optional, cols["ts"], reasons, file)
    bad = np.zeros(n, bool)
    counts: dict[str, int] = {}
    for reason, mask in reasons:
        new = mask & ~bad
        k = int(new.sum())
        if k:
            counts[reason] = k
        bad |= mask
    out = pl.DataFrame(cols).with_columns(pl.Series("row", np.arange(n, dtype=np.int64)))
    raw_ids = df.get_column(EVENT_ID) if EVENT_ID in optional else None
    if bad.any():
        out = out.filter(pl.Series(~bad))
        raw_ids = raw_ids.filter(pl.Series(~bad)) if raw_ids is not None else None
        row_ids = row_ids[~bad]
    return out.with_columns(event_ids(row_ids, raw_ids)), counts
