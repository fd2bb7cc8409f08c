"""The 2D device mesh: axis names, the `Topology` value (what 1d / 2d_ar / 2d_a2a mean), and `make_mesh`.

Every collective in jaxscale names one of the two axes defined here. Axes are ordered slow -> fast:
`node` is the host (the slow inter-node link), `local` the devices of one host (NVLink/NVSwitch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

NODE = "node"
LOCAL = "local"
AXES = (NODE, LOCAL)
BATCH_AXES = (NODE, LOCAL)  # the batch is always sharded over every device

TOPOLOGIES = ("1d", "2d_ar", "2d_a2a")

# Named clusters (`jaxscale.cluster.ClusterSpec.named`): a link to the repo's meshes/, shipped in the wheel.
_MESHES_DIR = Path(__file__).resolve().parent / "presets" / "meshes"


@dataclasses.dataclass(frozen=True)
class Topology:
    """What a topology name means on a (nodes, local) mesh; the one place that meaning is encoded.

    A topology splits the mesh axes in two: the *shard* axes form the all-to-all group (each member holds
    one shard of the tables) and the *replica* axes hold copies of that group (kept in sync by the replica
    sync). '1d' shards over every device; '2d_ar' shards over nodes and replicates inside a node (the
    all-to-all crosses nodes, the sync stays on NVLink); '2d_a2a' shards inside a node and replicates
    across nodes (the all-to-all never leaves a node, the sync crosses nodes).
    """

    name: str
    nodes: int
    local: int

    def __post_init__(self):
        if self.name not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.name!r}")
        for field in ("nodes", "local"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Topology.{field} must be a positive integer, got {value!r}")

    @classmethod
    def of(cls, name: str, mesh) -> Topology:
        """The topology `name` on a jaxscale mesh."""
        return cls(name, *mesh_shape(mesh))

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """Mesh axes the tables are sharded over (the all-to-all group)."""
        return {"1d": (NODE, LOCAL), "2d_ar": (NODE,), "2d_a2a": (LOCAL,)}[self.name]

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """Mesh axes that hold replicas of the tables."""
        return {"1d": (), "2d_ar": (LOCAL,), "2d_a2a": (NODE,)}[self.name]

    def _size(self, axes) -> int:
        return int(np.prod([{NODE: self.nodes, LOCAL: self.local}[a] for a in axes], dtype=int))

    @property
    def num_shards(self) -> int:
        """Size of the shard group: shards per replica."""
        return self._size(self.shard_axes)

    @property
    def num_replicas(self) -> int:
        """Copies of every shard (1 for '1d')."""
        return self._size(self.replica_axes)

    def _positions(self) -> np.ndarray:
        return np.arange(self.nodes * self.local).reshape(self.nodes, self.local)

    def shard_groups(self) -> tuple[tuple[int, ...], ...]:
        """The all-to-all groups as flat mesh positions (one group per replica), shard order within each."""
        pos = self._positions()
        if self.name == "1d":
            return (tuple(int(v) for v in pos.reshape(-1)),)
        if self.name == "2d_ar":
            return tuple(tuple(int(v) for v in col) for col in pos.T)
        return tuple(tuple(int(v) for v in row) for row in pos)

    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups of devices that hold the same shard, as flat mesh positions (singletons for '1d')."""
        pos = self._positions()
        if self.name == "1d":
            return tuple((int(v),) for v in pos.reshape(-1))
        if self.name == "2d_ar":
            return tuple(tuple(int(v) for v in row) for row in pos)
        return tuple(tuple(int(v) for v in col) for col in pos.T)

    def shard_of(self, positions):
        """Shard index (within its group) of flat mesh positions (NumPy arrays or ints)."""
        node, local = np.divmod(np.asarray(positions), self.local)
        return {"1d": np.asarray(positions), "2d_ar": node, "2d_a2a": local}[self.name]

    def replica_of(self, positions):
        """Replica index of flat mesh positions: which copy of the shard group they belong to."""
        node, local = np.divmod(np.asarray(positions), self.local)
        return {"1d": np.zeros_like(node), "2d_ar": local, "2d_a2a": node}[self.name]

    @property
    def shard_peers(self) -> tuple[int, int]:
        """(intra-node, inter-node) peers of one device in its all-to-all group."""
        return {
            "1d": (self.local - 1, (self.nodes - 1) * self.local),
            "2d_ar": (0, self.nodes - 1),
            "2d_a2a": (self.local - 1, 0),
        }[self.name]

    @property
    def replica_peers(self) -> tuple[int, int]:
        """(intra-node, inter-node) peers of one device in its replica group."""
        return {"1d": (0, 0), "2d_ar": (self.local - 1, 0), "2d_a2a": (0, self.nodes - 1)}[self.name]


def shard_axes(topology: str) -> tuple[str, ...]:
    """Mesh axes that embedding tables are sharded over (the all-to-all group)."""
    return Topology(topology, 1, 1).shard_axes


def replica_axes(topology: str) -> tuple[str, ...]:
    """Mesh axes that hold replicas of the tables (kept in sync by the replica sync)."""
    return Topology(topology, 1, 1).replica_axes


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


def node_of_position(position: int, mesh_shape_: tuple[int, int]) -> int:
    """The node coordinate of a flat mesh position (HLO replica groups are flat mesh positions)."""
    return int(np.unravel_index(position, mesh_shape_)[0])
