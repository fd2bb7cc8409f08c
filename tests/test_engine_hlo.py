"""What the engine's compiled lookup+update step communicates and allocates, read from XLA.

Deterministic checks (no wall clock): the collectives of the compiled HLO, classified intra- or
cross-node by `jaxscale.engine.comm_inspect`, and `compiled.memory_analysis()` (per-device sizes).
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import jaxscale
from jaxscale.engine.comm_inspect import format_table, list_collectives

DIM = 64
B, L = 64, 8  # global batch: 8 examples x 8 ids per device


def _collection(mesh, topology, rows=1000, comm=None, sharding="row_wise"):
    tables = [
        jaxscale.TableConfig("items", rows=rows, dim=DIM, pooling="sum"),
        jaxscale.TableConfig("seq", rows=300, dim=DIM, pooling=None),
    ]
    return jaxscale.EmbeddingCollection(
        tables,
        mesh,
        jaxscale.EmbeddingSettings(
            topology=topology, sharding=sharding, comm=comm, optimizer=jaxscale.RowWiseAdagrad(0.1)
        ),
    )


def _abstract_ids(ec):
    return {
        "items": jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=ec.batch_sharding),
        "seq": jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=ec.batch_sharding),
    }


def _train_step(ec):
    def step(state, ids):
        emb = ec.lookup(state, ids)
        grads = jax.tree.map(lambda e: 2.0 * e, emb)  # d/de sum(e**2)
        return ec.update(state, ids, grads), emb

    return jax.jit(step, donate_argnums=0)


def _step_collectives(mesh, topology, **kw):
    ec = _collection(mesh, topology, **kw)
    cs = list_collectives(_train_step(ec), ec.abstract_state(), _abstract_ids(ec), mesh=mesh)
    return ec, cs


def _float_a2a(cs):
    """The all-to-alls of rows (payload [.., .., width]); ids travel as s32 or as u16 [.., slots]."""
    return [
        c
        for c in cs
        if c.kind == "all-to-all" and not all(dt.startswith("s") for dt in c.dtypes) and len(c.shapes[0]) >= 3
    ]


MESHES = [pytest.param((2, 4), id="2x4"), pytest.param((4, 2), id="4x2")]


@pytest.mark.parametrize("shape", MESHES)
def test_2d_a2a_keeps_all_to_all_inside_the_node(shape):
    mesh = jaxscale.make_mesh(*shape)
    _, cs = _step_collectives(mesh, "2d_a2a")
    table = format_table(cs)
    a2a = [c for c in cs if c.kind == "all-to-all"]
    # ids out, rows back, gradients out (the ids a2a of lookup and update may be CSE'd into one)
    assert len(_float_a2a(cs)) >= 2 and any(c.dtypes[0] == "s32" for c in a2a), table
    assert all(c.group_size == shape[1] and not c.cross_node for c in a2a), table
    # the only cross-node traffic: the replica sync all-gather of the update (rows + gradients)
    cross = [c for c in cs if c.cross_node]
    assert cross and all(c.kind == "all-gather" and c.group_size == shape[0] for c in cross), table
    assert any(c.dtypes == ("f32",) and c.shapes[0][-1] == DIM for c in cross), table  # gradient rows
    assert any(c.dtypes == ("s32",) for c in cross), table  # their row ids


@pytest.mark.parametrize("shape", MESHES)
def test_1d_all_to_all_crosses_nodes(shape):
    mesh = jaxscale.make_mesh(*shape)
    _, cs = _step_collectives(mesh, "1d")
    table = format_table(cs)
    a2a = [c for c in cs if c.kind == "all-to-all"]
    assert a2a and all(c.cross_node and c.group_size == 8 for c in a2a), table
    assert _float_a2a(cs), table
    assert not [c for c in cs if c.kind == "all-gather"], table  # one replica: nothing to sync


@pytest.mark.parametrize("shape", MESHES)
def test_2d_ar_all_to_all_crosses_nodes_and_replica_sync_stays_inside(shape):
    mesh = jaxscale.make_mesh(*shape)
    _, cs = _step_collectives(mesh, "2d_ar")
    table = format_table(cs)
    a2a = [c for c in cs if c.kind == "all-to-all"]
    assert a2a and all(c.cross_node and c.group_size == shape[0] for c in a2a), table
    gathers = [c for c in cs if c.kind == "all-gather"]
    assert gathers and all(not c.cross_node and c.group_size == shape[1] for c in gathers), table
    assert any(c.dtypes == ("f32",) and c.shapes[0][-1] == DIM for c in gathers), table


@pytest.mark.parametrize("topology", ["1d", "2d_a2a"])
def test_fp8_lookup_payload_is_under_0p3_of_fp32(topology):
    mesh = jaxscale.make_mesh(2, 4)
    lookup_bytes = {}
    for name, comm in (("fp32", None), ("fp8", jaxscale.CommConfig(forward="fp8", backward="fp8"))):
        ec = _collection(mesh, topology, comm=comm)
        fn = jax.jit(lambda state, ids, ec=ec: ec.lookup(state, ids))
        cs = list_collectives(fn, ec.abstract_state(), _abstract_ids(ec), mesh=mesh)
        rows = _float_a2a(cs)
        assert rows, format_table(cs)
        if name == "fp8":  # the rows really travel as bytes: 64 fp8 values + a 1-byte scale per row
            assert all(set(c.dtypes) == {"u8"} and c.shapes[0][-1] == DIM + 1 for c in rows), format_table(cs)
        else:
            assert all(set(c.dtypes) == {"f32"} and c.shapes[0][-1] == DIM for c in rows), format_table(cs)
        lookup_bytes[name] = (
            sum(c.bytes_per_device for c in rows),
            sum(c.bytes_per_device for c in cs if c.kind == "all-to-all"),
        )
    payload_ratio = lookup_bytes["fp8"][0] / lookup_bytes["fp32"][0]
    total_ratio = lookup_bytes["fp8"][1] / lookup_bytes["fp32"][1]  # ids (never quantized) included
    assert payload_ratio <= 0.3, lookup_bytes
    assert total_ratio <= 0.3, lookup_bytes
    assert payload_ratio == pytest.approx((DIM + 1) / (4 * DIM))


def _compiled_update(ec):
    ids = {"items": jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=ec.batch_sharding)}
    grads = {"items": jax.ShapeDtypeStruct((B, DIM), jnp.float32, sharding=ec.batch_sharding)}
    fn = jax.jit(lambda state, ids, grads: ec.update(state, ids, grads), donate_argnums=0)
    return fn.lower(ec.abstract_state(), ids, grads).compile()


def _block_bytes(ec):
    """Bytes of one device's block of the stacked table (weights only)."""
    (st,) = ec.layout.stacks.values()
    return st.rows * st.width * 4


@pytest.mark.parametrize("topology", ["1d", "2d_a2a", "2d_ar"])
def test_update_is_sparse_and_donated(topology):
    mesh = jaxscale.make_mesh(2, 4)
    stats = {}
    for rows in (10_000, 1_000_000):
        ec = jaxscale.EmbeddingCollection(
            [jaxscale.TableConfig("items", rows=rows, dim=DIM, pooling="sum")],
            mesh,
            jaxscale.EmbeddingSettings(topology=topology, sharding="row_wise", optimizer=jaxscale.RowWiseAdagrad(0.1)),
        )
        m = _compiled_update(ec).memory_analysis()
        stats[rows] = (m.temp_size_in_bytes, m.alias_size_in_bytes, _block_bytes(ec))
    (t_small, _, table_small), (t_big, alias_big, table_big) = stats[10_000], stats[1_000_000]
    assert table_big >= 99 * table_small
    # a dense [rows, dim] gradient of the big table would need >= table_big temp bytes
    assert t_big < 2 * t_small, stats
    assert t_big < table_big / 10, stats
    # the state is donated: weights (and accumulators) alias the outputs
    assert alias_big >= table_big, stats


def test_dense_gradient_would_fail_the_sparsity_check():
    """Negative control: the same criterion flags an update that builds a dense gradient."""
    temps = {}
    for rows in (10_000, 1_000_000):
        w = jax.ShapeDtypeStruct((rows, DIM), jnp.float32)
        i = jax.ShapeDtypeStruct((B * L,), jnp.int32)
        g = jax.ShapeDtypeStruct((B * L, DIM), jnp.float32)

        def dense(w, i, g):
            dw = jax.grad(lambda w: jnp.sum(jnp.take(w, i, axis=0) * g))(w)
            return w - 0.1 * dw

        temps[rows] = jax.jit(dense, donate_argnums=0).lower(w, i, g).compile().memory_analysis().temp_size_in_bytes
    assert not temps[1_000_000] < 2 * temps[10_000], temps


def _lookup_then_update(ec, with_after):
    """One jitted step that looks up, then updates with GIVEN gradients (they do not depend on the lookup)."""

    def step(state, ids, grads):
        emb = ec.lookup(state, ids)
        return ec.update(state, ids, grads, after=emb if with_after else None), emb

    return jax.jit(step, donate_argnums=0)


@pytest.mark.parametrize(
    "shape, topology, sharding",
    [
        ((1, 1), "1d", "row_wise"),
        ((1, 8), "1d", "row_wise"),
        ((2, 4), "2d_a2a", "row_wise"),
        ((4, 2), "2d_ar", "table_wise"),
    ],
)
def test_update_after_the_lookup_needs_no_table_copy(shape, topology, sharding):
    """Given gradients leave the lookup and the in-place update unordered, so XLA copies the donated
    table; `update(after=outputs)` orders them: no copy, the same result bit for bit."""
    import numpy as np

    mesh = jaxscale.make_mesh(*shape, devices=jax.devices()[: shape[0] * shape[1]])
    rows = 200_000
    ec = jaxscale.EmbeddingCollection(
        [jaxscale.TableConfig("items", rows=rows, dim=DIM, pooling="sum")],
        mesh,
        jaxscale.EmbeddingSettings(topology=topology, sharding=sharding, optimizer=jaxscale.RowWiseAdagrad(0.1)),
    )
    rng = np.random.default_rng(0)
    ids = {"items": np.minimum(rng.zipf(1.2, (B, L)) - 1, rows - 1).astype(np.int32)}
    grads = {"items": jax.device_put(rng.normal(size=(B, DIM)).astype(np.float32), ec.batch_sharding)}
    w0 = rng.uniform(-0.1, 0.1, (rows, DIM)).astype(np.float32)
    block = _block_bytes(ec)
    results = {}
    for with_after in (False, True):
        fn = _lookup_then_update(ec, with_after)
        state, batch = ec.from_dense({"items": w0}), ec.shard_batch(ids)
        temp = fn.lower(state, batch, grads).compile().memory_analysis().temp_size_in_bytes
        state, emb = fn(state, batch, grads)
        results[with_after] = (temp, ec.to_dense(state)["items"], np.asarray(emb["items"]))
    (t_plain, w_plain, e_plain), (t_after, w_after, e_after) = results[False], results[True]
    assert t_plain >= block, (t_plain, block)  # negative control: without `after` the table is copied
    assert t_after < block / 10, (t_after, block)
    np.testing.assert_array_equal(w_after, w_plain)
    np.testing.assert_array_equal(e_after, e_plain)


def test_update_after_must_be_sharded_by_batch():
    ec = _collection(jaxscale.make_mesh(2, 4), "1d")
    ids = {"items": jnp.zeros((B, L), jnp.int32), "seq": jnp.zeros((B, L), jnp.int32)}
    grads = {"items": jnp.zeros((B, DIM)), "seq": jnp.zeros((B, L, DIM))}
    with pytest.raises(ValueError, match="after takes arrays sharded by batch"):
        ec.update(ec.init(jax.random.key(0)), ids, grads, after=jnp.zeros((3,)))


@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (4, 2)], ids=["1x8", "2x4", "4x2"])
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise"])
def test_1d_step_counters_ride_the_ids_all_to_all(shape, sharding):
    """1d lookup + update: the counters (overflow, invalid ids) travel inside the one ids all-to-all the
    lookup and update share (no all-reduce), and still count exactly: a forced capacity drops rows, and
    ids made invalid inside jit are counted. With replicas (2d_a2a) the all-reduce stays."""
    import numpy as np

    from jaxscale.engine.embedding import ids as ids_lib

    mesh = jaxscale.make_mesh(*shape)
    tables = [jaxscale.TableConfig("a", rows=300, dim=8), jaxscale.TableConfig("s", rows=200, dim=8, pooling=None)]
    rng = np.random.default_rng(3)
    host = {"a": rng.integers(0, 300, (32, 4)).astype(np.int32), "s": rng.integers(0, 200, (32, 3)).astype(np.int32)}
    grads = {"a": np.ones((32, 8), np.float32), "s": np.ones((32, 3, 8), np.float32)}
    variants = [("1d", None)]
    if sharding == "row_wise":  # row-wise pieces: a forced capacity really drops rows
        variants.append(("1d", 0.5))
    if shape[0] > 1:  # 2d_a2a with replicas (on 1 node it has none: the 1d case again)
        variants.append(("2d_a2a", None))
    for topology, factor in variants:
        ec = jaxscale.EmbeddingCollection(
            tables, mesh, jaxscale.EmbeddingSettings(topology=topology, sharding=sharding, capacity_factor=factor)
        )
        state = ec.from_dense({t.name: np.zeros((t.rows, t.dim), np.float32) for t in tables})

        def step(state, ids, g, ec=ec):
            bad = ids_lib.ShardedIds({"a": ids["a"].at[:, 0].set(300), "s": ids["s"]}, ids.capacities)  # 32 invalid
            emb, stats = ec.lookup(state, bad, return_stats=True)
            return ec.update(state, bad, g, after=emb), stats

        step = jax.jit(step, donate_argnums=0)
        batch = ec.shard_batch(host)
        g = {f: jax.device_put(v, ec.batch_sharding) for f, v in grads.items()}
        in_step = list_collectives(step, state, batch, g, mesh=mesh)
        in_lookup = list_collectives(functools.partial(ec.lookup, return_stats=True), state, batch, mesh=mesh)
        kinds = [c.kind for c in in_step]
        if ec.num_shards > 1 and ec.num_replicas == 1:
            assert "all-reduce" not in kinds + [c.kind for c in in_lookup], (topology, kinds)

            def ids_moves(cs):  # fp32 payloads: every integer all-to-all moves ids
                return sum(c.kind == "all-to-all" and not c.dtypes[0].startswith("f") for c in cs)

            assert ids_moves(in_step) == ids_moves(in_lookup) > 0  # the update's ids exchange is the lookup's
        else:
            assert "all-reduce" in kinds, (topology, kinds)
        _, stats = step(state, batch, g)
        assert int(stats["invalid_ids"]) == 32, (topology, factor)
        if factor is None:
            assert int(stats["overflow"]) == 0
        elif ec.num_shards > 1 and sharding == "row_wise":
            assert int(stats["overflow"]) > 0, (topology, factor)
