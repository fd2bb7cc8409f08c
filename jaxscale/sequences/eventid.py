"""Event ids: what makes a re-delivered event recognisable, so that the store holds each event once.

An at-least-once source (a broker that re-delivers what was not acknowledged, a log that holds a row twice)
can hand the engine the same event more than once. Every event therefore carries an int64 `event_id`:

- the raw `event_id` column when the log has one: an integer column as is (uint64 by its bits), a string
  column by the first 8 bytes of the BLAKE2b digest of its UTF-8 bytes, read as a little-endian int64;
- otherwise (no such column, or a null in it) the hash of the row's required columns after validation:
  splitmix64 chained over user_id, ts, item_id and the BLAKE2b-64 of event_type and surface. Two rows that
  agree on all five are the same event.

Both are stable across processes, machines and versions (neither Python's `hash()` nor Polars' hash, which
are seeded or may change), so a consumer that restarts recognises what an earlier process stored.

The rule, shared by backfill, the file stream, the broker consumer and the Ray backfill: within one
(sequence, day) partition an id is stored once, and the first arrival wins (`first_arrivals`).
"""

from __future__ import annotations

import hashlib

import numpy as np
import polars as pl
import pyarrow as pa

EVENT_ID = "event_id"
_SEED = np.uint64(0x6A09E667F3BCC908)  # any fixed constant: part of the id's definition, never change it


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 (wrapping arithmetic): a stable, well-mixed 64-bit hash."""
    x = np.asarray(x, np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def blake2b64(text: str) -> int:
    """The first 8 bytes of BLAKE2b(text) as an unsigned little-endian integer."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def string_hashes(s: pl.Series) -> np.ndarray:
    """uint64 BLAKE2b-64 of each value of a String series without nulls (each distinct value hashed once)."""
    uniq = s.unique()
    codes = {v: blake2b64(v) for v in uniq.to_list()}
    keys = pl.Series(list(codes), dtype=pl.String)
    vals = pl.Series(list(codes.values()), dtype=pl.UInt64)
    return s.replace_strict(keys, vals, return_dtype=pl.UInt64).to_numpy()


def is_string_dictionary(typ: pa.DataType) -> bool:
    """Whether an Arrow type is a dictionary of strings (what `dictionary_hashes` takes)."""
    return pa.types.is_dictionary(typ) and (
        pa.types.is_string(typ.value_type) or pa.types.is_large_string(typ.value_type)
    )


def dictionary_hashes(col: pa.ChunkedArray) -> np.ndarray:
    """uint64 BLAKE2b-64 of each value of a dictionary-of-strings column (0 where null), the same as
    `string_hashes` gives: each dictionary entry is hashed once and the row codes gather the results, where
    `string_hashes` pays two hash-table probes per row (a third of a backfill's validation)."""
    parts = []
    for chunk in col.chunks:
        values = np.array([0 if v is None else blake2b64(v) for v in chunk.dictionary.to_pylist()], np.uint64)
        indices = chunk.indices
        codes = indices.to_numpy() if indices.null_count == 0 else indices.fill_null(0).to_numpy(zero_copy_only=False)
        parts.append(values.take(codes) if len(values) else np.zeros(len(codes), np.uint64))
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


def _int_bits(s: pl.Series) -> np.ndarray:
    return s.cast(pl.Int64).to_numpy().view(np.uint64)


HASHED_STRINGS = ("event_type", "surface")
"""The string columns of the row hash, in the order they are chained."""


def row_hashes(df: pl.DataFrame, strings: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """int64 hash of each row's validated required columns (no nulls): the id of a row without `event_id`.
    `strings` may hold a string column's hashes already computed for these rows (`dictionary_hashes`)."""
    strings = strings or {}
    h = splitmix64(_SEED ^ _int_bits(df.get_column("user_id")))
    h = splitmix64(h ^ _int_bits(df.get_column("ts")))
    h = splitmix64(h ^ _int_bits(df.get_column("item_id")))
    for col in HASHED_STRINGS:
        hashed = strings[col] if col in strings else string_hashes(df.get_column(col))
        h = splitmix64(h ^ hashed)
    return h.view(np.int64)


def given_ids(s: pl.Series) -> tuple[np.ndarray, np.ndarray]:
    """(int64 ids, mask of rows that have one) of a raw `event_id` column (integer or string)."""
    present = s.is_not_null().to_numpy()
    if s.dtype == pl.UInt64:
        return s.fill_null(0).to_numpy().view(np.int64), present
    if s.dtype.is_integer():
        return s.cast(pl.Int64).fill_null(0).to_numpy(), present
    if s.dtype == pl.Binary:
        s = s.cast(pl.String, strict=False)
        present = s.is_not_null().to_numpy()
    text = s.cast(pl.String).fill_null("")
    return string_hashes(text).view(np.int64), present


def event_ids(df: pl.DataFrame, raw_ids: pl.Series | None, strings: dict[str, np.ndarray] | None = None) -> pl.Series:
    """The `event_id` column of validated rows `df`; `raw_ids` is the log's own column (same rows) or None;
    `strings` as for `row_hashes`."""
    ids = row_hashes(df, strings) if df.height else np.zeros(0, np.int64)
    if raw_ids is not None and df.height:
        given, present = given_ids(raw_ids)
        ids = np.where(present, given, ids)
    return pl.Series(EVENT_ID, ids, dtype=pl.Int64)


def first_arrivals(ids: np.ndarray, arrivals: np.ndarray) -> np.ndarray | None:
    """Mask keeping each id's earliest-arrival row, or None when every id is distinct (the common case)."""
    ids = np.asarray(ids, np.int64)
    if len(ids) < 2 or pl.Series(ids).n_unique() == len(ids):
        return None
    order = np.argsort(arrivals, kind="stable")
    first = pl.Series(ids[order]).is_first_distinct().to_numpy()
    keep = np.empty(len(ids), bool)
    keep[order] = first
    return keep
