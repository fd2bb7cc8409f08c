"""Point-in-time examples of a `jaxscale.sequences` store as padded arrays in the history encoding below (the
foundation model's batch format; other models extend it), served to the trainer by Grain (`data.source: sequences`).

Two ways to split the store into examples (`split_mode`, the config's `data.sequences.split`):

* 'day' (splits 'train', 'eval'): an example is a (user, ts) pair, the anchor; its history is the user's
  last `max_seq_len` events with event time strictly before ts (never an event at or after it: no future
  leaks into an example). Anchors are the distinct (user, ts) of the stored events; the last `eval_days`
  days of the store are the eval split, the days before them the train split; an anchor needs at least
  `min_history` earlier events. Its target is the anchor event: the user's first stored (earliest arrival)
  event at ts.
* 'leave_one_out' (splits 'train', 'valid', 'test'; 'eval' is an alias of 'valid'), as SASRec: each user's
  n events in (ts, arrival) order over the whole store, positions 0..n-1. An example is a target event;
  its history is the up to `max_seq_len` events immediately before it in that order, so an event with the
  target's ts that arrived earlier IS in the history (unlike the day split's ts-strict history); the
  target and every later event never are. Position n-1 is the user's test target, n-2 its validation
  target (so the test history includes the validation event), and every earlier position a train target.
  Every example needs at least `min_history` earlier events: a user contributes test iff n-1 >=
  min_history, valid iff n-2 >= min_history, and train positions min_history..n-3 (with min_history=1: a
  user with 1 event contributes nothing, with 2 events a test example, with 3 a test and a valid example).
  Examples are ordered by (user_id, position): valid and test hold one example per user, in increasing
  user id (`users_of_split()`). `train_targets='last'` keeps only each user's last train target (position
  n-3): one example per user whose history is the user's train sequence, SASRec's training when the loss is
  at every position.

`as_of_mode` (the config's `data.sequences.as_of_mode`, day split only) says which events a history at ts
may hold: 'event' (default) every stored event with event time < ts; 'ingest' only those the platform had
also received before ts (ingest_ts < ts); 'visible' only those also committed to the store before ts
(visible_ts < ts), i.e. what a server reading the store could have answered at that moment, so no event
appears in a history it could not have been served in (`jaxscale.sequences.query` says exactly what each
bounds). Anchors and `min_history` are the same in every mode (they count stored events by event time).

Batches have the foundation model's format (see `jaxscale.training.data`), right-padded to `max_seq_len`:

    item_ids    int32  raw item id if in [0, 2**31 - 2], otherwise splitmix64(id) mod (2**31 - 1); -1 pad
    timestamps  int32  event time in unix seconds (ts // 1000); -1 pad
    actions     int32  position of the event type in the sequence's `event_types` (engagement: click 0,
                       save 1, closeup 2); -1 pad
    surfaces    int32  1 + position of the surface in the definitions' `surfaces`, 0 for any other surface
                       (without `surfaces`: crc32(surface) mod num_surfaces); -1 pad
    engaged     float32  1.0 for the sequence's `engaged` event types (engagement: save), else 0; 0 on pad
    mask        bool   True on events

plus the target event in the same encoding, 0-d per example ([batch] in a batch): `target_item_ids`,
`target_timestamps`, `target_actions`, `target_surfaces` (int32) and `target_engaged` (float32).

`SequenceBatches` is the trainer's data source: a Grain `MapDataset` over `PointInTimeExamples` (a
random-access data source), shuffled (reshuffled every epoch), repeated, batched and sliced per process,
read through Grain's threaded prefetching iterator; its `get_state`/`set_state` carry Grain's iterator
state so a checkpoint can save the data position.

Extension hooks (a model that needs more than the foundation model's keys, e.g. the contextual two-tower
source `jaxscale_models.contextual_two_tower_sequences`): `PointInTimeExamples.anchor_event(i)` is the
stored target event of example i and `history(i)` its history arrays (in both split modes); `_padding` /
`_model_columns` define the history arrays (add a key to both); `SequenceBatches._make_source` builds the
random-access source and `SequenceBatches.keys` are the keys `batch` returns.
"""

from __future__ import annotations

import functools
import inspect
import json
import zlib
from pathlib import Path

import numpy as np

from jaxscale.sequences.definitions import Definitions, load_definitions
from jaxscale.sequences.query import AS_OF_MODES, SequenceReader, open_reader

INT32_ID_LIMIT = 2**31 - 1
"""Raw ids in [0, INT32_ID_LIMIT) are kept; others are hashed into that range."""
SPLIT_MODES = ("day", "leave_one_out")
SPLITS = ("train", "eval")
"""Splits of the day split mode."""
LOO_SPLITS = ("train", "valid", "test")
"""Splits of the leave-one-out split mode ('eval' is accepted as an alias of 'valid')."""
TRAIN_TARGETS = ("every", "last")
"""Leave-one-out train examples: every train target of a user, or only its last one (with the loss at every
position of the history, one example per user is SASRec's training: the user's sequence once per epoch)."""
REQUIRED_FIELDS = ("item_id", "ts", "event_type", "surface")
HISTORY_KEYS = ("item_ids", "timestamps", "actions", "surfaces", "engaged", "mask")
TARGET_KEYS = ("target_item_ids", "target_timestamps", "target_actions", "target_surfaces", "target_engaged")
"""The target event of an example, 0-d each: `target_<key>` is the history's `<key>` encoding of it."""
BATCH_KEYS = HISTORY_KEYS + TARGET_KEYS


def item_ids_to_int32(ids: np.ndarray) -> np.ndarray:
    """Deterministic int64 -> [0, 2**31 - 1) map: identity where the id already fits, else splitmix64 hash."""
    ids = np.asarray(ids, np.int64)
    fits = (ids >= 0) & (ids < INT32_ID_LIMIT)
    with np.errstate(over="ignore"):
        x = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    hashed = (x % np.uint64(INT32_ID_LIMIT)).astype(np.int64)
    return np.where(fits, ids, hashed).astype(np.int32)


def model_item_ids(raw: np.ndarray, vocab=None) -> np.ndarray:
    """int32 item ids for a model: the dense index of each id in the store's `item_id` vocabulary (a
    `jaxscale.sequences.vocabulary.Vocabulary`; 1 = out of vocabulary) when there is one, else
    `item_ids_to_int32` (raw id, or its hash). With a vocabulary the model's item table needs at least
    `vocab.num_indices` rows (`check_item_rows`)."""
    if vocab is None:
        return item_ids_to_int32(raw)
    if vocab.num_indices > INT32_ID_LIMIT:
        raise ValueError(f"vocabulary of {vocab.field!r} has {vocab.num_indices} indices; they must fit int32")
    return vocab.encode(raw).astype(np.int32)


def check_item_rows(vocab, item_rows: int, where: str = "the model") -> None:
    """ValueError unless a table of `item_rows` rows holds every index of the `item_id` vocabulary `vocab`
    (None: no vocabulary, nothing to check)."""
    if vocab is not None and item_rows < vocab.num_indices:
        raise ValueError(
            f"{where} has item_rows={item_rows}, but the store's {vocab.field!r} vocabulary (version "
            f"{vocab.version}) has {vocab.size} ids + 2 reserved = {vocab.num_indices} indices; set item_rows >= "
            f"{vocab.num_indices}"
        )


def surface_code(surface: str, surfaces: tuple[str, ...], num_surfaces: int) -> int:
    """The model's surface id of a surface string (see the module doc)."""
    if surfaces:
        return surfaces.index(surface) + 1 if surface in surfaces else 0
    return zlib.crc32(surface.encode()) % num_surfaces


def _check_positive(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


@functools.lru_cache(maxsize=4)
def _shared_reader(store: str, sequence: str) -> SequenceReader:
    """One in-memory copy of a sequence per process, shared by the train and eval splits."""
    return open_reader(store, sequence)


def run_lengths(part, users: np.ndarray) -> np.ndarray:
    """Events of each user in one partition (0 for users without any)."""
    if len(part.users) == 0:
        return np.zeros(len(users), np.int64)
    i = np.minimum(np.searchsorted(part.users, users), len(part.users) - 1)
    return np.where(part.users[i] == users, part.starts[i + 1] - part.starts[i], 0)


class PointInTimeExamples:
    """Random-access source of point-in-time examples (a Grain `RandomAccessDataSource`).

    Picklable (Grain worker processes reopen the store lazily). `sequences(user_ids, as_of)` is the
    Python read API: padded arrays for arbitrary (user, ts) pairs.
    """

    def __init__(
        self,
        store,
        sequence: str,
        defs: Definitions | str | Path,
        *,
        max_seq_len: int,
        num_actions: int,
        num_surfaces: int,
        split: str = "train",
        eval_days: int = 1,
        min_history: int = 1,
        split_mode: str = "day",
        as_of_mode: str = "event",
        train_targets: str = "every",
    ):
        self.store, self.sequence_name = str(store), sequence
        if train_targets not in TRAIN_TARGETS:
            raise ValueError(f"train_targets must be one of {TRAIN_TARGETS}, got {train_targets!r}")
        if train_targets != "every" and split_mode != "leave_one_out":
            raise ValueError(f"train_targets={train_targets!r} needs split_mode='leave_one_out'")
        self.train_targets = train_targets
        self.defs = defs if isinstance(defs, Definitions) else load_definitions(defs)
        self.seq = self.defs.sequence(sequence)
        self.max_seq_len = _check_positive("max_seq_len", max_seq_len)
        self.num_actions = _check_positive("num_actions", num_actions)
        self.num_surfaces = _check_positive("num_surfaces", num_surfaces)
        if split_mode not in SPLIT_MODES:
            raise ValueError(f"split_mode must be one of {SPLIT_MODES}, got {split_mode!r}")
        self.split_mode = split_mode
        if as_of_mode not in AS_OF_MODES:
            raise ValueError(f"as_of_mode must be one of {list(AS_OF_MODES)}, got {as_of_mode!r}")
        if as_of_mode != "event" and split_mode != "day":
            raise ValueError(
                f"as_of_mode={as_of_mode!r} needs split_mode='day' (a leave_one_out history is positional, not "
                "a point in time)"
            )
        self.as_of_mode = as_of_mode
        if split_mode == "leave_one_out":
            if split not in (*LOO_SPLITS, "eval"):
                raise ValueError(
                    f"split must be one of {LOO_SPLITS} (or 'eval' for 'valid') in leave_one_out, got {split!r}"
                )
            split = "valid" if split == "eval" else split
            self.eval_days = eval_days  # not used by this split mode
        else:
            if split not in SPLITS:
                raise ValueError(f"split must be one of {SPLITS} in the day split mode, got {split!r}")
            self.eval_days = _check_positive("eval_days", eval_days)
        self.split = split
        if not isinstance(min_history, int) or min_history < 0:
            raise ValueError(f"min_history must be an integer >= 0, got {min_history!r}")
        self.min_history = min_history
        missing = [f for f in REQUIRED_FIELDS if f not in self.seq.fields]
        if missing:
            raise ValueError(f"sequence {sequence!r} lacks fields {missing} that the foundation model needs")
        if len(self.seq.event_types) > self.num_actions:
            raise ValueError(
                f"sequence {sequence!r} has {len(self.seq.event_types)} event types {list(self.seq.event_types)} "
                f"but the model has num_actions={self.num_actions}"
            )
        if self.defs.surfaces and len(self.defs.surfaces) + 1 > self.num_surfaces:
            raise ValueError(
                f"definitions list {len(self.defs.surfaces)} surfaces (+1 for other) but the model has "
                f"num_surfaces={self.num_surfaces}"
            )
        self._reader: SequenceReader | None = None
        self._maps: dict = {}
        reader = self.reader
        if reader.sequence.to_json() != self.seq.to_json():
            raise ValueError(
                f"store {store} was built from another definition of {sequence!r} than {defs} "
                f"(store: {json.dumps(reader.sequence.to_json())})"
            )
        self.users, self.anchor_ts, self.days, self.anchor_part, self.anchor_row = self._anchors(reader)
        """Per example: user id, target ts (ms), and the target event's partition index and row."""

    # ---------------------------------------------------------------- store access

    @property
    def reader(self) -> SequenceReader:
        if self._reader is None:
            self._reader = _shared_reader(str(Path(self.store).resolve()), self.sequence_name)
        return self._reader

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_reader"], state["_maps"] = None, {}
        state.pop("_order_items", None)  # derived from the store: rebuilt on first use
        return state

    def _anchors(self, reader: SequenceReader):
        """(users, target ts, days, target partition index, target row) of the split's examples."""
        parts = reader.partitions
        if not parts:
            raise ValueError(f"store {self.store} has no events of sequence {self.sequence_name!r}")
        if self.split_mode == "leave_one_out":
            return self._leave_one_out_anchors(parts)
        if len(parts) <= self.eval_days and self.split == "train":
            raise ValueError(
                f"store {self.store} has {len(parts)} day(s) of {self.sequence_name!r}; the train split needs "
                f"more than eval_days={self.eval_days}"
            )
        chosen = parts[-self.eval_days :] if self.split == "eval" else parts[: -self.eval_days]
        first_chosen = len(parts) - len(chosen) if self.split == "eval" else 0
        users, ts, at_part, at_row = [], [], [], []
        for k, part in enumerate(parts[first_chosen : first_chosen + len(chosen)], start=first_chosen):
            run = np.repeat(np.arange(len(part.users)), np.diff(part.starts))
            u, t = part.users[run], part.ts
            first = np.ones(len(t), bool)
            first[1:] = (u[1:] != u[:-1]) | (t[1:] != t[:-1])
            rows = np.flatnonzero(first)
            # Earlier events of the user: the rows before this one in its run, plus its whole runs in the
            # earlier days (all of them are before the anchor's day).
            history = rows - part.starts[run[rows]]
            for earlier in parts[:k]:
                history = history + run_lengths(earlier, u[rows])
            keep = history >= self.min_history
            users.append(u[rows][keep])
            ts.append(t[rows][keep])
            at_part.append(np.full(int(keep.sum()), k, np.int32))
            at_row.append(rows[keep].astype(np.int64))
        users, ts = np.concatenate(users), np.concatenate(ts)
        if len(users) == 0:
            raise ValueError(f"the {self.split} split of {self.sequence_name!r} in {self.store} has no example")
        return users, ts, [p.day for p in chosen], np.concatenate(at_part), np.concatenate(at_row)

    def _leave_one_out_anchors(self, parts):
        """Every stored event numbered by its position in its user's (ts, arrival) order (vectorised: the
        partitions are day-ordered and each is sorted by (user_id, ts, arrival), so a stable sort by user of
        their concatenation is that order), then the split's positions kept."""
        users = np.concatenate([np.repeat(p.users, np.diff(p.starts)) for p in parts])
        at_part = np.concatenate([np.full(p.rows, k, np.int32) for k, p in enumerate(parts)])
        at_row = np.concatenate([np.arange(p.rows, dtype=np.int64) for p in parts])
        ts = np.concatenate([p.ts for p in parts])
        order = np.argsort(users, kind="stable")
        users, at_part, at_row, ts = users[order], at_part[order], at_row[order], ts[order]
        first = np.ones(len(users), bool)
        first[1:] = users[1:] != users[:-1]
        starts = np.flatnonzero(first)
        run = np.cumsum(first) - 1
        position = np.arange(len(users)) - starts[run]
        count = np.diff(np.append(starts, len(users)))[run]
        last = {"test": 1, "valid": 2}.get(self.split)
        if last:
            keep = position == count - last
        else:  # train: every target before the validation one, or (train_targets='last') only the last of them
            keep = position == count - 3 if self.train_targets == "last" else position <= count - 3
        keep &= position >= self.min_history
        # every event's (partition, row) in (user, position) order, and where each example's target and its
        # user's first event are in it: a history is the slice just before the target (`_slices_before`)
        self._order_part, self._order_row = at_part, at_row
        self._target_at, self._user_first = np.flatnonzero(keep), starts[run][keep]
        if not keep.any():
            raise ValueError(
                f"the {self.split} split (leave_one_out) of {self.sequence_name!r} in {self.store} has no example "
                f"({len(starts)} users, min_history={self.min_history})"
            )
        return users[keep], ts[keep], [p.day for p in parts], at_part[keep], at_row[keep]

    # ---------------------------------------------------------------- examples

    def __len__(self) -> int:
        return len(self.users)

    def anchor(self, index: int) -> tuple[int, int]:
        """(user_id, ts in epoch ms of its target event) of example `index`."""
        return int(self.users[index]), int(self.anchor_ts[index])

    def anchor_event(self, index: int):
        """(partition, row): the stored target event of example `index`. Day split: the first stored
        (earliest arrival) of the user's events at the anchor's ts; its ts equals the anchor's, so it is not
        part of the anchor's history. Leave-one-out: the example's target event itself."""
        return self.reader.partitions[int(self.anchor_part[index])], int(self.anchor_row[index])

    def users_of_split(self) -> np.ndarray:
        """The split's distinct user ids, increasing. In leave_one_out's valid and test splits there is one
        example per user and example j is user `users_of_split()[j]` (`self.users` is the per-example array)."""
        return np.unique(self.users)

    def __getitem__(self, index) -> dict[str, np.ndarray]:
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"example {index} out of range [0, {len(self)})")
        index %= len(self)
        out = self.history(index)
        part, row = self.anchor_event(index)
        cols = self._model_columns(part)
        for k in TARGET_KEYS:
            out[k] = np.asarray(cols[k.removeprefix("target_")][row])
        return out

    def examples(self, indices) -> dict[str, np.ndarray]:
        """Examples `indices` stacked: [n, max_seq_len] history keys, [n] target keys (e.g. an evaluator's
        batch of one example per user)."""
        rows = [self[int(i)] for i in np.asarray(indices).ravel()]
        if not rows:
            return {k: v[None][:0] for k, v in (self[0] if len(self) else self._padding()).items()}
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def history(self, index: int) -> dict[str, np.ndarray]:
        """The history arrays of example `index` (`_padding`'s keys): in the day split `example(user, ts)`,
        in leave_one_out the events just before its target in (ts, arrival) order."""
        if self.split_mode == "day":
            return self.example(int(self.users[index]), int(self.anchor_ts[index]))
        return self._fill([(part, slice(lo, hi)) for part, lo, hi in self._slices_before(index)])

    def _slices_before(self, index: int):
        """[(partition, lo, hi)], oldest first: the user's last min(max_seq_len, max_length) stored events
        before the target event of example `index` (earlier rows of its partition, then earlier days)."""
        parts = self.reader.partitions
        at = int(self._target_at[index])
        lo = max(int(self._user_first[index]), at - min(self.max_seq_len, self.reader.max_length))
        part, row = self._order_part[lo:at], self._order_row[lo:at]
        # a user's rows of one partition are consecutive: one slice per partition the history touches
        cuts = [0, *(np.flatnonzero(np.diff(part)) + 1).tolist(), at - lo]
        return [(parts[int(part[a])], int(row[a]), int(row[b - 1]) + 1) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]

    def seen_mask(self, indices, num_items: int) -> np.ndarray:
        """bool [len(indices), num_items]: True at the item of every stored event of the example's user before
        its target (the whole history in (ts, arrival) order, not only the model's `max_seq_len` window): the
        candidates a history-masking protocol removes. Leave-one-out only (a day-split history is a point in
        time, not a position). Item ids outside [0, num_items) mark nothing."""
        if self.split_mode != "leave_one_out":
            raise ValueError("masking the history needs data.sequences.split: leave_one_out")
        items = self._ordered_items()
        indices = np.asarray(indices, np.int64).ravel()
        lo, hi = self._user_first[indices], self._target_at[indices]
        lengths = hi - lo
        rows = np.repeat(np.arange(len(indices)), lengths)
        at = np.repeat(lo - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
        cols = items[at]
        ok = (cols >= 0) & (cols < num_items)
        mask = np.zeros((len(indices), int(num_items)), bool)
        mask[rows[ok], cols[ok]] = True
        return mask

    def _ordered_items(self) -> np.ndarray:
        """int64: the model item id of every stored event in (user, position) order (computed once)."""
        items = getattr(self, "_order_items", None)
        if items is None:
            parts = self.reader.partitions
            flat = np.concatenate([np.asarray(self._model_columns(p)["item_ids"], np.int64) for p in parts])
            offsets = np.concatenate([[0], np.cumsum([p.rows for p in parts])[:-1]]).astype(np.int64)
            items = self._order_items = flat[offsets[self._order_part] + self._order_row]
        return items

    def item_vocabulary(self):
        """The `item_id` vocabulary the model's item ids are indices of (None: raw ids): the store's own. A
        source that reads another store than the model was trained on (serving) uses the training store's."""
        return self.reader.vocabulary("item_id")

    def _model_columns(self, part) -> dict[str, np.ndarray]:
        """A partition's events in the model's encoding (computed once per partition and vocabulary version,
        then sliced). `item_ids` are dense indices when the store has an `item_id` vocabulary."""
        vocab = self.item_vocabulary()
        key = (part.day, part.signature, None if vocab is None else vocab.version)
        cols = self._maps.get(key)
        if cols is None:
            types = part.dictionary["event_type"].tolist()
            action = np.array([self.seq.event_types.index(v) if v in self.seq.event_types else -1 for v in types])
            engaged = np.array([v in self.seq.engaged for v in types], np.float32)
            surfaces = [surface_code(v, self.defs.surfaces, self.num_surfaces) for v in part.dictionary["surface"]]
            seconds = part.ts // 1000
            if len(seconds) and (seconds.min() < 0 or seconds.max() > INT32_ID_LIMIT):
                raise ValueError(
                    f"partition {part.day}: event times {seconds.min()}..{seconds.max()} s do not fit int32 seconds"
                )
            codes = part.codes["event_type"]
            cols = {
                "item_ids": model_item_ids(part.values["item_id"], vocab),
                "timestamps": seconds.astype(np.int32),
                "actions": action.astype(np.int32)[codes],
                "surfaces": np.asarray(surfaces, np.int32)[part.codes["surface"]],
                "engaged": engaged[codes],
            }
            self._maps[key] = cols
        return cols

    def _padding(self) -> dict[str, np.ndarray]:
        """An empty history: one padded [max_seq_len] array per key of `_model_columns`, plus `mask`."""
        L = self.max_seq_len
        return {
            "item_ids": np.full(L, -1, np.int32),
            "timestamps": np.full(L, -1, np.int32),
            "actions": np.full(L, -1, np.int32),
            "surfaces": np.full(L, -1, np.int32),
            "engaged": np.zeros(L, np.float32),
            "mask": np.zeros(L, bool),
        }

    def example(self, user_id: int, as_of: int) -> dict[str, np.ndarray]:
        """A point-in-time history: the user's last max_seq_len events before as_of (in `as_of_mode`), in the
        model's format (the day split's history; no target keys)."""
        return self._fill(self.reader.slices(user_id, as_of, self.max_seq_len, as_of_mode=self.as_of_mode))

    def _fill(self, slices) -> dict[str, np.ndarray]:
        """The padded history arrays of [(partition or segment, rows)] pieces (rows: a slice or an index
        array), oldest first."""
        out = self._padding()
        at = 0
        for part, rows in slices:
            cols = self._model_columns(part)
            n = rows.stop - rows.start if isinstance(rows, slice) else len(rows)
            for k in out:
                if k in cols:
                    out[k][at : at + n] = cols[k][rows]
            at += n
        out["mask"][:at] = True
        return out

    def sequences(self, user_ids, as_of) -> dict[str, np.ndarray]:
        """Point-in-time batch for (user, ts) pairs: every history key [n, max_seq_len] (the Python read API;
        ts-strict as the day split, whatever `split_mode` is)."""
        user_ids, as_of = np.asarray(user_ids, np.int64).ravel(), np.asarray(as_of, np.int64).ravel()
        if user_ids.shape != as_of.shape:
            raise ValueError(f"user_ids and as_of differ in length: {user_ids.shape} vs {as_of.shape}")
        rows = [self.example(int(u), int(t)) for u, t in zip(user_ids, as_of)]
        if not rows:
            return {k: np.zeros((0, self.max_seq_len), v.dtype) for k, v in self._padding().items()}
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


class SequenceBatches:
    """The trainer's data source over a sequence store, through Grain.

    `batch(step)` returns this process's rows of the global batch of `step` (the slices of all processes
    concatenate to the one-process batch); steps are read in order through a prefetching iterator, and
    any other step (a resume, an eval restart) repositions it. `get_state()`/`set_state()` wrap Grain's
    iterator state (JSON-serialisable) so checkpoints can save the data position.
    """

    keys: tuple[str, ...] = BATCH_KEYS
    """The keys `batch` returns (a subclass whose source produces more sets its own)."""

    @classmethod
    def from_config(cls, mcfg, config, split: str, process_index: int, process_count: int, **model_options):
        """The source a run's `data.sequences` section describes, for a model config `mcfg` (its
        max_seq_len, num_actions, num_surfaces) and any options a subclass adds (`model_options`)."""
        s = config.data.sequences
        split_mode = getattr(s, "split", "day")
        as_of_mode = getattr(s, "as_of_mode", "event")
        params = inspect.signature(cls.__init__).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        if as_of_mode != "event":
            if "as_of_mode" not in params and not takes_any:
                raise ValueError(
                    f"data.sequences.as_of_mode={as_of_mode!r}: the data source {cls.__qualname__} supports only "
                    "the event mode (it takes no as_of_mode)"
                )
            model_options = {"as_of_mode": as_of_mode, **model_options}
        if split_mode != "day":
            if "split_mode" not in params and not takes_any:
                raise ValueError(
                    f"data.sequences.split={split_mode!r}: the data source {cls.__qualname__} supports only the "
                    f"day split (it takes no split_mode)"
                )
            model_options = {"split_mode": split_mode, **model_options}
        train_targets = getattr(s, "train_targets", "every")
        if train_targets != "every":
            if "train_targets" not in params and not takes_any:
                raise ValueError(
                    f"data.sequences.train_targets={train_targets!r}: the data source {cls.__qualname__} supports "
                    "only 'every' (it takes no train_targets)"
                )
            model_options = {"train_targets": train_targets, **model_options}
        return cls(
            s.store,
            s.sequence,
            s.defs,
            global_batch_size=config.train.batch_size,
            max_seq_len=mcfg.max_seq_len,
            num_actions=mcfg.num_actions,
            num_surfaces=mcfg.num_surfaces,
            seed=config.data.seed,
            process_index=process_index,
            process_count=process_count,
            split=split,
            eval_days=s.eval_days,
            min_history=s.min_history,
            **model_options,
        )

    def __init__(
        self,
        store,
        sequence: str,
        defs,
        *,
        global_batch_size: int,
        max_seq_len: int,
        num_actions: int,
        num_surfaces: int,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        split: str = "train",
        eval_days: int = 1,
        min_history: int = 1,
        split_mode: str = "day",
        as_of_mode: str = "event",
        train_targets: str = "every",
        num_threads: int = 2,
        prefetch: int = 4,
        worker_count: int = 0,
    ):
        import grain

        self.global_batch_size = _check_positive("global_batch_size", global_batch_size)
        self.process_count = _check_positive("process_count", process_count)
        if not isinstance(process_index, int) or not 0 <= process_index < process_count:
            raise ValueError(f"process_index must be in [0, {process_count}), got {process_index!r}")
        if global_batch_size % process_count:
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by process_count={process_count}")
        self.process_index, self.seed = process_index, int(seed)
        self.local_batch_size = global_batch_size // process_count
        # split_mode reaches the source only when it is not the default, so a subclass's source that predates
        # it keeps working in the day split
        extra = {} if split_mode == "day" else {"split_mode": split_mode}
        if as_of_mode != "event":
            extra["as_of_mode"] = as_of_mode
        if train_targets != "every":
            extra["train_targets"] = train_targets
        self.source = self._make_source(
            store,
            sequence,
            defs,
            max_seq_len=max_seq_len,
            num_actions=num_actions,
            num_surfaces=num_surfaces,
            split=split,
            eval_days=eval_days,
            min_history=min_history,
            **extra,
        )
        ds = grain.MapDataset.source(self.source).shuffle(seed=self.seed).repeat(None)
        ds = ds.batch(self.local_batch_size, drop_remainder=True)
        self.dataset = ds[process_index::process_count]
        self._read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
        self._mp = grain.MultiprocessingOptions(num_workers=worker_count) if worker_count else None
        self._seek(0)

    def _make_source(self, store, sequence, defs, **kwargs) -> PointInTimeExamples:
        """The random-access source of examples (`kwargs`: PointInTimeExamples' keyword arguments)."""
        return PointInTimeExamples(store, sequence, defs, **kwargs)

    def _seek(self, step: int) -> None:
        it_ds = self.dataset[step:].to_iter_dataset(self._read)
        if self._mp is not None:
            it_ds = it_ds.mp_prefetch(self._mp)
        self._iter = iter(it_ds)
        self._base, self._next = step, step

    def batch(self, step: int) -> dict[str, np.ndarray]:
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if step != self._next:
            self._seek(int(step))
        out = next(self._iter)
        self._next += 1
        return {k: out[k] for k in self.keys}

    def __len__(self) -> int:
        """Steps in one epoch of this split."""
        return len(self.source) // self.global_batch_size

    def get_state(self) -> dict:
        """The data position: the next step and Grain's iterator state (JSON-serialisable)."""
        return {"next_step": self._next, "base_step": self._base, "grain": self._iter.get_state()}

    def set_state(self, state) -> None:
        if isinstance(state, (bytes, str)):
            state = json.loads(state)
        if not isinstance(state, dict) or not {"next_step", "base_step", "grain"} <= set(state):
            raise ValueError(f"not a SequenceBatches state: {state!r}")
        self._seek(int(state["base_step"]))
        self._iter.set_state(state["grain"])
        self._next = int(state["next_step"])
