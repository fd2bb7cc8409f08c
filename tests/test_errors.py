"""Bad input to the engine gets a clear error that names the problem (never an XLA crash or garbage)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale
from jaxscale.engine.embedding.ids import ShardedIds

T = [
    jaxscale.TableConfig("items", rows=100, dim=8, pooling="sum", features=("a", "b")),
    jaxscale.TableConfig("seq", rows=50, dim=8, pooling=None),
]


@pytest.fixture(scope="module")
def ec():
    return jaxscale.EmbeddingCollection(
        T, jaxscale.make_mesh(2, 4), jaxscale.EmbeddingSettings(optimizer=jaxscale.SGD(0.1))
    )


@pytest.fixture(scope="module")
def state(ec):
    return ec.init(jax.random.key(0))


def ids(B=8, L=3, **over):
    x = {"a": np.zeros((B, L), np.int32), "b": np.ones((B, L), np.int32), "seq": np.zeros((B, L), np.int32)}
    x.update(over)
    return x


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="", rows=1, dim=1), "name"),
        (dict(name="t", rows=0, dim=4), r"rows must be a positive integer"),
        (dict(name="t", rows=-5, dim=4), r"rows must be a positive integer"),
        (dict(name="t", rows=10, dim=0), r"dim must be a positive integer"),
        (dict(name="t", rows=10.5, dim=4), r"rows must be a positive integer"),
        (dict(name="t", rows=10, dim=4, pooling="max"), r"pooling must be one of"),
        (dict(name="t", rows=10, dim=4, features=("x", "x")), r"features has duplicates"),
        (dict(name="t", rows=10, dim=5, reshape="half_dim"), r"even dim"),
    ],
)
def test_bad_table_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxscale.TableConfig(**kwargs)


def test_two_tables_one_name_and_shared_feature():
    mesh = jaxscale.make_mesh(1, 8)
    with pytest.raises(ValueError, match="two tables are named 't'"):
        jaxscale.EmbeddingCollection([jaxscale.TableConfig("t", 10, 8), jaxscale.TableConfig("t", 10, 8)], mesh)
    with pytest.raises(ValueError, match="feature 'f' is read by two tables"):
        jaxscale.EmbeddingCollection(
            [jaxscale.TableConfig("t", 10, 8, features=("f",)), jaxscale.TableConfig("u", 10, 8, features=("f",))], mesh
        )


def test_mesh_that_does_not_fit_the_devices():
    with pytest.raises(ValueError, match=r"nodes \* local = 3 \* 4 = 12 does not match the 8 available devices"):
        jaxscale.make_mesh(3, 4)
    with pytest.raises(ValueError, match="local must be a positive integer"):
        jaxscale.make_mesh(8, 0)


def test_impossible_topology_and_sharding_combinations():
    mesh = jaxscale.make_mesh(2, 4)
    with pytest.raises(ValueError, match="topology: must be one of"):
        jaxscale.EmbeddingCollection(T, mesh, jaxscale.EmbeddingSettings(topology="3d"))
    with pytest.raises(ValueError, match="table_row_wise needs topology '1d'"):
        jaxscale.EmbeddingCollection(T, mesh, jaxscale.EmbeddingSettings(topology="2d_a2a", sharding="table_row_wise"))
    with pytest.raises(ValueError, match="column_wise splits dim 12 over 8 shards"):
        jaxscale.EmbeddingCollection(
            [jaxscale.TableConfig("t", 100, 12)], mesh, jaxscale.EmbeddingSettings(sharding="column_wise")
        )
    with pytest.raises(ValueError, match="row_wise over 8 shards needs at least 8 rows"):
        jaxscale.EmbeddingCollection(
            [jaxscale.TableConfig("t", 5, 8)], mesh, jaxscale.EmbeddingSettings(sharding="row_wise")
        )
    with pytest.raises(ValueError, match="sharding: must be one of"):
        jaxscale.EmbeddingCollection(T, mesh, jaxscale.EmbeddingSettings(sharding="diagonal"))
    with pytest.raises(ValueError, match="unknown tables"):
        jaxscale.EmbeddingCollection(T, mesh, jaxscale.EmbeddingSettings(sharding={"nope": "row_wise"}))
    with pytest.raises(ValueError, match="^mode: must be one of"):
        jaxscale.ReplicaSync("sometimes")
    with pytest.raises(ValueError, match="^replica_sync.mode: must be one of"):
        jaxscale.EmbeddingSettings(replica_sync="sometimes")
    with pytest.raises(ValueError, match="^replica_sync: 'periodic dense k=1' needs replicas"):
        jaxscale.EmbeddingSettings(topology="1d", replica_sync="periodic")
    with pytest.raises(ValueError, match="capacity_factor"):
        jaxscale.EmbeddingCollection(T, mesh, jaxscale.EmbeddingSettings(capacity_factor=-1))
    with pytest.raises(ValueError, match="^optimizer: must be a mapping with a 'kind'"):
        jaxscale.EmbeddingSettings(optimizer="adam")
    with pytest.raises(ValueError, match="topology 'auto' is chosen by the planner"):
        jaxscale.EmbeddingCollection(T, mesh, jaxscale.EmbeddingSettings(topology="auto"))
    with pytest.raises(TypeError, match="settings must be a jaxscale.EmbeddingSettings"):
        jaxscale.EmbeddingCollection(T, mesh, {"topology": "1d"})
    with pytest.raises(ValueError, match="learning_rate"):
        jaxscale.RowWiseAdagrad(-1.0)


def test_plan_for_another_mesh_is_refused():
    plan = jaxscale.resolve_plan(T, "1d", 1, 8, "row_wise")
    with pytest.raises(ValueError, match="plan was made for 8 shards but topology '1d' on a 4x1 mesh has 4"):
        jaxscale.EmbeddingCollection(T, jaxscale.make_mesh(4, 1, devices=jax.devices()[:4]), plan=plan)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(a=np.full((8, 3), 100, np.int32)), r"feature 'a' \(table 'items', 100 rows\): id 100 is out of range"),
        (dict(a=np.full((8, 3), -2, np.int32)), r"id -2 is out of range"),
        (dict(a=np.full((8, 3), 0.5)), r"cannot be converted to int32 without loss"),
        (dict(a=np.full((8, 3), np.nan)), r"NaN or Inf"),
        (dict(a=np.full((8, 3), 2**40, np.int64)), r"cannot be converted to int32 without loss"),
        (dict(a=np.array([["x"] * 3] * 8)), r"ids must be integers"),
        (
            dict(a=np.zeros((4, 3), np.int32)),
            r"feature 'a' has batch size 4 but feature 'b' has 8|feature 'b' has batch size 8 but feature 'a' has 4",
        ),
        (dict(a=np.zeros((8, 3, 2), np.int32)), r"must be \[B\] or \[B, L\]"),
        (dict(zzz=np.zeros((8, 3), np.int32)), r"features \['zzz'\] have no table"),
    ],
)
def test_bad_ids_are_refused(ec, state, bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ec.lookup(state, ids(**bad))


@pytest.mark.parametrize("shape", [(8, 2, 2), (8, 3, 1, 1), ()])
def test_ids_of_another_rank_are_refused_by_shard_batch_and_lookup(ec, state, shape):
    """[B, L] or [B] only: a 3-D batch into a pooled table must not come back as a silently reshaped lookup."""
    bad = np.zeros(shape, np.int32)
    with pytest.raises(ValueError, match=r"feature 'a': ids must be \[B\] or \[B, L\], got shape"):
        ec.shard_batch({"a": bad})
    with pytest.raises(ValueError, match=r"feature 'a': ids must be \[B\] or \[B, L\], got shape"):
        ec.shard_batch({"a": bad, "label": np.zeros(8, np.float32)})  # a mixed batch is checked too
    if shape:
        placed = jax.device_put(bad, ec.batch_sharding)  # already global arrays: the lookup checks them
        with pytest.raises(ValueError, match=r"feature 'a': ids must be \[B\] or \[B, L\], got shape"):
            ec.lookup(state, {"a": placed})
        with pytest.raises(ValueError, match=r"feature 'a': ids must be \[B\] or \[B, L\]"):
            jax.jit(ec.lookup)(state, {"a": placed})


def test_float_arrays_under_a_features_name_are_not_ids(ec):
    """Gradients or targets keyed by feature name ([B, L, dim] floats) are placed, not read as ids."""
    grads = {"seq": np.ones((8, 3, 8), np.float32)}
    placed = ec.shard_batch(grads)
    assert not isinstance(placed, ShardedIds) and placed["seq"].shape == (8, 3, 8)


def test_one_id_per_example_is_a_batch_of_length_one(ec, state):
    flat = np.arange(8, dtype=np.int32)
    sharded = ec.shard_batch({"a": flat, "seq": flat})
    assert isinstance(sharded, ShardedIds) and sharded["a"].shape == (8, 1)
    out = ec.lookup(state, sharded)
    np.testing.assert_array_equal(np.asarray(out["a"]), np.asarray(ec.lookup(state, {"a": flat[:, None]})["a"]))
    assert out["seq"].shape == (8, 1, 8)


def test_batch_not_divisible_by_devices(ec, state):
    with pytest.raises(ValueError, match="batch size 6 is not divisible by the 8 devices"):
        ec.lookup(state, ids(B=6))


def test_lossless_conversions_are_accepted(ec, state):
    base = ec.lookup(state, ids())
    out = ec.lookup(state, ids(a=np.zeros((8, 3), np.int64), b=np.ones((8, 3), np.float64)))
    np.testing.assert_array_equal(np.asarray(out["a"]), np.asarray(base["a"]))
    np.testing.assert_array_equal(np.asarray(out["b"]), np.asarray(base["b"]))


def test_invalid_ids_inside_jit_are_padding_and_counted(ec, state):
    """The documented in-jit policy: out-of-range ids act as padding and are counted, never UB."""
    good = ec.shard_batch(ids())
    bad = dict(good, a=ec.shard_batch({"a": np.array([[0, 100, -7]] * 8, np.int32)})["a"])
    out, stats = jax.jit(lambda s, i: ec.lookup(s, i, return_stats=True))(state, bad)
    assert int(stats["invalid_ids"]) == 16
    dense = ec.to_dense(state)["items"]
    np.testing.assert_allclose(np.asarray(out["a"]), np.tile(dense[0], (8, 1)), rtol=1e-6)


def test_from_dense_shape_and_names(ec):
    with pytest.raises(ValueError, match=r"table 'items' has shape \(100, 4\), expected \(100, 8\)"):
        ec.from_dense({"items": np.zeros((100, 4)), "seq": np.zeros((50, 8))})
    with pytest.raises(ValueError, match=r"missing tables \['seq'\]"):
        ec.from_dense({"items": np.zeros((100, 8))})


def test_update_needs_every_gradient(ec, state):
    x = ids()
    with pytest.raises(ValueError, match=r"no gradient for features \['seq'\]"):
        ec.update(state, x, {"a": jnp.zeros((8, 8)), "b": jnp.zeros((8, 8))})
