"""Argument checks shared by the planner's stages."""

from __future__ import annotations

import math

import numpy as np

from jaxscale.engine.cluster import ClusterSpec
from jaxscale.engine.mesh import TOPOLOGIES, Topology


def check_positive(owner: str, field: str, value, integer: bool = False, allow_zero: bool = False):
    kind = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    ok = isinstance(value, kind) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok or (not integer and not math.isfinite(float(value))):
        need = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{owner}.{field} must be a {need} {'integer' if integer else 'number'}, got {value!r}")


def cluster_topology(cluster: ClusterSpec, topology: str) -> Topology:
    """What `topology` means on the cluster's mesh (shard count, peers): `jaxscale.engine.mesh.Topology`."""
    if not isinstance(cluster, ClusterSpec):
        raise TypeError(f"expected a jaxscale.engine.cluster.ClusterSpec, got {type(cluster).__name__}")
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    return cluster.topology(topology)


def max_over_mean(values: np.ndarray) -> float:
    """The imbalance of per-device loads: the slowest over the mean (1 when nothing is loaded)."""
    mean = float(np.mean(values))
    return float(np.max(values)) / mean if mean > 0 else 1.0
