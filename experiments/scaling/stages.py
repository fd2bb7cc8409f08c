"""The cumulative ablation stages and the small foundation configs whose train steps are compiled.

Stage order (each adds one technique to the previous one):
  baseline   1d, fp32 forward/backward, contiguous row blocks (TorchRec's naive row-wise layout)
  +fp8       FP8 (e4m3, per-row scale) forward, BF16 backward embedding payloads
  +balanced  planner-balanced, modulo-hashed rows (the engine's layout)
  +half_dim  bandwidth-aware tables: dim/2 x rows*2
  2d_ar      2D, all-reduce-optimised (shard over nodes, replicas inside a node)
  2d_a2a     2D, all-to-all-optimised (shard inside a node, replicas across nodes, exact sync)

The engine always hashes rows by modulo, so 'baseline' and '+fp8' compile exactly like '+balanced' minus
the precision change; the contiguous layout's penalty is its load imbalance (max/mean bytes a shard
serves), which the planner's cost model reports and the scaling model applies to the embedding
all-to-all time (see model.py).
"""

STAGES = [
    ("baseline", dict(topology="1d", fwd="fp32", bwd="fp32", half_dim=False, balanced=False)),
    ("+fp8", dict(topology="1d", fwd="fp8", bwd="bf16", half_dim=False, balanced=False)),
    ("+balanced", dict(topology="1d", fwd="fp8", bwd="bf16", half_dim=False, balanced=True)),
    ("+half_dim", dict(topology="1d", fwd="fp8", bwd="bf16", half_dim=True, balanced=True)),
    ("2d_ar", dict(topology="2d_ar", fwd="fp8", bwd="bf16", half_dim=True, balanced=True)),
    ("2d_a2a", dict(topology="2d_a2a", fwd="fp8", bwd="bf16", half_dim=True, balanced=True)),
]
STAGE_NAMES = [s for s, _ in STAGES]
CONFIG = "experiments/configs/foundation_smoke.yaml"
CAPACITY_FACTOR = 1.25  # foundation_large.yaml's value: padded a2a slots = 1.25 x the uniform share

# A tiny foundation model (compiles in ~30 s on a loaded 2-core CPU) with the large preset's table
# structure: 2 hashed item tables, concatenated, sequence lookups, a strided in-batch negative pool.
TINY = dict(
    item_rows=256,
    item_dim=8,
    item_vocab=100000,
    num_item_tables=2,
    item_combine="concat",
    num_layers=1,
    d_model=8,
    num_heads=1,
    max_seq_len=4,
    time_encoding="none",
    max_negatives=8,
)
TINY_BATCH = 16


def overrides(stage: dict, nodes: int, local: int, tiny: dict = TINY, batch: int = TINY_BATCH) -> list[str]:
    out = [
        f"mesh.nodes={nodes}",
        f"mesh.local={local}",
        f"train.batch_size={batch}",
        f"embedding.topology={stage['topology']}",
        f"embedding.comm_forward={stage['fwd']}",
        f"embedding.comm_backward={stage['bwd']}",
        f"embedding.capacity_factor={CAPACITY_FACTOR}",
    ]
    out += [f"model.foundation.{k}={v}" for k, v in effective_tiny(stage, tiny).items()]
    return out


def effective_tiny(stage: dict, tiny: dict = TINY) -> dict:
    """The compiled model config. FoundationModel cannot train with item_reshape='half_dim' yet (its item
    LayerNorm/Linear expect item_dim x tables features but the engine returns item_dim/2 per table: a
    reshape error at trace time), so +half_dim is compiled as the same engine payload written directly:
    item_dim/2 x item_rows*2 tables (identical all-to-all shapes; the dense input layer is E/2 wide)."""
    if not stage["half_dim"]:
        return dict(tiny)
    return dict(tiny, item_dim=tiny["item_dim"] // 2, item_rows=tiny["item_rows"] * 2)


def compile_key(stage: dict) -> tuple:
    """Stages that compile to the same step (balanced vs contiguous differ only in the cost model)."""
    return (stage["topology"], stage["fwd"], stage["bwd"], stage["half_dim"])
