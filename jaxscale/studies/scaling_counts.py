"""Exact per-step counts of one global batch on every nested mesh (1..N nodes), for the scaling model.

Used by experiments/scaling/run_ablation.py (--recount) for the large foundation preset on 1-64 nodes.

One global batch of the largest mesh is generated with the trainer's synthetic data
(`jaxscale.training.data.SyntheticFoundationData`: Zipf(1.1) item ranks within 32 item clusters over a 2B-id
vocabulary, lognormal sequence lengths) and hashed into the item tables exactly as the model does
(`jaxscale_models.foundation.foundation_ids`: 2 tables of 100M rows, or 200M under half_dim). Weak scaling keeps
the per-device batch, and the synthetic stream is counter-based, so the batch of an N-node run is the
first N nodes' slice of that batch: every node count reuses the same ids (nested meshes).

Counting is exact for those ids, with the definitions of `jaxscale.engine.planner.measure_step_counts` (which a
test checks this against on small meshes), but organised for nested meshes: each sort is done once for
the largest mesh and every smaller mesh reads prefixes / first appearances:
  - device-unique rows (device, row): rows a device requests (requested = max over device, shard);
  - node-unique rows (node, row): rows a node's devices touch (2d_a2a: a replica is a node);
  - local-index-unique rows (local, row) with their first node: rows touched by devices (., l) of the
    first N nodes (2d_ar: a replica is a local index);
  - each row's first node: the union over the first N nodes (rows every replica must learn).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from jaxscale.engine.cluster import ClusterSpec
from jaxscale.engine.comm_model import StackCounts
from jaxscale.engine.embedding.row_owner import row_part
from jaxscale.engine.plan import ShardingPlan
from jaxscale.engine.planner.step_counts import sorted_unique, stack_counts  # sorted_unique: np.unique, far faster
from jaxscale.engine.tables import TableConfig


@dataclasses.dataclass
class _TableIds:
    """Sorted unique views of one table's ids on the largest mesh."""

    rows: int  # stored rows of the table
    dev: np.ndarray  # device of each unique (device, row), sorted by device then row
    dev_row: np.ndarray
    node_row: np.ndarray  # rows of the unique (node, row), sorted by node then row
    node_start: np.ndarray  # node_row[node_start[n]:node_start[n+1]] are node n's rows
    local: np.ndarray  # local index of each unique (local, row)
    local_row: np.ndarray
    local_first_node: np.ndarray  # first node whose device (n, local) requests the row
    union_row: np.ndarray  # every row requested anywhere
    union_first_node: np.ndarray  # the first node that requests it


def _unique_keys(major: np.ndarray, row: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    keys = sorted_unique(major.astype(np.int64) * rows + row)
    return keys // rows, keys % rows


def _first_by_row(group: np.ndarray, row: np.ndarray, node: np.ndarray, max_nodes: int, rows: int):
    """For each unique (group, row): the smallest node among its occurrences."""
    keys = np.sort((group.astype(np.int64) * rows + row) * max_nodes + node)  # node is the least significant
    pair = keys // max_nodes
    first = np.concatenate([[True], pair[1:] != pair[:-1]])
    return pair[first] // rows, pair[first] % rows, keys[first] % max_nodes


class NestedCounts:
    """Exact per-step counts for the first N nodes of one global batch, for any N <= max nodes.

    Args:
      ids: {feature: int array [max_nodes * local, n]} stored-row ids per device (flat mesh order), -1 pad.
      tables: the tables (each feature read by one table).
      local: devices per node.
    """

    def __init__(self, ids: dict[str, np.ndarray], tables: Sequence[TableConfig], local: int):
        self.local = local
        self.tables = tuple(tables)
        self.devices = next(iter(ids.values())).shape[0]
        if self.devices % local:
            raise ValueError(f"{self.devices} devices do not split into nodes of {local}")
        self.max_nodes = self.devices // local
        self.per_table: dict[str, _TableIds] = {}
        for t in self.tables:
            x = np.concatenate([np.asarray(ids[f]).reshape(self.devices, -1) for f in t.features], axis=1)
            self.per_table[t.name] = self._index(x, t.stored_rows)

    def _index(self, x: np.ndarray, rows: int) -> _TableIds:
        valid = x >= 0
        dev_all = np.broadcast_to(np.arange(self.devices)[:, None], x.shape)[valid]
        dev, dev_row = _unique_keys(dev_all, x[valid], rows)
        node = dev // self.local
        node_u, node_row = _unique_keys(node, dev_row, rows)
        node_start = np.searchsorted(node_u, np.arange(self.max_nodes + 1))
        local, local_row, local_first = _first_by_row(dev % self.local, dev_row, node, self.max_nodes, rows)
        _, union_row, union_first = _first_by_row(np.zeros_like(node_u), node_row, node_u, self.max_nodes, rows)
        return _TableIds(
            rows, dev, dev_row, node_row, node_start, local, local_row, local_first, union_row, union_first
        )

    def counts(
        self, plan: ShardingPlan, nodes: int, row_assignment: str = "modulo", round_capacities: bool = True
    ) -> list[StackCounts]:
        """The counts of `plan` on the first `nodes` nodes (see jaxscale.engine.planner.measure_step_counts)."""
        if not 1 <= nodes <= self.max_nodes:
            raise ValueError(f"nodes must be in [1, {self.max_nodes}], got {nodes}")
        layout = ClusterSpec(nodes, self.local).topology(plan.topology)
        S, rep, D = layout.num_shards, layout.num_replicas, nodes * self.local
        acc: dict[int, dict[str, np.ndarray]] = {}
        for t in self.tables:
            ts = plan.tables[t.name]
            width = t.stored_dim // ts.col_parts
            a = acc.setdefault(
                width,
                {
                    "rows": np.zeros(S, np.int64),
                    "requested": np.zeros((D, S), np.int64),
                    "touched": np.zeros((rep, S), np.int64),
                    "owner_sent": np.zeros((rep, S, rep), np.int64),
                    "owned": np.zeros((S, rep), np.int64),
                },
            )
            P = ts.row_parts
            shard = np.asarray(ts.shards, np.int64).reshape(P, ts.col_parts)
            for p in range(P):
                for c in range(ts.col_parts):
                    a["rows"][shard[p, c]] += ts.piece_rows(t.stored_rows, p)
            ti = self.per_table[t.name]

            end = np.searchsorted(ti.dev, D)
            part, _ = row_part(ti.dev_row[:end], P, row_assignment, ti.rows)
            per_part = np.bincount(ti.dev[:end] * P + part, minlength=D * P).reshape(D, P)
            for c in range(ts.col_parts):
                np.add.at(a["requested"].T, shard[:, c], per_part.T)
            union = ti.union_row[ti.union_first_node < nodes]
            if rep == 1:  # one replica: it touches the union
                group, row = np.zeros(union.size, np.int64), union
            elif plan.topology == "2d_a2a":  # replica = node
                stop = ti.node_start[nodes]
                group = np.repeat(np.arange(nodes), np.diff(ti.node_start[: nodes + 1]))
                row = ti.node_row[:stop]
            else:  # 2d_ar: replica = local index
                keep = ti.local_first_node < nodes
                group, row = ti.local[keep], ti.local_row[keep]
            part, loc = row_part(row, P, row_assignment, ti.rows)
            touched = np.bincount(group * P + part, minlength=rep * P).reshape(rep, P)
            sent = np.bincount((group * P + part) * rep + loc % rep, minlength=rep * P * rep).reshape(rep, P, rep)
            upart, uloc = row_part(union, P, row_assignment, ti.rows)
            owned = np.bincount(upart * rep + uloc % rep, minlength=P * rep).reshape(P, rep)
            for c in range(ts.col_parts):
                np.add.at(a["touched"].T, shard[:, c], touched.T)
                np.add.at(a["owner_sent"].transpose(1, 0, 2), shard[:, c], sent.transpose(1, 0, 2))
                np.add.at(a["owned"], shard[:, c], owned)

        # one step: the rows touched since the last sync are the union over replicas, the owned rows
        return [
            stack_counts(width, {**a, "since_sync": a["owned"].sum(axis=1)}, S, round_capacities)
            for width, a in sorted(acc.items())
        ]


def generate_ids(cfg, max_nodes: int, local: int, batch_per_device: int, seed: int = 0, step: int = 0, log=print):
    """Raw item ids [max_nodes * local * batch_per_device, L] of one global batch, node slice by node slice."""
    from jaxscale_models.foundation_data import SyntheticFoundationData

    data = SyntheticFoundationData(cfg, global_batch=max_nodes * local * batch_per_device, seed=seed)
    t0 = time.perf_counter()
    raw = np.concatenate([data.batch(step, p, max_nodes)["item_ids"] for p in range(max_nodes)])
    seconds = time.perf_counter() - t0
    log(f"generated {raw.shape[0]:,} sequences x {raw.shape[1]} ({(raw >= 0).sum():,} ids) in {seconds:.0f} s")
    return raw


def device_ids(cfg, raw: np.ndarray, devices: int) -> dict[str, np.ndarray]:
    """{feature: [devices, B * L]} stored-row ids, hashed as the model hashes them."""
    from jaxscale_models.foundation import foundation_ids

    return {f: a.reshape(devices, -1) for f, a in foundation_ids(cfg, {"item_ids": raw}).items()}


def raw_row_ids(raw: np.ndarray, tables: Sequence[TableConfig], devices: int) -> dict[str, np.ndarray]:
    """{feature: [devices, B * L]} rows of ids used as given (raw id mod stored rows, no hashing)."""
    return {t.features[0]: np.where(raw >= 0, raw % t.stored_rows, -1).reshape(devices, -1) for t in tables}


def ids_per_device(raw: np.ndarray, devices: int) -> float:
    return float((raw >= 0).sum()) / devices


def check_nested_against_library(ids, tables, plan, nodes: int, local: int, row_assignment: str = "modulo"):
    """The counts of NestedCounts and of jaxscale.engine.planner.measure_step_counts for the same batch."""
    from jaxscale.engine import planner

    devices = nodes * local
    prefix = {f: a[:devices] for f, a in ids.items()}
    fast = NestedCounts(ids, tables, local).counts(plan, nodes, row_assignment, round_capacities=False)
    ref = planner.measure_step_counts(
        prefix, tables, plan, ClusterSpec(nodes, local), row_assignment=row_assignment, round_capacities=False
    )
    return fast, ref
