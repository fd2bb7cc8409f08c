"""Small control collectives: `gather_small` and `sum_counts` (the step's counters), on every mesh shape.

On CPU the counters travel as one u32 all-to-all (gloo runs all-reduce as a ring of dependent rounds);
the all-reduce path is what other platforms use. Both must give the same totals, also through the engine.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import MESH_IDS, MESH_SHAPES
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale
from jaxscale import collectives
from jaxscale.comm_inspect import format_table, list_collectives
from jaxscale.mesh import BATCH_AXES, LOCAL, NODE

AXES = [pytest.param(NODE, id="node"), pytest.param(LOCAL, id="local"), pytest.param(BATCH_AXES, id="both")]


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=MESH_IDS)
@pytest.mark.parametrize("axis", AXES)
def test_gather_small_is_an_all_gather_both_ways(shape, axis):
    mesh = jaxscale.make_mesh(*shape)
    axes = (axis,) if isinstance(axis, str) else axis
    size = int(np.prod([mesh.shape[a] for a in axes]))
    x = np.random.default_rng(0).integers(-(2**40), 2**40, size=(8, 3)).astype(np.int64)
    x = jax.device_put(x.astype(np.int32), NamedSharding(mesh, P(BATCH_AXES)))

    def run(as_a2a):
        body = lambda b: collectives.gather_small(b, axes, size, as_all_to_all=as_a2a)  # noqa: E731
        f = jax.shard_map(body, mesh=mesh, in_specs=P(BATCH_AXES), out_specs=P(BATCH_AXES), check_vma=False)
        return jax.jit(f), np.asarray(jax.jit(f)(x))

    f_a2a, via_a2a = run(True)
    _, via_gather = run(False)
    np.testing.assert_array_equal(via_a2a, via_gather)
    kinds = {c.kind for c in list_collectives(f_a2a, x, mesh=mesh)}
    assert kinds <= {"all-to-all"}, kinds


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=MESH_IDS)
@pytest.mark.parametrize("a2a", [True, False], ids=["all_to_all", "all_reduce"])
def test_sum_counts_adds_up_every_device(shape, a2a, monkeypatch):
    monkeypatch.setattr(collectives, "prefers_all_to_all", lambda mesh: a2a)
    mesh = jaxscale.make_mesh(*shape)
    rng = np.random.default_rng(sum(shape) + a2a)
    counts = {k: rng.integers(0, 2**20, size=8).astype(np.int32) for k in ("overflow", "invalid_ids", "zeros")}
    counts["zeros"][:] = 0
    placed = {k: jax.device_put(v, NamedSharding(mesh, P(BATCH_AXES))) for k, v in counts.items()}
    f = jax.jit(lambda c: collectives.sum_counts(c, mesh, BATCH_AXES))
    totals = f(placed)
    for k, v in counts.items():
        assert totals[k].dtype == jnp.int32 and totals[k].shape == ()
        assert int(totals[k]) == int(v.sum()), k
    cs = list_collectives(f, placed, mesh=mesh)
    want = "all-to-all" if a2a else "all-reduce"
    assert [c.kind for c in cs] == [want], format_table(cs)  # one collective for all three counts
    if a2a:
        assert cs[0].dtypes[0] == "u32" and cs[0].group_size == 8


def _ids_with_invalid(rng, rows, shape):
    x = rng.integers(0, rows, size=shape).astype(np.int32)
    x[rng.random(shape) < 0.1] = -1  # padding: not counted
    x[rng.random(shape) < 0.05] = rows + 7  # invalid inside jit: counted
    return x


TOPOLOGIES = ["1d", "2d_ar", "2d_a2a"]


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=MESH_IDS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_engine_counters_are_one_small_all_to_all_and_match_the_all_reduce(shape, topology, monkeypatch):
    """lookup + update with stats on CPU: no all-reduce, one tiny u32 all-to-all per counter sum; the same
    overflow and invalid-id totals as the all-reduce path (a small fixed capacity makes overflow happen)."""
    mesh = jaxscale.make_mesh(*shape)
    tables = [
        jaxscale.TableConfig("items", rows=2000, dim=16, pooling="sum"),
        jaxscale.TableConfig("seq", rows=500, dim=16, pooling=None),
    ]
    rng = np.random.default_rng(7)
    host = {"items": _ids_with_invalid(rng, 2000, (64, 6)), "seq": _ids_with_invalid(rng, 500, (64, 4))}
    host["items"][:, 0] = 3  # one hot row: overflows a fixed 0.3 capacity on its owner

    def run(a2a):
        monkeypatch.setattr(collectives, "prefers_all_to_all", lambda mesh: a2a)
        ec = jaxscale.EmbeddingCollection(
            tables, mesh, topology=topology, sharding="row_wise", capacity_factor=0.3, optimizer=jaxscale.SGD(0.1)
        )
        state = ec.init(jax.random.key(0))
        ids = {f: jax.device_put(v, ec.batch_sharding) for f, v in host.items()}  # traced ids: invalid counted

        def step(state, ids):
            emb, lstats = ec.lookup(state, ids, return_stats=True)
            state, ustats = ec.update(state, ids, jax.tree.map(jnp.ones_like, emb), return_stats=True)
            return state, lstats, ustats

        f = jax.jit(step, donate_argnums=0)
        cs = list_collectives(f, ec.abstract_state(), ids, mesh=mesh)
        _, lstats, ustats = f(state, ids)
        run.shards = ec.num_shards
        return cs, {k: int(v) for k, v in {**lstats, **{f"u_{k}": v for k, v in ustats.items()}}.items()}

    cs, via_a2a = run(True)
    _, via_reduce = run(False)
    assert via_a2a == via_reduce
    assert via_a2a["invalid_ids"] > 0
    assert (via_a2a["overflow"] > 0) == (run.shards > 1)  # one shard (2d_ar on 1x8): nothing is exchanged
    table = format_table(cs)
    assert not [c for c in cs if c.kind == "all-reduce" and c.dtypes[0].startswith("s")], table
    counters = [c for c in cs if c.kind == "all-to-all" and c.dtypes[0] == "u32"]
    assert len(counters) == 2 and all(c.group_size == 8 and c.bytes_per_device <= 8 * 2 * 4 for c in counters), table
