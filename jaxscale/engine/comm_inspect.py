"""What a jitted step sends over the network, read from its HLO.

Bytes per collective are exact and deterministic, unlike wall-clock on simulated CPU devices, so tests
and benchmarks compare communication through this module. Replica-group ids in the HLO are flat
positions in `mesh.devices` (not `device.id`); a collective is cross-node when one of its groups has
members with different `node` coordinates.

Two stages: 'compiled' is what this backend really moves (XLA:CPU upcasts bf16/f8 collectives), and
'lowered' is the pre-optimisation HLO with the intended dtypes (what a GPU would send; collectives that
GSPMD inserts appear only in the compiled HLO). A collective inside a loop body is listed once.

Bytes per device, with G the group size and R the result bytes:
all-to-all (G-1)/G*R, all-reduce (ring) 2(G-1)/G*R, all-gather (G-1)/G*R, reduce-scatter (G-1)*R,
collective-permute R. ragged-all-to-all is counted like all-to-all on its output buffer (an upper bound).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

from jaxscale.engine.mesh import NODE

KINDS = ("all-to-all", "ragged-all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute")
STAGES = ("compiled", "lowered")

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
    "f16": 2,
    "bf16": 2,
    "f32": 4,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "s4": 0.5,
    "u4": 0.5,
}
# `%name = <shape> <kind>[-start](` ; names carry '%' in compiled HLO, not in the lowered one.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>(?:[^=]|/\*index=\d+\*/)*?)\s+"
    r"(?P<kind>ragged-all-to-all|all-to-all|all-reduce|all-gather|reduce-scatter|collective-permute)"
    r"(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_IOTA = re.compile(r"(?:\[([\d,]+)\]<=)?\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_AXIS = re.compile(r"'?([^'=,\s]+)'?=(\d+)")
_AXIS_REF = re.compile(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?")


@dataclasses.dataclass
class Collective:
    """One collective of an HLO module.

    Attributes:
      kind: 'all-to-all', 'all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute' or
        'ragged-all-to-all' (an async '-start' op reports its base kind).
      dtypes / shapes: of the result arrays (a CPU all-to-all is a tuple of one array per peer).
      group_size: devices per replica group (2 for a collective-permute pair).
      groups: the replica groups as flat mesh positions (source-target pairs for a permute).
      result_bytes: bytes of the result on one device.
      bytes_per_device: bytes one device sends under the module's byte model.
      cross_node: whether any group spans more than one node.
      name: the HLO instruction name.
    """

    kind: str
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_size: int
    groups: tuple[tuple[int, ...], ...]
    result_bytes: int
    bytes_per_device: float
    cross_node: bool
    name: str


def list_collectives(
    fn_or_compiled_or_text, *args, mesh, stage: str = "compiled", node_axis: str = NODE, **kwargs
) -> list[Collective]:
    """The collectives of a jitted function called on `args`/`kwargs`, of a `Compiled` or `Lowered`, or
    of HLO text.

    `mesh` maps replica-group positions to nodes. `stage` picks the compiled HLO (what this backend
    moves) or the lowered, pre-optimisation HLO (the intended dtypes); it is ignored for HLO text and
    for a `Compiled`.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    return parse_hlo(_hlo_text(fn_or_compiled_or_text, args, kwargs, stage), mesh, node_axis)


def _hlo_text(obj, args, kwargs, stage: str) -> str:
    import jax

    if isinstance(obj, str):
        return obj
    if isinstance(obj, jax.stages.Compiled):
        return obj.as_text()
    if isinstance(obj, jax.stages.Lowered):
        lowered = obj
    elif callable(obj):
        jitted = obj if hasattr(obj, "lower") else jax.jit(obj)
        lowered = jitted.lower(*args, **kwargs)
    else:
        raise TypeError(f"expected a function, jax.stages.Compiled/Lowered or HLO text, got {type(obj)}")
    if stage == "lowered":
        return lowered.compiler_ir("hlo").as_hlo_text()
    return lowered.compile().as_text()


def parse_hlo(text: str, mesh, node_axis: str = NODE) -> list[Collective]:
    """The collectives in HLO `text` (every computation), in order of appearance."""
    mesh_shape = tuple(mesh.devices.shape)
    num_devices = int(np.prod(mesh_shape))
    node_dim = list(mesh.axis_names).index(node_axis) if node_axis in mesh.axis_names else None
    found = []
    for line in text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        kind, is_start = match["kind"], bool(match["start"])
        arrays = [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(match["shape"])]
        arrays = _result_arrays(kind, is_start, arrays)
        attributes = line[match.end() :]
        if kind == "collective-permute":
            pairs = _braced_attribute(attributes, "source_target_pairs")
            groups = _parse_nested_braces(pairs) if pairs else ()
            group_size = 2
        else:
            groups = _parse_replica_groups(attributes, num_devices)
            group_size = len(groups[0]) if groups else 1
        if any(p >= num_devices for g in groups for p in g):
            raise ValueError(f"{match['name']}: replica group position >= {num_devices} devices of the mesh")
        result_bytes = int(sum(_element_bytes(dt) * math.prod(shape) for dt, shape in arrays))
        cross = node_dim is not None and any(_spans_nodes(g, mesh_shape, node_dim) for g in groups)
        found.append(
            Collective(
                kind=kind,
                dtypes=tuple(dt for dt, _ in arrays),
                shapes=tuple(shape for _, shape in arrays),
                group_size=group_size,
                groups=groups,
                result_bytes=result_bytes,
                bytes_per_device=_bytes_per_device(kind, group_size, result_bytes),
                cross_node=cross,
                name=match["name"],
            )
        )
    return found


def _spans_nodes(group: tuple[int, ...], mesh_shape: tuple[int, ...], node_dim: int) -> bool:
    return len({int(np.unravel_index(p, mesh_shape)[node_dim]) for p in group}) > 1


def _element_bytes(dtype: str) -> float:
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return {"f8": 1, "f6": 0.75, "f4": 0.5}[dtype[:2]]
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return _DTYPE_BYTES[dtype]


def _result_arrays(kind: str, is_start: bool, arrays: list) -> list:
    """The arrays a collective delivers; async '-start' results also carry operands and contexts."""
    if not is_start or kind == "all-reduce":
        return arrays
    if kind == "all-gather":  # (operands..., results...)
        return arrays[len(arrays) // 2 :]
    if kind == "collective-permute":  # (operand, result, u32[] contexts...)
        return arrays[1:2]
    return arrays


def _bytes_per_device(kind: str, group_size: int, result_bytes: int) -> float:
    g = group_size
    if kind == "collective-permute":
        return float(result_bytes)
    if g <= 1:
        return 0.0
    if kind in ("all-to-all", "ragged-all-to-all", "all-gather"):
        return (g - 1) / g * result_bytes
    if kind == "all-reduce":
        return 2 * (g - 1) / g * result_bytes
    return float((g - 1) * result_bytes)  # reduce-scatter: result is one shard


def _closing(text: str, i: int) -> int:
    """Index just past the bracket expression that opens at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] in "{[(":
            depth += 1
        elif text[j] in "}])":
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError(f"unbalanced brackets in {text[i : i + 80]!r}")


def _parse_nested_braces(value: str) -> tuple[tuple[int, ...], ...]:
    """'{{0,1},{2,3}}' -> ((0, 1), (2, 3))."""
    return tuple(tuple(int(v) for v in g.split(",") if v.strip()) for g in re.findall(r"\{([\d,\s]*)\}", value[1:-1]))


def _braced_attribute(attributes: str, key: str) -> str | None:
    start = attributes.find(key + "={")
    if start < 0:
        return None
    i = start + len(key) + 1
    return attributes[i : _closing(attributes, i)]


def _parse_replica_groups(attributes: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """All three replica_groups syntaxes; a missing or empty list means one group of every device."""
    start = attributes.find("replica_groups=")
    if start < 0:
        return (tuple(range(num_devices)),)
    i = start + len("replica_groups=")
    if attributes.startswith("{", i):  # {{0,1},{2,3}}
        groups = _parse_nested_braces(attributes[i : _closing(attributes, i)])
        return groups if any(groups) else (tuple(range(num_devices)),)
    if attributes.startswith("[", i):  # [2,4]<=[8] or [4,2]<=[2,4]T(1,0)
        match = _IOTA.match(attributes, i)
        if match is None or not match[1]:
            raise ValueError(f"unrecognised iota replica groups: {attributes[i : i + 80]!r}")
        return _rows(_iota(match[0]))
    if attributes.startswith("mesh[", i):  # mesh['a'=2,'b'=4], device_ids=(...) {'b'}
        mesh_end = _closing(attributes, i + 4)
        mesh_spec, device_ids = attributes[i + 5 : mesh_end - 1], None
        rest = re.match(r",\s*device_ids=", attributes[mesh_end:])
        j = mesh_end
        if rest:
            j = mesh_end + rest.end()
            close = _closing(attributes, j)
            device_ids, j = attributes[j + 1 : close - 1], close
        axes = re.match(r"\s*\{([^}]*)\}", attributes[j:])
        if axes is None:
            raise ValueError(f"mesh replica groups without axes: {attributes[i : i + 120]!r}")
        return _mesh_axes_groups(mesh_spec, device_ids, axes[1])
    raise ValueError(f"unrecognised replica_groups syntax: {attributes[i : i + 80]!r}")


def _rows(ids: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(v) for v in row) for row in ids.reshape(ids.shape[0], -1))


def _iota(spec: str) -> np.ndarray:
    """'[4,2]<=[2,4]T(1,0)': iota over the reshape dims, transposed, reshaped to the group shape.

    Without the '[shape]<=' prefix (a mesh's device_ids) the result is flat.
    """
    match = _IOTA.fullmatch(spec.strip())
    if match is None:
        raise ValueError(f"unrecognised iota device list: {spec!r}")
    shape = [int(v) for v in match[1].split(",")] if match[1] else [-1]
    dims = [int(v) for v in match[2].split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if match[3]:
        ids = ids.transpose([int(v) for v in match[3].split(",")])
    return ids.reshape(shape)


def _mesh_axes_groups(mesh_spec: str, device_ids: str | None, axes: str) -> tuple[tuple[int, ...], ...]:
    """Groups of "mesh[<mesh_spec>], device_ids=(<device_ids>) {<axes>}": devices that differ only along
    the braced axes, which vary fastest in the order listed (as XLA's MeshAxesReplicaGroupList).

    A sub-axis 'b':(pre)size splits axis b into [pre, size, rest] pieces; the group spans `size`.
    """
    names, sizes = zip(*[(n, int(s)) for n, s in _MESH_AXIS.findall(mesh_spec)])
    if device_ids is None:
        ids = np.arange(math.prod(sizes))
    elif "[" in device_ids:
        ids = _iota(device_ids)
    else:
        ids = np.array([int(v) for v in re.findall(r"\d+", device_ids)])
    refs = [(n, int(pre) if pre else None, int(sz) if sz else None) for n, pre, sz in _AXIS_REF.findall(axes) if n]
    # Split every mesh axis into pieces so each referenced (sub-)axis is exactly one piece.
    pieces, grouped = [], []
    for name, size in zip(names, sizes):
        subs = sorted((pre, sz, i) for i, (n, pre, sz) in enumerate(refs) if n == name and pre is not None)
        full = [i for i, (n, pre, _) in enumerate(refs) if n == name and pre is None]
        if full:
            grouped.append((full[0], len(pieces)))
            pieces.append(size)
            continue
        covered = 1
        for pre, sz, ref_index in subs:
            if pre != covered:
                pieces.append(pre // covered)
                covered = pre
            grouped.append((ref_index, len(pieces)))
            pieces.append(sz)
            covered *= sz
        if covered != size:
            pieces.append(size // covered)
    if len(grouped) != len(refs):
        raise ValueError(f"replica group axes {axes!r} do not name axes of {names}")
    group_axes = [piece for _, piece in sorted(grouped)]  # in the order the braces list them
    others = [i for i in range(len(pieces)) if i not in group_axes]
    arranged = ids.reshape(pieces).transpose(others + group_axes)
    group_size = math.prod(pieces[i] for i in group_axes)
    return tuple(tuple(int(v) for v in row) for row in arranged.reshape(-1, group_size))


def summarize(collectives: list[Collective]) -> dict:
    """Bytes one device sends, split intra-node / cross-node, in total and per kind."""
    by_kind = defaultdict(lambda: {"intra_node": 0.0, "cross_node": 0.0, "count": 0})
    for c in collectives:
        entry = by_kind[c.kind]
        entry["cross_node" if c.cross_node else "intra_node"] += c.bytes_per_device
        entry["count"] += 1
    intra = sum(e["intra_node"] for e in by_kind.values())
    cross = sum(e["cross_node"] for e in by_kind.values())
    return {
        "intra_node": intra,
        "cross_node": cross,
        "total": intra + cross,
        "count": len(collectives),
        "by_kind": dict(by_kind),
    }


def format_table(collectives: list[Collective]) -> str:
    """A fixed-width table, one collective per line, with a total line."""
    header = f"{'name':<28} {'kind':<18} {'payload':<24} {'group':>5} {'where':<6} {'bytes/device':>14}"
    lines = [header, "-" * len(header)]
    for c in collectives:
        if len(set(c.shapes)) == 1 and len(set(c.dtypes)) == 1 and len(c.shapes) > 1:
            payload = f"{len(c.shapes)}x{c.dtypes[0]}{list(c.shapes[0])}"
        else:
            payload = ",".join(f"{dt}{list(s)}" for dt, s in zip(c.dtypes, c.shapes))
        where = "cross" if c.cross_node else "intra"
        lines.append(
            f"{c.name[:28]:<28} {c.kind:<18} {payload[:24]:<24} {c.group_size:>5} {where:<6} "
            f"{c.bytes_per_device:>14,.0f}"
        )
    s = summarize(collectives)
    lines.append("-" * len(header))
    lines.append(
        f"total: {s['count']} collectives, intra-node {s['intra_node']:,.0f} B, "
        f"cross-node {s['cross_node']:,.0f} B per device"
    )
    return "\n".join(lines)
