"""One 'node' of the emulated cluster: times the real compiled train step, unlimited and rate-limited.

Run by emulate.sh inside a network namespace, one process per namespace:
    python experiments/scaling/bench_step.py --stage 2d_a2a --nodes 4 --local 2 --process-id I \
        --coordinator 10.200.0.1:23456 --dev vethI --rate 4mbit --steps 32

`--stage` is a stage of `jaxscale.engine.techniques` or a periodic-sync variant '<stage>@periodic:<strategy>:<k>'
(e.g. '2d_a2a@periodic:dense:4'). Balanced stages get the planner's plan for the emulated tables, made from
the same synthetic global batch on every process. Phase A removes any qdisc from this namespace's veth
(unlimited); phase B installs `tc tbf` at --rate on it (each node limits its own egress, so every
cross-node byte is limited once). Both phases time the same compiled step: 2 warm-up steps, then
--steps timed steps. Process 0 prints one JSON line: the stage, the compiled bytes per collective
category, the measured means and medians, the bytes node 0's veth really carried (kernel counters), every
collective with its cross-node bytes, and the predicted delta of the limited phase by the exchange rule
(sent + received over the rate); emulation_report.py also predicts it with the transport factors
gloo_duplex.py measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from jaxscale.studies.link_emulation import bytes_by_category, predicted_delta, tbf_burst
from jaxscale.studies.scaling_model import stage_from_spec as parse_stage

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# A small foundation model whose step is dominated by embedding payloads on a slow link: sequence lookups
# of 64 events into 2 tables of 64-dim rows, 8 sequences per device; a 1-layer d_model-16 transformer.
EMU_MODEL = dict(
    item_rows=8192,
    item_dim=64,
    item_vocab=100000,
    num_item_tables=2,
    item_combine="concat",
    num_layers=1,
    d_model=16,
    num_heads=1,
    max_seq_len=64,
    time_encoding="none",
    max_negatives=64,
)
EMU_BATCH_PER_DEVICE = 8
TBF_QUEUE = "16mb"  # a deep queue: no packet is dropped (a drop costs a TCP timeout, not bandwidth)


def timed_steps(st, steps: int) -> int:
    """Timed steps per phase: `steps`, and for a periodic sync every k steps at least 8 periods, a whole
    number of them (the mean then weighs the sync step as the run does, with a standard error over 8+)."""
    if st.settings.replica_sync.mode != "periodic":
        return steps
    k = st.settings.replica_sync.every
    return max(steps, 8 * k) // k * k


def tc(dev: str, rate: str | None) -> None:
    subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if rate:
        tbf = ["tbf", "rate", rate, "burst", str(tbf_burst(rate)), "limit", TBF_QUEUE]
        subprocess.run(["tc", "qdisc", "replace", "dev", dev, "root", *tbf], check=True)


def wire_bytes_counters(dev: str) -> tuple[int, int]:
    """(bytes sent, bytes received) on the node's veth so far, headers included (kernel counters)."""
    stats = f"/sys/class/net/{dev}/statistics"
    with open(f"{stats}/tx_bytes") as tx, open(f"{stats}/rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def plan_file_for(st, cfg, nodes: int, local: int) -> str | None:
    """The planner's plan for a balanced stage, from the run's first synthetic global batch (every process
    makes the same one), written to a temp file."""
    if not st.balanced:
        return None
    from jaxscale.engine import planner
    from jaxscale.engine.cluster import ClusterSpec
    from jaxscale_models.foundation import foundation_ids, foundation_tables
    from jaxscale_models.foundation_data import SyntheticFoundationData

    f = dataclasses.replace(cfg.model.foundation, item_reshape="half_dim" if st.half_dim else None)
    batch = SyntheticFoundationData(f, cfg.train.batch_size, seed=cfg.data.seed).batch(0)
    tables = foundation_tables(f)
    stats = planner.measure_feature_stats(foundation_ids(f, batch), tables)
    plan = planner.plan_sharding(
        tables, stats, ClusterSpec(nodes, local), cfg.train.batch_size // (nodes * local), topology=st.settings.topology
    )
    fd, path = tempfile.mkstemp(prefix="jaxscale_emu_plan_", suffix=".json")
    with os.fdopen(fd, "w") as out:
        out.write(plan.to_json())
    return path


def build_config(st, nodes: int, local: int, batch_per_device: int):
    from jaxscale.studies.scaling_model import CONFIG
    from jaxscale.studies.scaling_model import compiled_overrides as overrides
    from jaxscale.training.config import load_config

    base = overrides(dataclasses.replace(st, balanced=False), nodes, local, EMU_MODEL, batch_per_device * nodes * local)
    # capacity_factor null: every exchange and the exact replica sync are sized for the batch they carry,
    # counted on the host (the engine the model's counts describe), not fixed slot-padded shapes
    extra = ["train.overflow_policy=grow", "train.warmup_steps=1", "embedding.capacity_factor=null"]
    cfg = load_config(CONFIG, base + extra)
    plan = plan_file_for(st, cfg, nodes, local)
    if plan is not None:
        cfg = load_config(CONFIG, base + extra + [f"embedding.plan_file={plan}"])
    return cfg, plan


def step_collectives(trainer, st) -> list[dict]:
    """Every collective of the compiled step: kind, device group ('node': one device per node, 'all',
    'local': inside a node), category, bytes per device (intra, inter) and how often it runs per step
    (a periodic sync: 1/k)."""
    from jaxscale.training.comm_report import categorize, group_layout, replica_groups, split_bytes

    shape = tuple(trainer.mesh.devices.shape)
    reps = replica_groups(trainer.ec.topology)
    # the dense gradients: the largest all-reduce outside the replica groups (a periodic sync is larger)
    reduces = [c for c in trainer.collectives if c.kind == "all-reduce" and categorize(c, reps) != "replica_sync"]
    largest = max(reduces, key=lambda c: c.result_bytes).name if reduces else None
    out = []
    for c in trainer.collectives:
        intra, inter = split_bytes(c, shape)
        cat = categorize(c, reps, largest)
        k, m, _ = group_layout(c.groups[0], shape) if c.groups else (1, 1, None)
        group = "local" if k == 1 else ("node" if m == 1 else "all")
        per_step = 1 / st.settings.replica_sync.every if cat == "replica_sync" else 1.0
        out.append(
            {"kind": c.kind, "group": group, "category": cat, "intra": intra, "inter": inter, "per_step": per_step,
             "operands": len(c.shapes)}  # XLA:CPU runs a tuple all-reduce as one ring per operand
        )  # fmt: skip
    return out


def print_config(st, nodes: int, local: int, batch_per_device: int) -> int:
    """The setup a run of `st` would use, as one JSON line (the temp plan file is read, then removed)."""
    cfg, path = build_config(st, nodes, local, batch_per_device)
    plan = None
    if path is not None:
        with open(path) as f:
            plan = json.load(f)
        os.remove(path)
    e = cfg.embedding
    out = {"stage": st.name, "topology": e.topology, "sharding": e.sharding, "plan_file": e.plan_file, "plan": plan}
    print(json.dumps(out))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", required=True)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--batch-per-device", type=int, default=EMU_BATCH_PER_DEVICE)
    p.add_argument("--process-id", type=int)
    p.add_argument("--coordinator")
    p.add_argument("--dev")
    p.add_argument("--rate", default="4mbit")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--delay-ms", type=float, default=0.0, help="recorded only: the link's one-way delay")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="only build the stage's config (and plan), print it as JSON and exit: no cluster needed",
    )
    a = p.parse_args(argv)
    st = parse_stage(a.stage)
    if a.print_config:
        return print_config(st, a.nodes, a.local, a.batch_per_device)
    single = a.nodes == 1
    if single:
        a.process_id = 0  # one node: no cluster, no link, the unlimited phase only
    missing = [f"--{k.replace('_', '-')}" for k in ("process_id", "coordinator", "dev") if getattr(a, k) is None]
    if missing and not single:
        p.error(f"{', '.join(missing)} required (one process per emulated node)")
    steps = timed_steps(st, a.steps)

    from jaxscale.infra import distributed

    if single:
        distributed.initialize(local_devices=a.local)
    else:
        distributed.initialize(a.coordinator, a.nodes, a.process_id, local_devices=a.local)
    import jax
    from jax.experimental import multihost_utils

    from jaxscale.training.trainer import Trainer

    cfg, plan = build_config(st, a.nodes, a.local, a.batch_per_device)
    trainer = Trainer(cfg, progress=False, log=False)
    state = trainer.init_state()
    batches = [trainer.batch(i) for i in range(4)]
    t0 = time.perf_counter()
    trainer.compile(state, batches[0])
    compile_s = time.perf_counter() - t0
    collectives = step_collectives(trainer, st)
    by_cat = bytes_by_category(collectives)

    def timed(n):
        nonlocal state
        times = []
        for i in range(n + 2):
            t = time.perf_counter()
            state, metrics = trainer.train_step(state, batches[i % 4])
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - t)
        return times[2:]

    timed(len(batches))  # every batch's shapes compiled (exact counts: a batch may size its buffers anew)
    out, wire = {}, {}
    phases = (("unlimited", None),) if single else (("unlimited", None), ("limited", a.rate))
    for phase, rate in phases:
        if not single:
            tc(a.dev, rate)
            multihost_utils.sync_global_devices(f"start-{phase}")
            before = wire_bytes_counters(a.dev)
        out[phase] = timed(steps)
        if not single:
            after = wire_bytes_counters(a.dev)
            wire[phase] = [(y - x) / (steps + 2) for x, y in zip(before, after)]
            multihost_utils.sync_global_devices(f"done-{phase}")
    if not single:
        tc(a.dev, None)
    if plan is not None:
        os.remove(plan)
    if a.process_id == 0:
        inter = sum(v[1] for v in by_cat.values())
        result = {
            "stage": a.stage,
            "nodes": a.nodes,
            "local": a.local,
            "rate": None if single else a.rate,
            "delay_ms": None if single else a.delay_ms,
            "steps": steps,
            "batch_per_device": a.batch_per_device,
            "sharding": {k: v.sharding for k, v in trainer.ec.plan.tables.items()},
            "compile_s": compile_s,
            "bytes_by_category": by_cat,
            "inter_bytes_per_device": inter,
            "inter_bytes_per_node": inter * a.local,
            "collectives": collectives,
        }
        for phase, times in out.items():
            result[f"{phase}_mean_s"] = statistics.fmean(times)
            result[f"{phase}_median_s"] = statistics.median(times)
            result[f"{phase}_s"] = times
        if not single:
            result["wire_sent_per_step"] = wire["unlimited"][0]  # node 0's link, TCP/IP headers included
            result["wire_received_per_step"] = wire["unlimited"][1]
            result["predicted_delta_s"] = predicted_delta(collectives, a.local, a.rate)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
