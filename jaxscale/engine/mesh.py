"""The 2D device mesh: axis names, the `Topology` value (what 1d / 2d_ar / 2d_a2a mean), and `make_mesh`.

Every collective in jaxscale names one of the two axes defined here. Axes are ordered slow -> fast:
`node` is the host (the slow inter-node link), `local` the devices of one host (NVLink/NVSwitch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

NODE = "node"
LOCAL = "local"
AXES = (NODE, LOCAL)
BATCH_AXES = (NODE, LOCAL)  # the batch is always sharded over every device

# What each topology means, and the only place it is written: the mesh axes its tables are sharded over
# (the all-to-all group) and the axes that hold replicas of that group (kept equal by the replica sync).
# Everything else (`Topology`'s groups, peers, shard and replica indices) is derived from this table.
TOPOLOGY_AXES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "1d": ((NODE, LOCAL), ()),  # shard over every device; no replicas
    "2d_ar": ((NODE,), (LOCAL,)),  # shard across nodes, replicate inside a node (all-reduce-optimised)
    "2d_a2a": ((LOCAL,), (NODE,)),  # shard inside a node, replicate across nodes (all-to-all-optimised)
}
TOPOLOGIES = tuple(TOPOLOGY_AXES)

# Named clusters (`jaxscale.engine.cluster.ClusterSpec.named`): a link to the repo's meshes/, shipped in the wheel.
_MESHES_DIR = Path(__file__).resolve().parents[1] / "presets" / "meshes"


def check_topology(name) -> str:
    """`name` if it names a topology, else ValueError listing them."""
    if name not in TOPOLOGY_AXES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {name!r}")
    return name


def shard_axes(topology: str) -> tuple[str, ...]:
    """Mesh axes that embedding tables are sharded over (the all-to-all group)."""
    return TOPOLOGY_AXES[check_topology(topology)][0]


def replica_axes(topology: str) -> tuple[str, ...]:
    """Mesh axes that hold replicas of the tables (kept in sync by the replica sync); () for none."""
    return TOPOLOGY_AXES[check_topology(topology)][1]


def has_replicas(topology: str) -> bool:
    """Whether the topology keeps replicas on any mesh with more than one device on its replica axes."""
    return bool(replica_axes(topology))


@dataclasses.dataclass(frozen=True)
class Topology:
    """A topology (`TOPOLOGY_AXES`) on a (nodes, local) mesh: its groups, peers and sizes.

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
        check_topology(self.name)
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
        return shard_axes(self.name)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """Mesh axes that hold replicas of the tables."""
        return replica_axes(self.name)

    def _size(self, axes) -> int:
        return int(np.prod([{NODE: self.nodes, LOCAL: self.local}[a] for a in axes], dtype=int))

    @property
    def num_shards(self) -> int:
        """Size of the shard group: shards per replica."""
        return self._size(self.shard_axes)

    @property
    def num_replicas(self) -> int:
        """Copies of every shard (1 for '1d', and for a 2D topology whose replica axis has one device)."""
        return self._size(self.replica_axes)

    def _grid(self) -> np.ndarray:
        """Flat mesh positions as [replicas, shards]: row r is replica r's all-to-all group in shard order."""
        pos = np.arange(self.nodes * self.local).reshape(self.nodes, self.local)
        order = [AXES.index(a) for a in self.replica_axes + self.shard_axes]
        return pos.transpose(order).reshape(self.num_replicas, self.num_shards)

    def shard_groups(self) -> tuple[tuple[int, ...], ...]:
        """The all-to-all groups as flat mesh positions (one group per replica), shard order within each."""
        return tuple(tuple(int(v) for v in row) for row in self._grid())

    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups of devices that hold the same shard, as flat mesh positions (singletons for '1d')."""
        return tuple(tuple(int(v) for v in col) for col in self._grid().T)

    def _coordinates(self) -> tuple[np.ndarray, np.ndarray]:
        """(replica, shard) of every flat mesh position."""
        grid = self._grid()
        replica, shard = np.empty(grid.size, int), np.empty(grid.size, int)
        replica[grid], shard[grid] = np.indices(grid.shape)
        return replica, shard

    def shard_of(self, positions):
        """Shard index (within its group) of flat mesh positions (NumPy arrays or ints)."""
        return self._coordinates()[1][np.asarray(positions)]

    def replica_of(self, positions):
        """Replica index of flat mesh positions: which copy of the shard group they belong to."""
        return self._coordinates()[0][np.asarray(positions)]

    def _peers(self, axes) -> tuple[int, int]:
        inside = self.local if LOCAL in axes else 1
        return inside - 1, self._size(axes) - inside

    @property
    def shard_peers(self) -> tuple[int, int]:
        """(intra-node, inter-node) peers of one device in its all-to-all group."""
        return self._peers(self.shard_axes)

    @property
    def replica_peers(self) -> tuple[int, int]:
        """(intra-node, inter-node) peers of one device in its replica group."""
        return self._peers(self.replica_axes)


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


def batch_mesh(batch_size: int):
    """The mesh of the current `jax.set_mesh` context when it has the batch axes, more than one device, and
    `batch_size` splits evenly over them, else None: a model that finds one may run a per-example part in
    `shard_map` over `BATCH_AXES` (the trainer compiles its step in that context)."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
        return None
    devices = math.prod(mesh.shape[a] for a in BATCH_AXES)
    return mesh if devices > 1 and batch_size % devices == 0 else None


def mesh_shape(mesh) -> tuple[int, int]:
    """(nodes, local) of a jaxscale mesh; raises if the axes are not ('node', 'local')."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"expected a mesh with axes {AXES}, got {tuple(mesh.axis_names)}")
    return int(mesh.shape[NODE]), int(mesh.shape[LOCAL])


def node_of_position(position: int, mesh_shape_: tuple[int, int]) -> int:
    """The node coordinate of a flat mesh position (HLO replica groups are flat mesh positions)."""
    return int(np.unravel_index(position, mesh_shape_)[0])
