"""The wire format for feature payloads: one Arrow IPC stream holding one record batch.

Each feature is a column; each row is one example. A feature with per-example shape ``()`` is a plain column of
its dtype; shape ``(d1, ..., dk)`` is a FixedSizeList of size d1 of ... FixedSizeList of size dk of the dtype
(row-major, exactly NumPy's layout), so dtype and shape are in the schema and a receiver checks them without
touching the data. Media type ``application/vnd.apache.arrow.stream``. Buffers may be compressed with Arrow's
IPC buffer compression (``zstd`` or ``lz4``, LZ4 frame): readers decompress transparently.

Selecting columns of a record batch (trimming) is zero-copy.

Decoding is bounded (`DecodeLimits`): a compressed body of a few kilobytes can declare gigabytes of values (a
compression bomb), so the rows and the decoded bytes a body declares are read from its IPC metadata (the record
batch's length, each buffer's length and, for a compressed buffer, the uncompressed length in its 8-byte prefix)
and checked BEFORE anything is decompressed; the decoded batch is checked again after (`DecodeLimitError`, which
servers answer with 413 naming the limit).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from jaxscale.serving.signature import DTYPES, FeatureError

MEDIA_TYPE = "application/vnd.apache.arrow.stream"
COMPRESSIONS = (None, "zstd", "lz4")


class PayloadError(ValueError):
    """The body is not a readable feature payload (not Arrow IPC, several batches, nulls, bad column types)."""


class DecodeLimitError(PayloadError):
    """The body declares more rows or decoded bytes than the server's `DecodeLimits` (answered 413)."""

    def __init__(self, message: str, limit: str, value: int, maximum: int):
        super().__init__(message)
        self.limit, self.value, self.maximum = limit, value, maximum

    def to_json(self) -> dict:
        return {"error": str(self), "reason": "decode_limit", "limit": self.limit, "maximum": self.maximum}


@dataclass(frozen=True)
class DecodeLimits:
    """What one request body may decode to: ``max_rows`` rows and ``max_decoded_bytes`` bytes of Arrow buffers
    (after decompression). The body limit counts bytes on the wire only; these bound what they expand to."""

    max_decoded_bytes: int = 256 << 20
    max_rows: int = 1 << 20

    def __post_init__(self):
        for name in ("max_decoded_bytes", "max_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def check(self, rows: int, decoded_bytes: int, when: str = "declares") -> None:
        """Raise `DecodeLimitError` when ``rows`` or ``decoded_bytes`` is over its limit."""
        if rows > self.max_rows:
            raise DecodeLimitError(
                f"body {when} {rows} rows, over the limit of {self.max_rows} rows (max_rows)",
                "max_rows", rows, self.max_rows,
            )  # fmt: skip
        if decoded_bytes > self.max_decoded_bytes:
            raise DecodeLimitError(
                f"body {when} {decoded_bytes} decoded bytes, over the limit of {self.max_decoded_bytes} bytes "
                "(max_decoded_bytes)",
                "max_decoded_bytes", decoded_bytes, self.max_decoded_bytes,
            )  # fmt: skip


def _column(name: str, values) -> pa.Array:
    a = np.asarray(values)
    if a.ndim == 0:
        raise FeatureError(
            f"feature {name!r} is a scalar; features have a leading batch dimension", feature=name, reason="shape"
        )
    if a.dtype.name not in DTYPES:
        raise FeatureError(f"feature {name!r} has unsupported dtype {a.dtype}", feature=name, reason="dtype")
    a = np.ascontiguousarray(a)
    arr = pa.array(a.reshape(-1), type=pa.from_numpy_dtype(a.dtype))
    for size in reversed(a.shape[1:]):
        arr = pa.FixedSizeListArray.from_arrays(arr, size)
    return arr


def to_record_batch(features: Mapping[str, np.ndarray]) -> pa.RecordBatch:
    """``{name: array [batch, ...]}`` -> a record batch; every feature must have the same batch size."""
    if not features:
        raise PayloadError("a feature payload needs at least one feature")
    batch = None
    for name, values in features.items():
        n = np.shape(values)[0] if np.ndim(values) else None
        if batch is None:
            batch = n
        elif n != batch:
            raise FeatureError(
                f"feature {name!r} has batch size {n}, other features have {batch}", feature=name, reason="shape"
            )
    return pa.RecordBatch.from_arrays([_column(k, v) for k, v in features.items()], names=list(features))


def encode(batch: pa.RecordBatch | Mapping[str, np.ndarray], compression: str | None = None) -> bytes:
    """Serialize to an Arrow IPC stream; ``compression`` is None, 'zstd' or 'lz4'."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if not isinstance(batch, pa.RecordBatch):
        batch = to_record_batch(batch)
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with pa.ipc.new_stream(sink, batch.schema, options=options) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def decode(body: bytes, limits: DecodeLimits | None = None) -> pa.RecordBatch:
    """Parse an Arrow IPC stream with exactly one record batch and unique, non-empty column names.

    With ``limits``, the rows and decoded bytes the body declares are checked before any buffer is decompressed
    (`declared_size`) and the decoded batch again after; over a limit raises `DecodeLimitError`.
    A body whose schema message is byte-identical to one already decoded reuses that parsed schema (a server sees
    the same schema on every request): parsing 200 nested field types costs more than reading the batch."""
    if limits is not None:
        limits.check(*declared_size(body))
    key, batch = _decode_known_schema(body)
    if batch is None:
        batch = _decode_stream(body)
        if key is not None:
            _SCHEMAS.put(key, batch.schema)
    if limits is not None:
        limits.check(batch.num_rows, batch.get_total_buffer_size(), "decoded to")
    return batch


def check_limits(body: bytes, limits: DecodeLimits) -> None:
    """`DecodeLimitError` when an Arrow IPC ``body`` declares more than ``limits`` allow (nothing is decompressed;
    a body that is not Arrow IPC passes: its decoder words that error)."""
    try:
        rows, decoded = declared_size(body)
    except DecodeLimitError:
        raise
    except PayloadError:
        return
    limits.check(rows, decoded)


# ------------------------------------------------------------------------------ sizes from the IPC metadata

_HEADER_RECORD_BATCH, _HEADER_DICTIONARY_BATCH = 3, 2


class _Table:
    """A FlatBuffers table in ``buf`` at ``pos``: just enough of the format to read the IPC message metadata
    (Message.fbs) without decoding the message. Every read is bounds-checked (`struct.error`, `IndexError`)."""

    def __init__(self, buf: bytes, pos: int):
        if not 0 <= pos <= len(buf) - 4:
            raise IndexError(f"table at {pos} outside the metadata")
        self.buf, self.pos = buf, pos
        self.vtable = pos - struct.unpack_from("<i", buf, pos)[0]
        if not 0 <= self.vtable <= len(buf) - 4:
            raise IndexError(f"vtable at {self.vtable} outside the metadata")
        self.vtable_size = struct.unpack_from("<H", buf, self.vtable)[0]

    def _field(self, index: int) -> int:
        at = 4 + 2 * index
        if at + 2 > self.vtable_size:
            return 0
        offset = struct.unpack_from("<H", self.buf, self.vtable + at)[0]
        return self.pos + offset if offset else 0

    def scalar(self, index: int, fmt: str, default=0):
        at = self._field(index)
        return struct.unpack_from(fmt, self.buf, at)[0] if at else default

    def table(self, index: int) -> _Table | None:
        at = self._field(index)
        return _Table(self.buf, at + struct.unpack_from("<I", self.buf, at)[0]) if at else None

    def vector(self, index: int) -> tuple[int, int]:
        """(position of the first element, element count); (0, 0) when absent."""
        at = self._field(index)
        if not at:
            return 0, 0
        start = at + struct.unpack_from("<I", self.buf, at)[0]
        return start + 4, struct.unpack_from("<I", self.buf, start)[0]


def declared_size(body: bytes) -> tuple[int, int]:
    """(rows, decoded bytes) an Arrow IPC stream declares, from its messages' metadata alone: the record batches'
    lengths, and the byte length of every buffer of its record and dictionary batches as it will be in memory (a
    compressed buffer's uncompressed length is the int64 that prefixes it in the message body). Nothing is
    decompressed or allocated: the stream's framing (length-prefixed FlatBuffers metadata, then the message body)
    is walked here. Raises `PayloadError` for a body that is not a readable IPC stream."""
    rows = decoded = 0
    at, n = 0, len(body)
    try:
        while at + 4 <= n:
            size = struct.unpack_from("<i", body, at)[0]
            if size == -1:  # the continuation marker, then the metadata length
                size = struct.unpack_from("<i", body, at + 4)[0]
                at += 8
            else:  # the format before 0.15: the length alone
                at += 4
            if size == 0:
                return rows, decoded  # end of stream
            if size < 0 or at + size > n:
                raise PayloadError(f"body is not an Arrow IPC stream: a message of {size} metadata bytes at {at}")
            meta = body[at : at + size]
            root = _Table(meta, struct.unpack_from("<I", meta, 0)[0])
            body_length = root.scalar(3, "<q")
            start = at + size
            if body_length < 0 or start + body_length > n:
                raise PayloadError(f"body is not an Arrow IPC stream: a message body of {body_length} bytes at {start}")
            at = start + body_length
            kind = root.scalar(1, "<B")
            if kind not in (_HEADER_RECORD_BATCH, _HEADER_DICTIONARY_BATCH):
                continue
            header = root.table(2)
            if header is None:
                raise PayloadError("body is not an Arrow IPC stream: a batch message without a header")
            if kind == _HEADER_DICTIONARY_BATCH:
                header = header.table(1)
                if header is None:
                    raise PayloadError("body is not an Arrow IPC stream: a dictionary batch without data")
            else:
                rows += header.scalar(0, "<q")
            first, count = header.vector(2)
            if first + 16 * count > len(meta):
                raise IndexError(f"{count} buffers run past the metadata")
            spans = np.frombuffer(meta, "<i8", 2 * count, first).reshape(count, 2)  # (offset, length) per buffer
            offsets, lengths = spans[:, 0], spans[:, 1]
            if (spans < 0).any() or (count and int((offsets + lengths).max()) > body_length):
                raise PayloadError("body is not an Arrow IPC stream: a buffer outside its message body")
            if header.table(3) is None:  # uncompressed: the buffers are as long in memory as in the body
                decoded += int(lengths.sum())
                continue
            prefixed = offsets[lengths >= 8] + start  # a compressed buffer starts with its uncompressed length
            data = np.frombuffer(body, np.uint8)
            sizes = data[prefixed[:, None] + np.arange(8)].view("<i8").reshape(-1)
            if (sizes < -1).any():
                raise PayloadError(f"an IPC buffer declares {int(sizes.min())} uncompressed bytes")
            stored = lengths[lengths >= 8] - 8  # -1: the buffer is stored uncompressed after the prefix
            decoded += int(np.where(sizes == -1, stored, sizes).sum())
    except (struct.error, IndexError, ValueError) as e:
        if isinstance(e, PayloadError):
            raise
        raise PayloadError(f"body is not an Arrow IPC stream: malformed message metadata ({e})") from None
    if at != n:
        raise PayloadError(f"body is not an Arrow IPC stream: {n - at} bytes after the last message")
    return rows, decoded


def _decode_stream(body: bytes) -> pa.RecordBatch:
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(body))
        batches = list(reader)
    except (pa.ArrowInvalid, pa.ArrowIOError, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise PayloadError(f"body is not an Arrow IPC stream: {e}") from None
    if len(batches) != 1:
        raise PayloadError(f"payload must hold exactly one record batch, got {len(batches)}")
    batch = batches[0]
    names = batch.schema.names
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise PayloadError(f"payload has duplicate feature column(s) {dup}")
    if batch.num_rows < 1:
        raise PayloadError("payload has an empty batch (0 rows)")
    return batch


class _SchemaCache:
    """Parsed schemas keyed by the schema message's metadata bytes as received. Only schemas that passed
    `_decode_stream`'s checks and hold no dictionaries go in, so a batch read against one needs no other message."""

    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self._schemas: dict[bytes, pa.Schema] = {}
        self._lock = threading.Lock()

    def get(self, metadata: bytes) -> pa.Schema | None:
        return self._schemas.get(metadata)

    def put(self, metadata: bytes, schema: pa.Schema) -> None:
        if any(pa.types.is_dictionary(f.type) for f in schema):
            return
        with self._lock:
            if len(self._schemas) >= self.max_entries:
                self._schemas.pop(next(iter(self._schemas)))
            self._schemas[metadata] = schema


_SCHEMAS = _SchemaCache()
_READ_ERRORS = (StopIteration, OSError, ValueError, TypeError, NotImplementedError, pa.ArrowException)


def _decode_known_schema(body: bytes) -> tuple[bytes | None, pa.RecordBatch | None]:
    """(the schema message's metadata, the one batch when that schema is cached and the body well formed).
    A None batch sends the body down the full path, which also words the error for a bad one."""
    try:
        messages = pa.ipc.MessageReader.open_stream(pa.py_buffer(body))
        first = messages.read_next_message()
        if first.type != "schema":
            return None, None
        key = first.metadata.to_pybytes()
    except _READ_ERRORS:
        return None, None
    schema = _SCHEMAS.get(key)
    if schema is None:
        return key, None
    try:
        message = messages.read_next_message()
        if message.type != "record batch":
            return key, None
        try:
            messages.read_next_message()
            return key, None  # more than one batch
        except StopIteration:
            pass
        batch = pa.ipc.read_record_batch(message, schema)
    except _READ_ERRORS:
        return key, None
    return key, (batch if batch.num_rows >= 1 else None)


_ARROW_DTYPES = {pa.from_numpy_dtype(np.dtype(name)): name for name in DTYPES}


def column_type(name: str, t: pa.DataType) -> tuple[str, tuple[int, ...]]:
    """A column's Arrow type -> (dtype name, per-example shape); raises FeatureError for types we do not carry."""
    shape = []
    while pa.types.is_fixed_size_list(t):
        shape.append(t.list_size)
        t = t.value_type
    dtype = _ARROW_DTYPES.get(t)
    if dtype is None:
        raise FeatureError(
            f"feature {name!r} has Arrow type {t} (supported: fixed-size lists of {sorted(DTYPES)})",
            feature=name,
            reason="dtype",
        )
    return dtype, tuple(shape)


def describe(batch: pa.RecordBatch) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{feature: (dtype, per-example shape)}`` from the schema alone."""
    return {f.name: column_type(f.name, f.type) for f in batch.schema}


def to_numpy(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """One column as a ``[batch, *shape]`` NumPy array (zero-copy for numeric columns without offsets)."""
    col = batch.column(name)
    dtype, shape = column_type(name, col.type)
    return column_to_numpy(col, name, dtype, shape)


def column_to_numpy(col: pa.Array, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """`to_numpy` for a column whose (dtype, shape) `column_type` already gave (a server caches it per schema)."""
    values = col
    for _ in shape:
        if values.null_count:
            break
        # the child array as it is (no compute kernel) when it holds exactly this list's values: 4x faster
        inner = values.values
        exact = values.offset == 0 and len(inner) == len(values) * values.type.list_size
        values = inner if exact else values.flatten()
    if values.null_count:
        raise FeatureError(f"feature {name!r} has null values", feature=name, reason="nulls")
    out = values.to_numpy(zero_copy_only=False)
    return out.reshape((len(col), *shape)).astype(dtype, copy=False)


# --------------------------------------------------------------------------------------- repeated layouts

_CONTINUATION = b"\xff\xff\xff\xff"
_END_OF_STREAM = _CONTINUATION + b"\x00\x00\x00\x00"


def batch_body_start(body: bytes) -> int | None:
    """Where the record batch's body starts in ``body`` = [schema message][batch message][end-of-stream] (the
    framing `encode` writes), from the two messages' length prefixes alone; None for any other framing."""
    n = len(body)
    if n < 24 or not body.startswith(_CONTINUATION) or not body.endswith(_END_OF_STREAM):
        return None
    at = 8 + int.from_bytes(body[4:8], "little")
    if at + 8 > n or body[at : at + 4] != _CONTINUATION:
        return None
    start = at + 8 + int.from_bytes(body[at + 4 : at + 8], "little")
    return start if start <= n - 8 else None


class LayoutCache:
    """What a server learned from a body (e.g. where each column's values lie), reused for later bodies with the
    same layout: the same length and byte-identical framing, schema and record batch metadata. The metadata fixes
    the row count, every buffer's offset and length and every null count, so such a body decodes to the same
    arrays at the same offsets and only the values differ; nothing else about it has to be parsed or checked.
    Only bodies that `decode` read without error are learned (the caller learns after the full path), with the
    rows and decoded bytes they decoded to: `find` checks those against the caller's `DecodeLimits`, so a body
    that skips decoding is bounded like one that does not."""

    def __init__(self, max_entries: int = 8):
        self.max_entries = max_entries
        self._entries: list[tuple[bytes, int, object, int, int]] = []  # (prefix, length, value, rows, decoded)
        self._lock = threading.Lock()

    def find(self, body: bytes, limits: DecodeLimits | None = None):
        """The value learned for ``body``'s layout, or None; `DecodeLimitError` when that layout decodes to more
        than ``limits`` allow."""
        n = len(body)
        for prefix, length, value, rows, decoded in self._entries:
            if n == length and body.startswith(prefix) and body.endswith(_END_OF_STREAM):
                if limits is not None:
                    limits.check(rows, decoded)
                return value
        return None

    def learn(self, body: bytes, value, batch: pa.RecordBatch) -> bool:
        """Remember ``value`` for ``body``'s layout, which decoded to ``batch`` (False when its framing is not the
        plain one)."""
        start = batch_body_start(body)
        if start is None:
            return False
        entry = (body[:start], len(body), value, batch.num_rows, batch.get_total_buffer_size())
        with self._lock:
            self._entries = [entry, *self._entries[: self.max_entries - 1]]
        return True


def view_offset(array: np.ndarray, body: bytes) -> int | None:
    """The offset in ``body`` of a C-contiguous, non-empty NumPy ``array`` that is a view of ``body``'s bytes
    (as `column_to_numpy` returns for a column of a body `decode` read); None when it is not such a view."""
    if array.nbytes == 0 or not array.flags.c_contiguous:
        return None
    offset = array.ctypes.data - np.frombuffer(body, np.uint8).ctypes.data
    return offset if 0 <= offset and offset + array.nbytes <= len(body) else None
