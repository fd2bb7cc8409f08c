"""Replica sync: keeping the copies of a 2D topology's shards in agreement.

Under '2d_ar' and '2d_a2a' every shard exists once per replica, and each replica's owners first
aggregate the gradients of their own replica's requesters. Two modes:

* exact: every replica applies the SAME combined update (the sum over replicas) every step, so replicas
  stay bit-identical and training equals one big shard group. Two strategies (`capacity.SYNC_STRATEGIES`):
  - 'gather': all-gather every replica's (row, summed gradient) list; each replica sums them. Bytes per
    device: (Rep-1) x U rows, U = rows one replica touched on the shard: grows with the replica count.
  - 'owner': row r's owner replica is r % Rep. Each replica sends its rows to their owners (one
    all-to-all over the replica axes), each owner sums what it received over its share of the union
    and all-gathers those sums. Bytes: ~(U + V) (Rep-1)/Rep rows, V = the union over replicas: close to
    the union of touched rows, whatever the replica count, when the replicas' ids overlap.
  Gradients travel in the backward comm precision; everyone applies the values decoded from the wire
  (the owner too), so quantized syncs keep replicas identical.
* periodic (TorchRec DMPCollection): replicas update independently and average weights and optimizer
  state every `sync_every` steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxscale.engine import collectives
from jaxscale.engine.embedding import kernels


def _axis(axes: tuple[str, ...]):
    return axes if len(axes) > 1 else axes[0]


def gather_sync(urows, gsum, *, replica_axes, comm):
    """Every replica's (rows i32[U], sums f32[U, w]) -> the concatenation over replicas, on every replica."""
    rows = jax.lax.all_gather(urows, _axis(replica_axes), tiled=True)
    g = collectives.all_gather(gsum, replica_axes, comm.backward, fp8_format=comm.fp8_backward_format)
    return rows, g


def owner_sync(urows, gsum, *, replica_axes, num_replicas, comm, send_capacity, owned_capacity, block_rows):
    """Sum over replicas routed through each row's owner replica (r % num_replicas).

    urows i32[m] (unique rows, -1 padding), gsum f32[m, w] -> (rows i32[Rep * V], sums f32[Rep * V, w],
    overflow): the union of every replica's rows (each once) with the summed gradients, identical on every
    replica. Rows that do not fit `send_capacity` / `owned_capacity` are counted, never dropped silently.
    """
    Rep, C, V = num_replicas, send_capacity, owned_capacity
    m = urows.shape[0]
    valid = urows >= 0
    owner = jnp.where(valid, urows % Rep, Rep)
    iota = jnp.arange(m, dtype=jnp.int32)
    sorted_owner, perm = jax.lax.sort((owner, iota), num_keys=1)
    counts = jax.ops.segment_sum(jnp.ones((m,), jnp.int32), sorted_owner, num_segments=Rep + 1)
    slot = iota - (jnp.cumsum(counts) - counts)[sorted_owner]
    fits = (sorted_owner < Rep) & (slot < C)
    overflow = jnp.sum((sorted_owner < Rep) & (slot >= C), dtype=jnp.int32)
    dest = jnp.where(fits, sorted_owner, Rep)  # Rep: dropped
    send_rows = jnp.full((Rep, C), -1, jnp.int32).at[dest, slot].set(urows[perm], mode="drop")
    send_g = jnp.zeros((Rep, C, gsum.shape[1]), gsum.dtype).at[dest, slot].set(gsum[perm], mode="drop")
    axis = _axis(replica_axes)
    recv_rows = jax.lax.all_to_all(send_rows, axis, 0, 0, tiled=True).reshape(-1)
    recv_g = collectives.all_to_all(send_g, replica_axes, comm.backward, fp8_format=comm.fp8_backward_format)
    owned_rows, owned_g, count, _ = kernels.sum_by_row(recv_rows, recv_g.reshape(Rep * C, -1), block_rows=block_rows)
    overflow += jnp.maximum(count - V, 0)
    rows = jax.lax.all_gather(owned_rows[:V], axis, tiled=True)
    g = collectives.all_gather(owned_g[:V], replica_axes, comm.backward, fp8_format=comm.fp8_backward_format)
    return rows, g, overflow


def average(tree, *, replica_axes, num_replicas):
    """The mean over replicas of every leaf (TorchRec DMPCollection's sync).

    `pcast`: the mean is replica-invariant, but the state is typed replica-varying (each replica owns its
    copy), so the result is cast back to varying.
    """
    return jax.tree.map(
        lambda a: jax.lax.pcast(jax.lax.psum(a, replica_axes) / num_replicas, replica_axes, to="varying"), tree
    )


def average_touched(tree, *, replica_axes, num_replicas, capacity):
    """The periodic average restricted to the rows some replica touched since the last sync.

    tree = (weights {key: [1, 1, R, w]}, slots {name: {key: [1, 1, R]}}) with slots['touched'] the 0/1
    markers. Rows no replica touched are already equal on every replica, so averaging them changes
    nothing: only the union of the touched rows is gathered into a [capacity] buffer and all-reduced
    (plus one max-reduce of the markers). When more rows than `capacity(key)` were touched, that stack
    averages every row instead. The markers are cleared.
    """
    weights, slots = tree
    weights, slots = dict(weights), {s: dict(v) for s, v in slots.items()}
    for key in weights:
        marks = jax.lax.pmax(slots["touched"][key][0, 0], replica_axes)  # [R]: the union over replicas
        rows_total = marks.shape[0]
        cap = capacity(key)
        state = [weights[key][0, 0]] + [slots[s][key][0, 0] for s in slots if s != "touched"]

        def sparse(state, marks=marks, cap=cap, rows_total=rows_total):
            (idx,) = jnp.nonzero(marks > 0, size=cap, fill_value=rows_total)
            out = []
            for a in state:
                picked = a.at[idx].get(mode="fill", fill_value=0.0)
                mean = jax.lax.psum(picked, replica_axes) / num_replicas
                out.append(a.at[idx].set(mean, mode="drop"))
            return out

        def dense(state):
            # the averages are replica-invariant; the state is typed replica-varying
            return [
                jax.lax.pcast(jax.lax.psum(a, replica_axes) / num_replicas, replica_axes, to="varying") for a in state
            ]

        fits = jnp.sum(marks > 0) <= cap
        state = jax.lax.cond(fits, sparse, dense, state)
        weights[key] = state[0][None, None]
        names = [s for s in slots if s != "touched"]
        for s, a in zip(names, state[1:]):
            slots[s][key] = a[None, None]
        slots["touched"][key] = jnp.zeros_like(slots["touched"][key])
    return weights, slots
