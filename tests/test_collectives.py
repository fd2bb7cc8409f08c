"""`collectives.gather_small` (the host capacity exchange's gather) on every mesh shape and axis.

On CPU it is one all-to-all (gloo runs all-gather as a ring of dependent rounds); the all-gather is what
other platforms use. Both must give the same rows, in peer order.
"""

import jax
import numpy as np
import pytest
from conftest import MESH_IDS, MESH_SHAPES
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxscale
from jaxscale.engine import collectives
from jaxscale.engine.comm_inspect import list_collectives
from jaxscale.engine.mesh import BATCH_AXES, LOCAL, NODE

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


def test_the_capacity_exchange_executable_is_one_all_to_all_on_cpu():
    """The (process, device) gather the multi-process capacity exchange runs (one process here: its
    'process' axis has size 1, and the compiled module still says which collective it is)."""
    from jaxscale.engine.embedding import collection

    mesh, gather = collection._process_gather_executable()
    assert mesh.axis_names == ("process", "device") and mesh.shape["process"] == jax.process_count()
    x = np.arange(5, dtype=np.int64)
    np.testing.assert_array_equal(collection._process_allgather(x), x[None])
    rows = jax.device_put(x[None], NamedSharding(mesh, P("process")))
    text = gather.lower(rows).compile().as_text()
    assert "all-gather" not in text
    assert collectives.prefers_all_to_all(mesh)


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=MESH_IDS)
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.uint32])
def test_ids_all_to_all_carries_the_sum_of_the_counters(shape, axis, dtype):
    """all_to_all_ids_and_sum = all_to_all_ids + psum of the counters, in one all-to-all and nothing else."""
    mesh = jaxscale.make_mesh(*shape)
    axes = (axis,) if isinstance(axis, str) else axis
    size = int(np.prod([mesh.shape[a] for a in axes]))
    rng = np.random.default_rng(1)
    ids = jax.device_put(
        rng.integers(0, np.iinfo(dtype).max, size=(8 * size, 3, 2)).astype(dtype), NamedSharding(mesh, P(BATCH_AXES))
    )
    counters = jax.device_put(rng.integers(0, 2**26, size=(8, 3)).astype(np.int32), NamedSharding(mesh, P(BATCH_AXES)))
    spec = (P(BATCH_AXES), P(BATCH_AXES))

    def fused(x, c):
        got, sums = collectives.all_to_all_ids_and_sum(x, c[0], axes)
        return got, sums[None]

    def separate(x, c):
        return collectives.all_to_all_ids(x, axes), jax.lax.psum(c[0], axes)[None]

    f = jax.jit(jax.shard_map(fused, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    g = jax.jit(jax.shard_map(separate, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
    (got, sums), (want, want_sums) = f(ids, counters), g(ids, counters)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(sums), np.asarray(want_sums))
    assert [c.kind for c in list_collectives(f, ids, counters, mesh=mesh)] == (["all-to-all"] if size > 1 else [])


def test_ids_all_to_all_and_sum_refuses_float_ids():
    mesh = jaxscale.make_mesh(1, 8)
    body = lambda x: collectives.all_to_all_ids_and_sum(x, jax.numpy.zeros(2, jax.numpy.int32), BATCH_AXES)  # noqa: E731
    f = jax.shard_map(body, mesh=mesh, in_specs=P(BATCH_AXES), out_specs=P(BATCH_AXES), check_vma=False)
    with pytest.raises(TypeError, match="all_to_all_ids_and_sum moves integer ids of at most 32 bits; got float32"):
        jax.eval_shape(f, jax.ShapeDtypeStruct((64, 2), np.float32))
