"""Contextual sequential two-tower retrieval: the foundation encoder over a user's history plus the request's
context in the query tower, item id + category in the item tower, trained with a logQ-corrected in-batch
softmax and evaluated by exact full-corpus top-K.

Query tower:  history (items + categories through the sharded tables, actions, surfaces, time gaps)
              -> the foundation model's causal `SequenceEncoder` -> its state at the last valid event
              -> [context layer: subject category embedding x confidence, surface, hour of day]
              -> MLP head -> L2-normalised query [E].
Item tower:   item id embedding ++ category embedding (same sharded tables) -> LayerNorm -> MLP
              -> L2-normalised item vector [E].

The two halves of the query tower are separable on purpose (hybrid inference, `two_tower_inference`): the
encoder state depends on the history only, so it is computed offline and cached per user; the context
layer and head are all that runs per request.

Training (`two_tower_loss`): each example's candidates are the batch's positive items (in-batch softmax).
  * logQ correction (Yi et al. 2019, "Sampling-bias-corrected neural modeling for large corpus item
    recommendations"): in-batch negatives are sampled by popularity, so each candidate's logit is lowered
    by log p(candidate), p estimated by a streaming frequency estimator (`StreamingFrequencyEstimator`:
    per hash bucket, the step it was last seen and a moving average of the gap in steps between sightings;
    p = 1 / gap). Its arrays are model state (nnx variables, not parameters): updated in training mode,
    read in eval mode, checkpointed with the model.
  * accidental hits (tensorflow-recommenders' `remove_accidental_hits`): a candidate that is the same item
    as the row's positive (another row engaged with it too) is not a negative; it is masked out.
  * pseudo-context: training examples carry a context derived from the positive label (its category, with
    noise; see `contextual_two_tower_data.derive_pseudo_context`), and the context is dropped with a high
    probability `context_dropout` (0.5) so the model also serves requests without context: a dropped context
    looks exactly like a missing one. `context_dropout_mode='sample'` draws a mask per example (dropout);
    'marginal' (default) takes its exact expectation: each example's loss is (1 - p) * loss(with its
    context) + p * loss(context missing), so the missing-context mode learns from every example.

Evaluation: exact full-corpus retrieval: every item's vector, scores = queries @ items.T, top-K over all
items and Recall@10/50/100 (`full_corpus_recall`, by `jaxscale.training.ranking`). In the trainer the eval
batches carry the corpus ids (`corpus_items`), the eval step returns the query vectors and the corpus item
vectors, and `summarize` ranks the whole corpus.

Batch keys: see `jaxscale_models.contextual_two_tower_data`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.engine.tables import TableConfig
from jaxscale.training import ranking
from jaxscale.training.config import check_choice, check_float, check_int, field_error
from jaxscale.training.registry import ModelSpec
from jaxscale_models.contextual_two_tower_data import CONTEXT_KEYS, CORPUS_KEYS, HISTORY_KEYS, LABEL_KEYS
from jaxscale_models.foundation import (
    DTYPES,
    TIME_ENCODINGS,
    FoundationConfig,
    SequenceEncoder,
    hash_ids,
)

HOURS = 24
CONTEXT_DROPOUT_MODES = ("sample", "marginal")
NEG_INF = -1e9  # masked logits: finite, so a fully masked (ignored) row stays finite in value and gradient


# Engine features (the batch's id columns as the tables see them).
ITEM_FEATURES = ("item_ids", "label_item", "corpus_items")
CATEGORY_FEATURES = ("item_categories", "label_category", "context_category", "corpus_categories")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextualTwoTowerConfig:
    """Shape of the contextual two-tower model. Defaults are the CPU smoke size."""

    item_rows: int = 20_000
    """The corpus: item ids are in [0, item_rows); rows of the sharded item table."""
    num_categories: int = 200
    """Categories: ids in [0, num_categories); rows of the sharded category table (+1 with `missing_category`)."""
    missing_category: bool = False
    """Reserve one more category row, index `num_categories`, as the learned 'missing' bucket: a sequence
    store's category -1 (an enrichment's default for an item missing from its table) is read as that index
    by `jaxscale_models.contextual_two_tower_sequences` instead of being refused. -1 in a batch stays padding."""
    item_dim: int = 32
    """Embedding dim of the item and category tables."""
    num_actions: int = 4
    num_surfaces: int = 4
    """Surfaces of history events and of requests."""
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: int = 4
    max_seq_len: int = 32
    dropout: float = 0.0
    """Dropout inside the encoder."""
    time_encoding: Literal["log_bucket", "sinusoidal", "none"] = "log_bucket"
    time_buckets: int = 32
    time_max_seconds: float = 3.0e7
    use_context: bool = True
    """False: the same model without the context layer (the head sees the encoder state only)."""
    context_dim: int = 32
    context_dropout: float = 0.5
    """Training only: probability that an example's whole context is replaced by 'missing'."""
    context_dropout_mode: Literal["sample", "marginal"] = "marginal"
    """'sample': a Bernoulli(context_dropout) mask per example (dropout). 'marginal': its exact expectation,
    without sampling: every example's loss is (1 - p) * loss(with context) + p * loss(context missing), so
    the missing-context mode learns from every example (the head runs twice; the encoder once)."""
    head_hidden: tuple[int, ...] = (128,)
    """Hidden sizes of the query head MLP."""
    item_hidden: tuple[int, ...] = (128,)
    """Hidden sizes of the item tower MLP."""
    item_category_feature: bool = True
    """The item tower reads the item's category embedding besides its id embedding."""
    embed_dim: int = 32
    """Dim of the query and item vectors (the retrieval space)."""
    temperature: float = 0.05
    """Softmax temperature on cosine similarities."""
    logq_correction: bool = True
    logq_buckets: int | None = None
    """Hash buckets of the frequency estimator; None = item_rows (one bucket per item, no collisions)."""
    logq_alpha: float = 0.05
    """Moving-average rate of the estimator's gap estimate."""
    remove_accidental_hits: bool = True
    recall_ks: tuple[int, ...] = (10, 50, 100)
    """The K of the full-corpus Recall@K computed at evaluation."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Activation dtype of the encoder; heads, softmax and losses stay float32."""
    reserved_rows: int = 0
    """Item rows [0, reserved_rows) are never candidates in full-corpus ranking: a sequence store's vocabulary
    reserves 0 (padding) and 1 (out of vocabulary), so set 2 when the store has one."""
    eval_context: Literal["missing", "label"] = "missing"
    """`data.source: sequences`, held-out splits: the request's subject category is missing, or the label's own
    category with confidence 1 (the genre of the item being viewed: the pseudo-context of training, taken from
    the positive label, given at serving time by the page the user is on)."""
    category_field: str = "category"
    """`data.source: sequences`: the sequence field (int64, in [0, num_categories)) that gives the categories
    of history events, labels and the corpus (`jaxscale_models.contextual_two_tower_sequences`). A model
    setting, like num_categories: which store field feeds the category table."""

    def __post_init__(self):
        o = "ContextualTwoTowerConfig"
        for f in (
            "item_rows",
            "num_categories",
            "item_dim",
            "num_actions",
            "num_surfaces",
            "d_model",
            "num_layers",
            "num_heads",
            "mlp_ratio",
            "time_buckets",
            "context_dim",
            "embed_dim",
        ):
            check_int(o, self, f, 1)
        check_int(o, self, "max_seq_len", 2)
        check_int(o, self, "reserved_rows", 0)
        if self.reserved_rows >= self.item_rows:
            raise field_error(o, "reserved_rows", f"must be < item_rows={self.item_rows}, got {self.reserved_rows}")
        check_choice(o, self, "eval_context", ("missing", "label"))
        for f in ("item_rows", "num_categories"):
            if getattr(self, f) > 2**31 - 1:
                raise field_error(o, f, f"must fit int32, got {getattr(self, f)}")
        if self.logq_buckets is not None:
            check_int(o, self, "logq_buckets", 1)
        check_choice(o, self, "time_encoding", TIME_ENCODINGS)
        check_choice(o, self, "context_dropout_mode", CONTEXT_DROPOUT_MODES)
        check_choice(o, self, "dtype", DTYPES)
        if not isinstance(self.category_field, str) or not self.category_field:
            raise field_error(o, "category_field", f"must be a field name, got {self.category_field!r}")
        for f in (
            "use_context",
            "logq_correction",
            "remove_accidental_hits",
            "item_category_feature",
            "missing_category",
        ):
            if not isinstance(getattr(self, f), bool):
                raise field_error(o, f, f"must be a bool, got {getattr(self, f)!r}")
        if self.d_model % self.num_heads:
            raise field_error(o, "num_heads", f"must divide d_model={self.d_model}, got {self.num_heads}")
        if self.time_encoding == "sinusoidal" and self.d_model % 2:
            raise field_error(o, "d_model", f"must be even for sinusoidal time encoding, got {self.d_model}")
        for f in ("dropout", "context_dropout"):
            check_float(o, self, f, 0.0, 1.0)
            if getattr(self, f) >= 1.0:
                raise field_error(o, f, f"must be < 1, got {getattr(self, f)}")
        check_float(o, self, "time_max_seconds", 1.0)
        check_float(o, self, "temperature", 0.0, low_open=True)
        check_float(o, self, "logq_alpha", 0.0, 1.0, low_open=True)
        for f in ("head_hidden", "item_hidden", "recall_ks"):
            value = getattr(self, f)
            ok = isinstance(value, (tuple, list)) and all(
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1 for v in value
            )
            if not ok or (f == "recall_ks" and not value):
                raise field_error(o, f, f"must be a list of positive integers, got {value!r}")
            object.__setattr__(self, f, tuple(int(v) for v in value))

    @property
    def category_rows(self) -> int:
        """Rows of the category table: num_categories, plus the 'missing' bucket with `missing_category`."""
        return self.num_categories + int(self.missing_category)

    @property
    def missing_category_index(self) -> int | None:
        """The category id of the 'missing' bucket (None without `missing_category`)."""
        return self.num_categories if self.missing_category else None

    @property
    def estimator_buckets(self) -> int:
        return self.logq_buckets if self.logq_buckets is not None else self.item_rows

    def encoder_config(self) -> FoundationConfig:
        """The foundation config of the query tower's encoder (one item input of dim item_dim)."""
        return FoundationConfig(
            item_rows=self.item_rows,
            item_dim=self.item_dim,
            num_actions=self.num_actions,
            num_surfaces=self.num_surfaces,
            d_model=self.d_model,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            mlp_ratio=self.mlp_ratio,
            max_seq_len=self.max_seq_len,
            dropout=self.dropout,
            time_encoding=self.time_encoding,
            time_buckets=self.time_buckets,
            time_max_seconds=self.time_max_seconds,
            dtype=self.dtype,
        )

    @classmethod
    def smoke(cls, **overrides) -> ContextualTwoTowerConfig:
        return cls(**overrides)


# ------------------------------------------------------------------------------------------ tables and ids


def two_tower_tables(cfg: ContextualTwoTowerConfig) -> list[TableConfig]:
    """Two sharded sequence tables: items (history, labels, corpus) and categories (history, labels, the
    request's subject, corpus)."""
    return [
        TableConfig("items", rows=cfg.item_rows, dim=cfg.item_dim, pooling=None, features=ITEM_FEATURES),
        TableConfig("categories", rows=cfg.category_rows, dim=cfg.item_dim, pooling=None, features=CATEGORY_FEATURES),
    ]


def _require(batch: Mapping, keys, why: str) -> None:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing} ({why}); it has {sorted(batch)}")


def check_context(cfg: ContextualTwoTowerConfig, batch: Mapping, n: int) -> None:
    """Host check of the request context of `n` requests: shapes [n], surface in [-1, num_surfaces), hour in [-1, 24),
    confidence finite in [0, 1]. ValueError naming the feature otherwise (category ids are checked by the
    embedding engine, against the category table)."""
    _require(batch, CONTEXT_KEYS, "the request context; -1 / 0.0 mark a missing feature")
    for k in CONTEXT_KEYS:
        shape = np.shape(batch[k])
        if shape != (n,):
            raise ValueError(f"context feature {k!r} must have shape [{n}] (one value per request), got {shape}")
    for k, hi in (("context_surface", cfg.num_surfaces), ("context_hour", HOURS), ("context_category", None)):
        x = np.asarray(batch[k])
        if not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"context feature {k!r} must be integer ids (-1 = missing), got dtype {x.dtype}")
        if hi is not None and x.size and (x.min() < -1 or x.max() >= hi):
            bad = x[(x < -1) | (x >= hi)][0]
            raise ValueError(f"context feature {k!r} has value {bad}; expected -1 (missing) or 0..{hi - 1}")
    conf = np.asarray(batch["context_confidence"])
    if not np.issubdtype(conf.dtype, np.floating):
        raise ValueError(f"context feature 'context_confidence' must be float in [0, 1], got dtype {conf.dtype}")
    if conf.size and not (np.all(np.isfinite(conf)) and conf.min() >= 0.0 and conf.max() <= 1.0):
        bad = conf[~(np.isfinite(conf) & (conf >= 0) & (conf <= 1))][0]
        raise ValueError(f"context feature 'context_confidence' has value {bad}; expected a number in [0, 1]")


def request_ids(cfg: ContextualTwoTowerConfig, batch: Mapping, *, context: bool | None = None) -> dict:
    """The query tower's engine ids from a host batch (NumPy): the history's item ids and categories and,
    with `context` (default: the model has a context layer), the request's subject category ([B, 1]); the
    context features are then checked too."""
    _require(batch, HISTORY_KEYS, "the user's history")
    for k in ("item_ids", "item_categories"):
        if np.ndim(batch[k]) != 2:
            raise ValueError(f"{k!r} must be [batch, seq_len], got shape {np.shape(batch[k])}")
    if np.shape(batch["item_ids"]) != np.shape(batch["item_categories"]):
        raise ValueError(
            f"'item_categories' has shape {np.shape(batch['item_categories'])}, "
            f"but 'item_ids' has {np.shape(batch['item_ids'])}"
        )
    if np.shape(batch["item_ids"])[1] > cfg.max_seq_len:
        raise ValueError(f"'item_ids' has {np.shape(batch['item_ids'])[1]} events; max_seq_len is {cfg.max_seq_len}")
    ids = {"item_ids": batch["item_ids"], "item_categories": batch["item_categories"]}
    if cfg.use_context if context is None else context:
        check_context(cfg, batch, np.shape(batch["item_ids"])[0])
        ids["context_category"] = np.asarray(batch["context_category"])[:, None]
    return {k: _as_int32(k, v) for k, v in ids.items()}


def two_tower_ids(cfg: ContextualTwoTowerConfig, batch: Mapping) -> dict:
    """The engine's input from a host batch: {feature: int32 [B, L]} (NumPy): `request_ids`, the label's id
    and category ([B, 1]), and the corpus when the batch carries it (eval)."""
    ids = request_ids(cfg, batch)
    _require(batch, LABEL_KEYS, "the positive item and its category; -1 = no label")
    n = np.shape(batch["item_ids"])[0]
    for k in LABEL_KEYS:
        if np.shape(batch[k]) != (n,):
            raise ValueError(f"{k!r} must have shape [{n}] (one label per example), got {np.shape(batch[k])}")
        ids[k] = _as_int32(k, np.asarray(batch[k])[:, None])
    if "corpus_items" in batch:
        _require(batch, CORPUS_KEYS, "the corpus layout of an eval batch")
        ids["corpus_items"] = _as_int32("corpus_items", batch["corpus_items"])
        ids["corpus_categories"] = _as_int32("corpus_categories", batch["corpus_categories"])
    return ids


def _as_int32(name: str, x) -> np.ndarray:
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"{name!r} must be integer ids, got dtype {x.dtype}")
    if x.size and (x.min() < -(2**31) or x.max() > 2**31 - 1):
        raise ValueError(f"{name!r} has ids outside int32")
    return x.astype(np.int32)


def withhold_context(batch: Mapping) -> dict:
    """The batch with its request context removed (every context feature 'missing')."""
    n = np.shape(batch["item_ids"])[0]
    missing = np.full((n,), -1, np.int32)
    return dict(
        batch,
        context_category=missing,
        context_confidence=np.zeros((n,), np.float32),
        context_surface=missing,
        context_hour=missing,
    )


# ------------------------------------------------------------------------------------------ logQ estimator


class FrequencyStat(nnx.Variable):
    """State of the streaming frequency estimator: not a parameter (no gradient, no optimizer), saved with
    the model."""


def frequency_update(last_step, gap, step, buckets, valid, alpha: float):
    """One step of the streaming frequency estimator (Yi et al. 2019, Algorithm 2), vectorised.

    Args: last_step int32 [H] (0 = never seen), gap f32 [H] (steps between sightings, moving average),
      step int32 [] (steps done), buckets int32 [N] (hash bucket of each candidate of this step), valid
      bool [N].
    Returns (last_step, gap, step + 1).

    Semantics = the sequential algorithm over the batch's valid candidates in order at t = step + 1: a
    sighting sets gap <- (1 - alpha) * gap + alpha * (t - last_step) and last_step <- t, except that an
    item's first sighting ever sets gap <- t (no prior to average with). A bucket seen k times in one step
    therefore gets (1 - alpha)^k gap + alpha (1 - alpha)^(k-1) (t - last) (first sighting: (1-alpha)^(k-1) t).
    """
    h = gap.shape[0]
    t = step + 1
    b = jnp.where(valid, buckets, h)  # h: sentinel, dropped by the scatters below
    uniq, counts = jnp.unique(b, size=b.shape[0], fill_value=h, return_counts=True)
    idx = jnp.minimum(uniq, h - 1)
    prev_last, prev_gap = last_step[idx], gap[idx]
    g = (t - prev_last).astype(jnp.float32)
    k = counts.astype(jnp.float32)
    decay = (1.0 - alpha) ** jnp.maximum(k - 1.0, 0.0)
    seen = decay * ((1.0 - alpha) * prev_gap + alpha * g)
    new_gap = jnp.where(prev_last > 0, seen, decay * g)
    gap = gap.at[uniq].set(new_gap, mode="drop")
    last_step = last_step.at[uniq].set(jnp.full_like(uniq, t), mode="drop")
    return last_step, gap, t


class StreamingFrequencyEstimator(nnx.Module):
    """Estimates each candidate's sampling probability from the training stream (Yi et al. 2019).

    `estimator(ids, valid) -> log p [N]`: in training mode the step's candidates update the state first
    (`frequency_update`); in eval mode (`model.eval()`, like BatchNorm's running averages) the state is
    only read. p = 1 / gap: the expected sightings per step, up to a constant that cancels in the softmax.
    Count-min-free: one bucket per id when `buckets >= vocab`, else ids are hashed into `buckets`
    (collisions overestimate p, as in the paper's single-hash variant).
    """

    def __init__(self, buckets: int, alpha: float, vocab: int):
        self.buckets, self.alpha, self.vocab = int(buckets), float(alpha), int(vocab)
        self.last_step = FrequencyStat(jnp.zeros((self.buckets,), jnp.int32))
        self.gap = FrequencyStat(jnp.ones((self.buckets,), jnp.float32))
        self.step = FrequencyStat(jnp.zeros((), jnp.int32))
        self.use_running_average = False

    def bucket(self, ids):
        return jnp.maximum(hash_ids(jnp.asarray(ids), 0, self.buckets, vocab=self.vocab), 0)

    def log_probability(self, ids):
        return -jnp.log(jnp.maximum(self.gap[...][self.bucket(ids)], 1e-6))

    def __call__(self, ids, valid):
        if not self.use_running_average:
            last, gap, step = frequency_update(
                self.last_step[...], self.gap[...], self.step[...], self.bucket(ids), valid, self.alpha
            )
            self.last_step[...], self.gap[...], self.step[...] = last, gap, step
        return self.log_probability(ids)


# ------------------------------------------------------------------------------------------ the model


class MLP(nnx.Module):
    """Linear layers with GELU between them: sizes = (in, hidden..., out)."""

    def __init__(self, sizes: Sequence[int], *, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = jax.nn.gelu(x)
        return x


class ContextLayer(nnx.Module):
    """The request's context -> [B, context_dim]: the subject item's category embedding weighted by the
    classifier's confidence, the request surface and the hour of day. A missing feature (-1; confidence 0)
    uses its own 'missing' row (surface, hour) or weight 0 (category).

    Context dropout (training mode only): with probability `rate` an example's whole context becomes
    'missing', exactly the input of a request without context, so the model learns to serve those too.
    """

    def __init__(self, cfg: ContextualTwoTowerConfig, *, rngs: nnx.Rngs):
        c = cfg.context_dim
        init = nnx.initializers.normal(0.02)
        self.num_surfaces = cfg.num_surfaces
        self.category_ln = nnx.LayerNorm(cfg.item_dim, rngs=rngs)
        self.category_proj = nnx.Linear(cfg.item_dim, c, rngs=rngs)
        self.confidence_proj = nnx.Linear(1, c, rngs=rngs)
        self.surface_emb = nnx.Embed(cfg.num_surfaces + 1, c, embedding_init=init, rngs=rngs)
        self.hour_emb = nnx.Embed(HOURS + 1, c, embedding_init=init, rngs=rngs)
        self.out = nnx.Linear(c, c, rngs=rngs)
        self.rate = cfg.context_dropout if cfg.context_dropout_mode == "sample" else 0.0
        self.deterministic = False
        self.rngs = rngs["dropout"].fork()

    def __call__(self, category_emb, category, confidence, surface, hour):
        """category_emb [B, item_dim] (zeros when missing), category / surface / hour int [B] (-1 = missing),
        confidence f32 [B]."""
        s = self.num_surfaces
        known = category >= 0
        conf = jnp.where(known, jnp.clip(jnp.asarray(confidence, jnp.float32), 0.0, 1.0), 0.0)
        surface = jnp.where((surface >= 0) & (surface < s), surface, s)
        hour = jnp.where((hour >= 0) & (hour < HOURS), hour, HOURS)
        if not self.deterministic and self.rate > 0:
            drop = jax.random.bernoulli(self.rngs(), self.rate, conf.shape)
            conf = jnp.where(drop, 0.0, conf)
            surface = jnp.where(drop, s, surface)
            hour = jnp.where(drop, HOURS, hour)
        x = (
            conf[:, None] * self.category_proj(self.category_ln(jnp.asarray(category_emb, jnp.float32)))
            + self.confidence_proj(conf[:, None])
            + self.surface_emb(surface)
            + self.hour_emb(hour)
        )
        return jax.nn.gelu(self.out(jax.nn.gelu(x)))


def l2norm(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class QueryHead(nnx.Module):
    """The per-request half of the query tower: (encoder state, request context) -> the context layer (when
    the model has one) and the MLP head -> L2-normalised query. This is all the online step runs."""

    def __init__(self, cfg: ContextualTwoTowerConfig, *, rngs: nnx.Rngs):
        self.use_context = cfg.use_context
        if cfg.use_context:
            self.context = ContextLayer(cfg, rngs=rngs)
        head_in = cfg.d_model + (cfg.context_dim if cfg.use_context else 0)
        self.mlp = MLP((head_in, *cfg.head_hidden, cfg.embed_dim), rngs=rngs)

    def __call__(self, state, category_emb, context: Mapping):
        """state [B, d_model]; category_emb [B, item_dim]: the subject category's embedding (zeros when
        missing; unused without a context layer); `context`: the context features (see `CONTEXT_KEYS`)."""
        x = jnp.asarray(state, jnp.float32)
        if self.use_context:
            c = self.context(
                category_emb,
                jnp.asarray(context["context_category"]),
                context["context_confidence"],
                jnp.asarray(context["context_surface"]),
                jnp.asarray(context["context_hour"]),
            )
            x = jnp.concatenate([x, c], axis=-1)
        return l2norm(self.mlp(x))


class ContextualTwoTower(nnx.Module):
    """The dense part of the contextual two-tower model (the tables live in the `EmbeddingCollection`).

    `model(embeddings, batch) -> {'state' [B, d_model], 'query' [B, E], 'item' [B, E]}`: the encoder state,
    the query and the label item's vector. The query tower is `user_state` (offline-cacheable: history only)
    followed by `query_head` (per request: context layer and head).
    """

    def __init__(self, cfg: ContextualTwoTowerConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.encoder = SequenceEncoder(cfg.encoder_config(), rngs=rngs)
        self.query_head = QueryHead(cfg, rngs=rngs)
        item_in = cfg.item_dim * (2 if cfg.item_category_feature else 1)
        self.item_ln = nnx.LayerNorm(item_in, rngs=rngs)
        self.item_tower = MLP((item_in, *cfg.item_hidden, cfg.embed_dim), rngs=rngs)
        if cfg.logq_correction:
            self.logq = StreamingFrequencyEstimator(cfg.estimator_buckets, cfg.logq_alpha, cfg.item_rows)

    def user_state(self, embeddings: Mapping, batch: Mapping):
        """The encoder's state after the user's last event [B, d_model]: depends on the history only."""
        mask = jnp.asarray(batch["mask"], bool)
        items = jnp.asarray(embeddings["item_ids"], jnp.float32) + jnp.asarray(
            embeddings["item_categories"], jnp.float32
        )
        return self.encoder.encode_last(jnp.where(mask[..., None], items, 0.0), batch)

    def item_vectors(self, item_emb, category_emb):
        """Item tower: [..., item_dim] id and category embeddings -> L2-normalised [..., E] (the category is
        ignored without `item_category_feature`)."""
        x = jnp.asarray(item_emb, jnp.float32)
        if self.cfg.item_category_feature:
            x = jnp.concatenate([x, jnp.asarray(category_emb, jnp.float32)], axis=-1)
        return l2norm(self.item_tower(self.item_ln(x)))

    def query(self, embeddings: Mapping, batch: Mapping):
        """The end-to-end query tower [B, E]: encoder over the history, then the context layer and head."""
        state = self.user_state(embeddings, batch)
        category_emb = embeddings["context_category"][:, 0] if self.cfg.use_context else None
        return state, self.query_head(state, category_emb, batch)

    def __call__(self, embeddings: Mapping, batch: Mapping) -> dict:
        state, query = self.query(embeddings, batch)
        item = self.item_vectors(embeddings["label_item"][:, 0], embeddings["label_category"][:, 0])
        return {"state": state, "query": query, "item": item}


# ------------------------------------------------------------------------------------------ loss


def in_batch_softmax(
    query, candidates, label_ids, valid, *, temperature: float, log_q=None, remove_accidental_hits: bool = True
):
    """Sampled softmax over in-batch candidates, mean over valid rows.

    Args:
      query [N, E]; candidates [N, E]: row i's positive is candidates[i], every valid candidate is a
      negative of the other rows. label_ids [N]: item id of each candidate. valid [N] bool: rows (and
      candidates) to use. log_q [N] or None: log sampling probability of each candidate, subtracted from
      its logit in every row (logQ correction, positive included). remove_accidental_hits: candidates j != i
      with label_ids[j] == label_ids[i] are masked out of row i.
    """
    n = query.shape[0]
    logits = (query @ candidates.T) / temperature
    if log_q is not None:
        logits = logits - log_q[None, :]
    drop = ~valid[None, :]
    if remove_accidental_hits:
        drop = drop | ((label_ids[:, None] == label_ids[None, :]) & ~jnp.eye(n, dtype=bool))
    logits = jnp.where(drop, NEG_INF, logits)
    per_row = jax.nn.logsumexp(logits, axis=-1) - jnp.diagonal(logits)
    count = jnp.maximum(jnp.sum(valid), 1)
    return jnp.sum(jnp.where(valid, per_row, 0.0)) / count


def _stateful(model: nnx.Module) -> nnx.Module:
    """`model`, when its non-parameter state (estimator arrays, dropout RNG counters) can be updated in place
    at this trace level; otherwise a copy, with a warning: the caller merged the model from state captured
    outside its gradient trace (nnx then refuses in-place updates), so this step's state updates end with
    this call. To keep them, merge inside the traced function with fresh variables
    (`nnx.merge(graphdef, params, rest, copy=True)`) and carry `nnx.state(model, nnx.Not(nnx.Param))` out of
    the step, as `experiments/two_tower/compare.py` does."""
    state = nnx.state(model, nnx.Not(nnx.Param))
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if all(getattr(v, "_can_update", True) for v in variables):
        return model
    training = any(isinstance(m, ContextLayer) and not m.deterministic for _, m in nnx.iter_modules(model)) or any(
        isinstance(m, StreamingFrequencyEstimator) and not m.use_running_average for _, m in nnx.iter_modules(model)
    )
    if training:
        warnings.warn(
            "ContextualTwoTower: the model's state was merged outside this trace, so the logQ estimator and the "
            "context-dropout RNG updates of this step are discarded after it (the estimator stays at its "
            "initial state). Merge with copy=True inside the step and carry the non-parameter state forward.",
            RuntimeWarning,
            stacklevel=3,
        )
    return nnx.merge(*nnx.split(model), copy=True)


def two_tower_loss(model: ContextualTwoTower, embeddings: Mapping, batch: Mapping):
    """(loss, metrics): the logQ-corrected in-batch softmax with accidental hits removed. Non-scalar
    metrics (for `two_tower_summarize`): the queries, the labels and, on eval batches carrying the corpus,
    every corpus item's vector. In training mode the estimator and the dropout RNG advance (model state)."""
    model = _stateful(model)
    cfg = model.cfg
    out = model(embeddings, batch)
    labels = jnp.asarray(batch["label_item"])
    valid = labels >= 0
    log_q = model.logq(labels, valid) if cfg.logq_correction else None

    def softmax(query):
        return in_batch_softmax(
            query,
            out["item"],
            labels,
            valid,
            temperature=cfg.temperature,
            log_q=log_q,
            remove_accidental_hits=cfg.remove_accidental_hits,
        )

    loss = softmax(out["query"])
    metrics = {}
    if cfg.use_context and cfg.context_dropout_mode == "marginal" and not model.query_head.context.deterministic:
        n = labels.shape[0]
        missing = withhold_context({"item_ids": np.zeros((n, 1))})
        no_context = model.query_head(out["state"], jnp.zeros((n, cfg.item_dim), jnp.float32), missing)
        loss_missing = softmax(no_context)
        metrics = {"loss_with_context": loss, "loss_context_missing": loss_missing}
        loss = (1.0 - cfg.context_dropout) * loss + cfg.context_dropout * loss_missing
    metrics |= {"loss": loss, "examples": jnp.sum(valid), "query": out["query"], "label_item": labels}
    if cfg.logq_correction:
        metrics["logq_estimator_step"] = model.logq.step[...]
        metrics["mean_log_q"] = jnp.sum(jnp.where(valid, log_q, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
    if "corpus_items" in embeddings:
        metrics["corpus_vectors"] = model.item_vectors(embeddings["corpus_items"], embeddings["corpus_categories"])
        metrics["corpus_items"] = jnp.asarray(batch["corpus_items"])
    return loss, metrics


# ------------------------------------------------------------------------------------------ full-corpus eval


def full_corpus_recall(
    queries, items, labels, ks: Sequence[int] = (10, 50, 100), *, chunk: int = 1024
) -> dict[str, float]:
    """Exact full-corpus Recall@K: labels index the rows of `items` (the whole corpus). Scores = queries @
    items.T over EVERY item, `chunk` queries at a time; the top-K and the recall are the library's
    (`jaxscale.training.ranking.topk_from_scores`: ties by the lower item index; `ranking_metrics`)."""
    queries = np.asarray(queries, np.float32)
    items = np.asarray(items, np.float32)
    labels = np.asarray(labels)
    if queries.ndim != 2 or items.ndim != 2 or queries.shape[1] != items.shape[1]:
        raise ValueError(f"need queries [N, E] and items [M, E], got {queries.shape} and {items.shape}")
    if labels.shape != (queries.shape[0],):
        raise ValueError(f"{queries.shape[0]} queries but labels of shape {labels.shape}")
    k = max(ks)
    chunk = max(1, chunk)
    top = [ranking.topk_from_scores(queries[i : i + chunk] @ items.T, k) for i in range(0, len(queries), chunk)]
    metrics = ranking.ranking_metrics(np.concatenate(top) if top else np.zeros((0, k), np.int64), labels, ks)
    return {f"recall@{k}": metrics[f"recall@{k}"] for k in ks}


def corpus_from_metrics(cfg: ContextualTwoTowerConfig, metrics: Mapping) -> np.ndarray:
    """The [item_rows, E] corpus vectors from one eval batch's metrics; ValueError unless every item id of
    the corpus appears exactly once."""
    ids = np.asarray(metrics["corpus_items"]).reshape(-1)
    vecs = np.asarray(metrics["corpus_vectors"]).reshape(ids.shape[0], -1)
    keep = ids >= 0
    ids, vecs = ids[keep], vecs[keep]
    if ids.shape[0] != cfg.item_rows or not np.array_equal(np.sort(ids), np.arange(cfg.item_rows)):
        raise ValueError(
            f"the eval batch's corpus_items must hold every item id in [0, {cfg.item_rows}) exactly once "
            f"(got {ids.shape[0]} ids, {np.unique(ids).shape[0]} distinct)"
        )
    items = np.empty((cfg.item_rows, vecs.shape[1]), np.float32)
    items[ids] = vecs
    return items


def two_tower_summarize(cfg: ContextualTwoTowerConfig, batches: list) -> dict:
    """Exact full-corpus Recall@K over the eval set's labelled rows. Needs eval batches carrying the corpus
    (`corpus_items` / `corpus_categories`, as the synthetic eval split does); without them there is nothing
    to rank against and no recall is reported."""
    if not batches or "corpus_vectors" not in batches[0]:
        return {}
    items = corpus_from_metrics(cfg, batches[0])
    queries = np.concatenate([np.asarray(b["query"]) for b in batches])
    labels = np.concatenate([np.asarray(b["label_item"]) for b in batches])
    keep = labels >= 0
    if not keep.any():
        return {}
    return full_corpus_recall(queries[keep], items, labels[keep], cfg.recall_ks)


def two_tower_score(model: ContextualTwoTower, embeddings: Mapping, batch: Mapping):
    """Full-corpus ranking (`jaxscale.evaluate`): (scores [B, item_rows], label items [B]). The queries are
    the end-to-end query tower's (with the batch's context); the candidates are the item tower's vectors of
    the batch's corpus (`corpus_items` / `corpus_categories`, laid over the global batch), placed at their ids;
    rows below `reserved_rows` are -inf."""
    cfg = model.cfg
    _, query = model.query(embeddings, batch)
    ids = jnp.asarray(batch["corpus_items"]).reshape(-1)
    vecs = model.item_vectors(embeddings["corpus_items"], embeddings["corpus_categories"])
    vecs = vecs.reshape(ids.shape[0], -1)
    items = jnp.zeros((cfg.item_rows, vecs.shape[-1]), jnp.float32)
    items = items.at[jnp.where(ids >= 0, ids, cfg.item_rows)].set(vecs, mode="drop")
    scores = query @ items.T / cfg.temperature
    scores = jnp.where(jnp.arange(cfg.item_rows) >= cfg.reserved_rows, scores, -jnp.inf)
    return scores, jnp.asarray(batch["label_item"], jnp.int32)


# ------------------------------------------------------------------------------------------ registry


def _synthetic(cfg: ContextualTwoTowerConfig, global_batch: int, data, split: str):
    """The planted-context generator on the run's data settings (seed, Zipf exponent, id scrambling); its
    signal strengths keep their defaults here (set them on `SyntheticContextualData` directly)."""
    from jaxscale_models.contextual_two_tower_data import SyntheticContextualData

    return SyntheticContextualData(
        cfg, global_batch, data.seed, split=split, zipf_exponent=data.zipf_exponent, scramble=data.scramble_ids
    )


def _sequence_store(cfg: ContextualTwoTowerConfig, config, split: str, process_index: int, process_count: int):
    """`data.source: sequences`: anchors of a `jaxscale.sequences` store, labelled by the anchor event, through
    Grain (`jaxscale_models.contextual_two_tower_sequences`)."""
    from jaxscale_models.contextual_two_tower_sequences import sequence_source

    return sequence_source(cfg, config, split, process_index, process_count)


def _parquet_columns(cfg: ContextualTwoTowerConfig):
    from jaxscale_models.contextual_two_tower_data import SyntheticContextualData

    return list(SyntheticContextualData.columns), cfg.max_seq_len


SPEC = ModelSpec(
    kind="contextual_two_tower",
    config=ContextualTwoTowerConfig,
    tables=two_tower_tables,
    ids=two_tower_ids,
    build=lambda cfg, rngs: ContextualTwoTower(cfg, rngs=rngs),
    loss=two_tower_loss,
    synthetic=_synthetic,
    parquet_columns=_parquet_columns,
    summarize=two_tower_summarize,
    data_sources={"sequences": _sequence_store},
    score=two_tower_score,
    encoder_states="jaxscale_models.two_tower_inference:ENCODER_STATES",
)

__all__ = [
    "ContextLayer",
    "ContextualTwoTower",
    "ContextualTwoTowerConfig",
    "QueryHead",
    "SPEC",
    "StreamingFrequencyEstimator",
    "frequency_update",
    "full_corpus_recall",
    "in_batch_softmax",
    "request_ids",
    "two_tower_ids",
    "two_tower_loss",
    "two_tower_summarize",
    "two_tower_tables",
    "withhold_context",
]
