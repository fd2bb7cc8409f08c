"""Hybrid inference for the contextual two-tower model: the expensive, history-only half of the query tower
runs offline and is cached per user; a request runs only the context layer and head on the cached state.

    encoder = OfflineEncoder(model, ec, emb_state)                       # history -> encoder state
    store = build_state_store("states.arrow", encoder, requests, version="ckpt-1200")
    online = OnlineQueryTower.from_collection(model, ec, emb_state, store)
    queries = online.for_users(user_ids, context)                        # per request: context layer + head

`EndToEndQueryTower` is the forward the hybrid path replaces (lookups, encoder, context layer, head per
request); the online result equals it to float rounding as long as the user's history has not changed since
the store was built. `CorpusEncoder` computes every item's vector for exact full-corpus retrieval.

The store is the library's `jaxscale.serving.states.EncoderStateStore` (one Arrow IPC file of user ids and
states, written atomically, read memory-mapped); `ENCODER_STATES` is what its state builder needs of this model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.serving.states import EncoderStateParts, EncoderStateStore
from jaxscale.training.data import to_global
from jaxscale_models.contextual_two_tower import ContextualTwoTower, check_context, request_ids
from jaxscale_models.contextual_two_tower_data import CONTEXT_KEYS, HISTORY_KEYS
from jaxscale_models.contextual_two_tower_sequences import history_source

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
    offline half of the query tower. `traces` counts its compilations (a state builder's fixed micro-batch
    shape keeps it at 1)."""

    def __init__(self, model: ContextualTwoTower, ec, emb_state):
        self.cfg, self.ec, self.traces = model.cfg, ec, 0

        def encode(m, emb, batch):
            self.traces += 1
            return m.user_state(emb, batch)

        self._runner = _CollectionRunner(model, ec, emb_state, encode)

    def __call__(self, batch: Mapping) -> np.ndarray:
        dense, n = _padded(batch, HISTORY_KEYS, self.ec.mesh.size)
        return self._runner.run(request_ids(self.cfg, dense, context=False), dense, n)


ENCODER_STATES = EncoderStateParts(histories=history_source, encoder=OfflineEncoder)
"""What `python -m jaxscale.serving states` needs of this model (`ModelSpec.encoder_states` names it)."""


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
