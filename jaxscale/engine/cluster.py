"""`ClusterSpec`: the hardware a plan or a performance model is for (pure Python, no JAX).

A cluster is `nodes` hosts of `devices_per_node` accelerators. Two link classes matter for embedding
training: the intra-node link (NVLink/NVSwitch: every device has its own bandwidth to its peers) and the
inter-node link (the node's NICs: one line rate per NODE, shared by all its devices when they all talk
across nodes at once, as they do in an all-to-all or a hierarchical all-reduce). Each link class also
has a per-message latency (the alpha of an alpha-beta model): an all-to-all over G devices sends G-1
messages, so latency, not bandwidth, dominates small exchanges on large clusters.

Named clusters live in `meshes/<name>.yaml` (the link figures there carry their sources). What a
topology name ('1d', '2d_ar', '2d_a2a') means on the cluster's mesh is `jaxscale.engine.mesh.Topology`'s job;
`ClusterSpec.topology(name)` returns it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from pathlib import Path

from jaxscale.engine.mesh import _MESHES_DIR, Topology

# YAML keys (with their units) -> (field, conversion to SI units; None: taken as it is).
_YAML_FIELDS = {
    "name": ("name", None),
    "nodes": ("nodes", None),
    "devices_per_node": ("devices_per_node", None),
    "device_memory_gb": ("device_memory_bytes", lambda v: v * 1e9),
    "intra_node_bandwidth_gbytes_per_s": ("intra_node_bandwidth", lambda v: v * 1e9),
    "inter_node_bandwidth_gbit_per_s": ("inter_node_bandwidth", lambda v: v * 1e9 / 8),
    "intra_node_latency_us": ("intra_node_latency", lambda v: v / 1e6),
    "inter_node_latency_us": ("inter_node_latency", lambda v: v / 1e6),
    "efficiency": ("efficiency", float),
    "a2a_extra_message_cost": ("a2a_extra_message_cost", float),
}


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Nodes, devices and link figures of a cluster. Bandwidths are bytes/s per direction.

    Attributes:
      nodes: hosts (the mesh's 'node' axis).
      devices_per_node: accelerators per host (the mesh's 'local' axis).
      device_memory_bytes: memory one device may spend on embedding weights + optimizer state.
      intra_node_bandwidth: bytes/s one device sends to its node's peers (NVLink 4 on H100 SXM:
        900 GB/s bidirectional = 450 GB/s per direction).
      inter_node_bandwidth: bytes/s one NODE sends to other nodes: the NIC line rate, shared by the
        node's devices (400 Gbit/s = 50e9 B/s).
      intra_node_latency: seconds per message over the intra-node link.
      inter_node_latency: seconds per message across nodes.
      efficiency: fraction of the line rates that collectives reach (1.0 = line rate).
      a2a_extra_message_cost: what each further message of one grouped all-to-all adds to its latency,
        as a fraction of one message's latency: 1.0 = additive (G-1 messages cost (G-1) x latency, the
        plain alpha-beta rule); 0.0 = every message posted at once (one latency whatever G). Measured on
        the emulated cluster: experiments/scaling/latency.json.
      name: a label (the preset's name when loaded from meshes/).
    """

    nodes: int
    devices_per_node: int
    device_memory_bytes: float = 80e9
    intra_node_bandwidth: float = 450e9
    inter_node_bandwidth: float = 400e9 / 8
    intra_node_latency: float = 3e-6
    inter_node_latency: float = 10e-6
    efficiency: float = 1.0
    a2a_extra_message_cost: float = 1.0
    name: str = ""

    def __post_init__(self):
        for field in ("nodes", "devices_per_node"):
            value = getattr(self, field)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ClusterSpec.{field} must be a positive integer, got {value!r}")
            object.__setattr__(self, field, int(value))
        for field in ("device_memory_bytes", "intra_node_bandwidth", "inter_node_bandwidth"):
            _check_number(field, getattr(self, field), positive=True)
        for field in ("intra_node_latency", "inter_node_latency"):
            _check_number(field, getattr(self, field), positive=False)
        _check_number("efficiency", self.efficiency, positive=True)
        if self.efficiency > 1:
            raise ValueError(f"ClusterSpec.efficiency must be in (0, 1], got {self.efficiency!r}")
        _check_number("a2a_extra_message_cost", self.a2a_extra_message_cost, positive=False)
        if self.a2a_extra_message_cost > 1:
            raise ValueError(
                f"ClusterSpec.a2a_extra_message_cost must be in [0, 1], got {self.a2a_extra_message_cost!r}"
            )
        if not isinstance(self.name, str):
            raise ValueError(f"ClusterSpec.name must be a string, got {self.name!r}")

    # ------------------------------------------------------------------ derived figures

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def intra_bandwidth_per_device(self) -> float:
        """Achievable bytes/s one device sends inside its node."""
        return self.intra_node_bandwidth * self.efficiency

    @property
    def inter_bandwidth_per_device(self) -> float:
        """Achievable bytes/s one device sends across nodes while all its node's devices do the same."""
        return self.inter_node_bandwidth * self.efficiency / self.devices_per_node

    def topology(self, name: str) -> Topology:
        """What topology `name` means on this cluster's (nodes, devices_per_node) mesh."""
        return Topology(name, self.nodes, self.devices_per_node)

    def with_nodes(self, nodes: int) -> ClusterSpec:
        """The same hardware with another node count (weak-scaling studies)."""
        return dataclasses.replace(self, nodes=nodes, name=f"{self.name}@{nodes}" if self.name else "")

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_yaml(cls, name_or_path: str | Path, **overrides) -> ClusterSpec:
        """A cluster from `meshes/<name>.yaml` (e.g. '8x8') or from a YAML file path.

        Keys carry their units (see meshes/*.yaml); unknown keys and bad values raise a ValueError that
        names the key and the file. `overrides` replace fields (SI units) after loading.
        """
        import yaml

        path = _resolve(name_or_path)
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of cluster fields, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(_YAML_FIELDS))
        if unknown:
            raise ValueError(f"{path}: unknown key(s) {unknown}; known keys: {sorted(_YAML_FIELDS)}")
        kwargs = {}
        for key, value in raw.items():
            field, to_si = _YAML_FIELDS[key]
            if to_si is not None:
                if not isinstance(value, numbers.Real) or isinstance(value, bool):
                    raise ValueError(f"{path}: {key} must be a number, got {value!r}")
                value = to_si(value)
            kwargs[field] = value
        kwargs.setdefault("name", path.stem)
        kwargs.update(overrides)
        try:
            return cls(**kwargs)
        except TypeError as e:  # a required field is missing
            raise ValueError(f"{path}: {e}") from e
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    @classmethod
    def named(cls, name: str, **overrides) -> ClusterSpec:
        """A preset of meshes/ by name, e.g. `ClusterSpec.named('8x8', inter_node_bandwidth=12.5e9)`."""
        return cls.from_yaml(name, **overrides)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def known_clusters() -> list[str]:
    """Names of the presets in meshes/."""
    return sorted(p.stem for p in _MESHES_DIR.glob("*.yaml"))


def _resolve(name_or_path) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise ValueError(f"cluster file {str(path)!r} does not exist")
        return path
    preset = _MESHES_DIR / f"{name_or_path}.yaml"
    if not preset.exists():
        raise ValueError(f"unknown cluster {str(name_or_path)!r}; known presets: {known_clusters()}")
    return preset


def _check_number(field: str, value, positive: bool) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > 0 if positive else value >= 0)
    if not ok:
        need = "a positive" if positive else "a non-negative"
        raise ValueError(f"ClusterSpec.{field} must be {need} finite number, got {value!r}")
