"""The one ladder of cumulative technique stages (pure data, no JAX).

Each stage adds one technique to the previous one; benchmarks, the scaling model, the emulated cluster
and the docs all read this ladder, so they describe the same configurations:

  baseline   1d, fp32 forward / fp32 backward payloads, contiguous row blocks (TorchRec's row-wise)
  +fp8       FP8 forward (e4m3, per-row scale) / BF16 backward payloads (TorchRec's QComms pairing)
  +balanced  the planner's plan (`jaxscale.planner.plan_sharding`) instead of plain row-wise blocks
  +half_dim  bandwidth-aware tables: dim/2 x rows*2 (`item_reshape=half_dim`; the model's `item_up`
             projection restores the item dim after the all-to-all, without communication)
  2d_ar      2D, all-reduce-optimised: tables sharded across nodes, replicas inside a node (exact sync)
  2d_a2a     2D, all-to-all-optimised: tables sharded inside a node, replicas across nodes, synced by
             the recommended strategy (exact, each row's gradient summed by one owner replica)

`Stage.config_overrides()` turns a stage into dotted overrides of the training config.
"""

from __future__ import annotations

import dataclasses

from jaxscale.mesh import TOPOLOGIES
from jaxscale.quantization import PRECISIONS

SYNC_MODES = ("exact", "periodic")
SYNC_STRATEGIES = ("owner", "gather", "dense", "sparse")
# The training-config keys a stage sets (one place to change when the config's layout changes).
CONFIG_KEYS = {
    "topology": "embedding.topology",
    "comm_forward": "embedding.comm.forward",
    "comm_backward": "embedding.comm.backward",
    "half_dim": "model.foundation.item_reshape",  # the foundation model's bandwidth-aware reshape
    "sharding": "embedding.sharding",
    "plan_file": "embedding.plan_file",
    "replica_sync": "embedding.replica_sync",
    "sync_every": "embedding.sync_every",
    "sync_strategy": "embedding.sync_strategy",
}


@dataclasses.dataclass(frozen=True)
class Stage:
    """One configuration of the ladder.

    Attributes:
      name: the stage's label ('baseline', '+fp8', ...).
      topology: '1d' | '2d_ar' | '2d_a2a'.
      comm_forward / comm_backward: wire precisions of the embedding payloads.
      balanced: the planner's plan; False is plain row-wise with contiguous row blocks (TorchRec's layout;
        the engine itself always hashes rows by modulo, so False only changes what a model predicts).
      half_dim: tables stored as dim/2 x rows*2.
      replica_sync: 'exact' | 'periodic' (2D only; None for 1d).
      sync_strategy: 'owner' | 'gather' for exact, 'dense' | 'sparse' for periodic (None for 1d).
      sync_every: k of the periodic sync (1 for exact).
      description: one line for tables.
    """

    name: str
    topology: str
    comm_forward: str
    comm_backward: str
    balanced: bool
    half_dim: bool
    replica_sync: str | None = None
    sync_strategy: str | None = None
    sync_every: int = 1
    description: str = ""

    def __post_init__(self):
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"Stage {self.name!r}: topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        for field in ("comm_forward", "comm_backward"):
            if getattr(self, field) not in PRECISIONS:
                raise ValueError(f"Stage {self.name!r}: {field} must be one of {PRECISIONS}")
        if (self.topology == "1d") != (self.replica_sync is None):
            raise ValueError(f"Stage {self.name!r}: replica_sync is set exactly when the topology has replicas")
        if self.replica_sync is not None and self.replica_sync not in SYNC_MODES:
            raise ValueError(f"Stage {self.name!r}: replica_sync must be one of {SYNC_MODES}")
        if self.replica_sync is not None and self.sync_strategy not in SYNC_STRATEGIES:
            raise ValueError(f"Stage {self.name!r}: sync_strategy must be one of {SYNC_STRATEGIES}")
        if not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"Stage {self.name!r}: sync_every must be a positive integer")
        if self.replica_sync == "exact" and self.sync_every != 1:
            raise ValueError(f"Stage {self.name!r}: exact sync runs every step (sync_every=1)")

    def with_sync(self, replica_sync: str, sync_strategy: str, sync_every: int = 1) -> Stage:
        """The same stage with another replica sync (e.g. the one the planner recommends)."""
        return dataclasses.replace(self, replica_sync=replica_sync, sync_strategy=sync_strategy, sync_every=sync_every)

    def config_overrides(self, *, plan_file: str | None = None) -> list[str]:
        """Dotted overrides of the training config for this stage.

        A balanced stage needs `plan_file`, a JSON `ShardingPlan` the planner made for the run's tables
        and cluster (`ShardingPlan.to_json`); unbalanced stages use plain `row_wise`. An exact sync sets the
        engine's `sync_strategy`; a sparse periodic sync is the engine's `replica_sync=periodic_sparse`.
        """
        k = CONFIG_KEYS
        out = [
            f"{k['topology']}={self.topology}",
            f"{k['comm_forward']}={self.comm_forward}",
            f"{k['comm_backward']}={self.comm_backward}",
            f"{k['half_dim']}={'half_dim' if self.half_dim else 'null'}",
        ]
        if self.balanced:
            if plan_file is None:
                raise ValueError(f"stage {self.name!r} is balanced: pass plan_file, the planner's plan as JSON")
            out.append(f"{k['plan_file']}={plan_file}")
        else:
            out += [f"{k['sharding']}=row_wise", f"{k['plan_file']}=null"]
        if self.replica_sync is not None:
            mode = "periodic_sparse" if self.replica_sync == "periodic" and self.sync_strategy == "sparse" else None
            out += [f"{k['replica_sync']}={mode or self.replica_sync}", f"{k['sync_every']}={self.sync_every}"]
            if self.replica_sync == "exact" and self.sync_strategy is not None:
                out.append(f"{k['sync_strategy']}={self.sync_strategy}")
        return out


STAGES: tuple[Stage, ...] = (
    Stage(
        "baseline", "1d", "fp32", "fp32", balanced=False, half_dim=False, description="1d, fp32/fp32, row-wise blocks"
    ),
    Stage("+fp8", "1d", "fp8", "bf16", balanced=False, half_dim=False, description="+ FP8 fwd / BF16 bwd payloads"),
    Stage("+balanced", "1d", "fp8", "bf16", balanced=True, half_dim=False, description="+ the planner's plan"),
    Stage("+half_dim", "1d", "fp8", "bf16", balanced=True, half_dim=True, description="+ dim/2 x rows*2 tables"),
    Stage(
        "2d_ar",
        "2d_ar",
        "fp8",
        "bf16",
        balanced=True,
        half_dim=True,
        replica_sync="exact",
        sync_strategy="owner",
        description="2D: shard across nodes, replicas in a node",
    ),
    Stage(
        "2d_a2a",
        "2d_a2a",
        "fp8",
        "bf16",
        balanced=True,
        half_dim=True,
        replica_sync="exact",
        sync_strategy="owner",
        description="2D: shard in a node, replicas across nodes",
    ),
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)


def stage(name: str) -> Stage:
    """The stage called `name`."""
    for s in STAGES:
        if s.name == name:
            return s
    raise ValueError(f"unknown stage {name!r}; stages: {STAGE_NAMES}")
