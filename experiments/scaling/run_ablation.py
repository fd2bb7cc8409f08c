"""Regenerates experiments/scaling/RESULTS.md and ablation.png: exact bytes, an alpha-beta model with assumed compute.

    python experiments/scaling/run_ablation.py [--json OUT] [--recount] [--recompile] [--k-study FILE]

1. Compiled bytes (collect.py -> compiled_bytes.json): every distinct stage's train step compiled on the
   2x4 and 4x2 CPU meshes with a tiny foundation model; the closed-form bytes
   (`jaxscale.studies.scaling_model`, today's padded engine) must equal them.
2. Per-step counts of the large preset (foundation_large: 32 sequences x 2048 events per GPU, 2 hashed
   tables of 100M x 64) at 1-64 nodes x 8 GPUs, by Monte Carlo over the model's own ids
   (`jaxscale.studies.scaling_counts`), with the planner's plans; cached in mc_counts.json (--recount recomputes).
3. Parameters from outside the checked points: compute per step assumed, the published 490k examples/s at
   8 nodes read as pure compute at the assumed per-GPU batch (so that throughput is not a check); the EFA
   and TCP link efficiencies from the published collective benchmarks in link_benchmarks.json. Every other
   published figure is a check (the ratio checks within 20%, the rest within 15%); none is called a
   prediction unless the throughput compute came from is reproduced within 15%.
   The fragility table re-evaluates every check along a compute sweep (2-20 ms) and under each
   alternative calibration, with the compute values where each check flips.
4. Weak-scaling speedups per stage at 100 / 400 / 3200 Gbit/s per node; the replica-sync options; the
   planner's topology recommendation; the periodic-sync study (from --k-study FILE when given).
5. Latency: the 16-64-node ranking under the additive all-to-all latency (every message's latency adds
   up) and under the extra-message cost measured on the emulated cluster (the newest
   emulation/latency_*.jsonl, `jaxscale.studies.link_emulation.fit_latency`).
`--json OUT` writes {"calibration": {...}, "checks": [...], "fragility": {...}, ...}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np

from jaxscale.benchmarks.machine import machine
from jaxscale.engine import comm_model as cm
from jaxscale.engine import planner
from jaxscale.engine.plan import ShardingPlan, TableShards
from jaxscale.engine.techniques import STAGES, stage
from jaxscale.infra.atomic import write_json
from jaxscale.studies import scaling_counts as C
from jaxscale.studies import scaling_model as M

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
COMPILED = os.path.join(HERE, "compiled_bytes.json")  # collect.py writes it
COUNTS_CACHE = os.path.join(HERE, "mc_counts.json")
LINK_BENCHMARKS = os.path.join(HERE, "link_benchmarks.json")
SENSITIVITY_KEY = "1d|contiguous-hashed|full"
K_STUDY = os.path.join(ROOT, "experiments", "sync", "results.json")  # written by experiments/sync/k_study.py
BATCH_PER_DEVICE = 32  # foundation_large.yaml: global batch 2048 on 8 x 8 GPUs (the report gives no per-GPU batch)
SEED = 0
EXACT_SYNCS = M.EXACT_SYNCS
PERIODIC_K = (4, 16, 64)
SWEEP_S = tuple(x / 1e3 for x in range(2, 21))  # compute sweep of the fragility table: 2-20 ms
DENSE_SCALES = tuple(2.0**-k for k in range(7))  # dense-model sweep of the fragility table: 1 .. 1/64 of the preset
LATENCY_RUNS = os.path.join(HERE, "emulation")  # run_emulation.sh calibrate writes latency_<stamp>.jsonl
RANKING_NODES = (16, 32, 64)
ONE_D = ("baseline", "+fp8", "+balanced", "+half_dim")


def load_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------- 2. counts


def count_configs():
    """(key, topology, balanced, half_dim) of every distinct count set the stages need."""
    seen = {}
    for s in STAGES:
        key = M.stage_count_key(s)
        seen.setdefault(key, (key, s.settings.topology, s.balanced, s.half_dim))
    return list(seen.values())


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
    write_json(COUNTS_CACHE, out, indent=1)
    return out


def periodic_counts_fn(mc: dict, large, k: int):
    """Counts with touched_since_sync for k steps (expected union from the sample's id statistics)."""
    base = M.cached_counts_fn(mc)
    cache = {}

    def get(s, n):
        key = (M.stage_count_key(s), n)
        if key not in cache:
            plan = ShardingPlan.from_dict(mc["plans"][f"{M.stage_count_key(s)}|{n}"])
            cluster = M.H100_NODES.with_nodes(n)
            tables = large.tables(s.half_dim)
            est = planner.step_counts(tables, M.cached_stats(mc, s.half_dim), cluster, plan, BATCH_PER_DEVICE, k)
            cache[key] = [
                dataclasses.replace(c, touched_since_sync=e.touched_since_sync) for c, e in zip(base(s, n), est)
            ]
        return cache[key]

    return get


# ----------------------------------------------------------------------------------- 3. parameters and checks


def calibrations(sc: M.Scenario, sc_hashed: M.Scenario, eff: dict, flops_s: float, log=print) -> dict:
    """The primary calibration (pinned) and each alternative the fragility table compares."""
    predict = M.predictor(sc)
    primary = M.published_calibration(sc, eff)
    compute, pinned, src = primary.compute_s, primary.points_used, primary.source

    def pin(name, c, e, e_tcp, frm=pinned, scenario=sc):
        return M.pinned_calibration(M.predictor(scenario), c, e, e_tcp, frm, name=name, source=src)

    out = {"pinned": primary}
    out["EFA from all_reduce_perf"] = pin("EFA from all_reduce_perf", compute, eff["efa_all_reduce"], eff["tcp"])
    out["TCP busbw 4 GB/s"] = pin("TCP busbw 4 GB/s", compute, eff["efa"], eff["tcp_low"])
    out["TCP busbw 6 GB/s"] = pin("TCP busbw 6 GB/s", compute, eff["efa"], eff["tcp_high"])
    out["compute from FLOPs"] = pin("compute from FLOPs", flops_s, eff["efa"], eff["tcp"], frm=())
    out["hashed-id baseline"] = pin("hashed-id baseline", compute, eff["efa"], eff["tcp"], scenario=sc_hashed)
    t0 = time.perf_counter()
    out["compute fitted, benchmark efficiencies"] = M.fit(
        predict, efficiencies=(eff["efa"], eff["tcp"]), name="compute fitted, benchmark efficiencies"
    )
    out["former fit (compute + one efficiency)"] = M.fit(predict, name="former fit (compute + one efficiency)")
    log(f"fitted the alternatives in {time.perf_counter() - t0:.0f} s")
    return out


def check_details(sc: M.Scenario, cal: M.Calibration) -> dict:
    """What the checks are made of: the all-to-all seconds and the final stack at 2, 4, 8 nodes."""
    large, fn = sc.workload, sc.counts_fn
    efa = cal.cluster(M.CALIBRATION_FABRICS["with EFA"])
    n = M.A2A_LATENCY_NODES
    t1 = M.a2a_seconds(large, stage("+half_dim"), fn, efa, n, EXACT_SYNCS[0])
    t2 = M.a2a_seconds(large, stage("2d_a2a"), fn, efa, n, EXACT_SYNCS[0])
    detail = {"a2a_seconds_1d": t1, "a2a_seconds_2d_a2a": t2, "nodes": n, "final": {}}
    a2a = stage("2d_a2a")
    for nodes in (2, 4, 8):
        st, sync, label = M.final_stack(sc, efa, nodes, cal.compute_s)
        t = M.stage_time(large, st, fn, efa, nodes, cal.compute_s, sync)
        sync_a2a = M.best_sync(sc, a2a, efa, nodes, cal.compute_s)
        detail["final"][nodes] = {
            "recommended": label,
            "speedup_recommended": M.speedup(large, st, fn, efa, nodes, cal.compute_s, sync),
            "step_ms": t.total * 1e3,
            "comm_ms": t.comm * 1e3,
            "dense_exposed_ms": t.dense_exposed * 1e3,
            "by_category_ms": {k: v * 1e3 for k, v in t.by_category.items()},
            "speedup_2d_a2a": M.speedup(large, a2a, fn, efa, nodes, cal.compute_s, sync_a2a),
            "sync_2d_a2a": sync_a2a.label,
        }
    st, sync, _ = M.final_stack(sc, efa, 8, 0.0)
    detail["final_8_comm_only_ms"] = M.stage_time(large, st, fn, efa, 8, 0.0, sync).total * 1e3
    return detail


def fragility(sc: M.Scenario, sc_hashed: M.Scenario, cals: dict, log=print) -> dict:
    """Every check under each calibration, and along the compute sweep with the pinned efficiencies."""
    t0 = time.perf_counter()
    alternatives = {}
    for name, cal in cals.items():
        scenario = sc_hashed if name == "hashed-id baseline" else sc
        rows = M.run_checks(scenario, cal)
        alternatives[name] = {
            "compute_s": cal.compute_s,
            "efficiency": cal.efficiency,
            "efficiency_tcp": cal.efficiency_tcp,
            "points_used": list(cal.points_used),
            "gate_passed": cal.gate_passed,
            "gate_reason": cal.gate_reason(),
            "checks": {r["name"]: {"value": r["predicted"], "passed": r["passed"], "kind": r["kind"]} for r in rows},
        }
    sweep = M.compute_sweep(sc, cals["pinned"], SWEEP_S)
    dense = M.dense_sweep(sc, cals["pinned"], DENSE_SCALES)
    log(f"fragility table in {time.perf_counter() - t0:.0f} s")
    return {"alternatives": alternatives, "compute_sweep": sweep, "dense_sweep": dense}


# ----------------------------------------------------------------------------------- 4. predictions


def predictions(sc: M.Scenario, mc: dict, cal: M.Calibration, log=print) -> dict:
    """Speedups per fabric, stage and node count (with the calibration's compute and EFA efficiency)."""
    large, fn = sc.workload, sc.counts_fn
    out = {}
    for fname, spec in M.FABRICS.items():
        cluster = cal.cluster(spec)
        res = {"stages": {}, "variants": {}, "recommended": {}, "step_ms": {}}
        for st in STAGES:
            sp, ms, syncs = {}, {}, {}
            for n in M.NODES:
                sync = M.best_sync(sc, st, cluster, n, cal.compute_s)
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
            choice = M.recommend(sc, cluster, n, cal.compute_s)
            st = M.stage_for_choice(choice)
            res["recommended"][n] = {
                "label": choice.chosen.label,
                "topology": choice.topology,
                "reason": choice.reason,
                "speedup": M.speedup(large, st, fn, cluster, n, cal.compute_s, choice.sync or EXACT_SYNCS[0]),
            }
        log(f"predicted {fname}")
        out[fname] = res
    return out


def measured_latency() -> dict | None:
    """The fit of the newest emulated latency run (None when there is none)."""
    import glob

    from jaxscale.studies.link_emulation import fit_latency

    runs = sorted(glob.glob(os.path.join(LATENCY_RUNS, "latency_*.jsonl")))
    if not runs:
        return None
    with open(runs[-1]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return dict(fit_latency(rows), file=os.path.relpath(runs[-1], ROOT))


def latency_ranking(sc: M.Scenario, cal: M.Calibration, costs: dict) -> dict:
    """{latency model: {fabric: {nodes: {...}}}}: at 16-64 nodes the best 1d stage, 2d_ar, 2d_a2a and the
    planner's choice with every all-to-all message's latency costing `cost` after the first (1 = additive),
    and the a2a_latency_ratio check under that model."""
    large, fn = sc.workload, sc.counts_fn
    out = {}
    for model, cost in costs.items():
        out[model] = {"a2a_extra_message_cost": cost}
        for fname, spec in M.FABRICS.items():
            cluster = dataclasses.replace(cal.cluster(spec), a2a_extra_message_cost=cost)
            rows = {}
            for n in RANKING_NODES:
                sp = {}
                for name in (*ONE_D, "2d_ar", "2d_a2a"):
                    st = stage(name)
                    sp[name] = M.speedup(
                        large, st, fn, cluster, n, cal.compute_s, M.best_sync(sc, st, cluster, n, cal.compute_s)
                    )
                best_1d = max(ONE_D, key=sp.get)
                choice = M.recommend(sc, cluster, n, cal.compute_s)
                ranked = sorted((best_1d, "2d_ar", "2d_a2a"), key=sp.get, reverse=True)
                rows[n] = {
                    "best_1d": best_1d,
                    "speedup": {k: sp[k] for k in (best_1d, "2d_ar", "2d_a2a")},
                    "ranking": ["1d" if k == best_1d else k for k in ranked],
                    "recommended": choice.chosen.label,
                }
            out[model][fname] = rows
        efa = dataclasses.replace(cal.cluster(M.CALIBRATION_FABRICS["with EFA"]), a2a_extra_message_cost=cost)
        n, sync = M.A2A_LATENCY_NODES, EXACT_SYNCS[0]
        out[model]["a2a_latency_ratio"] = M.a2a_seconds(large, stage("+half_dim"), fn, efa, n, sync) / M.a2a_seconds(
            large, stage("2d_a2a"), fn, efa, n, sync
        )
    return out


def bytes_table(sc: M.Scenario, cal: M.Calibration) -> list[dict]:
    large, fn = sc.workload, sc.counts_fn
    rows = []
    cluster = cal.cluster(M.FABRICS["400 Gbps/node"])
    for st in STAGES:
        for n in (1, 2, 8, 64):
            c = cluster.with_nodes(n)
            sync = M.best_sync(sc, st, cluster, n, cal.compute_s)
            b = M.category_bytes(M.step_comms(large, st, fn(st, n), c, sync))
            rows.append({"stage": st.name, "nodes": n, "sync": sync.label, "bytes": b})
    return rows


# ----------------------------------------------------------------------------------- output


def fmt_bytes(x: float) -> str:
    for unit, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= s:
            return f"{x / s:.2f} {unit}"
    return f"{x:.0f} B"


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
    if args.recompile or not os.path.exists(COMPILED):
        cmd = [sys.executable, os.path.join(HERE, "collect.py")] + (["--force"] if args.recompile else [])
        subprocess.run(cmd, check=True, cwd=ROOT)
    checks_hlo = M.cross_check(load_json(COMPILED))
    bad = [c for c in checks_hlo if not M.agrees(c)]

    from jaxscale_models.foundation import FoundationConfig

    fl = FoundationConfig.large()
    large = M.foundation_workload(fl, BATCH_PER_DEVICE, "large")
    mc = load_counts(large, args.recount)
    sc = M.Scenario(large, M.cached_counts_fn(mc), M.cached_stats(mc, True), BATCH_PER_DEVICE)
    sc_hashed = dataclasses.replace(sc, counts_fn=M.cached_counts_fn(mc, SENSITIVITY_KEY))
    with open(LINK_BENCHMARKS) as f:
        eff = M.link_efficiencies(json.load(f))
    flops_s = M.flops_compute_s(large, fl.d_model, fl.num_layers)
    cals = calibrations(sc, sc_hashed, eff, flops_s)
    cal = cals["pinned"]
    checks = M.run_checks(sc, cal)
    detail = check_details(sc, cal)
    frag = fragility(sc, sc_hashed, cals)
    preds = predictions(sc, mc, cal)
    btab = bytes_table(sc, cal)
    lat = measured_latency()
    costs = {"additive": 1.0} | ({"measured": lat["a2a_extra_message_cost"]} if lat else {})
    ranking = latency_ranking(sc, cal, costs)
    import write_results

    k_study = write_results.load_k_study(args.k_study or (K_STUDY if os.path.exists(K_STUDY) else None))
    mach["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    mach["seconds"] = time.perf_counter() - t_start
    result = {
        "machine": mach,
        "calibration": {
            "name": cal.name,
            "points_used": list(cal.points_used),
            "fitted": {
                "compute_s": cal.compute_s,
                "efficiency": cal.efficiency,
                "efficiency_tcp": cal.efficiency_tcp,
                "residual_log_rms": cal.residual_log_rms,
            },
            "values_at_points_used": cal.fitted_values,
            "gate_passed": cal.gate_passed,
            "gate_reason": cal.gate_reason(),
            "source": cal.source,
            "link_efficiencies": eff,
            "batch_per_device": BATCH_PER_DEVICE,
            "fabrics": {k: dataclasses.asdict(v) for k, v in M.CALIBRATION_FABRICS.items()},
        },
        "checks": checks,
        "check_details": detail,
        "fragility": frag,
        "cross_check": {"rows": len(checks_hlo), "disagree": len(bad)},
        "predictions": {f: {k: v for k, v in r.items() if k != "recommended"} for f, r in preds.items()},
        "recommended": {f: r["recommended"] for f, r in preds.items()},
        "flops_compute_s": flops_s,
        "latency": {"measured": lat, "ranking": ranking},
    }
    text = write_results.render(
        mach, checks_hlo, bad, large, mc, cal, eff, checks, detail, frag, preds, btab, k_study, flops_s, lat, ranking
    )
    with open(os.path.join(HERE, "RESULTS.md"), "w") as f:
        f.write(text)
    write_results.plot(preds, os.path.join(HERE, "ablation.png"))
    if args.json:
        write_json(args.json, json.loads(json.dumps(result, default=_jsonable)), indent=1)
    print(text)
    return 1 if bad else 0


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
