"""The small foundation configs whose train steps are compiled (collect.py) or timed (bench_step.py).

The technique stages themselves are `jaxscale.techniques.STAGES` (baseline -> +fp8 -> +balanced ->
+half_dim -> 2d_ar -> 2d_a2a). Compiled configs shard every table row-wise: the engine hashes rows by
modulo, so 'baseline' compiles like '+balanced' minus the precision change (the contiguous layout is
a difference of counts, which the model computes), and the planner's plan for these small row-wise
tables is row-wise too.
"""

from __future__ import annotations

import dataclasses

from jaxscale.techniques import STAGES, Stage

CONFIG = "jaxscale/configs/foundation_smoke.yaml"
CAPACITY_FACTOR = 1.25  # foundation_large.yaml's value: padded all-to-all slots = 1.25 x the uniform share

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


def overrides(stage: Stage, nodes: int, local: int, model: dict = TINY, batch: int = TINY_BATCH) -> list[str]:
    """Config overrides compiling `stage` on a nodes x local mesh with the given small model and global batch."""
    compiled = dataclasses.replace(stage, balanced=False)  # row-wise: see the module docstring
    out = [
        f"mesh.nodes={nodes}",
        f"mesh.local={local}",
        f"train.batch_size={batch}",
        f"embedding.capacity_factor={CAPACITY_FACTOR}",
        *compiled.config_overrides(),
    ]
    return out + [f"model.foundation.{k}={v}" for k, v in model.items()]


def compile_key(stage: Stage) -> tuple:
    """Stages that compile to the same step (balanced vs contiguous differ only in the counts)."""
    return (stage.settings.topology, stage.settings.comm.forward, stage.settings.comm.backward, stage.half_dim)


def distinct_compiled_stages() -> list[Stage]:
    """One stage per compile key, in ladder order."""
    seen, out = set(), []
    for s in STAGES:
        if compile_key(s) not in seen:
            seen.add(compile_key(s))
            out.append(s)
    return out
