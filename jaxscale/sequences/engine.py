"""The one execution engine: filter, normalize, enrich and assemble, over Arrow tables.

`Engine.transform(chunk)` turns one chunk of raw events (an Arrow table from one file) into, per sequence,
the normalized and enriched events with their day; `assemble(frames)` sorts a day's events into the
store's order, (user_id, ts, arrival). Backfill, stream and the distributed runtime call exactly these two
functions; only the way chunks are produced and days are written differs.

Columnar work runs in Polars (Arrow memory, multi-threaded) and the final ordering in NumPy's lexsort;
there is no loop over rows. experiments/sequences/RESULTS.md times the same per-batch work in Polars,
pyarrow compute and DuckDB: DuckDB is the slowest for one batch, Polars and pyarrow compute trade places
between runs on a shared 2-core machine.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from jaxscale.sequences.definitions import RAW_FIELDS, Definitions, Enrichment, Sequence
from jaxscale.sequences.events import validate_rows
from jaxscale.sequences.store import MS_PER_DAY, STORE_SORT_KEYS

ARROW_TYPES = {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string()}
POLARS_TYPES = {"int64": pl.Int64, "float64": pl.Float64, "string": pl.String}


class EnrichmentError(ValueError):
    """An enrichment table cannot be used; the message names the file, column or key."""


def stored_columns(defs: Definitions, seq: Sequence) -> dict[str, str]:
    """Columns of a sequence in the store, name -> type: user_id, ts, arrival, then its other fields."""
    enriched = defs.enriched_fields()
    cols = {"user_id": "int64", "ts": "int64", "arrival": "int64"}
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
        self.raw_to_type = {r: et.name for et in defs.event_types for r in et.raw}
        used = {t for s in defs.sequences for t in s.event_types}
        self.raw_used = {r: t for r, t in self.raw_to_type.items() if t in used}
        self.columns = {s.name: stored_columns(defs, s) for s in defs.sequences}
        self.schemas = {name: arrow_schema(cols) for name, cols in self.columns.items()}
        missing = [en.name for en in needed_enrichments(defs) if en.name not in tables]
        if missing:
            raise EnrichmentError(f"enrichments {missing} have no table")

    def transform(
        self, table: pa.Table, file: str, arrival_start: int, lo_ms: int | None = None, hi_ms: int | None = None
    ) -> tuple[dict[str, pl.DataFrame], ChunkStats]:
        """One raw chunk -> {sequence: normalized events with `day`}, and the chunk's row accounting.

        `arrival_start` is the arrival id of the chunk's first row; events with ts outside [lo_ms, hi_ms)
        are counted as outside the range and left out.
        """
        stats = ChunkStats(rows=table.num_rows)
        df, bad = validate_rows(table, file)
        stats.bad.update(bad)
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
            sel = df.filter(pl.col("event_type").is_in(list(s.event_types))) if len(s.event_types) else df
            out[s.name] = sel.select([*self.columns[s.name], "day"])
            stats.indexed[s.name] += sel.height
        return out, stats

    def _enrich(self, df: pl.DataFrame) -> pl.DataFrame:
        for en in needed_enrichments(self.defs):
            table = self.tables[en.name]
            df = df.join(table, on=en.key, how="left", coalesce=True)
            df = df.with_columns(pl.col(f).fill_null(en.defaults[f]) for f in en.fields)
        return df

    def assemble(self, name: str, frames: list[pl.DataFrame]) -> pa.Table:
        """A day's events of sequence `name` in store order (user_id, ts, arrival), as the stored schema."""
        df = pl.concat(frames, how="vertical", rechunk=False) if len(frames) > 1 else frames[0]
        df = df.select(list(self.columns[name]))
        # NumPy's lexsort on the three int64 keys measured ~1.7x faster than a multi-column DataFrame sort.
        order = np.lexsort([df.get_column(k).to_numpy() for k in reversed(STORE_SORT_KEYS)])
        return df[order].to_arrow().cast(self.schemas[name])


def split_days(df: pl.DataFrame) -> dict[int, pl.DataFrame]:
    """{day number: rows} of a transformed frame (the `day` column)."""
    if df.height == 0:
        return {}
    return {int(k[0]): v for k, v in df.partition_by("day", as_dict=True, maintain_order=False).items()}
