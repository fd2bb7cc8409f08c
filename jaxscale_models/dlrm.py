"""DLRM-style ranking model (dense features + pooled sparse embeddings -> click probability).

The sparse tables are sharded `EmbeddingCollection` tables with pooling 'sum'/'mean'; this module
consumes their pooled outputs:

    ids = dlrm_ids(cfg, batch)                  # {sparse_i: int32 [B, ids_per_feature[i]]}, -1 = padding
    emb = ec.lookup(state, ids)                 # {sparse_i: f32 [B, emb_dim]}
    loss, metrics = dlrm_loss(model, emb, batch)

`batch` keys (see `jaxscale_models.dlrm_data.SyntheticDLRMData`): dense f32 [B, num_dense] (raw non-negative counts;
the model applies log1p, as DLRM does for Criteo), sparse_i int32 [B, ids_per_feature[i]], label f32 [B].

Interactions: 'dot' (DLRM: pairwise dot products of the bottom-MLP output and every embedding; needs
bottom_mlp[-1] == emb_dim) or 'dcn' (DCNv2 cross layers over the concatenation, optionally low-rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxscale.engine.tables import TableConfig
from jaxscale.training.config import check_choice, check_int, field_error
from jaxscale.training.ranking import auc
from jaxscale.training.registry import ModelSpec

INTERACTIONS = ("dot", "dcn")

# MLPerf DLRMv2 (Criteo 1TB, multi-hot, 40M-row cap) table sizes and multi-hot sizes.
_MLPERF_ROWS = (
    40_000_000,
    39_060,
    17_295,
    7_424,
    20_265,
    3,
    7_122,
    1_543,
    63,
    40_000_000,
    3_067_956,
    405_282,
    10,
    2_209,
    11_938,
    155,
    4,
    976,
    14,
    40_000_000,
    40_000_000,
    40_000_000,
    590_152,
    12_973,
    108,
    36,
)
_MLPERF_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DLRMConfig:
    """DLRM shape. `rows` and `ids_per_feature` are one value for every feature or one per feature."""

    num_sparse_features: int = 8
    rows: int | tuple[int, ...] = 10_000
    emb_dim: int = 16
    ids_per_feature: int | tuple[int, ...] = 2
    """Multi-hot width: the max ids per example per feature (the padded length L of its id tensor)."""
    pooling: Literal["sum", "mean"] = "sum"
    num_dense: int = 13
    bottom_mlp: tuple[int, ...] = (64, 16)
    top_mlp: tuple[int, ...] = (64, 32)
    """Hidden sizes of the top MLP; a final 1-unit logit layer is added."""
    interaction: Literal["dot", "dcn"] = "dot"
    dcn_layers: int = 2
    dcn_rank: int = 0
    """Low-rank factor of the DCNv2 cross weights; 0 = full rank."""

    def __post_init__(self):
        o = "DLRMConfig"
        for f in ("num_sparse_features", "emb_dim", "num_dense", "dcn_layers"):
            check_int(o, self, f, 1)
        check_int(o, self, "dcn_rank", 0)
        for f in ("rows", "ids_per_feature"):
            value = getattr(self, f)
            values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
            if isinstance(value, (tuple, list)) and len(values) != self.num_sparse_features:
                raise field_error(o, f, f"has {len(values)} entries but num_sparse_features={self.num_sparse_features}")
            if not values or any(
                not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1 or v > 2**31 - 1 for v in values
            ):
                raise field_error(o, f, f"must be positive int32 integers, got {value!r}")
            if isinstance(value, list):
                object.__setattr__(self, f, tuple(value))
        for f in ("bottom_mlp", "top_mlp"):
            value = getattr(self, f)
            if (
                not isinstance(value, (tuple, list))
                or not value
                or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in value)
            ):
                raise field_error(o, f, f"must be a non-empty list of positive integers, got {value!r}")
            object.__setattr__(self, f, tuple(value))
        check_choice(o, self, "pooling", ("sum", "mean"))
        check_choice(o, self, "interaction", INTERACTIONS)
        if self.interaction == "dot" and self.bottom_mlp[-1] != self.emb_dim:
            raise field_error(
                o, "bottom_mlp", f"must end in emb_dim={self.emb_dim} for the 'dot' interaction, got {self.bottom_mlp}"
            )

    def table_rows(self) -> tuple[int, ...]:
        return self.rows if isinstance(self.rows, tuple) else (self.rows,) * self.num_sparse_features

    def hotness(self) -> tuple[int, ...]:
        ids = self.ids_per_feature
        return ids if isinstance(ids, tuple) else (ids,) * self.num_sparse_features

    @property
    def embedding_params(self) -> int:
        return sum(self.table_rows()) * self.emb_dim

    @classmethod
    def smoke(cls, **overrides) -> DLRMConfig:
        """8 tables of 10k x 16, 2-hot, 13 dense features: trains on CPU in seconds."""
        return cls(**overrides)

    @classmethod
    def large(cls, **overrides) -> DLRMConfig:
        """MLPerf DLRMv2 (DCNv2) shape: 26 tables, 204M rows x 128 (26B embedding params), multi-hot."""
        base = dict(
            num_sparse_features=26,
            rows=_MLPERF_ROWS,
            emb_dim=128,
            ids_per_feature=_MLPERF_HOT,
            num_dense=13,
            bottom_mlp=(512, 256, 128),
            top_mlp=(1024, 1024, 512, 256),
            interaction="dcn",
            dcn_layers=3,
            dcn_rank=512,
        )
        return cls(**(base | overrides))


def sparse_features(cfg: DLRMConfig) -> tuple[str, ...]:
    return tuple(f"sparse_{i}" for i in range(cfg.num_sparse_features))


def dlrm_tables(cfg: DLRMConfig) -> list[TableConfig]:
    """One pooled table per sparse feature (table name == feature name)."""
    return [
        TableConfig(name=f, rows=r, dim=cfg.emb_dim, pooling=cfg.pooling, features=(f,))
        for f, r in zip(sparse_features(cfg), cfg.table_rows())
    ]


def dlrm_ids(cfg: DLRMConfig, batch: Mapping) -> dict:
    """The engine's input: the batch's sparse_i arrays (already table rows)."""
    return {f: batch[f] for f in sparse_features(cfg)}


class MLP(nnx.Module):
    """ReLU MLP; `final_activation=False` leaves the last layer linear."""

    def __init__(self, sizes, *, final_activation: bool, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])
        self.final_activation = final_activation

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1 or self.final_activation:
                x = jax.nn.relu(x)
        return x


class CrossLayer(nnx.Module):
    """DCNv2: x_{l+1} = x0 * (W x_l + b) + x_l, with W = U V^T when low-rank."""

    def __init__(self, width: int, rank: int, *, rngs: nnx.Rngs):
        if rank:
            self.down = nnx.Linear(width, rank, use_bias=False, rngs=rngs)
            self.up = nnx.Linear(rank, width, rngs=rngs)
        else:
            self.full = nnx.Linear(width, width, rngs=rngs)
        self.rank = rank

    def __call__(self, x0, x):
        w = self.up(self.down(x)) if self.rank else self.full(x)
        return x0 * w + x


class DLRM(nnx.Module):
    """Call: `model(embeddings, dense) -> logits [B]`; embeddings = {sparse_i: [B, emb_dim]}."""

    def __init__(self, cfg: DLRMConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        f, d = cfg.num_sparse_features, cfg.emb_dim
        self.bottom = MLP((cfg.num_dense, *cfg.bottom_mlp), final_activation=True, rngs=rngs)
        if cfg.interaction == "dot":
            width = cfg.bottom_mlp[-1] + (f + 1) * f // 2
        else:
            width = cfg.bottom_mlp[-1] + f * d
            self.cross = nnx.List([CrossLayer(width, cfg.dcn_rank, rngs=rngs) for _ in range(cfg.dcn_layers)])
        self.top = MLP((width, *cfg.top_mlp, 1), final_activation=False, rngs=rngs)

    def __call__(self, embeddings: Mapping, dense) -> jax.Array:
        cfg = self.cfg
        x = self.bottom(jnp.log1p(jnp.maximum(jnp.asarray(dense, jnp.float32), 0.0)))
        embs = [jnp.asarray(embeddings[f], jnp.float32) for f in sparse_features(cfg)]
        if cfg.interaction == "dot":
            t = jnp.stack([x, *embs], axis=1)  # [B, F+1, D]
            z = jnp.einsum("bid,bjd->bij", t, t)
            i, j = np.tril_indices(t.shape[1], k=-1)  # distinct pairs only
            h = jnp.concatenate([x, z[:, i, j]], axis=-1)
        else:
            x0 = h = jnp.concatenate([x, *embs], axis=-1)
            for layer in self.cross:
                h = layer(x0, h)
        return self.top(h)[:, 0]


def dlrm_loss(model: DLRM, embeddings: Mapping, batch: Mapping):
    """(mean BCE, metrics): loss, accuracy, logits [B], probs [B], labels [B] (the last three for AUC)."""
    return dlrm_objective(model.cfg, dlrm_forward(model, embeddings, batch), batch)


def dlrm_forward(model: DLRM, embeddings: Mapping, batch: Mapping) -> dict:
    """The per-example part of the loss: {'logits': [B]}."""
    return {"logits": model(embeddings, batch["dense"])}


def dlrm_objective(cfg: DLRMConfig, out: Mapping, batch: Mapping):
    """Mean BCE of the logits against the labels: (loss, metrics)."""
    del cfg
    logits = out["logits"]
    labels = jnp.asarray(batch["label"], jnp.float32)
    loss = jnp.mean(jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits))))
    acc = jnp.mean((logits > 0) == (labels > 0.5))
    return loss, {"loss": loss, "accuracy": acc, "logits": logits, "probs": jax.nn.sigmoid(logits), "labels": labels}


def _synthetic(cfg: DLRMConfig, global_batch: int, data, split: str):
    from jaxscale_models.dlrm_data import SyntheticDLRMData

    return SyntheticDLRMData(
        cfg, global_batch, data.seed, split=split, zipf_exponent=data.zipf_exponent, scramble=data.scramble_ids
    )


def _parquet_columns(cfg: DLRMConfig):
    names = list(sparse_features(cfg))
    return ["dense", "label", *names], dict(zip(names, cfg.hotness()))


def _summarize(cfg: DLRMConfig, batches: list) -> dict:
    labels = np.concatenate([np.asarray(b["labels"]).reshape(-1) for b in batches])
    probs = np.concatenate([np.asarray(b["probs"]).reshape(-1) for b in batches])
    return {"auc": auc(labels, probs)}


SPEC = ModelSpec(
    kind="dlrm",
    config=DLRMConfig,
    tables=dlrm_tables,
    ids=dlrm_ids,
    build=lambda cfg, rngs: DLRM(cfg, rngs=rngs),
    loss=dlrm_loss,
    forward=dlrm_forward,
    objective=dlrm_objective,
    synthetic=_synthetic,
    parquet_columns=_parquet_columns,
    summarize=_summarize,
)

__all__ = ["DLRM", "DLRMConfig", "SPEC", "auc", "dlrm_ids", "dlrm_loss", "dlrm_tables", "sparse_features"]
