"""The embedding state: its arrays, shardings, initialisation, and conversion to and from dense tables.

State = {'weights': {stack key: f32[replicas, shards, R, w]}, 'step': i32[],
         <optimizer slot>: {stack key: f32[replicas, shards, R]}}.
A stack is sharded P(replica axes, shard axes), so each device holds exactly one [R, w] block. The
explicit replica axis lets replicas be compared (and diverge between periodic syncs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.engine.embedding import layout as layout_lib
from jaxscale.engine.embedding.layout import Layout
from jaxscale.engine.mesh import Topology
from jaxscale.engine.optimizers import slot_initial_value


@dataclasses.dataclass(frozen=True, eq=False)
class StateSpec:
    """What the state arrays look like on a mesh: layout, topology and the optimizer's slots."""

    mesh: object
    layout: Layout
    topology: Topology
    optimizer: object
    markers: tuple[str, ...] = ()
    """Per-row state beside the optimizer's, starting at 0 (e.g. 'touched' of the sparse periodic sync)."""

    @property
    def spec(self) -> P:
        """PartitionSpec of every stack and slot array: [replicas, shards, ...]."""
        return P(self.topology.replica_axes or None, self.topology.shard_axes)

    @property
    def slots(self) -> tuple[str, ...]:
        """Per-row state arrays: the optimizer's slots, then the markers."""
        return tuple(self.optimizer.slots) + tuple(self.markers)

    def initial(self, slot: str) -> float:
        return 0.0 if slot in self.markers else slot_initial_value(self.optimizer, slot)

    def shardings(self) -> dict:
        """NamedShardings of the state pytree (for jit in/out shardings and checkpoint restore)."""
        s = NamedSharding(self.mesh, self.spec)
        out = {"weights": {k: s for k in self.layout.stacks}, "step": NamedSharding(self.mesh, P())}
        for slot in self.slots:
            out[slot] = {k: s for k in self.layout.stacks}
        return out

    def abstract(self) -> dict:
        """ShapeDtypeStructs (with shardings) of the state: a restore target for orbax."""
        sh = self.shardings()
        rs = (self.topology.num_replicas, self.topology.num_shards)
        out = {
            "weights": {
                k: jax.ShapeDtypeStruct(rs + (st.rows, st.width), jnp.float32, sharding=sh["weights"][k])
                for k, st in self.layout.stacks.items()
            },
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=sh["step"]),
        }
        for slot in self.slots:
            out[slot] = {
                k: jax.ShapeDtypeStruct(rs + (st.rows,), jnp.float32, sharding=sh[slot][k])
                for k, st in self.layout.stacks.items()
            }
        return out

    def signature(self) -> dict:
        """What the stored arrays' layout depends on; equal signatures mean a state can be reused as is."""
        return {
            "plan": self.layout.plan.to_dict(),
            "num_replicas": self.topology.num_replicas,
            "stacks": {k: [st.rows, st.width] for k, st in self.layout.stacks.items()},
        }

    # ------------------------------------------------------------------------------------ init

    def init_fn(self):
        """A jitted key -> state that generates every block on its device (no table built on the host).

        Row r of table t is uniform(-s, s), s = `TableConfig.scale`, drawn from fold_in(fold_in(key, t), r):
        the values do not depend on the mesh, topology or sharding.
        """
        layout, topology = self.layout, self.topology
        max_dim = max(t.stored_dim for t in layout.tables)
        scales = np.array([t.scale for t in layout.tables], np.float32)
        metas = {k: layout_lib.piece_meta(st, layout.num_shards) for k, st in layout.stacks.items()}
        shard_axes, replica_axes = topology.shard_axes, topology.replica_axes

        def init_stack(key, st, meta):
            # meta arrives as a runtime argument: as a constant, XLA would fold [rows]-sized index arrays.
            def body(key, meta):
                shard = jax.lax.axis_index(shard_axes)
                i = jnp.arange(st.rows, dtype=jnp.int32)
                starts = meta["start"][shard]
                piece = jnp.clip(jnp.searchsorted(starts, i, side="right") - 1, 0, starts.shape[0] - 1)

                def get(name):
                    return meta[name][shard][piece]

                local = i - get("start")
                valid = local < get("rows")
                row = get("row_part") + local * get("row_parts")
                table = get("table")

                def one(t, r, c):
                    k = jax.random.fold_in(jax.random.fold_in(key, t), r)
                    v = jax.random.uniform(k, (max_dim,), jnp.float32, -1.0, 1.0)
                    return jax.lax.dynamic_slice(v, (c * st.width,), (st.width,))

                vals = jax.vmap(one)(table, row, get("col_part"))
                block = jnp.where(valid[:, None], vals * jnp.asarray(scales)[table][:, None], 0.0)[None, None]
                # Every replica draws the same values; the state is typed replica-varying (replicas may diverge
                # under periodic sync), so the block is cast to varying over the replica axes.
                return jax.lax.pcast(block, replica_axes, to="varying") if replica_axes else block

            return jax.shard_map(body, mesh=self.mesh, in_specs=(P(), P()), out_specs=self.spec)(key, meta)

        def init(key, metas):
            state = {
                "weights": {k: init_stack(key, st, metas[k]) for k, st in layout.stacks.items()},
                "step": jnp.zeros((), jnp.int32),
            }
            rs = (topology.num_replicas, topology.num_shards)
            for slot in self.slots:
                value = self.initial(slot)
                state[slot] = {k: jnp.full(rs + (st.rows,), value, jnp.float32) for k, st in layout.stacks.items()}
            return state

        jitted = jax.jit(init, out_shardings=self.shardings())
        return lambda key: jitted(key, metas)

    # ------------------------------------------------------------------------------- dense

    def from_dense(self, tables: Mapping[str, np.ndarray], slots=None, step: int = 0) -> dict:
        """State holding the given dense tables ({name: [stored rows, stored dim]}) and, optionally, slots
        ({slot: {table: [rows] | [rows, k]}}, see `layout.dense_slots_to_stacks`)."""
        if not isinstance(tables, Mapping):
            raise TypeError(f"from_dense expects a dict {{table name: array}}, got {type(tables).__name__}")
        names = {t.name for t in self.layout.tables}
        missing, extra = names - set(tables), set(tables) - names
        if missing or extra:
            raise ValueError(f"from_dense: missing tables {sorted(missing)}, unknown tables {sorted(extra)}")
        dense = {}
        for t in self.layout.tables:
            a = np.asarray(tables[t.name])
            if a.shape != (t.stored_rows, t.stored_dim):
                raise ValueError(
                    f"from_dense: table {t.name!r} has shape {a.shape}, expected {(t.stored_rows, t.stored_dim)}"
                )
            if not np.issubdtype(a.dtype, np.floating):
                raise ValueError(f"from_dense: table {t.name!r} must be floating point, got {a.dtype}")
            dense[t.name] = a.astype(np.float32, copy=False)
        sh = self.shardings()
        reps = self.topology.num_replicas
        host = layout_lib.dense_to_stacks(self.layout, dense)
        state = {
            "weights": {k: put(np.broadcast_to(v[None], (reps,) + v.shape), sh["weights"][k]) for k, v in host.items()},
            "step": put(np.asarray(step, np.int32), sh["step"]),
        }
        for slot in self.slots:
            fill = self.initial(slot)
            given = (slots or {}).get(slot, {})
            stacks = layout_lib.dense_slots_to_stacks(self.layout, given, fill)
            state[slot] = {k: put(np.broadcast_to(v[None], (reps,) + v.shape), sh[slot][k]) for k, v in stacks.items()}
        return state

    def to_dense(self, state, replica: int = 0) -> dict[str, np.ndarray]:
        """The tables of `state` as dense host arrays {name: [rows, dim]}, read from one replica."""
        return layout_lib.stacks_to_dense(self.layout, {k: to_host(v)[replica] for k, v in state["weights"].items()})

    def slots_to_dense(self, state, replica: int = 0, per_column_shard: bool = False) -> dict:
        """Per-row optimizer state as {slot: {table: [rows]}} ([rows, col_parts] per column shard)."""
        return {
            slot: layout_lib.slots_to_dense(
                self.layout, {k: to_host(v)[replica] for k, v in state[slot].items()}, per_column_shard
            )
            for slot in self.optimizer.slots
        }


def put(x: np.ndarray, sharding: NamedSharding):
    """A global array from a host array every process holds whole (each process puts its own shards)."""
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(a) -> np.ndarray:
    """A global array as one host array (gathered across processes when needed)."""
    if a.is_fully_addressable:
        return np.asarray(a)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))
