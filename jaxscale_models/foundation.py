"""A PinFM-style user-sequence foundation model: a causal GPT-2-style transformer over activity events.

An event is (timestamp, action, surface, item). The item ids are the only large vocabulary: they live in
sharded `EmbeddingCollection` sequence tables (pooling=None) and reach this module as looked-up vectors.
Actions and surfaces have tens of values, so they are plain `nnx.Embed` params inside the model
(replicated, data-parallel like the rest of the dense model): routing a 4-row table through the
all-to-all would cost a collective and buy nothing.

Data flow (the trainer's job; this module never sees the tables):

    ids = foundation_ids(cfg, batch)            # {item feature: int32 [B, L]}, -1 = padding
    emb = ec.lookup(state, ids)                 # {item feature: f32 [B, L, item_dim]}
    loss, metrics = foundation_loss(model, emb, batch)

`batch` keys (see `jaxscale_models.foundation_data.SyntheticFoundationData`): item_ids int32 [B, L] (raw ids,
-1 padded), timestamps int32 [B, L] (unix seconds), actions int32 [B, L], surfaces int32 [B, L], engaged f32 [B, L]
(label: did the user engage with this event's item), mask bool [B, L] (item_ids >= 0).

Heads, both causal (position t sees events <= t only):
  * next-item retrieval: the query at t is scored against the item embedding of event t+1 with an InfoNCE
    loss over in-batch negatives (the other events' next items). The candidates are the looked-up item
    embeddings themselves, so the retrieval gradient reaches the item tables on both sides.
  * engagement: from the history at t and the item of event t+1, predict whether event t+1 was engaged.
    Predicting the *next* event's label keeps the label out of the inputs (event t's action encodes it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend.random import threefry2x32_p
from jax.sharding import PartitionSpec as P

from jaxscale.engine.mesh import BATCH_AXES, batch_mesh
from jaxscale.engine.tables import TableConfig
from jaxscale.training.config import check_choice, check_float, check_int, field_error
from jaxscale.training.ranking import auc
from jaxscale.training.registry import ModelSpec
from jaxscale_models.layers import LayerNorm, Linear

TIME_ENCODINGS = ("log_bucket", "sinusoidal", "none")
RETRIEVAL_LOSSES = ("in_batch", "full_softmax")
SIMILARITIES = ("cosine", "dot")
TARGET_KEY = "target_item_ids"
"""Optional batch key: int32 [B], the item that follows the history (a sequence store's example target)."""
ITEM_COMBINES = ("sum", "concat")
ITEM_SPACES = ("projected", "tied")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FoundationConfig:
    """Shape of the foundation model and its item tables. Defaults are the CPU smoke size."""

    item_rows: int = 20_000
    """Rows of each item table. Raw item ids beyond this are hashed into it (see `item_vocab`)."""
    item_dim: int = 32
    """Embedding dim of each item table (the all-to-all payload per event is item_dim floats per table)."""
    item_vocab: int | None = None
    """Range of raw item ids; None = item_rows (ids index the single table directly)."""
    num_item_tables: int = 1
    """Items are hashed into this many tables with independent hashes (fewer harmful collisions)."""
    item_combine: Literal["sum", "concat"] = "sum"
    """How the per-table item vectors are combined into one item vector."""
    item_reshape: Literal["half_dim"] | None = None
    """TableConfig.reshape for the item tables (bandwidth-aware embeddings)."""
    item_space: Literal["projected", "tied"] = "projected"
    """How the item rows meet the transformer. 'projected': an event's row enters through a LayerNorm and a
    Linear (the transformer sees the row's direction, whatever scale the sparse optimizer gives it) and a
    Linear head maps the hidden state to the retrieval query, so the table keeps a space of its own (any
    item_dim). 'tied' (SASRec's): the row is added to the transformer's input as is and the hidden state is
    the query, so input and output share the transformer's space (needs item_out_dim == d_model and no
    item_reshape). On MovieLens-100K 'tied' learned faster and ranked better, on validation and on test
    (docs/movielens.md, "The item space")."""
    num_actions: int = 4
    num_surfaces: int = 4
    action_inputs: bool = True
    """Each event's type (the rating, in MovieLens) is an input of the encoder; False drops that input (an
    ablation: the encoder then sees items, surfaces, positions and times only)."""
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: int = 4
    max_seq_len: int = 32
    dropout: float = 0.0
    time_encoding: Literal["log_bucket", "sinusoidal", "none"] = "log_bucket"
    """Encoding of the gap to the previous event: log-spaced buckets, log-gap sinusoids, or nothing."""
    time_buckets: int = 32
    time_max_seconds: float = 3.0e7
    """Gaps are clipped here (about a year) before encoding."""
    temperature: float = 0.1
    """Softmax temperature: scores are similarity / temperature (both retrieval losses)."""
    retrieval_loss: Literal["in_batch", "full_softmax"] = "in_batch"
    """'in_batch': InfoNCE against the batch's other next items (scales to any table). 'full_softmax':
    cross-entropy over every row of the item table (SASRec's objective; for a table that holds the whole
    vocabulary: one table, item_vocab <= item_rows). The table is looked up whole each step through the
    engine, as an extra feature laid over the batch (`corpus_feature`)."""
    similarity: Literal["cosine", "dot"] = "cosine"
    """Query-item score: cosine (both L2-normalised) or the raw dot product (as SASRec scores)."""
    loss_last_positions: int = 0
    """Full softmax: only the last k events of each history predict their next item (the last one the
    target); 0 = every event. With a reader that yields every target as an example (leave-one-out), each
    target is otherwise predicted from up to max_seq_len overlapping windows per epoch, most of them with a
    truncated context; k small trains each target mostly from its full history, as SASRec does (k = 1)."""
    seen_item_bias: bool = False
    """Full softmax: a learned score offset (one scalar, 0 at init) added to the items already in the user's
    history (at position t: the items of events <= t). It lets the model learn from the data how likely a
    user is to come back to an item (in MovieLens a movie is rated once, so it learns to demote them);
    evaluation still ranks every item (nothing is masked)."""
    seen_item_bias_scale: float = 1.0
    """The offset is `scale * p` with p the trained scalar. Adam moves p about one learning rate per step
    whatever its gradient, so at lr 1e-3 an offset of scale 1 needs thousands of steps to reach the few
    units that demoting a history item is worth; scale 10 lets it move as fast as the data asks.
    Equivalent to a learning rate of its own for this one parameter."""
    reserved_rows: int = 0
    """Rows [0, reserved_rows) are never candidates: a sequence store's vocabulary reserves 0 (padding) and
    1 (out of vocabulary), so set 2 when the store has one."""
    max_negatives: int = 0
    """In-batch candidate pool size (a strided subset of the next items); 0 = every next item in the batch."""
    recall_k: int = 10
    retrieval_weight: float = 1.0
    engage_weight: float = 1.0
    """0: the engagement head is still run and its metrics reported, but it is not trained (no backward pass)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Activation dtype of the transformer; params, softmax and losses stay float32."""

    def __post_init__(self):
        o = "FoundationConfig"
        for f in (
            "item_rows",
            "item_dim",
            "num_item_tables",
            "num_actions",
            "num_surfaces",
            "d_model",
            "num_layers",
            "num_heads",
            "mlp_ratio",
            "time_buckets",
            "recall_k",
        ):
            check_int(o, self, f, 1)
        check_int(o, self, "max_seq_len", 2)
        check_int(o, self, "max_negatives", 0)
        check_int(o, self, "reserved_rows", 0)
        check_int(o, self, "loss_last_positions", 0)
        if self.reserved_rows >= self.item_rows:
            raise field_error(o, "reserved_rows", f"must be < item_rows={self.item_rows}, got {self.reserved_rows}")
        check_choice(o, self, "retrieval_loss", RETRIEVAL_LOSSES)
        check_choice(o, self, "similarity", SIMILARITIES)
        check_float(o, self, "seen_item_bias_scale", 0.0, low_open=True)
        if self.seen_item_bias and self.retrieval_loss != "full_softmax":
            raise field_error(o, "seen_item_bias", "needs retrieval_loss='full_softmax'")
        if self.item_vocab is not None:
            check_int(o, self, "item_vocab", 1)
            if self.item_vocab > 2**31 - 1:
                raise field_error(o, "item_vocab", f"must fit int32, got {self.item_vocab}")
        if self.item_rows > 2**31 - 1:
            raise field_error(o, "item_rows", f"must fit int32, got {self.item_rows}")
        check_choice(o, self, "item_combine", ITEM_COMBINES)
        check_choice(o, self, "item_reshape", (None, "half_dim"))
        check_choice(o, self, "item_space", ITEM_SPACES)
        if self.item_space == "tied" and (self.item_out_dim != self.d_model or self.item_reshape is not None):
            raise field_error(
                o,
                "item_space",
                f"'tied' adds the item rows to the transformer's input and scores them with its hidden state: needs "
                f"item_out_dim == d_model and item_reshape=None, got item_out_dim={self.item_out_dim}, "
                f"d_model={self.d_model}, item_reshape={self.item_reshape!r}",
            )
        if self.item_reshape == "half_dim" and self.item_dim % 2:
            raise field_error(o, "item_dim", f"must be even with item_reshape='half_dim', got {self.item_dim}")
        check_choice(o, self, "time_encoding", TIME_ENCODINGS)
        if self.retrieval_loss == "full_softmax" and not (self.num_item_tables == 1 and self.vocab <= self.item_rows):
            raise field_error(
                o,
                "retrieval_loss",
                f"'full_softmax' needs one item table holding the whole vocabulary (num_item_tables=1, item_vocab <= "
                f"item_rows), got num_item_tables={self.num_item_tables}, item_vocab={self.vocab}, "
                f"item_rows={self.item_rows}",
            )
        if self.retrieval_loss == "full_softmax" and self.item_reshape is not None:
            raise field_error(o, "item_reshape", "must be null with retrieval_loss='full_softmax'")
        check_choice(o, self, "dtype", DTYPES)
        if self.d_model % self.num_heads:
            raise field_error(o, "num_heads", f"must divide d_model={self.d_model}, got {self.num_heads}")
        if self.time_encoding == "sinusoidal" and self.d_model % 2:
            raise field_error(o, "d_model", f"must be even for sinusoidal time encoding, got {self.d_model}")
        check_float(o, self, "dropout", 0.0, 1.0)
        if self.dropout >= 1.0:
            raise field_error(o, "dropout", f"must be < 1, got {self.dropout}")
        check_float(o, self, "time_max_seconds", 1.0)
        check_float(o, self, "temperature", 0.0, low_open=True)
        check_float(o, self, "retrieval_weight", 0.0)
        check_float(o, self, "engage_weight", 0.0)

    @property
    def vocab(self) -> int:
        return self.item_vocab if self.item_vocab is not None else self.item_rows

    @property
    def item_out_dim(self) -> int:
        """Dim of the combined item vector (the retrieval space)."""
        return self.item_dim * (self.num_item_tables if self.item_combine == "concat" else 1)

    @property
    def embedding_params(self) -> int:
        return self.num_item_tables * self.item_rows * self.item_dim

    @classmethod
    def smoke(cls, **overrides) -> FoundationConfig:
        """Trains on 8 simulated CPU devices in seconds (20k x 32 item table, 2 layers, d_model 64)."""
        return cls(**overrides)

    @classmethod
    def large(cls, **overrides) -> FoundationConfig:
        """Production-like: 2 hashed item tables of 100M x 64 (12.8B embedding params), 2k-event
        sequences, a 12-layer d_model-1024 transformer (~150M dense params). Sized for 8x8 H100s."""
        base = dict(
            item_rows=100_000_000,
            item_dim=64,
            item_vocab=2_000_000_000,
            num_item_tables=2,
            item_combine="concat",
            num_actions=16,
            num_surfaces=8,
            d_model=1024,
            num_layers=12,
            num_heads=16,
            mlp_ratio=4,
            max_seq_len=2048,
            dropout=0.1,
            time_buckets=64,
            max_negatives=8192,
            recall_k=100,
            dtype="bfloat16",
        )
        return cls(**(base | overrides))


def item_features(cfg: FoundationConfig) -> tuple[str, ...]:
    """Engine feature names of the item tables, one per hashed table."""
    return tuple(f"item_h{j}" for j in range(cfg.num_item_tables))


def corpus_feature(cfg: FoundationConfig) -> str | None:
    """The engine feature that looks up the whole item table (retrieval_loss='full_softmax'), else None."""
    return f"{item_features(cfg)[0]}_corpus" if cfg.retrieval_loss == "full_softmax" else None


def foundation_tables(cfg: FoundationConfig) -> list[TableConfig]:
    """The sharded tables: only the item tables (sequence lookups). Actions/surfaces are nnx.Embed.
    Under full_softmax the first table also serves `corpus_feature` (every row, once per step)."""
    corpus = corpus_feature(cfg)
    return [
        TableConfig(
            name=f,
            rows=cfg.item_rows,
            dim=cfg.item_dim,
            pooling=None,
            features=(f, corpus) if corpus and j == 0 else (f,),
            reshape=cfg.item_reshape,
        )
        for j, f in enumerate(item_features(cfg))
    ]


def corpus_ids(rows: int, local_batch: int) -> np.ndarray:
    """Every row of a table laid over a batch: int32 [local_batch, ceil(rows / local_batch)], row-major,
    -1 padded. Each process lays the whole corpus over its own rows; the objective reads the first
    `rows` entries of the gathered [B, C] lookup (process 0's copy)."""
    per_row = -(-rows // local_batch)
    flat = np.full(local_batch * per_row, -1, np.int32)
    flat[:rows] = np.arange(rows, dtype=np.int32)
    return flat.reshape(local_batch, per_row)


def _fmix32(h, xp):
    """murmur3's 32-bit finaliser; identical in numpy and jax.numpy (uint32 wraps in both)."""
    h = h ^ (h >> 16)
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def hash_ids(ids, table: int, rows: int, *, num_tables: int = 1, vocab: int | None = None):
    """Maps raw ids to rows of hashed table `table`; -1 stays -1. numpy in -> numpy out, jax -> jax.

    One table over a vocab that fits is the identity, so its rows are the raw ids (and Zipf-hot ids stay
    hot rows, which the sharding planner should see). Otherwise table j uses hash_j(id) % rows.
    """
    xp = np if isinstance(ids, np.ndarray) else jnp
    valid = ids >= 0
    if num_tables == 1 and vocab is not None and vocab <= rows:
        return ids.astype(xp.int32) if xp is np else ids.astype(jnp.int32)
    with np.errstate(over="ignore"):
        h = ids.astype(xp.uint32) ^ xp.uint32((0x9E3779B9 * (table + 1)) & 0xFFFFFFFF)
        h = _fmix32(h, xp) % xp.uint32(rows)
    return xp.where(valid, h.astype(xp.int32), xp.int32(-1))


def foundation_ids(cfg: FoundationConfig, batch: Mapping) -> dict:
    """The engine's input: {item feature: int32 [B, L]} from batch['item_ids'] (numpy or jax)."""
    ids = batch["item_ids"]
    rows = cfg.item_rows * 2 if cfg.item_reshape == "half_dim" else cfg.item_rows  # the tables' stored_rows
    out = {
        f: hash_ids(ids, j, rows, num_tables=cfg.num_item_tables, vocab=cfg.vocab)
        for j, f in enumerate(item_features(cfg))
    }
    corpus = corpus_feature(cfg)
    if corpus is not None:
        out[corpus] = corpus_ids(cfg.item_rows, ids.shape[0])
        if not isinstance(ids, np.ndarray):
            out[corpus] = jnp.asarray(out[corpus])
    return out


def combine_items(cfg: FoundationConfig, embeddings: Mapping) -> jax.Array:
    """Per-table item vectors -> one [B, L, item_out_dim] vector (sum or concat)."""
    parts = [jnp.asarray(embeddings[f], jnp.float32) for f in item_features(cfg)]
    return sum(parts[1:], parts[0]) if cfg.item_combine == "sum" else jnp.concatenate(parts, axis=-1)


class ByteDropout(nnx.Dropout):
    """`nnx.Dropout` with one random byte per element: an element is dropped when its byte is below
    `round(rate * 256)`, so the rate actually applied is that over 256 (0.2 -> 0.1992; FlashAttention's
    dropout quantises the same way) and kept elements are scaled by 256 / (256 - that). Four elements share one
    32-bit draw, where `jax.random.bernoulli` draws a float per element: on CPU the masks of the foundation
    model's training step cost a tenth of the time (the attention probabilities alone are B x heads x L x L).
    Same state and train/eval switch as `nnx.Dropout`."""

    def __call__(self, inputs, *, deterministic: bool | None = None, rngs=None):
        deterministic = self.deterministic if deterministic is None else deterministic
        drop = byte_threshold(self.rate)
        if deterministic is not False or rngs is not None or self.broadcast_dims or not 0 < drop < 256:
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)  # exact path: odd cases
        keep = byte_keep_mask(self.rngs(), self.rate, inputs.shape)
        return jnp.where(keep, inputs * jnp.asarray(256.0 / (256 - drop), inputs.dtype), jnp.zeros((), inputs.dtype))

    def byte_mask(self, shape) -> tuple[jax.Array | None, float] | None:
        """What `__call__` on an input of `shape` would apply, for a caller that applies it itself: (None, 1.0)
        when it passes inputs through, (keep mask, scale of the kept) when it draws a byte mask (the same draw
        `__call__` makes), None when it takes `nnx.Dropout`'s exact path (the caller then calls it)."""
        drop = byte_threshold(self.rate)
        if self.deterministic or self.rate == 0:
            return None, 1.0
        if self.broadcast_dims or not 0 < drop < 256:
            return None
        return byte_keep_mask(self.rngs(), self.rate, shape), 256.0 / (256 - drop)


def byte_threshold(rate: float) -> int:
    """The drop threshold of `ByteDropout` on a byte (0..256): the applied rate is this over 256 (rates that
    round to 0 or 256 take `nnx.Dropout`'s exact path)."""
    return min(256, max(0, round(rate * 256)))


def byte_keep_mask(key, rate: float, shape) -> jax.Array:
    """bool `shape`: True where the element's random byte is >= `byte_threshold(rate)` (kept)."""
    *lead, last = shape
    words = threefry_words(key, (*lead, -(-last // 4)))
    octets = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(*lead, -1)[..., :last]
    return octets >= np.uint8(byte_threshold(rate))


def threefry_words(key, shape) -> jax.Array:
    """uint32 `shape` of random words: threefry-2x32 in counter mode, both 32-bit halves of each block kept
    (word 2j and 2j+1 of a row are the block of counter (0, j), j numbered over the whole array), where
    `jax.random.bits` XORs the halves into one word: half the hashing for the same bits. The counter is each
    element's own index, so the words do not depend on how the array is sharded. Other key kinds (or more
    than 2^32 blocks) draw `jax.random.bits`."""
    *lead, last = shape
    half = -(-last // 2)
    blocks = math.prod(lead) * half
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    if data.shape != (2,) or data.dtype != jnp.uint32 or blocks >= 2**32:
        return jax.random.bits(key, shape, jnp.uint32)
    counter = jax.lax.iota(jnp.uint32, blocks).reshape(*lead, half)
    hi, lo = threefry2x32_p.bind(data[0], data[1], jnp.zeros_like(counter), counter)
    return jnp.stack([hi, lo], axis=-1).reshape(*lead, 2 * half)[..., :last]


ATTENTION_BLOCK = 64
"""Query positions per block of `CausalSelfAttention`: block i attends to keys up to its own end only."""


class CausalSelfAttention(nnx.Module):
    """Multi-head self-attention; position t attends to valid positions <= t (and always to itself, so a
    row is never fully masked and padded rows stay finite).

    The queries go in blocks of about `ATTENTION_BLOCK` positions, each scored against the keys up to its
    own end only: the scores above the diagonal, all masked, are never computed (200 positions: 4 blocks,
    5/8 of the full square). Exact: a masked key's weight is 0 either way."""

    def __init__(self, cfg: FoundationConfig, *, rngs: nnx.Rngs):
        d, dt = cfg.d_model, jnp.dtype(cfg.dtype)
        self.num_heads = cfg.num_heads
        self.qkv = Linear(d, 3 * d, dtype=dt, rngs=rngs)
        # GPT-2 scales residual projections by 1/sqrt(2 * layers) so depth doesn't blow up the stream.
        init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))
        self.out = Linear(d, d, dtype=dt, kernel_init=init, rngs=rngs)
        self.dropout = ByteDropout(cfg.dropout, rngs=rngs)

    def __call__(self, x, mask):
        b, l, d = x.shape
        q, k, v = self._heads(x)
        n = -(-l // ATTENTION_BLOCK)
        edges = [round(i * l / n) for i in range(n + 1)]
        out = [
            self._block(q[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi], mask[:, :hi], lo)
            for lo, hi in zip(edges, edges[1:])
        ]
        return self.out(jnp.transpose(jnp.concatenate(out, axis=2), (0, 2, 1, 3)).reshape(b, l, d))

    def at(self, x, mask, last):
        """The attention output at one query position per row, `last` [B] -> [B, d]: what `__call__` gives
        there (keys and values from every position), without the other positions' queries."""
        b, l, d = x.shape
        q, k, v = self._heads(x)
        q = jnp.take_along_axis(q, last[:, None, None, None], axis=2)  # [B, H, 1, d/H]
        key, at = jnp.arange(l)[None], last[:, None]
        allowed = ((key <= at) & mask) | (key == at)  # [B, L]
        return self.out(self._attend(q, k, v, allowed[:, None]).reshape(b, d))

    def _heads(self, x):
        """q, k, v heads-major [B, H, L, d/H]: XLA:CPU's batched products then run on contiguous per-head
        blocks."""
        b, l, d = x.shape
        return jnp.transpose(self.qkv(x).reshape(b, l, 3, self.num_heads, d // self.num_heads), (2, 0, 3, 1, 4))

    def _block(self, q, k, v, mask, start: int):
        """Queries start..start+len(q) against keys 0..start+len(q): [B, H, q, d/H]."""
        at, key = jnp.arange(start, start + q.shape[2])[:, None], jnp.arange(k.shape[2])[None]
        return self._attend(q, k, v, ((at >= key)[None] & mask[:, None, :]) | (at == key)[None])

    def _attend(self, q, k, v, allowed):
        """Softmax attention of q [B, H, Q, d/H] over k, v [B, H, K, d/H] where `allowed` [B, Q, K], the
        probabilities dropped out: `softmax_attention` with the dropout's byte mask (the autodiff definition,
        `attention_reference`, where the dropout takes nnx.Dropout's exact path)."""
        drop = self.dropout.byte_mask((*q.shape[:3], k.shape[2]))
        if drop is None:
            return attention_reference(q, k, v, allowed, self.dropout)
        keep, scale = drop
        return softmax_attention(q, k, v, allowed, keep, scale)


def attention_reference(q, k, v, allowed, dropout=None):
    """Softmax attention by its definition (jax's autodiff differentiates it): q [B, H, Q, d/H] over k, v
    [B, H, K, d/H] where `allowed` [B, Q, K], `dropout` (a callable) applied to the probabilities."""
    logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    logits = jnp.where(allowed[:, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = (dropout(probs) if dropout is not None else probs).astype(v.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", probs, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def softmax_attention(q, k, v, allowed, keep, scale: float):
    """`attention_reference` with the dropout given as its mask: the kept probabilities (`keep` [B, H, Q, K],
    or None for no dropout) weigh the values, and the output is multiplied by `scale` (dropout's 1 / keep
    rate) on [B, H, Q, d/H], not on the [B, H, Q, K] probabilities; the 1/sqrt(d/H) is folded into q.

    Its VJP is written out (FlashAttention's): dS = P * (dP - rowsum(dO * O)), the row sum taken over the
    d/H values of the output instead of over the K probabilities, and no other pass over the probabilities
    than the products' and that one. Equal to jax's autodiff of the definition (tests/test_foundation_kernels.py)."""
    return _attention_forward(q, k, v, allowed, keep, scale)[0]


def _attention_forward(q, k, v, allowed, keep, scale):
    qs = q * jnp.asarray(1 / math.sqrt(q.shape[-1]), q.dtype)
    logits = jnp.einsum("bhqd,bhkd->bhqk", qs, k, preferred_element_type=jnp.float32)
    logits = jnp.where(allowed[:, None], logits, jnp.finfo(jnp.float32).min)
    top = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - top)
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    kept = probs if keep is None else jnp.where(keep, probs, 0.0)
    out = jnp.einsum("bhqk,bhkd->bhqd", kept.astype(v.dtype), v, preferred_element_type=jnp.float32) * scale
    return out.astype(v.dtype), (qs, k, v, keep, probs, out)


def _softmax_attention_fwd(q, k, v, allowed, keep, scale):
    out, res = _attention_forward(q, k, v, allowed, keep, scale)
    return out, (*res, allowed)


def _softmax_attention_bwd(scale, res, d_out):
    qs, k, v, keep, probs, out, allowed = res
    g = d_out.astype(jnp.float32)
    kept = probs if keep is None else jnp.where(keep, probs, 0.0)
    dv = jnp.einsum("bhqk,bhqd->bhkd", kept, g * scale).astype(v.dtype)
    d_kept = jnp.einsum("bhqd,bhkd->bhqk", g * scale, v, preferred_element_type=jnp.float32)
    d_probs = d_kept if keep is None else jnp.where(keep, d_kept, 0.0)
    delta = jnp.sum(g * out, axis=-1, keepdims=True)  # = rowsum(d_probs * probs): sum_k dP P = sum_d dO O
    d_logits = probs * (d_probs - delta)
    dq = jnp.einsum("bhqk,bhkd->bhqd", d_logits, k) * (1 / math.sqrt(qs.shape[-1]))
    dk = jnp.einsum("bhqk,bhqd->bhkd", d_logits, qs)
    no_grad = np.zeros(allowed.shape, jax.dtypes.float0)
    return (
        dq.astype(qs.dtype),
        dk.astype(k.dtype),
        dv,
        no_grad,
        None if keep is None else np.zeros(keep.shape, jax.dtypes.float0),
    )


softmax_attention.defvjp(_softmax_attention_fwd, _softmax_attention_bwd)


class Block(nnx.Module):
    """Pre-LN GPT-2 block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: FoundationConfig, *, rngs: nnx.Rngs):
        d, dt = cfg.d_model, jnp.dtype(cfg.dtype)
        self.ln1 = LayerNorm(d, dtype=dt, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln2 = LayerNorm(d, dtype=dt, rngs=rngs)
        self.fc = Linear(d, cfg.mlp_ratio * d, dtype=dt, rngs=rngs)
        init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.num_layers))
        self.proj = Linear(cfg.mlp_ratio * d, d, dtype=dt, kernel_init=init, rngs=rngs)
        self.dropout = ByteDropout(cfg.dropout, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.dropout(self.attn(self.ln1(x), mask))
        return x + self.dropout(self.proj(jax.nn.gelu(self.fc(self.ln2(x)))))

    def at(self, x, mask, last):
        """The block's output at one position per row, `last` [B] -> [B, d]: attention query and MLP there
        only (the last block of a model that reads one state per user need not compute the others)."""
        x_last = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
        x_last = x_last + self.dropout(self.attn.at(self.ln1(x), mask, last))
        return x_last + self.dropout(self.proj(jax.nn.gelu(self.fc(self.ln2(x_last)))))


def last_positions(mask) -> jax.Array:
    """Each row's last valid position [B] int32 (0 for a row with none)."""
    l = mask.shape[1]
    return jnp.max(jnp.where(mask, jnp.arange(l, dtype=jnp.int32)[None, :], 0), axis=1)


class SequenceEncoder(nnx.Module):
    """The causal encoder over a user's events: item vectors + action + surface + position + time gap ->
    a pre-LN transformer -> final LayerNorm. `encode(items, batch) -> hidden [B, L, d_model]`: position t
    sees events <= t only, so `hidden[:, t]` is the user's state after event t.

    The foundation model is this encoder plus its heads; other models (e.g. the contextual two-tower's query
    tower) hold one as a submodule and reuse it as is. Configured by the `FoundationConfig` fields that shape
    it (item_dim / item_out_dim / item_reshape, num_actions, num_surfaces, d_model, num_layers, num_heads,
    mlp_ratio, max_seq_len, dropout, time_encoding, time_buckets, time_max_seconds, dtype).
    """

    def __init__(self, cfg: FoundationConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, e, dt = cfg.d_model, cfg.item_out_dim, jnp.dtype(cfg.dtype)
        # LayerNorm first: table rows start tiny (TorchRec init, ~1/sqrt(rows)) and their scale drifts with
        # the sparse optimizer; the transformer should see the item's direction, not its scale.
        if cfg.item_reshape == "half_dim":
            # Bandwidth-aware tables return item_dim/2 per lookup (half the all-to-all bytes); this local
            # projection restores item_dim after the all-to-all, with no communication.
            self.item_up = Linear(cfg.item_dim // 2, cfg.item_dim, dtype=dt, rngs=rngs)
        if cfg.item_space == "projected":
            self.item_ln = LayerNorm(e, rngs=rngs)
            self.item_in = Linear(e, d, dtype=dt, rngs=rngs)
        emb_init = nnx.initializers.normal(0.02)
        if cfg.action_inputs:
            self.action_emb = nnx.Embed(cfg.num_actions, d, dtype=dt, embedding_init=emb_init, rngs=rngs)
        self.surface_emb = nnx.Embed(cfg.num_surfaces, d, dtype=dt, embedding_init=emb_init, rngs=rngs)
        self.pos_emb = nnx.Embed(cfg.max_seq_len, d, dtype=dt, embedding_init=emb_init, rngs=rngs)
        if cfg.time_encoding == "log_bucket":
            self.time_emb = nnx.Embed(cfg.time_buckets, d, dtype=dt, embedding_init=emb_init, rngs=rngs)
        elif cfg.time_encoding == "sinusoidal":
            self.time_proj = Linear(d, d, dtype=dt, rngs=rngs)
        self.dropout = ByteDropout(cfg.dropout, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.ln_f = LayerNorm(d, dtype=dt, rngs=rngs)

    def time_features(self, timestamps, mask):
        """Encodes the gap (seconds) since the previous valid event; 0 for the first event."""
        cfg = self.cfg
        ts = jnp.where(mask, timestamps, 0)
        prev = jnp.concatenate([ts[:, :1], ts[:, :-1]], axis=1)
        gap = jnp.clip((ts - prev).astype(jnp.float32), 0.0, cfg.time_max_seconds)
        log_gap = jnp.log1p(gap)
        if cfg.time_encoding == "log_bucket":
            bucket = jnp.floor(log_gap / math.log1p(cfg.time_max_seconds) * (cfg.time_buckets - 1))
            return self.time_emb(jnp.clip(bucket.astype(jnp.int32), 0, cfg.time_buckets - 1))
        half = cfg.d_model // 2
        freqs = jnp.exp(jnp.linspace(0.0, math.log(100.0), half))  # log-gap scale: one cycle ~ x e^(2pi)
        angles = log_gap[..., None] * freqs
        return self.time_proj(jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1))

    def item_vectors(self, embeddings: Mapping, mask) -> jax.Array:
        """The looked-up item tables -> one [B, L, item_out_dim] vector per event (zeros on padding)."""
        cfg = self.cfg
        if cfg.item_reshape == "half_dim":
            embeddings = {f: self.item_up(jnp.asarray(embeddings[f], jnp.float32)) for f in item_features(cfg)}
        return jnp.where(mask[..., None], combine_items(cfg, embeddings), 0.0)

    def encode(self, items, batch: Mapping) -> jax.Array:
        """items [B, L, item_out_dim] (zeros on padding) and the batch's actions / surfaces / timestamps / mask
        -> hidden [B, L, d_model] float32."""
        x, mask = self._inputs(items, batch)
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x).astype(jnp.float32)

    def encode_last(self, items, batch: Mapping) -> jax.Array:
        """`encode(items, batch)` at each row's last valid position only -> [B, d_model] float32 (position 0
        for an empty history). The final block computes its attention query and MLP at that position alone:
        a model that reads one state per user (the two-tower's query tower) skips the rest of that block."""
        x, mask = self._inputs(items, batch)
        *front, final = self.blocks
        for block in front:
            x = block(x, mask)
        return self.ln_f(final.at(x, mask, last_positions(mask))).astype(jnp.float32)

    def _inputs(self, items, batch: Mapping):
        """The transformer's input stream [B, L, d_model] (items + surface + position + action + time gap,
        after dropout) and the bool mask [B, L]."""
        cfg = self.cfg
        mask = jnp.asarray(batch["mask"], bool)
        b, l = mask.shape
        if l > cfg.max_seq_len:
            raise ValueError(f"sequence length {l} exceeds FoundationConfig.max_seq_len={cfg.max_seq_len}")
        actions = jnp.clip(jnp.where(mask, batch["actions"], 0), 0, cfg.num_actions - 1)
        surfaces = jnp.clip(jnp.where(mask, batch["surfaces"], 0), 0, cfg.num_surfaces - 1)
        if cfg.item_space == "projected":
            items = self.item_in(self.item_ln(items))
        x = items.astype(self.pos_emb.dtype) + self.surface_emb(surfaces) + self.pos_emb(jnp.arange(l))[None]
        if cfg.action_inputs:
            x = x + self.action_emb(actions)
        if cfg.time_encoding != "none":
            x = x + self.time_features(batch["timestamps"], mask)
        return self.dropout(x), mask


class FoundationModel(SequenceEncoder):
    """The dense part of the foundation model: the `SequenceEncoder` plus its heads. Call:
    `model(embeddings, batch) -> dict` with

      hidden        [B, L, d_model]  final-LN transformer output (the user representation at each event)
      query         [B, L, E]        retrieval query (E = cfg.item_out_dim), L2-normalised
      item          [B, L, E]        item vector of each event (combined lookups), L2-normalised
      engage_logits [B, L-1]         logit that event t+1 is engaged, from history <= t and item t+1
      corpus        [B, C, E]        (full_softmax only) item vectors of every table row laid over the batch
                                     (`corpus_ids`), normalised like `item`

    Dropout follows nnx's train/eval switch (`model.train()` / `model.eval()`); it is a no-op at rate 0.
    """

    def __init__(self, cfg: FoundationConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)  # the encoder's parameters first: creation order fixes their init
        d, e = cfg.d_model, cfg.item_out_dim
        if cfg.item_space == "projected":
            self.query = Linear(d, e, rngs=rngs)
        self.engage_item = Linear(e, d, rngs=rngs)
        self.engage_hidden = Linear(2 * d, d, rngs=rngs)
        self.engage_out = Linear(d, 1, rngs=rngs)
        if cfg.seen_item_bias:
            self.seen_bias = nnx.Param(jnp.zeros((), jnp.float32))

    def __call__(self, embeddings: Mapping, batch: Mapping) -> dict:
        mask = jnp.asarray(batch["mask"], bool)
        items = self.item_vectors(embeddings, mask)
        hidden = self.encode(items, batch)
        unit = self.cfg.similarity == "cosine"
        query = self.query_vector(hidden)
        item_n = _l2norm(items)
        nxt = self.engage_item(item_n[:, 1:])
        z = jax.nn.gelu(self.engage_hidden(jnp.concatenate([hidden[:, :-1], nxt], axis=-1)))
        engage = self.engage_out(z)[..., 0]
        if self.cfg.engage_weight == 0:  # reported, not trained: no backward pass through the head
            engage = jax.lax.stop_gradient(engage)
        out = {"hidden": hidden, "query": query, "item": item_n, "engage_logits": engage}
        corpus = corpus_feature(self.cfg)
        if self.cfg.seen_item_bias:
            out["seen_bias"] = jnp.broadcast_to(self.seen_offset(), mask.shape[:1])  # batch-major, as all outputs
        if corpus is not None:
            out["corpus"] = self.corpus_vectors(embeddings)
            if not unit:
                out["item"] = jnp.where(mask[..., None], combine_items(self.cfg, embeddings), 0.0)
        return out

    def last_query(self, embeddings: Mapping, batch: Mapping) -> jax.Array:
        """The retrieval query after each row's last valid event [B, E]: `__call__`'s `query` there, through
        `encode_last` and without the engagement head (ranking reads nothing else)."""
        mask = jnp.asarray(batch["mask"], bool)
        return self.query_vector(self.encode_last(self.item_vectors(embeddings, mask), batch))

    def query_vector(self, hidden) -> jax.Array:
        """hidden [..., d_model] -> the retrieval query [..., E] (L2-normalised under cosine similarity)."""
        query = self.query(hidden) if self.cfg.item_space == "projected" else hidden
        return _l2norm(query) if self.cfg.similarity == "cosine" else query

    def corpus_vectors(self, embeddings: Mapping) -> jax.Array:
        """The batch-laid corpus lookup [B, C, E] (full_softmax), normalised like the queries."""
        vectors = jnp.asarray(embeddings[corpus_feature(self.cfg)], jnp.float32)
        return _l2norm(vectors) if self.cfg.similarity == "cosine" else vectors

    def seen_offset(self) -> jax.Array:
        """The trained seen-item offset: `seen_item_bias_scale` x one scalar parameter."""
        return self.cfg.seen_item_bias_scale * self.seen_bias[...]


def _l2norm(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def info_nce(query, target, valid, target_ids, *, temperature: float, max_negatives: int = 0, k: int = 10):
    """InfoNCE with in-batch negatives and accidental-hit removal.

    Args:
      query: [N, E] queries; target: [N, E] their positives; valid: [N] bool; target_ids: [N] raw item ids.
      The candidate pool is every target (or a strided `max_negatives` subset). Pool entries whose item
      id equals the query's target (including the positive itself) are removed from the negatives, so
      popular items are not pushed away from themselves.
    Returns (mean loss over valid rows, recall@k over valid rows, number of valid rows).
    """
    n = query.shape[0]
    idx = np.arange(n) if not max_negatives or max_negatives >= n else (np.arange(max_negatives) * n // max_negatives)
    pool, pool_valid, pool_ids = target[idx], valid[idx], target_ids[idx]
    pos = jnp.sum(query * target, axis=-1) / temperature  # [N]
    neg = query @ pool.T / temperature  # [N, M]
    neg_ok = pool_valid[None, :] & (pool_ids[None, :] != target_ids[:, None])
    neg = jnp.where(neg_ok, neg, -jnp.inf)
    lse = jnp.logaddexp(pos, jax.nn.logsumexp(neg, axis=-1))
    count = jnp.maximum(jnp.sum(valid), 1)
    loss = jnp.sum(jnp.where(valid, lse - pos, 0.0)) / count
    rank = jnp.sum(neg_ok & (neg > pos[:, None]), axis=-1)
    recall = jnp.sum(valid & (rank < k)) / count
    return loss, recall, jnp.sum(valid)


def foundation_loss(model: FoundationModel, embeddings: Mapping, batch: Mapping):
    """(loss, metrics). Loss = retrieval_weight * InfoNCE + engage_weight * BCE, both over the pairs
    (t, t+1) where both events are real. Scalar metrics are 0-d; engage_probs/engage_labels/engage_weights
    ([B, L-1]) are returned for AUC."""
    return foundation_objective(model.cfg, model(embeddings, batch), batch)


def foundation_forward(model: FoundationModel, embeddings: Mapping, batch: Mapping) -> dict:
    """The per-example part of the loss (every output is batch-major): the model's forward pass."""
    return model(embeddings, batch)


def table_rows(cfg: FoundationConfig, item_ids):
    """Rows of the (single, full-softmax) item table of raw item ids, -1 kept: the first table's mapping."""
    return hash_ids(jnp.asarray(item_ids, jnp.int32), 0, cfg.item_rows, num_tables=1, vocab=cfg.vocab)


def next_items(cfg: FoundationConfig, batch: Mapping):
    """(table rows [B, L], valid [B, L]): the item each position should predict. Position t predicts event
    t+1 of the history; the last event predicts the example's target (`target_item_ids`) when the batch has
    one (a sequence store's examples do), so every target of the data is trained on."""
    mask = jnp.asarray(batch["mask"], bool)
    rows = table_rows(cfg, batch["item_ids"])
    nxt = jnp.concatenate([rows[:, 1:], jnp.full_like(rows[:, :1], -1)], axis=1)
    valid = jnp.concatenate([mask[:, :-1] & mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)
    if TARGET_KEY in batch:
        target = table_rows(cfg, batch[TARGET_KEY])
        last = jnp.sum(mask, axis=1) - 1  # the last event of a right-padded history
        at_last = (jnp.arange(mask.shape[1])[None] == last[:, None]) & (target[:, None] >= 0)
        nxt = jnp.where(at_last, target[:, None], nxt)
        valid = valid | at_last
    if cfg.loss_last_positions:
        pos = jnp.arange(mask.shape[1])[None]
        last = jnp.max(jnp.where(valid, pos, -1), axis=1)  # the last position that has a next item
        valid = valid & (pos > last[:, None] - cfg.loss_last_positions)
    return nxt, valid & (nxt >= cfg.reserved_rows)


def corpus_matrix(cfg: FoundationConfig, corpus) -> jax.Array:
    """[item_rows, E]: the vector of every table row, from the batch-laid `corpus` lookup [B, C, E]."""
    return corpus.reshape(-1, corpus.shape[-1])[: cfg.item_rows]


def candidate_scores(cfg: FoundationConfig, query, corpus, seen=None, seen_bias=None):
    """query [..., E] x corpus [N, E] -> scores [..., N] / temperature, plus `seen_bias` where `seen` [..., N]
    (items already in the history); reserved rows are -inf."""
    scores = jnp.einsum("...e,ne->...n", query, corpus, preferred_element_type=jnp.float32) / cfg.temperature
    if seen is not None:
        scores = scores + seen_bias * seen
    keep = jnp.arange(corpus.shape[0]) >= cfg.reserved_rows
    return jnp.where(keep, scores, -jnp.inf)


def first_positions(cfg: FoundationConfig, batch: Mapping) -> jax.Array:
    """int32 [B, item_rows]: the first position of each item row in the history, L where it does not occur.
    The causal seen set at position t is `t >= first`: [B, L] -> [B, N] by one scatter, never a [B, L, N]
    one-hot and its cumulative sum."""
    rows = table_rows(cfg, batch["item_ids"])
    b, l = rows.shape
    at = jnp.where(rows >= 0, rows, cfg.item_rows)  # padding lands out of range and is dropped
    pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    first = jnp.full((b, cfg.item_rows), l, jnp.int32)
    return first.at[jnp.arange(b)[:, None], at].min(pos, mode="drop")


def seen_items(cfg: FoundationConfig, batch: Mapping, *, causal: bool):
    """float [B, L, N] (causal: the items of events <= t at position t) or [B, N] (the whole history): 1 where
    the item row occurs in the history."""
    first = first_positions(cfg, batch)
    l = jnp.shape(batch["item_ids"])[1]
    if causal:
        return (jnp.arange(l)[None, :, None] >= first[:, None, :]).astype(jnp.float32)
    return (first < l).astype(jnp.float32)


def loss_positions(cfg: FoundationConfig, batch: Mapping):
    """(positions [B, P], next item rows [B, P], valid [B, P]): the positions whose next item the full softmax
    predicts. P = loss_last_positions when it is set and shorter than the history (the k positions ending at
    each row's last valid one: every valid position of `next_items` lies in that window), else every position."""
    nxt, valid = next_items(cfg, batch)
    b, l = valid.shape
    pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    k = cfg.loss_last_positions
    if not k or k >= l:
        return pos, nxt, valid
    last = jnp.max(jnp.where(valid, pos, -1), axis=1)
    sel = last[:, None] - k + 1 + jnp.arange(k, dtype=jnp.int32)[None]
    inside = sel >= 0
    sel = jnp.maximum(sel, 0)
    return sel, jnp.take_along_axis(nxt, sel, axis=1), jnp.take_along_axis(valid, sel, axis=1) & inside


def full_softmax(cfg: FoundationConfig, out: Mapping, batch: Mapping):
    """Cross-entropy of every position's next item against every table row (SASRec's objective).
    Returns (mean loss, recall@recall_k, number of predicted positions).

    Computed by `softmax_cross_entropy` (cache-sized chunks of positions, padding skipped, gradients in the
    same pass) at the positions that enter the loss only (`loss_positions`): the same function as scoring
    [B, L, N] logits and masking."""
    pos, nxt, valid = loss_positions(cfg, batch)
    query = jnp.take_along_axis(out["query"], pos[..., None], axis=1)
    if cfg.seen_item_bias:
        first, bias = first_positions(cfg, batch), out["seen_bias"][0]
    else:
        first, bias = jnp.zeros((pos.shape[0], 0), jnp.int32), jnp.zeros((), jnp.float32)
    xent = CrossEntropy(cfg.temperature, cfg.reserved_rows, cfg.recall_k, cfg.seen_item_bias)
    args = (query, corpus_matrix(cfg, out["corpus"]), bias, nxt, valid, pos, first)
    mesh = batch_mesh(pos.shape[0])
    if mesh is None:
        nll, hits = softmax_cross_entropy(xent, *args)
    else:  # each device its own examples against the whole corpus: one reduction, not one per chunk
        ex = P(BATCH_AXES)

        def per_device(q, corpus, bias, *rest):
            # the shared corpus and bias marked per-device: their gradients are summed over devices on the way back
            corpus, bias = jax.lax.pcast((corpus, bias), BATCH_AXES, to="varying")
            return jax.lax.psum(softmax_cross_entropy(xent, q, corpus, bias, *rest), BATCH_AXES)

        local = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(ex, P(), P(), ex, ex, ex, ex),
            out_specs=P(),
        )
        nll, hits = local(*args)
    count = jnp.maximum(jnp.sum(valid), 1)
    return nll / count, hits / count, jnp.sum(valid)


@dataclasses.dataclass(frozen=True)
class CrossEntropy:
    """The static part of `softmax_cross_entropy`: score = query . row / temperature (+ bias on seen rows),
    rows < reserved never candidates; a hit is a target ranked < recall_k."""

    temperature: float
    reserved: int
    recall_k: int
    seen: bool
    chunk_elements: int = 1 << 21
    """Predicted positions are scored in chunks of about this many logits (8 MiB of float32: cache-sized)."""


XENT_SPAN = 16
"""Positions per unit of `softmax_cross_entropy`'s work: a span of one example's consecutive positions.
Spans without a predicted position are skipped; a right-padded history wastes at most XENT_SPAN - 1."""


def _live_first(live) -> jax.Array:
    """int32 [S]: a permutation of the spans that puts the live ones first, each group in its original order
    (a stable partition by counting, not a sort)."""
    count = jnp.sum(live, dtype=jnp.int32)
    dest = jnp.where(live, jnp.cumsum(live, dtype=jnp.int32) - 1, count + jnp.cumsum(~live, dtype=jnp.int32) - 1)
    return jnp.zeros_like(dest).at[dest].set(jnp.arange(live.shape[0], dtype=jnp.int32), unique_indices=True)


def _xent_chunk(x: CrossEntropy, q, corpus, bias, target, valid, pos, first, grads: bool):
    """One chunk of spans [c, u, E] over the candidate rows (the reserved ones sliced off; `q` already
    divided by the temperature; `first` [c, N] of each span's example). The elementwise work is three passes
    over the [c, u, N] scores (max and hit count; exp sums; the gradient), with the softmax's normaliser, the
    one-hot and the valid mask folded into the last."""
    logits = jnp.einsum("bpe,ne->bpn", q, corpus, preferred_element_type=jnp.float32)
    if x.seen:
        seen = pos[..., None] >= first[:, None, :]
        logits = jnp.where(seen, logits + bias, logits)
    positive = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    top = jnp.max(logits, axis=-1)
    above = jnp.sum(jnp.where(logits > positive[..., None], 1.0, 0.0), axis=-1)  # a float sum fuses; int did not
    e = jnp.exp(logits - top[..., None])
    total = jnp.sum(e, axis=-1)
    nll = jnp.sum(jnp.where(valid, top + jnp.log(total) - positive, 0.0))
    hits = jnp.sum(valid & (above < x.recall_k))
    if not grads:
        return nll, hits
    # d nll / d logits = softmax - one-hot(target) on valid positions, 0 elsewhere
    scale = jnp.where(valid, 1.0 / total, 0.0)
    onehot = jnp.arange(corpus.shape[0]) == target[..., None]
    g = e * scale[..., None] - jnp.where(onehot & valid[..., None], 1.0, 0.0)
    dq = jnp.einsum("bpn,ne->bpe", g, corpus)
    dc_t = jnp.einsum("bpe,bpn->en", q, g)  # [E, N]: the small operand transposed, not the scores
    db = jnp.sum(jnp.where(seen, g, 0.0)) if x.seen else jnp.zeros((), jnp.float32)
    return nll, hits, dq, dc_t, db


def _xent_scan(x: CrossEntropy, query, corpus, bias, nxt, valid, pos, first, grads: bool):
    """Scores the spans that hold a predicted position against the candidate rows, chunk by chunk; returns
    the sums (and the gradients with respect to the unscaled query and the full corpus, reserved rows' zero).

    The positions go in spans of `XENT_SPAN`, the live spans first (`_live_first`), and a loop runs over the
    chunks that hold a live one: a right-padded batch pays for the positions it predicts, not for its padding
    (ML-1M's 200-event windows are about half padding)."""
    r = x.reserved
    cand = corpus[r:]
    b, p = valid.shape
    valid = valid & (nxt >= r)  # a reserved row is never a candidate, so it is never a target
    u = min(XENT_SPAN, p)
    per = -(-p // u)  # spans per example
    spans = b * per
    c = max(1, min(spans, x.chunk_elements // max(u * cand.shape[0], 1)))
    n = -(-spans // c)
    live = jnp.any(jnp.pad(valid, [(0, 0), (0, per * u - p)]).reshape(spans, u), axis=1)
    order = _live_first(live)

    def units(a):  # [B, P, ...] -> [n * c, u, ...]: spans, live first, padded with invalid ones
        a = jnp.pad(a, [(0, 0), (0, per * u - p)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape((spans, u) + a.shape[2:])[order]
        return jnp.pad(a, [(0, n * c - spans)] + [(0, 0)] * (a.ndim - 1))

    q = units(query / x.temperature)
    target, ok, at = units(jnp.clip(nxt - r, 0, cand.shape[0] - 1)), units(valid), units(pos)
    example = jnp.pad((jnp.arange(spans, dtype=jnp.int32) // per)[order], (0, n * c - spans))
    first = first[:, r:] if x.seen else first
    chunks = -(-jnp.sum(live, dtype=jnp.int32) // c)  # the chunks that hold a live span

    def body(state):
        i, sums, dq = state

        def take(a):
            return jax.lax.dynamic_slice_in_dim(a, i * c, c)

        f = first[take(example)] if x.seen else first
        out = _xent_chunk(x, take(q), cand, bias, take(target), take(ok), take(at), f, grads=grads)
        sums = tuple(s + o for s, o in zip(sums, out[:2] + out[3:]))
        if grads:
            dq = jax.lax.dynamic_update_slice_in_dim(dq, out[2], i * c, 0)
        return i + 1, sums, dq

    # zeros like the query: the same varying axes under `shard_map` as what the chunks add to them
    sums = (jnp.zeros_like(q, shape=()), jnp.zeros_like(q, jnp.int32, shape=()))
    if grads:
        sums = sums + (jnp.zeros_like(q, shape=cand.shape[::-1]), jnp.zeros_like(q, shape=()))
    dq = jnp.zeros_like(q) if grads else jnp.zeros_like(q, shape=())
    _, sums, dq = jax.lax.while_loop(lambda s: s[0] < chunks, body, (jnp.zeros_like(chunks), sums, dq))
    if not grads:
        return sums
    nll, hits, dc_t, db = sums
    dc = jnp.concatenate([jnp.zeros((r, corpus.shape[1]), jnp.float32), dc_t.T])
    # back to [B, P, E]: span k of the partition is span order[k]; the spans never scored get 0
    dq = jnp.zeros_like(dq[:spans]).at[order].set(dq[:spans], unique_indices=True)
    return (nll, hits, dc, db), dq.reshape(b, per * u, -1)[:, :p] / x.temperature


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def softmax_cross_entropy(x: CrossEntropy, query, corpus, bias, nxt, valid, pos, first):
    """(summed negative log-likelihood, hits) of the next items `nxt` [B, P] at the `valid` positions, scored
    against every row of `corpus` [N, E] by `query` [B, P, E] (plus `bias` where `pos` >= `first` [B, N]: the
    row was seen by then). The logits are never materialised whole: positions go in cache-sized chunks (of
    `XENT_SPAN`-position spans; spans with no valid position are never scored), and under differentiation
    each chunk's gradients (softmax - one-hot) are formed in the same pass, so the [B, P, N] scores are
    computed once, not kept for the backward pass."""
    return _xent_scan(x, query, corpus, bias, nxt, valid, pos, first, grads=False)


def _softmax_cross_entropy_fwd(x, query, corpus, bias, nxt, valid, pos, first):
    (nll, hits, dc, db), dq = _xent_scan(x, query, corpus, bias, nxt, valid, pos, first, grads=True)
    return (nll, hits), (dq, dc, db, nxt, valid, pos, first)


def _softmax_cross_entropy_bwd(x, res, cotangents):
    dq, dc, db, nxt, valid, pos, first = res
    g = cotangents[0]
    zeros = [np.zeros(a.shape, jax.dtypes.float0) for a in (nxt, valid, pos, first)]
    return (g * dq, g * dc, g * db, *zeros)


softmax_cross_entropy.defvjp(_softmax_cross_entropy_fwd, _softmax_cross_entropy_bwd)


def foundation_score(model: FoundationModel, embeddings: Mapping, batch: Mapping):
    """Full-corpus ranking (`jaxscale.evaluate`): (scores [B, item_rows], target rows [B], -1 when none).
    The user is the query after the last valid event of the history (`FoundationModel.last_query`); the
    candidates are every table row except the reserved ones (-inf). Needs retrieval_loss='full_softmax' (the
    corpus rides in the lookup)."""
    cfg = model.cfg
    if corpus_feature(cfg) is None:
        raise ValueError("foundation_score needs FoundationConfig.retrieval_loss='full_softmax'")
    mask = jnp.asarray(batch["mask"], bool)
    query = model.last_query(embeddings, batch)
    seen = seen_items(cfg, batch, causal=False) if cfg.seen_item_bias else None
    bias = model.seen_offset() if cfg.seen_item_bias else None
    scores = candidate_scores(cfg, query, corpus_matrix(cfg, model.corpus_vectors(embeddings)), seen, bias)
    if TARGET_KEY in batch:
        target = table_rows(cfg, batch[TARGET_KEY])
    else:
        target = jnp.full(mask.shape[:1], -1, jnp.int32)
    return scores, target


def foundation_objective(cfg: FoundationConfig, out: Mapping, batch: Mapping):
    """The batch-coupled part of the loss (in-batch negatives, or the full table) from the forward's outputs:
    (loss, metrics)."""
    mask = jnp.asarray(batch["mask"], bool)
    pair = mask[:, :-1] & mask[:, 1:]
    e = out["query"].shape[-1]
    ids = jnp.asarray(batch["item_ids"])
    if cfg.retrieval_loss == "full_softmax":
        retrieval, recall, pairs = full_softmax(cfg, out, batch)
    else:
        retrieval, recall, pairs = info_nce(
            out["query"][:, :-1].reshape(-1, e),
            out["item"][:, 1:].reshape(-1, e),
            pair.reshape(-1),
            ids[:, 1:].reshape(-1),
            temperature=cfg.temperature,
            max_negatives=cfg.max_negatives,
            k=cfg.recall_k,
        )
    logits = out["engage_logits"]
    labels = jnp.asarray(batch["engaged"], jnp.float32)[:, 1:]
    w = pair.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(w), 1.0)
    bce = jnp.sum(w * _bce(logits, labels)) / count
    acc = jnp.sum(w * ((logits > 0) == (labels > 0.5))) / count
    loss = cfg.retrieval_weight * retrieval + cfg.engage_weight * bce
    metrics = {
        "loss": loss,
        "retrieval_loss": retrieval,
        f"recall@{cfg.recall_k}": recall,
        "engage_loss": bce,
        "engage_accuracy": acc,
        "pairs": pairs,
        "engage_probs": jax.nn.sigmoid(logits),
        "engage_labels": labels,
        "engage_weights": w,
    }
    return loss, metrics


def _bce(logits, labels):
    return jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits)))


def _synthetic(cfg: FoundationConfig, global_batch: int, data, split: str):
    from jaxscale_models.foundation_data import SyntheticFoundationData

    return SyntheticFoundationData(
        cfg,
        global_batch,
        data.seed,
        split=split,
        zipf_exponent=data.zipf_exponent,
        num_clusters=data.num_clusters,
        scramble=data.scramble_ids,
    )


def _parquet_columns(cfg: FoundationConfig):
    from jaxscale_models.foundation_data import SyntheticFoundationData

    return list(SyntheticFoundationData.columns), cfg.max_seq_len


def _summarize(cfg: FoundationConfig, batches: list) -> dict:
    """Engagement AUC over the real (t, t+1) pairs of the whole eval set."""
    cat = lambda k: np.concatenate([np.asarray(b[k]).reshape(-1) for b in batches])  # noqa: E731
    keep = cat("engage_weights") > 0
    return {"auc": auc(cat("engage_labels")[keep], cat("engage_probs")[keep])}


def _sequence_store(cfg: FoundationConfig, config, split: str, process_index: int, process_count: int):
    """`data.source: sequences`: point-in-time examples from a `jaxscale.sequences` store, through Grain."""
    from jaxscale.sequences.examples import SequenceBatches, check_item_rows

    batches = SequenceBatches.from_config(cfg, config, split, process_index, process_count)
    check_item_rows(batches.source.reader.vocabulary("item_id"), cfg.item_rows, "model.foundation")
    return batches


SPEC = ModelSpec(
    kind="foundation",
    config=FoundationConfig,
    tables=foundation_tables,
    ids=foundation_ids,
    build=lambda cfg, rngs: FoundationModel(cfg, rngs=rngs),
    loss=foundation_loss,
    forward=foundation_forward,
    objective=foundation_objective,
    synthetic=_synthetic,
    parquet_columns=_parquet_columns,
    summarize=_summarize,
    data_sources={"sequences": _sequence_store},
    score=foundation_score,
)
