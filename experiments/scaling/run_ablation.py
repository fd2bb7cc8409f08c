"""Regenerates experiments/scaling/RESULTS.md and ablation.png.

    python experiments/scaling/run_ablation.py            # uses compiled_bytes.json (collect.py) if present

1. Compiled bytes: every distinct stage's train step on the 2x4 and 4x2 CPU meshes (collect.py ->
   compiled_bytes.json), tiny foundation model.
2. Cross-check: the closed-form bytes of model.step_bytes for the same tiny shape against the compiled
   per-category bytes (must agree exactly, else the extrapolation is wrong and this script says so).
3. Extrapolation: the same formulas for the large preset (foundation_large.yaml: 32 sequences x 2048
   events per GPU, 2 x 100M x 64 tables, ~150M dense parameters), at 1..64 nodes x 8 GPUs.
4. Alpha-beta step time per fabric and compute assumption; weak-scaling speedups; table + plot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

import model as M  # noqa: E402
from stages import CAPACITY_FACTOR, STAGES, TINY, TINY_BATCH, effective_tiny  # noqa: E402

NODES = [1, 2, 4, 8, 16, 32, 64]
LOCAL = 8
PUBLISHED = {"before": {2: 1.13, 4: 1.21}, "after": {2: 2.0, 4: 3.9, 8: 7.5}}
CATS = ("emb_ids", "emb_rows", "replica_sync", "dense_grad", "model_gather")


def dense_params(fcfg) -> int:
    """fp32 dense parameters of the foundation model (abstract: nothing is allocated)."""
    import jax
    from flax import nnx

    from models.foundation import FoundationModel

    abstract = nnx.eval_shape(lambda: FoundationModel(fcfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    return int(sum(int(x.size) for x in jax.tree.leaves(params)))


def shape_of(fcfg, batch_per_device: int) -> M.Shape:
    return M.Shape(
        batch=batch_per_device,
        seq_len=fcfg.max_seq_len,
        tables=fcfg.num_item_tables,
        dim=fcfg.item_dim,
        rows=fcfg.item_rows,
        capacity_factor=CAPACITY_FACTOR,
        dense_params=dense_params(fcfg),
        item_out_dim=fcfg.item_out_dim,
        max_negatives=fcfg.max_negatives,
    )


def cross_check(compiled: dict) -> list[dict]:
    """Formula vs compiled bytes, per mesh, stage and category."""
    from models.foundation import FoundationConfig

    tiny = {h: shape_of(FoundationConfig(**effective_tiny({"half_dim": h})), None) for h in (False, True)}
    rows = []
    for key, rep in sorted(compiled.items()):
        mesh, topo, fwd, bwd, half = key.split("|")
        nodes, local = map(int, mesh.split("x"))
        sh = M.Shape(**{**tiny[half == "True"].__dict__, "batch": TINY_BATCH // (nodes * local)})
        # half_dim is compiled as the equivalent dim/2 x rows*2 tables (stages.effective_tiny)
        pred = M.step_bytes(sh, nodes, local, topo, fwd, bwd, False)
        got = rep["per_step"]["by_category"]
        for cat in CATS:
            g = got.get(cat, {"intra_node": 0.0, "inter_node": 0.0})
            rows.append(
                {
                    "mesh": mesh,
                    "topology": topo,
                    "comm": f"{fwd}/{bwd}",
                    "half_dim": half == "True",
                    "category": cat,
                    "compiled": (g["intra_node"], g["inter_node"]),
                    "formula": pred[cat],
                }
            )
    return rows


EXACT = ("emb_ids", "emb_rows", "replica_sync")


def agrees(c: dict) -> bool:
    """Embedding categories must match to the byte; dense/model ones within 1% (combined scalars)."""
    tol = 1e-9 if c["category"] in EXACT else 0.01
    return all(abs(a - b) <= tol * max(1.0, abs(a)) for a, b in zip(c["compiled"], c["formula"]))


def imbalance(topology: str, nodes: int, local: int, contiguous: bool, half_dim: bool, fcfg, batch: int) -> float:
    """max/mean bytes a shard serves under the planner's cost model, Zipf(1.1) ids with the hottest ids at the
    lowest rows (un-hashed catalogue ids: the worst case for contiguous blocks)."""
    from jaxscale.plan import resolve_plan
    from jaxscale.planner import FeatureStats, Topology, report
    from models.foundation import foundation_tables

    tables = foundation_tables(fcfg.__class__(**{**fcfg.__dict__, "item_reshape": "half_dim" if half_dim else None}))
    S, _ = M.shard_group(topology, nodes, local)
    if S == 1:
        return 1.0
    stats = {t.features[0]: FeatureStats.zipf(t.rows, fcfg.max_seq_len, 1.1) for t in tables}
    topo = Topology(nodes, local, 80e9, name=topology)
    plan = resolve_plan(tables, topology, nodes, local, "row_wise")
    r = report(plan, tables, stats, topo, batch, row_assignment="contiguous" if contiguous else "modulo")
    return r.bytes_imbalance


def predict(large: M.Shape, fcfg, compute_s: float, links: M.Links, imb_cache: dict) -> dict:
    out = {}
    for name, st in STAGES:
        times = {}
        for n in NODES:
            key = (st["topology"], n, not st["balanced"], st["half_dim"])
            if key not in imb_cache:
                imb_cache[key] = imbalance(
                    st["topology"], n, LOCAL, not st["balanced"], st["half_dim"], fcfg, large.batch
                )
            b = M.step_bytes(large, n, LOCAL, st["topology"], st["fwd"], st["bwd"], st["half_dim"])
            times[n] = M.step_time(b, compute_s, links, n, LOCAL, imbalance=imb_cache[key])
        out[name] = {"times": times, "speedup": M.speedup({n: t["total"] for n, t in times.items()})}
    return out


def fmt_bytes(x: float) -> str:
    for unit, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= s:
            return f"{x / s:.2f} {unit}"
    return f"{x:.0f} B"


def main():
    cache = os.path.join(HERE, "compiled_bytes.json")
    if not os.path.exists(cache) or "--recompile" in sys.argv:
        subprocess.run([sys.executable, os.path.join(HERE, "collect.py")], check=True, cwd=ROOT)
    compiled = json.load(open(cache))
    from models.foundation import FoundationConfig

    checks = cross_check(compiled)
    bad = [c for c in checks if not agrees(c)]

    fl = FoundationConfig.large()
    large = shape_of(fl, 2048 // 64)
    compute = {
        "FLOPs (40% MFU of H100 bf16)": M.compute_time_from_flops(large, fl.d_model, fl.num_layers),
        "published 490k ex/s": M.compute_time_from_published(large.batch),
    }
    imb_cache: dict = {}
    results = {
        (c, f): predict(large, fl, cs, links, imb_cache) for c, cs in compute.items() for f, links in M.FABRICS.items()
    }

    L = [
        "# Scaling ablation: exact bytes + alpha-beta model",
        "",
        "Generated by `python experiments/scaling/run_ablation.py` (model: `model.py`, stages: `stages.py`).",
        "",
    ]
    L += [
        "## What was measured and what is modelled",
        "",
        "* **Bytes are exact for the compiled meshes.** Each distinct stage's train step was compiled (not run) on "
        "the 2x4 and 4x2 simulated CPU meshes with a tiny foundation model that has the large preset's table "
        f"structure ({TINY}, global batch {TINY_BATCH}, capacity_factor {CAPACITY_FACTOR}); "
        "`jaxscale.comm_report` read every collective from the compiled HLO.",
        "* **Bytes at 8 GPUs/node and 1-64 nodes, for the large preset, are extrapolated analytically** (the large "
        "model cannot compile here): `model.step_bytes` gives each collective's per-device bytes in closed form "
        "(docstring of model.py), and the same formulas reproduce the compiled tiny-model bytes exactly "
        "(cross-check below). Large preset per GPU: "
        f"{large.batch} sequences x {large.seq_len} events, {large.tables} tables x {large.rows:,} rows x "
        f"{large.dim}, {large.dense_params:,} dense parameters (counted from the model, abstractly), item vector "
        f"{large.item_out_dim}.",
        "* **Time is modelled** (alpha-beta, `model.py`), with published link figures; nothing is fitted to the "
        "published speedups. Compute time per step is a parameter: "
        + "; ".join(f"{k}: {v * 1e3:.1f} ms" for k, v in compute.items())
        + ".",
        "* The `baseline` and `+fp8` stages use TorchRec's contiguous row blocks; the engine only implements "
        "modulo-hashed rows, so their penalty enters as the load imbalance (max/mean bytes per shard) from the "
        "planner's cost model with Zipf(1.1) ids whose hottest ids are the lowest rows (raw catalogue ids, the "
        "worst case; with hashed ids contiguous blocks would be nearly balanced). The imbalance multiplies the "
        "embedding all-to-all time.",
        "",
    ]
    L += ["## Cross-check: closed-form bytes vs compiled HLO (per device per step, intra / inter)", ""]
    L += ["| mesh | topology | comm | half_dim | category | compiled | formula |", "|---|---|---|---|---|---|---|"]
    for c in checks:
        if c["compiled"] == (0.0, 0.0) and c["formula"] == (0.0, 0.0):
            continue
        L.append(
            f"| {c['mesh']} | {c['topology']} | {c['comm']} | {c['half_dim']} | {c['category']} | "
            f"{c['compiled'][0]:,.0f} / {c['compiled'][1]:,.0f} | {c['formula'][0]:,.0f} / {c['formula'][1]:,.0f} |"
        )
    L += [
        "",
        f"**All {len(checks)} category rows agree** (embedding all-to-alls and replica sync to the byte; "
        "dense_grad / model_gather within 1%: XLA combines 3 fp32 metric scalars into the gradient all-reduce)."
        if not bad
        else f"**{len(bad)} of {len(checks)} category rows DISAGREE** (the extrapolation of those categories is not "
        f"validated): " + ", ".join(f"{c['mesh']} {c['topology']} {c['category']}" for c in bad),
        "",
    ]

    L += [
        "## Extrapolated bytes per GPU per step (large preset, 8 GPUs/node)",
        "",
        "| stage | nodes | emb all-to-all intra | emb all-to-all inter | replica sync inter | dense all-reduce inter | "
        "negatives gather inter | imbalance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, st in STAGES:
        for n in (1, 2, 8, 64):
            b = M.step_bytes(large, n, LOCAL, st["topology"], st["fwd"], st["bwd"], st["half_dim"])
            e_i = b["emb_ids"][0] + b["emb_rows"][0]
            e_x = b["emb_ids"][1] + b["emb_rows"][1]
            imb = imb_cache[(st["topology"], n, not st["balanced"], st["half_dim"])]
            L.append(
                f"| {name} | {n} | {fmt_bytes(e_i)} | {fmt_bytes(e_x)} | {fmt_bytes(b['replica_sync'][1])} | "
                f"{fmt_bytes(b['dense_grad'][1])} | {fmt_bytes(b['model_gather'][1])} | {imb:.2f} |"
            )
    L += [""]
    for (cname, fname), res in results.items():
        L += [
            f"## Predicted weak-scaling speedup: {fname}, compute = {cname} ({compute[cname] * 1e3:.1f} ms)",
            "",
            "| stage | " + " | ".join(f"{n} node{'s' if n > 1 else ''}" for n in NODES) + " | step ms at 8 nodes |",
            "|---|" + "---|" * (len(NODES) + 1),
        ]
        for name, _ in STAGES:
            sp = res[name]["speedup"]
            L.append(
                f"| {name} | "
                + " | ".join(f"{sp[n]:.2f}x" for n in NODES)
                + f" | {res[name]['times'][8]['total'] * 1e3:.1f} |"
            )
        L.append("| published before / after | — | 1.13x / 2.0x | 1.21x / 3.9x | — / 7.5x | | | | |")
        L.append("")

    def sp(c, f, stage, n):
        return results[(c, f)][stage]["speedup"][n]

    cf, cp = list(compute)
    L += [
        "## Where the model and the published figures disagree",
        "",
        f"* **Compute dominates under the FLOPs estimate.** With {compute[cf] * 1e3:.0f} ms of transformer compute "
        f"per step (32 x 2048 tokens per GPU), even the baseline scales well: {sp(cf, '3200 Gbps/node', 'baseline', 2):.2f}x "  # noqa: E501
        f"at 2 nodes on 3200 Gbps and {sp(cf, '100 Gbps/node', 'baseline', 2):.2f}x on 100 Gbps, against the published "
        "1.13x. The published baseline implies communication comparable to compute, i.e. a much lighter dense step "
        "per looked-up row than our large preset (their 'example' is not our 2048-event sequence).",
        f"* **Under the published-throughput compute ({compute[cp] * 1e3:.1f} ms per 32-example step)** "
        f"communication dominates: baseline {sp(cp, '3200 Gbps/node', 'baseline', 2):.2f}x at 2 nodes on 3200 Gbps "
        f"(published 1.13x) and {sp(cp, '100 Gbps/node', 'baseline', 2):.2f}x on 100 Gbps (published 0.2x without the "
        f"fast NIC) - the same regime - but the full stack reaches only {sp(cp, '3200 Gbps/node', '2d_ar', 2):.2f}x "
        f"(2d_ar) / {sp(cp, '3200 Gbps/node', '2d_a2a', 2):.2f}x (2d_a2a) at 2 nodes and "
        f"{sp(cp, '3200 Gbps/node', '2d_a2a', 8):.2f}x at 8 nodes, far from 2.0x / 7.5x. The dense-gradient "
        "all-reduce of ~156M fp32 parameters (137 MB inter-node per GPU at 8 nodes) cannot hide behind a 4 ms step; "
        "none of the five techniques touches it.",
        "* **2d_a2a with exact replica sync does not scale in this engine.** The sync all-gathers every replica's "
        "received rows and gradients, (Rep-1) S C (4 + wire) bytes per device: it grows linearly with the node count "
        "(11 MB at 2 nodes, 78 MB at 8, 702 MB at 64 per GPU, all inter-node), so 2d_a2a falls behind 2d_ar and "
        "even +half_dim 1d beyond ~4 nodes. The published 2D all-to-all result relies on TorchRec's periodic weight "
        "averaging (replica_sync='periodic' here), whose cost is amortised over sync_every steps; this model does not "
        "include that mode's cost.",
        "* **2d_ar equals +half_dim 1d here**: its all-to-all is one GPU per node, so every byte crosses nodes, the "
        "same inter-node bytes as 1d (whose (N-1)/N x payload crosses); its intra-node replica sync is cheap on NVLink.",  # noqa: E501
        "* **Balance**: the contiguous baseline's imbalance (1.68 at 2 nodes, 3.85 at 8, 24 at 64) assumes raw Zipf "
        "ids with the hottest ids in the first rows; with hashed ids (as the large preset hashes a 2B vocabulary) "
        "contiguous blocks are nearly balanced and the '+balanced' step would gain little.",
        "* **FP8**: fp32 -> fp8 forward / bf16 backward cuts the embedding rows' bytes to (68 + 128) / 512 = 38% "
        "(forward alone: 68/256 = 27%, i.e. a 73% cut, slightly under the published >75% because of the 4-byte "
        "per-row scale).",
        "* Not modelled: overlap of the embedding all-to-all with compute (pipelining), NCCL protocol efficiency "
        "(efficiency = 1.0: line rate), congestion, and ragged all-to-alls (the engine pads to capacity_factor 1.25 "
        "x the uniform share).",
        "",
    ]
    open(os.path.join(HERE, "RESULTS.md"), "w").write("\n".join(L) + "\n")
    plot(results, compute)
    print("\n".join(L))
    return 1 if bad else 0


def plot(results, compute):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9), sharex=True)
    for i, cname in enumerate(compute):
        for j, fname in enumerate(M.FABRICS):
            ax = axes[i, j]
            res = results[(cname, fname)]
            for name, _ in STAGES:
                sp = res[name]["speedup"]
                ax.plot(NODES, [sp[n] for n in NODES], marker="o", label=name)
            ax.plot(NODES, NODES, "k:", label="ideal")
            ax.plot(
                list(PUBLISHED["before"]),
                list(PUBLISHED["before"].values()),
                "rx",
                ms=10,
                mew=2,
                label="published before",
            )
            ax.plot(list(PUBLISHED["after"]), list(PUBLISHED["after"].values()), "g*", ms=12, label="published after")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_title(f"{fname}\ncompute: {cname}", fontsize=9)
            ax.set_xlabel("nodes (8 GPUs each)")
            ax.set_ylabel("speedup vs 1 node")
            ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("jaxscale weak scaling: exact compiled bytes extrapolated + alpha-beta model")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "ablation.png"), dpi=90)


if __name__ == "__main__":
    sys.exit(main())
