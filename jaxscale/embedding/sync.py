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

from jaxscale import collectives
from jaxscale.embedding import kernels


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
