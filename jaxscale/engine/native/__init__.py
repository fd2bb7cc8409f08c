"""Native fused CPU kernels for embedding lookups and sparse optimizers, through `jax.ffi`.

    from jaxscale.engine import native
    out = native.gather_pool(table, ids, pooling="sum")                       # [b, w]
    table, acc = native.update_pooled(table, acc, ids, grad_out, pooling="sum",
                                      optimizer="rowwise_adagrad", learning_rate=0.01, eps=1e-8)

The C++ source ships with the package and is compiled on first use with the system compiler into a cache
(see `jaxscale.engine.native.build`); JAXSCALE_NATIVE=auto|0|1 chooses between it and the pure-JAX kernels (see
`jaxscale.engine.native.runtime`). `python -m jaxscale.engine.native` builds the library and prints its status.
"""

from jaxscale.engine.native.ops import (
    gather_pool,
    gather_rows,
    gather_segment_sum,
    rank_within_owner,
    slot_bags,
    update_pooled,
    update_rows,
    update_rows_indexed,
)
from jaxscale.engine.native.runtime import NativeUnavailableError, available, library_path, mode, unavailable_reason

__all__ = [
    "NativeUnavailableError",
    "available",
    "gather_pool",
    "gather_rows",
    "gather_segment_sum",
    "library_path",
    "mode",
    "rank_within_owner",
    "slot_bags",
    "unavailable_reason",
    "update_pooled",
    "update_rows",
    "update_rows_indexed",
]
