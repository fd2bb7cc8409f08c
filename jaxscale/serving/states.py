"""Fresh hybrid states: a model's encoder states kept up to date from the sequence store, and their file format.

    python -m jaxscale.serving states --config C --checkpoint DIR --store SEQSTORE --out STATEDIR \\
        [--follow] [--interval S] [--metrics-port P]

`StateBuilder` follows one sequence of a store (a stream's commits or a backfill's output). Each `update()`:

1. refreshes its `SequenceReader` (incremental: only new files are loaded, see `jaxscale.sequences.query`)
   and diffs the reader's files against the previous update: every loaded file contributes, per user, the
   count and a wrapping sum of 64-bit event hashes (all stored fields but `ingest_ts`); files added add
   their contribution, files gone subtract it. A user whose (count, hash) differs from the one their
   published state was computed from has changed; a compaction or a re-run backfill of the same events
   changes nobody, so nobody is recomputed. Nothing is rescanned but the new files.
2. encodes the changed users' current histories (their last `max_seq_len` events, in the model's training
   encoding) with its offline encoder in micro-batches padded to one fixed shape, so the encoder compiles once
   for the builder's life (`encoder_traces`). Both come from the kind's `EncoderStateParts`, which its
   `ModelSpec.encoder_states` names (`state_parts`); a kind without them has no states to serve.
3. publishes a new complete version of the state store (below) and removes old versions.

Item ids are numbered as the model was trained: by the `item_id` vocabulary of its training store (the
config's `data.sequences.store`, or `--vocabulary-store`), not by the followed store's own, which a stream fills
in its arrival order (`training_vocabulary`).

A restart reads the latest publication's per-user digests and recomputes only the users whose stored
events differ from them (all users when the model version differs).

Publication (`STATEDIR/`):

    CURRENT                        {"format": "jaxscale.serving.states/1", "version": 7,
                                    "file": "states-000000000007.arrow", "published_at_ms": ..., ...}
    states-000000000007.arrow      one version, complete: Arrow IPC file, rows sorted by user_id
    .lock                          flock of the one builder

A version file holds `user_id` (int64), `state` (fixed-size list of d_model float32), `state_time`
(int64 epoch ms: the event time of the newest event in the history the state encodes), `ingest_time` (its
newest ingestion time), `events` and `digest` (what the state was computed from); its schema metadata holds
the `EncoderStateStore` format name, the model version, d_model, the publication number and the default
state, so `EncoderStateStore.open` reads it as well (an `EncoderStateStore`, below, is the offline form: one
Arrow IPC file of `user_id` and `state`, written atomically, read memory-mapped). A version is written to a
temporary file, fsynced and renamed into place, then `CURRENT` is replaced atomically: a reader sees the
previous version or the new one, whole. A builder killed at any point leaves `CURRENT` naming a complete
version. Versions older than the newest `keep` are deleted; a reader that has one memory-mapped keeps reading
it (an unlinked file lives until unmapped) and a reader that lost the race between reading `CURRENT` and
opening the file reads `CURRENT` again.

Default state: a user without stored events (unknown, or all events removed) is served the encoder's state
of an empty history (no events: every position padded), computed by the builder with the model and stored
in each version's metadata; `StateReader.lookup` returns it with `found=False`.

Metrics (prometheus_client, `--metrics-port`): `jaxscale_states_staleness_seconds` (histogram, per
recomputed user: publication time minus the event time of the user's newest event),
`jaxscale_states_ingest_lag_seconds` (publication time minus that event's ingestion time: the broker's
receive time, so a replayed old log still measures the pipeline), the counters
`jaxscale_states_users_recomputed_total`, `jaxscale_states_users_removed_total`,
`jaxscale_states_publications_total`, `jaxscale_states_errors_total`, and the gauges
`jaxscale_states_version`, `jaxscale_states_users`, `jaxscale_states_last_publish_seconds`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jaxscale.infra import atomic
from jaxscale.infra.periodic import PeriodicTask

log = logging.getLogger(__name__)

POINTER = "CURRENT"
POINTER_FORMAT = "jaxscale.serving.states/1"
STATE_FORMAT = "jaxscale.two_tower.encoder_states/1"
"""The `EncoderStateStore` format name: a version file opens as an encoder-state store too."""
LOCK = ".lock"
_VERSION_FILE = re.compile(r"^states-(\d{12})\.arrow$")
DEFAULT_BATCH = 256
DEFAULT_KEEP = 3
_HASH_SKIP = ("user_id", "ingest_ts")
"""Stored columns left out of a user's digest: the key, and the ingestion time (it never changes a state)."""


def version_file(version: int) -> str:
    return f"states-{version:012d}.arrow"


# ------------------------------------------------------------------------------------------ reading


class EncoderStateStore:
    """User-keyed encoder states, memory-mapped from an Arrow IPC file (see the module docstring)."""

    def __init__(self, path: Path, user_ids: np.ndarray, states: np.ndarray, version: str, mapped=None):
        self.path, self.user_ids, self.states, self.version = path, user_ids, states, version
        self._mapped = mapped  # keeps the memory map open while the arrays use it

    @property
    def dim(self) -> int:
        return self.states.shape[1]

    def __len__(self) -> int:
        return self.user_ids.shape[0]

    @staticmethod
    def write(path, user_ids, states, *, version: str) -> EncoderStateStore:
        """Writes the states of `user_ids` ([N] integers, unique) atomically; returns the opened store."""
        import pyarrow as pa

        path = Path(path)
        user_ids = np.asarray(user_ids)
        states = np.asarray(states)
        if not isinstance(version, str) or not version:
            raise ValueError(
                f"version must be a non-empty string naming the model the states come from, got {version!r}"
            )
        if user_ids.ndim != 1 or not np.issubdtype(user_ids.dtype, np.integer):
            raise ValueError(f"user_ids must be a 1-D integer array, got shape {user_ids.shape} dtype {user_ids.dtype}")
        if states.ndim != 2 or states.shape[0] != user_ids.shape[0]:
            raise ValueError(f"states must be [{user_ids.shape[0]}, d_model] (one per user), got {states.shape}")
        if not np.all(np.isfinite(states)):
            row = int(np.argwhere(~np.isfinite(states))[0, 0])
            raise ValueError(f"the state of user {int(user_ids[row])} is not finite")
        order = np.argsort(user_ids, kind="stable")
        ids = user_ids[order].astype(np.int64)
        dup = np.flatnonzero(ids[1:] == ids[:-1])
        if dup.size:
            raise ValueError(f"user id {int(ids[dup[0]])} appears more than once in user_ids")
        values = np.ascontiguousarray(states[order], np.float32)
        d = values.shape[1]
        schema = pa.schema(
            [("user_id", pa.int64()), ("state", pa.list_(pa.float32(), d))],
            metadata={"format": STATE_FORMAT, "version": version, "d_model": str(d)},
        )
        table = pa.table(
            [pa.array(ids), pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), d)], schema=schema
        )
        with atomic.replacing(path) as tmp, pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as w:
            w.write_table(table)
        return EncoderStateStore.open(path, version=version)

    @staticmethod
    def open(path, *, version: str | None = None) -> EncoderStateStore:
        """Opens a store (memory-mapped). `version`: refuse a store written for another model version."""
        import pyarrow as pa

        path = Path(path)
        try:
            mapped = pa.memory_map(str(path), "r")
            table = pa.ipc.open_file(mapped).read_all()
        except (OSError, pa.ArrowInvalid) as e:
            raise ValueError(f"{path}: not a readable encoder-state store ({e})") from e
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(
                f"{path}: not an encoder-state store (format {meta.get('format')!r}, want {STATE_FORMAT!r})"
            )
        if version is not None and meta.get("version") != version:
            raise ValueError(
                f"{path}: states of model version {meta.get('version')!r}, but version {version!r} was asked"
            )
        d = int(meta["d_model"])
        ids_col, state_col = table.column("user_id").combine_chunks(), table.column("state").combine_chunks()
        ids = ids_col.to_numpy(zero_copy_only=True) if ids_col.null_count == 0 else None
        if ids is None or state_col.null_count or state_col.type.list_size != d:
            raise ValueError(f"{path}: corrupt store (nulls, or a state size other than d_model={d})")
        states = state_col.values.to_numpy(zero_copy_only=True).reshape(len(ids), d)
        if ids.size > 1 and not np.all(ids[1:] > ids[:-1]):
            raise ValueError(f"{path}: corrupt store (user ids not sorted and unique)")
        return EncoderStateStore(path, ids, states, meta["version"], mapped)

    def lookup(self, user_ids) -> tuple[np.ndarray, np.ndarray]:
        """(states [N, d] float32, found [N] bool); rows of users not in the store are zeros."""
        q = np.asarray(user_ids, np.int64).reshape(-1)
        pos = np.minimum(np.searchsorted(self.user_ids, q), max(len(self) - 1, 0))
        found = (self.user_ids[pos] == q) if len(self) else np.zeros(q.shape, bool)
        states = np.where(found[:, None], self.states[pos], 0.0).astype(np.float32) if len(self) else None
        return (states if states is not None else np.zeros((q.shape[0], self.dim), np.float32)), found

    def get(self, user_ids) -> np.ndarray:
        """States [N, d]; KeyError naming the users the store does not have."""
        states, found = self.lookup(user_ids)
        if not found.all():
            missing = np.asarray(user_ids, np.int64).reshape(-1)[~found]
            raise KeyError(f"{self.path}: no encoder state for users {missing[:10].tolist()} ({missing.size} missing)")
        return states


@dataclasses.dataclass(frozen=True)
class StateSnapshot:
    """One published version, memory-mapped (arrays are views of the file)."""

    version: int
    model_version: str
    user_ids: np.ndarray
    states: np.ndarray
    state_time: np.ndarray
    ingest_time: np.ndarray
    events: np.ndarray
    digest: np.ndarray
    default_state: np.ndarray
    published_at_ms: int
    path: Path
    mapped: object = dataclasses.field(repr=False, default=None)

    @property
    def dim(self) -> int:
        return int(self.states.shape[1])

    def positions(self, user_ids) -> tuple[np.ndarray, np.ndarray]:
        """(row of each user, found mask); rows of users not found are 0."""
        q = np.asarray(user_ids, np.int64).reshape(-1)
        if len(self.user_ids) == 0:
            return np.zeros(q.shape, np.int64), np.zeros(q.shape, bool)
        pos = np.minimum(np.searchsorted(self.user_ids, q), len(self.user_ids) - 1)
        found = self.user_ids[pos] == q
        return np.where(found, pos, 0), found


def open_version(path) -> StateSnapshot:
    """A version file, memory-mapped; ValueError naming the file when it is not one."""
    import pyarrow as pa

    path = Path(path)
    try:
        mapped = pa.memory_map(str(path), "r")
        table = pa.ipc.open_file(mapped).read_all()
    except pa.ArrowInvalid as e:
        raise ValueError(f"{path}: not a readable state version ({e})") from e
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    if meta.get("format") != STATE_FORMAT or "publication" not in meta:
        raise ValueError(f"{path}: not a published state version (format {meta.get('format')!r})")
    d = int(meta["d_model"])

    def column(name):
        col = table.column(name).combine_chunks()
        if col.null_count:
            raise ValueError(f"{path}: corrupt state version (nulls in {name!r})")
        return col

    ids = column("user_id").to_numpy(zero_copy_only=True)
    state_col = column("state")
    if state_col.type.list_size != d:
        raise ValueError(f"{path}: corrupt state version (state size {state_col.type.list_size}, d_model {d})")
    states = state_col.values.to_numpy(zero_copy_only=True).reshape(len(ids), d)
    if ids.size > 1 and not np.all(ids[1:] > ids[:-1]):
        raise ValueError(f"{path}: corrupt state version (user ids not sorted and unique)")
    default = np.asarray(json.loads(meta["default_state"]), np.float32)
    if default.shape != (d,):
        raise ValueError(f"{path}: corrupt state version (default state of shape {default.shape}, d_model {d})")
    return StateSnapshot(
        version=int(meta["publication"]),
        model_version=meta["version"],
        user_ids=ids,
        states=states,
        state_time=column("state_time").to_numpy(zero_copy_only=True),
        ingest_time=column("ingest_time").to_numpy(zero_copy_only=True),
        events=column("events").to_numpy(zero_copy_only=True),
        digest=column("digest").to_numpy(zero_copy_only=True),
        default_state=default,
        published_at_ms=int(meta["published_at_ms"]),
        path=path,
        mapped=mapped,
    )


def read_pointer(root) -> dict | None:
    """The `CURRENT` pointer of a state directory (None before the first publication)."""
    path = Path(root) / POINTER
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: corrupt pointer ({e})") from None
    if doc.get("format") != POINTER_FORMAT or not _VERSION_FILE.match(str(doc.get("file", ""))):
        raise ValueError(f"{path}: not a state pointer (format {doc.get('format')!r}, file {doc.get('file')!r})")
    return doc


def open_current(root, retries: int = 5) -> StateSnapshot | None:
    """The version `CURRENT` names (None before the first publication). A version deleted between reading
    the pointer and opening it (the builder published `keep` more meanwhile) makes it read the pointer again."""
    root = Path(root)
    for attempt in range(retries):
        doc = read_pointer(root)
        if doc is None:
            return None
        try:
            return open_version(root / doc["file"])
        except FileNotFoundError:
            if attempt == retries - 1:
                raise
            time.sleep(0.01 * (attempt + 1))


class StatesNotReady(RuntimeError):
    """A reader expecting one model version's states has none of it to serve (nothing published, or only another
    model version's publications)."""


class StateReader:
    """The latest published states under `path` (a state directory; see the module doc).

    `lookup(user_ids)` -> (states float32 [B, d_model], found bool [B]): users without a published state get
    the default state (the encoder's state of an empty history). `state_time(user_ids)` is the event time
    (epoch ms) of the newest event each state includes (-1 without one). `reload_if_changed()` follows a
    new publication; `watch(interval_s)` does so in a daemon thread. Each call reads one snapshot (a single
    reference read), so a lookup never mixes two versions.

    ``model_version``: the model the states are for (a server's loaded model). A publication of another model
    version is refused (states of another model of the same width would give wrong answers, not errors): the
    previous one stays served, and ``on_refused(snapshot)`` is called once per refused publication. Such a reader
    may start with no matching publication (none, or another model's): it is not `ready` (lookups raise
    `StatesNotReady`) until a matching one is published."""

    def __init__(self, path, *, wait_s: float = 0.0, model_version: str | None = None, on_refused=None):
        self.path = Path(path)
        self.expected_model_version, self._on_refused = model_version, on_refused
        self.refused: StateSnapshot | None = None  # the last publication refused (another model version)
        self._reload_lock = threading.Lock()
        self._watcher = PeriodicTask(self.reload_if_changed, f"states-watch-{self.path}")
        self._pointer_key = None
        deadline = time.monotonic() + wait_s
        snap = self._accepted(self._read())
        while snap is None and time.monotonic() < deadline:
            time.sleep(0.05)
            snap = self._accepted(self._read())
        if snap is None and model_version is None:
            raise FileNotFoundError(f"{self.path}: no published states yet (no {POINTER}; run the state builder)")
        self._current: StateSnapshot | None = snap

    def _accepted(self, snap: StateSnapshot | None) -> StateSnapshot | None:
        """``snap`` when it is for the expected model version (or none is expected), else None (refused)."""
        if snap is None or self.expected_model_version is None or snap.model_version == self.expected_model_version:
            return snap
        if self.refused is None or self.refused.version != snap.version:
            self.refused = snap
            if self._on_refused is not None:
                self._on_refused(snap)
        return None

    @property
    def ready(self) -> bool:
        """Whether a publication (of the expected model version) is being served."""
        return self._current is not None

    @property
    def _snapshot(self) -> StateSnapshot:
        snap = self._current
        if snap is None:
            refused = self.refused
            why = (
                f"the only publication ({refused.version}) is of model version {refused.model_version!r}"
                if refused is not None
                else "nothing is published yet"
            )
            raise StatesNotReady(f"{self.path}: no states of model version {self.expected_model_version!r}: {why}")
        return snap

    def _key(self):
        try:
            st = os.stat(self.path / POINTER)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _read(self) -> StateSnapshot | None:
        key = self._key()
        snap = open_current(self.path)
        self._pointer_key = key
        return snap

    @property
    def snapshot(self) -> StateSnapshot:
        return self._snapshot

    @property
    def version(self) -> int:
        """The publication number (increases by one per publication)."""
        return self._snapshot.version

    @property
    def model_version(self) -> str:
        return self._snapshot.model_version

    @property
    def dim(self) -> int:
        return self._snapshot.dim

    @property
    def default_state(self) -> np.ndarray:
        return self._snapshot.default_state

    def __len__(self) -> int:
        return len(self._snapshot.user_ids)

    def lookup(self, user_ids) -> tuple[np.ndarray, np.ndarray]:
        snap = self._snapshot
        pos, found = snap.positions(user_ids)
        if len(snap.user_ids) == 0:
            return np.repeat(snap.default_state[None], len(pos), 0), found
        states = np.where(found[:, None], snap.states[pos], snap.default_state[None])
        return states.astype(np.float32, copy=False), found

    def state_time(self, user_ids) -> np.ndarray:
        snap = self._snapshot
        pos, found = snap.positions(user_ids)
        if len(snap.user_ids) == 0:
            return np.full(len(pos), -1, np.int64)
        return np.where(found, snap.state_time[pos], -1)

    def encoder_store(self):
        """The current version as an `EncoderStateStore` (for `OnlineQueryTower(..., store)`)."""
        s = self._snapshot
        return EncoderStateStore(s.path, s.user_ids, s.states, s.model_version, s.mapped)

    def reload_if_changed(self) -> bool:
        """Swaps in the version `CURRENT` names if it changed (and is of the expected model version); True if it
        did."""
        with self._reload_lock:
            if self._key() == self._pointer_key:
                return False
            snap = self._accepted(self._read())
            if snap is None or (self._current is not None and snap.version == self._current.version):
                return False
            self._current = snap
            return True

    def watch(self, interval_s: float) -> None:
        """Checks for a new publication every `interval_s` seconds in a daemon thread."""
        self._watcher.start(interval_s)

    def close(self) -> None:
        self._watcher.close()


# ------------------------------------------------------------------------------------------ change detection


def _string_hashes(dictionary: np.ndarray) -> np.ndarray:
    return np.array(
        [int.from_bytes(hashlib.blake2b(str(v).encode(), digest_size=8).digest(), "little") for v in dictionary],
        np.uint64,
    )


def segment_digest(seg) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(users, event counts, wrapping sum of event hashes) of one loaded file (a `query.Segment`)."""
    from jaxscale.sequences.eventid import splitmix64

    n = seg.rows
    h = np.full(n, 0x5EED, np.uint64)
    with np.errstate(over="ignore"):
        for name in sorted(seg.values):
            if name in _HASH_SKIP:
                continue
            h = splitmix64(h ^ np.ascontiguousarray(seg.values[name]).view(np.uint64))
        for name in sorted(seg.codes):
            h = splitmix64(h ^ _string_hashes(seg.dictionary[name])[seg.codes[name]])
    counts = np.diff(seg.starts).astype(np.int64)
    if n == 0:
        return seg.users.astype(np.int64), counts, np.zeros(0, np.uint64)
    sums = np.add.reduceat(h, seg.starts[:-1]) if len(seg.users) else np.zeros(0, np.uint64)
    return seg.users.astype(np.int64), counts, sums.astype(np.uint64)


class StoreFollower:
    """The per-user digest of a sequence's stored events, kept up to date by diffing the reader's files
    between refreshes (see the module doc). `poll()` -> (users touched, their current counts, hashes)."""

    def __init__(self, reader):
        self.reader = reader
        self._files: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def poll(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Refreshes the reader; the delta of every user whose stored events may have changed since the last
        poll: (users, count delta, hash delta), users unique and sorted."""
        self.reader.refresh()
        live = {s.signature: s for p in self.reader.partitions for s in p.segments}
        users, counts, hashes = [], [], []
        for key, seg in live.items():
            if key not in self._files:
                self._files[key] = segment_digest(seg)
                u, c, h = self._files[key]
                users.append(u), counts.append(c), hashes.append(h)
        for key in [k for k in self._files if k not in live]:
            u, c, h = self._files.pop(key)
            users.append(u), counts.append(-c), hashes.append(np.zeros_like(h) - h)
        if not users:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint64)
        users, counts, hashes = np.concatenate(users), np.concatenate(counts), np.concatenate(hashes)
        uniq, inv = np.unique(users, return_inverse=True)
        dc = np.zeros(len(uniq), np.int64)
        dh = np.zeros(len(uniq), np.uint64)
        np.add.at(dc, inv, counts)
        with np.errstate(over="ignore"):
            np.add.at(dh, inv, hashes)
        return uniq, dc, dh


class _Digests:
    """Sorted per-user (count, hash) arrays with vectorised upsert."""

    def __init__(self, ids=None, counts=None, hashes=None):
        self.ids = np.zeros(0, np.int64) if ids is None else np.asarray(ids, np.int64)
        self.counts = np.zeros(0, np.int64) if counts is None else np.asarray(counts, np.int64)
        self.hashes = np.zeros(0, np.uint64) if hashes is None else np.asarray(hashes, np.uint64)

    def get(self, users) -> tuple[np.ndarray, np.ndarray]:
        if len(self.ids) == 0:
            return np.zeros(len(users), np.int64), np.zeros(len(users), np.uint64)
        pos = np.minimum(np.searchsorted(self.ids, users), len(self.ids) - 1)
        found = self.ids[pos] == users
        return np.where(found, self.counts[pos], 0), np.where(found, self.hashes[pos], np.uint64(0))

    def add(self, users, dc, dh) -> None:
        c, h = self.get(users)
        with np.errstate(over="ignore"):
            c, h = c + dc, h + dh
        keep = ~np.isin(self.ids, users)
        ids = np.concatenate([self.ids[keep], users])
        order = np.argsort(ids, kind="stable")
        live = np.concatenate([self.counts[keep] > 0, c > 0])[order]
        self.ids = ids[order][live]
        self.counts = np.concatenate([self.counts[keep], c])[order][live]
        self.hashes = np.concatenate([self.hashes[keep], h])[order][live]


# ------------------------------------------------------------------------------------------ the model's parts


@dataclasses.dataclass(frozen=True)
class EncoderStateParts:
    """What the state builder needs from a model kind (its `ModelSpec.encoder_states` names them).

    histories: (store, sequence, defs, model config, *, vocabulary=None) -> the users' current histories, read
      through one `SequenceReader` of their own (`.reader`, refreshed by the builder; `.store`): `current(users)`
      -> (history batch [n, L] per key with a bool "mask", newest event time ms [n], newest ingest time ms [n]),
      `_padding()` -> one empty history row per key, `prune()` forgets files the reader dropped. `vocabulary`:
      the `item_id` vocabulary the model was trained with (`training_vocabulary`) when the followed store is
      another one (a stream numbers items in its own arrival order).
    encoder: (model, ec, emb_state) -> a callable of a history batch -> states [n, d_model] float32 whose rows
      are independent, exact whatever the training's capacity factor, counting its traces in `.traces`."""

    histories: Callable
    encoder: Callable


def state_parts(kind: str) -> EncoderStateParts:
    """The `EncoderStateParts` of a model kind; ValueError naming the kinds that have them otherwise."""
    import importlib.metadata

    from jaxscale.training import registry

    spec = registry.get(kind)
    if spec.encoder_states is None:
        have = [k for k in registry.kinds() if registry.get(k).encoder_states]
        raise ValueError(f"model kind {kind!r} has no encoder states to serve; the kinds that have them: {have}")
    return importlib.metadata.EntryPoint(kind, spec.encoder_states, registry.ENTRY_POINTS).load()


# ------------------------------------------------------------------------------------------ metrics


class StateMetrics:
    """The builder's Prometheus metrics, in their own registry (exported with --metrics-port)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        buckets = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 3600, 86400, float("inf"))
        self.staleness = Histogram(
            "jaxscale_states_staleness_seconds",
            "Per recomputed user: publication time minus the event time of the newest event in its state",
            registry=r,
            buckets=buckets,
        )
        self.ingest_lag = Histogram(
            "jaxscale_states_ingest_lag_seconds",
            "Per recomputed user: publication time minus the ingestion time of the newest event in its state",
            registry=r,
            buckets=buckets,
        )
        self.recomputed = Counter("jaxscale_states_users_recomputed", "Users whose state was recomputed", registry=r)
        self.removed = Counter("jaxscale_states_users_removed", "Users dropped: no stored event left", registry=r)
        self.publications = Counter("jaxscale_states_publications", "State versions published", registry=r)
        self.errors = Counter("jaxscale_states_errors", "Updates that failed (the last version stays)", registry=r)
        self.version = Gauge("jaxscale_states_version", "Publication number of the latest version", registry=r)
        self.users = Gauge("jaxscale_states_users", "Users with a state in the latest version", registry=r)
        self.publish_seconds = Gauge(
            "jaxscale_states_last_publish_seconds", "Seconds the last update took (detect, encode, publish)", registry=r
        )

    def serve(self, port: int, host: str = "127.0.0.1"):
        from prometheus_client import start_http_server

        return start_http_server(port, addr=host, registry=self.registry)


# ------------------------------------------------------------------------------------------ building


@dataclasses.dataclass(frozen=True)
class Update:
    """What one `StateBuilder.update()` did."""

    version: int | None
    """The publication number, None when nothing changed (no publication)."""
    recomputed: int
    removed: int
    seconds: float
    max_staleness_s: float | None = None


class StateBuilder:
    """Follows a sequence store and publishes the encoder states of its users (see the module doc).

    `histories`, `encoder`: made by the model kind's `EncoderStateParts` (`state_parts`). `batch_size` is the
    fixed micro-batch (a multiple of the encoder's mesh size)."""

    def __init__(
        self,
        out,
        histories,
        encoder,
        *,
        model_version: str,
        batch_size: int = DEFAULT_BATCH,
        keep: int = DEFAULT_KEEP,
        metrics: StateMetrics | None = None,
    ):
        if not isinstance(model_version, str) or not model_version:
            raise ValueError(f"model_version must be a non-empty string, got {model_version!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer (versions kept), got {keep!r}")
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"{self.out} is being published by another state builder") from None
        self.histories, self.encoder = histories, encoder
        self.model_version, self.batch_size, self.keep = model_version, batch_size, keep
        self.metrics = metrics or StateMetrics()
        self.follower = StoreFollower(histories.reader)
        self.stats = {"updates": 0, "publications": 0, "users_recomputed": 0, "users_removed": 0, "errors": 0}
        try:
            self.default_state = self._encode_default()
            self._load_published()
        except BaseException:
            self.close()
            raise

    # -- state

    def _load_published(self) -> None:
        snap = open_current(self.out)
        numbers = [int(m[1]) for f in os.listdir(self.out) if (m := _VERSION_FILE.match(f))]
        self.version = max([*numbers, snap.version if snap else 0])
        d = self.default_state.shape[0]
        if snap is not None and snap.model_version == self.model_version and snap.dim == d:
            self.ids = np.array(snap.user_ids)
            self.states = np.array(snap.states)
            self.state_time, self.ingest_time = np.array(snap.state_time), np.array(snap.ingest_time)
            self.published = _Digests(snap.user_ids, snap.events, snap.digest)
        else:  # nothing published by this model: every user is recomputed
            self.ids = np.zeros(0, np.int64)
            self.states = np.zeros((0, d), np.float32)
            self.state_time = self.ingest_time = np.zeros(0, np.int64)
            self.published = _Digests()
        self.current = _Digests()
        self._published_once = False
        self._pending = np.zeros(0, np.int64)

    def _encode_default(self) -> np.ndarray:
        empty = self.histories._padding()
        batch = {k: np.repeat(v[None], self.batch_size, 0) for k, v in empty.items()}
        state = np.asarray(self._encode(batch)[0], np.float32)
        if not np.all(np.isfinite(state)):
            raise ValueError("the encoder's state of an empty history is not finite: no default state to serve")
        return state

    def _encode(self, batch) -> np.ndarray:
        """Encodes one micro-batch, padded to `batch_size` rows (one shape: one compilation)."""
        n = batch["mask"].shape[0]
        if n < self.batch_size:
            pad = self.batch_size - n
            batch = {
                k: np.concatenate([v, np.full((pad,) + v.shape[1:], False if v.dtype == bool else -1, v.dtype)])
                for k, v in batch.items()
            }
        return np.asarray(self.encoder(batch))[:n]

    @property
    def encoder_traces(self) -> int | None:
        """How often the encoder was traced (compiled), when it counts (`.traces`)."""
        return getattr(self.encoder, "traces", None)

    # -- one update

    def update(self) -> Update:
        """Detects changed users, recomputes them and publishes a new version (none when nothing changed,
        except the first update, which always publishes so readers get the default state)."""
        t0 = time.perf_counter()
        self.stats["updates"] += 1
        users, dc, dh = self.follower.poll()
        self.current.add(users, dc, dh)
        # users touched by an update that failed stay pending until a publication includes them
        users = self._pending = np.union1d(self._pending, users)
        if not self._published_once:  # a restart: also users published but no longer stored
            gone = self.published.ids[~np.isin(self.published.ids, self.current.ids)]
            users = self._pending = np.union1d(users, gone)
        cur_c, cur_h = self.current.get(users)
        pub_c, pub_h = self.published.get(users)
        changed = (cur_c != pub_c) | (cur_h != pub_h)
        recompute = users[changed & (cur_c > 0)]
        remove = users[changed & (cur_c == 0)]
        if not len(recompute) and not len(remove) and self._published_once:
            self._pending = np.zeros(0, np.int64)
            return Update(None, 0, 0, time.perf_counter() - t0)
        self.histories.prune()
        states, newest, ingest = [], [], []
        for start in range(0, len(recompute), self.batch_size):
            part = recompute[start : start + self.batch_size]
            batch, t, it = self.histories.current(part)
            states.append(self._encode(batch))
            newest.append(t), ingest.append(it)
        d = self.default_state.shape[0]
        new_states = np.concatenate(states) if states else np.zeros((0, d), np.float32)
        new_time = np.concatenate(newest) if newest else np.zeros(0, np.int64)
        new_ingest = np.concatenate(ingest) if ingest else np.zeros(0, np.int64)
        merged = self._merged(recompute, remove, new_states, new_time, new_ingest)
        published = _Digests(self.published.ids, self.published.counts, self.published.hashes)
        zeros = np.zeros(len(remove), np.int64), np.zeros(len(remove), np.uint64)
        published.add(recompute, *_minus(*self.current.get(recompute), *published.get(recompute)))
        published.add(remove, *_minus(*zeros, *published.get(remove)))
        published_at = self._publish(merged, published)
        # only now, with the version on disk: a failed publication leaves the users pending
        self.ids, self.states, self.state_time, self.ingest_time = merged
        self.published = published
        self._published_once = True
        self._pending = np.zeros(0, np.int64)
        staleness = (published_at - new_time) / 1000.0
        for s in staleness:
            self.metrics.staleness.observe(max(float(s), 0.0))
        for s in (published_at - new_ingest) / 1000.0:
            self.metrics.ingest_lag.observe(max(float(s), 0.0))
        m = self.metrics
        m.recomputed.inc(len(recompute)), m.removed.inc(len(remove)), m.publications.inc()
        m.version.set(self.version), m.users.set(len(self.ids))
        seconds = time.perf_counter() - t0
        m.publish_seconds.set(seconds)
        self.stats["publications"] += 1
        self.stats["users_recomputed"] += len(recompute)
        self.stats["users_removed"] += len(remove)
        return Update(
            self.version,
            len(recompute),
            len(remove),
            seconds,
            float(staleness.max()) if len(staleness) else None,
        )

    def _merged(self, recompute, remove, new_states, new_time, new_ingest):
        """(ids, states, state_time, ingest_time) with `recompute` replaced and `remove` dropped (new arrays)."""
        drop = np.isin(self.ids, np.concatenate([recompute, remove]))
        ids = np.concatenate([self.ids[~drop], recompute])
        order = np.argsort(ids, kind="stable")
        return (
            ids[order],
            np.concatenate([self.states[~drop], new_states.astype(np.float32)])[order],
            np.concatenate([self.state_time[~drop], new_time])[order],
            np.concatenate([self.ingest_time[~drop], new_ingest])[order],
        )

    def _publish(self, merged, published: _Digests) -> int:
        """Writes the next version, then points CURRENT at it; returns its publication time (epoch ms)."""
        import pyarrow as pa

        ids, states, state_time, ingest_time = merged
        version = self.version + 1
        published_at = int(time.time() * 1000)
        d = states.shape[1]
        events, digest = published.get(ids)
        schema = pa.schema(
            [
                ("user_id", pa.int64()),
                ("state", pa.list_(pa.float32(), d)),
                ("state_time", pa.int64()),
                ("ingest_time", pa.int64()),
                ("events", pa.int64()),
                ("digest", pa.uint64()),
            ],
            metadata={
                "format": STATE_FORMAT,
                "version": self.model_version,
                "d_model": str(d),
                "publication": str(version),
                "published_at_ms": str(published_at),
                "default_state": json.dumps([float(x) for x in self.default_state]),
            },
        )
        flat = pa.array(np.ascontiguousarray(states, np.float32).reshape(-1))
        table = pa.table(
            [
                pa.array(ids),
                pa.FixedSizeListArray.from_arrays(flat, d),
                pa.array(state_time),
                pa.array(ingest_time),
                pa.array(events),
                pa.array(digest),
            ],
            schema=schema,
        )
        name = version_file(version)
        with atomic.replacing(self.out / name) as tmp, pa.OSFile(str(tmp), "wb") as sink:
            with pa.ipc.new_file(sink, schema) as w:
                w.write_table(table)
        pointer = {
            "format": POINTER_FORMAT,
            "version": version,
            "file": name,
            "published_at_ms": published_at,
            "model_version": self.model_version,
            "users": int(len(ids)),
        }
        atomic.write_json(self.out / POINTER, pointer)
        self.version = version
        self._collect_garbage()
        return published_at

    def _collect_garbage(self) -> None:
        """Deletes versions older than the newest `keep` (and temporary files of a killed builder)."""
        for f in os.listdir(self.out):
            m = _VERSION_FILE.match(f)
            if (m and int(m[1]) <= self.version - self.keep) or (f.startswith(".states-") and f.endswith(".tmp")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.out / f)

    # -- following

    def follow(self, interval_s: float, stop: threading.Event | None = None, on_update=None) -> None:
        """`update()` every `interval_s` seconds until `stop` is set; a failed update is logged and counted,
        the last version stays published, and the next tick retries."""
        stop = stop or threading.Event()
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                result = self.update()
                if on_update is not None:
                    on_update(result)
            except Exception:
                self.stats["errors"] += 1
                self.metrics.errors.inc()
                log.exception("state update from %s failed", self.histories.store)
            stop.wait(max(interval_s - (time.monotonic() - t0), 0.0))

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _minus(c, h, pc, ph):
    """(c - pc, h - ph) with wrapping hashes: the delta that turns a published digest into the current one."""
    with np.errstate(over="ignore"):
        return c - pc, h - ph


# ------------------------------------------------------------------------------------------ the CLI


def load_model(cfg, checkpoint, step: int | None = None):
    """(model, ec, emb_state, model version): the config's model restored from a run's checkpoint (the latest
    complete one unless `step`), on the config's mesh. The version is named as the retrieval artifact names it
    (`jaxscale.serving.retrieval.model_version`): ``<run dir name>/step-<step>``."""
    from flax import nnx

    from jaxscale.training.evaluate import find_checkpoints, restore
    from jaxscale.training.trainer import Trainer

    checkpoints = find_checkpoints(checkpoint)
    no_data = object()  # the trainer only restores here: it reads no data
    trainer = Trainer(cfg, workdir=str(checkpoints.parent), progress=False, log=False, data=no_data, eval_data=no_data)
    state, restored = restore(trainer, checkpoints, step)
    model = nnx.merge(trainer.graphdef, state["dense"], state["rest"])
    return model, trainer.ec, state["emb"], f"{checkpoints.parent.resolve().name}/step-{int(restored)}"


def training_vocabulary(store, training_store, sequence: str):
    """The `item_id` vocabulary of the store the model was trained on (`training_store`, the config's
    `data.sequences.store`), for a builder following `store`; None when they are one store or neither has one.
    Refuses to guess: a followed store with a vocabulary and no readable training store is an error."""
    from jaxscale.sequences.query import open_reader

    if Path(training_store).resolve() == Path(store).resolve():
        return None
    if Path(training_store).is_dir():
        return open_reader(training_store, sequence).vocabulary("item_id")
    if open_reader(store, sequence).vocabulary("item_id") is None:
        return None
    raise ValueError(
        f"the model's item ids are indices of its training store's 'item_id' vocabulary, and that store "
        f"({training_store}, data.sequences.store) does not exist here; pass --vocabulary-store (the followed "
        f"store {store} numbers items in its own order)"
    )


def build_from_config(
    cfg, checkpoint, store, out, *, step=None, batch_size=DEFAULT_BATCH, keep=DEFAULT_KEEP, vocabulary_store=None
):
    """The `states` command's builder: the model restored from `checkpoint`, following sequence
    `data.sequences.sequence` of `store` (definitions `data.sequences.defs`), item ids numbered by the training
    store's vocabulary (`vocabulary_store`, default `data.sequences.store`; see `training_vocabulary`)."""
    if cfg.data.source != "sequences":
        raise ValueError(
            f"the state builder follows a sequence store: data.source must be 'sequences', got {cfg.data.source!r}"
        )
    parts = state_parts(cfg.model.kind)
    model, ec, emb_state, version = load_model(cfg, checkpoint, step)
    if batch_size % ec.mesh.size:
        raise ValueError(f"--batch-size {batch_size} must be a multiple of the mesh's {ec.mesh.size} devices")
    s = cfg.data.sequences
    vocabulary = training_vocabulary(store, vocabulary_store or s.store, s.sequence)
    histories = parts.histories(store, s.sequence, s.defs, model.cfg, vocabulary=vocabulary)
    encoder = parts.encoder(model, ec, emb_state)
    return StateBuilder(out, histories, encoder, model_version=version, batch_size=batch_size, keep=keep)


def main(argv=None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="python -m jaxscale.serving states",
        description="Publish a model's encoder states of a sequence store's users, kept fresh.",
    )
    p.add_argument("--config", required=True, help="the run's YAML config (model, data.sequences)")
    p.add_argument("--checkpoint", required=True, help="run directory, or its checkpoints/ or best/ directory")
    p.add_argument("--store", required=True, help="the sequence store to follow (stream or backfill output)")
    p.add_argument("--out", required=True, help="the state directory to publish into")
    p.add_argument("--follow", action="store_true", help="keep following the store (default: one update)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between updates with --follow")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH, help="users per encoder call (fixed shape)")
    p.add_argument("--keep", type=int, default=DEFAULT_KEEP, help="versions kept on disk")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest complete one)")
    p.add_argument(
        "--vocabulary-store",
        default=None,
        help="the store whose item_id vocabulary the model was trained with (default: data.sequences.store)",
    )
    p.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")
    args = p.parse_intermixed_args(argv)
    from jaxscale.training.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        if args.interval <= 0:
            raise ValueError(f"--interval must be positive, got {args.interval}")
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():  # a fresh process: the config's simulated CPU devices
        from jaxscale.infra import distributed

        distributed.initialize(None, None, None, local_devices=cfg.mesh.nodes * cfg.mesh.local)
    try:
        builder = build_from_config(
            cfg, args.checkpoint, args.store, args.out, step=args.step, batch_size=args.batch_size, keep=args.keep,
            vocabulary_store=args.vocabulary_store,
        )  # fmt: skip
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.metrics_port is not None:
        builder.metrics.serve(args.metrics_port)

    def report(u: Update) -> None:
        if u.version is not None:
            doc = {"version": u.version, "recomputed": u.recomputed, "removed": u.removed}
            doc.update(seconds=round(u.seconds, 4), max_staleness_s=u.max_staleness_s)
            print(json.dumps(doc), flush=True)

    if not args.follow:
        report(builder.update())
        return 0
    import signal

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    builder.follow(args.interval, stop, on_update=report)
    return 0
