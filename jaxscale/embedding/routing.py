"""Routing requests to the shards that own them, with static-shape send buffers.

Two strategies, both typed here:

* rows: every (id, column block) is a request for one row of one owner; requests are sorted and
  de-duplicated, and each unique (owner, row) gets a position in a `[shards, capacity]` send buffer. The owner
  returns the rows and the requester pools them.
* pairs (per-bag partial sums, for pooled features with several ids per bag): every valid (row, bag) pair
  travels to its owner (no de-duplication: the owner pools its rows per bag) and one partial sum per bag
  comes back from each owner that holds a piece of the bag's table.

Request building works on NumPy or JAX arrays (`xp`), so the host counts exactly the buffers the device
fills (`jaxscale.embedding.capacity`). A request that does not fit its buffer is counted as overflow,
never dropped silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.embedding.layout import Layout


class Segment(NamedTuple):
    """Requests [start, start + size) of a rows-strategy request list: feature `feature`, column block `col_block`."""

    feature: str
    col_block: int
    start: int
    size: int


class BagSegment(NamedTuple):
    """One (feature, column block) of the pairs strategy: its bags get a partial sum on each holder."""

    feature: str
    col_block: int
    bags: int
    holders: tuple[int, ...]  # owner shards holding a piece of this column block
    offsets: tuple[int, ...]  # per owner shard: index of the first partial sum of this segment's bags


@dataclasses.dataclass(frozen=True)
class RowRequests:
    """Every (id, column block) request reading one stack, in a fixed order (see `segments`)."""

    dest: object  # int32 [n]: owner shard, or num_shards for padding / invalid ids
    row: object  # int32 [n]: row in the owner's block
    segments: tuple[Segment, ...]


@dataclasses.dataclass(frozen=True)
class RowRoute:
    """Where each request's row travels: the de-duplicated send buffer and each request's position in it."""

    send_rows: jax.Array  # int32 [S, C]: block row wanted from each owner, -1 = empty
    overflow: jax.Array  # int32 []: unique rows that did not fit
    dest: jax.Array  # int32 [n] (request order): owner, or S when no position
    position: jax.Array  # int32 [n]: position in the owner's block of the send buffer
    keep: jax.Array  # f32 [n]: 1 where the request has a position


@dataclasses.dataclass(frozen=True)
class PairRequests:
    """Every valid (row, bag) pair of the partial-sum features reading one stack."""

    dest: object  # int32 [n]: owner shard, S for padding
    row: object  # int32 [n]: row in the owner's block
    bag: object  # int32 [n]: the index of the bag's partial sum on its owner
    segments: tuple[BagSegment, ...]
    bags: int  # partial sums per owner (the largest over owners)


@dataclasses.dataclass(frozen=True)
class PairRoute:
    """The (row, bag) pairs' send buffer; a pair travels as one int32 `row * bags + bag` when that fits."""

    send: jax.Array  # int32 [S, C] packed, or [S, C, 2] unpacked; -1 = empty
    overflow: jax.Array
    packed: bool
    dest: jax.Array  # int32 [n] (request order): owner, or S when no position
    position: jax.Array  # int32 [n]: position in the owner's block of the send buffer


def _valid(x, rows: int, xp):
    return (x >= 0) & (x < rows)


def row_requests(layout: Layout, feature_table: Mapping[str, int], key: str, feats: Sequence[str], ids, xp=jnp):
    """All (feature, id, column block) requests that read stack `key`, flattened in a fixed order.

    `ids[f]` is [b, L]; the requests of (f, c) are its ids in row-major order. Returns None when no
    feature reads the stack.
    """
    S = layout.num_shards
    dest, row, segments, start = [], [], [], 0
    for f in feats:
        t_idx = feature_table[f]
        route = layout.routes[t_idx]
        if route.stack != key:
            continue
        t = layout.tables[t_idx]
        x = ids[f].reshape(-1)
        valid = _valid(x, t.stored_rows, xp)
        sid = xp.where(valid, x, 0)
        part = sid % route.row_parts if route.row_parts > 1 else xp.zeros_like(sid)
        block_row = sid // route.row_parts
        for c in range(route.col_parts):
            dest.append(xp.where(valid, xp.asarray(route.shard[:, c])[part], S))
            row.append(xp.asarray(route.offset[:, c])[part] + block_row)
            segments.append(Segment(f, c, start, x.shape[0]))
            start += x.shape[0]
    if not segments:
        return None
    return RowRequests(xp.concatenate(dest).astype(xp.int32), xp.concatenate(row).astype(xp.int32), tuple(segments))


def route_rows(req: RowRequests, num_shards: int, block_rows: int, capacity: int) -> RowRoute:
    """Sort + de-duplicate requests and give each unique (owner, row) a position in the send buffer.

    One packed sort key `owner * R + row` (fits int32: `build_layout` checks (shards + 1) * R < 2**31);
    padding carries owner S and sorts last. Positions are ranks among the owner's unique rows.
    """
    dest, row, C = req.dest, req.row, capacity
    S, R = num_shards, block_rows
    n = dest.shape[0]
    iota = jnp.arange(n, dtype=jnp.int32)
    skey, perm = jax.lax.sort((dest * R + row, iota), num_keys=1)
    new = jnp.concatenate([jnp.ones((1,), bool), skey[1:] != skey[:-1]])
    uid = jnp.cumsum(new, dtype=jnp.int32) - 1
    sd, sr = skey // R, skey % R
    uniques = jax.ops.segment_sum(new.astype(jnp.int32), sd, num_segments=S + 1, indices_are_sorted=True)
    position = uid - (jnp.cumsum(uniques) - uniques)[sd]
    fits = (sd < S) & (position < C)
    overflow = jnp.sum(new & (sd < S) & (position >= C), dtype=jnp.int32)
    # Rows that do not fit are written to owner S, which mode="drop" discards; they are counted above.
    send_rows = jnp.full((S, C), -1, jnp.int32).at[jnp.where(fits, sd, S), position].set(sr, mode="drop")
    inv = jnp.zeros((n,), jnp.int32).at[perm].set(iota)  # original request -> sorted position
    return RowRoute(send_rows, overflow, jnp.where(fits, sd, S)[inv], position[inv], fits[inv].astype(jnp.float32))


def bag_segments(layout: Layout, feature_table, key: str, feats, batch: Mapping[str, int]):
    """The pairs strategy's segments of stack `key` and the partial sums each owner keeps.

    Each owner keeps one partial sum per bag only for the segments (feature, column block) it holds a
    piece of, so a table-wise feature's sums travel to and from its one owner only.
    Returns (segments, offsets [S + 1, segments] (row S: padding), bags per owner).
    """
    S = layout.num_shards
    segs = []
    for f in sorted(feats):
        route = layout.routes[feature_table[f]]
        if route.stack == key:
            segs += [(f, c, route) for c in range(route.col_parts)]
    offsets = np.zeros((S + 1, len(segs)), np.int32)
    used = np.zeros(S, np.int64)
    segments = []
    for j, (f, c, route) in enumerate(segs):
        holders = sorted({int(d) for d in route.shard[:, c]})
        for d in holders:
            offsets[d, j] = used[d]
            used[d] += batch[f]
        segments.append(BagSegment(f, c, batch[f], tuple(holders), tuple(int(o) for o in offsets[:S, j])))
    return tuple(segments), offsets, int(max(1, used.max())) if segs else 1


def pair_requests(layout: Layout, feature_table, key: str, feats, ids, xp=jnp):
    """(owner, row, bag index) of every valid id of the partial-sum features reading stack `key`."""
    S = layout.num_shards
    segments, offsets, bags = bag_segments(layout, feature_table, key, feats, {f: ids[f].shape[0] for f in feats})
    if not segments:
        return None
    dest, row, bag = [], [], []
    for j, seg in enumerate(segments):
        t_idx = feature_table[seg.feature]
        route, t = layout.routes[t_idx], layout.tables[t_idx]
        b, L = ids[seg.feature].shape
        x = ids[seg.feature].reshape(-1)
        valid = _valid(x, t.stored_rows, xp)
        sid = xp.where(valid, x, 0)
        part = sid % route.row_parts if route.row_parts > 1 else xp.zeros_like(sid)
        d = xp.where(valid, xp.asarray(route.shard[:, seg.col_block])[part], S)
        dest.append(d)
        row.append(xp.asarray(route.offset[:, seg.col_block])[part] + sid // route.row_parts)
        bag.append(xp.asarray(offsets[:, j])[d] + xp.repeat(xp.arange(b, dtype=xp.int32), L))
    cat = xp.concatenate
    return PairRequests(
        cat(dest).astype(xp.int32), cat(row).astype(xp.int32), cat(bag).astype(xp.int32), segments, bags
    )


def route_pairs(req: PairRequests, num_shards: int, block_rows: int, capacity: int) -> PairRoute:
    """Each valid (row, bag) pair gets a position among the pairs bound for its owner (no de-duplication)."""
    dest, C = req.dest, capacity
    S, G = num_shards, req.bags
    n = dest.shape[0]
    iota = jnp.arange(n, dtype=jnp.int32)
    sd, perm = jax.lax.sort((dest, iota), num_keys=1)
    counts = jax.ops.segment_sum(jnp.ones((n,), jnp.int32), sd, num_segments=S + 1, indices_are_sorted=True)
    position = iota - (jnp.cumsum(counts) - counts)[sd]
    fits = (sd < S) & (position < C)
    overflow = jnp.sum((sd < S) & (position >= C), dtype=jnp.int32)
    row, bag = req.row[perm], req.bag[perm]
    packed = block_rows * G < 2**31
    payload = row * G + bag if packed else jnp.stack([row, bag], axis=-1)
    shape = (S, C) if packed else (S, C, 2)
    send = jnp.full(shape, -1, jnp.int32).at[jnp.where(fits, sd, S), position].set(payload, mode="drop")
    inv = jnp.zeros((n,), jnp.int32).at[perm].set(iota)
    return PairRoute(send, overflow, packed, jnp.where(fits, sd, S)[inv], position[inv])


def unpack_pairs(recv, route: PairRoute, bags: int):
    """Received pairs -> (rows, bags); -1 rows (and bag 0) for empty slots."""
    if route.packed:
        return jnp.where(recv >= 0, recv // bags, -1), jnp.where(recv >= 0, recv % bags, 0)
    return recv[..., 0], recv[..., 1]
