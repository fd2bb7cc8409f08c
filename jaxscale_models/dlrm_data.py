"""Synthetic click logs for DLRM, with a learnable label.

Batch keys: dense float32 [B, num_dense]; sparse_i int32 [B, hotness_i] (-1 padded); label float32 [B].
"""

from __future__ import annotations

import numpy as np

from jaxscale.training.data import (
    Column,
    ZipfSampler,
    check_batch,
    check_split,
    coprime_multiplier,
    example_indices,
    hash64,
    normal,
    uniform,
)

# Purpose tags: each independent random quantity hashes its own tag (disjoint from the foundation data's).
_T_DENSE, _T_DENSE2, _T_HOT, _T_SPARSE, _T_VALUE, _T_LABEL, _T_DW = range(17, 24)


class SyntheticDLRMData:
    """Click logs with a learnable label: each (feature, id) has a hidden value in [-1, 1]; the label is
    Bernoulli(sigmoid(sum of per-feature pooled values + a feature-0 x feature-1 interaction + a hidden
    linear function of log dense counts)). Ids are Zipf per table; each example has 1..hotness ids per
    feature (right-padded with -1). Dense features are lognormal counts."""

    def __init__(
        self,
        cfg,
        global_batch: int,
        seed: int = 0,
        *,
        split: str = "train",
        zipf_exponent: float = 1.1,
        scramble: bool = False,
    ):
        self.cfg = cfg
        self.global_batch = check_batch(global_batch)
        self.seed, self.split, self.split_id = int(seed), split, check_split(split)
        self.zipf_exponent, self.scramble = zipf_exponent, scramble
        self.rows, self.hot = cfg.table_rows(), cfg.hotness()
        self.names = tuple(f"sparse_{i}" for i in range(cfg.num_sparse_features))
        self.samplers = [ZipfSampler(r, zipf_exponent) for r in self.rows]
        self.multipliers = [coprime_multiplier(r) for r in self.rows]
        self.dense_mu = 1.0 + 2.0 * uniform(self.seed, _T_DW, np.arange(cfg.num_dense), 0)
        self.dense_w = 0.6 * (2.0 * uniform(self.seed, _T_DW, np.arange(cfg.num_dense), 1) - 1.0)
        self.columns = {
            "dense": Column("fixed", 0.0),
            "label": Column("scalar", 0.0),
            **{n: Column("seq", -1, n) for n in self.names},
        }

    def held_out(self) -> SyntheticDLRMData:
        return SyntheticDLRMData(
            self.cfg,
            self.global_batch,
            self.seed,
            split="eval",
            zipf_exponent=self.zipf_exponent,
            scramble=self.scramble,
        )

    def value(self, feature: int, ids):
        return 2.0 * uniform(self.seed, _T_VALUE, feature, ids) - 1.0

    def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        cfg = self.cfg
        gi = example_indices(self.global_batch, process_index, process_count)
        ex = hash64(self.seed, self.split_id, step, gi)[:, None]  # [b, 1]
        j = np.arange(cfg.num_dense)[None]
        log_dense = self.dense_mu + normal(ex, _T_DENSE, j)
        dense = np.floor(np.exp(log_dense)).astype(np.float32)
        logit = (np.log1p(dense) - self.dense_mu - 0.5) @ self.dense_w - 0.5
        out = {"dense": dense}
        pooled = []
        for f, (name, rows, hot) in enumerate(zip(self.names, self.rows, self.hot)):
            k = np.arange(hot)[None]
            count = 1 + np.floor(uniform(ex[:, 0], _T_HOT, f) * hot).astype(np.int64)
            ids = self.samplers[f](uniform(ex, _T_SPARSE, f, k))
            if self.scramble:
                ids = (ids * self.multipliers[f] + f) % rows
            valid = k < count[:, None]
            out[name] = np.where(valid, ids, -1).astype(np.int32)
            pooled.append((self.value(f, ids) * valid).sum(1) / count)
            logit = logit + 1.5 * pooled[-1]
        if len(pooled) > 1:
            logit = logit + 2.0 * pooled[0] * pooled[1]
        out["label"] = (uniform(ex[:, 0], _T_LABEL) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return out
