"""The benchmark suite: jaxscale beside FBGEMM / TorchRec and NumPy, each engine timed alone.

    python -m jaxscale.bench                  # full run; writes experiments/results/bench_suite.{md,json}
    python -m jaxscale.bench --quick          # small shapes, few configurations; bench_suite_quick.{md,json}
    python experiments/bench/suite.py ...     # the same (python -m jaxscale.bench runs this script)

Parts (`--parts`, default all):
  one_device   lookup + row-wise AdaGrad on one device: jaxscale vs FBGEMM's CPU TBE vs the NumPy
               reference, same table, ids and gradients; the updated tables are checked (one_device.py)
  equal_devices  jaxscale on W simulated devices in one process and on W processes (gloo) vs TorchRec on W
               gloo ranks, W = 1, 2, 4, per sharding type and precision; time and bytes ratios
               (equal_devices.py)
  stages       bytes per example of the foundation smoke config's embedding step per technique stage,
               from the compiled HLO (stages.py)

Timing protocol (common.py, docs/benchmarks.md): every engine runs in its own processes and no other engine
process is alive while it is timed; sessions alternate A, B, C, A, B, C, ... and the report compares medians.
The run refuses to start when the 1-minute load average exceeds --max-load (default: a quarter of the
cores) unless --allow-load is given; the other processes' CPU share is sampled before every session and a
table whose sessions saw more than --max-busy is marked. The Markdown is computed from the JSON
(`--render RESULT.json` redoes it without running anything).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import equal_devices
import one_device
import stages
from common import (
    RESULTS,
    LoadGate,
    alternate,
    describe_machine,
    load_average,
    load_line,
    log,
    machine,
    run_session,
    write_atomic,
)

PARTS = ("one_device", "equal_devices", "stages")
EXIT_CHECK_FAILED, EXIT_LOADED = 1, 3


def sizes(quick: bool) -> dict:
    if quick:
        return {
            "one_device": dict(rows=100_000, dim=64, batch=1024, hotness=20, zipf=1.1, warmup=2, steps=6, rounds=2),
            "equal_devices": dict(
                tables=4,
                rows=5_000,
                dim=64,
                batch=256,
                hotness=8,
                zipf=1.1,
                warmup=1,
                steps=4,
                rounds=1,
                worlds=(2, 4),
                shardings=("table_wise", "row_wise"),
                precisions=("fp32", "fp8"),
                torchrec_fp8_probe=False,
            ),
        }
    return {
        "one_device": dict(rows=1_000_000, dim=64, batch=4096, hotness=20, zipf=1.1, warmup=3, steps=15, rounds=3),
        "equal_devices": dict(
            tables=8,
            rows=20_000,
            dim=64,
            batch=1024,
            hotness=10,
            zipf=1.1,
            warmup=2,
            steps=16,
            rounds=2,
            worlds=(2, 4),
            shardings=equal_devices.SHARDINGS,
            precisions=("fp32", "fp16", "bf16", "fp8/bf16", "fp8"),
            torchrec_fp8_probe=True,
        ),
    }


# ------------------------------------------------------------------------------------------- run


def torchrec_installed() -> bool:
    """torch, fbgemm_gpu and torchrec importable (found without importing them into this process)."""
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "fbgemm_gpu", "torchrec"))


def run(args) -> dict:
    S = sizes(args.quick)
    have_torchrec = torchrec_installed()
    parts = [p for p in PARTS if p in args.parts.split(",")]
    gate = LoadGate(args.max_load, args.max_busy, args.allow_load)
    res = {
        "command": "python -m jaxscale.bench " + " ".join(args.argv),
        "quick": args.quick,
        "machine": machine(),
        "thresholds": {"max_load": args.max_load, "max_busy": args.max_busy, "allow_load": args.allow_load},
        "parts": {},
        "torchrec_installed": have_torchrec,
    }
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="jaxscale_bench_") as tmp:
        for part in parts:
            before = load_average()
            gate.busy = []
            log(f"part {part}")
            if part == "stages":
                out = stages_part(tmp)
            else:
                cfg = dict(S[part])
                if args.rounds:
                    cfg["rounds"] = args.rounds
                if part == "equal_devices" and args.capacity_factor:
                    cfg["capacity_factor"] = args.capacity_factor
                if part == "equal_devices":
                    cfg["reuse_capacities"] = not args.count_every_batch
                if not have_torchrec:  # FBGEMM and TorchRec columns stay empty; the report says why
                    cfg["engines"] = tuple(e for e in one_device.ENGINES if e != "fbgemm")
                    cfg["torchrec"] = False
                alt = partial(alternate, rounds=cfg["rounds"], gate=gate)
                module = one_device if part == "one_device" else equal_devices
                out = module.run(cfg, tmp, alt)
                out["rounds"] = cfg["rounds"]
            out["load_average_before"], out["load_average_after"] = before, load_average()
            out["background_busy"] = list(gate.busy)
            out["problems"] = gate.problems(gate.busy) if part != "stages" else []
            res["parts"][part] = out
    res["wall_s"] = time.time() - t0
    res["ok"] = checks_ok(res)
    return res


def stages_part(tmp: str) -> dict:
    return run_session(stages.__file__, "bytes", [{}], tmp=tmp, timeout_s=1800)[0]


def checks_ok(res: dict) -> bool:
    """The one-device engines agree with the reference; every equal-device configuration ran, and the fp32
    ones agree with the reference too."""
    ok = True
    one = res["parts"].get("one_device")
    if one:
        ok &= one["check"]["ok"]
    dist = res["parts"].get("equal_devices")
    if dist:
        for engine in ("jaxscale_sim", "jaxscale_mp", "torchrec"):
            for world in dist["engines"].get(engine, {}).values():
                for c in world["configs"].values():
                    ok &= "error" not in c
                    if c.get("precision") == "fp32" and c.get("check"):
                        ok &= c["check"]["max_abs_diff"] <= FP32_TOLERANCE
    return bool(ok)


FP32_TOLERANCE = 1e-5


# ---------------------------------------------------------------------------------------- report


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _bytes(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _problems(part: dict) -> list[str]:
    if part.get("problems"):
        return ["", f"> **Timings not valid: {'; '.join(part['problems'])}.**", ""]
    return []


def render_one_device(p: dict) -> list[str]:
    s, e = p["shape"], p["engines"]
    what = {
        "jaxscale": "`shard_batch` + jitted lookup + update (donated), 1 CPU device",
        "fbgemm": "TBE forward + backward with the fused optimizer",
        "numpy": "`jaxscale.reference`: lookup, per-row sums, AdaGrad in place",
    }
    fb = e.get("fbgemm", {}).get("median_ms")
    L = [
        "## 1. One device: lookup + row-wise AdaGrad",
        "",
        f"Table {s['rows']:,} x {s['dim']} fp32, {s['batch']} bags x {s['hotness']} Zipf({s['zipf']}) ids, fresh ids "
        f"every step ({s['touched_rows']:,} rows touched over {s['warmup'] + s['steps']} steps), sum pooling, row-wise "
        f"AdaGrad (lr {s['lr']}, eps {s['eps']}). {p['rounds']} sessions per engine, alternated "
        f"({' -> '.join(p['order'])}); each: {s['warmup']} warm-up + {s['steps']} timed steps. "
        + load_line(p["load_average_before"], p["load_average_after"], p["background_busy"])
        + ".",
        *_problems(p),
        "",
        "| engine | what | median ms | p10 | p90 | session medians ms | M ids/s | speed vs FBGEMM |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for name, x in e.items():
        sessions = ", ".join(_ms(m) for m in x["session_medians_ms"])
        speed = _ratio(fb / x["median_ms"]) if fb else "-"
        L.append(
            f"| {name} | {what.get(name, '')} | {_ms(x['median_ms'])} | {_ms(x['p10_ms'])} | {_ms(x['p90_ms'])} | "
            f"{sessions} | {s['batch'] * s['hotness'] / x['median_ms'] / 1e3:.2f} | {speed} |"
        )
    info = e.get("fbgemm", {}).get("info", {})
    c = p["check"]
    diffs = ", ".join(f"{n} {x['max_abs_diff_rows']:.1e}" for n, x in e.items())
    L += [
        "",
        f"Speed vs FBGEMM = FBGEMM's median / the engine's (> 1: faster than FBGEMM). FBGEMM: torch "
        f"{info.get('torch', '?')}, fbgemm-gpu-cpu {info.get('fbgemm', '?')}, {info.get('threads', '?')} threads; "
        f"jax {e.get('jaxscale', {}).get('info', {}).get('jax', '?')}.",
        "",
        f"Check (every session, against `jaxscale.reference`): max |rows - reference| after the last step: {diffs} "
        f"(tolerance {c['tolerance']:.1e}; rows moved up to {c['rows_moved_up_to']:.2e}): "
        f"**{'OK' if c['ok'] else 'MISMATCH'}**.",
        "",
    ]
    return L


def _capacity_line(p: dict) -> str:
    """How jaxscale sized its exchanges in this run."""
    if p.get("capacity_factor"):
        return f"jaxscale: fixed capacities (capacity_factor {p['capacity_factor']})."
    if p.get("reuse_capacities"):
        return (
            "jaxscale: `reuse_capacities=True`: the host counts the first batch's capacities (and those of a "
            "batch that overflowed them); every other batch reuses the largest counted set, with no host "
            "counting and no exchange between the processes before the step; a batch that does not fit is "
            "skipped and re-run counted, and that step's time includes both attempts (re-runs: table below)."
        )
    return "jaxscale: capacities counted on the host for every batch (exchanged between the processes)."


def _reruns(c: dict) -> str:
    if "reruns" not in c:
        return "-"
    return f"{c['reruns']} (+{c['reruns_warmup']} warm-up)" if c.get("reruns_warmup") else str(c["reruns"])


def render_equal_devices(p: dict) -> list[str]:
    s = p["shape"]
    L = [
        "## 2. Equal devices: jaxscale vs TorchRec",
        "",
        f"{s['tables']} pooled tables x {s['rows']:,} x {s['dim']}, global batch {s['batch']} x {s['hotness']} "
        f"Zipf({s['zipf']}) ids per table, fresh every step, row-wise AdaGrad (lr {s['lr']}); {p['rounds']} "
        f"session(s) per engine and device count, alternated; each session: {s['warmup']} warm-up + {s['steps']} "
        f"timed steps per configuration. jaxscale 1 proc: W simulated CPU devices in one process (mesh 1 x W); "
        f"jaxscale W procs: W processes of one device, gloo on 127.0.0.1 (mesh W x 1); TorchRec: DMP on W gloo "
        f"ranks, fused TBE. {_capacity_line(p)} Step time: median over timed steps, each step's slowest process. "
        f"Bytes: what leaves "
        f"the devices per step, summed over the W devices, one byte model for both (jaxscale from the compiled "
        f"HLO). Time ratio = jaxscale / TorchRec (< 1: jaxscale faster); targets: time <= 1.0x, bytes <= 1.0x "
        f"(fp8 <= 0.5x, fp8/bf16 <= 0.75x: its fp8 forward at 0.5x, its bf16 backward at 1.0x). "
        + load_line(p["load_average_before"], p["load_average_after"], p["background_busy"])
        + ".",
        *_problems(p),
        "",
        "| devices | sharding | jaxscale | TorchRec | jaxscale 1 proc ms | jaxscale W procs ms | TorchRec ms "
        "| time ratio (1 proc) | time ratio (W procs) | jaxscale bytes | TorchRec bytes | bytes ratio "
        "| meets targets |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in p["comparisons"]:
        targets = []
        for label, ratio in (("time 1p", r["time_ratio_sim"]), ("time Wp", r["time_ratio_mp"])):
            if ratio is not None:
                targets.append(f"{label} {'yes' if ratio <= 1.0 else 'no'}")
        if r["bytes_ratio"] is not None:
            targets.append(f"bytes {'yes' if r['bytes_ratio'] <= r['bytes_target'] else 'no'}")
        tr = r["torchrec_precision"] if not r["torchrec_error"] else f"{r['torchrec_precision']} (failed)"
        if r.get("jaxscale_error"):
            targets.append("jaxscale failed: see below")
        L.append(
            f"| {r['devices']} | {r['sharding']} | {r['precision']} | {tr} | {_ms(r['jaxscale_sim_ms'])} | "
            f"{_ms(r['jaxscale_mp_ms'])} | {_ms(r['torchrec_ms'])} | {_ratio(r['time_ratio_sim'])} | "
            f"{_ratio(r['time_ratio_mp'])} | {_bytes(r['jaxscale_bytes'])} | {_bytes(r['torchrec_bytes'])} | "
            f"{_ratio(r['bytes_ratio'])} | {', '.join(targets) or '-'} |"
        )
    matches = sorted({(r["precision"], r["torchrec_precision"], r["match"]) for r in p["comparisons"]})
    L += [
        "",
        "Matched precisions: " + "; ".join(f"jaxscale {a} vs TorchRec {b} ({why})" for a, b, why in matches) + ".",
    ]
    probe = p["engines"].get("torchrec_fp8_probe")
    if probe:
        L += ["", "TorchRec asked for FP8 QComms on 2 ranks (not timed):", ""]
        for sharding, r in probe.items():
            what = (
                f"ran; its collectives: {', '.join(r['collectives']) or 'none'}"
                if r["ran"]
                else f"failed: `{r['error'].splitlines()[0][:300]}`"
            )
            L.append(f"- {sharding}: {what}")
    L += [
        "",
        "Per engine and configuration (bytes per step summed over devices, by collective; check: max |table - "
        "reference| after the last step, fp32 must be <= " + f"{FP32_TOLERANCE:g}):",
        "",
        "| engine | devices | config | median ms | p10 | p90 | bytes by collective | overflow | re-runs | check |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for engine, worlds in p["engines"].items():
        if engine == "torchrec_fp8_probe":
            continue
        for w, x in worlds.items():
            for name, c in x["configs"].items():
                if "error" in c:
                    L.append(f"| {engine} | {w} | {name} | failed | | | `{c['error'].splitlines()[0][:120]}` | | | |")
                    continue
                kinds = "; ".join(f"{k} {v:,.0f}" for k, v in sorted(c["bytes_cluster_per_kind"].items())) or "none"
                chk = c.get("check")
                chk = f"{chk['max_abs_diff']:.1e} (acc/row {chk['col_parts']})" if chk else "-"
                L.append(
                    f"| {engine} | {w} | {name} | {_ms(c.get('median_ms'))} | {_ms(c.get('p10_ms'))} | "
                    f"{_ms(c.get('p90_ms'))} | {kinds} | {c.get('overflow_rows', '-')} | {_reruns(c)} | {chk} |"
                )
    L.append("")
    return L


def render_stages(p: dict) -> list[str]:
    st = p["stages"]
    if not st:
        return []
    base = st[0]["total_bytes_per_example"]
    L = [
        f"## 3. Bytes per technique stage (foundation smoke config, {'x'.join(map(str, p['mesh']))} mesh)",
        "",
        f"The embedding step (lookup + update) of `{p['config']}` compiled per stage, global batch "
        f"{st[0]['global_batch']}; stages are cumulative. Bytes from the compiled HLO, split intra- / inter-node "
        "(`jaxscale.comm_report.split_bytes`). The dense model's all-reduce is the same in every stage and not "
        "included.",
        "",
        "| stage | topology | forward / backward | planner plan | half_dim | intra-node B/example "
        "| inter-node B/example | total B/example | vs baseline |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for x in st:
        c = x["settings"]
        L.append(
            f"| {x['stage']} | {c['topology']} | {c['comm_forward']} / {c['comm_backward']} | "
            f"{'yes' if c['balanced'] else 'no'} | {'yes' if c['half_dim'] else 'no'} | "
            f"{x['intra_node_bytes_per_example']:,.1f} | {x['inter_node_bytes_per_example']:,.1f} | "
            f"{x['total_bytes_per_example']:,.1f} | {x['total_bytes_per_example'] / base:.3f} |"
        )
    L.append("")
    return L


def findings(res: dict) -> list[str]:
    """Sentences computed from the numbers."""
    out = []
    one = res["parts"].get("one_device")
    if one and "fbgemm" in one["engines"] and "jaxscale" in one["engines"]:
        j, f = one["engines"]["jaxscale"]["median_ms"], one["engines"]["fbgemm"]["median_ms"]
        out.append(
            f"One device: jaxscale {_ms(j)} ms vs FBGEMM {_ms(f)} ms per step: {f / j:.2f}x FBGEMM's speed "
            f"(target >= 1.0x: {'met' if f / j >= 1 else 'not met'})."
        )
    dist = res["parts"].get("equal_devices")
    if dist:
        rows = [r for r in dist["comparisons"] if r["devices"] > 1]
        for key, label in (("time_ratio_sim", "1 process"), ("time_ratio_mp", "W processes")):
            vals = [r[key] for r in rows if r[key] is not None]
            if vals:
                met = sum(v <= 1.0 for v in vals)
                out.append(
                    f"Equal devices, jaxscale in {label}: time ratio {min(vals):.2f}x to {max(vals):.2f}x TorchRec; "
                    f"{met} of {len(vals)} rows meet <= 1.0x."
                )
        b = [(r["bytes_ratio"], r["bytes_target"]) for r in rows if r["bytes_ratio"] is not None]
        if b:
            met = sum(v <= t for v, t in b)
            out.append(
                f"Equal devices, bytes: {min(v for v, _ in b):.2f}x to {max(v for v, _ in b):.2f}x TorchRec; "
                f"{met} of {len(b)} rows meet their target (<= 1.0x, fp8 <= 0.5x, fp8/bf16 <= 0.75x)."
            )
    if not res.get("ok", True):
        out.append("**A correctness check failed** (see the check columns): the timings compare different work.")
    return out


def render(res: dict) -> str:
    m = res["machine"]
    L = [
        f"# jaxscale benchmark suite{' (--quick)' if res['quick'] else ''}",
        "",
        f"Command: `{res['command']}`  ",
        f"Machine: {describe_machine(m)}.  ",
        f"Load average (1/5/15 min) at start: {m['load_average']}; wall time {res['wall_s']:.0f} s.",
        "",
        "Every engine is timed in its own processes with no other engine process alive (sessions alternate; see "
        "docs/benchmarks.md for why). CPU wall-clock is comparable only within one run; bytes are exact.",
        "",
    ]
    if not res.get("torchrec_installed", True):
        L += [
            "**TorchRec / FBGEMM are not installed here, so their columns are empty** "
            "(`bash experiments/baselines/install_torchrec.sh`).",
            "",
        ]
    f = findings(res)
    if f:
        L += ["**Summary (computed from the tables below):**", ""] + [f"- {x}" for x in f] + [""]
    parts = res["parts"]
    if "one_device" in parts:
        L += render_one_device(parts["one_device"])
    if "equal_devices" in parts:
        L += render_equal_devices(parts["equal_devices"])
    if "stages" in parts:
        L += render_stages(parts["stages"])
    return "\n".join(L)


# ------------------------------------------------------------------------------------------ main


def parse(argv):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ap = argparse.ArgumentParser(prog="python -m jaxscale.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, few configurations (a few minutes)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--rounds", type=int, default=None, help="sessions per engine (default: 3/2 full, 2/1 quick)")
    ap.add_argument("--capacity-factor", type=float, default=None, help="jaxscale capacity_factor (default: engine's)")
    ap.add_argument(
        "--count-every-batch",
        action="store_true",
        help="equal devices: jaxscale counts every batch's capacities on the host (default: reuse_capacities=True)",
    )
    ap.add_argument("--out", default=None, help="results path without suffix (default experiments/results/bench_suite)")
    ap.add_argument("--max-load", type=float, default=cores / 4, help="refuse above this 1-min load average")
    ap.add_argument("--max-busy", type=float, default=0.15, help="mark tables when others use more of the CPU")
    ap.add_argument("--allow-load", action="store_true", help="run on a loaded machine; tables are marked")
    ap.add_argument("--render", metavar="RESULT.json", help="only rewrite the Markdown of a recorded JSON")
    a = ap.parse_args(argv)
    unknown = set(a.parts.split(",")) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    a.argv = list(argv)
    return a


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.render:
        res = json.loads(Path(args.render).read_text())
        write_atomic(Path(args.render).with_suffix(".md"), render(res) + "\n")
        print(render(res))
        return 0
    out = Path(args.out) if args.out else RESULTS / ("bench_suite_quick" if args.quick else "bench_suite")
    gate = LoadGate(args.max_load, args.max_busy, args.allow_load)
    if not gate.start_ok and not args.allow_load:
        print(
            f"refusing to benchmark: load average {gate.start[0]:.2f} > --max-load {args.max_load:g} "
            f"(other work would distort the timings). Wait for an idle machine, or pass --allow-load to record "
            f"marked tables.",
            file=sys.stderr,
        )
        return EXIT_LOADED
    res = run(args)
    text = render(res)
    write_atomic(out.with_suffix(".json"), json.dumps(res, indent=1, default=float) + "\n")
    write_atomic(out.with_suffix(".md"), text + "\n")
    print(text)
    log(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    if not res["ok"]:
        print("FAILED: an engine failed or disagrees with the reference (see the tables)", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
