"""The 2D device mesh: axis names, topology constants, and `make_mesh`.

Every collective in jaxscale names one of the two axes defined here. Axes are ordered slow -> fast:
`node` is the host (the slow inter-node link), `local` the devices of one host (NVLink/NVSwitch).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

NODE = "node"
LOCAL = "local"
AXES = (NODE, LOCAL)
BATCH_AXES = (NODE, LOCAL)  # the batch is always sharded over every device

TOPOLOGIES = ("1d", "2d_ar", "2d_a2a")

_MESHES_DIR = Path(__file__).resolve().parent.parent / "meshes"


def shard_axes(topology: str) -> tuple[str, ...]:
    """Mesh axes that embedding tables are sharded over (the all-to-all group)."""
    return {"1d": (NODE, LOCAL), "2d_ar": (NODE,), "2d_a2a": (LOCAL,)}[_check_topology(topology)]


def replica_axes(topology: str) -> tuple[str, ...]:
    """Mesh axes that hold replicas of the tables (kept in sync by the replica sync)."""
    return {"1d": (), "2d_ar": (LOCAL,), "2d_a2a": (NODE,)}[_check_topology(topology)]


def _check_topology(topology: str) -> str:
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    return topology


def make_mesh(nodes: int, local: int, devices: Sequence | None = None):
    """A `jax.sharding.Mesh` of shape (nodes, local) with axes ('node', 'local').

    In a multi-process run row `n` of the mesh holds exactly the devices of process `n` (built from
    `process_index`, never from device ids, which are not contiguous across processes). With one
    process, `nodes` simulated nodes are consecutive groups of `local` devices.
    """
    import jax
    from jax.sharding import Mesh

    for name, value in (("nodes", nodes), ("local", local)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"make_mesh: {name} must be a positive integer, got {value!r}")
    devices = list(jax.devices() if devices is None else devices)
    if nodes * local != len(devices):
        raise ValueError(
            f"make_mesh: nodes * local = {nodes} * {local} = {nodes * local} does not match the "
            f"{len(devices)} available devices (set --xla_force_host_platform_device_count or "
            f"jax_num_cpu_devices before JAX starts to simulate more CPU devices)"
        )
    processes = sorted({d.process_index for d in devices})
    if len(processes) > 1:
        if len(processes) != nodes:
            raise ValueError(
                f"make_mesh: in a multi-process run the 'node' axis is the process; got nodes={nodes} "
                f"but {len(processes)} processes"
            )
        per_process = {p: sum(d.process_index == p for d in devices) for p in processes}
        if any(n != local for n in per_process.values()):
            raise ValueError(f"make_mesh: local={local} but the processes hold {per_process} devices each")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(ordered, dtype=object).reshape(nodes, local), AXES)


def mesh_shape(mesh) -> tuple[int, int]:
    """(nodes, local) of a jaxscale mesh; raises if the axes are not ('node', 'local')."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"expected a mesh with axes {AXES}, got {tuple(mesh.axis_names)}")
    return int(mesh.shape[NODE]), int(mesh.shape[LOCAL])


def named_mesh(name: str) -> dict:
    """A named topology from `meshes/` (e.g. '2x4'), as a dict with nodes, local and link figures."""
    import yaml

    path = _MESHES_DIR / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in _MESHES_DIR.glob("*.yaml"))
        raise ValueError(f"unknown mesh {name!r}; known meshes: {known}")
    return yaml.safe_load(path.read_text())


def node_of_position(position: int, mesh_shape_: tuple[int, int]) -> int:
    """The node coordinate of a flat mesh position (HLO replica groups are flat mesh positions)."""
    return int(np.unravel_index(position, mesh_shape_)[0])
