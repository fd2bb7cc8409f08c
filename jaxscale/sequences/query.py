"""Point-in-time reads of a stored sequence, in memory: what serving and training share.

`SequenceReader(store, name)` loads the sequence's partitions as NumPy columns (strings dictionary
encoded) with, per partition, the start offset of each user's run (files are sorted by (user_id, ts,
arrival), so that is the index). `slices(user, as_of, n)` finds the user's last n events with
ts < as_of by binary search, newest partition first, touching no other event. `refresh()` reloads only
the partitions whose directory changed (a backfill's exchange or a stream's new file), then the
sequence's vocabularies whose version changed (after the partitions: a writer saves a vocabulary before the
partitions it covers, so every loaded id is in the loaded vocabulary).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from jaxscale.sequences.definitions import Sequence
from jaxscale.sequences.store import (
    MS_PER_DAY,
    StoreError,
    day_number,
    list_partitions,
    partition_signature,
    read_partition,
    read_sequence_meta,
)
from jaxscale.sequences.vocabulary import Vocabulary, load_vocabulary, read_vocabulary_meta

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ID_MODES = ("raw", "dense")
"""How `events` answers a vocabulary field: its raw ids, or their dense indices."""


@dataclasses.dataclass(frozen=True)
class Partition:
    """One day in memory. `codes[f]` index `dictionary[f]` for string fields; `values[f]` otherwise."""

    day: str
    start_ms: int
    signature: tuple
    users: np.ndarray
    starts: np.ndarray
    """starts[i]:starts[i+1] are the rows of users[i]."""
    ts: np.ndarray
    values: dict[str, np.ndarray]
    codes: dict[str, np.ndarray]
    dictionary: dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        return len(self.ts)

    def user_rows(self, user_id: int) -> tuple[int, int]:
        i = int(np.searchsorted(self.users, user_id))
        if i == len(self.users) or self.users[i] != user_id:
            return 0, 0
        return int(self.starts[i]), int(self.starts[i + 1])


def load_partition(path: Path, day: str, columns: dict[str, str], signature: tuple) -> Partition:
    table = read_partition(path, list(columns))
    user = table.column("user_id").to_numpy()
    bounds = np.flatnonzero(np.diff(user)) + 1 if len(user) else np.zeros(0, np.int64)
    starts = np.concatenate([[0], bounds, [len(user)]]).astype(np.int64)
    values, codes, dictionary = {}, {}, {}
    for name, typ in columns.items():
        if name in ("user_id",):
            continue
        col = table.column(name)
        if typ == "string":
            enc = pc.dictionary_encode(col).combine_chunks()
            codes[name] = enc.indices.to_numpy(zero_copy_only=False).astype(np.int32)
            dictionary[name] = np.array(enc.dictionary.to_pylist(), dtype=object)
        else:
            values[name] = col.to_numpy()
    return Partition(
        day=day,
        start_ms=day_number(day) * MS_PER_DAY,
        signature=signature,
        users=user[starts[:-1]] if len(user) else user,
        starts=starts if len(user) else np.zeros(1, np.int64),
        ts=values["ts"],
        values=values,
        codes=codes,
        dictionary=dictionary,
    )


class SequenceReader:
    """One sequence of a store, in memory, for point-in-time queries (thread-safe reads)."""

    def __init__(self, store, name: str):
        self.store, self.name = Path(store), name
        self.seq_dir = self.store / name
        meta = read_sequence_meta(self.seq_dir)
        s = meta["sequence"]
        self.sequence = Sequence(
            s["name"],
            tuple(s["event_types"]),
            tuple(s["fields"]),
            s["max_length"],
            s["ordering"],
            tuple(s["engaged"]),
            tuple(s.get("vocabularies", ())),
        )
        self.columns: dict[str, str] = meta["columns"]
        self.fields = self.sequence.fields
        self.max_length = self.sequence.max_length
        self._lock = threading.Lock()
        self._json_cache: dict = {}
        self.partitions: tuple[Partition, ...] = ()
        self.vocabularies: dict[str, Vocabulary | None] = {f: None for f in self.sequence.vocabularies}
        self.refresh()

    def refresh(self, retries: int = 5) -> bool:
        """Reloads changed partitions; True if anything changed. Safe against a concurrent writer."""
        with self._lock:
            for attempt in range(retries):
                try:
                    return self._refresh()
                except FileNotFoundError:  # a writer swapped a partition under us: list again
                    if attempt == retries - 1:
                        raise
                    time.sleep(0.01 * (attempt + 1))
        return False

    def _refresh(self) -> bool:
        old = {p.day: p for p in self.partitions}
        new = []
        for day, path in list_partitions(self.seq_dir).items():
            sig = partition_signature(path)
            part = old.get(day)
            if part is None or part.signature != sig:
                part = load_partition(path, day, self.columns, sig)
                if partition_signature(path) != sig:
                    raise FileNotFoundError(path)  # changed while loading: retry
            new.append(part)
        changed = [p.signature for p in new] != [p.signature for p in self.partitions]
        self.partitions = tuple(new)
        if changed:
            live = {id(p) for p in new}
            self._json_cache = {k: v for k, v in self._json_cache.items() if k[0] in live}
        for f, old_vocab in self.vocabularies.items():  # after the partitions (see the module doc)
            meta = read_vocabulary_meta(self.seq_dir, f)
            if meta is not None and (old_vocab is None or old_vocab.version != meta["version"]):
                self.vocabularies[f] = load_vocabulary(self.seq_dir, f)
                changed = True
        return changed

    def vocabulary(self, field: str) -> Vocabulary | None:
        """The loaded vocabulary of `field` (as of the last refresh), or None when the store has none."""
        return self.vocabularies.get(field)

    def _dense_fields(self, ids: str) -> dict[str, Vocabulary]:
        """{field: vocabulary} to encode for `ids` ('raw': none; 'dense': every vocabulary field).
        ValueError for another mode, or 'dense' on a sequence without a stored vocabulary."""
        if ids == "raw":
            return {}
        if ids != "dense":
            raise ValueError(f"ids must be one of {list(ID_MODES)}, got {ids!r}")
        vocabs = {f: v for f, v in self.vocabularies.items() if v is not None}
        if not vocabs:
            raise ValueError(f"sequence {self.name!r} has no vocabulary in {self.store}: ids=dense needs one")
        return vocabs

    @property
    def num_events(self) -> int:
        return sum(p.rows for p in self.partitions)

    def slices(self, user_id: int, as_of: int | None = None, limit: int | None = None):
        """[(partition, lo, hi)], oldest first: the user's last min(limit, max_length) events with ts < as_of."""
        need = self.max_length if limit is None else min(int(limit), self.max_length)
        out = []
        for part in reversed(self.partitions):
            if need <= 0:
                break
            if as_of is not None and part.start_ms >= as_of:
                continue
            lo, hi = part.user_rows(user_id)
            if hi == lo:
                continue
            if as_of is not None and as_of < part.start_ms + MS_PER_DAY:
                hi = lo + int(np.searchsorted(part.ts[lo:hi], as_of, side="left"))
            take = min(need, hi - lo)
            if take > 0:
                out.append((part, hi - take, hi))
                need -= take
        out.reverse()
        return out

    def query(self, user_id: int, as_of: int | None = None, limit: int | None = None) -> dict[str, np.ndarray]:
        """The sequence's fields (plus arrival) as arrays, oldest first; strings decoded."""
        pieces = self.slices(user_id, as_of, limit)
        out = {}
        for f in ("ts", "arrival", *[f for f in self.fields if f != "ts"]):
            if self.columns[f] == "string":
                parts = [p.dictionary[f][p.codes[f][lo:hi]] for p, lo, hi in pieces]
                out[f] = np.concatenate(parts) if parts else np.zeros(0, object)
            else:
                parts = [p.values[f][lo:hi] for p, lo, hi in pieces]
                empty = np.zeros(0, np.float64 if self.columns[f] == "float64" else np.int64)
                out[f] = np.concatenate(parts) if parts else empty
        return out

    def events(self, user_id: int, as_of: int | None = None, limit: int | None = None, ids: str = "raw") -> list[dict]:
        """JSON-ready events (each with the sequence's fields, in definition order), oldest first.
        `ids='dense'`: vocabulary fields hold dense indices (OOV = 1) instead of raw ids."""
        dense = self._dense_fields(ids)
        pieces = self.slices(user_id, as_of, limit)
        cols = {}
        for f in self.fields:
            if f in dense:
                cols[f] = [x for p, lo, hi in pieces for x in dense[f].encode(p.values[f][lo:hi]).tolist()]
            elif self.columns[f] == "string":
                cols[f] = [x for p, lo, hi in pieces for x in p.dictionary[f][p.codes[f][lo:hi]].tolist()]
            else:
                cols[f] = [x for p, lo, hi in pieces for x in p.values[f][lo:hi].tolist()]
        names = list(self.fields)
        return [dict(zip(names, row)) for row in zip(*(cols[f] for f in names))]

    def events_json(self, user_id: int, as_of: int | None = None, limit: int | None = None, ids: str = "raw") -> str:
        """`json.dumps(self.events(...))`, rendered column-wise (the serving hot path: no dict per event)."""
        dense = self._dense_fields(ids)
        pieces = self.slices(user_id, as_of, limit)
        if not pieces:
            return "[]"
        template = "{{" + ",".join(f"{json.dumps(f)}:{{}}" for f in self.fields) + "}}"
        cols = []
        for f in self.fields:
            typ = self.columns[f]
            if f in dense:
                col = [x for p, lo, hi in pieces for x in dense[f].encode(p.values[f][lo:hi]).tolist()]
            elif typ == "string":
                col = []
                for p, lo, hi in pieces:
                    enc = self._encoded(p, f)
                    col.extend(enc[c] for c in p.codes[f][lo:hi].tolist())
            elif typ == "float64":
                col = [_json_float(x) for p, lo, hi in pieces for x in p.values[f][lo:hi].tolist()]
            else:
                col = [x for p, lo, hi in pieces for x in p.values[f][lo:hi].tolist()]
            cols.append(col)
        return "[" + ",".join(map(template.format, *cols)) + "]"

    def _encoded(self, part: Partition, field: str) -> list[str]:
        """JSON-encoded dictionary values of a string field (once per loaded partition)."""
        key = (id(part), field)
        enc = self._json_cache.get(key)
        if enc is None or enc[0] is not part:
            enc = (part, [json.dumps(v) for v in part.dictionary[field].tolist()])
            self._json_cache[key] = enc
        return enc[1]


def _json_float(x: float) -> str:
    return repr(x) if math.isfinite(x) else "null"


def open_reader(store, name: str) -> SequenceReader:
    """A reader for `name`, or StoreError naming the store's sequences."""
    if not (Path(store) / name / "_sequence.json").is_file():
        from jaxscale.sequences.store import list_sequences

        raise StoreError(f"store {store} has no sequence {name!r} (has {list_sequences(store)})")
    return SequenceReader(store, name)
