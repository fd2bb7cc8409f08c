"""Balanced sharding planner vs two naive baselines, scored by the same cost model.

Command: python experiments/planner/bench_planner.py [--json] [--tables 64] [--seed 0]

Synthetic workload: tables with log-uniform rows in [1e3, 1e8], dims from {16, 32, 64, 128}, 1-32 ids
per example, Zipf(1.1) ids whose hot ids are the low ids (raw catalogue ids). Stats are analytic
(`FeatureStats.zipf`): expected distinct ids per shard per batch, no sampling of 1e8-row tables.
Baselines: every table row_wise with TorchRec's contiguous ceil(rows/world) row blocks, and
round-robin table_wise placement. No device and no JAX computation is involved.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jaxscale.plan import ShardingPlan, TableShards  # noqa: E402
from jaxscale.planner import FeatureStats, Topology, plan_sharding, report  # noqa: E402
from jaxscale.tables import TableConfig  # noqa: E402

ZIPF_EXPONENT = 1.1
BATCH_SIZE_PER_DEVICE = 4096
DEVICE_MEMORY_BYTES = 80e9
CLUSTERS = [  # (label, nodes, devices per node, jaxscale topology)
    ("8 devices (1x8, 1d)", 1, 8, "1d"),
    ("16 devices (2x8, 1d)", 2, 8, "1d"),
    ("64 devices (8x8, 1d)", 8, 8, "1d"),
    ("64 devices (8x8, 2d_ar)", 8, 8, "2d_ar"),
    ("64 devices (8x8, 2d_a2a)", 8, 8, "2d_a2a"),
]


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


def baselines(tables, topology: Topology) -> dict[str, ShardingPlan]:
    n = topology.num_shards
    row_wise = {t.name: TableShards("row_wise", n, 1, tuple(range(n))) for t in tables}
    round_robin = {t.name: TableShards("table_wise", 1, 1, (i % n,)) for i, t in enumerate(tables)}
    return {
        "row_wise": ShardingPlan(topology.name, n, row_wise),
        "table_wise": ShardingPlan(topology.name, n, round_robin),
    }


def run(num_tables: int, seed: int) -> list[dict]:
    tables, stats = make_workload(num_tables, seed)
    rows = []
    for label, nodes, local, name in CLUSTERS:
        topology = Topology(nodes, local, DEVICE_MEMORY_BYTES, name=name)
        start = time.perf_counter()
        plan = plan_sharding(tables, stats, topology, BATCH_SIZE_PER_DEVICE)
        seconds = time.perf_counter() - start
        base = baselines(tables, topology)
        candidates = [
            ("planner (modulo rows)", report(plan, tables, stats, topology, BATCH_SIZE_PER_DEVICE), seconds),
            (
                "row_wise, contiguous rows (TorchRec)",
                report(base["row_wise"], tables, stats, topology, BATCH_SIZE_PER_DEVICE, row_assignment="contiguous"),
                None,
            ),
            ("row_wise, modulo rows", report(base["row_wise"], tables, stats, topology, BATCH_SIZE_PER_DEVICE), None),
            (
                "table_wise round-robin",
                report(base["table_wise"], tables, stats, topology, BATCH_SIZE_PER_DEVICE),
                None,
            ),
        ]
        for plan_name, rep, secs in candidates:
            rows.append(
                {
                    "cluster": label,
                    "shards": topology.num_shards,
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    parser.add_argument("--tables", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = run(args.tables, args.seed)
    print(json.dumps(rows, indent=1) if args.json else to_markdown(rows))


if __name__ == "__main__":
    main()
