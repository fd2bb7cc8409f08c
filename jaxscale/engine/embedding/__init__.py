"""Sharded embedding tables: `EmbeddingCollection` and its parts.

settings   every setting of a collection in one frozen value (no JAX: the config loads it device-free)
layout     where every row lives (pure host: pieces, stacks, routes, dense <-> stacked)
ids        host ids: validation, and the batch pytree carrying its exchange capacities
capacity   static buffer sizes: worst case, a fixed factor, or counted from the batch (host)
routing    requests -> owners with static-shape send buffers (rows, and per-bag partial sums)
kernels    per-shard compute: gather, sum per row, the sparse optimizer update
sync       replica sync of 2D topologies (exact: gather / owner; periodic averaging)
state      the state arrays, their shardings, init and dense conversion
collection `EmbeddingCollection`, which runs the above inside one `shard_map`

Names are imported lazily, so `jaxscale.engine.embedding.settings` loads without JAX.
"""

from jaxscale.infra.lazy import lazy_exports

_EXPORTS = {
    "EmbeddingCollection": "jaxscale.engine.embedding.collection",
    "EmbeddingSettings": "jaxscale.engine.embedding.settings",
    "ReplicaSync": "jaxscale.engine.embedding.settings",
    "PADDING_ID": "jaxscale.engine.embedding.ids",
    "ShardedIds": "jaxscale.engine.embedding.ids",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
