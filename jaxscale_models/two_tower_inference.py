"""Hybrid inference for the contextual two-tower model: the expensive, history-only half of the query tower
runs offline and is cached per user; a request runs only the context layer and head on the cached state.

    encoder = OfflineEncoder(model, ec, emb_state)                       # history -> encoder state
    store = build_state_store("states.arrow", encoder, requests, version="ckpt-1200")
    online = OnlineQueryTower.from_collection(model, ec, emb_state, store)
    queries = online.for_users(user_ids, context)                        # per request: context layer + head

`EndToEndQueryTower` is the forward the hybrid path replaces (lookups, encoder, context layer, head per
request); the online result equals it to float rounding as long as the user's history has not changed since
the store was built. `CorpusEncoder` computes every item's vector for exact full-corpus retrieval.

The store (`EncoderStateStore`) is one Arrow IPC file: column `user_id` (int64, sorted, unique) and column
`state` (fixed-size list of d_model float32), with the format name, the model version and d_model in the
schema metadata. It is written to a temporary file in the same folder, fsynced and renamed over the target
(a reader never sees a partial file), and read memory-mapped (opening costs no copy of the states).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.infra import atomic
from jaxscale.training.data import to_global
from jaxscale_models.contextual_two_tower import ContextualTwoTower, check_context, request_ids
from jaxscale_models.contextual_two_tower_data import CONTEXT_KEYS, HISTORY_KEYS

STORE_FORMAT = "jaxscale.two_tower.encoder_states/1"


# ------------------------------------------------------------------------------------------ the state store


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
            metadata={"format": STORE_FORMAT, "version": version, "d_model": str(d)},
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
        if meta.get("format") != STORE_FORMAT:
            raise ValueError(
                f"{path}: not an encoder-state store (format {meta.get('format')!r}, want {STORE_FORMAT!r})"
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


# ------------------------------------------------------------------------------------------ shared plumbing


def _eval_split(model: ContextualTwoTower):
    """(graphdef, state) of an eval-mode copy of `model` (no dropout, no estimator update)."""
    copy = nnx.clone(model)
    copy.eval()
    return nnx.split(copy)


def _padded(batch: Mapping, keys, multiple: int) -> tuple[dict, int]:
    """The batch's `keys`, rows padded to a multiple of `multiple` (padding rows: -1 ids, False mask)."""
    n = np.shape(batch[keys[0]])[0]
    pad = (-n) % multiple
    out = {}
    for k in keys:
        x = np.asarray(batch[k])
        if pad:
            fill = False if x.dtype == bool else (0 if np.issubdtype(x.dtype, np.floating) else -1)
            x = np.concatenate([x, np.full((pad,) + x.shape[1:], fill, x.dtype)])
        out[k] = x
    return out, n


def exact_collection(ec):
    """`ec`, or the same collection with exchanges sized for the worst case (`capacity_factor=None`) when it
    has a fixed capacity factor: a lookup past a fixed capacity drops ids, so a user's state (or an item's
    vector) would depend on who else is in its batch. The stored layout is the same (checked), so the trained
    tables are reused as they are."""
    if ec.settings.capacity_factor is None:
        return ec
    from jaxscale.engine.embedding.collection import EmbeddingCollection

    exact = EmbeddingCollection(ec.tables, ec.mesh, dataclasses.replace(ec.settings, capacity_factor=None), ec.plan)
    if exact.layout_signature() != ec.layout_signature():
        raise ValueError("the collection's layout changes without its capacity factor: cannot look up exactly")
    return exact


class _CollectionRunner:
    """A jitted function of (dense model, tables, ids, dense inputs) on the collection's mesh, fed from the
    host: ids checked on the host (`validate_ids`), rows padded to the mesh size. Inference never drops an id:
    the collection's exchanges are sized for the worst case of the batch shape (`exact_collection`), whatever
    capacity factor training used; one compilation per batch shape, never one per batch."""

    def __init__(self, model: ContextualTwoTower, ec, emb_state, fn):
        ec = exact_collection(ec)
        self.cfg, self.ec, self.emb_state = model.cfg, ec, emb_state
        graphdef, state = _eval_split(model)
        self._fn = jax.jit(
            lambda emb_state, ids, batch: fn(nnx.merge(graphdef, state), ec.lookup(emb_state, ids), batch)
        )

    def run(self, ids: Mapping, dense: Mapping, n: int) -> np.ndarray:
        ids = to_global(self.ec.validate_ids(ids), self.ec.mesh)
        out = self._fn(self.emb_state, ids, to_global(dense, self.ec.mesh))
        return np.asarray(out)[:n]


# ------------------------------------------------------------------------------------------ offline


class OfflineEncoder:
    """History -> encoder state [B, d_model] (lookups through the sharded tables, then the encoder): the
    offline half of the query tower."""

    def __init__(self, model: ContextualTwoTower, ec, emb_state):
        self._runner = _CollectionRunner(model, ec, emb_state, lambda m, emb, batch: m.user_state(emb, batch))
        self.cfg, self.ec = model.cfg, ec

    def __call__(self, batch: Mapping) -> np.ndarray:
        dense, n = _padded(batch, HISTORY_KEYS, self.ec.mesh.size)
        return self._runner.run(request_ids(self.cfg, dense, context=False), dense, n)


def build_state_store(
    path, encoder: OfflineEncoder, requests: Iterable[tuple[np.ndarray, Mapping]], *, version: str
) -> EncoderStateStore:
    """The offline step: encodes every (user ids [B], history batch) of `requests` and writes the store
    atomically. A user listed twice is an error (which history is current would be ambiguous)."""
    ids, states = [], []
    for user_ids, batch in requests:
        ids.append(np.asarray(user_ids, np.int64).reshape(-1))
        states.append(encoder(batch))
        if states[-1].shape[0] != ids[-1].shape[0]:
            raise ValueError(f"{ids[-1].shape[0]} user ids for a batch of {states[-1].shape[0]} histories")
    if not ids:
        raise ValueError("build_state_store: no requests to encode")
    return EncoderStateStore.write(path, np.concatenate(ids), np.concatenate(states), version=version)


# ------------------------------------------------------------------------------------------ online


class OnlineQueryTower:
    """The online step: (cached encoder state, request context) -> query [B, E], running only the context
    layer and head. The subject category's embedding comes from a dense copy of the (small) category table.
    Jitted once per batch size; the head's weights are compiled in as constants."""

    def __init__(self, model: ContextualTwoTower, category_table, store: EncoderStateStore | None = None):
        cfg = model.cfg
        table = jnp.asarray(np.asarray(category_table, np.float32))
        if table.shape != (cfg.num_categories, cfg.item_dim):
            raise ValueError(f"category_table must be [{cfg.num_categories}, {cfg.item_dim}], got {table.shape}")
        if store is not None and store.dim != cfg.d_model:
            raise ValueError(f"{store.path}: states have {store.dim} dims, the model's encoder {cfg.d_model}")
        self.cfg, self.store = cfg, store
        head = nnx.clone(model.query_head)
        head.eval()
        graphdef, state = nnx.split(head)

        def query(states, category, confidence, surface, hour):
            known = category >= 0
            category_emb = jnp.where(known[:, None], table[jnp.maximum(category, 0)], 0.0)
            context = dict(
                context_category=category, context_confidence=confidence, context_surface=surface, context_hour=hour
            )
            return nnx.merge(graphdef, state)(states, category_emb, context)

        self._fn = jax.jit(query)

    @classmethod
    def from_collection(cls, model: ContextualTwoTower, ec, emb_state, store=None) -> OnlineQueryTower:
        return cls(model, ec.to_dense(emb_state)["categories"], store)

    def __call__(self, states, context: Mapping) -> np.ndarray:
        """states [B, d_model] (cached), context: the CONTEXT_KEYS arrays [B] -> queries [B, E]."""
        states = np.asarray(states, np.float32)
        if states.ndim != 2 or states.shape[1] != self.cfg.d_model:
            raise ValueError(f"states must be [batch, {self.cfg.d_model}], got {states.shape}")
        n = states.shape[0]
        if self.cfg.use_context:
            check_context(self.cfg, context, n)
            cat = np.asarray(context["context_category"])
            if cat.size and cat.max() >= self.cfg.num_categories:
                raise ValueError(
                    f"context feature 'context_category' has value {int(cat.max())}; expected -1 (missing) or "
                    f"0..{self.cfg.num_categories - 1}"
                )
            args = [np.asarray(context[k]) for k in CONTEXT_KEYS]
        else:
            args = [np.full((n,), -1, np.int32), np.zeros((n,), np.float32)] + [np.full((n,), -1, np.int32)] * 2
        category, confidence, surface, hour = args
        out = self._fn(
            states,
            category.astype(np.int32),
            confidence.astype(np.float32),
            surface.astype(np.int32),
            hour.astype(np.int32),
        )
        return np.asarray(out)

    def for_users(self, user_ids, context: Mapping) -> np.ndarray:
        """Queries for users of the store (KeyError naming users it does not have)."""
        if self.store is None:
            raise ValueError("OnlineQueryTower has no store: pass one, or call it with the states")
        return self(self.store.get(user_ids), context)


class EndToEndQueryTower:
    """The forward hybrid inference replaces: per request, the history's lookups through the sharded tables,
    the encoder, the context layer and the head."""

    def __init__(self, model: ContextualTwoTower, ec, emb_state):
        self.cfg, self.ec = model.cfg, ec
        self._runner = _CollectionRunner(model, ec, emb_state, lambda m, emb, batch: m.query(emb, batch)[1])

    def __call__(self, batch: Mapping) -> np.ndarray:
        keys = HISTORY_KEYS + (CONTEXT_KEYS if self.cfg.use_context else ())
        dense, n = _padded(batch, keys, self.ec.mesh.size)
        return self._runner.run(request_ids(self.cfg, dense), dense, n)


class CorpusEncoder:
    """Every item's vector [item_rows, E] (item tower over the id and category tables), for exact
    full-corpus retrieval."""

    def __init__(self, model: ContextualTwoTower, ec, emb_state, *, rows_per_call: int = 8192):
        self.cfg, self.ec, self.rows = model.cfg, ec, max(1, rows_per_call)
        graphdef, state = _eval_split(model)

        def fn(emb_state, ids):
            emb = ec.lookup(emb_state, ids)
            return nnx.merge(graphdef, state).item_vectors(emb["label_item"][:, 0], emb["label_category"][:, 0])

        self._fn = jax.jit(fn)
        self.emb_state = emb_state

    def __call__(self, item_categories) -> np.ndarray:
        """item_categories [item_rows]: the category of every item id (item metadata)."""
        cats = np.asarray(item_categories)
        if cats.shape != (self.cfg.item_rows,):
            raise ValueError(f"item_categories must be [{self.cfg.item_rows}] (one per item id), got {cats.shape}")
        ids = np.arange(self.cfg.item_rows, dtype=np.int32)
        chunk = -(-min(self.rows, ids.size) // self.ec.mesh.size) * self.ec.mesh.size
        out = []
        for start in range(0, ids.size, chunk):
            part, n = _padded(
                {"label_item": ids[start : start + chunk, None], "label_category": cats[start : start + chunk, None]},
                ("label_item", "label_category"),
                chunk,
            )
            lookup_ids = to_global(self.ec.validate_ids(part), self.ec.mesh)
            out.append(np.asarray(self._fn(self.emb_state, lookup_ids))[:n])
        return np.concatenate(out)
