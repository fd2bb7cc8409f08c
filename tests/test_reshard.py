"""Moving an embedding state between layouts on device, from row-chunked saved blocks (no table gathered)."""

import jax
import numpy as np
import pytest

import jaxscale
from jaxscale.engine.embedding import reshard

TABLES = [
    jaxscale.TableConfig("a", rows=37, dim=16, pooling=None),
    jaxscale.TableConfig("b", rows=64, dim=16, pooling="sum"),
    jaxscale.TableConfig("c", rows=20, dim=8, pooling="mean"),
]
MOVES = [
    (((2, 4), "2d_a2a", "column_wise"), ((1, 8), "1d", "row_wise")),
    (((1, 8), "1d", "table_wise"), ((4, 2), "2d_ar", "column_wise")),
    (((4, 2), "2d_a2a", "row_wise"), ((2, 4), "1d", "table_row_wise")),
    (((2, 4), "2d_ar", "row_wise"), ((2, 4), "2d_a2a", {"a": "column_wise", "b": "table_wise", "c": "row_wise"})),
]


def _collection(layout, **kw):
    shape, topology, sharding = layout
    opt = jaxscale.RowWiseAdagrad(0.1)
    return jaxscale.EmbeddingCollection(
        TABLES,
        jaxscale.make_mesh(*shape),
        jaxscale.EmbeddingSettings(topology=topology, sharding=sharding, optimizer=opt, **kw),
    )


def _chunks(state, mesh):
    """The state's stacks as `Checkpointer` restores them onto another layout: padded and row-chunked."""
    D = mesh.size

    def chunk(x):
        host = np.asarray(x)
        full = reshard.chunked_shape(host.shape, D)
        padded = np.zeros(full, np.float32)
        padded[:, :, : host.shape[2]] = host
        return jax.device_put(padded, reshard.chunk_sharding(mesh, padded.ndim))

    return {k: (jax.tree.map(chunk, v) if k != "step" else v) for k, v in state.items()}


@pytest.mark.parametrize("source,target", MOVES, ids=[f"{s[1]}->{t[1]}" for s, t in MOVES])
def test_reshard_moves_every_row_and_slot(source, target):
    src = _collection(source)
    rng = np.random.default_rng(0)
    dense = {t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in TABLES}
    slots = {"accumulator": {t.name: rng.uniform(0.1, 2, t.rows).astype(np.float32) for t in TABLES}}
    state = src.load_dense(dense, slots, step=5)
    dst = _collection(target)
    chunks = _chunks(state, dst.mesh)
    # each device reads 1/D of every saved block, never a whole table
    for x in jax.tree.leaves(chunks["weights"]):
        shard = x.addressable_shards[0].data
        assert shard.shape[2] * dst.mesh.size == x.shape[2] and shard.shape[2] < x.shape[2]
    out = reshard.reshard(src.layout, chunks, dst.state_spec, step=5)
    for r in range(dst.num_replicas):
        got = dst.to_dense(out, replica=r)
        for n in dense:
            np.testing.assert_array_equal(got[n], dense[n], err_msg=f"replica {r} table {n}")
        acc = dst.slots_to_dense(out, replica=r)["accumulator"]
        for n in dense:
            np.testing.assert_array_equal(acc[n], slots["accumulator"][n])
    assert int(out["step"]) == 5
    # and the moved state trains: a lookup on the new layout returns the rows
    ids = {"a": rng.integers(-1, 37, (16, 3)).astype(np.int32)}
    np.testing.assert_allclose(
        np.asarray(dst.lookup(out, ids)["a"]), np.where(ids["a"][..., None] >= 0, dense["a"][ids["a"]], 0)
    )


def test_diverged_replicas_are_averaged_agreeing_ones_kept_exactly():
    """Periodic sync lets replicas differ between syncs: moving such a state averages them (the sync the next
    step would do); rows whose replicas agree keep their value bit for bit (a mean of 3 equal floats need not)."""
    src = _collection(((4, 2), "2d_a2a", "row_wise"), replica_sync=jaxscale.ReplicaSync("periodic", every=100))
    dst = _collection(((1, 8), "1d", "row_wise"))
    rng = np.random.default_rng(1)
    dense = {t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in TABLES}
    state = src.from_dense(dense)
    # replica 1 of every stack diverges on its first 3 rows
    bumped = {}
    for k, x in state["weights"].items():
        host = np.asarray(x).copy()
        host[1, :, :3] += 1.0
        bumped[k] = jax.device_put(host, x.sharding)
    state = dict(state, weights=bumped)
    reps = [src.to_dense(state, r) for r in range(src.num_replicas)]
    expect = {n: np.mean([rep[n] for rep in reps], axis=0) for n in dense}
    agree = {n: np.all([rep[n] == reps[0][n] for rep in reps], axis=0) for n in dense}
    out = reshard.reshard(src.layout, _chunks(state, dst.mesh), dst.state_spec, step=0)
    got = dst.to_dense(out)
    assert any((~agree[n]).any() for n in dense)
    for n in dense:
        np.testing.assert_allclose(got[n], expect[n], rtol=1e-6)
        np.testing.assert_array_equal(got[n][agree[n]], dense[n][agree[n]])
    assert any(not np.allclose(got[n], dense[n]) for n in dense)
