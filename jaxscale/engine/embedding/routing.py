"""Routing requests to the shards that own them, with static-shape send buffers.

Two strategies, both typed here:

* rows: every (id, column block) is a request for one row of one owner; requests are sorted and
  de-duplicated, and each unique (owner, row) gets a position in a `[shards, capacity]` send buffer. The owner
  returns the rows and the requester pools them.
* pairs (per-bag partial sums, for pooled features with several ids per bag): every valid (row, bag) pair
  travels to its owner (no de-duplication: the owner pools its rows per bag) and one partial sum per bag
  comes back from each owner that holds a piece of the bag's table. A pair travels as 2 bytes when it can
  (`PairCodec`): its row relative to its table piece, in bag order, beside one count per bag.

Request building works on NumPy or JAX arrays (`xp`), so the host counts exactly the buffers the device
fills (`jaxscale.engine.embedding.capacity`). A request that does not fit its buffer is counted as overflow,
never dropped silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.engine import native
from jaxscale.engine.embedding.layout import Layout
from jaxscale.engine.embedding.row_owner import row_part


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
    bag_len: int  # the most ids one bag has (pairs one bag sends one owner)


NARROW_SPAN = 2**16  # a table piece spanning at most this many rows of its owner's block has u16 row offsets


@dataclasses.dataclass(frozen=True, eq=False)
class PairCodec:
    """How one stack's (row, bag) pairs travel to their owners; chosen once, from the layout and bag length.

    'narrow': a u16 per pair (its row minus the first row of its table piece on the owner) and one count
    per bag (u8, or u16 for bags of 256+ ids), in ONE u16 buffer [S, C + count words]. A sender lists an
    owner's pairs in bag order, so the owner recovers each pair's bag from the counts and its row from
    the bag's piece: 2 bytes per pair + 1 per bag, where TorchRec sends an int64 per id and per bag.
    Needs every piece an owner holds to span <= NARROW_SPAN rows.
    'packed': one int32 `row * bags + bag` per pair; 'wide': two int32 (when even that overflows).
    """

    kind: str
    piece_base: np.ndarray | None = None  # int32 [S, G]: first block row of each owner bag's table piece
    count_bytes: int = 0  # 1 or 2: width of a per-bag count ('narrow')


@dataclasses.dataclass(frozen=True)
class PairRoute:
    """The (row, bag) pairs' send buffer, encoded as `codec` says; empty slots carry no pair."""

    send: jax.Array  # narrow: u16 [S, C + count words]; packed: int32 [S, C] / wide: [S, C, 2], -1 = empty
    overflow: jax.Array
    codec: PairCodec
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
        part, block_row = row_part(sid, route.row_parts)
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
        part, block_row = row_part(sid, route.row_parts)
        d = xp.where(valid, xp.asarray(route.shard[:, seg.col_block])[part], S)
        dest.append(d)
        row.append(xp.asarray(route.offset[:, seg.col_block])[part] + block_row)
        bag.append(xp.asarray(offsets[:, j])[d] + xp.repeat(xp.arange(b, dtype=xp.int32), L))
    cat = xp.concatenate
    bag_len = max(ids[seg.feature].shape[1] for seg in segments)
    return PairRequests(
        cat(dest).astype(xp.int32), cat(row).astype(xp.int32), cat(bag).astype(xp.int32), segments, bags, bag_len
    )


def pair_codec(layout: Layout, feature_table, key: str, req: PairRequests) -> PairCodec:
    """The narrowest `PairCodec` stack `key`'s pairs fit (static: from the layout and the ids' shapes)."""
    S, G = layout.num_shards, req.bags
    base = np.zeros((S, G), np.int64)
    narrow = req.bag_len < 2**16
    for seg in req.segments:
        t_idx = feature_table[seg.feature]
        for d in seg.holders:
            pieces = [pc for pc in layout.stacks[key].pieces[d] if pc.table == t_idx and pc.col_part == seg.col_block]
            lo, hi = min(pc.offset for pc in pieces), max(pc.offset + pc.rows for pc in pieces)
            narrow &= hi - lo <= NARROW_SPAN
            base[d, seg.offsets[d] : seg.offsets[d] + seg.bags] = lo
    if narrow:
        return PairCodec("narrow", base.astype(np.int32), 1 if req.bag_len < 2**8 else 2)
    return PairCodec("packed" if layout.stacks[key].rows * G < 2**31 else "wide")


def route_pairs(req: PairRequests, num_shards: int, codec: PairCodec, capacity: int) -> PairRoute:
    """Each valid (row, bag) pair gets a position among the pairs bound for its owner (no de-duplication).

    A pair's position is its rank among the earlier pairs with the same owner, so an owner's pairs keep
    request order, which is bag order (`pair_requests`): one counting pass in the native kernel
    (`jaxscale.engine.native.rank_within_owner`).
    A pair that does not fit is counted in `overflow`; with 'narrow' it is left out of its bag's count too.
    """
    dest, C = req.dest, capacity
    S, G = num_shards, req.bags
    position = native.rank_within_owner(dest, owners=S)
    fits = (dest < S) & (position < C)
    overflow = jnp.sum((dest < S) & (position >= C), dtype=jnp.int32)
    row, bag = req.row, req.bag
    slot_owner = jnp.where(fits, dest, S)  # owner S: dropped by mode="drop"
    if codec.kind == "narrow":
        base = jnp.asarray(codec.piece_base)[jnp.minimum(dest, S - 1), bag]
        offset = (row - base).astype(jnp.uint16)
        offsets = jnp.zeros((S, C), jnp.uint16).at[slot_owner, position].set(offset, mode="drop")
        per_bag = jax.ops.segment_sum(fits.astype(jnp.int32), slot_owner * G + bag, num_segments=(S + 1) * G)
        send = jnp.concatenate([offsets, _count_words(per_bag.reshape(S + 1, G)[:S], codec.count_bytes)], axis=1)
    else:
        packed = codec.kind == "packed"
        payload = row * G + bag if packed else jnp.stack([row, bag], axis=-1)
        shape = (S, C) if packed else (S, C, 2)
        send = jnp.full(shape, -1, jnp.int32).at[slot_owner, position].set(payload, mode="drop")
    return PairRoute(send, overflow, codec, slot_owner, position)


def _count_words(counts, count_bytes: int):
    """int32 [S, G] per-bag counts -> u16 [S, ceil(G * count_bytes / 2)] (u8 counts two to a word)."""
    if count_bytes == 2:
        return counts.astype(jnp.uint16)
    S, G = counts.shape
    pairs = jnp.pad(counts.astype(jnp.uint8), ((0, 0), (0, G % 2))).reshape(S, -1, 2)
    return jax.lax.bitcast_convert_type(pairs, jnp.uint16)


def _counts_of_words(words, bags: int, count_bytes: int):
    """Inverse of `_count_words`: int32 [S, bags]."""
    if count_bytes == 1:
        words = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(words.shape[0], -1)
    return words[:, :bags].astype(jnp.int32)


def unpack_pairs(recv, route: PairRoute, bags: int, shard=None):
    """Received pairs -> (rows, bags) per sender slot [S, C]; -1 rows (and bag 0) for empty slots.

    `shard`: this owner's shard index (`jax.lax.axis_index` of the shard axes), needed by 'narrow'.
    """
    codec = route.codec
    if codec.kind == "packed":
        return jnp.where(recv >= 0, recv // bags, -1), jnp.where(recv >= 0, recv % bags, 0)
    if codec.kind == "wide":
        return recv[..., 0], recv[..., 1]
    if shard is None:
        raise ValueError("unpack_pairs: narrow pairs need this owner's shard index (shard=axis_index)")
    capacity = recv.shape[1] - -(-bags * codec.count_bytes // 2)
    offsets, counts = recv[:, :capacity], _counts_of_words(recv[:, capacity:], bags, codec.count_bytes)
    bag = native.slot_bags(counts, capacity=capacity)  # -1 past a sender's last pair
    valid = bag >= 0
    bag = jnp.maximum(bag, 0)  # empty slots: bag 0
    base = jnp.asarray(codec.piece_base)[shard][bag]
    return jnp.where(valid, offsets.astype(jnp.int32) + base, -1), bag
