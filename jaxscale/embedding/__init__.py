"""Sharded embedding tables: `EmbeddingCollection` and its parts.

layout     where every row lives (pure host: pieces, stacks, routes, dense <-> stacked)
ids        host ids: validation, and the batch pytree carrying its exchange capacities
capacity   static buffer sizes: worst case, a fixed factor, or counted from the batch (host)
routing    requests -> owners with static-shape send buffers (rows, and per-bag partial sums)
kernels    per-shard compute: gather, sum per row, the sparse optimizer update
sync       replica sync of 2D topologies (exact: gather / owner; periodic averaging)
state      the state arrays, their shardings, init and dense conversion
collection `EmbeddingCollection`, which runs the above inside one `shard_map`
"""

from jaxscale.embedding.collection import POOLED_COMM_MODES, REPLICA_SYNC_MODES, SYNC_STRATEGIES, EmbeddingCollection
from jaxscale.embedding.ids import PADDING_ID, ShardedIds

__all__ = [
    "EmbeddingCollection",
    "PADDING_ID",
    "POOLED_COMM_MODES",
    "REPLICA_SYNC_MODES",
    "SYNC_STRATEGIES",
    "ShardedIds",
]
