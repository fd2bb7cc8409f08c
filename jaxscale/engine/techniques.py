"""The one ladder of cumulative technique stages (pure data, no JAX).

Each stage adds one technique to the previous one; benchmarks, the scaling model, the emulated cluster
and the docs all read this ladder, so they describe the same configurations:

  baseline   1d, fp32 forward / fp32 backward payloads, contiguous row blocks (TorchRec's row-wise)
  +fp8       FP8 forward (e4m3, per-row scale) / BF16 backward payloads (TorchRec's QComms pairing)
  +balanced  the planner's plan (`jaxscale.engine.planner.plan_sharding`) instead of plain row-wise blocks
  +half_dim  bandwidth-aware tables: dim/2 x rows*2 (`item_reshape=half_dim`; the model's `item_up`
             projection restores the item dim after the all-to-all, without communication)
  2d_ar      2D, all-reduce-optimised: tables sharded across nodes, replicas inside a node (exact sync)
  2d_a2a     2D, all-to-all-optimised: tables sharded inside a node, replicas across nodes, synced by
             the recommended strategy (exact, each row's gradient summed by one owner replica)

A stage holds the `EmbeddingSettings` it runs; `Stage.config_overrides()` writes them as dotted overrides
of the training config.
"""

from __future__ import annotations

import dataclasses

from jaxscale.engine.embedding.settings import AUTO_TOPOLOGY, EmbeddingSettings, ReplicaSync
from jaxscale.engine.quantization import CommConfig

HALF_DIM_KEY = "model.foundation.item_reshape"  # the foundation model's bandwidth-aware reshape


@dataclasses.dataclass(frozen=True)
class Stage:
    """One configuration of the ladder.

    Attributes:
      name: the stage's label ('baseline', '+fp8', ...).
      settings: what the engine runs: the stage's topology, wire precisions (`comm`) and replica sync; the
        other fields of `EmbeddingSettings` (optimizer, capacities) are the run's own.
      balanced: the planner's plan; False is plain row-wise with contiguous row blocks (TorchRec's layout;
        the engine itself always hashes rows by modulo, so False only changes what a model predicts).
      half_dim: tables stored as dim/2 x rows*2.
      description: one line for tables.
    """

    name: str
    settings: EmbeddingSettings
    balanced: bool
    half_dim: bool
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.settings, EmbeddingSettings) or self.settings.topology == AUTO_TOPOLOGY:
            raise ValueError(
                f"Stage {self.name!r}: settings must be EmbeddingSettings with a topology, got {self.settings!r}"
            )

    def applied_to(self, base: EmbeddingSettings) -> EmbeddingSettings:
        """A run's settings with this stage's topology, wire precisions and replica sync."""
        s = self.settings
        return base.replace(topology=s.topology, comm=s.comm, replica_sync=s.replica_sync)

    def with_sync(self, replica_sync: ReplicaSync) -> Stage:
        """The same stage with another replica sync (e.g. the one the planner recommends)."""
        return dataclasses.replace(self, settings=self.settings.replace(replica_sync=replica_sync))

    def config_overrides(self, *, plan_file: str | None = None) -> list[str]:
        """Dotted overrides of the training config for this stage: its settings' fields under `embedding.`.

        A balanced stage needs `plan_file`, a JSON `ShardingPlan` the planner made for the run's tables
        and cluster (`ShardingPlan.to_json`); unbalanced stages use plain `row_wise`.
        """
        tree = self.settings.to_tree()
        sync = ", ".join(f"{k}: {'null' if v is None else v}" for k, v in tree["replica_sync"].items())
        out = [
            f"embedding.topology={tree['topology']}",
            f"embedding.comm.forward={tree['comm']['forward']}",
            f"embedding.comm.backward={tree['comm']['backward']}",
            f"embedding.replica_sync={{{sync}}}",
            f"{HALF_DIM_KEY}={'half_dim' if self.half_dim else 'null'}",
        ]
        if self.balanced:
            if plan_file is None:
                raise ValueError(f"stage {self.name!r} is balanced: pass plan_file, the planner's plan as JSON")
            out.append(f"embedding.plan_file={plan_file}")
        else:
            out += ["embedding.sharding=row_wise", "embedding.plan_file=null"]
        return out


def _settings(topology: str, forward: str, backward: str, sync: ReplicaSync | None = None) -> EmbeddingSettings:
    return EmbeddingSettings(topology=topology, comm=CommConfig(forward, backward), replica_sync=sync or ReplicaSync())


OWNER = ReplicaSync("exact", "owner")  # each row's gradient summed by one owner replica
STAGES: tuple[Stage, ...] = (
    Stage("baseline", _settings("1d", "fp32", "fp32"), False, False, "1d, fp32/fp32, row-wise blocks"),
    Stage("+fp8", _settings("1d", "fp8", "bf16"), False, False, "+ FP8 fwd / BF16 bwd payloads"),
    Stage("+balanced", _settings("1d", "fp8", "bf16"), True, False, "+ the planner's plan"),
    Stage("+half_dim", _settings("1d", "fp8", "bf16"), True, True, "+ dim/2 x rows*2 tables"),
    Stage("2d_ar", _settings("2d_ar", "fp8", "bf16", OWNER), True, True, "2D: shard across nodes, replicas in a node"),
    Stage(
        "2d_a2a", _settings("2d_a2a", "fp8", "bf16", OWNER), True, True, "2D: shard in a node, replicas across nodes"
    ),
)
STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)


def stage(name: str) -> Stage:
    """The stage called `name`."""
    for s in STAGES:
        if s.name == name:
            return s
    raise ValueError(f"unknown stage {name!r}; stages: {STAGE_NAMES}")
