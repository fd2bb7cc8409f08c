"""jaxscale: sharded embeddings and near-linear multi-node training for recommendation models in JAX.

Names are imported lazily, so device-free modules (`jaxscale.planner`, `jaxscale.plan`, `jaxscale.tables`)
can be used without importing JAX.
"""

import importlib

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

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxscale' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
