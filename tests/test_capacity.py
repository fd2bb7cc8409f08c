"""Exchange capacities: counted exactly on the host, overflow counted exactly when a factor is forced, and
the compiled exchanges of a batch sized close to what the batch really needs (bytes from compiled HLO)."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from capacity_reference import dropped, remote_unique_ids, requests_per_owner
from conftest import MESH_IDS, MESH_SHAPES

import jaxscale
from jaxscale.engine.comm_inspect import list_collectives
from jaxscale.engine.comm_model import round_up_capacity
from jaxscale.engine.embedding import capacity
from jaxscale.engine.mesh import Topology
from jaxscale.training.comm_report import split_bytes

LAYOUTS = [((1, 8), "1d"), ((2, 4), "2d_a2a"), ((4, 2), "2d_a2a"), ((2, 4), "2d_ar")]
LAYOUT_IDS = [f"{n}x{l}-{t}" for (n, l), t in LAYOUTS]


def zipf_ids(rng, rows, shape, a=1.1):
    """Zipf(a)-distributed ids in [0, rows) with the hottest ids spread by a fixed permutation."""
    ranks = np.minimum(rng.zipf(a, size=shape) - 1, rows - 1)
    return np.random.default_rng(123).permutation(rows)[ranks].astype(np.int32)


def test_ladder_rounds_up_by_at_most_a_quarter():
    values = sorted({round_up_capacity(n) for n in range(1, 5000)})
    assert values[:10] == [1, 2, 3, 4, 5, 6, 8, 10, 12, 15]
    for n in range(1, 5000):
        v = round_up_capacity(n)
        assert n <= v <= max(n + 1, 1.25 * n + 1)
    assert len(values) < 40  # a run sees few distinct capacities


@pytest.mark.parametrize("shape,topology", LAYOUTS, ids=LAYOUT_IDS)
def test_counted_capacities_are_the_exact_needs_rounded_up(shape, topology):
    mesh = jaxscale.make_mesh(*shape)
    tables = [
        jaxscale.TableConfig("seq", rows=300, dim=16, pooling=None),
        jaxscale.TableConfig("bag", rows=120, dim=16, pooling="sum"),
        jaxscale.TableConfig("cw", rows=50, dim=16, pooling=None),
    ]
    ec = jaxscale.EmbeddingCollection(
        tables,
        mesh,
        jaxscale.EmbeddingSettings(
            topology=topology, sharding={"seq": "row_wise", "bag": "row_wise", "cw": "column_wise"}
        ),
    )
    rng = np.random.default_rng(0)
    ids = {
        "seq": zipf_ids(rng, 300, (32, 6)),
        "bag": np.where(rng.random((32, 4)) < 0.2, -1, zipf_ids(rng, 120, (32, 4))),
        "cw": rng.integers(-1, 50, (32, 3)).astype(np.int32),
    }
    caps = ec.shard_batch(ids).capacities
    assert caps.counted
    uniq, pairs = requests_per_owner(ec, ids, partial=frozenset({"bag"}))
    for key, cap in caps.stacks:
        need_rows = max((len(s) for s in uniq[key].values()), default=0)
        need_pairs = max(pairs[key].values(), default=0)
        has_rows = any(ec.layout.routes[ec.feature_table[f]].stack == key for f in ("seq", "cw"))
        has_pairs = ec.layout.routes[ec.feature_table["bag"]].stack == key
        assert cap.rows == (round_up_capacity(max(need_rows, 1)) if has_rows else 0)
        assert cap.pairs == (round_up_capacity(max(need_pairs, 1)) if has_pairs else 0)
    # an exact batch never overflows, and its lookup equals the plain gather
    w = {t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in tables}
    out, stats = ec.lookup(ec.from_dense(w), ids, return_stats=True)
    assert int(stats["overflow"]) == 0
    np.testing.assert_allclose(np.asarray(out["seq"]), np.where(ids["seq"][..., None] >= 0, w["seq"][ids["seq"]], 0))


@pytest.mark.parametrize("shape,topology", LAYOUTS, ids=LAYOUT_IDS)
def test_overflow_equals_the_rows_actually_dropped(shape, topology):
    """A forced small capacity: the reported overflow is the number of unique rows (and pairs) that did not
    fit, summed over every device (each device counts its own requests: nothing is divided by the replica
    count), and exactly those rows come back as zeros."""
    mesh = jaxscale.make_mesh(*shape)
    seq = jaxscale.TableConfig("seq", rows=96, dim=8, pooling=None)
    bag = jaxscale.TableConfig("bag", rows=96, dim=8, pooling="sum")
    ec = jaxscale.EmbeddingCollection(
        [seq, bag], mesh, jaxscale.EmbeddingSettings(topology=topology, capacity_factor=0.4)
    )
    rng = np.random.default_rng(1)
    ids = {"seq": rng.integers(0, 96, (32, 8)).astype(np.int32), "bag": rng.integers(-1, 96, (32, 6)).astype(np.int32)}
    w = {n: 1.0 + np.abs(rng.normal(size=(96, 8))).astype(np.float32) for n in ("seq", "bag")}
    state = ec.from_dense(w)
    out, stats = ec.lookup(state, ids, return_stats=True)
    sharded = ec.shard_batch(ec.validate_ids(ids))
    caps = ec._capacities_in_trace(sharded)
    assert not caps.counted
    expected = dropped(ec, ids, caps, partial=frozenset({"bag"}))
    assert expected > 0
    assert int(stats["overflow"]) == expected
    # the update counts the same requests
    grads = {"seq": jnp.ones((32, 8, 8)), "bag": jnp.ones((32, 8))}
    _, ustats = ec.update(state, ids, grads, apply=False, return_stats=True)
    assert int(ustats["overflow"]) == expected
    # which rows were dropped: per (device, owner), the unique rows past the capacity in block-row order
    # (row r of a row-wise table sits at r // shards of its owner's block)
    got = np.asarray(out["seq"])
    per = 32 // mesh.size
    uniq, _ = requests_per_owner(ec, {"seq": ids["seq"]})
    (key,) = uniq
    lost = set()
    for (d, _owner), rows in uniq[key].items():
        ordered = sorted(rows, key=lambda r: r[1] // ec.num_shards)
        lost |= {(d, r[1]) for r in ordered[caps[key].rows :]}
    for i in range(32):
        for j in range(8):
            v = int(ids["seq"][i, j])
            want = np.zeros(8) if (i // per, v) in lost else w["seq"][v]
            np.testing.assert_array_equal(got[i, j], want, err_msg=f"example {i} position {j} id {v}")
    assert len(lost) == dropped(ec, {"seq": ids["seq"]}, caps)


def _step_bytes(ec, ids):
    """Collectives of the lookup + update step compiled for exactly this batch."""
    sharded = ec.shard_batch(ec.validate_ids(ids))

    def step(state, ids):
        emb = ec.lookup(state, ids)
        grads = jax.tree.map(jnp.ones_like, emb)
        return ec.update(state, ids, grads)

    return list_collectives(jax.jit(step, donate_argnums=0), ec.abstract_state(), sharded, mesh=ec.mesh)


def test_exact_exchange_sends_at_most_twice_the_deduplicated_need():
    """2x4, 1d, one 200,000 x 64 row-wise table, Zipf(1.1), global batch 512 x 20, default settings: the
    compiled step sends <= 2x what an exact, de-duplicated exchange needs (each device's unique remote ids
    x (4 bytes of id + a row forward + a gradient back))."""
    mesh = jaxscale.make_mesh(2, 4)
    t = jaxscale.TableConfig("items", rows=200_000, dim=64, pooling=None)
    ec = jaxscale.EmbeddingCollection([t], mesh, jaxscale.EmbeddingSettings(topology="1d", sharding="row_wise"))
    ids = {"items": zipf_ids(np.random.default_rng(2), 200_000, (512, 20))}
    sent = sum(c.bytes_per_device for c in _step_bytes(ec, ids) if c.kind == "all-to-all")
    need = remote_unique_ids(ec, ids) * (4 + 64 * 4 + 64 * 4)
    assert sent <= 2 * need.mean(), (sent, need.mean())
    # the worst-case capacity (what a fixed shape pays) is far above: the test can fail
    worst = jaxscale.EmbeddingCollection(
        [t], mesh, jaxscale.EmbeddingSettings(topology="1d", sharding="row_wise", capacity_factor=8.0)
    )
    padded = sum(c.bytes_per_device for c in _step_bytes(worst, ids) if c.kind == "all-to-all")
    assert padded > 4 * need.mean()


def test_exact_sync_cross_node_bytes_follow_the_union_of_touched_rows():
    """4x2, 2d_a2a (shards inside a node, replicas across the 4 nodes), exact sync, row-wise 200,000 x 64,
    Zipf ids, default settings: cross-node bytes per device <= 2.5 x (distinct rows touched in the step /
    local shards x row bytes)."""
    mesh = jaxscale.make_mesh(4, 2)
    t = jaxscale.TableConfig("items", rows=200_000, dim=64, pooling=None)
    ec = jaxscale.EmbeddingCollection([t], mesh, jaxscale.EmbeddingSettings(topology="2d_a2a", sharding="row_wise"))
    ids = {"items": zipf_ids(np.random.default_rng(3), 200_000, (512, 20))}
    cs = _step_bytes(ec, ids)
    inter = sum(split_bytes(c, (4, 2))[1] for c in cs)
    distinct = len(np.unique(ids["items"]))
    bound = 2.5 * distinct / 2 * 64 * 4
    assert inter <= bound, (inter, bound)
    # 'auto' (the default) picked the cheaper strategy for this batch
    by = {}
    for strategy in ("gather", "owner"):
        other = jaxscale.EmbeddingCollection(
            [t],
            mesh,
            jaxscale.EmbeddingSettings(
                topology="2d_a2a", sharding="row_wise", replica_sync=jaxscale.ReplicaSync(strategy=strategy)
            ),
        )
        by[strategy] = sum(split_bytes(c, (4, 2))[1] for c in _step_bytes(other, ids))
    assert inter == min(by.values()), (inter, by)


def test_sync_strategy_follows_how_much_the_nodes_ids_overlap():
    """Heavily shared ids (a steep Zipf head): routing each row to one owner node sends the union once and
    beats all-gathering every node's rows; the 'auto' choice makes that call per batch from the counts."""
    mesh = jaxscale.make_mesh(4, 2)
    t = jaxscale.TableConfig("items", rows=20_000, dim=64, pooling=None)
    ids = {"items": zipf_ids(np.random.default_rng(6), 20_000, (512, 20), a=2.0)}
    inter = {}
    for strategy in ("auto", "gather", "owner"):
        ec = jaxscale.EmbeddingCollection(
            [t],
            mesh,
            jaxscale.EmbeddingSettings(
                topology="2d_a2a", sharding="row_wise", replica_sync=jaxscale.ReplicaSync(strategy=strategy)
            ),
        )
        if strategy == "auto":
            assert ec.shard_batch(ids).capacities["w64"].sync_strategy == "owner"
        inter[strategy] = sum(split_bytes(c, (4, 2))[1] for c in _step_bytes(ec, ids))
    assert inter["auto"] == inter["owner"] < inter["gather"], inter


@pytest.mark.parametrize("strategy", ["owner", "gather"])
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_exact_sync_strategies_keep_replicas_identical_and_exact(shape, strategy):
    """Both exact sync strategies equal the single-device reference and keep replicas bit-identical, with
    fp32 and with quantized (bf16) gradients on the wire."""
    from embedding_reference import adagrad_step

    mesh = jaxscale.make_mesh(*shape)
    tables = [jaxscale.TableConfig("a", rows=64, dim=8, pooling=None), jaxscale.TableConfig("b", rows=40, dim=8)]
    rng = np.random.default_rng(4)
    w0 = {t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in tables}
    for comm in (None, jaxscale.CommConfig(backward="bf16")):
        ec = jaxscale.EmbeddingCollection(
            tables,
            mesh,
            jaxscale.EmbeddingSettings(
                topology="2d_a2a",
                comm=comm,
                optimizer=jaxscale.RowWiseAdagrad(0.1),
                sharding={"a": "row_wise", "b": "column_wise"},
                replica_sync=jaxscale.ReplicaSync(strategy=strategy),
            ),
        )
        state = ec.from_dense(w0)
        ref_w, ref_acc = dict(w0), {t.name: np.zeros(t.rows, np.float32) for t in tables}
        for _ in range(3):
            ids = {
                "a": rng.integers(-1, 64, (16, 5)).astype(np.int32),
                "b": rng.integers(0, 40, (16, 3)).astype(np.int32),
            }
            grads = {
                "a": rng.normal(size=(16, 5, 8)).astype(np.float32),
                "b": rng.normal(size=(16, 8)).astype(np.float32),
            }
            caps = ec.shard_batch(ids).capacities
            assert all(c.sync_strategy == strategy for _, c in caps.stacks)
            state = ec.update(state, ids, {f: jnp.asarray(g) for f, g in grads.items()})
            ref_w, ref_acc = adagrad_step(ref_w, ref_acc, tables, ids, grads, 0.1, 1e-8)
        got = ec.to_dense(state)
        tol = dict(rtol=1e-5, atol=1e-6) if comm is None else dict(rtol=2e-2, atol=2e-2)
        for n in got:
            np.testing.assert_allclose(got[n], ref_w[n], **tol, err_msg=f"{strategy} {comm} {n}")
            for r in range(1, ec.num_replicas):
                np.testing.assert_array_equal(ec.to_dense(state, r)[n], got[n])


def test_capacity_cache_reuses_a_covering_executable():
    mesh = jaxscale.make_mesh(1, 8)
    t = jaxscale.TableConfig("t", rows=1000, dim=8, pooling=None)
    ec = jaxscale.EmbeddingCollection([t], mesh)
    rng = np.random.default_rng(5)
    big = ec.shard_batch({"t": rng.integers(0, 1000, (64, 8)).astype(np.int32)}).capacities
    small = ec.shard_batch({"t": rng.integers(0, 50, (64, 8)).astype(np.int32)}).capacities
    assert small == big  # the smaller batch fits the executable already compiled
    assert Topology("2d_a2a", 2, 4).replica_of(np.arange(8)).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=MESH_IDS)
@pytest.mark.parametrize("topology", jaxscale.TOPOLOGIES)
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise"])
def test_pair_counts_without_building_pairs_equal_the_request_path(shape, topology, sharding):
    """The host counts the (row, bag) pairs a device sends each owner straight from the ids; the same
    maximum as building the pair requests and counting (device, owner) keys; invalid ids send nothing."""
    from jaxscale.engine.embedding import capacity as C
    from jaxscale.engine.embedding import routing

    rng = np.random.default_rng(zlib.crc32(f"{shape}{topology}{sharding}".encode()))
    tables = [
        jaxscale.TableConfig(f"t{i}", rows=int(rng.integers(50, 500)), dim=16, pooling="sum", features=(f"f{i}",))
        for i in range(3)
    ]
    ec = jaxscale.EmbeddingCollection(
        tables, jaxscale.make_mesh(*shape), jaxscale.EmbeddingSettings(topology=topology, sharding=sharding)
    )
    B, L, devices = 64, 7, 8
    ids = {}
    for i, t in enumerate(tables):
        x = np.minimum(rng.zipf(1.2, (B, L)) - 1, t.rows + 3)  # a few ids past the table: invalid
        ids[f"f{i}"] = np.where(rng.random((B, L)) < 0.2, -1, x).astype(np.int32)
    ids["f0"][:8] = -1  # device 0 sends nothing for f0
    for key in ec.layout.stacks:
        feats = sorted(ids)
        fast = C._pair_count_max(ec.layout, ec.feature_table, key, feats, ids, devices)
        req = routing.pair_requests(ec.layout, ec.feature_table, key, feats, ids, xp=np)
        dev = np.concatenate([np.repeat(np.arange(s.bags) // (s.bags // devices), L) for s in req.segments])
        ok = req.dest < ec.layout.num_shards
        slow = max(1, C._max_count(dev[ok].astype(np.int64) * ec.layout.num_shards + req.dest[ok]))
        assert fast == slow


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise"])
def test_per_process_counts_combine_to_the_single_process_capacities(shape, sharding):
    """What a multi-process run does, emulated: each 'process' (one node's devices) counts its own rows
    with `count_local`; the capacities from every process's maxima equal those one process counts from
    the whole batch. (The exchange itself runs between real processes in tests/test_multiprocess.py.)"""
    mesh = jaxscale.make_mesh(*shape)
    tables = [
        jaxscale.TableConfig("seq", rows=400, dim=16, pooling=None),
        jaxscale.TableConfig("bag", rows=150, dim=16, pooling="sum"),
    ]
    ec = jaxscale.EmbeddingCollection(tables, mesh, jaxscale.EmbeddingSettings(topology="1d", sharding=sharding))
    rng = np.random.default_rng(zlib.crc32(f"{shape}{sharding}".encode()))
    ids = {
        "seq": zipf_ids(rng, 400, (64, 5)),
        "bag": np.where(rng.random((64, 6)) < 0.2, -1, zipf_ids(rng, 150, (64, 6))),
    }
    args = (ec.layout, ec.feature_table, ec.topology)
    rest = (ec.settings.pooled_comm, False, "gather", lambda w: 4 * w)
    alone = capacity.count_local(*args, ids, *rest)
    whole = alone.capacities(alone.maxima[None])
    nodes, local = shape
    rows = 64 // nodes
    parts = [
        capacity.count_local(
            *args,
            {f: x[p * rows : (p + 1) * rows] for f, x in ids.items()},
            *rest,
            first_device=p * local,
            num_devices=local,
        )
        for p in range(nodes)
    ]
    assert all(p.stacks == parts[0].stacks for p in parts)
    combined = parts[0].capacities(np.stack([p.maxima for p in parts]))
    assert combined == whole and whole.counted
    # a single process's own maxima alone never ask for more than the combined batch
    for p in parts:
        assert combined.covers(p.capacities(p.maxima[None]))


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
@pytest.mark.parametrize("topology", jaxscale.TOPOLOGIES)
def test_per_process_counts_with_exact_sync_equal_one_process_on_every_topology(shape, topology):
    """As above with the exact replica sync's row keys exchanged too (2D topologies): each 'process' (one
    node) counts its rows; its exchange hands back every process's keys in process order. The capacities
    (sync included) must equal what one process counts from the whole batch: a row touched by one
    replica on two processes is one row, not two."""
    mesh = jaxscale.make_mesh(*shape)
    tables = [
        jaxscale.TableConfig("seq", rows=300, dim=16, pooling=None),
        jaxscale.TableConfig("bag", rows=120, dim=16, pooling="sum"),
    ]
    ec = jaxscale.EmbeddingCollection(tables, mesh, jaxscale.EmbeddingSettings(topology=topology, sharding="row_wise"))
    rng = np.random.default_rng(zlib.crc32(f"{shape}{topology}".encode()))
    ids = {"seq": zipf_ids(rng, 300, (64, 5)), "bag": zipf_ids(rng, 120, (64, 4))}
    args = (ec.layout, ec.feature_table, ec.topology)
    rest = (ec.settings.pooled_comm, ec._exact_sync, ec.settings.replica_sync.strategy, lambda w: 4 * w)
    alone = capacity.count_local(*args, ids, *rest)
    nodes, local = shape
    rows = 64 // nodes
    mine = [{f: x[p * rows : (p + 1) * rows] for f, x in ids.items()} for p in range(nodes)]
    sent = [[] for _ in range(nodes)]  # pass 1: what each process sends, call by call

    def recorder(p):
        def exchange(keys, same_size=False):
            sent[p].append(np.asarray(keys, np.int64))
            return keys

        return exchange

    def replay(p):
        calls = iter(range(len(sent[p])))

        def exchange(keys, same_size=False):
            i = next(calls)
            np.testing.assert_array_equal(keys, sent[p][i])  # the keys sent do not depend on what came back
            return np.concatenate([sent[q][i] for q in range(nodes)])

        return exchange

    for p in range(nodes):
        capacity.count_local(*args, mine[p], *rest, first_device=p * local, num_devices=local, exchange=recorder(p))
    parts = [
        capacity.count_local(*args, mine[p], *rest, first_device=p * local, num_devices=local, exchange=replay(p))
        for p in range(nodes)
    ]
    if ec.num_replicas > 1:
        assert all(sent[p] for p in range(nodes))  # the sync keys were exchanged
    combined = [p.capacities(np.stack([q.maxima for q in parts])) for p in parts]
    assert all(c == combined[0] for c in combined)  # every process agrees
    assert combined[0] == alone.capacities(alone.maxima[None])


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=MESH_IDS)
@pytest.mark.parametrize("topology", jaxscale.TOPOLOGIES)
def test_reused_capacities_skip_an_overflowing_batch_and_the_counted_rerun_is_exact(shape, topology, monkeypatch):
    """reuse_capacities: only the first batch and the re-run of a batch that overflowed are counted; an
    overflowing attempt changes no weight or accumulator of any replica, and every output and the final
    state equal a run that counts every batch (and the single-device reference where one replica holds
    the whole batch's update). A row-wise sequence table: the row exchange; a column-wise pooled table:
    partial sums. Where replicas exist, the exact sync is refused and the periodic one runs."""
    from embedding_reference import adagrad_step

    counted = []
    real_count = capacity.count_local
    monkeypatch.setattr(capacity, "count_local", lambda *a, **k: counted.append(1) or real_count(*a, **k))
    mesh = jaxscale.make_mesh(*shape)
    tables = [jaxscale.TableConfig("a", rows=64, dim=8, pooling=None), jaxscale.TableConfig("b", rows=48, dim=8)]
    kwargs = dict(topology=topology, sharding={"a": "row_wise", "b": "column_wise"})
    replicas = Topology.of(topology, mesh).num_replicas
    if replicas > 1:
        with pytest.raises(ValueError, match="reuse_capacities=True cannot run the exact replica sync"):
            jaxscale.EmbeddingCollection(tables, mesh, jaxscale.EmbeddingSettings(reuse_capacities=True, **kwargs))
        kwargs.update(replica_sync=jaxscale.ReplicaSync("periodic", every=2))
    reuse, every = (
        jaxscale.EmbeddingCollection(
            tables,
            mesh,
            jaxscale.EmbeddingSettings(optimizer=jaxscale.RowWiseAdagrad(0.1), reuse_capacities=r, **kwargs),
        )
        for r in (True, False)
    )
    rng = np.random.default_rng(11)
    w0 = {t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in tables}
    state, base = reuse.from_dense(w0), every.from_dense(w0)
    ref_w, ref_acc = dict(w0), {t.name: np.zeros(t.rows, np.float32) for t in tables}

    def dense(ec, st):
        return [(ec.to_dense(st, r), ec.slots_to_dense(st, r)["accumulator"]) for r in range(ec.num_replicas)]

    def batch(spread):  # spread 1: every id the same row (tiny needs); 64: many distinct rows
        return {
            "a": rng.integers(0, spread, (16, 5)).astype(np.int32),
            "b": rng.integers(0, min(spread, 48), (16, 3)).astype(np.int32),
        }

    reruns, reused_fits = 0, 0
    for step, ids in enumerate([batch(1), batch(64), batch(64), batch(1)]):
        grads = {"a": rng.normal(size=(16, 5, 8)).astype(np.float32), "b": rng.normal(size=(16, 8)).astype(np.float32)}
        before = len(counted)
        sharded = reuse.shard_batch(ids)
        emb, stats = reuse.lookup(state, sharded, return_stats=True)
        if step > 0:
            assert len(counted) == before, "a reused batch was counted"
        if int(stats["overflow"]):
            kept = dense(reuse, state)
            state = reuse.update(state, sharded, grads, apply=stats["overflow"] == 0)
            for r, (w, a) in enumerate(dense(reuse, state)):
                for n in w:
                    np.testing.assert_array_equal(w[n], kept[r][0][n], err_msg=f"skipped attempt: replica {r} {n}")
                    np.testing.assert_array_equal(a[n], kept[r][1][n], err_msg=f"skipped attempt: replica {r} {n}")
            state = dict(state, step=state["step"] - 1)  # the attempt advanced the counter (as the trainer rewinds)
            reruns += 1
            sharded = reuse.shard_batch(ids, recount=True)
            assert len(counted) == before + 1
            emb, stats = reuse.lookup(state, sharded, return_stats=True)
            assert int(stats["overflow"]) == 0
        else:
            reused_fits += step > 0
        want = every.lookup(base, ids)
        for f in want:
            np.testing.assert_allclose(np.asarray(emb[f]), np.asarray(want[f]), rtol=1e-6, atol=1e-6, err_msg=f)
        state = reuse.update(state, sharded, grads)
        base = every.update(base, ids, grads)
        ref_w, ref_acc = adagrad_step(ref_w, ref_acc, tables, ids, grads, 0.1, 1e-8)
    if reuse.num_shards > 1:
        assert reruns >= 1 and reused_fits >= 1, (reruns, reused_fits)
    else:  # one shard (2d_ar on 1 node): every row is local, nothing is exchanged or counted
        assert not counted and reruns == 0
    for r, ((w, a), (bw, ba)) in enumerate(zip(dense(reuse, state), dense(every, base))):
        for n in w:
            np.testing.assert_allclose(w[n], bw[n], rtol=1e-6, atol=1e-6, err_msg=f"replica {r} {n}")
            np.testing.assert_allclose(a[n], ba[n], rtol=1e-6, atol=1e-6, err_msg=f"replica {r} {n}")
            if replicas == 1:
                np.testing.assert_allclose(w[n], ref_w[n], rtol=1e-5, atol=1e-6, err_msg=n)
                np.testing.assert_allclose(a[n], ref_acc[n], rtol=1e-5, atol=1e-6, err_msg=n)


def test_reuse_capacities_must_be_a_bool():
    with pytest.raises(ValueError, match="^reuse_capacities: must be true or false, got 'yes'"):
        jaxscale.EmbeddingSettings(reuse_capacities="yes")
