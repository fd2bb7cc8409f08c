"""Balanced sharding planner vs two naive baselines, and its topology recommendation; writes RESULTS.md.

Command: python experiments/planner/bench_planner.py [--json OUT] [--tables 64] [--seed 0]

Synthetic workload: tables with log-uniform rows in [1e3, 1e8], dims from {16, 32, 64, 128}, 1-32 ids
per example, Zipf(1.1) ids whose hot ids are the low ids (raw catalogue ids). Stats are analytic
(`FeatureStats.zipf`): expected distinct ids per shard per batch, no sampling of 1e8-row tables.
Baselines: every table row_wise with TorchRec's contiguous ceil(rows/world) row blocks, and
round-robin table_wise placement. Clusters are the meshes/ presets (`ClusterSpec.named`). No device and
no JAX computation is involved.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from jaxscale.benchmarks.machine import machine
from jaxscale.engine.cluster import ClusterSpec
from jaxscale.engine.plan import ShardingPlan, TableShards
from jaxscale.engine.planner import CostParams, FeatureStats, plan_sharding, recommend_topology, report
from jaxscale.engine.quantization import CommConfig
from jaxscale.engine.tables import TableConfig
from jaxscale.infra import atomic

HERE = Path(__file__).resolve().parent
ZIPF_EXPONENT = 1.1
BATCH_SIZE_PER_DEVICE = 4096
CLUSTERS = [  # (label, meshes/ preset, jaxscale topology)
    ("8 devices (1x8, 1d)", "1x8", "1d"),
    ("16 devices (2x8, 1d)", "2x8", "1d"),
    ("64 devices (8x8, 1d)", "8x8", "1d"),
    ("64 devices (8x8, 2d_ar)", "8x8", "2d_ar"),
    ("64 devices (8x8, 2d_a2a)", "8x8", "2d_a2a"),
]
RECOMMEND_NODES = (2, 8)
RECOMMEND_FABRICS = {"100 Gbit/s per node": 100, "400 Gbit/s per node": 400, "3200 Gbit/s per node": 3200}
RECOMMEND_BATCH = 512


def make_workload(num_tables: int, seed: int):
    rng = np.random.default_rng(seed)
    tables, stats = [], {}
    for i in range(num_tables):
        rows = int(round(10 ** rng.uniform(3, 8)))
        dim = int(rng.choice([16, 32, 64, 128]))
        ids_per_example = int(rng.integers(1, 33))
        table = TableConfig(f"t{i:02d}", rows, dim)
        tables.append(table)
        stats[table.name] = FeatureStats.zipf(rows, ids_per_example, ZIPF_EXPONENT)
    return tables, stats


def baselines(tables, topology: str, n: int) -> dict[str, ShardingPlan]:
    row_wise = {t.name: TableShards("row_wise", n, 1, tuple(range(n))) for t in tables}
    round_robin = {t.name: TableShards("table_wise", 1, 1, (i % n,)) for i, t in enumerate(tables)}
    return {"row_wise": ShardingPlan(topology, n, row_wise), "table_wise": ShardingPlan(topology, n, round_robin)}


def run(num_tables: int, seed: int) -> list[dict]:
    tables, stats = make_workload(num_tables, seed)
    rows = []
    for label, preset, topology in CLUSTERS:
        cluster = ClusterSpec.named(preset)
        n = cluster.topology(topology).num_shards
        start = time.perf_counter()
        plan = plan_sharding(tables, stats, cluster, BATCH_SIZE_PER_DEVICE, topology=topology)
        seconds = time.perf_counter() - start
        base = baselines(tables, topology, n)
        candidates = [
            ("planner (modulo rows)", report(plan, tables, stats, cluster, BATCH_SIZE_PER_DEVICE), seconds),
            (
                "row_wise, contiguous rows (TorchRec)",
                report(base["row_wise"], tables, stats, cluster, BATCH_SIZE_PER_DEVICE, row_assignment="contiguous"),
                None,
            ),
            ("row_wise, modulo rows", report(base["row_wise"], tables, stats, cluster, BATCH_SIZE_PER_DEVICE), None),
            ("table_wise round-robin", report(base["table_wise"], tables, stats, cluster, BATCH_SIZE_PER_DEVICE), None),
        ]
        for plan_name, rep, secs in candidates:
            rows.append(
                {
                    "cluster": label,
                    "shards": n,
                    "plan": plan_name,
                    "lookup_max_over_mean": round(rep.lookup_imbalance, 4),
                    "bytes_max_over_mean": round(rep.bytes_imbalance, 4),
                    "cost_max_over_mean": round(rep.cost_imbalance, 4),
                    "slowest_shard_ms": round(rep.max_cost_s * 1e3, 4),
                    "max_memory_gb": round(max(rep.memory_bytes) / 1e9, 2),
                    "over_memory_shards": len(rep.over_memory),
                    "types": dict(rep.sharding_counts),
                    "plan_seconds": None if secs is None else round(secs, 2),
                }
            )
    return rows


def recommendations(num_tables: int, seed: int) -> list[dict]:
    """recommend_topology on the largest-lookup tables of the workload (fp8/bf16 comms, exact sync)."""
    tables, stats = make_workload(num_tables, seed)
    out = []
    for fabric, gbit in RECOMMEND_FABRICS.items():
        for nodes in RECOMMEND_NODES:
            cluster = ClusterSpec.named("8x8", inter_node_bandwidth=gbit * 1e9 / 8).with_nodes(nodes)
            choice = recommend_topology(
                tables, stats, cluster, RECOMMEND_BATCH, CommConfig("fp8", "bf16"), periodic_every=(16,)
            )
            out.append({"fabric": fabric, "nodes": nodes, **choice.to_dict(), "report": choice.report()})
    return out


def to_markdown(rows: list[dict]) -> str:
    head = (
        "| cluster | plan | lookups max/mean | bytes max/mean | cost max/mean | slowest shard ms | "
        "max memory GB | shards over memory | types | plan s |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        types = ", ".join(f"{k} {v}" for k, v in r["types"].items())
        secs = "" if r["plan_seconds"] is None else f"{r['plan_seconds']:.2f}"
        lines.append(
            f"| {r['cluster']} | {r['plan']} | {r['lookup_max_over_mean']:.3f} | {r['bytes_max_over_mean']:.3f} | "
            f"{r['cost_max_over_mean']:.3f} | {r['slowest_shard_ms']:.3f} | {r['max_memory_gb']:.1f} | "
            f"{r['over_memory_shards']} | {types} | {secs} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> list[str]:
    """Reading the table, with every figure computed from it."""
    by = {(r["cluster"], r["plan"]): r for r in rows}
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    planned = [by[(c, "planner (modulo rows)")] for c in clusters]
    lines = [
        f"- The plan's max/mean lookups is <= {max(r['lookup_max_over_mean'] for r in planned):.3f} on every "
        f"cluster (target <= 1.05), its max/mean step time <= {max(r['cost_max_over_mean'] for r in planned):.3f}.",
    ]
    for c in clusters:
        p, cont = by[(c, "planner (modulo rows)")], by[(c, "row_wise, contiguous rows (TorchRec)")]
        mod, rr = by[(c, "row_wise, modulo rows")], by[(c, "table_wise round-robin")]
        slowest = p["slowest_shard_ms"]
        lines.append(
            f"- {c}: slowest shard {slowest:.3f} ms, {cont['slowest_shard_ms'] / slowest:.2f}x "
            f"faster than contiguous row blocks (lookups max/mean {cont['lookup_max_over_mean']:.2f}), "
            f"{mod['slowest_shard_ms'] / p['slowest_shard_ms']:.2f}x vs all-row_wise modulo, "
            f"{rr['slowest_shard_ms'] / p['slowest_shard_ms']:.2f}x vs round-robin table_wise."
        )
    lines.append(
        "- Most of the gain over contiguous blocks is modulo hashing itself (the 'row_wise, modulo rows' rows); "
        "the planner adds where keeping tables whole saves per-piece overheads without unbalancing lookups."
    )
    return lines


def results_markdown(rows, recs, mach, seconds, args) -> str:
    cl = ClusterSpec.named("8x8")
    cost = CostParams()
    text = [
        "# Balanced sharding planner: benchmark",
        "",
        "Generated by `python experiments/planner/bench_planner.py` "
        f"(--tables {args.tables} --seed {args.seed}); {mach['platform']}, {mach['nproc']} CPUs, Python "
        f"{mach['python']}, NumPy {mach['numpy']}, load average {mach['loadavg_at_start'][0]:.1f}; {seconds:.0f} s. "
        "Deterministic except the 'plan s' column (planning wall time).",
        "",
        f"Workload (seed {args.seed}): {args.tables} tables, rows log-uniform in [1e3, 1e8], dims from "
        f"{{16, 32, 64, 128}}, 1-32 ids per example, Zipf({ZIPF_EXPONENT}) ids with the low ids hot, batch "
        f"{BATCH_SIZE_PER_DEVICE} per device, {cl.device_memory_bytes / 1e9:.0f} GB per device. Clusters are the "
        f"meshes/ presets: NVLink {cl.intra_node_bandwidth / 1e9:.0f} GB/s per device, "
        f"{cl.inter_node_bandwidth * 8 / 1e9:.0f} Gbit/s per node. Every row is scored by the same cost model "
        "(`jaxscale.engine.planner.report`): per shard, distinct ids per source batch slice landing on it x sources; "
        f"bytes = distinct rows x wire bytes of a row forward ({cost.comm_forward}) and backward "
        f"({cost.comm_backward}) (`jaxscale.engine.quantization.wire_bytes`); time = HBM reads (TorchRec's small-dim "
        f"penalties, {cost.backward_compute_multiplier:.0f}x backward) + bytes / link bandwidth + "
        f"{cost.piece_overhead_s * 1e6:.0f} us per piece.",
        "",
        to_markdown(rows),
        "",
        "Reading it:",
        *summary(rows),
        "- Caveat: the stats model knows the top 1024 ids individually and spreads the rest of the Zipf tail "
        "evenly over rows, so the contiguous baseline's pile-up is an underestimate.",
        "",
        "## Topology recommendation (`recommend_topology`)",
        "",
        f"The same {args.tables} tables, batch {RECOMMEND_BATCH} per device, fp8/bf16 payloads, exact sync "
        "recommended (periodic k=16 reported, not chosen), on 8-GPU H100 nodes with the NIC line rate varied:",
        "",
        "| fabric | nodes | recommended | predicted embedding comm ms (critical path) | 1d | 2d_ar | 2d_a2a |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        best = {}
        for c in r["candidates"]:
            if c["feasible"] and c["exact"]:
                t = c["topology"]
                best[t] = min(best.get(t, float("inf")), c["comm_s"])
        chosen = next(c for c in r["candidates"] if c["label"].startswith(r["topology"]) and c["sync"] == r["sync"])
        cells = [f"{best[t] * 1e3:.3f}" if t in best else "does not fit" for t in ("1d", "2d_ar", "2d_a2a")]
        text.append(
            f"| {r['fabric']} | {r['nodes']} | {chosen['label']} | {chosen['comm_s'] * 1e3:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    text += ["", "The report of the last one:", "", "```", recs[-1]["report"], "```", ""]
    return "\n".join(text) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    parser.add_argument("--tables", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    mach = machine()
    rows = run(args.tables, args.seed)
    recs = recommendations(args.tables, args.seed)
    text = results_markdown(rows, recs, mach, time.perf_counter() - start, args)
    atomic.write_text(HERE / "RESULTS.md", text)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "recommendations": recs}, indent=1, default=str))
    print(text)


if __name__ == "__main__":
    main()
