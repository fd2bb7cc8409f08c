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
from jaxscale import collectives
from jaxscale.comm_inspect import list_collectives
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


def test_the_capacity_exchange_executable_is_one_all_to_all_on_cpu():
    """The (process, device) gather the multi-process capacity exchange runs (one process here: its
    'process' axis has size 1, and the compiled module still says which collective it is)."""
    from jaxscale.embedding import collection

    mesh, gather = collection._process_gather_executable()
    assert mesh.axis_names == ("process", "device") and mesh.shape["process"] == jax.process_count()
    x = np.arange(5, dtype=np.int64)
    np.testing.assert_array_equal(collection._process_allgather(x), x[None])
    rows = jax.device_put(x[None], NamedSharding(mesh, P("process")))
    text = gather.lower(rows).compile().as_text()
    assert "all-gather" not in text
    assert collectives.prefers_all_to_all(mesh)
