"""Balanced sharding planner: a cost model over measured id statistics, pure Python + NumPy (no JAX).

Why it exists: TorchRec's row-wise sharding cuts tables into contiguous row blocks, so the hot ids
of a skewed (Zipf) feature pile onto one shard, and table-wise placement by size ignores how often
a table is read. The jaxscale engine hashes rows by modulo (row r -> part r % row_parts) and
deduplicates ids per source device per batch, so a shard's work per step is the number of DISTINCT
ids of each source's batch slice that land on it. This planner estimates exactly that from a data
sample and places pieces so that the slowest device is as fast as possible.

Stages, one module each (each can be tested alone):
  1. id_stats     `measure_feature_stats`: ids per example + id frequency distribution (hot ids, Zipf tail).
  2. costs        `enumerate_options`: the sharding types each table may take (or its override);
  3.              `estimate_option`: per-piece lookups, bytes sent per link class, memory and time.
  4. placement    `plan_sharding`: choose types + greedy largest-first placement + local-search moves/swaps
                  that lower the slowest device; returns a `ShardingPlan`.
  5. report       `report`: per-device load of any plan (also of naive baselines).
  step_counts     per-step counts of a plan, estimated (`step_counts`) or counted from ids (`measure_step_counts`).
  topology        `recommend_topology`: each topology's own plan, its counts and `jaxscale.engine.comm_model` times.
  resolve         `resolve(cfg, tables, sample) -> (settings, plan)`: what a run executes, before its trainer.
"""

from jaxscale.engine.embedding.row_owner import ROW_ASSIGNMENTS
from jaxscale.engine.planner.costs import (
    DEFAULT_COST,
    CostParams,
    PieceCosts,
    ShardingOption,
    enumerate_options,
    estimate_option,
)
from jaxscale.engine.planner.id_stats import FeatureStats, distinct_ids_per_part, measure_feature_stats
from jaxscale.engine.planner.placement import plan_sharding
from jaxscale.engine.planner.report import PlanReport, report
from jaxscale.engine.planner.resolve import choose_topology, cluster_for, resolve
from jaxscale.engine.planner.step_counts import measure_step_counts, sorted_unique, step_counts
from jaxscale.engine.planner.topology import TopologyCandidate, TopologyChoice, recommend_topology

__all__ = [
    "DEFAULT_COST",
    "ROW_ASSIGNMENTS",
    "CostParams",
    "FeatureStats",
    "PieceCosts",
    "PlanReport",
    "ShardingOption",
    "TopologyCandidate",
    "TopologyChoice",
    "choose_topology",
    "cluster_for",
    "distinct_ids_per_part",
    "enumerate_options",
    "estimate_option",
    "measure_feature_stats",
    "measure_step_counts",
    "plan_sharding",
    "recommend_topology",
    "report",
    "resolve",
    "sorted_unique",
    "step_counts",
]
