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
read after the partitions (a writer saves a vocabulary before the partitions it covers, so every loaded id
is in it), and the two are published together: one `View` (partitions, vocabularies) swapped in whole, and
every query reads one view, so a query running during a refresh never pairs new partitions with an older
vocabulary (new items out-of-vocabulary in ids=dense). Stored columns the reader does not use are not read.

A held window (`SequenceReader(..., hold=N)`, the server's `--hold-events N`, N >= max_length) bounds
memory: the reader holds each user's last N events (by ts, arrival) and, per user with older events, the
(ts, arrival) of the newest one not held (`Cutoffs`); the store keeps every event. A day that gains files
merges them into the window; a day that loses one (a merge, a new backfill) is dropped from the window and
read again whole; memory holds the window plus one day's files. An answer is exact when the window holds
enough of the user's events before as_of (every event not held is older than every held one); otherwise
`OutsideWindow` (the server's 422) names the window, never a shorter answer. The latest answer (no as_of)
is always held.
"""

from __future__ import annotations

import dataclasses
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
    day_name,
    day_number,
    file_visible_ms,
    list_partitions,
    partition_dir,
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
        self.end_ms = self.start_ms + MS_PER_DAY
        """Every row's ts is below this (a held window spanning days sets it higher)."""
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
        if as_of is not None and as_of < self.end_ms:
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


def take_rows(seg: Segment, keep: np.ndarray, day: str | None = None) -> Segment:
    """The rows of `seg` where `keep` (a mask) holds, in order, as a Segment of `day` (default: the day of its
    first ts); string dictionaries keep only the values still used."""
    users = np.repeat(seg.users, np.diff(seg.starts))[keep]
    values = {f: v[keep] for f, v in seg.values.items()}
    codes, dictionary = {}, {}
    for f, c in seg.codes.items():
        used, inverse = np.unique(c[keep], return_inverse=True)
        codes[f], dictionary[f] = inverse.astype(np.int32), seg.dictionary[f][used]
    if not len(users):
        return Segment(day or "1970-01-01", ("held",), users, np.zeros(1, np.int64), values, codes, dictionary)
    bounds = np.flatnonzero(np.diff(users)) + 1
    starts = np.concatenate([[0], bounds, [len(users)]]).astype(np.int64)
    day = day or day_name(int(values["ts"].min()) // MS_PER_DAY)
    return Segment(day, ("held",), users[starts[:-1]], starts, values, codes, dictionary)


class Cutoffs:
    """Per user of a held window, the (ts, arrival) of the newest stored event NOT held: every event of the
    user not held is at or below it, every held one above it."""

    def __init__(self, users=None, ts=None, arrival=None):
        z = np.zeros(0, np.int64)
        self.users = z if users is None else users
        self.ts = z if ts is None else ts
        self.arrival = z if arrival is None else arrival

    def of(self, user_id: int) -> tuple[int, int] | None:
        i = int(np.searchsorted(self.users, user_id))
        if i < len(self.users) and self.users[i] == user_id:
            return int(self.ts[i]), int(self.arrival[i])
        return None

    def covers(self, users, ts, arrival) -> np.ndarray:
        """Mask of the rows at or below their user's cutoff (events the window must not hold)."""
        if not len(self.users):
            return np.zeros(len(users), bool)
        pos = np.minimum(np.searchsorted(self.users, users), len(self.users) - 1)
        has = self.users[pos] == users
        cut_ts, cut_arr = self.ts[pos], self.arrival[pos]
        return has & ((ts < cut_ts) | ((ts == cut_ts) & (arrival <= cut_arr)))

    def raised(self, users, ts, arrival) -> Cutoffs:
        """These cutoffs raised to the given (user, ts, arrival) of newly dropped events (each user's newest)."""
        u = np.concatenate([self.users, users])
        t = np.concatenate([self.ts, ts])
        a = np.concatenate([self.arrival, arrival])
        order = np.lexsort((a, t, u))
        u, t, a = u[order], t[order], a[order]
        last = np.concatenate([u[1:] != u[:-1], [True]]) if len(u) else np.zeros(0, bool)
        return Cutoffs(u[last], t[last], a[last])


def hold_window(seg: Segment, hold: int, cutoffs: Cutoffs) -> tuple[Segment, Cutoffs]:
    """Each user's last `hold` events of `seg` above the user's cutoff; the cutoffs raised by what was
    dropped (see `Cutoffs`)."""
    users = np.repeat(seg.users, np.diff(seg.starts))
    arrival = seg.values["arrival"]
    keep = ~cutoffs.covers(users, seg.ts, arrival)
    counts = np.diff(seg.starts)
    over = np.flatnonzero(counts > hold)
    if len(over):
        # rank from the end within each user's run: rows before end - hold go
        end = np.repeat(seg.starts[1:], counts)
        keep &= (end - np.arange(len(users))) <= hold
        newest_dropped = seg.starts[over + 1] - hold - 1
        cutoffs = cutoffs.raised(users[newest_dropped], seg.ts[newest_dropped], arrival[newest_dropped])
    if keep.all():
        return seg, cutoffs
    return take_rows(seg, keep), cutoffs


class OutsideWindow(LookupError):
    """A query needs events older than the per-user window the reader holds in memory (`hold`)."""


@dataclasses.dataclass(frozen=True)
class View:
    """What one refresh publishes, swapped in whole: the partitions, the vocabularies read after them (so
    they cover every loaded id), and in a held window the cutoffs and the stored days."""

    partitions: tuple
    vocabularies: dict
    cutoffs: Cutoffs | None = None
    days: tuple[str, ...] = ()


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
    """One sequence of a store, in memory, for point-in-time queries (thread-safe reads). `hold`: keep only
    each user's last `hold` events in memory (at least max_length; None: every event; see the module doc)."""

    def __init__(self, store, name: str, *, hold: int | None = None):
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
        if hold is not None and (not isinstance(hold, int) or isinstance(hold, bool) or hold < self.max_length):
            raise ValueError(
                f"hold must be an integer >= the sequence's max_length ({self.max_length}) of {name!r}, got {hold!r}"
            )
        self.hold = hold
        self._lock = threading.Lock()
        self._json_cache: dict = {}
        self._view = View((), {f: None for f in self.sequence.vocabularies}, Cutoffs() if hold else None)
        self._held_listing: dict[str, tuple] = {}
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

    @property
    def partitions(self) -> tuple[Partition, ...]:
        """The loaded days (in a held window: one partition holding the window)."""
        return self._view.partitions

    @property
    def vocabularies(self) -> dict[str, Vocabulary | None]:
        return self._view.vocabularies

    @property
    def days(self) -> list[str]:
        """The store's days loaded by the last refresh."""
        return list(self._view.days) if self.hold else [p.day for p in self._view.partitions]

    def _refresh(self) -> bool:
        view = self._view
        if self.hold:
            changed, partitions, cutoffs = self._refresh_held(view)
        else:
            changed, partitions = self._refresh_days(view)
            cutoffs = None
        # The vocabularies after the partitions (a writer saves one before the partitions it covers), then
        # both published in one swap: a query never pairs new partitions with an older vocabulary.
        vocabularies = dict(view.vocabularies)
        for f, old_vocab in vocabularies.items():
            meta = read_vocabulary_meta(self.seq_dir, f)
            if meta is not None and (old_vocab is None or old_vocab.version != meta["version"]):
                vocabularies[f] = load_vocabulary(self.seq_dir, f)
                changed = True
        days = tuple(self._held_listing) if self.hold else ()
        self._view = View(partitions, vocabularies, cutoffs, days)
        if changed:
            live_ids = {id(s) for p in partitions for s in p.segments} | {id(p) for p in partitions}
            self._json_cache = {k: v for k, v in self._json_cache.items() if k[0] in live_ids}
        return changed

    def _refresh_days(self, view: View) -> tuple[bool, tuple[Partition, ...]]:
        old = {p.day: p for p in view.partitions}
        known = {s.signature: s for p in view.partitions for s in p.segments}
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
        changed = [p.signature for p in new] != [p.signature for p in view.partitions]
        live = {s.signature for p in new for s in p.segments}
        self.stats["refreshes"] += 1
        self.stats["files_loaded"] += loaded
        self.stats["files_dropped"] += sum(1 for k in known if k not in live)
        return changed, tuple(new)

    def _refresh_held(self, view: View) -> tuple[bool, tuple[Partition, ...], Cutoffs]:
        """The held window after the store's changes: a day that only gained files merges them in; a day that
        lost a file (a merge, a new backfill) or went away is dropped from the window and, if present, read
        again whole; each day's files are merged into the window and trimmed to `hold` per user at once, so
        memory holds the window plus one day's files."""
        held = view.partitions[0].segments[0] if view.partitions else None
        cutoffs = view.cutoffs
        listing = {day: _partition_listing(path, day) for day, path in list_partitions(self.seq_dir).items()}
        if listing == self._held_listing:
            self.stats["refreshes"] += 1
            return False, view.partitions, cutoffs
        drop, load, loaded = set(), {}, 0
        for day, (directory, keys) in listing.items():
            prev = self._held_listing.get(day)
            if prev == (directory, keys):
                continue
            if prev is not None and not set(prev[1]) <= set(keys):
                drop.add(day)
                self.stats["files_dropped"] += len(set(prev[1]) - set(keys))
                load[day] = keys
            else:
                load[day] = [k for k in keys if prev is None or k not in prev[1]]
        drop |= set(self._held_listing) - set(listing)
        if held is not None and drop:
            day_of = held.ts // MS_PER_DAY
            gone = np.isin(day_of, [day_number(d) for d in drop])
            held = take_rows(held, ~gone) if gone.any() else held
        for day, keys in sorted(load.items()):
            path = partition_dir(self.seq_dir, day)
            segments = [load_segment(path / k[1], day, k, self.read_columns) for k in keys]
            loaded += len(segments)
            if _partition_listing(path, day) != listing[day]:
                raise FileNotFoundError(path)  # changed while loading: retry
            parts = [s for s in (held, *segments) if s is not None and s.rows]
            if not parts:
                continue
            merged = merge_segments(day, ("held",), tuple(parts)) if len(parts) > 1 else parts[0]
            held, cutoffs = hold_window(merged, self.hold, cutoffs)
            held = take_rows(held, np.ones(held.rows, bool))  # its own day span and dictionaries
        self._held_listing = listing
        self.stats["refreshes"] += 1
        self.stats["files_loaded"] += loaded
        if held is None or not held.rows:
            return True, (), cutoffs
        held.end_ms = INT64_MAX
        return True, (Partition(held.day, ("held",), (held,)),), cutoffs

    def vocabulary(self, field: str) -> Vocabulary | None:
        """The loaded vocabulary of `field` (as of the last refresh), or None when the store has none."""
        return self.vocabularies.get(field)

    def _dense_fields(self, ids: str, view: View | None = None) -> dict[str, Vocabulary]:
        """{field: vocabulary} to encode for `ids` ('raw': none; 'dense': every vocabulary field) of `view`
        (default: the current one). ValueError for another mode, or 'dense' without a stored vocabulary."""
        if ids == "raw":
            return {}
        if ids != "dense":
            raise ValueError(f"ids must be one of {list(ID_MODES)}, got {ids!r}")
        vocabs = {f: v for f, v in (view or self._view).vocabularies.items() if v is not None}
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

    def slices(
        self,
        user_id: int,
        as_of: int | None = None,
        limit: int | None = None,
        *,
        as_of_mode: str = "event",
        view: View | None = None,
    ):
        """[(segment, rows)], oldest first, `rows` a slice or an index array of the segment: the user's last
        min(limit, max_length) events before as_of in `as_of_mode` (see the module doc), from `view` (default:
        the current one). OutsideWindow when a held window lacks events the answer needs."""
        if as_of_mode not in AS_OF_MODES:
            raise ValueError(f"as_of_mode must be one of {list(AS_OF_MODES)}, got {as_of_mode!r}")
        view = view or self._view
        bound = as_of_mode if as_of_mode in BOUNDED_MODES and as_of is not None else None
        need = self.max_length if limit is None else min(int(limit), self.max_length)
        wanted = need
        out = []
        for part in reversed(view.partitions):
            if need <= 0:
                break
            if as_of is not None and (part.start_ms >= as_of or (bound and part.min_bound[bound] >= as_of)):
                continue
            for piece in reversed(part.pieces(user_id, as_of, need, bound)):
                out.append(piece)
                need -= _count(piece[1])
        out.reverse()
        if need > 0 and view.cutoffs is not None:
            cut = view.cutoffs.of(user_id)
            if cut is not None:
                raise OutsideWindow(
                    f"user {user_id} of {self.name!r}: the answer needs {wanted} events and the {self.hold} this "
                    f"server holds per user (--hold-events) give {wanted - need}; its older events (ts <= {cut[0]}) "
                    "are in the store only: ask for a later as_of or a smaller limit, or read the store"
                )
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
        view = self._view  # one view: the vocabulary that covers these partitions
        dense = self._dense_fields(ids, view)
        pieces = self.slices(user_id, as_of, limit, as_of_mode=as_of_mode, view=view)
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
        view = self._view  # one view: the vocabulary that covers these partitions
        dense = self._dense_fields(ids, view)
        pieces = self.slices(user_id, as_of, limit, as_of_mode=as_of_mode, view=view)
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
