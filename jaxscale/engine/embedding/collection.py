"""`EmbeddingCollection`: sharded tables looked up and trained inside one `shard_map`.

Lookup (forward), per stack, on every device, for its slice of the batch:
  1. every (id, column block) becomes a request (owner shard, row in the owner's block); padding and
     invalid ids become no request (`routing`);
  2. requests are de-duplicated and given positions in a static `[shards, capacity]` send buffer, sized for
     this batch by the host (`capacity`), or the worst case / a fixed factor;
  3. the row ids travel to their owners (one all-to-all over the shard axes), the owners gather the rows
     (`kernels`) and send them back (a second all-to-all, in the forward comm precision);
  4. each request reads its row; column blocks are concatenated and bags pooled (or returned as sequences).
  Pooled features with several ids per bag instead send (row, bag) pairs and get back one partial sum per
  bag from each owner (B x dim instead of B x L x dim on the wire).

Update (backward) runs the reverse path: per-request output gradients are summed per unique row on the
requester, sent to the owners (backward precision), summed again there over all requesters and, under
exact replica sync, over all replicas (`sync`); the optimizer then touches only those rows, in place
(the state is donated). No dense [rows, dim] gradient is ever built.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.engine import collectives
from jaxscale.engine.embedding import capacity as capacity_lib
from jaxscale.engine.embedding import kernels, routing, sync
from jaxscale.engine.embedding.ids import PADDING_ID, ShardedIds, check_ids
from jaxscale.engine.embedding.layout import piece_meta, plan_layout
from jaxscale.engine.embedding.settings import AUTO_TOPOLOGY, EmbeddingSettings
from jaxscale.engine.embedding.state import StateSpec
from jaxscale.engine.mesh import BATCH_AXES, Topology
from jaxscale.engine.optimizers import RowWiseAdagrad
from jaxscale.engine.quantization import payload_bytes
from jaxscale.engine.tables import TableConfig, check_tables

_NO_STATS = {"overflow": P(), "invalid_ids": P()}


class EmbeddingCollection:
    """A set of embedding tables sharded over a ('node', 'local') mesh.

    Args:
      tables: the `TableConfig`s.
      mesh: a mesh from `jaxscale.make_mesh`.
      settings: an `EmbeddingSettings` (topology, sharding, optimizer, comm precisions, capacities, replica
        sync, pooled comm: see its docstring); None: the defaults.
      plan: a `ShardingPlan` (object or its dict/JSON form) to run instead of `settings.sharding`, e.g. the
        one the planner scored (`jaxscale.engine.planner.resolve`).
    """

    def __init__(self, tables: Sequence[TableConfig], mesh, settings: EmbeddingSettings | None = None, plan=None):
        settings = EmbeddingSettings() if settings is None else settings
        if not isinstance(settings, EmbeddingSettings):
            raise TypeError(f"settings must be a jaxscale.EmbeddingSettings, got {type(settings).__name__}")
        if settings.topology == AUTO_TOPOLOGY:
            raise ValueError("topology 'auto' is chosen by the planner (engine.planner.resolve) before a collection")
        self.settings = settings
        self.tables = check_tables(tables)
        self.mesh = mesh
        self.topology = Topology.of(settings.topology, mesh)
        self.nodes, self.local = self.topology.nodes, self.topology.local
        self.plan, self.layout = plan_layout(
            self.tables,
            settings.topology,
            self.nodes,
            self.local,
            settings.sharding if plan is None else plan,
            settings.plan_file if plan is None else None,
        )
        if settings.reuse_capacities and self._exact_sync:
            raise ValueError(
                f"reuse_capacities=True cannot run the exact replica sync of topology {settings.topology!r} on this "
                f"{self.nodes}x{self.local} mesh ({self.num_replicas} replicas): its buffers are sized "
                "from the touched rows counted and exchanged for every batch, and the lookup cannot see their "
                "overflow. Use a periodic replica_sync, topology='1d', or reuse_capacities=False"
            )
        self.feature_table = {f: i for i, t in enumerate(self.tables) for f in t.features}
        markers = ("touched",) if settings.replica_sync.sparse and self.num_replicas > 1 else ()
        self.state_spec = StateSpec(mesh, self.layout, self.topology, settings.optimizer, markers)
        self.batch_sharding = NamedSharding(mesh, P(BATCH_AXES))
        self._capacity_cache = capacity_lib.CapacityCache()
        self._reusable: dict = {}  # batch signature (features, shapes) -> largest counted capacities
        self._pair_codecs: dict = {}  # (stack, segments, bag length) -> routing.PairCodec
        self._lookup_jit = jax.jit(self._lookup)
        self._update_jit = jax.jit(self._update, donate_argnums=0)

    # ------------------------------------------------------------------ layout facts

    @property
    def shard_axes(self) -> tuple[str, ...]:
        return self.topology.shard_axes

    @property
    def replica_axes(self) -> tuple[str, ...]:
        return self.topology.replica_axes

    @property
    def num_shards(self) -> int:
        return self.topology.num_shards

    @property
    def num_replicas(self) -> int:
        return self.topology.num_replicas

    @property
    def _exact_sync(self) -> bool:
        return self.num_replicas > 1 and self.settings.replica_sync.exact

    def _sparse_capacity(self, key: str) -> int:
        """Rows per shard the sparse periodic sync moves in its compacted all-reduce."""
        rows = self.layout.stacks[key].rows
        return min(rows, self.settings.replica_sync.sparse_rows or max(1, rows // 8))

    @property
    def _invariant_adagrad(self) -> bool:
        """Row-wise AdaGrad with one accumulator per row over the full dim (the default)."""
        opt = self.settings.optimizer
        return isinstance(opt, RowWiseAdagrad) and not opt.per_column_shard

    # ------------------------------------------------------------------ state

    def state_shardings(self):
        """NamedShardings of the state pytree (for jit in/out shardings and checkpoint restore)."""
        return self.state_spec.shardings()

    def abstract_state(self):
        """ShapeDtypeStructs (with shardings) of the state: a restore target for orbax."""
        return self.state_spec.abstract()

    def init(self, key):
        """Initial state, generated on the devices (no table is built on the host).

        Row r of table t is uniform(-s, s) with s = `TableConfig.scale`, drawn from
        fold_in(fold_in(key, t), r): the values do not depend on the mesh, topology or sharding.
        """
        return self._init_fn(key)

    @functools.cached_property
    def _init_fn(self):
        return self.state_spec.init_fn()

    def from_dense(self, tables: Mapping[str, np.ndarray]):
        """State holding the given dense tables ({name: [rows, dim]}; stored shape under 'half_dim')."""
        return self.state_spec.from_dense(tables)

    def load_dense(self, tables, slots=None, step: int = 0):
        """Like `from_dense`, also setting the optimizer state ({slot: {table: [rows] | [rows, k]}}) and the
        step. A slot saved per column shard ([rows, k]) is read per column piece when k matches, else
        averaged over its columns."""
        return self.state_spec.from_dense(tables, slots, step)

    def to_dense(self, state, replica: int = 0) -> dict[str, np.ndarray]:
        """The tables of `state` as dense host arrays {name: [rows, dim]}, read from one replica."""
        return self.state_spec.to_dense(state, replica)

    def slots_to_dense(self, state, replica: int = 0) -> dict[str, dict[str, np.ndarray]]:
        """Per-row optimizer state as {slot: {table: [rows]}}; [rows, col_parts] for a column-wise table
        under `RowWiseAdagrad(per_column_shard=True)` (one state per column shard, as in TorchRec)."""
        per_shard = bool(getattr(self.settings.optimizer, "per_column_shard", False))
        return self.state_spec.slots_to_dense(state, replica, per_shard)

    def layout_signature(self) -> dict:
        """What the stored arrays' layout depends on; equal signatures mean a state can be reused as is."""
        return self.state_spec.signature()

    # ------------------------------------------------------------------ ids

    def validate_ids(self, ids: Mapping[str, object], *, global_batch: bool = True) -> dict[str, np.ndarray]:
        """Checks host ids and returns them as int32 [B, L]; raises ValueError/TypeError naming the problem.

        Accepts [B] (one id per example) or [B, L]; integer or float dtypes are converted to int32 when
        the conversion is lossless, refused otherwise. Ids must be in [0, rows) or the padding id -1.
        """
        out, invalid = check_ids(ids, self.tables, self.feature_table)
        if invalid:
            raise ValueError(invalid[0].message())
        if out and global_batch:
            b = next(iter(out.values())).shape[0]
            devices = self.nodes * self.local
            if b % devices:
                raise ValueError(f"batch size {b} is not divisible by the {devices} devices of the mesh")
        return out

    def capacities(self, ids: Mapping[str, np.ndarray], *, recount: bool = False):
        """Exchange capacities for host ids (this process's rows): counted from the ids when
        capacity_factor is None (the smallest already-compiled set that fits them, see
        `capacity.CapacityCache`), else None (the fixed shapes). None too when there is one shard and no
        exact replica sync: every row is local and nothing is exchanged, so there is nothing to count.
        Under `reuse_capacities` the largest counted set is reused without counting, unless `recount`
        or nothing was counted yet."""
        return self._finish_capacities(self._start_capacities(ids, recount))

    def _start_capacities(self, ids: Mapping[str, np.ndarray], recount: bool = False):
        """Counts this process's needs and, in a multi-process run, starts the exchange of the maxima
        (dispatched, not awaited): (local counts, the exchange in flight or None). Under
        `reuse_capacities`: the reused set itself, nothing counted."""
        if self.settings.capacity_factor is not None or (self.num_shards == 1 and not self._exact_sync):
            return None
        signature = tuple(sorted((n, x.shape) for n, x in ids.items()))
        reused = self._reusable.get(signature) if self.settings.reuse_capacities and not recount else None
        if reused is not None:
            return reused  # the same on every process: it changes only with exchanged counts
        exchange = None
        first, devices = 0, self.nodes * self.local
        if jax.process_count() > 1:
            exchange = _exchange_across_processes
            first, devices = jax.process_index() * self.local, self.local
        local = capacity_lib.count_local(
            self.layout,
            self.feature_table,
            self.topology,
            ids,
            self.settings.pooled_comm,
            self._exact_sync,
            self.settings.replica_sync.strategy,
            lambda w: payload_bytes(1, w, self.settings.comm.backward),
            first_device=first,
            num_devices=devices,
            exchange=exchange,
        )
        in_flight = _start_process_allgather(local.maxima) if exchange is not None and local.stacks else None
        return signature, local, in_flight

    def _finish_capacities(self, pending):
        if pending is None or isinstance(pending, capacity_lib.Capacities):
            return pending
        signature, local, in_flight = pending
        every = local.maxima[None] if in_flight is None else _read_process_allgather(in_flight)
        chosen = self._capacity_cache.choose(local.capacities(every), local.worst)
        known = self._reusable.get(signature)
        if known is None or chosen.slots() > known.slots():
            self._reusable[signature] = chosen
        return chosen

    def shard_batch(self, batch: Mapping[str, np.ndarray], *, recount: bool = False):
        """Host arrays (this process's slice of the global batch) -> global arrays sharded by batch.

        Ids (int32 [B, L] of the collection's features) come back as a `ShardedIds` carrying this batch's
        exchange capacities (see `capacities`); anything else (e.g. per-example targets) as a plain dict.
        In a multi-process run the ids are placed while the processes exchange their counts.
        `recount`: count this batch even under `reuse_capacities` (the re-run of a batch that overflowed);
        every process must pass the same value.
        """
        host = {name: np.asarray(x) for name, x in batch.items()}
        for name, x in host.items():
            if name in self.feature_table and np.issubdtype(x.dtype, np.integer):  # ids (float: e.g. gradients)
                _check_ids_rank(name, x.shape)
        is_ids = bool(host) and all(n in self.feature_table and np.issubdtype(x.dtype, np.integer) for n in host)
        if is_ids:
            host = {n: x if x.ndim == 2 else x[:, None] for n, x in host.items()}
        pending = (
            self._start_capacities({n: x.astype(np.int32, copy=False) for n, x in host.items()}, recount)
            if is_ids
            else None
        )
        # one batched transfer of every array (a call per array costs ~0.1 ms of Python each)
        if jax.process_count() == 1:
            arrays = jax.device_put(host, self.batch_sharding)
        else:
            shapes = {n: (x.shape[0] * jax.process_count(),) + x.shape[1:] for n, x in host.items()}
            shardings = dict.fromkeys(host, self.batch_sharding)
            arrays = jax.make_array_from_process_local_data(shardings, host, shapes)
        if not is_ids:
            return arrays
        return ShardedIds(arrays, self._finish_capacities(pending))

    def _prepare(self, ids):
        """Host inputs are validated and sharded; traced/global arrays pass through (policy inside jit)."""
        if isinstance(ids, ShardedIds) or all(isinstance(x, jax.Array) for x in ids.values()):
            for f, x in ids.items():
                if f not in self.feature_table:
                    raise ValueError(f"feature {f!r} has no table; known features: {sorted(self.feature_table)}")
                if not jnp.issubdtype(x.dtype, jnp.integer):
                    raise TypeError(f"feature {f!r}: ids must be int32, got {x.dtype}")
                _check_ids_rank(f, x.shape)
            if isinstance(ids, ShardedIds) and all(x.ndim == 2 and x.dtype == jnp.int32 for x in ids.values()):
                return ids
            caps = ids.capacities if isinstance(ids, ShardedIds) else None
            return ShardedIds({f: (x if x.ndim == 2 else x[:, None]).astype(jnp.int32) for f, x in ids.items()}, caps)
        return self.shard_batch(self.validate_ids(ids, global_batch=jax.process_count() == 1))

    def _capacities_in_trace(self, ids: ShardedIds) -> capacity_lib.Capacities:
        """The batch's counted capacities, or static ones from the per-device shapes."""
        if ids.capacities is not None:
            return ids.capacities
        devices = self.nodes * self.local
        shapes = {f: (x.shape[0] // devices, x.shape[1]) for f, x in ids.items()}
        return capacity_lib.static_capacities(
            self.layout,
            self.feature_table,
            self.topology,
            shapes,
            self.settings.pooled_comm,
            self.settings.capacity_factor,
            self._exact_sync,
        )

    def _shard_map(self, body, in_specs, out_specs, check_vma: bool = True):
        """The one place the collection enters `shard_map` (bodies see one device's blocks)."""
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)

    # ------------------------------------------------------------------ lookup

    def lookup(self, state, ids, *, return_stats: bool = False):
        """{feature: [B, dim]} (pooled) or {feature: [B, L, dim]} (sequence), sharded by batch.

        Inside jit, an id out of range (>= rows, or negative other than -1) is treated as padding and
        counted in stats['invalid_ids']; outside jit, host ids are validated and such an id raises.
        With return_stats, also returns {'overflow': unique rows that did not fit a fixed or reused capacity
        (always 0 for a batch counted by `shard_batch`), 'invalid_ids': count}, summed over every device.
        """
        ids = self._prepare(ids)
        out, stats = self._lookup_jit(state, ids)
        return (out, stats) if return_stats else out

    def _lookup(self, state, ids: ShardedIds):
        feats = tuple(sorted(ids))
        caps = self._capacities_in_trace(ids)
        spec = self.state_spec.spec
        fn = self._shard_map(
            functools.partial(self._lookup_body, feats, caps),
            in_specs=({k: spec for k in self.layout.stacks}, {f: P(BATCH_AXES) for f in feats}),
            out_specs=({f: P(BATCH_AXES) for f in feats}, _NO_STATS),
            # sums carried by an all-to-all are equal on every device; the checker only knows psum's are
            check_vma=not self._counters_ride_ids,
        )
        out, stats = fn(state["weights"], {f: ids[f] for f in feats})
        return {f: x.astype(self.settings.output_dtype) for f, x in out.items()}, stats

    def _partial(self, feats, ids) -> frozenset:
        return capacity_lib.pair_features(
            self.layout, self.feature_table, feats, {f: ids[f].shape[1] for f in feats}, self.settings.pooled_comm
        )

    def _lookup_body(self, feats, caps, weights, ids):
        partial = self._partial(feats, ids)
        parts: dict[str, dict[int, jax.Array]] = {}  # feature -> column block -> [b, (L,) w]
        fused = {}  # single-shard features, gathered and pooled in one kernel
        if self.num_shards == 1:  # every row is local: no routing, no all-to-all
            for f in feats:
                t = self.tables[self.feature_table[f]]
                table = weights[self.layout.routes[self.feature_table[f]].stack][0, 0]
                fused[f] = kernels.gather_pool(table, self._local_rows(f, ids[f]), pooling=t.pooling)
        routed = self._route(feats, ids, caps, partial)
        counters = self._counters(feats, ids, [r[-1] for r in routed])
        totals = None if self._counters_ride_ids and routed else self._sum_counters(counters)
        for mode, key, req, route in routed:
            exchange = self._exchange_pairs if mode == "pairs" else self._exchange_rows
            # the first exchange of ids also carries every device's counters (see _counters_ride_ids)
            got = exchange(key, weights[key][0, 0], req, route, parts, counters if totals is None else None)
            totals = got if totals is None else totals
        outputs = {}
        for f in feats:
            t = self.tables[self.feature_table[f]]
            x = ids[f]
            valid = (x >= 0) & (x < t.stored_rows)
            if f in fused:
                outputs[f] = fused[f]
                continue
            blocks = jnp.concatenate([parts[f][c] for c in range(len(parts[f]))], axis=-1)
            if f in partial:  # the owners' partial sums, added up; mean divides by the valid ids
                if t.pooling == "mean":
                    blocks = blocks / jnp.maximum(valid.sum(-1, keepdims=True), 1).astype(blocks.dtype)
                outputs[f] = blocks
            else:
                outputs[f] = kernels.pool(blocks.reshape(x.shape + (t.stored_dim,)), valid, t.pooling)
        return outputs, {"overflow": totals[0], "invalid_ids": totals[1]}

    def _local_rows(self, feature, x):
        """Single shard: a feature's ids as rows of the (only) block; padding and invalid ids -> -1."""
        t_idx = self.feature_table[feature]
        t = self.tables[t_idx]
        offset = int(self.layout.routes[t_idx].offset[0, 0])
        return jnp.where((x >= 0) & (x < t.stored_rows), x + offset, -1)

    def _route(self, feats, ids, caps, partial) -> list:
        """[(mode, stack, request, route)] of every exchange, 'pairs' before 'rows' in each stack. The
        lookup and the update build them alike: XLA then merges their identical ids all-to-alls into one."""
        if self.num_shards == 1:
            return []
        out = []
        for key in self.layout.stacks:
            mine = [f for f in feats if self.layout.routes[self.feature_table[f]].stack == key]
            pair_feats = [f for f in sorted(partial) if f in mine]
            row_feats = [f for f in mine if f not in partial]
            if pair_feats:
                req = routing.pair_requests(self.layout, self.feature_table, key, pair_feats, ids)
                route = routing.route_pairs(req, self.num_shards, self._pair_codec(key, req), caps[key].pairs)
                out.append(("pairs", key, req, route))
            if row_feats:
                req = routing.row_requests(self.layout, self.feature_table, key, row_feats, ids)
                route = routing.route_rows(req, self.num_shards, self.layout.stacks[key].rows, caps[key].rows)
                out.append(("rows", key, req, route))
        return out

    def _counters(self, feats, ids, routes) -> jax.Array:
        """This device's [overflow, invalid ids] of a batch (the same computation in lookup and update)."""
        invalid = jnp.zeros((), jnp.int32)
        for f in feats:
            x, t = ids[f], self.tables[self.feature_table[f]]
            invalid += jnp.sum((x != PADDING_ID) & ((x < 0) | (x >= t.stored_rows)), dtype=jnp.int32)
        overflow = functools.reduce(jnp.add, [r.overflow for r in routes], jnp.zeros((), jnp.int32))
        return jnp.stack([overflow, invalid])

    @property
    def _counters_ride_ids(self) -> bool:
        """The lookup's counters travel inside its first ids all-to-all, as extra words of every block,
        when that all-to-all spans every device (no replicas): one collective round fewer per step than
        an all-reduce of its own. With replicas, the shard group's sums would still need adding up over
        the replicas, so the all-reduce stays."""
        return self.num_shards > 1 and self.num_shards == self.nodes * self.local

    def _sum_counters(self, counters):
        # Each device counts its own requests (and its own sync rows), so the sums over every device are the
        # totals: nothing is divided by the replica count. One all-reduce (gloo's beats an all-to-all for
        # two values between 4 processes: experiments/results/collective_latency.md).
        return jax.lax.psum(counters, BATCH_AXES)

    def _stats(self, overflow, invalid):
        totals = self._sum_counters(jnp.stack([overflow, invalid]))
        return {"overflow": totals[0], "invalid_ids": totals[1]}

    def _send_ids(self, send, counters):
        """The ids' all-to-all; with `counters`, also their sums over every device (None without)."""
        if counters is None:
            return collectives.all_to_all_ids(send, self.shard_axes), None
        return collectives.all_to_all_ids_and_sum(send, counters, self.shard_axes)

    def _exchange_rows(self, key, table, req, route, parts, counters=None):
        """Row strategy: unique rows fetched from their owners; fills parts[f][c] with [b*L, w]."""
        wanted, totals = self._send_ids(route.send_rows, counters)  # [S, C] rows asked of me
        rows = kernels.gather_rows(table, wanted)
        back = collectives.all_to_all(
            rows, self.shard_axes, self.settings.comm.forward, fp8_format=self.settings.comm.fp8_forward_format
        )
        vals = back.at[route.dest, route.position].get(mode="fill", fill_value=0.0) * route.keep[:, None]
        for seg in req.segments:
            parts.setdefault(seg.feature, {})[seg.col_block] = vals[seg.start : seg.start + seg.size]
        return totals

    def _exchange_pairs(self, key, table, req, route, parts, counters=None):
        """Pair strategy: (row, bag) pairs to the owners, one partial sum per bag back from each holder."""
        st = self.layout.stacks[key]
        recv, totals = self._send_ids(route.send, counters)  # (row, bag) pairs for me
        rrow, rbag = routing.unpack_pairs(recv, route, req.bags, jax.lax.axis_index(self.shard_axes))
        S, G = self.num_shards, req.bags
        segment = jnp.where(rrow >= 0, jnp.arange(S)[:, None] * G + rbag, -1)  # the bag's partial sum, per owner
        sums = kernels.gather_segment_sum(table, rrow.reshape(-1), segment.reshape(-1), num_segments=S * G)
        sums = sums.reshape(S, G, st.width)
        back = collectives.all_to_all(
            sums, self.shard_axes, self.settings.comm.forward, fp8_format=self.settings.comm.fp8_forward_format
        )
        for seg in req.segments:  # add the partial sums of every owner holding a piece of this block
            partial_sums = [back[d, seg.offsets[d] : seg.offsets[d] + seg.bags] for d in seg.holders]
            parts.setdefault(seg.feature, {})[seg.col_block] = functools.reduce(jnp.add, partial_sums)
        return totals

    # ------------------------------------------------------------------ update

    def update(self, state, ids, grads, *, apply=True, after=None, return_stats: bool = False):
        """Applies the optimizer to the looked-up rows, given gradients w.r.t. the lookup outputs.

        `apply` may be a traced boolean: False leaves weights and optimizer state unchanged (used to skip
        a step on a non-finite loss or on overflow without copying the tables). The state is donated.

        `after`: this step's lookup outputs (or any arrays sharded by batch) that the in-place update must
        wait for. A train step whose gradients come from the lookup needs nothing; when one jitted step
        looks up and then updates with gradients that do NOT depend on the lookup (given or precomputed
        gradients, as in a kernel benchmark), nothing orders the two, and XLA copies every donated table
        to keep the old one alive for the lookup. Passing the outputs here orders them instead.
        """
        ids = self._prepare(ids)
        new_state, stats = self._update_jit(state, ids, grads, apply, after)
        return (new_state, stats) if return_stats else new_state

    def _update(self, state, ids: ShardedIds, grads, apply=True, after=None):
        feats = tuple(sorted(ids))
        missing = [f for f in feats if f not in grads]
        if missing:
            raise ValueError(f"update: no gradient for features {missing}")
        caps = self._capacities_in_trace(ids)
        slots = self.state_spec.slots
        spec = self.state_spec.spec
        stacks = {k: spec for k in self.layout.stacks}
        batch = {f: P(BATCH_AXES) for f in feats}
        after = self._order_inputs(after)
        fn = self._shard_map(
            functools.partial(self._update_body, feats, caps),
            in_specs=(stacks, {s: stacks for s in slots}, batch, batch, P(), P(), [P(BATCH_AXES)] * len(after)),
            out_specs=(stacks, {s: stacks for s in slots}, _NO_STATS),
        )
        weights, slot_state, stats = fn(
            state["weights"],
            {s: state[s] for s in slots},
            {f: ids[f] for f in feats},
            {f: grads[f].astype(jnp.float32) for f in feats},
            jnp.asarray(apply, jnp.bool_),
            state["step"],
            after,
        )
        return dict(state, weights=weights, step=state["step"] + 1, **slot_state), stats

    def _order_inputs(self, after) -> list:
        """The leaves of `after` as a list of batch-sharded arrays (checked: each splits over the devices)."""
        leaves = [jnp.asarray(x) for x in jax.tree.leaves(after)]
        devices = self.nodes * self.local
        for i, x in enumerate(leaves):
            if x.ndim == 0 or x.shape[0] % devices:
                raise ValueError(
                    f"update(after=...): leaf {i} has shape {x.shape}; after takes arrays sharded by batch "
                    f"(the lookup outputs), whose leading dim divides over the {devices} devices"
                )
        return leaves

    def _update_body(self, feats, caps, weights, slot_state, ids, grads, apply, step, after):
        weights, slot_state = dict(weights), {s: dict(v) for s, v in slot_state.items()}
        partial = self._partial(feats, ids)
        routed = {(mode, key): (req, route) for mode, key, req, route in self._route(feats, ids, caps, partial)}
        counters = self._counters(feats, ids, [r for _, r in routed.values()])
        # the first ids exchange carries the counters exactly as the lookup's does: the two are then one
        first = next(iter(routed), None) if self._counters_ride_ids else None
        overflow, invalid = jnp.zeros((), jnp.int32), counters[1]
        for key, st in self.layout.stacks.items():
            reads = [f for f in feats if self.layout.routes[self.feature_table[f]].stack == key]
            if self._fused_update(reads):
                # Every row is local and each feature reads its own table (disjoint rows): the fused backward
                # of the fused lookup, feature after feature, never materialising [b*L, w].
                for f in reads:
                    t = self.tables[self.feature_table[f]]
                    rows = self._local_rows(f, ids[f])
                    w, new = kernels.apply_pooled(
                        weights[key],
                        {s: slot_state[s][key] for s in self.settings.optimizer.slots},
                        rows,
                        grads[f],
                        pooling=t.pooling,
                        optimizer=self.settings.optimizer,
                        apply=apply,
                        after=after or None,
                    )
                    weights[key] = w
                    for s, v in new.items():
                        slot_state[s][key] = v
                    self._mark_touched(slot_state, key, st, rows.reshape(-1), apply)
                continue
            pair_feats = [f for f in sorted(partial) if self.layout.routes[self.feature_table[f]].stack == key]
            row_feats = [f for f in feats if f not in partial]
            received = []  # (exchange, rows i32[S, C], grads f32[S, C, w]) that reached this owner
            if pair_feats:
                carry = counters if first == ("pairs", key) else None
                ex, ov = self._pair_grads_to_owner(key, ids, grads, *routed["pairs", key], carry)
                received.append(ex)
                overflow += ov
            if any(self.layout.routes[self.feature_table[f]].stack == key for f in row_feats):
                carry = counters if first == ("rows", key) else None
                ex, ov = self._row_grads_to_owner(key, row_feats, ids, grads, routed.get(("rows", key)), carry)
                received.append(ex)
                overflow += ov
            if not received:
                continue
            if (
                len(received) == 1
                and received[0].indexed is not None
                and not self._exact_sync
                and not (self._invariant_adagrad and st.has_column_pieces)
            ):  # pairs alone: each row's gradients read straight from the received bags
                rows = received[0].rows.reshape(-1)
                weights[key], new_slots = kernels.apply_rows_indexed(
                    weights[key],
                    {s: slot_state[s][key] for s in self.settings.optimizer.slots},
                    rows,
                    *received[0].indexed,
                    optimizer=self.settings.optimizer,
                    apply=apply,
                    after=after or None,
                )
                for s, v in new_slots.items():
                    slot_state[s][key] = v
                self._mark_touched(slot_state, key, st, rows, apply)
                continue
            rows = jnp.concatenate([ex.rows.reshape(-1) for ex in received])
            g = jnp.concatenate([ex.grads.reshape(-1, st.width) for ex in received])
            if self._exact_sync:
                rows, g, ov = self._exact_replica_sync(st, rows, g, caps[key])
                overflow += ov
            sq = None
            if self._invariant_adagrad and st.has_column_pieces:
                rows, g, sq = self._full_dim_sq_means(key, rows, g, received)
            weights[key], new_slots = self._apply(
                weights[key], {s: slot_state[s][key] for s in self.settings.optimizer.slots}, rows, g, apply, sq, after
            )
            for s, v in new_slots.items():
                slot_state[s][key] = v
            self._mark_touched(slot_state, key, st, rows, apply)
        replica_sync = self.settings.replica_sync
        if self.num_replicas > 1 and not replica_sync.exact:
            # apply=False leaves every replica as it was: a skipped attempt does not average either
            do_sync = apply & ((step + 1) % replica_sync.every == 0)
            if not replica_sync.sparse:
                average = functools.partial(
                    sync.average, replica_axes=self.replica_axes, num_replicas=self.num_replicas
                )
            else:
                average = functools.partial(
                    sync.average_touched,
                    replica_axes=self.replica_axes,
                    num_replicas=self.num_replicas,
                    capacity=self._sparse_capacity,
                )
            weights, slot_state = jax.lax.cond(do_sync, average, lambda tree: tree, (weights, slot_state))
        return weights, slot_state, self._stats(overflow, invalid)

    def _fused_update(self, reads) -> bool:
        """One shard, no exact sync, and the features reading a block each on a table of their own."""
        tables = {self.feature_table[f] for f in reads}
        return self.num_shards == 1 and not self._exact_sync and len(tables) == len(reads)

    @staticmethod
    def _mark_touched(slot_state, key, st, rows, apply):
        """Sparse periodic sync: remember the rows (i32[m], < 0: none) this replica moved."""
        if "touched" in slot_state:
            marks = slot_state["touched"][key][0, 0]
            hit = jnp.where((rows >= 0) & apply, rows, st.rows)
            slot_state["touched"][key] = marks.at[hit].set(1.0, mode="drop")[None, None]

    def _apply(self, w_block, slot_blocks, rows, g, apply, grad_sq_mean, after):
        # The [1, 1, R, w] blocks go to the kernel as they are: a reshape in front of the in-place update
        # would make XLA copy the whole donated block.
        return kernels.apply_rows(
            w_block,
            slot_blocks,
            rows,
            g,
            optimizer=self.settings.optimizer,
            apply=apply,
            grad_sq_mean=grad_sq_mean,
            after=after or None,
        )

    def _row_grads_to_owner(self, key, feats, ids, grads, routed=None, counters=None):
        """Reverse path of the row strategy: per-request gradients summed per unique row on the requester,
        sent to the owners (backward precision). `routed`: (request, route) from `_route` (None: one shard)."""
        st = self.layout.stacks[key]
        req = (
            routed[0] if routed is not None else routing.row_requests(self.layout, self.feature_table, key, feats, ids)
        )
        g = jnp.concatenate(
            [self._request_grads(seg, st.width, ids[seg.feature], grads[seg.feature]) for seg in req.segments], axis=0
        )  # [n, w], request order
        if self.num_shards == 1:  # every row is local: the owner sums duplicates when applying
            rows = jnp.where(req.dest < 1, req.row, -1)
            return _Exchange(rows[None], g[None], _spans(req), None), jnp.zeros((), jnp.int32)
        route = routed[1]
        S, C = route.send_rows.shape
        send_g = (
            jnp.zeros((S, C, st.width), jnp.float32)
            .at[route.dest, route.position]
            .add(g * route.keep[:, None], mode="drop")
        )
        recv_rows, _ = self._send_ids(route.send_rows, counters)  # [S, C]
        recv_g = collectives.all_to_all(
            send_g, self.shard_axes, self.settings.comm.backward, fp8_format=self.settings.comm.fp8_backward_format
        )
        return _Exchange(recv_rows, recv_g, _spans(req), route), route.overflow

    def _pair_codec(self, key, req) -> routing.PairCodec:
        """How stack `key`'s pairs travel (narrow unless a piece spans too many rows); static, cached."""
        cache_key = (key, req.segments, req.bag_len)
        if cache_key not in self._pair_codecs:
            self._pair_codecs[cache_key] = routing.pair_codec(self.layout, self.feature_table, key, req)
        return self._pair_codecs[cache_key]

    def _pair_grads_to_owner(self, key, ids, grads, req, route, counters=None):
        """Reverse path of the pair strategy: each owner gets the bag gradients of the segments it holds
        and the (row, bag) pairs, and credits every pair's row with its bag's gradient."""
        st = self.layout.stacks[key]
        S, G = self.num_shards, req.bags
        per_owner = [[] for _ in range(S)]
        for seg in req.segments:
            gb = self._bag_grads(seg, st.width, ids[seg.feature], grads[seg.feature])
            for d in seg.holders:
                per_owner[d].append(gb)
        send_g = jnp.stack(
            [
                jnp.concatenate(blocks + [jnp.zeros((G - sum(x.shape[0] for x in blocks), st.width), jnp.float32)])
                for blocks in per_owner
            ]
        )
        recv_g = collectives.all_to_all(
            send_g, self.shard_axes, self.settings.comm.backward, fp8_format=self.settings.comm.fp8_backward_format
        )  # [S, G, w]
        recv, _ = self._send_ids(route.send, counters)
        rrow, rbag = routing.unpack_pairs(recv, route, G, jax.lax.axis_index(self.shard_axes))
        pair_g = recv_g[jnp.arange(S)[:, None], jnp.clip(rbag, 0, G - 1)] * (rrow >= 0)[..., None]
        sizes = [ids[seg.feature].size for seg in req.segments]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
        spans = tuple((seg.feature, int(a), n) for seg, a, n in zip(req.segments, starts, sizes))
        # the same gradients as an index into the received bags: the kernel reads them in place
        bag_index = jnp.where((rrow >= 0) & (rbag >= 0) & (rbag < G), jnp.arange(S)[:, None] * G + rbag, -1)
        indexed = (bag_index.reshape(-1), recv_g.reshape(S * G, st.width))
        return _Exchange(rrow, pair_g, spans, route, indexed), route.overflow

    def _bag_grads(self, seg, width, x, g):
        """Per-bag gradient [b, width] of one column block of a partial-sum feature (mean: / ids per bag)."""
        t = self.tables[self.feature_table[seg.feature]]
        g = g[:, seg.col_block * width : (seg.col_block + 1) * width]
        if t.pooling == "mean":
            valid = ((x >= 0) & (x < t.stored_rows)).sum(-1, keepdims=True)
            g = g / jnp.maximum(valid, 1).astype(g.dtype)
        return g

    def _request_grads(self, seg, width, x, g):
        """Per-request gradient [b*L, width] of one column block of a feature (zero for padding)."""
        t = self.tables[self.feature_table[seg.feature]]
        b, L = x.shape
        valid = ((x >= 0) & (x < t.stored_rows)).astype(jnp.float32)
        g = g[..., seg.col_block * width : (seg.col_block + 1) * width]
        if t.pooling is None:
            per = g * valid[..., None]
        else:
            if t.pooling == "mean":
                g = g / jnp.maximum(valid.sum(-1, keepdims=True), 1.0)
            per = g[:, None, :] * valid[..., None]
        return per.reshape(b * L, width)

    # ------------------------------------------------------------------ replica sync

    def _exact_replica_sync(self, st, rows, g, cap):
        """This replica's received (rows, gradients) -> every replica's, combined (see `sync`)."""
        urows, gsum, count, _ = kernels.sum_by_row(rows, g, block_rows=st.rows)
        if cap.sync_strategy == "owner":
            return sync.owner_sync(
                urows,
                gsum,
                replica_axes=self.replica_axes,
                num_replicas=self.num_replicas,
                comm=self.settings.comm,
                send_capacity=cap.sync,
                owned_capacity=cap.owned,
                block_rows=st.rows,
            )
        U = min(cap.sync, urows.shape[0])
        rows, g = sync.gather_sync(urows[:U], gsum[:U], replica_axes=self.replica_axes, comm=self.settings.comm)
        return rows, g, jnp.maximum(count - U, 0)

    # ------------------------------------------------------------------ full-dim AdaGrad on column shards

    def _full_dim_sq_means(self, key, rows, g, received):
        """Per unique row: the mean of its squared summed gradient over the table's FULL dim.

        A column shard only sees its columns, so the partial sums of squares of a row's column pieces are
        added up through the requesters that asked for the row (each asked every column piece): owners
        send each request position its row's partial sum back, requesters add the parts of each id and send the
        total forward again (4 bytes per position each way). Under exact sync every replica holds the same
        combined list, and a row one replica never requested gets its total from a replica that did
        (max over replicas). Returns (unique rows, summed gradients, mean squares) for `kernels.apply_rows`.
        """
        st = self.layout.stacks[key]
        urows, gsum, _, _ = kernels.sum_by_row(rows, g, block_rows=st.rows)
        part = jnp.sum(gsum * gsum, axis=-1)  # this piece's columns
        sorted_rows = jnp.where(urows >= 0, urows, st.rows)  # ascending, sentinel last

        def lookup_part(position_rows):
            pos = jnp.clip(jnp.searchsorted(sorted_rows, position_rows), 0, urows.shape[0] - 1)
            return jnp.where((position_rows >= 0) & (urows[pos] == position_rows), part[pos], 0.0)

        total = jnp.full(urows.shape, -jnp.inf, jnp.float32)
        for ex in received:
            position_rows = ex.rows
            back = lookup_part(position_rows)  # [S, C] partial sum of each position's row
            if self.num_shards > 1:
                back = collectives.all_to_all(back, self.shard_axes)
            per_request = self._sum_column_parts(ex, back)
            fwd = self._to_slots(ex, per_request, back.shape)
            if self.num_shards > 1:
                fwd = collectives.all_to_all(fwd, self.shard_axes)
            pos = jnp.clip(jnp.searchsorted(sorted_rows, position_rows), 0, urows.shape[0] - 1)
            hit = (position_rows >= 0) & (urows[pos] == position_rows)
            total = total.at[jnp.where(hit, pos, urows.shape[0]).reshape(-1)].max(fwd.reshape(-1), mode="drop")
        if self._exact_sync:
            total = jax.lax.pmax(total, self.replica_axes)
        dims = self._full_dims(key, urows)
        own = part / st.width
        sq = jnp.where(dims > 0, jnp.maximum(total, 0.0) / jnp.maximum(dims, 1), own)
        return urows, gsum, sq

    def _sum_column_parts(self, ex, back):
        """Requester side: per request, the sum over the column blocks of its id of the parts sent back."""
        if ex.route is None:  # single shard: slots are the requests themselves
            per_position = back.reshape(-1)
        else:
            per_position = back.at[ex.route.dest, ex.route.position].get(mode="fill", fill_value=0.0)
        totals = jnp.zeros_like(per_position)
        by_feature: dict[str, list] = {}
        for f, start, size in ex.spans:  # a column-wise feature has one span per column block
            by_feature.setdefault(f, []).append((start, size))
        for spans in by_feature.values():
            summed = functools.reduce(jnp.add, [per_position[a : a + n] for a, n in spans])
            for a, n in spans:
                totals = totals.at[a : a + n].set(summed)
        return totals

    def _to_slots(self, ex, per_request, shape):
        """Requester side: each request's total written to its position (equal for requests sharing one)."""
        if ex.route is None:
            return per_request.reshape(shape)
        return jnp.zeros(shape, jnp.float32).at[ex.route.dest, ex.route.position].set(per_request, mode="drop")

    def _full_dims(self, key, urows):
        """Full (stored) dim of the table of each unique row when it is a column piece, else 0."""
        st = self.layout.stacks[key]
        meta = piece_meta(st, self.num_shards)
        full = np.array(
            [
                [self.tables[t].stored_dim if self.plan.tables[self.tables[t].name].col_parts > 1 else 0 for t in row]
                for row in meta["table"]
            ],
            np.float32,
        )
        full[meta["rows"] == 0] = 0
        shard = jax.lax.axis_index(self.shard_axes)
        starts = jnp.asarray(meta["start"])[shard]
        piece = jnp.clip(jnp.searchsorted(starts, urows, side="right") - 1, 0, starts.shape[0] - 1)
        return jnp.where(urows >= 0, jnp.asarray(full)[shard][piece], 0.0)

    # ------------------------------------------------------------------ info

    def describe(self) -> str:
        """A short human-readable summary of the layout (stacks, shards, rows per shard)."""
        lines = [
            f"EmbeddingCollection: {len(self.tables)} tables, topology {self.topology.name}, "
            f"{self.num_shards} shards x {self.num_replicas} replicas on a {self.nodes}x{self.local} mesh"
        ]
        for k, st in self.layout.stacks.items():
            lines.append(f"  stack {k}: width {st.width}, {st.rows} rows per shard")
        for t in self.tables:
            ts = self.plan.tables[t.name]
            lines.append(f"  table {t.name}: {t.rows}x{t.dim} {ts.sharding} shards={list(ts.shards)}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Exchange:
    """What one strategy's backward exchange delivered to an owner, and how the requester routed it."""

    rows: jax.Array  # i32[S, C]: the block row of each received position (-1: empty)
    grads: jax.Array  # f32[S, C, w]: its gradient
    spans: tuple[tuple[str, int, int], ...]  # (feature, start, size) of the request list's segments
    route: object  # the requester's RowRoute / PairRoute (None: a single shard, positions are requests)
    # pairs: (i32[S*C] index into f32[S*G, w], the received bag gradients) = `grads` without materialising it
    indexed: tuple[jax.Array, jax.Array] | None = None


def _spans(req: routing.RowRequests) -> tuple[tuple[str, int, int], ...]:
    return tuple((seg.feature, seg.start, seg.size) for seg in req.segments)


def _exchange_across_processes(keys: np.ndarray, same_size: bool = False) -> np.ndarray:
    """Every process's int64 keys, concatenated in process order (same result on every process).

    `same_size`: every process sends as many keys (the capacity maxima), so one exchange does; otherwise
    the sizes go first. Each exchange is one cached executable over every device (a host round trip
    through `multihost_utils.process_allgather` costs about twice as much per call), an all-to-all on CPU
    (`collectives.prefers_all_to_all`)."""
    keys = np.asarray(keys, np.int64).reshape(-1)
    if same_size:
        return _process_allgather(keys).reshape(-1)
    sizes = _process_allgather(np.array([keys.size], np.int64)).reshape(-1)
    padded = np.full(int(sizes.max()) if sizes.size else 0, -1, np.int64)
    padded[: keys.size] = keys
    every = _process_allgather(padded)
    return np.concatenate([every[i, : sizes[i]] for i in range(len(sizes))])


def _process_allgather(x: np.ndarray) -> np.ndarray:
    """[processes, n]: row p = process p's int64 vector x (the same n on every process)."""
    return _read_process_allgather(_start_process_allgather(x))


def _start_process_allgather(x: np.ndarray) -> jax.Array:
    """Dispatches the gather of every process's x (asynchronously: nothing waits for the peers yet)."""
    mesh, gather = _process_gather_executable()
    sharding = NamedSharding(mesh, P("process"))
    rows = jax.make_array_from_process_local_data(sharding, x[None], (mesh.shape["process"], x.size))
    return gather(rows)


def _read_process_allgather(in_flight: jax.Array) -> np.ndarray:
    return np.asarray(in_flight.addressable_data(0))


@functools.cache
def _process_gather_executable():
    """A (process, device) mesh of every device and a jitted gather of each process's row, replicated."""
    from jax.sharding import Mesh

    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    grid = np.array([sorted(v, key=lambda d: d.id) for _, v in sorted(by_process.items())])
    mesh = Mesh(grid, ("process", "device"))
    a2a = collectives.prefers_all_to_all(mesh)
    body = functools.partial(collectives.gather_small, axis_name="process", size=grid.shape[0], as_all_to_all=a2a)
    # check_vma=False: every device ends with the same rows (JAX types an all-to-all's result as varying)
    gather = jax.shard_map(body, mesh=mesh, in_specs=P("process"), out_specs=P(), check_vma=False)
    return mesh, jax.jit(gather)


def _check_ids_rank(feature: str, shape: tuple[int, ...]) -> None:
    """Ids are [B, L] or [B]: any other rank would come back as a silently reshaped lookup, so refuse it."""
    if len(shape) not in (1, 2):
        raise ValueError(f"feature {feature!r}: ids must be [B] or [B, L], got shape {tuple(shape)}")
