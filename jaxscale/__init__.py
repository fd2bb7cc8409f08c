"""jaxscale: sharded embeddings and near-linear multi-node training for recommendation models in JAX.

Names are imported lazily, so the device-free modules (`jaxscale.engine.planner`, `.plan`, `.tables`) load
without JAX.
"""

from jaxscale.infra.lazy import lazy_exports

_EXPORTS = {
    "EmbeddingCollection": "jaxscale.engine.embedding.collection",
    "EmbeddingSettings": "jaxscale.engine.embedding.settings",
    "ReplicaSync": "jaxscale.engine.embedding.settings",
    "TableConfig": "jaxscale.engine.tables",
    "SGD": "jaxscale.engine.optimizers",
    "RowWiseAdagrad": "jaxscale.engine.optimizers",
    "CommConfig": "jaxscale.engine.quantization",
    "AXES": "jaxscale.engine.mesh",
    "LOCAL": "jaxscale.engine.mesh",
    "NODE": "jaxscale.engine.mesh",
    "TOPOLOGIES": "jaxscale.engine.mesh",
    "make_mesh": "jaxscale.engine.mesh",
    "SHARDING_TYPES": "jaxscale.engine.plan",
    "ShardingPlan": "jaxscale.engine.plan",
    "TableShards": "jaxscale.engine.plan",
    "resolve_plan": "jaxscale.engine.plan",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
