"""Point-in-time reads of a stored sequence, in memory: what serving and training share.

`SequenceReader(store, name)` holds the sequence's stored files as NumPy columns (strings dictionary
encoded), one `Segment` per file, with the start offset of each user's run (every file is sorted by
(user_id, ts, arrival), so that is the index). A day (`Partition`) is its files' segments: one after a
backfill or a compaction, several while a stream adds a file per micro-batch.

`slices(user, as_of, n)` finds the user's last n events before as_of by binary search, newest day first,
touching no other event; in a day of several files the user's rows of each file are merged in (ts, arrival)
order (only the last n of each file are candidates). `as_of_mode` says what "before as_of" means:

* 'event' (the default): events with ts < as_of (event time).
* 'ingest': events with ts < as_of whose `ingest_ts` < as_of: the platform had RECEIVED them before as_of
  (the broker's receive time, or the log's own `ingest_ts` column). Received is not yet visible: an event
  reaches readers only when a commit writes it to the store, up to a micro-batch (plus any consumer lag or
  outage) later, so 'ingest' can hold events no reader could see at as_of. A late event (ts < as_of <=
  ingest_ts) is left out.
* 'visible': events with ts < as_of whose `visible_ts` < as_of: the commit that wrote them to the store had
  happened before as_of (`jaxscale.sequences.incremental`: the commit's time, taken right before its files
  are written, which makes them visible milliseconds later). This is what a reader of the store could have
  answered at wall-clock time as_of (a server refreshing every R seconds saw it up to R later), so training
  in this mode matches serving. Files without the column (a backfill's, or written before it existed) count
  as visible from their modification time (a backfill installs its days once all are written, so its events
  became visible up to the backfill's duration after that). A merge keeps each event's `visible_ts`.

In both bounded modes, days none of whose events passed the bound by as_of are skipped, and a file whose
events all passed it needs no per-row test.

`refresh()` is incremental: a day whose directory is unchanged is kept as is; otherwise only its new
files are loaded (a file is known by name, inode, size and mtime, so a compaction's hard-linked files are
kept) and removed ones are dropped, never a whole-day reload. The vocabularies whose version changed are
reloaded after the partitions (a writer saves a vocabulary before the partitions it covers, so every
loaded id is in the loaded vocabulary). Stored columns the reader does not use are not read.
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jaxscale.sequences.definitions import Sequence
from jaxscale.sequences.store import (
    MS_PER_DAY,
    VISIBLE_TS,
    StoreError,
    day_number,
    file_visible_ms,
    list_partitions,
    read_sequence_meta,
)
from jaxscale.sequences.vocabulary import Vocabulary, load_vocabulary, read_vocabulary_meta

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ID_MODES = ("raw", "dense")
"""How `events` answers a vocabulary field: its raw ids, or their dense indices."""
AS_OF_MODES = ("event", "ingest", "visible")
"""What `as_of` bounds: event time only, event time and ingestion (receive) time, or event time and the
store's commit time (see the module doc)."""
INGEST_TS = "ingest_ts"
BOUNDED_MODES = {"ingest": INGEST_TS, "visible": VISIBLE_TS}
"""The modes that bound a second time besides ts, with the column they bound."""


class Segment:
    """One stored file in memory. `codes[f]` index `dictionary[f]` for string fields; `values[f]` otherwise
    (`ts`, `arrival`, `ingest_ts` and `visible_ts` included)."""

    def __init__(self, day: str, signature: tuple, users, starts, values, codes, dictionary):
        self.day, self.start_ms, self.signature = day, day_number(day) * MS_PER_DAY, signature
        self.users, self.starts = users, starts
        """starts[i]:starts[i+1] are the rows of users[i]."""
        self.values, self.codes, self.dictionary = values, codes, dictionary
        self.ts = values["ts"]
        self.ingest = values.get(INGEST_TS, self.ts)
        """ingest_ts (ts for a store written before the column existed)."""
        self.bounds = {"ingest": self.ingest, "visible": values[VISIBLE_TS]}
        self.max_bound = {m: int(a.max()) if len(a) else INT64_MIN for m, a in self.bounds.items()}
        self.min_bound = {m: int(a.min()) if len(a) else INT64_MAX for m, a in self.bounds.items()}

    @property
    def rows(self) -> int:
        return len(self.ts)

    @property
    def nbytes(self) -> int:
        arrays = [self.users, self.starts, *self.values.values(), *self.codes.values()]
        return sum(a.nbytes for a in arrays) + sum(len(d) * 64 for d in self.dictionary.values())

    def user_rows(self, user_id: int) -> tuple[int, int]:
        i = int(np.searchsorted(self.users, user_id))
        if i == len(self.users) or self.users[i] != user_id:
            return 0, 0
        return int(self.starts[i]), int(self.starts[i + 1])

    def candidates(self, user_id: int, as_of: int | None, need: int, bound: str | None):
        """Rows (a slice, or an index array) of the user's last `need` events before as_of; `bound`: None
        (event time only) or a mode of BOUNDED_MODES (as_of given)."""
        lo, hi = self.user_rows(user_id)
        if hi == lo:
            return slice(0, 0)
        if as_of is not None and as_of < self.start_ms + MS_PER_DAY:
            hi = lo + int(np.searchsorted(self.ts[lo:hi], as_of, side="left"))
        if bound is not None and self.max_bound[bound] >= as_of:
            rows = lo + np.flatnonzero(self.bounds[bound][lo:hi] < as_of)
            return rows[max(len(rows) - need, 0) :]
        return slice(max(hi - need, lo), hi)


def load_segment(path: Path, day: str, signature: tuple, columns: dict[str, str]) -> Segment:
    """One sorted file's columns (only `columns`, and its `visible_ts`) as a Segment."""
    pf = pq.ParquetFile(path)
    has_visible = VISIBLE_TS in pf.schema_arrow.names
    table = pf.read(columns=[*columns, *([VISIBLE_TS] if has_visible else [])])
    if not has_visible:
        table = table.append_column(VISIBLE_TS, pa.array(np.full(table.num_rows, file_visible_ms(path), np.int64)))
    columns = {**columns, VISIBLE_TS: "int64"}
    user = table.column("user_id").to_numpy()
    bounds = np.flatnonzero(np.diff(user)) + 1 if len(user) else np.zeros(0, np.int64)
    starts = np.concatenate([[0], bounds, [len(user)]]).astype(np.int64)
    values, codes, dictionary = {}, {}, {}
    for name, typ in columns.items():
        if name == "user_id":
            continue
        col = table.column(name)
        if typ == "string":
            enc = pc.dictionary_encode(col).combine_chunks()
            codes[name] = enc.indices.to_numpy(zero_copy_only=False).astype(np.int32)
            dictionary[name] = np.array(enc.dictionary.to_pylist(), dtype=object)
        else:
            values[name] = col.to_numpy()
    return Segment(
        day,
        signature,
        user[starts[:-1]] if len(user) else user,
        starts if len(user) else np.zeros(1, np.int64),
        values,
        codes,
        dictionary,
    )


def merge_segments(day: str, signature: tuple, segments: tuple[Segment, ...]) -> Segment:
    """The segments' rows as one Segment sorted by (user_id, ts, arrival), string dictionaries unified."""
    users = np.concatenate([np.repeat(s.users, np.diff(s.starts)) for s in segments])
    ts = np.concatenate([s.ts for s in segments])
    arrival = np.concatenate([s.values["arrival"] for s in segments])
    order = np.lexsort((arrival, ts, users))
    values = {f: np.concatenate([s.values[f] for s in segments])[order] for f in segments[0].values}
    codes, dictionary = {}, {}
    for f in segments[0].codes:
        union, inverse = np.unique(np.concatenate([s.dictionary[f] for s in segments]), return_inverse=True)
        offsets = np.cumsum([0, *(len(s.dictionary[f]) for s in segments)])
        remapped = [inverse[offsets[k] + s.codes[f]] for k, s in enumerate(segments)]
        codes[f], dictionary[f] = np.concatenate(remapped).astype(np.int32)[order], union
    users = users[order]
    bounds = np.flatnonzero(np.diff(users)) + 1
    starts = np.concatenate([[0], bounds, [len(users)]]).astype(np.int64)
    return Segment(day, signature, users[starts[:-1]], starts, values, codes, dictionary)


class Partition:
    """One day: its files' segments (in file-name order). The array attributes (`users`, `starts`, `ts`,
    `values`, `codes`, `dictionary`) are the day's rows sorted by (user_id, ts, arrival): the one segment's,
    or, while a stream has added several files, their merge (built on first use, e.g. by training)."""

    def __init__(self, day: str, directory: tuple, segments: tuple[Segment, ...]):
        self.day, self.start_ms, self.directory, self.segments = day, day_number(day) * MS_PER_DAY, directory, segments
        self.signature = segments[0].signature if len(segments) == 1 else tuple(s.signature for s in segments)
        self.rows = sum(s.rows for s in segments)
        self.min_bound = {m: min((s.min_bound[m] for s in segments), default=INT64_MAX) for m in BOUNDED_MODES}

    @functools.cached_property
    def merged(self) -> Segment:
        return self.segments[0] if len(self.segments) == 1 else merge_segments(self.day, self.signature, self.segments)

    def __getattr__(self, name):
        if name in ("users", "starts", "ts", "values", "codes", "dictionary", "ingest", "user_rows"):
            return getattr(self.merged, name)
        raise AttributeError(name)

    def pieces(self, user_id: int, as_of: int | None, need: int, bound: str | None) -> list:
        """[(segment, rows)] in (ts, arrival) order: the user's last `need` events of the day before as_of."""
        if len(self.segments) == 1:
            seg = self.segments[0]
            rows = seg.candidates(user_id, as_of, need, bound)
            return [(seg, rows)] if _count(rows) else []
        found = [(s, s.candidates(user_id, as_of, need, bound)) for s in self.segments]
        found = [(s, _as_index(r)) for s, r in found if _count(r)]
        if len(found) <= 1:
            return found
        which = np.concatenate([np.full(len(r), k, np.int64) for k, (_, r) in enumerate(found)])
        rows = np.concatenate([r for _, r in found])
        ts = np.concatenate([s.ts[r] for s, r in found])
        arrival = np.concatenate([s.values["arrival"][r] for s, r in found])
        order = np.lexsort((arrival, ts))[-need:]
        which, rows = which[order], rows[order]
        cuts = [0, *(np.flatnonzero(np.diff(which)) + 1).tolist(), len(which)]
        return [(found[int(which[a])][0], rows[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]


def _count(rows) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


def _as_index(rows) -> np.ndarray:
    return np.arange(rows.start, rows.stop, dtype=np.int64) if isinstance(rows, slice) else rows


def _file_key(day: str, entry: os.DirEntry) -> tuple:
    st = entry.stat()
    return (day, entry.name, st.st_ino, st.st_size, st.st_mtime_ns)


def _partition_listing(path: Path, day: str) -> tuple[tuple, list[tuple]]:
    """(directory identity, [file key] in name order) of one partition directory."""
    st = os.stat(path)
    with os.scandir(path) as it:
        keys = [_file_key(day, e) for e in it if e.name.endswith(".parquet") and not e.name.startswith(".")]
    return (st.st_ino, st.st_mtime_ns), sorted(keys)


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
        used = ("user_id", "ts", "arrival", INGEST_TS, *self.fields)
        self.read_columns = {c: self.columns[c] for c in dict.fromkeys(used) if c in self.columns}
        """The stored columns the reader loads (others, e.g. an event id, are never read)."""
        self._lock = threading.Lock()
        self._json_cache: dict = {}
        self.partitions: tuple[Partition, ...] = ()
        self.vocabularies: dict[str, Vocabulary | None] = {f: None for f in self.sequence.vocabularies}
        self.stats = {"refreshes": 0, "files_loaded": 0, "files_dropped": 0}
        """Counters of the incremental refresh (for monitoring and the memory benchmark)."""
        self.refresh()

    def refresh(self, retries: int = 5) -> bool:
        """Loads new files and drops removed ones; True if anything changed. Safe against a concurrent writer."""
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
        known = {s.signature: s for p in self.partitions for s in p.segments}
        new, loaded = [], 0
        for day, path in list_partitions(self.seq_dir).items():
            directory, keys = _partition_listing(path, day)
            part = old.get(day)
            if part is None or part.directory != directory:
                segments = []
                for key in keys:
                    seg = known.get(key)
                    if seg is None:
                        seg = load_segment(path / key[1], day, key, self.read_columns)
                        loaded += 1
                    segments.append(seg)
                if _partition_listing(path, day) != (directory, keys):
                    raise FileNotFoundError(path)  # changed while loading: retry
                if not segments:
                    raise StoreError(f"partition {path} has no Parquet file")
                part = Partition(day, directory, tuple(segments))
            new.append(part)
        changed = [p.signature for p in new] != [p.signature for p in self.partitions]
        live = {s.signature for p in new for s in p.segments}
        self.stats["refreshes"] += 1
        self.stats["files_loaded"] += loaded
        self.stats["files_dropped"] += sum(1 for k in known if k not in live)
        self.partitions = tuple(new)
        if changed:
            live_ids = {id(s) for p in new for s in p.segments} | {id(p) for p in new}
            self._json_cache = {k: v for k, v in self._json_cache.items() if k[0] in live_ids}
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

    @property
    def memory_bytes(self) -> int:
        """Bytes of the loaded columns (what the reader holds; the memory benchmark prints it beside RSS)."""
        return sum(s.nbytes for p in self.partitions for s in p.segments)

    def slices(self, user_id: int, as_of: int | None = None, limit: int | None = None, *, as_of_mode: str = "event"):
        """[(segment, rows)], oldest first, `rows` a slice or an index array of the segment: the user's last
        min(limit, max_length) events before as_of in `as_of_mode` (see the module doc)."""
        if as_of_mode not in AS_OF_MODES:
            raise ValueError(f"as_of_mode must be one of {list(AS_OF_MODES)}, got {as_of_mode!r}")
        bound = as_of_mode if as_of_mode in BOUNDED_MODES and as_of is not None else None
        need = self.max_length if limit is None else min(int(limit), self.max_length)
        out = []
        for part in reversed(self.partitions):
            if need <= 0:
                break
            if as_of is not None and (part.start_ms >= as_of or (bound and part.min_bound[bound] >= as_of)):
                continue
            for piece in reversed(part.pieces(user_id, as_of, need, bound)):
                out.append(piece)
                need -= _count(piece[1])
        out.reverse()
        return out

    def query(
        self, user_id: int, as_of: int | None = None, limit: int | None = None, *, as_of_mode: str = "event"
    ) -> dict[str, np.ndarray]:
        """The sequence's fields (plus arrival, ingest_ts and visible_ts) as arrays, oldest first; strings decoded."""
        pieces = self.slices(user_id, as_of, limit, as_of_mode=as_of_mode)
        extra = [c for c in ("arrival", INGEST_TS) if c in self.read_columns] + [VISIBLE_TS]
        out = {}
        for f in ("ts", *extra, *[f for f in self.fields if f != "ts"]):
            if self.columns.get(f, "int64") == "string":
                parts = [p.dictionary[f][p.codes[f][rows]] for p, rows in pieces]
                out[f] = np.concatenate(parts) if parts else np.zeros(0, object)
            else:
                parts = [p.values[f][rows] for p, rows in pieces]
                empty = np.zeros(0, np.float64 if self.columns.get(f, "int64") == "float64" else np.int64)
                out[f] = np.concatenate(parts) if parts else empty
        return out

    def events(
        self,
        user_id: int,
        as_of: int | None = None,
        limit: int | None = None,
        ids: str = "raw",
        as_of_mode: str = "event",
    ) -> list[dict]:
        """JSON-ready events (each with the sequence's fields, in definition order), oldest first.
        `ids='dense'`: vocabulary fields hold dense indices (OOV = 1) instead of raw ids."""
        dense = self._dense_fields(ids)
        pieces = self.slices(user_id, as_of, limit, as_of_mode=as_of_mode)
        cols = {}
        for f in self.fields:
            if f in dense:
                cols[f] = [x for p, rows in pieces for x in dense[f].encode(p.values[f][rows]).tolist()]
            elif self.columns[f] == "string":
                cols[f] = [x for p, rows in pieces for x in p.dictionary[f][p.codes[f][rows]].tolist()]
            else:
                cols[f] = [x for p, rows in pieces for x in p.values[f][rows].tolist()]
        names = list(self.fields)
        return [dict(zip(names, row)) for row in zip(*(cols[f] for f in names))]

    def events_json(
        self,
        user_id: int,
        as_of: int | None = None,
        limit: int | None = None,
        ids: str = "raw",
        as_of_mode: str = "event",
    ) -> str:
        """`json.dumps(self.events(...))`, rendered column-wise (the serving hot path: no dict per event)."""
        dense = self._dense_fields(ids)
        pieces = self.slices(user_id, as_of, limit, as_of_mode=as_of_mode)
        if not pieces:
            return "[]"
        template = "{{" + ",".join(f"{json.dumps(f)}:{{}}" for f in self.fields) + "}}"
        cols = []
        for f in self.fields:
            typ = self.columns[f]
            if f in dense:
                col = [x for p, rows in pieces for x in dense[f].encode(p.values[f][rows]).tolist()]
            elif typ == "string":
                col = []
                for p, rows in pieces:
                    enc = self._encoded(p, f)
                    col.extend(enc[c] for c in p.codes[f][rows].tolist())
            elif typ == "float64":
                col = [_json_float(x) for p, rows in pieces for x in p.values[f][rows].tolist()]
            else:
                col = [x for p, rows in pieces for x in p.values[f][rows].tolist()]
            cols.append(col)
        return "[" + ",".join(map(template.format, *cols)) + "]"

    def _encoded(self, part: Segment, field: str) -> list[str]:
        """JSON-encoded dictionary values of a string field (once per loaded segment)."""
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
