"""EmbeddingCollection against a single-device NumPy reference, on every mesh/topology/sharding."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MESH_IDS, MESH_SHAPES
from embedding_reference import adagrad_step, sgd_step
from embedding_reference import lookup as ref_lookup

import jaxscale

TABLES = [
    jaxscale.TableConfig("items", rows=200, dim=16, pooling=None, features=("seq_a", "seq_b")),
    jaxscale.TableConfig("cat", rows=50, dim=8, pooling="sum"),
    jaxscale.TableConfig("user", rows=37, dim=32, pooling="mean", features=("user_hist",)),
]
# The grid test uses one dim so each case compiles one stack (compile time dominates on 2 cores);
# mixed dims (several stacks) are covered by the other tests.
GRID_TABLES = [dataclasses.replace(t, dim=16) for t in TABLES]
B, L = 16, 5

SHARDINGS = ["table_wise", "row_wise", "column_wise", "table_row_wise"]
CASES = [
    pytest.param(shape, topo, sh, id=f"{mid}-{topo}-{sh}")
    for (shape, mid), topo, sh in itertools.product(zip(MESH_SHAPES, MESH_IDS), jaxscale.TOPOLOGIES, SHARDINGS)
    if not (sh == "table_row_wise" and topo != "1d")
]


def make_ids(rng, with_padding=True, tables=TABLES):
    ids = {}
    for t in tables:
        for f in t.features:
            hi = min(t.rows, 12)  # few distinct ids -> many duplicates
            x = rng.integers(0, hi, size=(B, L)).astype(np.int32)
            x[rng.random((B, L)) < 0.25] = t.rows - 1  # the last row too
            if with_padding:
                x[rng.random((B, L)) < 0.3] = -1
                x[0] = -1  # an all-padding bag
            ids[f] = x
    return ids


def dense_tables(rng, tables=TABLES):
    return {t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in tables}


def out_shape(f, tables=TABLES):
    t = next(t for t in tables if f in t.features)
    return (B, L, t.dim) if t.pooling is None else (B, t.dim)


def reference_step(opt, ref_w, ref_acc, tables, ids, grads, lr, eps):
    """One step of the NumPy reference: SGD ('sgd') or row-wise AdaGrad; returns (tables, accumulators)."""
    if opt == "sgd":
        return sgd_step(ref_w, tables, ids, grads, lr), ref_acc
    return adagrad_step(ref_w, ref_acc, tables, ids, grads, lr, eps)


@pytest.mark.parametrize("shape,topology,sharding", CASES)
def test_lookup_and_update_match_reference(shape, topology, sharding):
    """Lookups and 5 sparse updates equal the NumPy reference; row-wise AdaGrad on every case, SGD on 2x4.

    The AdaGrad runs return pooled features as per-bag partial sums (pooled_comm='auto'); the SGD runs
    return rows and pool on the requester (pooled_comm='rows')."""
    mesh = jaxscale.make_mesh(*shape)
    rng = np.random.default_rng(0)
    tables = GRID_TABLES
    w0 = dense_tables(rng, tables)
    lr, eps = 0.05, 1e-8
    for opt in ("adagrad", "sgd") if shape == (2, 4) else ("adagrad",):
        optimizer = jaxscale.SGD(lr) if opt == "sgd" else jaxscale.RowWiseAdagrad(lr, eps=eps)
        # pooled features come back as per-bag partial sums by default; the SGD runs cover returned rows
        ec = jaxscale.EmbeddingCollection(
            tables,
            mesh,
            jaxscale.EmbeddingSettings(
                topology=topology,
                sharding=sharding,
                optimizer=optimizer,
                pooled_comm="rows" if opt == "sgd" else "auto",
            ),
        )
        state = ec.from_dense(w0)
        ref_w = {k: v.copy() for k, v in w0.items()}
        # one accumulator per row over the full dim, whatever the sharding: the unsharded reference
        ref_acc = {k: np.zeros(v.shape[0], np.float32) for k, v in w0.items()}
        for step in range(5):
            ids = make_ids(rng, tables=tables)
            out = ec.lookup(state, ids)
            ref_out = ref_lookup(ref_w, tables, ids)
            for f in ids:
                assert out[f].shape == out_shape(f, tables)
                np.testing.assert_allclose(
                    np.asarray(out[f]), ref_out[f], rtol=1e-5, atol=1e-6, err_msg=f"{opt} step {step} {f}"
                )
            grads = {f: rng.normal(size=out_shape(f, tables)).astype(np.float32) for f in ids}
            state = ec.update(state, ids, {f: jnp.asarray(g) for f, g in grads.items()})
            ref_w, ref_acc = reference_step(opt, ref_w, ref_acc, tables, ids, grads, lr, eps)
        got = ec.to_dense(state)
        for name in ref_w:
            np.testing.assert_allclose(got[name], ref_w[name], rtol=1e-5, atol=1e-6, err_msg=f"{opt} table {name}")
            # rows never looked up are untouched, bit for bit
            touched = np.abs(ref_w[name] - w0[name]).sum(-1) > 0
            assert touched.any() and not touched.all()
            np.testing.assert_array_equal(got[name][~touched], w0[name][~touched])
        if opt == "adagrad":
            acc = ec.slots_to_dense(state)["accumulator"]
            for name in ref_acc:
                np.testing.assert_allclose(acc[name], ref_acc[name], rtol=1e-5, atol=1e-7)
        for r in range(1, ec.num_replicas):  # replicas are bit-identical under exact sync
            other = ec.to_dense(state, replica=r)
            for name in got:
                np.testing.assert_array_equal(other[name], got[name])
        assert int(state["step"]) == 5


ONE_FEATURE_TABLES = [  # one stack (dim 16), each table read by one feature: the fused one-shard update
    jaxscale.TableConfig("items", rows=200, dim=16, pooling=None),
    jaxscale.TableConfig("cat", rows=50, dim=16, pooling="sum"),
    jaxscale.TableConfig("user", rows=37, dim=16, pooling="mean"),
]


@pytest.mark.parametrize("tables", [ONE_FEATURE_TABLES, TABLES], ids=["fused", "shared-table"])
@pytest.mark.parametrize("opt", ["adagrad", "sgd"])
def test_one_device_matches_reference(tables, opt):
    """One shard: every row local, no exchange. Features on tables of their own take the fused backward
    (feature after feature on a shared stack); a table read by two features takes the general path."""
    mesh = jaxscale.make_mesh(1, 1, devices=jax.devices()[:1])
    rng = np.random.default_rng(3)
    w0 = dense_tables(rng, tables)
    lr, eps = 0.05, 1e-8
    optimizer = jaxscale.SGD(lr) if opt == "sgd" else jaxscale.RowWiseAdagrad(lr, eps=eps)
    ec = jaxscale.EmbeddingCollection(tables, mesh, jaxscale.EmbeddingSettings(optimizer=optimizer))
    assert ec._fused_update([f for t in tables for f in t.features]) == (tables is ONE_FEATURE_TABLES)
    state, ref_w = ec.from_dense(w0), {k: v.copy() for k, v in w0.items()}
    ref_acc = {k: np.zeros(v.shape[0], np.float32) for k, v in w0.items()}
    for _ in range(4):
        ids = make_ids(rng, tables=tables)
        ids[next(iter(ids))][1, 0] = 10_000  # an invalid id: padding inside jit, counted
        grads = {f: rng.normal(size=out_shape(f, tables)).astype(np.float32) for f in ids}
        batch = ec._prepare({f: jnp.asarray(x) for f, x in ids.items()})  # traced path: no host validation
        out, stats = ec.lookup(state, batch, return_stats=True)
        assert int(stats["invalid_ids"]) == 1
        ids[next(iter(ids))][1, 0] = -1
        ref_out = ref_lookup(ref_w, tables, ids)
        for f in ids:
            np.testing.assert_allclose(np.asarray(out[f]), ref_out[f], rtol=1e-5, atol=1e-6)
        state = ec.update(state, batch, {f: jnp.asarray(g) for f, g in grads.items()})
        ref_w, ref_acc = reference_step(opt, ref_w, ref_acc, tables, ids, grads, lr, eps)
    got = ec.to_dense(state)
    for name in ref_w:
        np.testing.assert_allclose(got[name], ref_w[name], rtol=1e-5, atol=1e-6, err_msg=name)
    if opt == "adagrad":
        for name, acc in ec.slots_to_dense(state)["accumulator"].items():
            np.testing.assert_allclose(acc, ref_acc[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape,topology", [((1, 8), "1d"), ((2, 4), "2d_a2a"), ((4, 2), "2d_ar")], ids=str)
def test_per_column_shard_adagrad_keeps_torchrec_semantics(shape, topology):
    """RowWiseAdagrad(per_column_shard=True): one accumulator per row AND column shard (each column shard is
    its own TBE in TorchRec/FBGEMM), for bit-parity with TorchRec column-wise runs; the default differs."""
    mesh = jaxscale.make_mesh(*shape)
    rng = np.random.default_rng(5)
    tables = GRID_TABLES
    w0 = dense_tables(rng, tables)
    lr, eps = 0.05, 0.25
    per_shard = jaxscale.RowWiseAdagrad(lr, eps=eps, per_column_shard=True)
    ec = jaxscale.EmbeddingCollection(
        tables, mesh, jaxscale.EmbeddingSettings(topology=topology, sharding="column_wise", optimizer=per_shard)
    )
    col_parts = {n: ts.col_parts for n, ts in ec.plan.tables.items()}
    assert all(cp > 1 for cp in col_parts.values())
    default = jaxscale.EmbeddingCollection(
        tables,
        mesh,
        jaxscale.EmbeddingSettings(
            topology=topology, sharding="column_wise", optimizer=jaxscale.RowWiseAdagrad(lr, eps=eps)
        ),
    )
    state, state_default = ec.from_dense(w0), default.from_dense(w0)
    ref_w = {k: v.copy() for k, v in w0.items()}
    ref_acc = {k: np.zeros((v.shape[0], col_parts[k]), np.float32) for k, v in w0.items()}
    for _ in range(3):
        ids = make_ids(rng, tables=tables)
        grads = {f: rng.normal(size=out_shape(f, tables)).astype(np.float32) for f in ids}
        state = ec.update(state, ids, {f: jnp.asarray(g) for f, g in grads.items()})
        state_default = default.update(state_default, ids, {f: jnp.asarray(g) for f, g in grads.items()})
        ref_w, ref_acc = adagrad_step(ref_w, ref_acc, tables, ids, grads, lr, eps, col_parts)
    got, acc = ec.to_dense(state), ec.slots_to_dense(state)["accumulator"]
    for name in ref_w:
        np.testing.assert_allclose(got[name], ref_w[name], rtol=1e-5, atol=1e-6, err_msg=name)
        assert acc[name].shape == (w0[name].shape[0], col_parts[name])
        np.testing.assert_allclose(acc[name], ref_acc[name], rtol=1e-5, atol=1e-7, err_msg=name)
    # the layout-invariant default trains differently on the same column-wise plan
    other = default.to_dense(state_default)
    assert max(np.abs(other[n] - got[n]).max() for n in got) > 1e-3
    assert all(v.shape == (w0[n].shape[0],) for n, v in default.slots_to_dense(state_default)["accumulator"].items())


@pytest.mark.parametrize(
    "topology,sharding",
    [(t, s) for t in jaxscale.TOPOLOGIES for s in SHARDINGS if not (s == "table_row_wise" and t != "1d")],
)
def test_dense_round_trip_is_exact(topology, sharding):
    rng = np.random.default_rng(1)
    w = dense_tables(rng)
    for shape in MESH_SHAPES:
        ec = jaxscale.EmbeddingCollection(
            TABLES, jaxscale.make_mesh(*shape), jaxscale.EmbeddingSettings(topology=topology, sharding=sharding)
        )
        back = ec.to_dense(ec.from_dense(w))
        for name in w:
            np.testing.assert_array_equal(back[name], w[name])


def test_init_does_not_depend_on_mesh_or_layout():
    layouts = [((1, 8), "1d", "row_wise"), ((2, 4), "2d_a2a", "column_wise"), ((4, 2), "2d_ar", "table_wise")]
    inits = []
    for shape, topology, sharding in layouts:
        ec = jaxscale.EmbeddingCollection(
            TABLES, jaxscale.make_mesh(*shape), jaxscale.EmbeddingSettings(topology=topology, sharding=sharding)
        )
        inits.append(ec.to_dense(ec.init(jax.random.key(7))))
    for t in TABLES:
        first = inits[0][t.name]
        assert np.all(np.abs(first) <= t.scale) and np.std(first) > t.scale / 4
        assert len(np.unique(first[:, 0])) == t.rows  # every row drawn independently
        for other in inits[1:]:
            np.testing.assert_array_equal(other[t.name], first)


def test_lookup_and_update_inside_user_jit(mesh):
    ec = jaxscale.EmbeddingCollection(
        TABLES,
        mesh,
        jaxscale.EmbeddingSettings(
            topology="2d_a2a" if mesh.shape["node"] > 1 else "1d", optimizer=jaxscale.RowWiseAdagrad(0.1)
        ),
    )
    rng = np.random.default_rng(2)
    w0 = dense_tables(rng)
    state = ec.from_dense(w0)
    ids = ec.shard_batch(make_ids(rng))

    @jax.jit
    def step(state, ids):
        def loss_fn(emb):
            return sum(jnp.sum(v**2) for v in emb.values())

        emb = ec.lookup(state, ids)
        loss, g = jax.value_and_grad(loss_fn)(emb)
        return ec.update(state, ids, g), loss

    losses = []
    for _ in range(3):
        state, loss = step(state, ids)
        losses.append(float(loss))
    assert losses[2] < losses[0]


def test_periodic_sync_averages_replicas():
    mesh = jaxscale.make_mesh(2, 4)
    rng = np.random.default_rng(3)
    w0 = dense_tables(rng)
    ec = jaxscale.EmbeddingCollection(
        TABLES,
        mesh,
        jaxscale.EmbeddingSettings(
            topology="2d_a2a", optimizer=jaxscale.SGD(0.1), replica_sync=jaxscale.ReplicaSync("periodic", every=2)
        ),
    )
    state = ec.from_dense(w0)
    ids = make_ids(rng)
    grads = {f: jnp.asarray(rng.normal(size=out_shape(f)).astype(np.float32)) for f in ids}
    state = ec.update(state, ids, grads)  # step 1: replicas diverge (each saw its half of the batch)
    r0, r1 = ec.to_dense(state, 0), ec.to_dense(state, 1)
    assert any(not np.array_equal(r0[n], r1[n]) for n in r0)
    # SGD is linear: the average of the replicas after one unsynced step equals half the full-batch update
    full = sgd_step(w0, TABLES, ids, {f: np.asarray(g) for f, g in grads.items()}, 0.1)
    for n in r0:
        np.testing.assert_allclose((r0[n] + r1[n]) / 2, w0[n] + (full[n] - w0[n]) / 2, rtol=1e-5, atol=1e-6)
    state = ec.update(state, ids, grads)  # step 2: synced
    r0, r1 = ec.to_dense(state, 0), ec.to_dense(state, 1)
    for n in r0:
        np.testing.assert_allclose(r0[n], r1[n], rtol=1e-6, atol=1e-7)


def test_overflow_is_counted_not_silent():
    mesh = jaxscale.make_mesh(1, 8)
    t = jaxscale.TableConfig("t", rows=64, dim=8, pooling=None)
    ec = jaxscale.EmbeddingCollection(
        [t], mesh, jaxscale.EmbeddingSettings(sharding="row_wise", capacity_factor=1.0, optimizer=jaxscale.SGD(1.0))
    )
    w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    state = ec.from_dense({"t": w})
    # every device asks for 8 distinct rows all owned by shard 0 (row % 8 == 0): capacity 1 per shard
    ids = np.tile((np.arange(8) * 8).astype(np.int32), (8, 1))
    out, stats = ec.lookup(state, {"t": ids}, return_stats=True)
    assert int(stats["overflow"]) == 8 * 7
    # exact capacity (the default) never overflows and returns the right rows
    ec_exact = jaxscale.EmbeddingCollection([t], mesh, jaxscale.EmbeddingSettings(sharding="row_wise"))
    out, stats = ec_exact.lookup(ec_exact.from_dense({"t": w}), {"t": ids}, return_stats=True)
    assert int(stats["overflow"]) == 0
    np.testing.assert_array_equal(np.asarray(out["t"]), w[ids])


def test_update_can_be_skipped_without_touching_state():
    mesh = jaxscale.make_mesh(2, 4)
    rng = np.random.default_rng(4)
    w0 = dense_tables(rng)
    ec = jaxscale.EmbeddingCollection(TABLES, mesh, jaxscale.EmbeddingSettings(optimizer=jaxscale.RowWiseAdagrad(0.1)))
    ids = make_ids(rng)
    grads = {f: jnp.ones(out_shape(f), jnp.float32) for f in ids}
    state = ec.update(ec.from_dense(w0), ids, grads, apply=jnp.array(False))
    got = ec.to_dense(state)
    for n in w0:
        np.testing.assert_array_equal(got[n], w0[n])
    assert float(sum(v.sum() for v in ec.slots_to_dense(state)["accumulator"].values())) == 0.0


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (8, 1)], ids=["2x4", "4x2", "8x1-one-shard"])
def test_sparse_periodic_sync_equals_dense_periodic_and_sends_less(shape):
    """'periodic_sparse' averages only rows some replica touched since the last sync: the result equals the
    dense periodic average (untouched rows are equal everywhere already), with a compacted all-reduce; a sync
    with more touched rows than its buffer averages every row, still equal."""
    from jaxscale.engine.comm_inspect import list_collectives

    mesh = jaxscale.make_mesh(*shape)
    rng = np.random.default_rng(7)
    tables = [jaxscale.TableConfig("t", rows=512, dim=16, pooling=None)]
    w0 = {"t": rng.normal(size=(512, 16)).astype(np.float32)}
    base = jaxscale.EmbeddingSettings(topology="2d_a2a", optimizer=jaxscale.RowWiseAdagrad(0.1))
    sync = functools.partial(jaxscale.ReplicaSync, "periodic", every=2)
    dense = jaxscale.EmbeddingCollection(tables, mesh, base.replace(replica_sync=sync()))
    sparse = jaxscale.EmbeddingCollection(tables, mesh, base.replace(replica_sync=sync(strategy="sparse")))
    tiny = jaxscale.EmbeddingCollection(tables, mesh, base.replace(replica_sync=sync(strategy="sparse", sparse_rows=2)))
    states = [ec.from_dense(w0) for ec in (dense, sparse, tiny)]
    for _ in range(4):
        ids = {"t": rng.integers(-1, 512, (16, 3)).astype(np.int32)}
        grads = {"t": jnp.asarray(rng.normal(size=(16, 3, 16)).astype(np.float32))}
        states = [ec.update(s, ids, grads) for ec, s in zip((dense, sparse, tiny), states)]
    ref = [dense.to_dense(states[0], r)["t"] for r in range(dense.num_replicas)]
    for ec, st in zip((sparse, tiny), states[1:]):
        for r in range(ec.num_replicas):
            np.testing.assert_allclose(ec.to_dense(st, r)["t"], ref[r], rtol=1e-6, atol=1e-7)
        acc = ec.slots_to_dense(st)["accumulator"]["t"]
        np.testing.assert_allclose(acc, dense.slots_to_dense(states[0])["accumulator"]["t"], rtol=1e-6)
    assert not np.array_equal(ref[0], w0["t"])

    def reduce_sizes(ec):
        ids = ec.shard_batch({"t": np.zeros((16, 3), np.int32)})
        grads = {"t": jnp.zeros((16, 3, 16))}
        cs = list_collectives(jax.jit(ec.update), ec.abstract_state(), ids, grads, mesh=mesh)
        return {c.result_bytes for c in cs if c.kind == "all-reduce" and any(d == "f32" for d in c.dtypes)}

    # the sparse sync moves its compacted buffer (weights + accumulator of `cap` rows), a fraction of the
    # block the dense average all-reduces (its fallback stays in the program, taken only when more rows moved)
    block = sparse.layout.stacks["w16"].rows
    cap = sparse._sparse_capacity("w16")
    assert cap == block // 8
    compact = reduce_sizes(sparse) - reduce_sizes(dense)
    assert compact and max(compact) <= cap * (16 + 1) * 4, (compact, cap)
