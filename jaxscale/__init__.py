"""jaxscale: sharded embeddings and near-linear multi-node training for recommendation models in JAX."""

from jaxscale.embedding import EmbeddingCollection
from jaxscale.mesh import AXES, LOCAL, NODE, TOPOLOGIES, make_mesh
from jaxscale.optimizers import SGD, RowWiseAdagrad
from jaxscale.plan import SHARDING_TYPES, ShardingPlan, TableShards, resolve_plan
from jaxscale.quantization import CommConfig
from jaxscale.tables import TableConfig

__all__ = [
    "EmbeddingCollection", "TableConfig", "SGD", "RowWiseAdagrad", "CommConfig",
    "AXES", "LOCAL", "NODE", "TOPOLOGIES", "make_mesh",
    "SHARDING_TYPES", "ShardingPlan", "TableShards", "resolve_plan",
]
