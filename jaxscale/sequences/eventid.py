"""Event ids: what makes a re-delivered event recognisable, so that the store holds each event once.

An at-least-once source (a broker that re-delivers what was not acknowledged, a log that holds a row twice)
can hand the engine the same event more than once. Every event therefore carries an int64 `event_id`:

- the raw `event_id` column when the log has one: an integer column as is (uint64 by its bits), a string
  column by the first 8 bytes of the BLAKE2b digest of its UTF-8 bytes, read as a little-endian int64;
- otherwise (no such column, or a null in it) the hash of the **whole source row**, every column as read
  (`row_identity`), so that only a true re-delivery (the same row again) collapses. Two rows that agree on
  the sequence's fields but differ in any other column (a second click on the same item in the same
  millisecond with another request id or position) are two events. (Before, the id hashed only user_id,
  ts, item_id, event_type and surface, and such rows were silently stored once.)

The row hash: columns in order of their names; per column, splitmix64 chained over a tag (the column's
name and its kind: int, float, bool, string, binary, null, else the Arrow type's name, so 5 and "5" and
5.0 differ while int32 and int64 of the same value agree, as do a plain and a dictionary-encoded column of
the same strings), a second tag for a null (so a null differs from every value), then the value: integers
by their 64 bits, floats as float64 bits (-0.0 as 0.0, every NaN as one NaN), strings (UTF-8) and binaries
by `bytes_hash` (splitmix64 of the length, chained over the bytes in 8-byte words: vectorised over a
column, where a BLAKE2b call per distinct value cost 4 s per million unique request ids), temporal types by
their integer storage, anything else (decimals, lists, structs) by `bytes_hash` of the Python value's repr.

Both ids are stable across processes, machines and versions (neither Python's `hash()` nor Polars' hash,
which are seeded or may change), so a consumer that restarts recognises what an earlier process stored. A
store written before the whole-row ids holds 5-field ids: a source re-delivering rows it stored then (a
broker's pending entries at the upgrade) would store them again, so drain a consumer before upgrading.

The rule, shared by backfill, the file stream, the broker consumer and the Ray backfill: within one
(sequence, day) partition an id is stored once, and the first arrival wins (`first_arrivals`); each run
reports how many rows it collapsed so.
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


HASHED_STRINGS = ("event_type", "surface")
"""String columns of low cardinality that readers decode dictionary-encoded (each distinct value hashed once)."""

_NAN_BITS = np.uint64(0x7FF8000000000000)


def _kind(typ: pa.DataType) -> str:
    """A column's kind in the row hash (see the module doc)."""
    if pa.types.is_dictionary(typ):
        return _kind(typ.value_type)
    if pa.types.is_null(typ):
        return "null"
    if pa.types.is_boolean(typ):
        return "bool"
    if pa.types.is_integer(typ):
        return "int"
    if pa.types.is_floating(typ):
        return "float"
    if pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ):
        return "string"
    if pa.types.is_binary(typ) or pa.types.is_large_binary(typ) or pa.types.is_fixed_size_binary(typ):
        return "binary"
    if pa.types.is_binary_view(typ):
        return "binary"
    return str(typ)


_BYTES_SEED = np.uint64(0xBB67AE8584CAA73B)  # part of the id's definition, never change it


def _splitmix_int(x: int) -> int:
    """`splitmix64` of one Python integer (no NumPy scalar overflow warnings)."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def bytes_hash(data: bytes) -> int:
    """The row hash of one string (its UTF-8) or binary value, one Python integer at a time: splitmix64 of
    the seed ^ the length, then chained over the bytes in 8-byte little-endian words (the last zero-padded).
    `_offsets_hashes` computes the same for a whole Arrow column at once."""
    h = _splitmix_int(int(_BYTES_SEED) ^ len(data))
    for k in range(0, len(data), 8):
        h = _splitmix_int(h ^ int.from_bytes(data[k : k + 8].ljust(8, b"\x00"), "little"))
    return h


def _bytes_hashes(values: list) -> np.ndarray:
    """`bytes_hash` of each str (UTF-8)/bytes value (0 for None): the slow path for unusual layouts."""
    out = np.zeros(len(values), np.uint64)
    for i, v in enumerate(values):
        if v is not None:
            out[i] = bytes_hash(v.encode("utf-8") if isinstance(v, str) else bytes(v))
    return out


def _offsets_hashes(arr: pa.Array) -> np.ndarray:
    """`bytes_hash` of each value of a string/binary array (32- or 64-bit offsets), vectorised: one pass per
    8-byte word over the values still that long (a 1M-row column of 10-byte ids: two passes)."""
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    off_type = np.int64 if large else np.int32
    _, off_buf, data_buf = arr.buffers()[:3]
    offsets = np.frombuffer(off_buf, off_type, count=len(arr) + 1, offset=arr.offset * np.dtype(off_type).itemsize)
    offsets = offsets.astype(np.int64)
    start, lengths = offsets[:-1], np.diff(offsets)
    lo = int(offsets[0]) if len(offsets) else 0
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    padded = np.zeros(max(int(offsets[-1]) - lo, 0) + 8, np.uint8) if len(offsets) else np.zeros(8, np.uint8)
    padded[: len(padded) - 8] = data[lo : len(padded) - 8 + lo]
    # Every byte position read as a little-endian uint64 (an unaligned view, no copy): words[i] = bytes i..i+7.
    words = np.ndarray(shape=(len(padded) - 7,), dtype="<u8", buffer=padded, strides=(1,))
    h = splitmix64(_BYTES_SEED ^ lengths.astype(np.uint64))
    rows = np.flatnonzero(lengths > 0)
    k = 0
    while len(rows):
        rem = lengths[rows] - k
        word = words[start[rows] - lo + k]
        short = rem < 8
        if short.any():
            bits = (np.minimum(rem, 7) * 8).astype(np.uint64)
            word = np.where(short, word & ((np.uint64(1) << bits) - np.uint64(1)), word)
        h[rows] = splitmix64(h[rows] ^ word)
        k += 8
        rows = rows[lengths[rows] > k]
    return h


def _chunk_hashes(arr: pa.Array, kind: str) -> np.ndarray:
    """uint64 value hash of each row of one chunk (anything where null: the validity tag decides)."""
    if pa.types.is_dictionary(arr.type):
        values = _chunk_hashes(arr.dictionary, kind)
        codes = arr.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        return values.take(codes) if len(values) else np.zeros(len(arr), np.uint64)
    if kind == "null":
        return np.zeros(len(arr), np.uint64)
    if kind in ("string", "binary"):
        typ = arr.type
        if pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_binary(typ):
            return _offsets_hashes(arr)
        if pa.types.is_large_binary(typ):
            return _offsets_hashes(arr)
        return _bytes_hashes(arr.to_pylist())  # view and fixed-size layouts
    if kind == "bool":
        return arr.fill_null(False).to_numpy(zero_copy_only=False).astype(np.uint64)
    if kind == "int":
        signed = pa.types.is_signed_integer(arr.type)
        v = arr.cast(pa.int64() if signed else pa.uint64()).fill_null(0).to_numpy(zero_copy_only=False)
        return v.view(np.uint64) if signed else v.astype(np.uint64, copy=False)
    if kind == "float":
        v = arr.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False).astype(np.float64)
        v = np.where(v == 0.0, 0.0, v)  # -0.0 is 0.0
        bits = v.view(np.uint64)
        return np.where(np.isnan(v), _NAN_BITS, bits)
    typ = arr.type
    if (pa.types.is_temporal(typ)) and typ.bit_width in (32, 64):
        storage = arr.view(pa.int32() if typ.bit_width == 32 else pa.int64())
        return storage.cast(pa.int64()).fill_null(0).to_numpy(zero_copy_only=False).view(np.uint64)
    return _bytes_hashes([None if v is None else repr(v) for v in arr.to_pylist()])  # decimals, nested: rare


def column_hashes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 value hash, validity mask) of each row of one column (see the module doc)."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    kind = _kind(col.type)
    if not chunks:
        return np.zeros(0, np.uint64), np.zeros(0, bool)
    values = np.concatenate([_chunk_hashes(c, kind) for c in chunks])
    valid = np.concatenate([c.is_valid().to_numpy(zero_copy_only=False) for c in chunks]).astype(bool)
    return values, valid


def row_identity(table: pa.Table) -> np.ndarray:
    """int64 hash of each whole row of `table`, every column as read (the module doc): the id of a row
    without an `event_id`. Stable across processes and versions; independent of column order and of
    dictionary encoding and integer width."""
    h = np.full(table.num_rows, _SEED, np.uint64)
    for name, i in sorted((name, i) for i, name in enumerate(table.column_names)):
        col = table.column(i)
        kind = _kind(col.type)
        values, valid = column_hashes(col)
        tag = np.uint64(blake2b64(f"{name}\x00{kind}"))
        null_tag = np.uint64(blake2b64(f"{name}\x00{kind}\x00null"))
        h = splitmix64(h ^ np.where(valid, tag, null_tag))
        h = splitmix64(h ^ np.where(valid, values, np.uint64(0)))
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


def event_ids(row_ids: np.ndarray, raw_ids: pl.Series | None) -> pl.Series:
    """The `event_id` column of validated rows: `raw_ids`, the log's own column (same rows), where it has a
    value, else `row_ids` (`row_identity` of the same rows)."""
    ids = np.asarray(row_ids, np.int64)
    if raw_ids is not None and len(ids):
        given, present = given_ids(raw_ids)
        ids = np.where(present, given, ids)
    return pl.Series(EVENT_ID, ids, dtype=pl.Int64)


def needs_row_identity(table: pa.Table) -> bool:
    """Whether some row of `table` lacks a given id (no `event_id` column, or a null in it)."""
    return EVENT_ID not in table.column_names or table.column(EVENT_ID).null_count > 0


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
