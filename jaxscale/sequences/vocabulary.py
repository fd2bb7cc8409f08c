"""Dense id vocabularies: raw int64 ids of a sequence field -> dense indices a model's table can hold.

A sequence declares them (`Sequence(..., vocabularies=("item_id",))`); the store keeps one per field:

    <store>/<sequence>/_vocab/<field>.parquet   columns `id` (int64, the raw ids in index order: row r is
                                                index r + 2) and `count` (events of the id counted when it
                                                was added)
    <store>/<sequence>/_vocab/<field>.json      {"field", "version", "size", "pad": 0, "oov": 1}

Index 0 is padding (never a real id), 1 is out-of-vocabulary, real ids start at 2: a table that holds the
vocabulary needs `num_indices = size + 2` rows. The backfill builds it in frequency order (most events
first, ties by the arrival of the id's first event) and the stream extends it per micro-batch; both only
ever append, so an id keeps its index forever. `version` grows by one with every write that adds ids.

Writes (under the sequence's writer lock) go Parquet first, then JSON, each atomically (fsynced temp file +
rename), and BEFORE the partitions whose events they cover are installed. A reader that loads the
partitions first and the vocabulary after (what `SequenceReader.refresh` does) therefore never sees a
stored id that its vocabulary lacks. A reader takes the first `size` ids of the Parquet file (the JSON's
size): the file is append-only, so a newer file has the older one as its prefix and a reader between the
two writes still gets one consistent version.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxscale.infra import atomic
from jaxscale.sequences.store import StoreError

PAD = 0
"""Index of padding (no event); never a real id."""
OOV = 1
"""Index of an id the vocabulary does not hold."""
FIRST = 2
"""Index of the first real id."""
VOCAB_DIR = "_vocab"


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """Raw ids of one field in index order (`ids[r]` has index r + 2), with the version that wrote them."""

    field: str
    ids: np.ndarray
    version: int = 0
    counts: np.ndarray | None = None
    _sorted: np.ndarray = dataclasses.field(init=False, repr=False, compare=False)
    _index: np.ndarray = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        ids = np.asarray(self.ids, np.int64).ravel()
        counts = np.zeros(len(ids), np.int64) if self.counts is None else np.asarray(self.counts, np.int64).ravel()
        if counts.shape != ids.shape:
            raise ValueError(f"vocabulary {self.field!r}: {len(counts)} counts for {len(ids)} ids")
        order = np.argsort(ids, kind="stable")
        if len(ids) > 1 and np.any(ids[order][1:] == ids[order][:-1]):
            dup = int(ids[order][1:][ids[order][1:] == ids[order][:-1]][0])
            raise ValueError(f"vocabulary {self.field!r} lists id {dup} more than once")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "_sorted", ids[order])
        object.__setattr__(self, "_index", order.astype(np.int64) + FIRST)

    @property
    def size(self) -> int:
        """Real ids held."""
        return len(self.ids)

    @property
    def num_indices(self) -> int:
        """Rows a table needs to hold every index: size + 2 (padding and out-of-vocabulary)."""
        return self.size + FIRST

    def encode(self, raw) -> np.ndarray:
        """int64 dense indices of raw ids (OOV = 1 for an id not held); same shape."""
        raw = np.asarray(raw, np.int64)
        if self.size == 0:
            return np.full(raw.shape, OOV, np.int64)
        pos = np.minimum(np.searchsorted(self._sorted, raw), self.size - 1)
        return np.where(self._sorted[pos] == raw, self._index[pos], OOV)

    def decode(self, dense, missing: int = -1) -> np.ndarray:
        """Raw ids of dense indices; PAD and OOV (and -1, the trainer's padding) become `missing`.
        ValueError for an index the vocabulary does not have."""
        dense = np.asarray(dense, np.int64)
        bad = (dense < -1) | (dense >= self.num_indices)
        if bad.any():
            raise ValueError(
                f"vocabulary {self.field!r} (version {self.version}) has indices [0, {self.num_indices}); "
                f"got {int(dense[bad].ravel()[0])}"
            )
        real = dense >= FIRST
        return np.where(real, self.ids[np.where(real, dense - FIRST, 0)] if self.size else missing, missing)

    def extended(self, new_ids, counts=None) -> Vocabulary:
        """This vocabulary with `new_ids` appended (none may be held already), version + 1."""
        new_ids = np.asarray(new_ids, np.int64).ravel()
        counts = np.zeros(len(new_ids), np.int64) if counts is None else np.asarray(counts, np.int64)
        return Vocabulary(
            self.field, np.concatenate([self.ids, new_ids]), self.version + 1, np.concatenate([self.counts, counts])
        )


# ------------------------------------------------------------------------------------------ building


class IdCounter:
    """Counts the ids of one field over chunks: per id, events and the arrival of its first event."""

    def __init__(self):
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, ids, arrivals) -> None:
        ids, arrivals = np.asarray(ids, np.int64).ravel(), np.asarray(arrivals, np.int64).ravel()
        if len(ids):
            self._parts.append(_group(ids, np.ones(len(ids), np.int64), arrivals))

    def add_counts(self, ids, counts, first_arrivals) -> None:
        """Adds already grouped (id, events, first arrival) rows (e.g. from a worker)."""
        ids = np.asarray(ids, np.int64).ravel()
        if len(ids):
            self._parts.append(
                (ids, np.asarray(counts, np.int64).ravel(), np.asarray(first_arrivals, np.int64).ravel())
            )

    def totals(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, events, first arrival), one row per distinct id (sorted by id)."""
        if not self._parts:
            z = np.zeros(0, np.int64)
            return z, z, z
        ids, counts, first = (np.concatenate(c) for c in zip(*self._parts))
        out = _group(ids, counts, first)
        self._parts = [out]
        return out

    def ranked(self, known: Vocabulary | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, events) of the ids `known` lacks, in frequency order (most events first; ties: earliest
        first arrival)."""
        ids, counts, first = self.totals()
        if known is not None and known.size:
            new = known.encode(ids) == OOV
            ids, counts, first = ids[new], counts[new], first[new]
        order = np.lexsort((ids, first, -counts))
        return ids[order], counts[order]


def _group(ids: np.ndarray, counts: np.ndarray, first: np.ndarray):
    """Sums counts and takes the smallest first arrival per distinct id."""
    order = np.lexsort((first, ids))
    ids, counts, first = ids[order], counts[order], first[order]
    start = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]]))
    return ids[start], np.add.reduceat(counts, start), first[start]


# ------------------------------------------------------------------------------------------ storage


def vocabulary_paths(seq_dir, field: str) -> tuple[Path, Path]:
    """(Parquet, JSON) of a field's vocabulary in a sequence directory."""
    d = Path(seq_dir) / VOCAB_DIR
    return d / f"{field}.parquet", d / f"{field}.json"


def save_vocabulary(seq_dir, vocab: Vocabulary) -> None:
    """Writes the vocabulary atomically: Parquet, then the JSON that makes it visible (call it under the
    sequence's writer lock, before installing the partitions it covers)."""
    parquet, meta = vocabulary_paths(seq_dir, vocab.field)
    parquet.parent.mkdir(parents=True, exist_ok=True)
    for stale in parquet.parent.glob(".*.tmp"):  # left by a writer that died (we hold the lock)
        stale.unlink(missing_ok=True)
    table = pa.table({"id": pa.array(vocab.ids, pa.int64()), "count": pa.array(vocab.counts, pa.int64())})
    with atomic.replacing(parquet) as tmp:
        pq.write_table(table, str(tmp), compression="zstd")
    body = {"field": vocab.field, "version": vocab.version, "size": vocab.size, "pad": PAD, "oov": OOV}
    atomic.write_text(meta, json.dumps(body) + "\n")


def read_vocabulary_meta(seq_dir, field: str) -> dict | None:
    """The JSON of a field's vocabulary, or None when the store has none."""
    _, meta = vocabulary_paths(seq_dir, field)
    try:
        data = json.loads(meta.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise StoreError(f"vocabulary {meta} is corrupt: {e}") from None
    if data.get("field") != field or data.get("pad") != PAD or data.get("oov") != OOV:
        raise StoreError(f"vocabulary {meta} is not a vocabulary of field {field!r} with pad=0, oov=1: {data}")
    return data


def load_vocabulary(seq_dir, field: str) -> Vocabulary | None:
    """The stored vocabulary of `field` (the version its JSON names), or None when the store has none."""
    meta = read_vocabulary_meta(seq_dir, field)
    if meta is None:
        return None
    parquet, _ = vocabulary_paths(seq_dir, field)
    size = int(meta["size"])
    try:
        # One open file, so a concurrent rename cannot mix two versions; an Arrow file, not a Python one: reading
        # through a Python file object leaves pyarrow I/O threads that abort the interpreter at exit now and then
        # ("terminate called without an active exception", about 1 run in 20 on a loaded 2-core machine).
        with pa.OSFile(str(parquet)) as f:
            table = pq.read_table(f, columns=["id", "count"])
    except FileNotFoundError:
        raise StoreError(f"vocabulary {parquet} is missing (its JSON names version {meta['version']})") from None
    if table.num_rows < size:
        raise StoreError(f"vocabulary {parquet} has {table.num_rows} ids; its JSON says {size}")
    table = table.slice(0, size)
    return Vocabulary(field, table.column("id").to_numpy(), int(meta["version"]), table.column("count").to_numpy())


class VocabularyWriter:
    """The vocabularies of a store's sequences during one run: extends and saves them append-only."""

    def __init__(self, store, defs):
        self.store = Path(store)
        self.current: dict[tuple[str, str], Vocabulary | None] = {
            (s.name, f): load_vocabulary(self.store / s.name, f) for s in defs.sequences for f in s.vocabularies
        }

    def fields(self, sequence: str) -> list[str]:
        return [f for (s, f) in self.current if s == sequence]

    def update(self, sequence: str, field: str, counter: IdCounter) -> Vocabulary:
        """Appends the ids `counter` saw that the vocabulary lacks (frequency order), saving a new version
        if anything was added (or if none was stored yet)."""
        old = self.current[(sequence, field)]
        ids, counts = counter.ranked(old)
        if old is not None and len(ids) == 0:
            return old
        base = old if old is not None else Vocabulary(field, np.zeros(0, np.int64), 0)
        new = base.extended(ids, counts)
        save_vocabulary(self.store / sequence, new)
        self.current[(sequence, field)] = new
        return new
