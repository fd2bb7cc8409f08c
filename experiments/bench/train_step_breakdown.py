"""Where a training step of the MovieLens foundation model goes on CPU, per mesh: one process per mesh shape.

    python experiments/bench/train_step_breakdown.py --run OUT [--meshes 1x1,1x2,1x8] [--steps 30]

OUT is a `bash experiments/movielens/run.sh OUT` directory (its `store` and `defs.json` are read; only the
store is needed, so a run stopped after "store built" will do). For each mesh a fresh process (the simulated
device count is fixed when JAX starts) builds the `Trainer` of `jaxscale/configs/movielens_foundation.yaml`
with that `mesh:` and times, per step and separately:

  data        `SequenceBatches.batch(step)`: the Grain reader and batch assembly on the host
  ids         the model's engine ids and their check against the tables (`ModelSpec.ids`, `check_ids`)
  place       the model batch onto the mesh (`to_global`)
  shard       `EmbeddingCollection.shard_batch`: exchange sizing (capacity counting) and the ids' transfer
  step        the compiled, donated train step until its outputs are ready (what `step_time_s` reports)
  metrics     the metrics' host read-back the trainer does every step
  forward     (for scale) the jitted loss alone, no gradient, on the same batch
  compile     the AOT compile of the step (once per run and capacity set), and of the eval/ranking steps
  evaluate    one `Trainer.evaluate` (eval batches + the full-corpus validation ranking), run every eval_every

and the trainer's own loop (`Trainer.run` for `--steps` steps, evaluation off), wall clock per step, with
the step executables it compiled inside that window (a batch whose exact exchange counts reach a new rung of
the capacity ladder compiles once; each compile's seconds land in that figure).
Writes experiments/results/train_step_breakdown.{json,md}; the Markdown is computed from the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "jaxscale" / "configs" / "movielens_foundation.yaml"
PHASES = ("data", "ids", "place", "shard", "step", "metrics")


def _ms(xs):
    return 1e3 * statistics.median(xs)


def worker(args) -> dict:
    nodes, local = (int(x) for x in args.mesh.split("x"))
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={nodes * local}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    from jaxscale.benchmarks.threads import xla_intra_op_threads
    from jaxscale.engine.embedding.ids import check_ids
    from jaxscale.sequences.query import SequenceReader
    from jaxscale.training.checkpoint import host as _host
    from jaxscale.training.config import load_config
    from jaxscale.training.data import to_global
    from jaxscale.training.trainer import Trainer

    run = Path(args.run)
    rows = SequenceReader(str(run / "store"), "ratings").vocabulary("item_id").num_indices
    workdir = tempfile.mkdtemp(prefix="breakdown_")
    overrides = [
        f"data.sequences.store={run / 'store'}",
        f"data.sequences.defs={run / 'defs.json'}",
        f"model.foundation.item_rows={rows}",
        f"mesh.nodes={nodes}",
        f"mesh.local={local}",
        f"train.workdir={workdir}",
        *args.override,
    ]
    cfg = load_config(str(CONFIG), overrides)
    t = time.perf_counter()
    tr = Trainer(cfg, progress=False, log=False)
    build_s = time.perf_counter() - t
    state = tr.init_state()
    times = {p: [] for p in PHASES}
    times["forward"], times["step_cpu"] = [], []
    compile_s = None
    loss_fn = jax.jit(lambda s, b, i: tr.spec.loss(_merge(tr, s), tr.ec.lookup(s["emb"], i), b)[0])
    for step in range(args.steps + args.warmup):
        t0 = time.perf_counter()
        host = tr.data.batch(step)
        t1 = time.perf_counter()
        host = {k: np.asarray(v) for k, v in host.items()}
        raw = tr.spec.ids(tr.model_cfg, host)
        ids, invalid = check_ids(raw, tr.ec.tables, tr.ec.feature_table)
        assert not invalid
        t2 = time.perf_counter()
        data = to_global(host, tr.mesh)
        t3 = time.perf_counter()
        sharded = tr.ec.shard_batch(ids)
        t4 = time.perf_counter()
        from jaxscale.training.trainer import Batch

        batch = Batch(data, sharded, 0, {})
        if compile_s is None:
            c0 = time.perf_counter()
            tr.compile(state, batch)
            compile_s = time.perf_counter() - c0
            jax.block_until_ready(loss_fn(state, data, sharded))
        t5, c5 = time.perf_counter(), time.process_time()
        state, metrics = tr.train_step(state, batch)
        jax.block_until_ready((state, metrics))
        t6, c6 = time.perf_counter(), time.process_time()
        metrics = {k: float(_host(v)) for k, v in metrics.items()}
        t7 = time.perf_counter()
        jax.block_until_ready(loss_fn(state, data, sharded))
        t8 = time.perf_counter()
        if step >= args.warmup:
            for p, dt in zip(PHASES + ("forward",), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t6 - t5, t7 - t6, t8 - t7)):
                times[p].append(dt)
            times["step_cpu"].append(c6 - c5)  # CPU time of every thread of the process during the step
    threads = xla_intra_op_threads()
    t = time.perf_counter()
    tr.evaluate(state)  # the first one compiles the eval and ranking steps
    eval_first_s = time.perf_counter() - t
    t = time.perf_counter()
    ev = tr.evaluate(state)
    eval_s = time.perf_counter() - t
    # the trainer's own loop, evaluation off: (wall of N + 1 steps - wall of 1 step) / N, so start-up, compile and
    # the final checkpoint save cancel (the executables are cached on the trainer)
    loop_cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, eval_every=0, eval_metric=None, early_stopping_patience=0)
    )
    loop = Trainer(loop_cfg, log=False, progress=False, workdir=tempfile.mkdtemp(prefix="breakdown_"))
    loop.run(steps=1)
    t = time.perf_counter()
    loop.run(steps=1)
    first_s = time.perf_counter() - t
    compiled_before = len(loop._executables)
    t = time.perf_counter()
    loop.run(steps=args.steps + 1)
    loop_s = time.perf_counter() - t
    return {
        "mesh": args.mesh,
        "devices": jax.device_count(),
        "xla_threads": threads,
        "batch_size": cfg.train.batch_size,
        "max_seq_len": tr.model_cfg.max_seq_len,
        "item_rows": rows,
        "eval_every": cfg.train.eval_every,
        "steps": args.steps,
        "median_ms": {p: _ms(v) for p, v in times.items()},
        "min_ms": {p: 1e3 * min(v) for p, v in times.items()},
        "all_ms": {p: [round(1e3 * x, 3) for x in v] for p, v in times.items()},
        "build_s": build_s,
        "compile_step_s": compile_s,
        "evaluate_first_s": eval_first_s,
        "evaluate_s": eval_s,
        "eval_metrics": {k: float(v) for k, v in ev.items() if isinstance(v, (int, float))},
        "run_first_step_s": first_s,
        "run_wall_s": loop_s,
        "run_steps": args.steps + 1,
        "run_ms_per_step": 1e3 * (loop_s - first_s) / args.steps,
        "run_compiles": len(loop._executables) - compiled_before,  # new capacity rungs met inside the timed run
    }


def _merge(tr, state):
    from flax import nnx

    model = nnx.merge(tr.graphdef, state["dense"], state["rest"])
    model.eval()
    return model


def render(res: dict) -> str:
    L = [
        "### Where a MovieLens foundation step goes (ML-100K store, `movielens_foundation.yaml`)",
        "",
        f"{res['machine']}. Load average before / after: {res['load_before']} / {res['load_after']}. "
        f"Batch {res['meshes'][0]['batch_size']}, {res['meshes'][0]['max_seq_len']} events, "
        f"{res['meshes'][0]['item_rows']} item rows; median ms of {res['meshes'][0]['steps']} steps per phase "
        f"(`{res['command']}`).",
        "",
        "| mesh | XLA threads | data | ids | place | shard | step | metrics | step (fastest) | step CPU time | "
        "forward only | host share | compile (s) | evaluate (s) | run(): ms/step | run(): compiles |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in res["meshes"]:
        t = m["median_ms"]
        host = sum(t[p] for p in PHASES if p not in ("step",))
        total = host + t["step"]
        per = m["run_ms_per_step"]
        L.append(
            f"| {m['mesh']} | {m['xla_threads']} | "
            + " | ".join(f"{t[p]:.1f}" for p in PHASES)
            + f" | {m['min_ms']['step']:.1f} | {t['step_cpu']:.1f} | {t['forward']:.1f} | {100 * host / total:.0f}% | "
            f"{m['compile_step_s']:.1f} | {m['evaluate_s']:.1f} | {per:.0f} | {m.get('run_compiles', '')} |"
        )
    return "\n".join(L + ["", fastest_mesh(res)])


def fastest_mesh(res: dict) -> str:
    """The mesh whose slowest recorded median step is the lowest, beside every mesh's range of medians."""
    steps: dict[str, list[float]] = {}
    for m in res["meshes"]:
        steps.setdefault(m["mesh"], []).append(m["median_ms"]["step"])
    best = min(steps, key=lambda k: max(steps[k]))
    ranges = "; ".join(
        f"{k} {min(v):.0f}-{max(v):.0f} ms" if len(v) > 1 else f"{k} {v[0]:.0f} ms" for k, v in steps.items()
    )
    return f"Median step per mesh over its rows: {ranges}. Fastest (lowest worst median): {best}."


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a run.sh output directory (its store and defs.json)")
    ap.add_argument("--meshes", default="1x1,1x2,1x8")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--override", action="append", default=[], help="config overrides (key=value)")
    ap.add_argument("--mesh", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "train_step_breakdown"))
    ap.add_argument("--append", action="store_true", help="add these meshes' rows to the recorded JSON at --out")
    args = ap.parse_args(argv)
    if args.mesh:  # a worker
        Path(args.result).write_text(json.dumps(worker(args)))
        return 0
    from jaxscale.benchmarks.machine import load_average, machine

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python experiments/bench/train_step_breakdown.py " + " ".join(argv or sys.argv[1:])
    if args.append:  # a later process's meshes beside the recorded ones (each row says when it ran)
        res = json.loads(out.with_suffix(".json").read_text())
        res["command"] += f"; then {command}"
    else:
        mach = machine()
        res = {"command": command, "machine": f"{mach['cpu_model']}, {mach.get('usable_cores', '?')} usable cores"}
        res["load_before"], res["meshes"] = load_average(), []
    for mesh in args.meshes.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--run", args.run, "--mesh", mesh, "--result", f.name]
            cmd += [f"--steps={args.steps}", f"--warmup={args.warmup}"] + [f"--override={o}" for o in args.override]
            env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
            subprocess.run(cmd, check=True, env=env)
            res["meshes"].append(json.loads(Path(f.name).read_text()) | {"load_after_mesh": load_average()})
        print(json.dumps({k: v for k, v in res["meshes"][-1].items() if k != "all_ms"}, indent=1), file=sys.stderr)
        res["load_after"] = load_average()
        out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")  # after every mesh: nothing lost
        out.with_suffix(".md").write_text(render(res) + "\n")
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
