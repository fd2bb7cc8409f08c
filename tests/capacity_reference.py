"""Brute-force counts of what the exchanges need and drop, from the plan alone (for tests).

Written without the engine's routing code: every id of every device is walked in Python, its owners are
read off the `ShardingPlan`, and the unique rows (or the (row, bag) pairs of partial-sum features) per
(device, owner) are counted.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np


def requests_per_owner(ec, ids: dict, partial=frozenset()):
    """{stack: {(device, owner): set of (table, id, column block)}} for row features and
    {stack: {(device, owner): number of valid (id, bag) pairs}} for partial-sum features."""
    devices = ec.nodes * ec.local
    uniq: dict = defaultdict(lambda: defaultdict(set))
    pairs: dict = defaultdict(lambda: defaultdict(int))
    for f, x in ids.items():
        t = ec.tables[ec.feature_table[f]]
        ts = ec.plan.tables[t.name]
        stack = f"w{t.stored_dim // ts.col_parts}"
        per = x.shape[0] // devices
        for i in range(x.shape[0]):
            d = i // per
            for v in x[i]:
                v = int(v)
                if not 0 <= v < t.stored_rows:
                    continue
                for c in range(ts.col_parts):
                    owner = ts.shard_of(v % ts.row_parts, c)
                    if f in partial:
                        pairs[stack][(d, owner)] += 1
                    else:
                        uniq[stack][(d, owner)].add((t.name, v, c))
    return uniq, pairs


def dropped(ec, ids: dict, capacities, partial=frozenset()) -> int:
    """Unique rows (and pairs) that do not fit the given capacities, summed over every device."""
    uniq, pairs = requests_per_owner(ec, ids, partial)
    total = 0
    for stack, groups in uniq.items():
        total += sum(max(0, len(s) - capacities[stack].rows) for s in groups.values())
    for stack, groups in pairs.items():
        total += sum(max(0, n - capacities[stack].pairs) for n in groups.values())
    return total


def remote_unique_ids(ec, ids: dict) -> np.ndarray:
    """Per device: the unique (table, id, column block) requests it sends to OTHER shards (the need of an
    exact, de-duplicated exchange)."""
    uniq, _ = requests_per_owner(ec, ids)
    devices = ec.nodes * ec.local
    out = np.zeros(devices, np.int64)
    for groups in uniq.values():
        for (d, owner), s in groups.items():
            if owner != int(ec.topology.shard_of(d)):
                out[d] += len(s)
    return out
