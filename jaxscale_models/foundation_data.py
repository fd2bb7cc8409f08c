"""Synthetic user-activity sequences for the foundation model, with a hidden structure it can learn.

Batch keys (int32 unless noted, [B, L], right-padded):
  item_ids    raw item ids in [0, cfg.vocab), -1 = padding
  timestamps  unix seconds, -1 = padding
  actions     0 = not engaged, 1..num_actions-1 = engagement types, -1 = padding
  surfaces    [0, num_surfaces), -1 = padding
  engaged     float32 0/1 label, 0 on padding
  mask        bool, item_ids >= 0
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

# Purpose tags: each independent random quantity hashes its own tag.
_T_USER, _T_LEN, _T_LEN2, _T_TASTE, _T_HOME, _T_MOVE, _T_JUMP, _T_ITEM, _T_SURF, _T_ENG, _T_ACT = range(1, 12)
_T_START, _T_GAP, _T_GAP2, _T_ITASTE, _T_IQUAL = range(12, 17)


class SyntheticFoundationData:
    """User activity sequences with a hidden structure the foundation model can learn.

    The item world (fixed by `seed`): item ids are grouped into `num_clusters` hidden clusters; clusters
    and items have hidden taste signs, items a hidden quality. A user has a home cluster and a taste sign;
    each next event stays in the current cluster (p_stay), moves to the cluster's hidden successor
    (p_next) or jumps at random. Within a cluster items are Zipf-popular. Engagement is
    Bernoulli(sigmoid(user taste x (cluster taste + item taste) + item quality + surface bias)), so it is
    predictable from the next item and from the user's past actions (which reveal the user's taste).
    Sequence lengths are lognormal (median `median_len_frac` * max_seq_len), truncated to
    [min_len, max_seq_len].

    With `scramble=False` the hottest items are the lowest ids (worst case for contiguous row sharding);
    `scramble=True` maps ids through a bijection of [0, vocab) so hot ids are spread.
    """

    columns = {
        "item_ids": Column("seq", -1, "item_ids"),
        "timestamps": Column("seq", -1, "item_ids"),
        "actions": Column("seq", -1, "item_ids"),
        "surfaces": Column("seq", -1, "item_ids"),
        "engaged": Column("seq", 0.0, "item_ids"),
        "mask": Column("derived", False),
    }

    def __init__(
        self,
        cfg,
        global_batch: int,
        seed: int = 0,
        *,
        split: str = "train",
        zipf_exponent: float = 1.1,
        num_clusters: int = 32,
        p_stay: float = 0.7,
        p_next: float = 0.2,
        median_len_frac: float = 0.5,
        len_sigma: float = 0.6,
        min_len: int = 2,
        scramble: bool = False,
    ):
        self.cfg = cfg
        self.global_batch = check_batch(global_batch)
        self.seed, self.split, self.split_id = int(seed), split, check_split(split)
        self.zipf_exponent = zipf_exponent
        vocab = cfg.vocab
        if not (isinstance(num_clusters, int) and 1 <= num_clusters <= vocab):
            raise ValueError(f"num_clusters must be an integer in [1, vocab={vocab}], got {num_clusters!r}")
        if not (0 <= p_stay and 0 <= p_next and p_stay + p_next <= 1):
            raise ValueError(f"need p_stay, p_next >= 0 and p_stay + p_next <= 1, got {p_stay}, {p_next}")
        if not (0 < median_len_frac <= 1 and len_sigma >= 0):
            raise ValueError(f"need 0 < median_len_frac <= 1 and len_sigma >= 0, got {median_len_frac}, {len_sigma}")
        if not (isinstance(min_len, int) and 1 <= min_len <= cfg.max_seq_len):
            raise ValueError(f"min_len must be an integer in [1, max_seq_len={cfg.max_seq_len}], got {min_len!r}")
        self.num_clusters, self.p_stay, self.p_next = num_clusters, p_stay, p_next
        self.median_len_frac, self.len_sigma, self.min_len = median_len_frac, len_sigma, min_len
        self.scramble = scramble
        self.per_cluster = vocab // num_clusters
        self.zipf = ZipfSampler(self.per_cluster, zipf_exponent)
        world = np.random.default_rng([self.seed, 7])
        self.successor = world.permutation(num_clusters)
        self.cluster_taste = np.where(world.random(num_clusters) < 0.5, 1.0, -1.0)
        self.multiplier = coprime_multiplier(vocab)
        self.offset = int(hash64(self.seed, 99) % np.uint64(vocab))
        self.surface_probs = 0.5 ** np.arange(cfg.num_surfaces)
        self.surface_probs /= self.surface_probs.sum()
        self.surface_bias = np.linspace(0.5, -0.5, cfg.num_surfaces) if cfg.num_surfaces > 1 else np.zeros(1)

    def held_out(self) -> SyntheticFoundationData:
        """The eval split: the same item world, a disjoint stream of users."""
        return self._with_split("eval")

    def _with_split(self, split):
        return SyntheticFoundationData(
            self.cfg,
            self.global_batch,
            self.seed,
            split=split,
            zipf_exponent=self.zipf_exponent,
            num_clusters=self.num_clusters,
            p_stay=self.p_stay,
            p_next=self.p_next,
            median_len_frac=self.median_len_frac,
            len_sigma=self.len_sigma,
            min_len=self.min_len,
            scramble=self.scramble,
        )

    def item_id(self, cluster: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """The raw id of the `rank`-th most popular item of `cluster`."""
        base = rank * self.num_clusters + cluster
        if self.scramble:
            base = (base * self.multiplier + self.offset) % self.cfg.vocab
        return base

    def item_taste(self, ids):
        return np.where(hash64(self.seed, _T_ITASTE, ids) & np.uint64(1), 1.0, -1.0)

    def item_quality(self, ids):
        return uniform(self.seed, _T_IQUAL, ids) - 0.5

    def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        cfg, L, C = self.cfg, self.cfg.max_seq_len, self.num_clusters
        gi = example_indices(self.global_batch, process_index, process_count)
        user = hash64(self.seed, self.split_id, _T_USER, step, gi)[:, None]  # [b, 1]
        t = np.arange(L)[None, :]
        median = max(self.min_len, self.median_len_frac * L)
        length = np.clip(
            np.round(median * np.exp(self.len_sigma * normal(user[:, 0], _T_LEN))), self.min_len, L
        ).astype(np.int64)
        mask = t < length[:, None]

        # Cluster walk: the only sequential part; everything random is precomputed as [b, L].
        move = uniform(user, t, _T_MOVE)
        jump = (hash64(user, t, _T_JUMP) % np.uint64(C)).astype(np.int64)
        cluster = np.empty(move.shape, np.int64)
        cluster[:, 0] = (hash64(user[:, 0], _T_HOME) % np.uint64(C)).astype(np.int64)
        for i in range(1, L):
            prev = cluster[:, i - 1]
            cluster[:, i] = np.where(
                move[:, i] < self.p_stay,
                prev,
                np.where(move[:, i] < self.p_stay + self.p_next, self.successor[prev], jump[:, i]),
            )
        ids = self.item_id(cluster, self.zipf(uniform(user, t, _T_ITEM)))

        surf = np.searchsorted(np.cumsum(self.surface_probs)[:-1], uniform(user, t, _T_SURF), side="right")
        taste = np.where(hash64(user, _T_TASTE) & np.uint64(1), 1.0, -1.0)
        logit = (
            2.0 * taste * self.cluster_taste[cluster]
            + 0.5 * taste * self.item_taste(ids)
            + 2.0 * self.item_quality(ids)
            + self.surface_bias[surf]
            - 0.2
        )
        engaged = uniform(user, t, _T_ENG) < 1.0 / (1.0 + np.exp(-logit))
        kinds = max(cfg.num_actions - 1, 1)
        actions = np.where(engaged, 1 + np.floor(uniform(user, t, _T_ACT) * kinds), 0).astype(np.int64)
        actions = np.minimum(actions, cfg.num_actions - 1)

        # Gaps: lognormal seconds, longer after an engaged event; kept so timestamps fit int32.
        gap_max = max(1.0, min(1e6, (2**31 - 1 - 1.75e9) / L))
        prev_eng = np.concatenate([np.zeros_like(engaged[:, :1]), engaged[:, :-1]], axis=1)
        gap = np.clip(np.exp(4.0 + 1.0 * prev_eng + 1.5 * normal(user, t, _T_GAP)), 1.0, gap_max)
        gap[:, 0] = 0.0
        start = 1.6e9 + np.floor(uniform(user[:, 0], _T_START) * 1.5e8)
        ts = (start[:, None] + np.cumsum(np.floor(gap), axis=1)).astype(np.int64)

        def pad(x, v):
            return np.where(mask, x, v)

        return {
            "item_ids": pad(ids, -1).astype(np.int32),
            "timestamps": pad(ts, -1).astype(np.int32),
            "actions": pad(actions, -1).astype(np.int32),
            "surfaces": pad(surf, -1).astype(np.int32),
            "engaged": pad(engaged, 0).astype(np.float32),
            "mask": mask,
        }
