"""Synthetic retrieval requests with a planted context signal, for the contextual two-tower model.

An example is one request: a user's history of events, the request's context, and the item the user
engaged with next (the label). Batch keys (int32 unless noted; [B, L] keys are right-padded with -1):

  item_ids, item_categories, timestamps, actions, surfaces   [B, L] the history (foundation-model names)
  mask                 bool [B, L]  item_ids >= 0
  context_category     [B]  category of the request's subject item as a classifier sees it; -1 = missing
  context_confidence   f32 [B]  the classifier's confidence in [0, 1]; 0 when missing
  context_surface      [B]  surface of the request; -1 = missing
  context_hour         [B]  hour of day (UTC) of the request, 0..23; -1 = missing
  label_item           [B]  the next item; -1 = no label (the row is ignored)
  label_category       [B]  its category
  corpus_items, corpus_categories  [B, ceil(item_rows / global_batch)]  (eval split by default) every item
                       id of the corpus once, laid out row-major over the global batch (-1 beyond the
                       corpus), so the trainer's eval step can compute every item vector for the exact
                       full-corpus recall (`ModelSpec.summarize`).

The world (fixed by `seed`): `item_rows` items in `num_categories` categories of equal size, Zipf-popular
inside a category. A user's history is a category walk (stay / move to the category's hidden successor /
jump), items Zipf within the category. The request has a surface, an hour and (unless missing, rate
`missing_context_rate`) a subject item of a uniformly random category. The label's category is

  * the subject's category with probability `context_strength[surface]` (the planted context signal: the
    history cannot predict it), otherwise
  * history-driven: the last event's category (probability `p_label_stay`) or that category's successor
    for the request's part of the day (one hidden successor permutation per 6-hour daypart, so the hour
    matters as well).

The classifier that names the subject's category is right with probability = its confidence (uniform in
`confidence_range`), else it names a random category.

Pseudo-context (`pseudo_context`, default on the train split): logged training examples have no request
context for the subject item, so it is derived from the positive label, as the model's training recipe
prescribes: the context category is the label's category with probability = a drawn confidence, else a
random category (`derive_pseudo_context`). Surface and hour are the request's real ones. The eval split
carries the real request context.
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

# What a batch holds (the model reads these keys; every source of this model writes them).
HISTORY_KEYS = ("item_ids", "item_categories", "timestamps", "actions", "surfaces", "mask")
CONTEXT_KEYS = ("context_category", "context_confidence", "context_surface", "context_hour")
LABEL_KEYS = ("label_item", "label_category")
CORPUS_KEYS = ("corpus_items", "corpus_categories")

HOURS = 24
DAYPARTS = 4  # 6-hour parts of the day, each with its own hidden category successor

# Purpose tags: each independent random quantity hashes its own tag.
(
    _T_USER,
    _T_LEN,
    _T_HOME,
    _T_MOVE,
    _T_JUMP,
    _T_ITEM,
    _T_SURF,
    _T_ENG,
    _T_ACT,
    _T_START,
    _T_GAP,
    _T_RGAP,
    _T_RSURF,
    _T_SUBJ,
    _T_MISS,
    _T_INTENT,
    _T_HIST,
    _T_LABEL,
    _T_CONF,
    _T_RIGHT,
    _T_WRONG,
) = range(1, 22)


def derive_pseudo_context(label_category, confidence, right, wrong_category) -> tuple[np.ndarray, np.ndarray]:
    """(context category int32, context confidence float32) of training examples: the positive label's
    category when `right` (a draw that is True with probability `confidence`), else `wrong_category` (a
    random category). Labels without a category (-1) give a missing context (-1, confidence 0).
    Arguments are NumPy arrays of one shape."""
    label_category = np.asarray(label_category)
    known = label_category >= 0
    category = np.where(known, np.where(np.asarray(right), label_category, np.asarray(wrong_category)), -1)
    return category.astype(np.int32), np.where(known, np.asarray(confidence, np.float32), 0.0).astype(np.float32)


def corpus_layout(item_rows: int, global_batch: int, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` (global example indices) of the corpus laid out row-major over the global batch:
    int32 [len(rows), ceil(item_rows / global_batch)], -1 beyond the corpus."""
    width = -(-item_rows // global_batch)
    ids = np.asarray(rows, np.int64)[:, None] * width + np.arange(width)[None, :]
    return np.where(ids < item_rows, ids, -1).astype(np.int32)


class SyntheticContextualData:
    """Requests of a planted-context world (see the module docstring); `batch(step, process_index,
    process_count)` returns that process's rows of step `step`, deterministic per (seed, split, step, example).
    """

    columns = {
        "item_ids": Column("seq", -1, "item_ids"),
        "item_categories": Column("seq", -1, "item_ids"),
        "timestamps": Column("seq", -1, "item_ids"),
        "actions": Column("seq", -1, "item_ids"),
        "surfaces": Column("seq", -1, "item_ids"),
        "mask": Column("derived", False),
        "context_category": Column("scalar", -1),
        "context_confidence": Column("scalar", 0.0),
        "context_surface": Column("scalar", -1),
        "context_hour": Column("scalar", -1),
        "label_item": Column("scalar", -1),
        "label_category": Column("scalar", -1),
    }

    def __init__(
        self,
        cfg,
        global_batch: int,
        seed: int = 0,
        *,
        split: str = "train",
        zipf_exponent: float = 1.1,
        p_stay: float = 0.6,
        p_next: float = 0.3,
        context_strength: tuple[float, float] = (0.85, 0.45),
        missing_context_rate: float = 0.1,
        p_label_stay: float = 0.5,
        confidence_range: tuple[float, float] = (0.5, 1.0),
        pseudo_context: bool | None = None,
        corpus: bool | None = None,
        median_len_frac: float = 0.5,
        len_sigma: float = 0.6,
        min_len: int = 1,
        scramble: bool = True,
    ):
        self.cfg = cfg
        self.global_batch = check_batch(global_batch)
        self.seed, self.split, self.split_id = int(seed), split, check_split(split)
        C, V = cfg.num_categories, cfg.item_rows
        if V < C:
            raise ValueError(f"item_rows={V} must be >= num_categories={C} (every category needs an item)")
        for name, p in (
            ("p_stay", p_stay),
            ("p_next", p_next),
            ("missing_context_rate", missing_context_rate),
            ("p_label_stay", p_label_stay),
        ):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
        if p_stay + p_next > 1:
            raise ValueError(f"need p_stay + p_next <= 1, got {p_stay} + {p_next}")
        lo, hi = context_strength
        if not (0.0 <= lo <= 1.0 and 0.0 <= hi <= 1.0):
            raise ValueError(
                f"context_strength must be two probabilities (first, last surface), got {context_strength}"
            )
        clo, chi = confidence_range
        if not 0.0 <= clo <= chi <= 1.0:
            raise ValueError(f"confidence_range must satisfy 0 <= low <= high <= 1, got {confidence_range}")
        if not (0 < median_len_frac <= 1 and len_sigma >= 0):
            raise ValueError(f"need 0 < median_len_frac <= 1 and len_sigma >= 0, got {median_len_frac}, {len_sigma}")
        if not (isinstance(min_len, int) and 1 <= min_len <= cfg.max_seq_len):
            raise ValueError(f"min_len must be an integer in [1, max_seq_len={cfg.max_seq_len}], got {min_len!r}")
        self.zipf_exponent, self.p_stay, self.p_next = zipf_exponent, p_stay, p_next
        self.context_strength, self.missing_context_rate = (float(lo), float(hi)), missing_context_rate
        self.p_label_stay, self.confidence_range = p_label_stay, (float(clo), float(chi))
        self.pseudo_context = (split == "train") if pseudo_context is None else bool(pseudo_context)
        self.corpus = (split == "eval") if corpus is None else bool(corpus)
        self.median_len_frac, self.len_sigma, self.min_len, self.scramble = (
            median_len_frac,
            len_sigma,
            min_len,
            scramble,
        )

        self.per_category = V // C
        self.zipf = ZipfSampler(self.per_category, zipf_exponent)
        world = np.random.default_rng([self.seed, 11])
        self.successor = world.permutation(C)
        self.daypart_successor = np.stack([world.permutation(C) for _ in range(DAYPARTS)])
        self.multiplier = coprime_multiplier(V)
        self.offset = int(hash64(self.seed, 98) % np.uint64(V))
        base = np.arange(V, dtype=np.int64)
        self.item_category = np.empty(V, np.int32)  # the item metadata: category of every item id
        self.item_category[self._scramble(base)] = base % C
        S = cfg.num_surfaces
        self.surface_probs = 0.5 ** np.arange(S)
        self.surface_probs /= self.surface_probs.sum()
        self.surface_context = np.linspace(lo, hi, S) if S > 1 else np.array([lo])

    # ------------------------------------------------------------------ the item world

    def _scramble(self, base):
        return (base * self.multiplier + self.offset) % self.cfg.item_rows if self.scramble else base

    def item_id(self, category: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """The raw id of the `rank`-th most popular item of `category`."""
        return self._scramble(rank * self.cfg.num_categories + category)

    def held_out(self) -> SyntheticContextualData:
        """The eval split: the same world, a disjoint stream of users, real request context, the corpus."""
        return self.with_options(split="eval", pseudo_context=None, corpus=None)

    def with_options(self, **overrides) -> SyntheticContextualData:
        """The same generator with some constructor arguments replaced."""
        args = dict(
            split=self.split,
            zipf_exponent=self.zipf_exponent,
            p_stay=self.p_stay,
            p_next=self.p_next,
            context_strength=self.context_strength,
            missing_context_rate=self.missing_context_rate,
            p_label_stay=self.p_label_stay,
            confidence_range=self.confidence_range,
            pseudo_context=self.pseudo_context,
            corpus=self.corpus,
            median_len_frac=self.median_len_frac,
            len_sigma=self.len_sigma,
            min_len=self.min_len,
            scramble=self.scramble,
        )
        args.update(overrides)
        return SyntheticContextualData(self.cfg, self.global_batch, self.seed, **args)

    def user_ids(self, step: int, process_index: int = 0, process_count: int = 1) -> np.ndarray:
        """int64 [b] ids of the users of this process's rows of step `step` (keys of the encoder-state store)."""
        gi = example_indices(self.global_batch, process_index, process_count)
        return (hash64(self.seed, self.split_id, _T_USER, step, gi) >> np.uint64(1)).astype(np.int64)

    # ------------------------------------------------------------------ batches

    def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
        cfg, L, C = self.cfg, self.cfg.max_seq_len, self.cfg.num_categories
        gi = example_indices(self.global_batch, process_index, process_count)
        user = hash64(self.seed, self.split_id, _T_USER, step, gi)[:, None]  # [b, 1]
        u = user[:, 0]
        t = np.arange(L)[None, :]
        median = max(self.min_len, self.median_len_frac * L)
        length = np.clip(np.round(median * np.exp(self.len_sigma * normal(u, _T_LEN))), self.min_len, L).astype(
            np.int64
        )
        mask = t < length[:, None]

        category = self._walk(user, t)
        ids = self.item_id(category, self.zipf(uniform(user, t, _T_ITEM)))
        surf = self._surface(uniform(user, t, _T_SURF))
        engaged = uniform(user, t, _T_ENG) < 0.5
        kinds = max(cfg.num_actions - 1, 1)
        actions = np.where(engaged, 1 + np.floor(uniform(user, t, _T_ACT) * kinds), 0).astype(np.int64)
        actions = np.minimum(actions, cfg.num_actions - 1)
        gap_max = max(1.0, min(1e6, (2**31 - 1 - 1.75e9) / (L + 1)))
        gap = np.clip(np.exp(6.0 + 1.5 * normal(user, t, _T_GAP)), 1.0, gap_max)
        gap[:, 0] = 0.0
        start = 1.6e9 + np.floor(uniform(u, _T_START) * 1.5e8)
        ts = (start[:, None] + np.cumsum(np.floor(gap), axis=1)).astype(np.int64)

        # The request: after the last event, on some surface, at some hour, maybe about a subject item.
        rows = np.arange(len(u))
        last = length - 1
        last_category = category[rows, last]
        request_time = ts[rows, last] + np.floor(np.exp(6.0 + 1.5 * normal(u, _T_RGAP))).astype(np.int64)
        hour = (request_time // 3600) % HOURS
        daypart = hour // (HOURS // DAYPARTS)
        req_surface = self._surface(uniform(u, _T_RSURF))
        subject = (hash64(u, _T_SUBJ) % np.uint64(C)).astype(np.int64)
        has_subject = uniform(u, _T_MISS) >= self.missing_context_rate
        from_context = has_subject & (uniform(u, _T_INTENT) < self.surface_context[req_surface])
        from_history = np.where(
            uniform(u, _T_HIST) < self.p_label_stay, last_category, self.daypart_successor[daypart, last_category]
        )
        label_category = np.where(from_context, subject, from_history)
        label_item = self.item_id(label_category, self.zipf(uniform(u, _T_LABEL)))

        lo, hi = self.confidence_range
        confidence = (lo + (hi - lo) * uniform(u, _T_CONF)).astype(np.float32)
        right = uniform(u, _T_RIGHT) < confidence
        wrong = (hash64(u, _T_WRONG) % np.uint64(C)).astype(np.int64)
        if self.pseudo_context:
            ctx_category, ctx_confidence = derive_pseudo_context(label_category, confidence, right, wrong)
        else:
            ctx_category = np.where(has_subject, np.where(right, subject, wrong), -1).astype(np.int32)
            ctx_confidence = np.where(has_subject, confidence, 0.0).astype(np.float32)

        def pad(x, v=-1):
            return np.where(mask, x, v)

        out = {
            "item_ids": pad(ids).astype(np.int32),
            "item_categories": pad(category).astype(np.int32),
            "timestamps": pad(ts).astype(np.int32),
            "actions": pad(actions).astype(np.int32),
            "surfaces": pad(surf).astype(np.int32),
            "mask": mask,
            "context_category": ctx_category.astype(np.int32),
            "context_confidence": ctx_confidence.astype(np.float32),
            "context_surface": req_surface.astype(np.int32),
            "context_hour": hour.astype(np.int32),
            "label_item": label_item.astype(np.int32),
            "label_category": label_category.astype(np.int32),
        }
        if self.corpus:
            out["corpus_items"] = corpus_layout(cfg.item_rows, self.global_batch, gi)
            out["corpus_categories"] = np.where(
                out["corpus_items"] >= 0, self.item_category[np.maximum(out["corpus_items"], 0)], -1
            ).astype(np.int32)
        return out

    def _surface(self, u):
        return np.searchsorted(np.cumsum(self.surface_probs)[:-1], u, side="right")

    def _walk(self, user, t):
        """The history's category walk [b, L]: stay, move to the hidden successor, or jump."""
        C, L = self.cfg.num_categories, self.cfg.max_seq_len
        move = uniform(user, t, _T_MOVE)
        jump = (hash64(user, t, _T_JUMP) % np.uint64(C)).astype(np.int64)
        category = np.empty(move.shape, np.int64)
        category[:, 0] = (hash64(user[:, 0], _T_HOME) % np.uint64(C)).astype(np.int64)
        for i in range(1, L):
            prev = category[:, i - 1]
            category[:, i] = np.where(
                move[:, i] < self.p_stay,
                prev,
                np.where(move[:, i] < self.p_stay + self.p_next, self.successor[prev], jump[:, i]),
            )
        return category
