"""What serving retrieval needs from a trained contextual two-tower (`jaxscale.serving.retrieval`): the item
tower's vector of every item (for the ANN index), the online query step as a function over a feature dict
(for `jax.export`), and real query vectors of held-out requests (for the index's recall check).

The online step is `OnlineQueryTower`'s computation (context layer + head over the cached encoder state), written
over the serving features

    encoder_state       float32 [batch, d_model]   filled by the leaf from the state store, by user_id
    context_category    int32   [batch]            -1 = missing
    context_confidence  float32 [batch]
    context_surface     int32   [batch]            -1 = missing
    context_hour        int32   [batch]            -1 = missing

(a model without a context layer reads `encoder_state` only). The head's weights and the category table are
compiled in as constants. A category id outside [0, num_categories) is read as missing: an exported module
cannot refuse a request, and a clamped gather would silently read another category's row.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.serving.retrieval import STATE_FEATURE, RetrievalParts
from jaxscale.serving.signature import FeatureSpec
from jaxscale_models.contextual_two_tower import ContextualTwoTower
from jaxscale_models.contextual_two_tower_data import CONTEXT_KEYS
from jaxscale_models.two_tower_inference import CorpusEncoder, EndToEndQueryTower

CONTEXT_DTYPES = {
    "context_category": "int32",
    "context_confidence": "float32",
    "context_surface": "int32",
    "context_hour": "int32",
}


def query_features(model: ContextualTwoTower) -> tuple[FeatureSpec, ...]:
    """Exactly the features the online step reads."""
    cfg = model.cfg
    state = FeatureSpec(STATE_FEATURE, "float32", (cfg.d_model,))
    if not cfg.use_context:
        return (state,)
    return (state, *(FeatureSpec(k, CONTEXT_DTYPES[k]) for k in CONTEXT_KEYS))


def query_step(model: ContextualTwoTower, category_table):
    """features -> {"query": float32 [batch, embed_dim]} (L2-normalised), the online half of the query tower."""
    cfg = model.cfg
    table = np.asarray(category_table, np.float32)[: cfg.num_categories]  # the 'missing' row is not a subject
    if table.shape != (cfg.num_categories, cfg.item_dim):
        raise ValueError(f"category_table must have [{cfg.num_categories}, {cfg.item_dim}] rows, got {table.shape}")
    head = nnx.clone(model.query_head)
    head.eval()
    graphdef, state = nnx.split(head)

    def step(features: Mapping):
        states = features[STATE_FEATURE]
        if not cfg.use_context:
            return {"query": nnx.merge(graphdef, state)(states, None, {})}
        category = features["context_category"]
        known = (category >= 0) & (category < cfg.num_categories)
        category_emb = jnp.where(known[:, None], jnp.asarray(table)[jnp.where(known, category, 0)], 0.0)
        context = {k: features[k] for k in CONTEXT_KEYS}
        context["context_category"] = jnp.where(known, category, -1)
        return {"query": nnx.merge(graphdef, state)(states, category_emb, context)}

    return step


def sample_queries(model: ContextualTwoTower, ec, emb_state, source, count: int) -> np.ndarray:
    """Query vectors of up to `count` held-out requests of `source` (the end-to-end query tower, with each
    request's own context): what the index is asked at serving time, for its recall check."""
    tower = EndToEndQueryTower(model, ec, emb_state)
    out, step, have = [], 0, 0
    while have < count:
        batch = source.batch(step)
        q = tower(batch)
        if "label_item" in batch:  # rows without a request (padding) carry no label
            q = q[np.asarray(batch["label_item"]) >= 0]
        out.append(q)
        have += q.shape[0]
        step += 1
        if step > 10_000:
            raise ValueError("the held-out source gave no query")
    return np.concatenate(out)[:count]


def retrieval_parts(trainer, state, source, *, queries: int = 1000, decode=None) -> RetrievalParts:
    """The parts of a restored two-tower (`trainer` and its `state`) that serving needs (the function the entry
    point group `jaxscale.retrieval` names for `contextual_two_tower`). `source`: a held-out data source with
    the corpus metadata (`item_category`, every item's category) and requests (for `queries` sample queries;
    0 = none). `decode`: item row -> served item id (a store's vocabulary); default the row. Rows below
    `reserved_rows` (padding, out-of-vocabulary) are not indexed."""
    model = nnx.merge(trainer.graphdef, state["dense"], state["rest"])
    cfg = model.cfg
    categories = getattr(source, "item_category", None)
    if categories is None:  # a synthetic generator bound to a process
        categories = getattr(getattr(source, "source", None), "item_category", None)
    if categories is None:
        raise ValueError(
            "the data source knows no item categories (item_category): the corpus cannot be encoded; use the "
            "held-out split of a synthetic or sequence-store source"
        )
    ec, emb_state = trainer.ec, state["emb"]
    vectors = CorpusEncoder(model, ec, emb_state)(np.asarray(categories))
    rows = np.arange(cfg.reserved_rows, cfg.item_rows, dtype=np.int64)
    item_ids = np.asarray(decode(rows) if decode is not None else rows, np.int64)
    category_table = ec.to_dense(emb_state)["categories"]
    return RetrievalParts(
        item_ids=item_ids,
        item_vectors=vectors[rows],
        query_fn=query_step(model, category_table),
        features=query_features(model),
        queries=sample_queries(model, ec, emb_state, source, queries) if queries else None,
        query_source="held-out requests through the end-to-end query tower" if queries else None,
    )
