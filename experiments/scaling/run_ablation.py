"""Regenerates experiments/scaling/RESULTS.md and ablation.png: exact bytes, a calibrated alpha-beta model.

    python experiments/scaling/run_ablation.py [--json OUT] [--recount] [--recompile] [--k-study FILE]

1. Compiled bytes (collect.py -> compiled_bytes.json): every distinct stage's train step compiled on the
   2x4 and 4x2 CPU meshes with a tiny foundation model; the closed-form bytes (model.py, today's padded
   engine) must equal them.
2. Per-step counts of the large preset (foundation_large: 32 sequences x 2048 events per GPU, 2 hashed
   tables of 100M x 64) at 1-64 nodes x 8 GPUs, by Monte Carlo over the model's own ids (counts.py), with
   the planner's plans; cached in mc_counts.json (--recount recomputes).
3. Calibration: compute time per step and one link efficiency fitted to the published "before" points;
   predictions checked against the other published figures without refitting.
4. Weak-scaling speedups per stage at 100 / 400 / 3200 Gbit/s per node; the replica-sync options; the
   planner's topology recommendation; the periodic-sync study (from --k-study FILE when given).
`--json OUT` writes {"calibration": {...}, "checks": [...], ...}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

import collect  # noqa: E402
import counts as C  # noqa: E402
import model as M  # noqa: E402
from compiled_stages import CAPACITY_FACTOR, TINY, TINY_BATCH, distinct_compiled_stages  # noqa: E402

from jaxscale import comm_model as cm  # noqa: E402
from jaxscale import planner  # noqa: E402
from jaxscale.cluster import ClusterSpec  # noqa: E402
from jaxscale.plan import ShardingPlan, TableShards  # noqa: E402
from jaxscale.quantization import CommConfig  # noqa: E402
from jaxscale.techniques import STAGES, stage  # noqa: E402

COUNTS_CACHE = os.path.join(HERE, "mc_counts.json")
SENSITIVITY_KEY = "1d|contiguous-hashed|full"
K_STUDY = os.path.join(ROOT, "experiments", "sync", "results.json")  # written by experiments/sync/k_study.py
BATCH_PER_DEVICE = 32  # foundation_large.yaml: global batch 2048 on 8 x 8 GPUs
SEED = 0
EXACT_SYNCS = (cm.ReplicaSync("exact", "owner"), cm.ReplicaSync("exact", "gather"))
PERIODIC_K = (4, 16, 64)
CATS = ("emb_ids", "emb_rows", "replica_sync", "dense")
EXACT_CATS = ("emb_ids", "emb_rows", "replica_sync")
# XLA's all-reduce combiner decides how the float all-reduces (dense gradients, the negative pool and its
# gradient) are grouped into collectives, so they are compared as one category.
DENSE_CATS = ("dense_grad", "model_gather")


# ----------------------------------------------------------------------------------- 1. cross-check


def tiny_workload(devices: int) -> M.Workload:
    """The compiled tiny model's workload on `devices` devices (both half_dim variants inside)."""
    from jaxscale_models.foundation import FoundationConfig

    return M.foundation_workload(FoundationConfig(**TINY), TINY_BATCH // devices, "tiny", CAPACITY_FACTOR)


# Which engine compiled compiled_bytes.json: 'padded' (static worst-case capacities, all-gather sync) or
# 'exact' (capacities from the batch, the owner sync): flip when the new engine lands, then recollect.
COMPILED_ENGINE = "padded"


def compiled_counts(compiled_entry: dict, w: M.Workload, st, cluster: ClusterSpec):
    """(counts, sync) the formulas use for one compiled entry, per COMPILED_ENGINE."""
    if COMPILED_ENGINE == "padded":
        return M.padded_counts(w, cluster.topology(st.settings.topology), st.half_dim), M.PADDED_SYNC
    from compiled_stages import CONFIG

    from jaxscale.config import load_config

    cfg = load_config(os.path.join(ROOT, CONFIG), compiled_entry["overrides"])
    return M.batch_counts(cfg), cm.ReplicaSync("exact", "owner")


def cross_check(compiled: dict) -> list[dict]:
    """Formula vs compiled bytes, per mesh, stage and category (engine: COMPILED_ENGINE)."""
    rows = []
    for st in distinct_compiled_stages():
        for nodes, local in collect.MESHES:
            key = collect.entry_key(nodes, local, st)
            if key not in compiled:
                continue
            cluster = ClusterSpec(nodes, local)
            w = tiny_workload(nodes * local)
            counts, sync = compiled_counts(compiled[key], w, st, cluster)
            pred = merge_dense(M.category_bytes(M.step_comms(w, st, counts, cluster, sync)))
            got = merge_dense(
                {
                    k: (v["intra_node"], v["inter_node"])
                    for k, v in compiled[key]["report"]["per_step"]["by_category"].items()
                }
            )
            for cat in CATS:
                g = dict(zip(("intra_node", "inter_node"), got.get(cat, (0.0, 0.0))))
                rows.append(
                    {
                        "mesh": f"{nodes}x{local}",
                        "stage": st.name,
                        "topology": st.settings.topology,
                        "comm": f"{st.settings.comm.forward}/{st.settings.comm.backward}",
                        "half_dim": st.half_dim,
                        "category": cat,
                        "compiled": (g["intra_node"], g["inter_node"]),
                        "formula": tuple(float(x) for x in pred.get(cat, (0.0, 0.0))),
                    }
                )
    return rows


def merge_dense(by_category: dict) -> dict:
    """{category: (intra, inter)} with the float all-reduce categories summed into 'dense'."""
    out = {k: tuple(v) for k, v in by_category.items() if k not in DENSE_CATS}
    parts = [by_category.get(k, (0.0, 0.0)) for k in DENSE_CATS]
    out["dense"] = (sum(p[0] for p in parts), sum(p[1] for p in parts))
    return out


def agrees(row: dict) -> bool:
    """Embedding categories must match to the byte; the dense all-reduces within 1% (XLA combines a few
    fp32 metric scalars into them)."""
    tol = 1e-9 if row["category"] in EXACT_CATS else 0.01
    return all(abs(a - b) <= tol * max(1.0, abs(a)) for a, b in zip(row["compiled"], row["formula"]))


# ----------------------------------------------------------------------------------- 2. counts


def count_configs():
    """(key, topology, balanced, half_dim) of every distinct count set the stages need."""
    seen = {}
    for s in STAGES:
        key = f"{s.settings.topology}|{'plan' if s.balanced else 'contiguous'}|{'half' if s.half_dim else 'full'}"
        seen.setdefault(key, (key, s.settings.topology, s.balanced, s.half_dim))
    return list(seen.values())


def stage_count_key(s) -> str:
    return f"{s.settings.topology}|{'plan' if s.balanced else 'contiguous'}|{'half' if s.half_dim else 'full'}"


def compute_counts(large, log=print) -> dict:
    """Monte Carlo counts for every stage configuration and node count (see counts.py)."""
    from jaxscale_models.foundation import FoundationConfig

    t0 = time.perf_counter()
    cfg = FoundationConfig.large()
    max_nodes = max(M.NODES)
    raw = C.generate_ids(cfg, max_nodes, M.LOCAL, BATCH_PER_DEVICE, seed=SEED, log=log)
    devices = max_nodes * M.LOCAL
    out = {"params": counts_params(), "ids_per_device": C.ids_per_device(raw, devices), "counts": {}, "plans": {}}
    stats_sample = {}
    for half, balanced_layout in ((False, False), (False, True), (True, True)):
        cfg_v = dataclasses.replace(cfg, item_reshape="half_dim" if half else None)
        tables = large.tables(half)
        # The engine's layout reads the model's hashed rows; TorchRec's naive layout reads ids as given
        # (raw id mod rows), which is what lets hot ids pile onto the first row block.
        ids = C.device_ids(cfg_v, raw, devices) if balanced_layout else C.raw_row_ids(raw, tables, devices)
        if balanced_layout:
            sample = {f: a[:64].reshape(64 * BATCH_PER_DEVICE, -1) for f, a in ids.items()}
            stats = planner.measure_feature_stats(sample, tables)
            stats_sample["half" if half else "full"] = {f: s.to_dict() for f, s in stats.items()}
        t1 = time.perf_counter()
        nested = C.NestedCounts(ids, tables, M.LOCAL)
        log(
            f"indexed {'hashed' if balanced_layout else 'raw'} {'half_dim' if half else 'full-dim'} ids in "
            f"{time.perf_counter() - t1:.0f} s"
        )
        configs = [c for c in count_configs() if c[3] == half and c[2] == balanced_layout]
        if balanced_layout and not half:  # sensitivity: contiguous blocks over the model's hashed rows
            configs.append((SENSITIVITY_KEY, "1d", False, False))
        for key, topology, balanced, _ in configs:
            for n in M.NODES:
                cluster = M.H100_NODES.with_nodes(n)
                S = cluster.topology(topology).num_shards
                if balanced:
                    plan = planner.plan_sharding(tables, stats, cluster, BATCH_PER_DEVICE, topology=topology)
                else:
                    plan = ShardingPlan(
                        topology, S, {t.name: TableShards("row_wise", S, 1, tuple(range(S))) for t in tables}
                    )
                ra = "modulo" if balanced else "contiguous"  # plans are row-wise: the assignment is the layout
                counts = nested.counts(plan, n, ra)
                out["counts"][f"{key}|{n}"] = [dataclasses.asdict(c) for c in counts]
                out["plans"][f"{key}|{n}"] = plan.to_dict()
            log(f"counted {key} at {list(M.NODES)} nodes")
        del nested, ids
    out["stats"] = stats_sample
    out["seconds"] = time.perf_counter() - t0
    return out


def counts_params() -> dict:
    return {"nodes": list(M.NODES), "local": M.LOCAL, "batch_per_device": BATCH_PER_DEVICE, "seed": SEED, "step": 0}


def load_counts(large, recount: bool, log=print) -> dict:
    if not recount and os.path.exists(COUNTS_CACHE):
        with open(COUNTS_CACHE) as f:
            cached = json.load(f)
        if cached.get("params") == counts_params():
            return cached
        log("mc_counts.json was made with other parameters: recounting")
    out = compute_counts(large, log)
    collect.save(out, COUNTS_CACHE)
    return out


def counts_fn(mc: dict, unbalanced_key: str | None = None):
    """(stage, nodes) -> counts; `unbalanced_key` replaces the unbalanced stages' counts (sensitivity)."""
    cache = {}

    def get(s, n):
        key = f"{unbalanced_key if unbalanced_key and not s.balanced else stage_count_key(s)}|{n}"
        if key not in cache:
            cache[key] = [cm.StackCounts(**d) for d in mc["counts"][key]]
        return cache[key]

    return get


def stats_of(mc: dict, half: bool) -> dict:
    return {f: planner.FeatureStats(**d) for f, d in mc["stats"]["half" if half else "full"].items()}


def periodic_counts_fn(mc: dict, large, k: int):
    """Counts with touched_since_sync for k steps (expected union from the sample's id statistics)."""
    base = counts_fn(mc)
    cache = {}

    def get(s, n):
        key = (stage_count_key(s), n)
        if key not in cache:
            plan = ShardingPlan.from_dict(mc["plans"][f"{stage_count_key(s)}|{n}"])
            cluster = M.H100_NODES.with_nodes(n)
            tables = large.tables(s.half_dim)
            est = planner.step_counts(tables, stats_of(mc, s.half_dim), cluster, plan, BATCH_PER_DEVICE, k)
            cache[key] = [
                dataclasses.replace(c, touched_since_sync=e.touched_since_sync) for c, e in zip(base(s, n), est)
            ]
        return cache[key]

    return get


# ----------------------------------------------------------------------------------- 3. calibration


def best_sync(large, st, fn, cluster, n, compute_s) -> cm.ReplicaSync:
    """The exact sync strategy with the shorter step (the recommended one)."""
    if cluster.with_nodes(n).topology(st.settings.topology).num_replicas == 1:
        return EXACT_SYNCS[0]
    return min(EXACT_SYNCS, key=lambda s: M.stage_time(large, st, fn, cluster, n, compute_s, s).total)


def point_predictor(large, fn):
    baseline, fp8 = stage("baseline"), stage("+fp8")
    efa, no_efa = M.CALIBRATION_FABRICS["with EFA"], M.CALIBRATION_FABRICS["without EFA"]

    def predict(name, compute_s, efficiency):
        c_efa = dataclasses.replace(efa, efficiency=efficiency)
        c_no = dataclasses.replace(no_efa, efficiency=efficiency)
        sync = EXACT_SYNCS[0]
        if name == "no_efa_2_nodes":
            return M.speedup(large, baseline, fn, c_no, 2, compute_s, sync)
        if name.startswith("before_"):
            return M.speedup(large, baseline, fn, c_efa, int(name.split("_")[1]), compute_s, sync)
        if name == "fp8_2_nodes":
            return M.speedup(large, fp8, fn, c_efa, 2, compute_s, sync)
        raise KeyError(name)

    return predict


def run_checks(large, fn, mc, cal: M.Calibration) -> tuple[list[dict], dict]:
    predict = point_predictor(large, fn)
    rows = [M.check_row(p, cal.fitted_values[p], fitted=True) for p in cal.points_used]
    rows.append(M.check_row("fp8_2_nodes", predict("fp8_2_nodes", cal.compute_s, cal.efficiency), fitted=False))
    efa = cal.cluster(M.CALIBRATION_FABRICS["with EFA"])
    n = M.A2A_LATENCY_NODES
    one_d, a2a = stage("+half_dim"), stage("2d_a2a")
    t1 = M.a2a_seconds(large, one_d, fn, efa, n, EXACT_SYNCS[0])
    t2 = M.a2a_seconds(large, a2a, fn, efa, n, EXACT_SYNCS[0])
    rows.append(M.check_row("a2a_latency_ratio", t1 / t2, fitted=False))
    detail = {"a2a_seconds_1d": t1, "a2a_seconds_2d_a2a": t2, "nodes": n, "final": {}}
    for nodes in (2, 4, 8):
        choice = recommend(large, mc, efa, nodes, cal.compute_s)
        st = stage_for_choice(choice)
        sp = M.speedup(large, st, fn, efa, nodes, cal.compute_s, choice.sync or EXACT_SYNCS[0])
        sync_a2a = best_sync(large, a2a, fn, efa, nodes, cal.compute_s)
        detail["final"][nodes] = {
            "recommended": choice.chosen.label,
            "speedup_recommended": sp,
            "speedup_2d_a2a": M.speedup(large, a2a, fn, efa, nodes, cal.compute_s, sync_a2a),
            "sync_2d_a2a": sync_a2a.label,
        }
        rows.append(M.check_row(f"final_{nodes}_nodes", sp, fitted=False))
    return rows, detail


def recommend(large, mc, cluster: ClusterSpec, nodes: int, compute_s: float) -> planner.TopologyChoice:
    """The planner's recommendation for the final stack (half_dim tables, fp8/bf16) on this cluster."""
    return planner.recommend_topology(
        large.tables(True),
        stats_of(mc, True),
        cluster.with_nodes(nodes),
        BATCH_PER_DEVICE,
        CommConfig("fp8", "bf16"),
        periodic_every=(16,),
        dense_params=large.dense_params(True) + large.max_negatives * large.item_out_dim,
        compute_s=compute_s,
    )


def stage_for_choice(choice: planner.TopologyChoice):
    """The ladder stage running the recommended topology (1d -> +half_dim)."""
    return {"1d": stage("+half_dim"), "2d_ar": stage("2d_ar"), "2d_a2a": stage("2d_a2a")}[choice.topology]


# ----------------------------------------------------------------------------------- 4. predictions


def predictions(large, fn, mc, cal: M.Calibration, log=print) -> dict:
    """Speedups per fabric, stage and node count (with fitted compute and efficiency)."""
    out = {}
    for fname, spec in M.FABRICS.items():
        cluster = cal.cluster(spec)
        res = {"stages": {}, "variants": {}, "recommended": {}, "step_ms": {}}
        for st in STAGES:
            sp, ms, syncs = {}, {}, {}
            for n in M.NODES:
                sync = best_sync(large, st, fn, cluster, n, cal.compute_s)
                sp[n] = M.speedup(large, st, fn, cluster, n, cal.compute_s, sync)
                ms[n] = M.stage_time(large, st, fn, cluster, n, cal.compute_s, sync).total * 1e3
                syncs[n] = sync.label
            res["stages"][st.name] = {"speedup": sp, "step_ms": ms, "sync": syncs}
        a2a = stage("2d_a2a")
        variants = {f"2d_a2a {s.label}": (s, fn) for s in EXACT_SYNCS}
        for k in PERIODIC_K:
            pfn = periodic_counts_fn(mc, large, k)
            for strat in ("dense", "sparse"):
                variants[f"2d_a2a periodic {strat} k={k}"] = (cm.ReplicaSync("periodic", strat, k), pfn)
        for label, (sync, vfn) in variants.items():
            res["variants"][label] = {n: M.speedup(large, a2a, vfn, cluster, n, cal.compute_s, sync) for n in M.NODES}
        res["variants"]["2d_a2a exact owner + bf16 dense all-reduce"] = {
            n: M.speedup(large, a2a, fn, cluster, n, cal.compute_s, EXACT_SYNCS[0], "bf16") for n in M.NODES
        }
        for n in M.NODES[1:]:
            choice = recommend(large, mc, cluster, n, cal.compute_s)
            st = stage_for_choice(choice)
            res["recommended"][n] = {
                "label": choice.chosen.label,
                "reason": choice.reason,
                "speedup": M.speedup(large, st, fn, cluster, n, cal.compute_s, choice.sync or EXACT_SYNCS[0]),
            }
        log(f"predicted {fname}")
        out[fname] = res
    return out


def bytes_table(large, fn, cal) -> list[dict]:
    rows = []
    cluster = cal.cluster(M.FABRICS["400 Gbps/node"])
    for st in STAGES:
        for n in (1, 2, 8, 64):
            c = cluster.with_nodes(n)
            sync = best_sync(large, st, fn, cluster, n, cal.compute_s)
            b = M.category_bytes(M.step_comms(large, st, fn(st, n), c, sync))
            rows.append({"stage": st.name, "nodes": n, "sync": sync.label, "bytes": b})
    return rows


# ----------------------------------------------------------------------------------- output


def machine() -> dict:
    import numpy

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "cpus": os.cpu_count(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def fmt_bytes(x: float) -> str:
    for unit, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= s:
            return f"{x / s:.2f} {unit}"
    return f"{x:.0f} B"


def load_k_study(path: str | None) -> dict | None:
    """The periodic-sync quality study (experiments/sync/k_study.py's results.json), if it was run."""
    path = path or (K_STUDY if os.path.exists(K_STUDY) else None)
    if path is None:
        return None
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError(f"{path}: expected {{'machine': ..., 'runs': [...]}} as experiments/sync/k_study.py writes")
    for i, r in enumerate(data["runs"]):
        missing = {"name", "k", "steps", "eval_loss", "eval_recall", "sync_bytes_inter"} - set(r)
        if missing:
            raise ValueError(f"{path}: runs[{i}] lacks {sorted(missing)}")
    return dict(data, path=os.path.relpath(path, ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="also write calibration, checks and tables as JSON here")
    p.add_argument("--recount", action="store_true", help="recompute the Monte Carlo counts (mc_counts.json)")
    p.add_argument("--recompile", action="store_true", help="recompile the small configs (collect.py --force)")
    p.add_argument(
        "--k-study", default=None, help="periodic-sync quality results (default: experiments/sync/results.json)"
    )
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    mach = machine()
    if args.recompile or not os.path.exists(collect.OUT):
        cmd = [sys.executable, os.path.join(HERE, "collect.py")] + (["--force"] if args.recompile else [])
        subprocess.run(cmd, check=True, cwd=ROOT)
    compiled = collect.load()
    checks_hlo = cross_check(compiled)
    bad = [c for c in checks_hlo if not agrees(c)]

    from jaxscale_models.foundation import FoundationConfig

    fl = FoundationConfig.large()
    large = M.foundation_workload(fl, BATCH_PER_DEVICE, "large")
    mc = load_counts(large, args.recount)
    fn = counts_fn(mc)
    cal = M.fit(point_predictor(large, fn))
    sensitivity = M.fit(point_predictor(large, counts_fn(mc, SENSITIVITY_KEY)))
    # diagnostic only (not used for any prediction): the EFA points alone, to see which point conflicts
    efa_only = M.fit(point_predictor(large, fn), points=("before_2_nodes", "before_4_nodes"))
    efa_only_no_efa = point_predictor(large, fn)("no_efa_2_nodes", efa_only.compute_s, efa_only.efficiency)
    checks, detail = run_checks(large, fn, mc, cal)
    preds = predictions(large, fn, mc, cal)
    btab = bytes_table(large, fn, cal)
    k_study = load_k_study(args.k_study)
    flops_s = M.transformer_step_flops(large, fl.d_model, fl.num_layers) / (0.4 * M.H100_BF16_DENSE_FLOPS)
    mach["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    mach["seconds"] = time.perf_counter() - t_start
    result = {
        "machine": mach,
        "calibration": {
            "points_used": list(cal.points_used),
            "fitted": {
                "compute_s": cal.compute_s,
                "efficiency": cal.efficiency,
                "residual_log_rms": cal.residual_log_rms,
            },
            "fabrics": {k: dataclasses.asdict(v) for k, v in M.CALIBRATION_FABRICS.items()},
        },
        "checks": checks,
        "check_details": detail,
        "cross_check": {"rows": len(checks_hlo), "disagree": len(bad)},
        "predictions": {f: {k: v for k, v in r.items() if k != "recommended"} for f, r in preds.items()},
        "recommended": {f: r["recommended"] for f, r in preds.items()},
        "flops_compute_s": flops_s,
    }
    import write_results

    text = write_results.render(
        mach,
        checks_hlo,
        bad,
        large,
        mc,
        cal,
        (sensitivity, efa_only, efa_only_no_efa),
        checks,
        detail,
        preds,
        btab,
        k_study,
        flops_s,
        fl,
    )
    with open(os.path.join(HERE, "RESULTS.md"), "w") as f:
        f.write(text)
    write_results.plot(preds, os.path.join(HERE, "ablation.png"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
