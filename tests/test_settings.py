"""One `EmbeddingSettings`: each check written once, the same value in the API, the config and the stages."""

import itertools
import subprocess
import sys

import numpy as np
import pytest

import jaxscale
from jaxscale.engine.embedding.settings import EmbeddingSettings, ReplicaSync, SettingError
from jaxscale.engine.mesh import AXES, LOCAL, NODE, TOPOLOGIES, TOPOLOGY_AXES, Topology
from jaxscale.engine.techniques import STAGES
from jaxscale.training.config import ConfigError, config_to_dict, load_config


def test_importing_the_settings_and_the_config_imports_no_jax():
    code = (
        "import sys, jaxscale.training.config, jaxscale.engine.embedding.settings, jaxscale.engine.techniques; "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    "override,key",
    [
        ("embedding.topology=3d", "embedding.topology"),
        ("embedding.sharding=diagonal", "embedding.sharding"),
        ("embedding.sharding={items: diagonal}", "embedding.sharding.items"),
        ("embedding.optimizer={kind: adam}", "embedding.optimizer.kind"),
        ("embedding.optimizer={kind: sgd, eps: 0.1}", "embedding.optimizer.eps"),
        ("embedding.optimizer.learning_rate=-1", "embedding.optimizer.learning_rate"),
        ("embedding.comm.forward=fp4", "embedding.comm.forward"),
        ("embedding.capacity_factor=0", "embedding.capacity_factor"),
        ("embedding.reuse_capacities=2", "embedding.reuse_capacities"),
        ("embedding.replica_sync=sometimes", "embedding.replica_sync.mode"),
        ("embedding.replica_sync={mode: exact, every: 4}", "embedding.replica_sync.every"),
        ("embedding.replica_sync={mode: periodic, strategy: owner}", "embedding.replica_sync.strategy"),
        ("embedding.replica_sync={mode: exact, sparse_rows: 3}", "embedding.replica_sync.sparse_rows"),
        ("embedding.replica_sync={mode: periodic, cadence: 3}", "embedding.replica_sync.cadence"),
        ("embedding.replica_sync=periodic", "embedding.replica_sync"),  # topology 1d has no replicas
        ("embedding.pooled_comm=sometimes", "embedding.pooled_comm"),
        ("embedding.sync_every=2", "embedding.sync_every"),
    ],
)
def test_a_bad_setting_is_named_by_its_dotted_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(f"{key}: "), str(e.value)


def test_the_settings_raise_the_field_the_loader_prefixes():
    with pytest.raises(SettingError) as e:
        EmbeddingSettings(replica_sync={"mode": "periodic", "every": 0}, topology="2d_a2a")
    assert e.value.field == "replica_sync.every" and str(e.value).startswith("replica_sync.every: ")


@pytest.mark.parametrize(
    "text,sync",
    [
        ("exact", ReplicaSync()),
        ("periodic", ReplicaSync("periodic", "dense", 1)),
        ("{mode: exact, strategy: gather}", ReplicaSync("exact", "gather")),
        ("{mode: periodic, strategy: sparse, every: 8, sparse_rows: 16}", ReplicaSync("periodic", "sparse", 8, 16)),
    ],
)
def test_replica_sync_yaml_forms(text, sync):
    cfg = load_config(
        None, ["embedding.topology=2d_a2a", f"embedding.replica_sync={text}", "mesh.nodes=2", "mesh.local=4"]
    )
    assert cfg.embedding.replica_sync == sync
    assert sync.exact == (sync.mode == "exact") and sync.sparse == (sync.strategy == "sparse")


def test_config_round_trip_keeps_every_setting():
    overrides = [
        "embedding.topology=2d_ar",
        "embedding.optimizer={kind: sgd, learning_rate: 0.5}",
        "embedding.comm={forward: fp8, backward: bf16}",
        "embedding.capacity_factor=2",
        "embedding.replica_sync={mode: periodic, strategy: sparse, every: 4}",
        "embedding.sharding={items_0: column_wise}",
        "mesh.nodes=2",
        "mesh.local=4",
    ]
    cfg = load_config(None, overrides)
    e = cfg.embedding
    assert e.optimizer == jaxscale.SGD(0.5) and e.capacity_factor == 2.0 and isinstance(e.capacity_factor, float)
    assert e.replica_sync == ReplicaSync("periodic", "sparse", 4) and e.comm == jaxscale.CommConfig("fp8", "bf16")
    tree = config_to_dict(cfg)
    assert tree["embedding"]["optimizer"] == {"kind": "sgd", "learning_rate": 0.5}
    from jaxscale.training.config import config_from_dict

    assert config_from_dict(tree) == cfg
    assert EmbeddingSettings.from_tree(e.to_tree()) == e


def test_stages_hold_settings_and_their_overrides_load_back():
    for st in STAGES:
        cfg = load_config(None, [*st.config_overrides(plan_file="p.json"), "mesh.nodes=2", "mesh.local=4"])
        assert cfg.embedding == st.applied_to(EmbeddingSettings(plan_file="p.json" if st.balanced else None))


def _flat_index(coords: dict, axes: tuple, sizes: dict) -> int:
    """Row-major index of a device's coordinates on `axes` (0 when there are none)."""
    return int(np.ravel_multi_index([coords[a] for a in axes], [sizes[a] for a in axes])) if axes else 0


@pytest.mark.parametrize("name", TOPOLOGIES)
def test_topology_facts_follow_the_axes_table(name):
    """Groups, indices and peers against a brute force over the (node, local) coordinates of each device."""
    shard_axes, replica_axes = TOPOLOGY_AXES[name]
    assert sorted(shard_axes + replica_axes) == sorted(AXES)
    for nodes, local in itertools.product((1, 2, 3, 4), (1, 2, 5, 8)):
        t = Topology(name, nodes, local)
        coords = [dict(zip(AXES, divmod(p, local))) for p in range(nodes * local)]

        sizes = {NODE: nodes, LOCAL: local}
        shard = [_flat_index(c, shard_axes, sizes) for c in coords]
        replica = [_flat_index(c, replica_axes, sizes) for c in coords]
        assert t.shard_of(np.arange(nodes * local)).tolist() == shard
        assert t.replica_of(np.arange(nodes * local)).tolist() == replica
        for r, group in enumerate(t.shard_groups()):
            assert [replica[p] for p in group] == [r] * len(group) and [shard[p] for p in group] == list(
                range(len(group))
            )
        for s, group in enumerate(t.replica_groups()):
            assert [shard[p] for p in group] == [s] * len(group)
        assert t.num_shards * t.num_replicas == nodes * local
        peers = [p for p in range(nodes * local) if replica[p] == replica[0] and p != 0]
        assert t.shard_peers == (sum(p // local == 0 for p in peers), sum(p // local != 0 for p in peers))
        assert (t.num_replicas == 1) == (not replica_axes or (nodes if replica_axes == (NODE,) else local) == 1)


def test_output_dtype_is_what_the_lookup_returns():
    """`output_dtype`: the lookup's outputs in that dtype (the float32 lookup rounded), the tables and their
    update unchanged; a bad value is named by its dotted key."""
    import jax
    import jax.numpy as jnp

    tables = [jaxscale.TableConfig("items", 64, 8), jaxscale.TableConfig("hist", 48, 4, pooling=None)]
    mesh = jaxscale.make_mesh(2, 4)
    rng = np.random.default_rng(0)
    ids = {"items": rng.integers(-1, 64, (16, 3)), "hist": rng.integers(-1, 48, (16, 5))}
    runs = {}
    for dtype in ("float32", "bfloat16"):
        ec = jaxscale.EmbeddingCollection(tables, mesh, EmbeddingSettings(topology="2d_a2a", output_dtype=dtype))
        state = ec.init(jax.random.key(0))
        batch = ec.shard_batch(ids)
        out = ec.lookup(state, batch)
        state = ec.update(state, batch, {f: jnp.ones_like(x) for f, x in out.items()})
        runs[dtype] = out, state["weights"]
    (out32, w32), (out16, w16) = runs["float32"], runs["bfloat16"]
    for f in ids:
        assert out32[f].dtype == jnp.float32 and out16[f].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(out16[f]), np.asarray(out32[f].astype(jnp.bfloat16)))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), w32, w16)
    with pytest.raises(ConfigError, match=r"^embedding\.output_dtype: must be one of"):
        load_config(None, ["embedding.output_dtype=int8"])
    assert load_config(None, ["embedding.output_dtype=bfloat16"]).embedding.output_dtype == "bfloat16"
