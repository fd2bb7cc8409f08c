"""Sharded embedding tables, looked up and trained inside one `shard_map`.

Storage. Each table is cut into pieces (see `jaxscale.plan`); pieces of the same column width `w` are
stacked, per shard, into one buffer. A stack is a global array `[replicas, shards, R_w, w]` sharded
`P(replica_axes, shard_axes)`, so each device holds exactly one `[R_w, w]` block: its pieces, back to
back. The explicit replica axis lets replicas be checked for equality (and diverge, in periodic sync).

Lookup (forward), per stack, on every device, for its slice of the batch:
  1. every (id, column block) becomes a request (owner shard, row in the owner's block); invalid ids
     and padding become no request;
  2. requests are sorted and de-duplicated, and each unique row gets a slot in a fixed-capacity
     `[shards, C]` send buffer (static shapes; a row that does not fit is counted as overflow, never
     dropped silently);
  3. input dist: the row ids travel to their owners with one all_to_all over the shard axes;
  4. owners gather the rows; output dist: the rows come back with a second all_to_all (quantized with
     the forward comm precision);
  5. each request reads its row; column blocks are concatenated, bags pooled (sum / mean ignoring
     padding) or returned as sequences.
Pooled features with several ids per example take a shorter output dist (`pooled_comm='auto'`): the
(row, bag) pairs travel to the owners, each owner sums its rows per bag, and one partial sum per bag
comes back from each owner that holds a piece of the bag's table (B x dim instead of B x L x dim; fp8
applies to the partial sums too); the requester adds them up. With a single shard nothing travels.

Update (backward) runs the reverse path: per-request output gradients are summed per unique row on the
requester (duplicates accumulated before anything travels), sent to the owners with one all_to_all
(backward precision), summed again on the owner over all requesters - and, under exact replica sync,
over all replicas (an all_gather of the sparse (row, gradient) lists over the replica axes, so every
replica applies the same update and replicas stay bit-identical) - and the optimizer touches only those
rows, in place (the state is donated). No dense [rows, dim] gradient is ever built.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale import collectives
from jaxscale.mesh import BATCH_AXES, mesh_shape, replica_axes, shard_axes
from jaxscale.optimizers import OPTIMIZERS, SGD, RowWiseAdagrad, slot_initial_value
from jaxscale.plan import ShardingPlan, resolve_plan
from jaxscale.quantization import CommConfig
from jaxscale.tables import TableConfig, check_tables

PADDING_ID = -1
REPLICA_SYNC_MODES = ("exact", "periodic")
POOLED_COMM_MODES = ("auto", "rows", "partial_sums")


@dataclasses.dataclass(frozen=True)
class _Piece:
    table: int  # index into the collection's tables
    row_part: int
    row_parts: int
    col_part: int
    rows: int  # rows of the table held by this piece
    offset: int  # first row of the piece in its shard's block


@dataclasses.dataclass(frozen=True)
class _Stack:
    """All pieces of column width `width`: per shard, the pieces laid out back to back."""

    key: str
    width: int
    rows: int  # R_w: rows per shard block (max over shards, >= 1)
    pieces: tuple[tuple[_Piece, ...], ...]  # per shard


@dataclasses.dataclass(frozen=True)
class _Route:
    """Static routing of one table: shard and block offset of piece (row_part, col_part)."""

    stack: str
    row_parts: int
    col_parts: int
    shard: np.ndarray  # int32 [row_parts, col_parts]
    offset: np.ndarray  # int32 [row_parts, col_parts]


class EmbeddingCollection:
    """A set of embedding tables sharded over a ('node', 'local') mesh.

    Args:
      tables: the `TableConfig`s.
      mesh: a mesh from `jaxscale.make_mesh`.
      topology: '1d' (shard over every device), '2d_ar' (shard over nodes, replicate inside a node) or
        '2d_a2a' (shard inside a node, replicate across nodes: the all-to-all never leaves a node).
      sharding: a sharding type for every table ('table_wise', 'row_wise', 'column_wise',
        'table_row_wise'), a {table: type} dict, or a `ShardingPlan` (object or its dict/JSON form).
      optimizer: `SGD` or `RowWiseAdagrad`, applied sparsely to the looked-up rows.
      comm: `CommConfig`: precision of the embedding payloads forward and backward (ids never quantized).
      capacity_factor: slots per destination in the padded all-to-all. None (default) gives the exact
        worst case, which can never overflow; a float f gives each row-wise piece f times its uniform
        share of a device's requests (smaller messages; overflow is then possible, counted and reported).
      replica_sync: 'exact' (default: replicas apply the same combined update every step) or 'periodic'
        (replicas update independently; weights and optimizer state are averaged every `sync_every`
        steps, TorchRec DMPCollection semantics).
      pooled_comm: how pooled features come back. 'rows' returns every looked-up row and pools on the
        requester; 'partial_sums' has each owner pool its rows per bag and return one partial sum per
        bag, summed on the requester (the output all-to-all carries B x dim instead of B x L x dim, and
        fp8 works on it too; the backward pass sends each bag's gradient once per owner). 'auto'
        (default) uses partial sums for pooled features with more than one id per example.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        mesh,
        *,
        topology: str = "1d",
        sharding: str | Mapping | ShardingPlan = "row_wise",
        optimizer: SGD | RowWiseAdagrad | None = None,
        comm: CommConfig | None = None,
        capacity_factor: float | None = None,
        replica_sync: str = "exact",
        sync_every: int = 1,
        pooled_comm: str = "auto",
    ):
        self.tables = check_tables(tables)
        self.mesh = mesh
        self.nodes, self.local = mesh_shape(mesh)
        self.topology = topology
        self.shard_axes = shard_axes(topology)
        self.replica_axes = replica_axes(topology)
        self.plan = resolve_plan(self.tables, topology, self.nodes, self.local, sharding)
        self.num_shards = self.plan.num_shards
        self.num_replicas = int(np.prod([mesh.shape[a] for a in self.replica_axes], dtype=int))
        self.optimizer = optimizer if optimizer is not None else RowWiseAdagrad(0.01)
        if not isinstance(self.optimizer, OPTIMIZERS):
            raise TypeError(
                f"optimizer must be jaxscale.SGD or jaxscale.RowWiseAdagrad, got {type(self.optimizer).__name__}"
            )
        self.comm = comm if comm is not None else CommConfig()
        if not isinstance(self.comm, CommConfig):
            raise TypeError(f"comm must be a jaxscale.CommConfig, got {type(self.comm).__name__}")
        if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
            raise ValueError(f"capacity_factor must be None or a positive number, got {capacity_factor!r}")
        self.capacity_factor = capacity_factor
        if replica_sync not in REPLICA_SYNC_MODES:
            raise ValueError(f"replica_sync must be one of {REPLICA_SYNC_MODES}, got {replica_sync!r}")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive integer, got {sync_every!r}")
        self.replica_sync = replica_sync
        self.sync_every = sync_every
        if pooled_comm not in POOLED_COMM_MODES:
            raise ValueError(f"pooled_comm must be one of {POOLED_COMM_MODES}, got {pooled_comm!r}")
        self.pooled_comm = pooled_comm

        self.feature_table = {f: i for i, t in enumerate(self.tables) for f in t.features}
        self._stacks, self._routes = _layout(self.tables, self.plan)
        self._max_dim = max(t.stored_dim for t in self.tables)

        rep = self.replica_axes or None
        self._stack_spec = P(rep, self.shard_axes)
        self._slot_spec = P(rep, self.shard_axes)
        self.batch_sharding = NamedSharding(mesh, P(BATCH_AXES))
        self._lookup_jit = jax.jit(self._lookup, static_argnames=("return_stats",))
        self._update_jit = jax.jit(self._update, donate_argnums=0, static_argnames=("return_stats",))

    # ------------------------------------------------------------------ state

    def state_shardings(self):
        """NamedShardings of the state pytree (for jit in/out shardings and checkpoint restore)."""
        s = NamedSharding(self.mesh, self._stack_spec)
        shardings = {"weights": {k: s for k in self._stacks}, "step": NamedSharding(self.mesh, P())}
        for slot in self.optimizer.slots:
            shardings[slot] = {k: NamedSharding(self.mesh, self._slot_spec) for k in self._stacks}
        return shardings

    def abstract_state(self):
        """ShapeDtypeStructs (with shardings) of the state: a restore target for orbax."""
        sh = self.state_shardings()
        rs = (self.num_replicas, self.num_shards)
        out = {
            "weights": {
                k: jax.ShapeDtypeStruct(rs + (st.rows, st.width), jnp.float32, sharding=sh["weights"][k])
                for k, st in self._stacks.items()
            },
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=sh["step"]),
        }
        for slot in self.optimizer.slots:
            out[slot] = {
                k: jax.ShapeDtypeStruct(rs + (st.rows,), jnp.float32, sharding=sh[slot][k])
                for k, st in self._stacks.items()
            }
        return out

    def init(self, key):
        """Initial state, generated on the devices (no table is built on the host).

        Row r of table t is uniform(-s, s) with s = `TableConfig.scale`, drawn from
        fold_in(fold_in(key, t), r): the values do not depend on the mesh, topology or sharding.
        """
        return self._init_jit(key)

    @functools.cached_property
    def _init_jit(self):
        stacks = self._stacks
        max_dim = self._max_dim
        scales = np.array([t.scale for t in self.tables], np.float32)

        metas = {k: _piece_meta(st, self.num_shards) for k, st in stacks.items()}

        def init_stack(key, st: _Stack, meta):
            # meta arrives as a runtime argument: as a constant, XLA would fold [rows]-sized index arrays.
            def body(key, meta):
                shard = _axis_index(self.shard_axes)
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
                vals = vals * jnp.asarray(scales)[table][:, None]
                return jnp.where(valid[:, None], vals, 0.0)[None, None]

            return jax.shard_map(
                body, mesh=self.mesh, in_specs=(P(), P()), out_specs=self._stack_spec, check_vma=False
            )(key, meta)

        def init(key, metas):
            state = {
                "weights": {k: init_stack(key, st, metas[k]) for k, st in stacks.items()},
                "step": jnp.zeros((), jnp.int32),
            }
            for slot in self.optimizer.slots:
                state[slot] = {
                    k: jnp.full(
                        (self.num_replicas, self.num_shards, st.rows),
                        slot_initial_value(self.optimizer, slot),
                        jnp.float32,
                    )
                    for k, st in stacks.items()
                }
            return state

        jitted = jax.jit(init, out_shardings=self.state_shardings())
        return lambda key: jitted(key, metas)

    def from_dense(self, tables: Mapping[str, np.ndarray]):
        """State holding the given dense tables ({name: [rows, dim]}; stored shape under 'half_dim')."""
        if not isinstance(tables, Mapping):
            raise TypeError(f"from_dense expects a dict {{table name: array}}, got {type(tables).__name__}")
        names = {t.name for t in self.tables}
        missing, extra = names - set(tables), set(tables) - names
        if missing or extra:
            raise ValueError(f"from_dense: missing tables {sorted(missing)}, unknown tables {sorted(extra)}")
        dense = {}
        for t in self.tables:
            a = np.asarray(tables[t.name])
            if a.shape != (t.stored_rows, t.stored_dim):
                raise ValueError(
                    f"from_dense: table {t.name!r} has shape {a.shape}, expected {(t.stored_rows, t.stored_dim)}"
                )
            if not np.issubdtype(a.dtype, np.floating):
                raise ValueError(f"from_dense: table {t.name!r} must be floating point, got {a.dtype}")
            dense[t.name] = a.astype(np.float32, copy=False)
        host = {k: np.zeros((self.num_shards, st.rows, st.width), np.float32) for k, st in self._stacks.items()}
        for k, st in self._stacks.items():
            for s, pieces in enumerate(st.pieces):
                for pc in pieces:
                    t = self.tables[pc.table]
                    cols = slice(pc.col_part * st.width, (pc.col_part + 1) * st.width)
                    host[k][s, pc.offset : pc.offset + pc.rows] = dense[t.name][pc.row_part :: pc.row_parts, cols]
        sh = self.state_shardings()
        state = {
            "weights": {
                k: _put(np.broadcast_to(v[None], (self.num_replicas,) + v.shape), sh["weights"][k])
                for k, v in host.items()
            },
            "step": _put(np.zeros((), np.int32), sh["step"]),
        }
        for slot in self.optimizer.slots:
            init = slot_initial_value(self.optimizer, slot)
            state[slot] = {
                k: _put(np.full((self.num_replicas, self.num_shards, st.rows), init, np.float32), sh[slot][k])
                for k, st in self._stacks.items()
            }
        return state

    def to_dense(self, state, replica: int = 0) -> dict[str, np.ndarray]:
        """The tables of `state` as dense host arrays {name: [rows, dim]}, read from one replica."""
        host = {k: _to_host(v)[replica] for k, v in state["weights"].items()}
        return stacks_to_dense(self.tables, self.plan, host)

    def slots_to_dense(self, state, replica: int = 0) -> dict[str, dict[str, np.ndarray]]:
        """Per-row optimizer state as {slot: {table: [rows]}}, or [rows, col_parts] for a column-wise
        table (each column shard keeps its own row-wise state, as in TorchRec/FBGEMM)."""
        return {
            slot: slots_to_dense(self.tables, self.plan, {k: _to_host(v)[replica] for k, v in state[slot].items()})
            for slot in self.optimizer.slots
        }

    def load_dense(
        self,
        tables: Mapping[str, np.ndarray],
        slots: Mapping[str, Mapping[str, np.ndarray]] | None = None,
        step: int = 0,
    ):
        """Like `from_dense`, also setting the optimizer state ({slot: {table: [rows] | [rows, col_parts]}}).

        Used to move a checkpoint between layouts (another mesh, topology or plan). A column-wise slot
        saved with a different number of column shards is reset to the mean of its blocks, per row.
        """
        state = self.from_dense(tables)
        sh = self.state_shardings()
        for slot in self.optimizer.slots:
            if not slots or slot not in slots:
                continue
            host = {k: np.zeros((self.num_shards, st.rows), np.float32) for k, st in self._stacks.items()}
            for k, st in self._stacks.items():
                for s, pieces in enumerate(st.pieces):
                    for pc in pieces:
                        v = np.asarray(slots[slot][self.tables[pc.table].name], np.float32)
                        cp = self.plan.tables[self.tables[pc.table].name].col_parts
                        if v.ndim == 2:
                            v = v[:, pc.col_part] if v.shape[1] == cp else v.mean(axis=1)
                        host[k][s, pc.offset : pc.offset + pc.rows] = v[pc.row_part :: pc.row_parts]
            state[slot] = {
                k: _put(np.broadcast_to(v[None], (self.num_replicas,) + v.shape), sh[slot][k]) for k, v in host.items()
            }
        state["step"] = _put(np.asarray(step, np.int32), sh["step"])
        return state

    def layout_signature(self) -> dict:
        """What the stored arrays' layout depends on; equal signatures mean a state can be reused as is."""
        return {
            "plan": self.plan.to_dict(),
            "num_replicas": self.num_replicas,
            "stacks": {k: [st.rows, st.width] for k, st in self._stacks.items()},
        }

    # ------------------------------------------------------------------ ids

    def shard_batch(self, batch: Mapping[str, np.ndarray]):
        """Host arrays (this process's slice of the global batch) -> global arrays sharded by batch."""
        out = {}
        for name, x in batch.items():
            x = np.asarray(x)
            if jax.process_count() == 1:
                out[name] = jax.device_put(x, self.batch_sharding)
            else:
                shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
                out[name] = jax.make_array_from_process_local_data(self.batch_sharding, x, shape)
        return out

    def validate_ids(self, ids: Mapping[str, object], *, global_batch: bool = True) -> dict[str, np.ndarray]:
        """Checks host ids and returns them as int32 [B, L]; raises ValueError/TypeError naming the problem.

        Accepts [B] (one id per example) or [B, L]; integer or float dtypes are converted to int32 when
        the conversion is lossless, refused otherwise. Ids must be in [0, rows) or the padding id -1.
        """
        if not isinstance(ids, Mapping):
            raise TypeError(f"ids must be a dict {{feature: int32 [B, L]}}, got {type(ids).__name__}")
        unknown = [f for f in ids if f not in self.feature_table]
        if unknown:
            raise ValueError(f"features {unknown} have no table; known features: {sorted(self.feature_table)}")
        out, batch = {}, None
        for f, x in ids.items():
            t = self.tables[self.feature_table[f]]
            x = _as_int32(f, x)
            if x.ndim == 1:
                x = x[:, None]
            if x.ndim != 2:
                raise ValueError(f"feature {f!r}: ids must be [B] or [B, L], got shape {x.shape}")
            if batch is None:
                batch = (f, x.shape[0])
            elif x.shape[0] != batch[1]:
                raise ValueError(f"feature {f!r} has batch size {x.shape[0]} but feature {batch[0]!r} has {batch[1]}")
            bad = (x < PADDING_ID) | (x >= t.stored_rows)
            if bad.any():
                v = x[bad][0]
                raise ValueError(
                    f"feature {f!r} (table {t.name!r}, {t.stored_rows} rows): id {int(v)} is out of range; ids must be "
                    f"in [0, {t.stored_rows}) or {PADDING_ID} for padding ({int(bad.sum())} bad ids)"
                )
            out[f] = x
        if batch is not None and global_batch:
            devices = self.nodes * self.local
            if batch[1] % devices:
                raise ValueError(f"batch size {batch[1]} is not divisible by the {devices} devices of the mesh")
        return out

    def _prepare(self, ids):
        """Host inputs are validated and sharded; traced/global arrays pass through (policy inside jit)."""
        if all(isinstance(x, jax.Array) for x in ids.values()):
            for f, x in ids.items():
                if f not in self.feature_table:
                    raise ValueError(f"feature {f!r} has no table; known features: {sorted(self.feature_table)}")
                if not jnp.issubdtype(x.dtype, jnp.integer):
                    raise TypeError(f"feature {f!r}: ids must be int32, got {x.dtype}")
            return {f: (x if x.ndim == 2 else x[:, None]).astype(jnp.int32) for f, x in ids.items()}
        return self.shard_batch(self.validate_ids(ids, global_batch=jax.process_count() == 1))

    # ------------------------------------------------------------------ lookup

    def lookup(self, state, ids, *, return_stats: bool = False):
        """{feature: [B, dim]} (pooled) or {feature: [B, L, dim]} (sequence), sharded by batch.

        Inside jit, an id out of range (>= rows, or negative other than -1) is treated as padding and
        counted in stats['invalid_ids']; outside jit, host ids are validated and such an id raises.
        With return_stats, also returns {'overflow': unique rows dropped by the capacity (0 unless a
        capacity_factor is set), 'invalid_ids': count}.
        """
        ids = self._prepare(ids)
        out, stats = self._lookup_jit(state, ids, return_stats=True)
        return (out, stats) if return_stats else out

    def _lookup(self, state, ids, return_stats=True):
        feats = tuple(sorted(ids))
        in_specs = ({k: self._stack_spec for k in self._stacks}, {f: P(BATCH_AXES) for f in feats})
        out_specs = ({f: P(BATCH_AXES) for f in feats}, {"overflow": P(), "invalid_ids": P()})
        fn = jax.shard_map(
            functools.partial(self._lookup_body, feats), mesh=self.mesh, in_specs=in_specs, out_specs=out_specs
        )
        return fn(state["weights"], {f: ids[f] for f in feats})

    def _lookup_body(self, feats, weights, ids):
        outputs, overflow, invalid = {}, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
        partial = self._partial_features(feats, ids)
        pooled = {}
        for key, st in self._stacks.items():
            table = weights[key][0, 0]
            pairs = self._pair_requests(key, partial, ids)
            if pairs is not None:
                route = self._pair_route(pairs, st.rows)
                overflow += route["overflow"]
                recv = collectives.all_to_all_ids(route["send"], self.shard_axes)  # (row, bag) pairs for me
                rrow, rbag = self._unpack_pairs(recv, route, pairs["bags"])
                rows = jnp.take(table, jnp.clip(rrow, 0, st.rows - 1), axis=0, mode="clip") * (rrow >= 0)[..., None]
                G, S = pairs["bags"], self.num_shards
                sums = (
                    jnp.zeros((S, G, st.width), jnp.float32)
                    .at[jnp.arange(S)[:, None], jnp.where(rrow >= 0, rbag, G)]
                    .add(rows, mode="drop")
                )
                back = collectives.all_to_all(
                    sums, self.shard_axes, self.comm.forward, fp8_format=self.comm.fp8_forward_format
                )  # [S, G, w] partial sums
                for f, c, b, holders, off in pairs["segments"]:  # add the partial sums of every owner
                    parts = [back[d, off[d] : off[d] + b] for d in holders]
                    pooled.setdefault(f, {})[c] = functools.reduce(jnp.add, parts)
            reqs = self._requests(key, [f for f in feats if f not in partial], ids)
            if reqs is None:
                continue
            if self.num_shards == 1:  # every row is local: no routing, no all-to-all
                vals = jnp.take(table, jnp.clip(reqs["row"], 0, st.rows - 1), axis=0, mode="clip")
                vals = vals * (reqs["dest"] < 1)[:, None]
                for f, c, start, size in reqs["segments"]:
                    outputs.setdefault(f, {})[c] = vals[start : start + size]
                continue
            route = self._route(st, reqs)
            overflow += route["overflow"]
            received = collectives.all_to_all_ids(route["send_rows"], self.shard_axes)  # [S, C] rows wanted from me
            rows = jnp.where(
                (received >= 0)[..., None],
                jnp.take(table, jnp.clip(received, 0, st.rows - 1), axis=0, mode="clip"),
                0.0,
            )
            back = collectives.all_to_all(
                rows, self.shard_axes, self.comm.forward, fp8_format=self.comm.fp8_forward_format
            )  # [S, C, w]
            vals = (
                back.at[route["dest"], route["slot"]].get(mode="fill", fill_value=0.0) * route["keep"][:, None]
            )  # [n, w] per request (original order)
            for f, c, start, size in reqs["segments"]:
                seg = vals[start : start + size]
                outputs.setdefault(f, {})[c] = seg
        for f in feats:
            t = self.tables[self.feature_table[f]]
            b, L = ids[f].shape
            x = ids[f]
            valid = (x >= 0) & (x < t.stored_rows)
            invalid += jnp.sum((x != PADDING_ID) & ~valid, dtype=jnp.int32)
            if f in partial:
                parts = pooled[f]
                s = jnp.concatenate([parts[c] for c in range(len(parts))], axis=-1)
                if t.pooling == "mean":
                    s = s / jnp.maximum(valid.sum(-1, keepdims=True), 1).astype(s.dtype)
                outputs[f] = s
                continue
            parts = outputs[f]
            emb = jnp.concatenate([parts[c] for c in range(len(parts))], axis=-1).reshape(b, L, t.stored_dim)
            outputs[f] = _pool(emb, valid, t.pooling)
        stats = {
            "overflow": jax.lax.psum(overflow, BATCH_AXES) // self.num_replicas,
            "invalid_ids": jax.lax.psum(invalid, BATCH_AXES),
        }
        return outputs, stats

    # ------------------------------------------------------------------ update

    def update(self, state, ids, grads, *, apply=True, return_stats: bool = False):
        """Applies the optimizer to the looked-up rows, given gradients w.r.t. the lookup outputs.

        `apply` may be a traced boolean: False leaves weights and optimizer state unchanged (used to skip
        a step on a non-finite loss or on overflow without copying the tables). The state is donated.
        """
        ids = self._prepare(ids)
        new_state, stats = self._update_jit(state, ids, grads, apply, return_stats=True)
        return (new_state, stats) if return_stats else new_state

    def _update(self, state, ids, grads, apply=True, return_stats=True):
        feats = tuple(sorted(ids))
        missing = [f for f in feats if f not in grads]
        if missing:
            raise ValueError(f"update: no gradient for features {missing}")
        slots = self.optimizer.slots
        in_specs = (
            {k: self._stack_spec for k in self._stacks},
            {s: {k: self._slot_spec for k in self._stacks} for s in slots},
            {f: P(BATCH_AXES) for f in feats},
            {f: P(BATCH_AXES) for f in feats},
            P(),
            P(),
        )
        out_specs = (
            {k: self._stack_spec for k in self._stacks},
            {s: {k: self._slot_spec for k in self._stacks} for s in slots},
            {"overflow": P(), "invalid_ids": P()},
        )
        fn = jax.shard_map(
            functools.partial(self._update_body, feats), mesh=self.mesh, in_specs=in_specs, out_specs=out_specs
        )
        weights, slot_state, stats = fn(
            state["weights"],
            {s: state[s] for s in slots},
            {f: ids[f] for f in feats},
            {f: grads[f].astype(jnp.float32) for f in feats},
            jnp.asarray(apply, jnp.bool_),
            state["step"],
        )
        new_state = dict(state, weights=weights, step=state["step"] + 1, **slot_state)
        return new_state, stats

    def _update_body(self, feats, weights, slot_state, ids, grads, apply, step):
        weights, slot_state = dict(weights), {s: dict(v) for s, v in slot_state.items()}
        overflow, invalid = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)
        for f in feats:
            t = self.tables[self.feature_table[f]]
            x = ids[f]
            invalid += jnp.sum((x != PADDING_ID) & ((x < 0) | (x >= t.stored_rows)), dtype=jnp.int32)
        partial = self._partial_features(feats, ids)
        for key, st in self._stacks.items():
            owner_rows, owner_g = [], []  # (row, gradient) pairs that reached this owner
            pairs = self._pair_requests(key, partial, ids)
            if pairs is not None:
                route = self._pair_route(pairs, st.rows)
                overflow += route["overflow"]
                G, S = pairs["bags"], self.num_shards
                per_dest = [[] for _ in range(S)]  # each owner gets the bag gradients of the segments it holds
                for f, c, _, holders, _ in pairs["segments"]:
                    gb = self._bag_grads(f, c, st.width, ids[f], grads[f])
                    for d in holders:
                        per_dest[d].append(gb)
                send_g = jnp.stack(
                    [
                        jnp.concatenate(
                            blocks + [jnp.zeros((G - sum(x.shape[0] for x in blocks), st.width), jnp.float32)], axis=0
                        )
                        for blocks in per_dest
                    ]
                )
                recv_g = collectives.all_to_all(
                    send_g, self.shard_axes, self.comm.backward, fp8_format=self.comm.fp8_backward_format
                )  # [S, G, w]
                recv = collectives.all_to_all_ids(route["send"], self.shard_axes)
                rrow, rbag = self._unpack_pairs(recv, route, G)
                pg = recv_g[jnp.arange(S)[:, None], jnp.clip(rbag, 0, G - 1)] * (rrow >= 0)[..., None]
                owner_rows.append(rrow.reshape(-1))
                owner_g.append(pg.reshape(-1, st.width))
            reqs = self._requests(key, [f for f in feats if f not in partial], ids)
            if reqs is None and not owner_rows:
                continue
            if reqs is None:
                rows, g = owner_rows[0], owner_g[0]
            else:
                rows, g, ov = self._rows_mode_grads(st, reqs, ids, grads)
                overflow += ov
                rows = jnp.concatenate([rows] + owner_rows)
                g = jnp.concatenate([g] + owner_g)
            if self.replica_axes and self.replica_sync == "exact":
                rows = jax.lax.all_gather(rows, self.replica_axes, tiled=True)
                g = collectives.all_gather(
                    g, self.replica_axes, self.comm.backward, fp8_format=self.comm.fp8_backward_format
                )
            weights[key], new_slots = self._apply_rows(
                weights[key], {s: slot_state[s][key] for s in slot_state}, rows, g, st.rows, apply
            )
            for s, v in new_slots.items():
                slot_state[s][key] = v
        if self.replica_axes and self.replica_sync == "periodic":
            do_sync = (step + 1) % self.sync_every == 0
            n = self.num_replicas

            def average(tree):  # pcast: the mean is replica-invariant; the state is typed replica-varying
                return jax.tree.map(
                    lambda a: jax.lax.pcast(jax.lax.psum(a, self.replica_axes) / n, self.replica_axes, to="varying"),
                    tree,
                )

            weights, slot_state = jax.lax.cond(do_sync, average, lambda tr: tr, (weights, slot_state))
        stats = {
            "overflow": jax.lax.psum(overflow, BATCH_AXES) // self.num_replicas,
            "invalid_ids": jax.lax.psum(invalid, BATCH_AXES),
        }
        return weights, slot_state, stats

    def _rows_mode_grads(self, st: _Stack, reqs, ids, grads):
        """Reverse path of the row-returning lookup: (rows, summed gradients, overflow) at this owner."""
        g = jnp.concatenate(
            [self._request_grads(f, c, st.width, ids[f], grads[f]) for f, c, _, _ in reqs["segments"]], axis=0
        )  # [n, w], original order
        if self.num_shards == 1:  # every row is local: the owner sums duplicates in _apply_rows
            return jnp.where(reqs["dest"] < 1, reqs["row"], -1), g, jnp.zeros((), jnp.int32)
        route = self._route(st, reqs)
        g = g * route["keep"][:, None]
        S, C = route["send_rows"].shape
        send_g = jnp.zeros((S, C, st.width), jnp.float32).at[route["dest"], route["slot"]].add(g, mode="drop")
        recv_rows = collectives.all_to_all_ids(route["send_rows"], self.shard_axes)  # [S, C]
        recv_g = collectives.all_to_all(
            send_g, self.shard_axes, self.comm.backward, fp8_format=self.comm.fp8_backward_format
        )  # [S, C, w]
        return recv_rows.reshape(-1), recv_g.reshape(-1, st.width), route["overflow"]

    def _apply_rows(self, w_block, slot_blocks, rows, g, block_rows, apply):
        """Sums gradients per unique row (rows < 0: none) and applies the optimizer to those rows only."""
        w = w_block[0, 0]
        m = rows.shape[0]
        key = jnp.where(rows >= 0, rows, block_rows)  # sentinel sorts last and is dropped by the scatters
        order = jnp.argsort(key)
        sk, sg = key[order], g[order]
        new = jnp.concatenate([jnp.ones((1,), bool), sk[1:] != sk[:-1]])
        uid = jnp.cumsum(new) - 1
        gsum = jax.ops.segment_sum(sg, uid, num_segments=m, indices_are_sorted=True)
        urow = jnp.full((m,), block_rows, jnp.int32).at[uid].set(sk)
        slots = {s: v[0, 0].at[urow].get(mode="fill", fill_value=0.0) for s, v in slot_blocks.items()}
        rows_w = w.at[urow].get(mode="fill", fill_value=0.0)
        delta, new_slots = self.optimizer.row_update(rows_w, slots, gsum)
        delta = jnp.where(apply, delta, 0.0)
        w = w.at[urow].add(delta, mode="drop")
        out_slots = {}
        for s, v in slot_blocks.items():
            out_slots[s] = v[0, 0].at[urow].set(jnp.where(apply, new_slots[s], slots[s]), mode="drop")[None, None]
        return w[None, None], out_slots

    def sync_replicas(self, state):
        """Averages weights and optimizer state over the replicas (periodic mode; a no-op under '1d')."""
        if not self.replica_axes:
            return state
        n = self.num_replicas
        slots = self.optimizer.slots
        specs = (
            {k: self._stack_spec for k in self._stacks},
            {s: {k: self._slot_spec for k in self._stacks} for s in slots},
        )

        def body(w, sl):
            return jax.tree.map(lambda a: jax.lax.psum(a, self.replica_axes) / n, (w, sl))

        fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=specs))
        w, sl = fn(state["weights"], {s: state[s] for s in slots})
        return dict(state, weights=w, **sl)

    # ------------------------------------------------------------------ routing

    def _requests(self, key, feats, ids):
        """All (feature, id, column block) requests that read stack `key`, flattened in a fixed order."""
        dest, row, segments, start = [], [], [], 0
        for f in feats:
            t_idx = self.feature_table[f]
            route = self._routes[t_idx]
            if route.stack != key:
                continue
            t = self.tables[t_idx]
            x = ids[f].reshape(-1)
            valid = (x >= 0) & (x < t.stored_rows)
            sid = jnp.where(valid, x, 0)
            part = sid % route.row_parts if route.row_parts > 1 else jnp.zeros_like(sid)
            local = sid // route.row_parts
            for c in range(route.col_parts):
                d = jnp.asarray(route.shard[:, c])[part]
                r = jnp.asarray(route.offset[:, c])[part] + local
                dest.append(jnp.where(valid, d, self.num_shards))
                row.append(r)
                segments.append((f, c, start, x.shape[0]))
                start += x.shape[0]
        if not segments:
            return None
        return {
            "dest": jnp.concatenate(dest).astype(jnp.int32),
            "row": jnp.concatenate(row).astype(jnp.int32),
            "segments": segments,
            "capacity": self._capacity(key, feats, ids),
        }

    def _capacity(self, key, feats, ids) -> int:
        """Static slots per destination: the worst case, or capacity_factor x the uniform share."""
        st = self._stacks[key]
        need = np.zeros(self.num_shards, np.int64)
        for f in feats:
            t_idx = self.feature_table[f]
            route = self._routes[t_idx]
            if route.stack != key:
                continue
            n = int(np.prod(ids[f].shape))
            for c in range(route.col_parts):
                for s in range(self.num_shards):
                    parts = [p for p in range(route.row_parts) if route.shard[p, c] == s]
                    if not parts:
                        continue
                    held = sum(len(range(p, self.tables[t_idx].stored_rows, route.row_parts)) for p in parts)
                    bound = n
                    if self.capacity_factor is not None and route.row_parts > 1:
                        bound = math.ceil(self.capacity_factor * n * len(parts) / route.row_parts)
                    need[s] += min(bound, held, n)
        return int(max(1, min(need.max(), st.rows * self.num_shards)))

    def _route(self, st: _Stack, reqs):
        """Sort + de-duplicate requests and assign each unique (owner, row) a slot of the send buffer.

        One packed sort key `owner * R + row` (fits int32: `_layout` checks (shards + 1) * R < 2**31);
        invalid requests carry owner S and sort last. Slots are ranks among the owner's unique rows.
        """
        dest, row, C = reqs["dest"], reqs["row"], reqs["capacity"]
        S, R = self.num_shards, st.rows
        n = dest.shape[0]
        iota = jnp.arange(n, dtype=jnp.int32)
        skey, perm = jax.lax.sort((dest * R + row, iota), num_keys=1)
        new = jnp.concatenate([jnp.ones((1,), bool), skey[1:] != skey[:-1]])
        uid = jnp.cumsum(new, dtype=jnp.int32) - 1
        sd, sr = skey // R, skey % R
        uniques = jax.ops.segment_sum(new.astype(jnp.int32), sd, num_segments=S + 1, indices_are_sorted=True)
        slot = uid - (jnp.cumsum(uniques) - uniques)[sd]
        fits = (sd < S) & (slot < C)
        overflow = jnp.sum(new & (sd < S) & (slot >= C), dtype=jnp.int32)
        send_rows = jnp.full((S, C), -1, jnp.int32).at[jnp.where(fits, sd, S), slot].set(sr, mode="drop")
        inv = jnp.zeros((n,), jnp.int32).at[perm].set(iota)  # original request -> sorted position
        return {
            "send_rows": send_rows,
            "overflow": overflow,
            "dest": jnp.where(fits, sd, S)[inv],
            "slot": slot[inv],
            "keep": fits[inv].astype(jnp.float32),
        }

    def _partial_features(self, feats, ids) -> frozenset:
        """Pooled features whose output comes back as per-bag partial sums (see `pooled_comm`)."""
        if self.num_shards == 1 or self.pooled_comm == "rows":
            return frozenset()
        out = set()
        for f in feats:
            t = self.tables[self.feature_table[f]]
            if t.pooling is not None and (self.pooled_comm == "partial_sums" or ids[f].shape[1] > 1):
                out.add(f)
        return frozenset(out)

    def _pair_requests(self, key, feats, ids):
        """(owner, row, slot) of every valid id of the partial-sum features reading stack `key`.

        Each owner keeps one partial-sum slot per bag only for the segments (feature, column block) it
        holds a piece of, so a table-wise feature's sums travel to and from its one owner only; `slot`
        is the bag's slot on that owner (static offsets `off[owner, segment]`).
        """
        S = self.num_shards
        segs = []
        for f in sorted(feats):
            route = self._routes[self.feature_table[f]]
            if route.stack == key:
                segs += [(f, c, route) for c in range(route.col_parts)]
        if not segs:
            return None
        off = np.full((S + 1, len(segs)), 0, np.int32)  # row S: invalid requests (dropped anyway)
        owners, used = [], np.zeros(S, np.int64)
        for j, (f, c, route) in enumerate(segs):
            b = ids[f].shape[0]
            holders = sorted(set(int(d) for d in route.shard[:, c]))
            for d in holders:
                off[d, j] = used[d]
                used[d] += b
            owners.append(tuple(holders))
        dest, row, slot, segments = [], [], [], []
        for j, (f, c, route) in enumerate(segs):
            t = self.tables[self.feature_table[f]]
            b, L = ids[f].shape
            x = ids[f].reshape(-1)
            valid = (x >= 0) & (x < t.stored_rows)
            sid = jnp.where(valid, x, 0)
            part = sid % route.row_parts if route.row_parts > 1 else jnp.zeros_like(sid)
            d = jnp.where(valid, jnp.asarray(route.shard[:, c])[part], S)
            dest.append(d)
            row.append(jnp.asarray(route.offset[:, c])[part] + sid // route.row_parts)
            slot.append(jnp.asarray(off[:, j])[d] + jnp.repeat(jnp.arange(b, dtype=jnp.int32), L))
            segments.append((f, c, b, owners[j], tuple(int(o) for o in off[:S, j])))
        return {
            "dest": jnp.concatenate(dest).astype(jnp.int32),
            "row": jnp.concatenate(row).astype(jnp.int32),
            "bag": jnp.concatenate(slot).astype(jnp.int32),
            "segments": segments,
            "bags": int(max(1, used.max())),
            "capacity": self._pair_capacity(key, feats, ids),
        }

    def _pair_capacity(self, key, feats, ids) -> int:
        """Static (row, bag) slots per destination: the worst case, or capacity_factor x the uniform share."""
        need = np.zeros(self.num_shards, np.int64)
        for f in feats:
            route = self._routes[self.feature_table[f]]
            if route.stack != key:
                continue
            n = int(np.prod(ids[f].shape))
            for c in range(route.col_parts):
                for s in range(self.num_shards):
                    parts = sum(1 for p in range(route.row_parts) if route.shard[p, c] == s)
                    if parts:
                        bound = n
                        if self.capacity_factor is not None and route.row_parts > 1:
                            bound = min(n, math.ceil(self.capacity_factor * n * parts / route.row_parts))
                        need[s] += bound
        return int(max(1, need.max()))

    def _pair_route(self, reqs, block_rows: int):
        """Each valid (row, bag) pair gets a slot among the pairs bound for its owner (no de-duplication:
        the owner pools per bag). A pair travels as one int32 `row * bags + bag` when that fits, else as
        two; -1 marks an empty slot."""
        dest, C = reqs["dest"], reqs["capacity"]
        S, G = self.num_shards, reqs["bags"]
        n = dest.shape[0]
        iota = jnp.arange(n, dtype=jnp.int32)
        sd, perm = jax.lax.sort((dest, iota), num_keys=1)
        counts = jax.ops.segment_sum(jnp.ones((n,), jnp.int32), sd, num_segments=S + 1, indices_are_sorted=True)
        slot = iota - (jnp.cumsum(counts) - counts)[sd]
        fits = (sd < S) & (slot < C)
        overflow = jnp.sum((sd < S) & (slot >= C), dtype=jnp.int32)
        row, bag = reqs["row"][perm], reqs["bag"][perm]
        packed = block_rows * G < 2**31
        payload = row * G + bag if packed else jnp.stack([row, bag], axis=-1)
        shape = (S, C) if packed else (S, C, 2)
        send = jnp.full(shape, -1, jnp.int32).at[jnp.where(fits, sd, S), slot].set(payload, mode="drop")
        return {"send": send, "overflow": overflow, "packed": packed}

    @staticmethod
    def _unpack_pairs(recv, route, bags):
        """Received pairs -> (rows, bags), -1 rows for empty slots."""
        if route["packed"]:
            return jnp.where(recv >= 0, recv // bags, -1), jnp.where(recv >= 0, recv % bags, 0)
        return recv[..., 0], recv[..., 1]

    def _bag_grads(self, f, c, width, x, g):
        """Per-bag gradient [b, width] of column block c of a partial-sum feature (mean: / ids per bag)."""
        t = self.tables[self.feature_table[f]]
        g = g[:, c * width : (c + 1) * width]
        if t.pooling == "mean":
            valid = ((x >= 0) & (x < t.stored_rows)).sum(-1, keepdims=True)
            g = g / jnp.maximum(valid, 1).astype(g.dtype)
        return g

    def _request_grads(self, f, c, width, x, g):
        """Per-request gradient [b*L, width] of column block c of feature f (zero for padding)."""
        t = self.tables[self.feature_table[f]]
        b, L = x.shape
        valid = ((x >= 0) & (x < t.stored_rows)).astype(jnp.float32)
        g = g[..., c * width : (c + 1) * width]
        if t.pooling is None:
            per = g * valid[..., None]
        else:
            if t.pooling == "mean":
                g = g / jnp.maximum(valid.sum(-1, keepdims=True), 1.0)
            per = g[:, None, :] * valid[..., None]
        return per.reshape(b * L, width)

    # ------------------------------------------------------------------ info

    def describe(self) -> str:
        """A short human-readable summary of the layout (stacks, shards, rows per shard)."""
        lines = [
            f"EmbeddingCollection: {len(self.tables)} tables, topology {self.topology}, "
            f"{self.num_shards} shards x {self.num_replicas} replicas on a {self.nodes}x{self.local} mesh"
        ]
        for k, st in self._stacks.items():
            lines.append(f"  stack {k}: width {st.width}, {st.rows} rows per shard")
        for t in self.tables:
            ts = self.plan.tables[t.name]
            lines.append(f"  table {t.name}: {t.rows}x{t.dim} {ts.sharding} shards={list(ts.shards)}")
        return "\n".join(lines)


def stacks_to_dense(tables, plan: ShardingPlan, stacks: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Host stacks {key: [shards, R, w]} of one replica -> dense tables {name: [rows, dim]} (pure, no devices)."""
    layout, _ = _layout(tables, plan)
    out = {t.name: np.zeros((t.stored_rows, t.stored_dim), np.float32) for t in tables}
    for k, st in layout.items():
        for s, pieces in enumerate(st.pieces):
            for pc in pieces:
                cols = slice(pc.col_part * st.width, (pc.col_part + 1) * st.width)
                out[tables[pc.table].name][pc.row_part :: pc.row_parts, cols] = stacks[k][
                    s, pc.offset : pc.offset + pc.rows
                ]
    return out


def slots_to_dense(tables, plan: ShardingPlan, stacks: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Host slot stacks {key: [shards, R]} -> {name: [rows]} ([rows, col_parts] for column-wise tables)."""
    layout, _ = _layout(tables, plan)
    out = {}
    for t in tables:
        cp = plan.tables[t.name].col_parts
        out[t.name] = np.zeros((t.stored_rows, cp) if cp > 1 else (t.stored_rows,), np.float32)
    for k, st in layout.items():
        for s, pieces in enumerate(st.pieces):
            for pc in pieces:
                dst = out[tables[pc.table].name]
                vals = stacks[k][s, pc.offset : pc.offset + pc.rows]
                if dst.ndim == 2:
                    dst[pc.row_part :: pc.row_parts, pc.col_part] = vals
                else:
                    dst[pc.row_part :: pc.row_parts] = vals
    return out


def _pool(emb, valid, pooling):
    if pooling is None:
        return emb
    s = emb.sum(axis=1)
    if pooling == "mean":
        s = s / jnp.maximum(valid.sum(-1, keepdims=True), 1).astype(s.dtype)
    return s


def _axis_index(axes):
    return jax.lax.axis_index(axes if len(axes) > 1 else axes[0])


def _layout(tables, plan: ShardingPlan):
    """Per-width stacks and per-table routes, from the plan (pure, host-side)."""
    S = plan.num_shards
    per_width: dict[int, list[list[_Piece]]] = {}
    routes = []
    fill: dict[int, list[int]] = {}
    for i, t in enumerate(tables):
        ts = plan.tables[t.name]
        width = t.stored_dim // ts.col_parts
        shards = per_width.setdefault(width, [[] for _ in range(S)])
        used = fill.setdefault(width, [0] * S)
        shard = np.zeros((ts.row_parts, ts.col_parts), np.int32)
        offset = np.zeros((ts.row_parts, ts.col_parts), np.int32)
        for p in range(ts.row_parts):
            for c in range(ts.col_parts):
                s = ts.shard_of(p, c)
                n = ts.piece_rows(t.stored_rows, p)
                shards[s].append(_Piece(i, p, ts.row_parts, c, n, used[s]))
                shard[p, c], offset[p, c] = s, used[s]
                used[s] += n
        routes.append(_Route(f"w{width}", ts.row_parts, ts.col_parts, shard, offset))
    stacks = {}
    for width, shards in sorted(per_width.items()):
        rows = max(1, max(fill[width]))
        if rows * (S + 1) >= 2**31:
            raise ValueError(
                f"stack of width {width} holds {rows} rows on each of {S} shards; (shards + 1) * rows "
                f"must stay below 2**31 (packed int32 routing keys)"
            )
        stacks[f"w{width}"] = _Stack(f"w{width}", width, rows, tuple(tuple(p) for p in shards))
    return stacks, routes


def _piece_meta(st: _Stack, S: int) -> dict[str, np.ndarray]:
    """Per-shard arrays (padded to the max piece count) describing the pieces of a stack."""
    npieces = max(1, max(len(p) for p in st.pieces))
    meta = {
        k: np.zeros((S, npieces), np.int32) for k in ("start", "rows", "table", "row_part", "row_parts", "col_part")
    }
    meta["start"][:] = st.rows  # padding pieces start past the end
    meta["row_parts"][:] = 1
    for s, pieces in enumerate(st.pieces):
        for j, pc in enumerate(pieces):
            meta["start"][s, j], meta["rows"][s, j], meta["table"][s, j] = pc.offset, pc.rows, pc.table
            meta["row_part"][s, j], meta["row_parts"][s, j], meta["col_part"][s, j] = (
                pc.row_part,
                pc.row_parts,
                pc.col_part,
            )
    return meta


def _as_int32(feature, x) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype == np.int32:
        return x
    if np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating):
        if x.size and (not np.all(np.isfinite(x)) if np.issubdtype(x.dtype, np.floating) else False):
            raise TypeError(f"feature {feature!r}: ids contain NaN or Inf")
        y = x.astype(np.int32)
        if not np.array_equal(y.astype(x.dtype), x) or (
            x.size and (x.max() > np.iinfo(np.int32).max or x.min() < np.iinfo(np.int32).min)
        ):
            raise TypeError(f"feature {feature!r}: ids of dtype {x.dtype} cannot be converted to int32 without loss")
        return y
    raise TypeError(f"feature {feature!r}: ids must be integers (int32), got dtype {x.dtype}")


def _put(x: np.ndarray, sharding: NamedSharding):
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _to_host(a) -> np.ndarray:
    if a.is_fully_addressable:
        return np.asarray(a)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))
