"""Soak test: a long run of the smoke model with periodic checkpoints; is memory flat and throughput steady?

    python experiments/soak/soak.py --steps 2000                 # smoke foundation model, 8 simulated devices
    python experiments/soak/soak.py --steps 300 --json /tmp/soak.json train.batch_size=32

Trains with `Trainer.run` (checkpoints every --checkpoint-every steps, asynchronous orbax saves, the last 2
kept) and samples, every --window steps: resident memory (VmRSS of this process), the wall time of the
window's steps and the checkpoint count. Reports RSS and throughput of the first window after compilation
vs the last one and exits 1 if RSS grew by more than --max-rss-growth-mb or throughput fell by more than
--max-slowdown (fraction). RSS growth is judged from the first window after the first checkpoint (orbax
allocates its thread pools and caches once, at the first save); the growth from the start is reported too.
Not part of the test suite (minutes of CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides")
    p.add_argument("--config", default=str(ROOT / "jaxscale" / "configs" / "foundation_smoke.yaml"))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--window", type=int, default=100, help="steps per sample")
    p.add_argument("--workdir", default=None, help="default: a temporary directory")
    p.add_argument("--json", default=None, help="write the samples and summary here")
    p.add_argument("--max-rss-growth-mb", type=float, default=200.0)
    p.add_argument("--max-slowdown", type=float, default=0.5)
    args = p.parse_args(argv)

    from jaxscale.training.config import load_config

    workdir = args.workdir or tempfile.mkdtemp(prefix="jaxscale_soak_")
    cfg = load_config(
        args.config,
        list(args.overrides)
        + [
            f"train.steps={args.steps}",
            f"train.checkpoint_every={args.checkpoint_every}",
            "train.eval_every=0",
            f"train.log_every={args.window}",
            f"train.workdir={workdir}",
        ],
    )
    import jax

    jax.config.update("jax_num_cpu_devices", cfg.mesh.nodes * cfg.mesh.local)
    from jaxscale.training.trainer import Trainer

    trainer = Trainer(cfg, progress=False)
    samples, state = [], {"n": 0, "t": None}
    step_fn = trainer.train_step

    def probe(st, batch):  # wraps the step: timing and memory every `window` steps
        out = step_fn(st, batch)
        state["n"] += 1
        n = state["n"]
        if n == 1:
            jax.block_until_ready(out[0])
            state["t"] = time.perf_counter()  # after compilation and the first step
            samples.append({"step": n, "rss_mb": rss_mb(), "examples_per_s": None})
        elif n % args.window == 0 or n == args.steps:
            jax.block_until_ready(out[0])
            now = time.perf_counter()
            steps = n - samples[-1]["step"]
            ckpt = Path(workdir) / "checkpoints"
            samples.append(
                {
                    "step": n,
                    "rss_mb": rss_mb(),
                    "examples_per_s": steps * cfg.train.batch_size / (now - state["t"]),
                    "checkpoints_on_disk": len([d for d in os.listdir(ckpt) if d.isdigit()]) if ckpt.exists() else 0,
                }
            )
            state["t"] = now
            s = samples[-1]
            print(
                f"step {n:6d}  rss {s['rss_mb']:8.1f} MB  {s['examples_per_s']:8.0f} ex/s  "
                f"checkpoints on disk {s['checkpoints_on_disk']}",
                flush=True,
            )
        return out

    trainer.train_step = probe
    t0 = time.perf_counter()
    out = trainer.run()
    wall = time.perf_counter() - t0
    timed = [s for s in samples if s["examples_per_s"] is not None]
    if len(timed) < 2:
        print("need at least two windows (steps >= 2 * window)", file=sys.stderr)
        return 2
    first, last = timed[0], timed[-1]
    # orbax allocates its thread pools and tensorstore caches at the first save: steady state starts after it
    steady = next((s for s in timed if s["step"] >= args.checkpoint_every + args.window), first)
    summary = {
        "steps": args.steps,
        "batch_size": cfg.train.batch_size,
        "checkpoint_every": args.checkpoint_every,
        "wall_s": wall,
        "rss_mb_after_first_step": samples[0]["rss_mb"],
        "rss_mb_first_window": first["rss_mb"],
        "rss_mb_end": last["rss_mb"],
        "rss_growth_mb": last["rss_mb"] - first["rss_mb"],
        "rss_mb_steady_start": steady["rss_mb"],
        "rss_mb_steady_start_step": steady["step"],
        "rss_growth_steady_mb": last["rss_mb"] - steady["rss_mb"],
        "examples_per_s_first_window": first["examples_per_s"],
        "examples_per_s_last_window": last["examples_per_s"],
        "throughput_ratio_last_over_first": last["examples_per_s"] / first["examples_per_s"],
        "loss_first": out["losses"][0],
        "loss_last": out["losses"][-1],
        "nonfinite_skipped": int(out["final_state"]["skipped"]),
        "workdir": workdir,
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "samples": samples}, indent=2))
    ok = (
        summary["rss_growth_steady_mb"] <= args.max_rss_growth_mb
        and summary["throughput_ratio_last_over_first"] >= 1 - args.max_slowdown
    )
    print("PASS: memory flat and throughput steady" if ok else "FAIL: memory grew or throughput fell")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
