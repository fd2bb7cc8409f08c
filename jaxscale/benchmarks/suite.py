"""The benchmark suite: jaxscale beside FBGEMM / TorchRec and NumPy, each engine timed alone.

    python -m jaxscale.bench                  # full run (6 rounds); bench_suite.{md,json}
    python -m jaxscale.bench --quick          # small shapes, few configurations, 2 rounds; bench_suite_quick.*

Results go to the current directory (`--out PREFIX` chooses; a checkout's recorded results are written with
`--out experiments/results/bench_suite`). Nothing here reads or writes the source tree: an installed wheel
runs the same suite (without TorchRec installed, its and FBGEMM's columns stay empty and say so).

Parts (`--parts`, default all):
  one_device   lookup + row-wise AdaGrad on one device: jaxscale vs FBGEMM's CPU TBE vs the NumPy
               reference, same table, ids, gradients and threads; the updated tables are checked
  equal_devices  jaxscale on W processes of one device (gloo) vs TorchRec on W gloo ranks, W = 1, 2, 4, the
               same threads per process, per sharding type, precision and exchange sizing; time against
               TorchRec's matched precision and its fastest configuration, with per-round ratios; bytes.
               jaxscale on W simulated devices of one process is reported apart (not equal devices)
  stages       bytes per example of the foundation smoke config's embedding step per technique stage,
               from the compiled HLO
  train_step   a real training step: the MovieLens foundation model through the Trainer (1xTHREADS mesh) vs a
               SASRec+ reference in PyTorch (eager, and under torch.compile), same shapes and threads:
               examples/s, median and worst, per-round ratios (skipped, and said so, without torch)

Timing protocol (`jaxscale.benchmarks.sessions`, docs/benchmarks.md): every engine runs in its own processes
and no other engine process is alive while it is timed; sessions alternate in rounds A, B, C, B, C, A, ...
and the report gives pooled medians, each round's ratio and the worst round's. The run refuses to start when
the 1-minute load average exceeds --max-load (default: a quarter of the cores) unless --allow-load is given
(--quick marks instead of refusing: its results are a check of the machinery, never recorded); the other
processes' CPU share is sampled before every session and a table whose sessions saw more than --max-busy is
marked. The Markdown is computed from the JSON (`--render RESULT.json` redoes it without running anything).
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

from jaxscale.benchmarks import equal_devices, one_device, stages, train_step
from jaxscale.benchmarks.machine import LoadGate, load_average, recorded_machine
from jaxscale.benchmarks.report import FP32_TOLERANCE, render
from jaxscale.benchmarks.sessions import alternate, log, module_command, run_session
from jaxscale.benchmarks.threads import usable_cores
from jaxscale.infra import atomic

PARTS = ("one_device", "equal_devices", "stages", "train_step")
EXIT_CHECK_FAILED, EXIT_LOADED = 1, 3
FULL_ROUNDS = 6  # rounds of sessions per engine in a recorded run: enough for a worst round to mean something


def sizes(quick: bool) -> dict:
    if quick:
        return {
            # tiny shapes: a check of the machinery in CI's bench smoke, not a measurement
            "train_step": dict(
                batch=8,
                events=16,
                items=64,
                layers=1,
                d_model=16,
                heads=2,
                inner=64,
                warmup=1,
                steps=2,
                rounds=1,
                engines=("jaxscale", "torch"),
            ),
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
                rounds=2,
                worlds=(2, 4),
                shardings=("table_wise", "row_wise"),
                precisions=("fp32", "fp8"),
                torchrec_fp8_probe=False,
            ),
        }
    return {
        # the benchmark shapes of issue 34: SASRec+ on ML-1M (3,416 items, histories of 200)
        "train_step": dict(
            batch=128,
            events=200,
            items=3416,
            layers=2,
            d_model=64,
            heads=2,
            inner=256,
            warmup=3,
            steps=8,
            rounds=FULL_ROUNDS,
        ),
        "one_device": dict(
            rows=1_000_000, dim=64, batch=4096, hotness=20, zipf=1.1, warmup=3, steps=15, rounds=FULL_ROUNDS
        ),
        "equal_devices": dict(
            tables=8,
            rows=20_000,
            dim=64,
            batch=1024,
            hotness=10,
            zipf=1.1,
            warmup=2,
            steps=16,
            rounds=FULL_ROUNDS,
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
        "machine": recorded_machine(),
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
                    cfg["capacities"] = "count" if args.count_every_batch else "reuse"
                if part == "train_step" and args.threads:
                    cfg["threads"] = args.threads
                if part == "train_step" and args.mesh:
                    cfg["mesh"] = args.mesh
                if part == "train_step" and args.engines:
                    cfg["engines"] = tuple(args.engines.split(","))
                cfg["cores"] = usable_cores()
                if not have_torchrec and part != "train_step":  # FBGEMM, TorchRec columns stay empty; says why
                    cfg["engines"] = tuple(e for e in one_device.ENGINES if e != "fbgemm")
                    cfg["torchrec"] = False
                alt = partial(alternate, rounds=cfg["rounds"], gate=gate)
                module = {"one_device": one_device, "equal_devices": equal_devices, "train_step": train_step}[part]
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
    return run_session(module_command(stages.WORKER), "bytes", [{}], tmp=tmp, timeout_s=1800)[0]


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


# ------------------------------------------------------------------------------------------ main


def default_out(quick: bool) -> Path:
    """bench_suite[_quick] in the current directory, wherever that is (a library writes where its user says)."""
    return Path("bench_suite_quick" if quick else "bench_suite")


def parse(argv):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ap = argparse.ArgumentParser(prog="python -m jaxscale.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, few configurations (a few minutes)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument(
        "--rounds", type=int, default=None, help=f"rounds of sessions per engine (default {FULL_ROUNDS}; --quick 2)"
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="train_step: intra-op threads of both engines (default: usable cores)"
    )
    ap.add_argument(
        "--mesh",
        default=None,
        help="train_step: jaxscale's mesh NODESxLOCAL of simulated CPU devices (default 1xTHREADS)",
    )
    ap.add_argument(
        "--engines",
        default=None,
        help=f"train_step: comma-separated subset of {','.join(train_step.ENGINES)} (default all; --quick: no compile)",
    )
    ap.add_argument("--capacity-factor", type=float, default=None, help="jaxscale capacity_factor (default: engine's)")
    ap.add_argument(
        "--count-every-batch",
        action="store_true",
        help="equal devices: every jaxscale row counts every batch's capacities on the host (default: "
        "reuse_capacities=True, with one counted fp32 row per sharding beside them)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="results path without suffix (default: bench_suite[_quick] in the current directory)",
    )
    ap.add_argument("--max-load", type=float, default=cores / 4, help="refuse above this 1-min load average")
    ap.add_argument("--max-busy", type=float, default=0.15, help="mark tables when others use more of the CPU")
    ap.add_argument("--allow-load", action="store_true", help="run on a loaded machine; tables are marked")
    ap.add_argument("--render", metavar="RESULT.json", help="only rewrite the Markdown of a recorded JSON")
    a = ap.parse_args(argv)
    unknown = set(a.parts.split(",")) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    if a.engines and not set(a.engines.split(",")) <= set(train_step.ENGINES):
        ap.error(f"unknown engines in --engines {a.engines}; choose from {','.join(train_step.ENGINES)}")
    if a.rounds is not None and a.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {a.rounds}")
    a.argv = list(argv)
    return a


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.render:
        res = json.loads(Path(args.render).read_text())
        atomic.write_text(Path(args.render).with_suffix(".md"), render(res) + "\n")
        print(render(res))
        return 0
    out = Path(args.out) if args.out else default_out(args.quick)
    gate = LoadGate(args.max_load, args.max_busy, args.allow_load)
    if not gate.start_ok and not (args.allow_load or args.quick):
        print(
            f"refusing to benchmark: load average {gate.start[0]:.2f} > --max-load {args.max_load:g} "
            f"(other work would distort the timings). Wait for an idle machine, or pass --allow-load to record "
            f"marked tables.",
            file=sys.stderr,
        )
        return EXIT_LOADED
    res = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the JSON first: what was measured survives a report that fails (`--render` redoes the Markdown)
    atomic.write_text(out.with_suffix(".json"), json.dumps(res, indent=1, default=float) + "\n")
    text = render(res)
    atomic.write_text(out.with_suffix(".md"), text + "\n")
    print(text)
    log(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    if not res["ok"]:
        print("FAILED: an engine failed or disagrees with the reference (see the tables)", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
