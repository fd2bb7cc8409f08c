"""Bytes per technique stage: the foundation smoke config's embedding step, compiled per stage on a 2x4 mesh.

The ladder is the project's one ladder, `jaxscale.engine.techniques.STAGES` (each stage adds one technique to
the previous one):

  baseline   1d, fp32 forward / fp32 backward payloads, the config's sharding
  +fp8       fp8 forward (e4m3, per-row scale), bf16 backward
  +balanced  the planner's plan (measured on the batch) instead of one sharding type for every table
  +half_dim  bandwidth-aware item tables: (2 x rows) x (dim / 2)
  2d_ar      2D, all-reduce flavour: tables sharded across nodes, replicas inside a node
  2d_a2a     2D, all-to-all flavour: all-to-alls inside a node, replicas across nodes (exact sync)

`python -m jaxscale.benchmarks.stages bytes SPEC RESULT` is the worker (8 simulated CPU devices) the suite runs.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from jaxscale.benchmarks.sessions import worker_main
from jaxscale.engine.techniques import Stage

WORKER = "jaxscale.benchmarks.stages"  # python -m WORKER bytes SPEC RESULT
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding jaxscale/ (a checkout or site-packages)
FOUNDATION_CONFIG = PACKAGE_ROOT / "jaxscale" / "configs" / "foundation_smoke.yaml"  # shipped in the wheel
MESH = (2, 4)


def technique_stages() -> list[Stage]:
    """The technique ladder, cumulative: the project's one ladder (`jaxscale.engine.techniques.STAGES`)."""
    from jaxscale.engine.techniques import STAGES

    return list(STAGES)


def _foundation_workload(half_dim: bool):
    """(config, tables, host ids of the first synthetic batch) of the foundation smoke config."""
    from jaxscale.training import registry
    from jaxscale.training.config import load_config
    from jaxscale.training.data import make_data

    overrides = [f"mesh.nodes={MESH[0]}", f"mesh.local={MESH[1]}"]
    if half_dim:
        overrides.append("model.foundation.item_reshape=half_dim")
    cfg = load_config(str(FOUNDATION_CONFIG), overrides)
    spec = registry.get(cfg.model.kind)
    host_ids = dict(spec.ids(cfg.model.params, make_data(cfg, split="train").batch(0)))
    return cfg, tuple(spec.tables(cfg.model.params)), host_ids


def _sharding(stage: Stage, cfg, tables, host_ids):
    """The config's sharding, or the planner's plan for the batch (balanced stages)."""
    if not stage.balanced:
        return cfg.embedding.sharding
    from jaxscale.engine import planner
    from jaxscale.engine.cluster import ClusterSpec

    batch = next(iter(host_ids.values())).shape[0]
    devices = MESH[0] * MESH[1]
    stats = planner.measure_feature_stats(host_ids, tables)
    cluster = ClusterSpec(nodes=MESH[0], devices_per_node=MESH[1], device_memory_bytes=1e9)
    per_device = batch // devices
    return planner.plan_sharding(
        tables, stats, cluster, batch_size_per_device=per_device, topology=stage.settings.topology
    )


def stage_settings(stage: Stage) -> dict:
    """What a stage runs, as the flat JSON the report prints (topology, wire precisions, plan, reshape, sync)."""
    s = stage.settings
    return {
        "topology": s.topology,
        "comm_forward": s.comm.forward,
        "comm_backward": s.comm.backward,
        "balanced": stage.balanced,
        "half_dim": stage.half_dim,
        "replica_sync": dataclasses.asdict(s.replica_sync),
    }


def stage_bytes(stage: Stage) -> dict:
    """Bytes per example of the embedding step (lookup, then update with d(loss)/d(emb) = emb), from the
    compiled HLO, split intra-/inter-node. The dense model's all-reduce is the same in every stage and not
    included (`python -m jaxscale.comm_report` shows the whole train step)."""
    import jax

    import jaxscale
    from jaxscale.engine import comm_inspect
    from jaxscale.training import comm_report

    cfg, tables, host_ids = _foundation_workload(stage.half_dim)
    mesh = jaxscale.make_mesh(*MESH, devices=jax.devices()[: MESH[0] * MESH[1]])
    plan = _sharding(stage, cfg, tables, host_ids)
    ec = jaxscale.EmbeddingCollection(tables, mesh, stage.applied_to(cfg.embedding), plan=plan)
    state = ec.init(jax.random.key(0))
    ids = ec.shard_batch(host_ids)

    def step(state, ids):
        return ec.update(state, ids, ec.lookup(state, ids))

    t0 = time.perf_counter()
    collectives = comm_inspect.list_collectives(jax.jit(step, donate_argnums=0), state, ids, mesh=mesh)
    intra = inter = 0.0
    for c in collectives:
        a, b = comm_report.split_bytes(c, MESH)
        intra, inter = intra + a, inter + b
    batch = next(iter(host_ids.values())).shape[0]
    devices = MESH[0] * MESH[1]
    return {
        "stage": stage.name,
        "settings": stage_settings(stage),
        "global_batch": batch,
        "collectives": len(collectives),
        "intra_node_bytes_per_example": intra * devices / batch,
        "inter_node_bytes_per_example": inter * devices / batch,
        "total_bytes_per_example": (intra + inter) * devices / batch,
        "compile_s": time.perf_counter() - t0,
    }


def _bytes_worker(spec: dict) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", MESH[0] * MESH[1])
    wanted = spec.get("stages")
    out = []
    for stage in technique_stages():
        if wanted is None or stage.name in wanted:
            out.append(stage_bytes(stage))
            print(f"[stages] {stage.name}: {out[-1]['total_bytes_per_example']:,.0f} B/example", file=sys.stderr)
    return {
        "stages": out,
        "mesh": list(MESH),
        "config": FOUNDATION_CONFIG.relative_to(PACKAGE_ROOT).as_posix(),
        "jax": jax.__version__,
    }


if __name__ == "__main__":
    sys.exit(worker_main({"bytes": _bytes_worker}))
