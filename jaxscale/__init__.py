"""jaxscale: sharded embeddings and near-linear multi-node training for recommendation models in JAX.

Names are imported lazily, so device-free modules (`jaxscale.planner`, `jaxscale.plan`, `jaxscale.tables`)
can be used without importing JAX.
"""

from jaxscale.lazy import lazy_exports

_EXPORTS = {
    "EmbeddingCollection": "jaxscale.embedding.collection",
    "EmbeddingSettings": "jaxscale.embedding.settings",
    "ReplicaSync": "jaxscale.embedding.settings",
    "TableConfig": "jaxscale.tables",
    "SGD": "jaxscale.optimizers",
    "RowWiseAdagrad": "jaxscale.optimizers",
    "CommConfig": "jaxscale.quantization",
    "AXES": "jaxscale.mesh",
    "LOCAL": "jaxscale.mesh",
    "NODE": "jaxscale.mesh",
    "TOPOLOGIES": "jaxscale.mesh",
    "make_mesh": "jaxscale.mesh",
    "SHARDING_TYPES": "jaxscale.plan",
    "ShardingPlan": "jaxscale.plan",
    "TableShards": "jaxscale.plan",
    "resolve_plan": "jaxscale.plan",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
