"""Moving a saved embedding state onto another layout (mesh, topology or plan) without gathering it.

The saved stacks are read row-chunked: every device reads rows [d*q, (d+1)*q) of every saved block
(`chunked_shape` / `chunk_spec`), so no device (and no host) ever holds a whole table. Each table row is
then sent, in units of `gcd(saved width, target width)` columns, from the device that read it to every
device that holds it in the target layout (one all-to-all per pair of stacks, sized from host-built index
lists), and scattered into the target blocks.

Replicas: a state saved under periodic sync can hold replicas that differ; they are averaged (the sync the
next step would have done). Replicas that agree (exact sync) are taken as they are, bit for bit.
Optimizer slots: a target piece takes the saved value of the row's column piece that holds the target
piece's first column (one accumulator per row: every column piece holds the same value).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.engine.embedding.layout import Layout
from jaxscale.engine.mesh import AXES, Topology


def chunk_rows(block_rows: int, devices: int) -> int:
    """Rows q of every saved block that one device reads (the block padded to devices x q rows)."""
    return max(1, math.ceil(block_rows / devices))


def chunked_shape(saved_shape: tuple[int, ...], devices: int) -> tuple[int, ...]:
    """[replicas, shards, R, ...] -> the padded shape whose row axis splits evenly over the devices."""
    reps, shards, rows = saved_shape[:3]
    return (reps, shards, devices * chunk_rows(rows, devices)) + tuple(saved_shape[3:])


def chunk_sharding(mesh, ndim: int) -> NamedSharding:
    """Row axis (axis 2) split over every device; replicas, shards and columns whole."""
    return NamedSharding(mesh, P(None, None, AXES, *([None] * (ndim - 3))))


@dataclasses.dataclass(frozen=True)
class _Units:
    """Transfer units of one (saved stack, target stack) pair: `width` columns of one row each."""

    saved: str
    target: str
    width: int
    send: dict  # {'shard', 'row', 'col'}: int32 [D, D, cap] on the sender, indexed [sender, receiver, slot]
    recv: dict  # {'row', 'col'}: int32 [D, D, cap] on the receiver, indexed [receiver, sender, slot]


def _plan_units(saved: Layout, target: Layout, topology: Topology, q: dict, slots: bool) -> list[_Units]:
    """Host index lists of every unit that moves from a reading device to a holding device.

    With `slots`, one unit per (row, target piece): the saved slot of the column piece holding the target
    piece's first column. Otherwise units of gcd(widths) columns covering every target column. `q[stack]`
    is the chunk each device reads of that saved stack's blocks.
    """
    D = topology.nodes * topology.local
    positions = np.arange(D)
    holders = {s: positions[topology.shard_of(positions) == s] for s in range(topology.num_shards)}
    pieces: dict[tuple[str, str], list] = {}
    for t_idx, t in enumerate(target.tables):
        rs, rt = saved.routes[t_idx], target.routes[t_idx]
        ws, wt = saved.stacks[rs.stack].width, target.stacks[rt.stack].width
        u = 1 if slots else math.gcd(ws, wt)
        x = np.arange(t.stored_rows, dtype=np.int64)
        for p in range(rt.row_parts):
            rows = x[p :: rt.row_parts]
            p_s = rows % rs.row_parts
            for c in range(rt.col_parts):
                b_t = rt.offset[p, c] + rows // rt.row_parts
                col_starts = [c * wt] if slots else range(c * wt, (c + 1) * wt, u)
                for col in col_starts:
                    c_s, col_s = col // ws, col % ws
                    s_s = rs.shard[p_s, c_s]
                    b_s = rs.offset[p_s, c_s] + rows // rs.row_parts
                    sender = b_s // q[rs.stack]
                    for receiver in holders[int(rt.shard[p, c])]:
                        pieces.setdefault((rs.stack, rt.stack, u), []).append(
                            np.stack(
                                [
                                    sender,
                                    np.full_like(sender, receiver),
                                    s_s,
                                    b_s % q[rs.stack],
                                    np.full_like(sender, 0 if slots else col_s),
                                    b_t,
                                    np.full_like(sender, 0 if slots else col - c * wt),
                                ]
                            )
                        )
    out = []
    for (ks, kt, u), parts in pieces.items():
        sender, receiver, s_s, j, col_s, b_t, col_t = np.concatenate(parts, axis=1)
        order = np.lexsort((receiver, sender))
        pair = sender[order] * D + receiver[order]
        first = np.searchsorted(pair, pair, side="left")
        slot = np.arange(pair.size) - first
        cap = int(slot.max()) + 1 if slot.size else 1
        send = {k: np.full((D, D, cap), -1, np.int32) for k in ("shard", "row", "col")}
        recv = {k: np.full((D, D, cap), -1, np.int32) for k in ("row", "col")}
        si, ri = sender[order], receiver[order]
        for k, v in (("shard", s_s), ("row", j), ("col", col_s)):
            send[k][si, ri, slot] = v[order]
        for k, v in (("row", b_t), ("col", col_t)):
            recv[k][ri, si, slot] = v[order]
        out.append(_Units(ks, kt, u, send, recv))
    return out


def _merge_replicas(x):
    """[reps, ...] -> [...]: the replicas where they all agree (bit for bit), their mean where they differ."""
    if x.shape[0] == 1:
        return x[0]
    agree = jnp.all(x == x[0:1], axis=0)
    return jnp.where(agree, x[0], jnp.mean(x, axis=0))


def reshard(saved: Layout, chunks: dict, target_spec, *, step) -> dict:
    """Row-chunked saved state -> a state in `target_spec`'s layout (a `state.StateSpec`).

    `chunks` = {'weights': {saved stack: [reps, shards, D*q, w]}, slot: {saved stack: [reps, shards, D*q]}},
    sharded with `chunk_sharding`. Every target row gets its saved values; nothing is gathered whole.
    """
    target, topology, mesh = target_spec.layout, target_spec.topology, target_spec.mesh
    D = topology.nodes * topology.local
    q = {k: v.shape[2] // D for k, v in chunks["weights"].items()}  # rows of every block each device read
    kinds = [("weights", False)] + [(s, True) for s in target_spec.slots if s in chunks]
    plans = {name: _plan_units(saved, target, topology, q, is_slot) for name, is_slot in kinds}
    out_spec = target_spec.spec
    index_spec = P(AXES)

    def body(chunks, index):
        result = {}
        for name, is_slot in kinds:
            blocks = {
                k: jnp.zeros((st.rows,) if is_slot else (st.rows, st.width), jnp.float32)
                for k, st in target.stacks.items()
            }
            for n, units in enumerate(plans[name]):
                src = _merge_replicas(chunks[name][units.saved])  # [shards, q(, w)]
                send, recv = index[name][n]
                width = 1 if is_slot else src.shape[-1]
                flat = src.reshape(-1)
                base = (send["shard"][0] * q[units.saved] + send["row"][0]) * width + send["col"][0]  # [D, cap]
                span = jnp.arange(units.width)
                idx = base[..., None] + span
                vals = jnp.where((send["shard"][0] >= 0)[..., None], flat[jnp.clip(idx, 0, flat.size - 1)], 0.0)
                got = jax.lax.all_to_all(vals, AXES, 0, 0, tiled=True)  # [D senders, cap, u]
                st = target.stacks[units.target]
                tw = 1 if is_slot else st.width
                dst = recv["row"][0] * tw + recv["col"][0]
                didx = jnp.where((recv["row"][0] >= 0)[..., None], dst[..., None] + span, st.rows * tw)
                block = blocks[units.target].reshape(-1).at[didx.reshape(-1)].set(got.reshape(-1), mode="drop")
                blocks[units.target] = block.reshape(blocks[units.target].shape)
            result[name] = {k: v[None, None] for k, v in blocks.items()}
        return result

    index = {
        name: [
            tuple(
                {k: jax.device_put(v, NamedSharding(mesh, index_spec)) for k, v in side.items()}
                for side in (u.send, u.recv)
            )
            for u in units_list
        ]
        for name, units_list in plans.items()
    }
    in_chunk = {
        name: {k: P(None, None, AXES, *([None] * (v.ndim - 3))) for k, v in chunks[name].items()} for name, _ in kinds
    }
    in_index = jax.tree.map(lambda _: index_spec, index)
    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(in_chunk, in_index),
            out_specs={name: {k: out_spec for k in target.stacks} for name, _ in kinds},
        ),
        out_shardings={name: {k: NamedSharding(mesh, out_spec) for k in target.stacks} for name, _ in kinds},
    )
    state = fn({name: chunks[name] for name, _ in kinds}, index)
    state["step"] = jax.device_put(np.asarray(step, np.int32), NamedSharding(mesh, P()))
    return state
