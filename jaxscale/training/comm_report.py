"""What one training step sends, per collective, from the compiled train step (nothing is trained).

    python -m jaxscale.comm_report --config jaxscale/configs/foundation_smoke.yaml mesh.nodes=2 mesh.local=4
    python -m jaxscale.comm_report --config ... embedding.comm.forward=fp8 --json

Sets the simulated CPU device count to nodes x local before JAX starts, builds the `Trainer`, compiles the
donated train step (`Trainer.compile`) and reads its collectives from the compiled HLO
(`jaxscale.engine.comm_inspect`). For every collective: kind, wire dtype, bytes one device sends, and where
those bytes go; per step: intra-node and inter-node bytes per device, for the whole cluster, and per
example of the global batch.

Intra/inter split. `comm_inspect` marks a whole collective cross-node when one of its groups spans
nodes; a 1d all-to-all over every device then counts its same-node peers as cross-node too. Here the
bytes of each collective are split by where they actually go, for the most-loaded device:
  all-to-all      R/G to each peer: inter = R/G x (peers on other nodes), intra = R/G x (same-node peers);
  all-reduce      hierarchical (reduce-scatter inside the node, all-reduce across nodes over 1/m of the
                  data, all-gather inside the node): intra 2(m-1)/m R, inter 2(k-1)/k R/m;
  all-gather      inter (k-1)/k R/m, intra (m-1)/m R;   reduce-scatter inter (k-1) R, intra (m-1) k R;
  permute         R, inter when the pair spans nodes;
with G = k x m group members over k nodes, m per node (groups are regular on a jaxscale mesh). The two
parts always add up to comm_inspect's bytes per device (ring byte model), so totals agree with it.

Categories (used by experiments/scaling): 'emb_ids' (all-to-alls of signed ints, or of buffers without a
row axis: row ids / narrow (row, bag) pairs to the owners), 'emb_rows' (float/bitcast all-to-alls of
[.., .., width] buffers: looked-up rows forward, their gradients backward),
'replica_sync' (collectives over the replica axes of a 2D topology: exact sparse sync or periodic
averaging), 'dense_grad' (the largest all-reduce: data-parallel dense gradients; XLA combines into it whatever else
is all-reduced in the backward pass), 'model_gather' (other all-gathers/all-reduces of float arrays the
model needs, e.g. the in-batch negative pool), 'scalars' (metrics and counters).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import defaultdict

CATEGORIES = ("emb_ids", "emb_rows", "replica_sync", "dense_grad", "model_gather", "scalars", "other")
SCALAR_BYTES = 1024


def _set_device_count(n: int) -> None:
    """Simulated CPU devices = n; a no-op check when the backend already runs (e.g. under pytest)."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", int(n))
    except RuntimeError:
        pass
    have = jax.device_count()
    if have < n:
        raise RuntimeError(
            f"comm_report needs {n} devices for the mesh but JAX already started with {have}; run it in a "
            f"fresh process (python -m jaxscale.comm_report sets the count before JAX starts)"
        )


def group_layout(group, mesh_shape) -> tuple[int, int, dict]:
    """(k nodes, m max members per node, {node: members}) of one replica group."""
    from jaxscale.engine.mesh import node_of_position

    per_node = defaultdict(int)
    for p in group:
        per_node[node_of_position(p, mesh_shape)] += 1
    return len(per_node), max(per_node.values()), per_node


def split_bytes(c, mesh_shape) -> tuple[float, float]:
    """(intra-node, inter-node) bytes the most-loaded device sends for collective `c` (see module doc)."""
    total = float(c.bytes_per_device)
    if total == 0 or not c.groups:
        return 0.0, 0.0
    R = float(c.result_bytes)
    if c.kind == "collective-permute":
        cross = any(group_layout(pair, mesh_shape)[0] > 1 for pair in c.groups)
        return (0.0, total) if cross else (total, 0.0)
    best = (0.0, 0.0)
    for g in c.groups:
        k, m, per_node = group_layout(g, mesh_shape)
        G = len(g)
        if k == 1:
            split = (total, 0.0)
        elif c.kind in ("all-to-all", "ragged-all-to-all"):
            m_min = min(per_node.values())  # a device on the smallest node has the most remote peers
            inter = R / G * (G - m_min)
            split = (total - inter, inter)
        elif c.kind == "all-reduce":
            inter = 2 * (k - 1) / k * R / m
            split = (total - inter, inter)
        elif c.kind == "all-gather":
            inter = (k - 1) / k * R / m
            split = (total - inter, inter)
        elif c.kind == "reduce-scatter":
            inter = (k - 1) * R
            split = (total - inter, inter)
        else:
            split = (0.0, total)
        if split[1] > best[1] or best == (0.0, 0.0):
            best = split
    return max(best[0], 0.0), best[1]


def categorize(c, replica_groups: frozenset, largest_all_reduce: str | None = None) -> str:
    """The category of a collective (see module doc). `largest_all_reduce` names the dense-gradient one."""
    groups = frozenset(frozenset(g) for g in c.groups)
    if replica_groups and groups == replica_groups:  # the owner sync's all-to-all included
        return "replica_sync"
    if c.kind in ("all-to-all", "ragged-all-to-all"):
        # ids: signed ints, or u16 buffers without a row axis (narrow pairs); rows are [.., .., width]
        integer = all(dt.startswith("s") or dt == "pred" for dt in c.dtypes)
        flat = all(dt == "u16" and len(s) <= 2 for dt, s in zip(c.dtypes, c.shapes))
        return "emb_ids" if integer or flat else "emb_rows"
    if c.kind == "all-reduce" and c.name == largest_all_reduce and c.result_bytes >= SCALAR_BYTES:
        return "dense_grad"
    has_array = any(len(s) >= 1 and dt.startswith(("f", "bf")) for dt, s in zip(c.dtypes, c.shapes))
    if c.kind in ("all-gather", "all-reduce") and has_array:
        return "model_gather"  # e.g. the in-batch negative pool (GSPMD all-gather or masked all-reduce)
    if c.result_bytes < SCALAR_BYTES:
        return "scalars"
    return "other"


def replica_groups(topology) -> frozenset:
    """The replica groups of the collection's `Topology` as sets of flat mesh positions (empty: no replicas)."""
    return frozenset(frozenset(g) for g in topology.replica_groups() if len(g) > 1)


def comm_report(cfg) -> dict:
    """Compiles the train step of `cfg` (without training) and returns what one step sends.

    Returns a dict with 'config' (mesh, topology, precisions, batch), 'collectives' (one dict per
    collective: name, kind, dtypes, shapes, group_size, bytes_per_device, intra_node, inter_node, where,
    category) and 'per_step' (per-device intra/inter bytes, cluster totals, per-example bytes, and
    per-category sums). Bytes are those of the compiled HLO: low-precision payloads are bitcast to
    unsigned ints before every collective, so they are also what a GPU would send.
    """
    nodes, local = cfg.mesh.nodes, cfg.mesh.local
    _set_device_count(nodes * local)
    from jaxscale.engine import comm_inspect
    from jaxscale.training.run import plan_run
    from jaxscale.training.trainer import Trainer

    cfg, plan = plan_run(cfg, log=None)  # the plan the trainer runs: the planner's, for topology=auto
    trainer = Trainer(cfg, plan=plan, log=False, progress=False)
    state = trainer.init_state()
    batch = trainer.batch(0)
    compiled = trainer.compile(state, batch)
    collectives = trainer.collectives
    mesh_shape = tuple(trainer.mesh.devices.shape)
    reps = replica_groups(trainer.ec.topology)
    rows, by_cat = [], defaultdict(lambda: {"intra_node": 0.0, "inter_node": 0.0, "count": 0})
    reduces = [c for c in collectives if c.kind == "all-reduce"]
    largest = max(reduces, key=lambda c: c.result_bytes).name if reduces else None
    for c in collectives:
        intra, inter = split_bytes(c, mesh_shape)
        cat = categorize(c, reps, largest)
        where = "intra" if inter == 0 else ("inter" if intra == 0 else "mixed")
        rows.append(
            {
                "name": c.name,
                "kind": c.kind,
                "dtypes": list(c.dtypes),
                "shapes": [list(s) for s in c.shapes],
                "group_size": c.group_size,
                "result_bytes": c.result_bytes,
                "bytes_per_device": float(c.bytes_per_device),
                "intra_node": intra,
                "inter_node": inter,
                "where": where,
                "spans_nodes": bool(c.cross_node),
                "category": cat,
            }
        )
        by_cat[cat]["intra_node"] += intra
        by_cat[cat]["inter_node"] += inter
        by_cat[cat]["count"] += 1
    devices = nodes * local
    gb = cfg.train.batch_size
    intra = sum(r["intra_node"] for r in rows)
    inter = sum(r["inter_node"] for r in rows)
    inspect = comm_inspect.summarize(collectives)
    del compiled, state
    e = trainer.ec.settings  # what ran (topology=auto resolved)
    reshapes = sorted({t.reshape for t in trainer.tables if t.reshape})
    return {
        "config": {
            "nodes": nodes,
            "local": local,
            "devices": devices,
            "topology": e.topology,
            "sharding": e.sharding if isinstance(e.sharding, str) else dict(e.sharding),
            "plan_file": e.plan_file,
            "plan": trainer.ec.plan.to_dict(),  # what ran: for topology=auto the plan the planner scored
            "comm_forward": e.comm.forward,
            "comm_backward": e.comm.backward,
            "comm": dataclasses.asdict(e.comm),
            "capacity_factor": e.capacity_factor,
            "replica_sync": e.replica_sync.to_tree(),
            "model": cfg.model.kind,
            "global_batch": gb,
            "batch_per_device": gb // devices,
            "item_reshape": reshapes[0] if reshapes else None,  # the tables' bandwidth-aware reshape, if any
            "capacities": str(batch.ids.capacities),
        },
        "collectives": rows,
        "per_step": {
            "intra_node_bytes_per_device": intra,
            "inter_node_bytes_per_device": inter,
            "total_bytes_per_device": intra + inter,
            "intra_node_bytes_cluster": intra * devices,
            "inter_node_bytes_cluster": inter * devices,
            "intra_node_bytes_per_example": intra * devices / gb,
            "inter_node_bytes_per_example": inter * devices / gb,
            "comm_inspect_cross_node": inspect["cross_node"],  # whole collectives that span nodes
            "comm_inspect_intra_node": inspect["intra_node"],
            "by_category": {k: dict(v) for k, v in by_cat.items()},
        },
    }


def _payload(r) -> str:
    shapes, dts = r["shapes"], r["dtypes"]
    if len(shapes) > 1 and len({tuple(s) for s in shapes}) == 1 and len(set(dts)) == 1:
        return f"{len(shapes)}x{dts[0]}{shapes[0]}"
    return ",".join(f"{d}{s}" for d, s in zip(dts, shapes))


def format_report(rep: dict) -> str:
    c, s = rep["config"], rep["per_step"]
    head = (
        f"{'name':<22} {'kind':<14} {'dtype':<5} {'payload':<22} {'grp':>3} {'where':<5} "
        f"{'bytes/device':>13} {'intra B':>12} {'inter B':>12} category"
    )
    lines = [
        f"mesh {c['nodes']}x{c['local']} topology {c['topology']} comm {c['comm_forward']}/{c['comm_backward']} "
        f"capacity_factor {c['capacity_factor']} reshape {c['item_reshape']} global batch {c['global_batch']} "
        f"({c['batch_per_device']}/device)",
        head,
        "-" * len(head),
    ]
    for r in rep["collectives"]:
        dt = "/".join(sorted(set(r["dtypes"])))
        lines.append(
            f"{r['name'][:22]:<22} {r['kind'][:14]:<14} {dt[:5]:<5} {_payload(r)[:22]:<22} "
            f"{r['group_size']:>3} {r['where']:<5} {r['bytes_per_device']:>13,.0f} "
            f"{r['intra_node']:>12,.0f} {r['inter_node']:>12,.0f} {r['category']}"
        )
    lines.append("-" * len(head))
    lines.append(
        f"per step, per device: intra-node {s['intra_node_bytes_per_device']:,.0f} B, inter-node "
        f"{s['inter_node_bytes_per_device']:,.0f} B"
    )
    lines.append(
        f"per step, cluster:    intra-node {s['intra_node_bytes_cluster']:,.0f} B, inter-node "
        f"{s['inter_node_bytes_cluster']:,.0f} B"
    )
    lines.append(
        f"per example:          intra-node {s['intra_node_bytes_per_example']:,.1f} B, inter-node "
        f"{s['inter_node_bytes_per_example']:,.1f} B"
    )
    cats = ", ".join(f"{k} {v['intra_node'] + v['inter_node']:,.0f}" for k, v in sorted(s["by_category"].items()))
    lines.append(f"by category (B/device): {cats}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxscale.comm_report",
        description="Bytes per collective of the compiled train step (no training).",
    )
    p.add_argument("--config", default=None, help="YAML config (default: the smoke foundation config)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. embedding.topology=2d_a2a")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    from jaxscale.training.config import ConfigError, load_config
    from jaxscale.training.run import DEFAULT_CONFIG

    try:
        cfg = load_config(args.config or DEFAULT_CONFIG, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    _set_device_count(cfg.mesh.nodes * cfg.mesh.local)  # before anything initialises the backend
    rep = comm_report(cfg)
    if args.json:
        print(json.dumps(rep, indent=1, default=lambda o: None if isinstance(o, float) and not math.isfinite(o) else o))
    else:
        print(format_report(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
