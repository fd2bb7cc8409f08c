"""Training from the store: point-in-time sequences as padded arrays, served to the trainer by Grain.

An example is a (user, ts) pair, the anchor; its history is the user's last `max_seq_len` events with
event time strictly before ts (never an event at or after it: no future leaks into an example). Anchors
are the distinct (user, ts) of the stored events; the last `eval_days` days of the store are the eval
split, the days before them the train split; an anchor needs at least `min_history` earlier events.

Batches have the foundation model's format (see `jaxscale.data`), right-padded to `max_seq_len`:

    item_ids    int32  raw item id if in [0, 2**31 - 2], otherwise splitmix64(id) mod (2**31 - 1); -1 pad
    timestamps  int32  event time in unix seconds (ts // 1000); -1 pad
    actions     int32  position of the event type in the sequence's `event_types` (engagement: click 0,
                       save 1, closeup 2); -1 pad
    surfaces    int32  1 + position of the surface in the definitions' `surfaces`, 0 for any other surface
                       (without `surfaces`: crc32(surface) mod num_surfaces); -1 pad
    engaged     float32  1.0 for the sequence's `engaged` event types (engagement: save), else 0; 0 on pad
    mask        bool   True on events

`SequenceBatches` is the trainer's data source: a Grain `MapDataset` over `PointInTimeExamples` (a
random-access data source), shuffled (reshuffled every epoch), repeated, batched and sliced per process,
read through Grain's threaded prefetching iterator; its `get_state`/`set_state` carry Grain's iterator
state so a checkpoint can save the data position.

Extension hooks (a model that needs more than the foundation model's keys, e.g. the contextual two-tower
source `jaxscale_models.contextual_two_tower_sequences`): `PointInTimeExamples.anchor_event(i)` is the
stored event that anchor i was taken from; `_padding` / `_model_columns` define the history arrays (add a
key to both); `SequenceBatches._make_source` builds the random-access source and `SequenceBatches.keys`
are the keys `batch` returns.
"""

from __future__ import annotations

import functools
import json
import zlib
from pathlib import Path

import numpy as np

from jaxscale.sequences.definitions import Definitions, load_definitions
from jaxscale.sequences.query import SequenceReader, open_reader

INT32_ID_LIMIT = 2**31 - 1
"""Raw ids in [0, INT32_ID_LIMIT) are kept; others are hashed into that range."""
SPLITS = ("train", "eval")
REQUIRED_FIELDS = ("item_id", "ts", "event_type", "surface")
BATCH_KEYS = ("item_ids", "timestamps", "actions", "surfaces", "engaged", "mask")


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
    ):
        self.store, self.sequence_name = str(store), sequence
        self.defs = defs if isinstance(defs, Definitions) else load_definitions(defs)
        self.seq = self.defs.sequence(sequence)
        self.max_seq_len = _check_positive("max_seq_len", max_seq_len)
        self.num_actions = _check_positive("num_actions", num_actions)
        self.num_surfaces = _check_positive("num_surfaces", num_surfaces)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.split = split
        self.eval_days = _check_positive("eval_days", eval_days)
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

    # ---------------------------------------------------------------- store access

    @property
    def reader(self) -> SequenceReader:
        if self._reader is None:
            self._reader = _shared_reader(str(Path(self.store).resolve()), self.sequence_name)
        return self._reader

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_reader"], state["_maps"] = None, {}
        return state

    def _anchors(self, reader: SequenceReader):
        parts = reader.partitions
        if not parts:
            raise ValueError(f"store {self.store} has no events of sequence {self.sequence_name!r}")
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

    # ---------------------------------------------------------------- examples

    def __len__(self) -> int:
        return len(self.users)

    def anchor(self, index: int) -> tuple[int, int]:
        """(user_id, ts in epoch ms) of example `index`."""
        return int(self.users[index]), int(self.anchor_ts[index])

    def anchor_event(self, index: int):
        """(partition, row): the stored event anchor `index` was taken from, the first stored (earliest
        arrival) of the user's events at the anchor's ts; its ts equals the anchor's, so it is not part of the
        anchor's history."""
        return self.reader.partitions[int(self.anchor_part[index])], int(self.anchor_row[index])

    def __getitem__(self, index) -> dict[str, np.ndarray]:
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"example {index} out of range [0, {len(self)})")
        return self.example(int(self.users[index]), int(self.anchor_ts[index]))

    def _model_columns(self, part) -> dict[str, np.ndarray]:
        """A partition's events in the model's encoding (computed once per partition, then sliced)."""
        key = (part.day, part.signature)
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
                "item_ids": item_ids_to_int32(part.values["item_id"]),
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
        """One example: the user's last max_seq_len events with ts < as_of, in the model's format."""
        out = self._padding()
        at = 0
        for part, lo, hi in self.reader.slices(user_id, as_of, self.max_seq_len):
            cols = self._model_columns(part)
            for k, v in cols.items():
                out[k][at : at + hi - lo] = v[lo:hi]
            at += hi - lo
        out["mask"][:at] = True
        return out

    def sequences(self, user_ids, as_of) -> dict[str, np.ndarray]:
        """Point-in-time batch for (user, ts) pairs: every key [n, max_seq_len] (the Python read API)."""
        user_ids, as_of = np.asarray(user_ids, np.int64).ravel(), np.asarray(as_of, np.int64).ravel()
        if user_ids.shape != as_of.shape:
            raise ValueError(f"user_ids and as_of differ in length: {user_ids.shape} vs {as_of.shape}")
        rows = [self.example(int(u), int(t)) for u, t in zip(user_ids, as_of)]
        if not rows:
            return {k: np.zeros((0, self.max_seq_len), v.dtype) for k, v in self.example(0, 0).items()}
        return {k: np.stack([r[k] for r in rows]) for k in BATCH_KEYS}


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
