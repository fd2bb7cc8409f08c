"""The one execution engine: filter, normalize, enrich and assemble, over Arrow tables.

`Engine.transform(chunk)` turns one chunk of raw events (an Arrow table from one file) into, per sequence,
the normalized and enriched events with their day; `assemble(frames)` sorts a day's events into the
store's order, (user_id, ts, arrival). Backfill, stream and the distributed runtime call exactly these two
functions; only the way chunks are produced and days are written differs.

Columnar work runs in Polars (Arrow memory, multi-threaded); the final ordering is a lexsort of one
rechunked frame; enrichment tables are sorted once and looked up by binary search (or hashed per chunk when
small beside it); there is no loop over rows. experiments/sequences/RESULTS.md times the same per-batch work in Polars,
pyarrow compute and DuckDB: DuckDB is the slowest for one batch, Polars and pyarrow compute trade places
between runs on a shared 2-core machine.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jaxscale.sequences.definitions import RAW_FIELDS, Definitions, Enrichment, Sequence
from jaxscale.sequences.eventid import EVENT_ID, first_arrivals
from jaxscale.sequences.events import validate_rows
from jaxscale.sequences.store import MS_PER_DAY, STORE_SORT_KEYS, VISIBLE_TS

ARROW_TYPES = {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string()}
POLARS_TYPES = {"int64": pl.Int64, "float64": pl.Float64, "string": pl.String}
HASH_LOOKUP_RATIO = 1
"""An enrichment table with at most 1/HASH_LOOKUP_RATIO as many keys as a chunk has rows is looked up by
hashing its keys for the chunk (Arrow's `index_in`); a larger one by a binary search of the sorted keys (a
hash rebuilt from a large table for every chunk would cost more than the search)."""


class EnrichmentError(ValueError):
    """An enrichment table cannot be used; the message names the file, column or key."""


def stored_columns(defs: Definitions, seq: Sequence) -> dict[str, str]:
    """Columns of a sequence in the store, name -> type: user_id, ts, arrival, ingest_ts (when the event reached
    the platform, see `jaxscale.sequences.events`), then its other fields."""
    enriched = defs.enriched_fields()
    cols = {"user_id": "int64", "ts": "int64", "arrival": "int64", "ingest_ts": "int64"}
    for f in seq.fields:
        if f not in cols:
            cols[f] = RAW_FIELDS[f] if f in RAW_FIELDS else enriched[f].fields[f]
    return cols


def arrow_schema(columns: dict[str, str]) -> pa.Schema:
    return pa.schema([pa.field(k, ARROW_TYPES[t]) for k, t in columns.items()])


def needed_enrichments(defs: Definitions) -> list[Enrichment]:
    """Enrichments some sequence uses a field of (only their tables are required)."""
    used = {f for s in defs.sequences for f in s.fields}
    return [en for en in defs.enrichments if used & set(en.fields)]


def _table_dtype_ok(dtype: pl.DataType, typ: str) -> bool:
    if typ == "int64":
        return dtype.is_integer()
    if typ == "float64":
        return dtype.is_numeric()
    return dtype in (pl.String, pl.Categorical) or isinstance(dtype, pl.Enum)


def load_enrichment_table(en: Enrichment, path) -> pl.DataFrame:
    """An enrichment table (key + fields) from Parquet, checked: columns, types, null or duplicate keys."""
    path = Path(path)
    if not path.exists():
        raise EnrichmentError(f"enrichment {en.name!r}: table {path} does not exist")
    try:
        schema = pq.read_schema(path) if path.is_file() else pq.ParquetDataset(path).schema
    except Exception as e:
        raise EnrichmentError(f"enrichment {en.name!r}: {path} is not a readable Parquet table ({e})") from None
    for col in (en.key, *en.fields):
        if col not in schema.names:
            raise EnrichmentError(f"enrichment {en.name!r}: table {path} has no column {col!r} (has {schema.names})")
    df = pl.read_parquet(path, columns=[en.key, *en.fields])
    for col, typ in ((en.key, "int64"), *en.fields.items()):
        if not _table_dtype_ok(df.schema[col], typ):
            raise EnrichmentError(f"enrichment {en.name!r}: {path} column {col!r} is {df.schema[col]}, not {typ}")
    nulls = df.get_column(en.key).null_count()
    if nulls:
        raise EnrichmentError(f"enrichment {en.name!r}: {path} column {en.key!r} has {nulls} null keys")
    df = df.with_columns(
        pl.col(en.key).cast(pl.Int64), *[pl.col(f).cast(POLARS_TYPES[t]) for f, t in en.fields.items()]
    )
    dup = df.get_column(en.key).is_duplicated()
    if dup.any():
        example = df.filter(dup).get_column(en.key)[0]
        raise EnrichmentError(
            f"enrichment {en.name!r}: {path} has {int(dup.sum())} rows with a duplicated {en.key!r} "
            f"(e.g. {example}); each key must appear once"
        )
    return df.with_columns(pl.col(f).fill_null(en.defaults[f]) for f in en.fields)


def load_enrichment_tables(defs: Definitions, sources: dict[str, str]) -> dict[str, pl.DataFrame]:
    """{enrichment name: table} for the enrichments in use; `sources` maps source name -> path."""
    tables = {}
    for en in needed_enrichments(defs):
        if en.source not in sources:
            flag = "--items PATH" if en.source == "items" else f"--table {en.source}=PATH"
            raise EnrichmentError(
                f"enrichment {en.name!r} needs its source table {en.source!r}: pass {flag} (given: {sorted(sources)})"
            )
        tables[en.name] = load_enrichment_table(en, sources[en.source])
    return tables


@dataclasses.dataclass
class ChunkStats:
    """What happened to the rows of one chunk (summed per file into the run report)."""

    rows: int = 0
    bad: Counter = dataclasses.field(default_factory=Counter)
    filtered: int = 0
    """Good rows whose event type no sequence uses."""
    outside: int = 0
    """Good rows outside the run's day range."""
    indexed: Counter = dataclasses.field(default_factory=Counter)
    """Events indexed per sequence (an event can feed several sequences)."""
    first_day: int | None = None
    last_day: int | None = None
    """Day range of the good rows (what a backfill without --start/--end covers)."""

    def add(self, other: ChunkStats) -> None:
        self.rows += other.rows
        self.bad.update(other.bad)
        self.filtered += other.filtered
        self.outside += other.outside
        self.indexed.update(other.indexed)
        days = [d for d in (self.first_day, other.first_day) if d is not None]
        self.first_day = min(days) if days else None
        days = [d for d in (self.last_day, other.last_day) if d is not None]
        self.last_day = max(days) if days else None

    def to_json(self) -> dict:
        return {
            "rows": self.rows,
            "bad_rows": sum(self.bad.values()),
            "bad": dict(sorted(self.bad.items())),
            "filtered_event_type": self.filtered,
            "outside_range": self.outside,
            "indexed": dict(sorted(self.indexed.items())),
        }


class Engine:
    """The compiled definitions plus their enrichment tables; `transform` and `assemble` do the work."""

    def __init__(self, defs: Definitions, tables: dict[str, pl.DataFrame]):
        self.defs = defs
        self.tables = tables
        self._lookups: dict[str, tuple[np.ndarray, pl.DataFrame]] = {}
        self._arrow_lookups: dict[str, pa.Array] = {}
        self.collapsed: Counter = Counter()
        """Rows `assemble` dropped as duplicates (an event id seen twice), per sequence, since creation."""
        self._collapsed_lock = threading.Lock()
        self.raw_to_type = {r: et.name for et in defs.event_types for r in et.raw}
        used = {t for s in defs.sequences for t in s.event_types}
        self.raw_used = {r: t for r, t in self.raw_to_type.items() if t in used}
        self.columns = {s.name: stored_columns(defs, s) for s in defs.sequences}
        self.schemas = {name: arrow_schema(cols) for name, cols in self.columns.items()}
        # What a partition file holds: the declared columns plus the event id (kept out of `columns`, the
        # sequence's meta, so readers that do not deduplicate never load it).
        self.file_columns = {name: [*cols, EVENT_ID] for name, cols in self.columns.items()}
        self.file_schemas = {
            name: schema.append(pa.field(EVENT_ID, pa.int64())) for name, schema in self.schemas.items()
        }
        clash = [name for name, cols in self.columns.items() if EVENT_ID in cols]
        if clash:
            raise EnrichmentError(
                f"sequences {clash} have a field named {EVENT_ID!r}, which the store keeps for event ids"
            )
        missing = [en.name for en in needed_enrichments(defs) if en.name not in tables]
        if missing:
            raise EnrichmentError(f"enrichments {missing} have no table")

    def transform(
        self,
        table: pa.Table,
        file: str,
        arrival_start: int | np.ndarray,
        lo_ms: int | None = None,
        hi_ms: int | None = None,
        *,
        row_ids: np.ndarray | None = None,
    ) -> tuple[dict[str, pl.DataFrame], ChunkStats]:
        """One raw chunk -> {sequence: normalized events with `day`}, and the chunk's row accounting.

        `arrival_start` is the arrival id of the chunk's first row (rows follow consecutively), or an array of
        one arrival id per row (a broker's entries); events with ts outside [lo_ms, hi_ms) are counted as
        outside the range and left out. `row_ids` are the rows' whole-row identities when the caller computed
        them before adding columns of its own (`jaxscale.sequences.eventid.row_identity`; a broker's receive
        time), else they are computed from `table`.
        """
        stats = ChunkStats(rows=table.num_rows)
        df, bad = validate_rows(table, file, row_ids)
        stats.bad.update(bad)
        if isinstance(arrival_start, np.ndarray):  # one arrival per row of `table` (a broker's entries)
            arrival = pl.Series("arrival", arrival_start[df.get_column("row").to_numpy()], dtype=pl.Int64)
            df = df.with_columns(arrival).drop("row")
        else:
            df = df.with_columns((pl.col("row") + arrival_start).alias("arrival")).drop("row")
        if df.height:
            lo, hi = df.select(pl.col("ts").min().alias("lo"), pl.col("ts").max().alias("hi")).row(0)
            stats.first_day, stats.last_day = lo // MS_PER_DAY, hi // MS_PER_DAY
        if lo_ms is not None or hi_ms is not None:
            keep = pl.lit(True)
            if lo_ms is not None:
                keep = keep & (pl.col("ts") >= lo_ms)
            if hi_ms is not None:
                keep = keep & (pl.col("ts") < hi_ms)
            before = df.height
            df = df.filter(keep)
            stats.outside = before - df.height
        df = df.with_columns(pl.col("event_type").replace_strict(self.raw_used, default=None, return_dtype=pl.String))
        before = df.height
        df = df.filter(pl.col("event_type").is_not_null())
        stats.filtered = before - df.height
        df = self._enrich(df)
        df = df.with_columns((pl.col("ts") // MS_PER_DAY).cast(pl.Int32).alias("day"))
        out = {}
        for s in self.defs.sequences:
            sel = df.filter(pl.col("event_type").is_in(list(s.event_types))) if self._selects(s) else df
            out[s.name] = sel.select([*self.file_columns[s.name], "day"])
            stats.indexed[s.name] += sel.height
        return out, stats

    def _selects(self, seq: Sequence) -> bool:
        """Whether a sequence drops some of the events left after the event-type mapping (a sequence of
        every used type, or of all types, takes them all: no filter to run)."""
        return bool(seq.event_types) and not set(self.raw_used.values()) <= set(seq.event_types)

    def _enrich(self, df: pl.DataFrame) -> pl.DataFrame:
        """Each used enrichment's fields looked up by key (a left join; a key not in the table gets the
        field's default). The table is sorted by key once (`_lookups`) and each chunk binary-searched into it:
        a hash join rebuilt its hash table from the whole table for every chunk, which dominated a backfill
        of a large catalogue. A table small beside the chunk is hashed instead (HASH_LOOKUP_RATIO): the
        same positions in the sorted table, ~5x cheaper than sorting the chunk's keys for the search."""
        for en in needed_enrichments(self.defs):
            keys, table = self._lookup(en)
            k = df.get_column(en.key).to_numpy()
            if len(keys) and len(keys) * HASH_LOOKUP_RATIO <= len(k):
                # A table small beside the chunk: a hash of its keys costs less than sorting the chunk's keys.
                found = pc.index_in(pa.array(k), value_set=self._arrow_keys(en, keys))
                pos = found.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
                hit = pl.Series(found.is_valid().to_numpy(zero_copy_only=False))
            elif len(keys):
                pos = np.minimum(sorted_positions(keys, k), len(keys) - 1)
                hit = pl.Series(keys[pos] == k)
            else:
                pos, hit = np.zeros(len(k), np.int64), pl.Series(np.zeros(len(k), bool))
            rows = pl.Series(pos, dtype=pl.Int64)
            df = df.with_columns(
                pl.when(hit).then(table.get_column(f).gather(rows)).otherwise(pl.lit(en.defaults[f])).alias(f)
                for f in en.fields
            )
        return df

    def _lookup(self, en: Enrichment) -> tuple[np.ndarray, pl.DataFrame]:
        """(sorted keys, fields in that order) of an enrichment table, built on first use."""
        if en.name not in self._lookups:  # two threads may both build it: the same value either way
            table = self.tables[en.name].sort(en.key)
            self._lookups[en.name] = (table.get_column(en.key).to_numpy(), table.select(list(en.fields)))
        return self._lookups[en.name]

    def _arrow_keys(self, en: Enrichment, keys: np.ndarray) -> pa.Array:
        """The sorted keys as an Arrow array (the hash lookup's value set), built once."""
        if en.name not in self._arrow_lookups:
            self._arrow_lookups[en.name] = pa.array(keys)
        return self._arrow_lookups[en.name]

    def assemble(self, name: str, frames: list[pl.DataFrame]) -> pa.Table:
        """A day's events of sequence `name` in store order (user_id, ts, arrival), as the stored schema; an
        event id seen twice keeps its first arrival, and the rows dropped so are counted (`collapsed`)."""
        df = pl.concat(frames, how="vertical", rechunk=False) if len(frames) > 1 else frames[0]
        # One contiguous chunk first: a gather across the frames' chunks cost ~10x a gather from one. The
        # order is NumPy's lexsort (the keys are a total order: arrival is unique): ~40% less CPU than
        # Polars' multi-key arg sort for a day (90k rows), which matters more than the arg sort's threads
        # now that the backfill assembles days while its other workers transform row groups.
        # A merge of stored files keeps each event's commit time (`visible_ts`); new events get theirs when
        # the writer commits them.
        visible = all(VISIBLE_TS in f.columns for f in frames)
        df = df.select([*self.file_columns[name], *([VISIBLE_TS] if visible else [])]).rechunk()
        order = np.lexsort([df.get_column(k).to_numpy() for k in reversed(STORE_SORT_KEYS)])
        df = df[pl.Series(order, dtype=pl.Int64)]
        keep = first_arrivals(df.get_column(EVENT_ID).to_numpy(), df.get_column("arrival").to_numpy())
        if keep is not None:  # an event delivered twice: its first arrival is the one stored
            df = df.filter(pl.Series(keep))
            with self._collapsed_lock:  # the backfill assembles days on several threads
                self.collapsed[name] += len(keep) - df.height
        schema = self.file_schemas[name]
        return df.to_arrow().cast(schema.append(pa.field(VISIBLE_TS, pa.int64())) if visible else schema)


def sorted_positions(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """np.searchsorted(keys, values) for unsorted `values`, searched in sorted order (NumPy's search then
    starts from the previous answer: ~5x faster than random probes into a large table)."""
    order = np.argsort(values)
    pos = np.empty(len(values), np.int64)
    pos[order] = np.searchsorted(keys, values[order])
    return pos


def split_days(df: pl.DataFrame) -> dict[int, pl.DataFrame]:
    """{day number: rows} of a transformed frame (the `day` column)."""
    if df.height == 0:
        return {}
    return {int(k[0]): v for k, v in df.partition_by("day", as_dict=True, maintain_order=False).items()}
