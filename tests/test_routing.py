"""How (row, bag) pairs travel to their owners: the narrow codec (u16 row offsets + per-bag counts) against
the int32 one, pair for pair, over random layouts, bag lengths and capacities; and the engine on both."""

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MESH_IDS, MESH_SHAPES
from embedding_reference import adagrad_step
from embedding_reference import lookup as ref_lookup

import jaxscale
from jaxscale.engine import native
from jaxscale.engine.comm_inspect import list_collectives
from jaxscale.engine.embedding import routing
from jaxscale.engine.native import jax_kernels


def _collection(shape, topology, sharding, tables):
    mesh = jaxscale.make_mesh(*shape, devices=jax.devices()[: shape[0] * shape[1]])
    return jaxscale.EmbeddingCollection(tables, mesh, jaxscale.EmbeddingSettings(topology=topology, sharding=sharding))


def _random_ids(rng, tables, bags, length, invalid=True):
    ids = {}
    for t in tables:
        for f in t.features:
            x = np.minimum(rng.zipf(1.2, size=(bags, length)) - 1, t.rows - 1).astype(np.int32)
            x[rng.random(x.shape) < 0.2] = -1  # padding
            if invalid:  # out-of-range ids are never sent (the engine refuses them on the host)
                x[rng.random(x.shape) < 0.05] = t.rows + 3
            ids[f] = x
    return ids


def _decoded(send, route, bags, num_shards):
    """{owner: Counter((row, bag))} as each owner decodes this sender's buffer (the others' blocks empty)."""
    out = {}
    empty = jnp.zeros_like(send) if route.codec.kind == "narrow" else jnp.full_like(send, -1)
    for d in range(num_shards):
        recv = empty.at[0].set(send[d])
        rows, bag = routing.unpack_pairs(recv, route, bags, d)
        rows, bag = np.asarray(rows[0]), np.asarray(bag[0])
        out[d] = collections.Counter(zip(rows[rows >= 0].tolist(), bag[rows >= 0].tolist()))
    return out


CASES = [
    pytest.param(shape, topo, sh, length, id=f"{mid}-{topo}-{sh}-L{length}")
    for (shape, mid), topo, sh, length in itertools.product(
        zip(MESH_SHAPES, MESH_IDS), ("1d", "2d_a2a"), ("table_wise", "row_wise", "column_wise"), (7, 300)
    )
]


PURE_JAX_CASES = [  # the pure-JAX routing kernels: positions from the one-hot running count and the stable sort
    pytest.param((2, 4), "1d", sh, 7, rank, id=f"2x4-1d-{sh}-L7-{rank}")
    for sh in ("table_wise", "row_wise", "column_wise")
    for rank in ("one_hot", "sort")
]


def _routing_kernels(rank, monkeypatch):
    """'native': the default dispatch; 'one_hot' / 'sort': the pure-JAX kernels (JAXSCALE_NATIVE=0)."""
    if rank != "native":
        monkeypatch.setenv("JAXSCALE_NATIVE", "0")
    if rank == "sort":
        monkeypatch.setattr(jax_kernels, "ONE_HOT_RANK_LIMIT", 0)


@pytest.mark.parametrize(
    "shape,topology,sharding,length,rank",
    [pytest.param(*c.values, "native", id=c.id) for c in CASES] + PURE_JAX_CASES,
)
def test_narrow_pairs_decode_to_the_same_pairs_as_int32(shape, topology, sharding, length, rank, monkeypatch):
    """Every owner decodes the same multiset of (row, bag) pairs from the narrow buffer as from the int32
    one, at the exact capacity and at a capacity that overflows (the same pairs are left out of both);
    with the native routing kernels and with both pure-JAX ones."""
    _routing_kernels(rank, monkeypatch)
    rng = np.random.default_rng(length + len(sharding))
    tables = [
        jaxscale.TableConfig("a", rows=3000, dim=8, pooling="sum", features=("fa", "fb")),
        jaxscale.TableConfig("b", rows=120, dim=8, pooling="mean"),
    ]
    ec = _collection(shape, topology, sharding, tables)
    ids = _random_ids(rng, tables, bags=6, length=length)
    (key,) = ec.layout.stacks
    req = routing.pair_requests(ec.layout, ec.feature_table, key, sorted(ids), ids)
    narrow = routing.pair_codec(ec.layout, ec.feature_table, key, req)
    assert narrow.kind == "narrow" and narrow.count_bytes == (1 if length < 256 else 2)
    S = ec.num_shards
    full = max(1, int(np.bincount(np.asarray(req.dest), minlength=S + 1)[:S].max()))
    for capacity in (full, max(1, full // 3)):
        got = {}
        for codec in (narrow, routing.PairCodec("packed"), routing.PairCodec("wide")):
            route = routing.route_pairs(req, S, codec, capacity)
            got[codec.kind] = (_decoded(route.send, route, req.bags, S), int(route.overflow))
        assert got["narrow"] == got["packed"] == got["wide"], f"capacity {capacity}"
        sent = sum(sum(c.values()) for c in got["narrow"][0].values())
        assert sent + got["narrow"][1] == int((np.asarray(req.dest) < S).sum())  # nothing dropped silently
        assert (got["narrow"][1] > 0) == (capacity < full)


@pytest.mark.parametrize("rank", ["native", "one_hot", "sort"])
def test_positions_are_ranks_within_each_owner(rank, monkeypatch):
    """rank_within_owner against a brute-force count, owners outside [0, S) (padding, negative) -> -1."""
    _routing_kernels(rank, monkeypatch)
    fn = jax.jit(native.rank_within_owner, static_argnames="owners")
    rng = np.random.default_rng(3)
    for S, n in ((1, 50), (3, 1000), (8, 4000), (5, 0), (0, 7)):
        dest = rng.integers(-1, S + 2, n).astype(np.int32)  # -1 and >= S: no owner
        want = np.array([(dest[:i] == dest[i]).sum() if 0 <= dest[i] < S else -1 for i in range(n)], np.int32)
        np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(dest), owners=S)), want)


@pytest.mark.parametrize("rank", ["native", "one_hot"])
def test_slot_bags_label_each_senders_slots_in_bag_order(rank, monkeypatch):
    """slot_bags against a brute-force expansion, with empty bags, senders that overflow the capacity,
    negative counts (as zero), and no bags at all."""
    _routing_kernels(rank, monkeypatch)
    fn = jax.jit(native.slot_bags, static_argnames="capacity")
    rng = np.random.default_rng(4)
    for S, G, capacity in ((1, 1, 5), (3, 40, 64), (4, 17, 10), (2, 0, 6), (3, 5, 0)):
        counts = rng.integers(-1, 6, (S, G)).astype(np.int32)
        counts[rng.random((S, G)) < 0.3] = 0
        want = np.full((S, capacity), -1, np.int32)
        for s in range(S):
            labels = [g for g in range(G) for _ in range(max(counts[s, g], 0))][:capacity]
            want[s, : len(labels)] = labels
        np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(counts), capacity=capacity)), want)


def test_narrow_buffer_is_two_bytes_per_pair_plus_one_per_bag():
    tables = [jaxscale.TableConfig("a", rows=3000, dim=8, pooling="sum", features=("fa", "fb"))]
    ec = _collection((1, 4), "1d", "row_wise", tables)
    ids = _random_ids(np.random.default_rng(0), tables, bags=8, length=10)
    req = routing.pair_requests(ec.layout, ec.feature_table, "w8", sorted(ids), ids)
    codec = routing.pair_codec(ec.layout, ec.feature_table, "w8", req)
    route = routing.route_pairs(req, 4, codec, capacity=40)
    assert route.send.dtype == jnp.uint16 and route.send.shape == (4, 40 + req.bags // 2)


def test_a_piece_too_long_for_u16_travels_as_int32():
    tables = [jaxscale.TableConfig("big", rows=routing.NARROW_SPAN + 10, dim=4, pooling="sum")]
    ec = _collection((1, 2), "1d", "table_wise", tables)
    ids = {"big": np.full((4, 3), routing.NARROW_SPAN + 9, np.int32)}
    req = routing.pair_requests(ec.layout, ec.feature_table, "w4", ["big"], ids)
    assert routing.pair_codec(ec.layout, ec.feature_table, "w4", req).kind == "packed"
    ec = _collection((1, 2), "1d", "row_wise", tables)  # two pieces of half the rows: narrow again
    req = routing.pair_requests(ec.layout, ec.feature_table, "w4", ["big"], ids)
    assert routing.pair_codec(ec.layout, ec.feature_table, "w4", req).kind == "narrow"


ENGINE_CASES = [
    pytest.param(shape, topo, id=f"{mid}-{topo}")
    for (shape, mid), topo in itertools.product(zip(MESH_SHAPES, MESH_IDS), jaxscale.TOPOLOGIES)
]


@pytest.mark.parametrize("shape,topology", ENGINE_CASES)
def test_engine_on_both_codecs_matches_reference_and_sends_u16_ids(shape, topology):
    """One stack with a table whose piece spans more than NARROW_SPAN rows (int32 pairs) and one stack of
    small tables (narrow pairs): lookup, AdaGrad updates and the compiled id exchange."""
    tables = [
        jaxscale.TableConfig("big", rows=routing.NARROW_SPAN + 100, dim=4, pooling="sum"),
        jaxscale.TableConfig("small", rows=500, dim=8, pooling="mean", features=("s1", "s2")),
    ]
    plan = {"big": "table_wise", "small": "row_wise"}
    ec = jaxscale.EmbeddingCollection(
        tables,
        jaxscale.make_mesh(*shape),
        jaxscale.EmbeddingSettings(topology=topology, optimizer=jaxscale.RowWiseAdagrad(0.05, eps=1e-8)),
        plan=plan,
    )
    rng = np.random.default_rng(1)
    w0 = {t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in tables}
    state = ec.from_dense(w0)
    ref_w = {k: v.copy() for k, v in w0.items()}
    ref_acc = {k: np.zeros(len(v), np.float32) for k, v in w0.items()}
    for _ in range(3):
        ids = _random_ids(rng, tables, bags=16, length=6, invalid=False)
        ids["big"][:, 0] = rng.integers(routing.NARROW_SPAN, routing.NARROW_SPAN + 100, size=16)  # the far rows
        out = ec.lookup(state, ids)
        for f, want in ref_lookup(ref_w, tables, ids).items():
            np.testing.assert_allclose(np.asarray(out[f]), want, rtol=1e-5, atol=1e-6, err_msg=f)
        grads = {f: rng.normal(size=np.shape(out[f])).astype(np.float32) for f in ids}
        state = ec.update(state, ids, {f: jnp.asarray(g) for f, g in grads.items()})
        ref_w, ref_acc = adagrad_step(ref_w, ref_acc, tables, ids, grads, 0.05, 1e-8)
    got = ec.to_dense(state)
    for name in ref_w:
        np.testing.assert_allclose(got[name], ref_w[name], rtol=1e-5, atol=1e-6, err_msg=name)
    acc = ec.slots_to_dense(state)["accumulator"]
    for name in ref_acc:
        np.testing.assert_allclose(acc[name], ref_acc[name], rtol=1e-5, atol=1e-7, err_msg=name)
    for r in range(1, ec.num_replicas):  # replicas stay identical under exact sync
        for name, w in ec.to_dense(state, replica=r).items():
            np.testing.assert_array_equal(w, got[name])

    sharded = ec.shard_batch(ids)
    step = jax.jit(lambda st, x: ec.lookup(st, x))
    id_exchanges = [c for c in list_collectives(step, state, sharded, mesh=ec.mesh) if c.kind == "all-to-all"]
    if ec.num_shards == 1:  # e.g. 2d_ar on one node: every row is local, nothing is exchanged
        assert not id_exchanges
        return
    dtypes = {d for c in id_exchanges for d in c.dtypes if d in ("u16", "s32")}
    assert dtypes == {"s32", "u16"}, id_exchanges  # int32 pairs for 'big', u16 pairs + counts for 'small'
