"""Planning as a stage of a run: the embedding settings and the sharding plan it executes, decided before
the trainer is built, so the plan that runs is the plan that was scored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jaxscale.engine.cluster import ClusterSpec, known_clusters
from jaxscale.engine.embedding.settings import AUTO_TOPOLOGY, EmbeddingSettings, ReplicaSync
from jaxscale.engine.mesh import has_replicas
from jaxscale.engine.plan import ShardingPlan, resolve_plan
from jaxscale.engine.planner.id_stats import measure_feature_stats
from jaxscale.engine.planner.topology import TopologyChoice, recommend_topology
from jaxscale.engine.tables import TableConfig


def cluster_for(mesh) -> ClusterSpec:
    """The link figures of the config's mesh section: `mesh.cluster` (a preset of meshes/ or a YAML path),
    else the preset named '<nodes>x<local>' when there is one, else `ClusterSpec`'s defaults."""
    nodes, local = mesh.nodes, mesh.local
    if mesh.cluster is not None:
        cluster = ClusterSpec.from_yaml(mesh.cluster)
    elif f"{nodes}x{local}" in known_clusters():
        cluster = ClusterSpec.named(f"{nodes}x{local}")
    else:
        cluster = ClusterSpec(nodes, local)
    if (cluster.nodes, cluster.devices_per_node) != (nodes, local):
        got = f"{cluster.nodes}x{cluster.devices_per_node}"
        raise ValueError(f"mesh.cluster describes a {got} cluster, the mesh is {nodes}x{local}")
    return cluster


def choose_topology(
    cfg, tables: Sequence[TableConfig], sample: Mapping[str, np.ndarray], *, dense_params: int = 0
) -> TopologyChoice:
    """`embedding.topology: auto`: every topology scored with its own balanced plan on the mesh's cluster and
    the statistics of `sample` ({feature: engine ids of a few global batches}), the dense gradient
    all-reduce sharing the links; the fastest wins."""
    nodes, local = cfg.mesh.nodes, cfg.mesh.local
    return recommend_topology(
        tables,
        measure_feature_stats(sample, tables),
        cluster_for(cfg.mesh),
        cfg.train.batch_size // (nodes * local),
        cfg.embedding.comm,
        dense_params=dense_params,
        dense_precision=cfg.train.dense_grad_precision,
    )


def resolve(
    cfg,
    tables: Sequence[TableConfig],
    sample: Mapping[str, np.ndarray] | None = None,
    *,
    dense_params: int = 0,
    log: Callable[[str], None] | None = print,
) -> tuple[EmbeddingSettings, ShardingPlan]:
    """(settings, plan) that a run of `cfg` executes on its mesh.

    - `embedding.topology: auto`: `choose_topology` on `sample` (required); the winner's topology, its exact
      sync strategy (when the config's sync is exact) and the plan it was scored with. Its report goes to `log`.
    - `embedding.plan_file`: that plan (checked against the topology and the mesh by the collection).
    - otherwise: `embedding.sharding` placed on the topology's shard group.
    """
    settings, nodes, local = cfg.embedding, cfg.mesh.nodes, cfg.mesh.local
    if settings.topology == AUTO_TOPOLOGY:
        if sample is None:
            raise ValueError("embedding.topology=auto needs a data sample ({feature: ids}) to plan from")
        choice = choose_topology(cfg, tables, sample, dense_params=dense_params)
        if log is not None:
            log(choice.report())
        sync = settings.replica_sync
        if not has_replicas(choice.topology):
            sync = ReplicaSync()  # nothing to sync
        elif sync.exact and choice.sync is not None and choice.sync.exact:
            sync = choice.sync  # the exact strategy the planner priced
        return settings.replace(topology=choice.topology, replica_sync=sync, plan_file=None), choice.plan
    if settings.plan_file:
        return settings, ShardingPlan.from_file(settings.plan_file)
    return settings, resolve_plan(tables, settings.topology, nodes, local, settings.sharding)
