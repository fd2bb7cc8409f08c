"""Latency of one small collective between W JAX processes on this machine (gloo over 127.0.0.1).

    python experiments/bench/collective_latency.py            # W = 2, 4; writes experiments/results/
                                                              #   collective_latency.{md,json}
    python experiments/bench/collective_latency.py --quick    # fewer repetitions, W = 2 only
    python experiments/bench/collective_latency.py --render experiments/results/collective_latency.json

Why it exists: the embedding step and the host capacity exchange move a few counters between all
processes each step (overflow and invalid-id counts; per-destination capacity maxima). XLA:CPU runs
cross-process collectives through gloo, whose all-gather is a ring of W - 1 dependent rounds, while an
all-to-all is one round of pairwise exchanges; when processes share cores, each dependent round waits for
a peer to be scheduled. This measures, for one int32 vector of 2 (the step's counters) and of 24 elements
(capacity maxima), the median wall time per call of:
  all_reduce     `jax.lax.psum` over every device (how the step adds up its two counters)
  all_gather     `jax.lax.all_gather` (the capacity exchange on other platforms)
  all_to_all     `collectives.gather_small(..., as_all_to_all=True)`: the block repeated per peer, one
                 all-to-all (the capacity exchange on CPU)
  exchange       jaxscale's host capacity exchange as the engine calls it (host -> devices -> host)
Each W runs in its own W processes of one CPU device each; the four kinds are interleaved call by call.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxscale.benchmarks.machine import describe_machine, load_average
from jaxscale.benchmarks.machine import recorded_machine as machine
from jaxscale.benchmarks.sessions import free_port, run_session, script_command, worker_main
from jaxscale.infra.atomic import write_text as write_atomic

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
KINDS = ("all_reduce", "all_gather", "all_to_all", "exchange")


def _worker(spec: dict) -> dict:
    nproc, pid = spec["num_processes"], spec["process_id"]
    from jaxscale.infra import distributed

    distributed.initialize(spec["coordinator"], nproc, pid, local_devices=1)
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxscale.engine import collectives
    from jaxscale.engine.embedding import collection

    devices = np.array(sorted(jax.devices(), key=lambda d: d.process_index))
    mesh = Mesh(devices, ("p",))
    sharding = NamedSharding(mesh, P("p"))

    def shard_mapped(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("p"), out_specs=P(), check_vma=False))

    fns = {
        "all_reduce": shard_mapped(lambda b: jax.lax.psum(b, "p")),
        "all_gather": shard_mapped(lambda b: jax.lax.all_gather(b, "p", tiled=True)),
        "all_to_all": shard_mapped(lambda b: collectives.gather_small(b, "p", nproc, as_all_to_all=True)),
    }
    out = {}
    for n in spec["sizes"]:
        x = (np.arange(n, dtype=np.int32) + pid)[None]
        expect_sum = sum(np.arange(n) + p for p in range(nproc))
        times = {k: [] for k in KINDS}
        for rep in range(spec["warmup"] + spec["reps"]):
            for kind in KINDS:
                t = time.perf_counter()
                if kind == "exchange":
                    got = collection._exchange_across_processes(x[0].astype(np.int64), same_size=True)
                    ok = np.array_equal(got.reshape(nproc, n)[:, 0], np.arange(nproc))
                else:
                    arr = jax.make_array_from_process_local_data(sharding, x, (nproc, n))
                    got = np.asarray(fns[kind](arr).addressable_data(0))
                    ok = (
                        np.array_equal(got.reshape(-1), expect_sum)
                        if kind == "all_reduce"
                        else np.array_equal(got.reshape(nproc, n)[:, 0], np.arange(nproc))
                    )
                elapsed = time.perf_counter() - t
                if not ok:
                    raise AssertionError(f"{kind} of {n} elements gave a wrong result: {got}")
                if rep >= spec["warmup"]:
                    times[kind].append(elapsed)
        out[str(n)] = {k: v for k, v in times.items()}
    return {"process_id": pid, "jax": jax.__version__, "times_s": out}


def run(worlds, sizes, warmup: int, reps: int, tmp: str) -> dict:
    res = {}
    for w in worlds:
        base = {"num_processes": w, "sizes": sizes, "warmup": warmup, "reps": reps}
        base["coordinator"] = f"127.0.0.1:{free_port()}"
        results = run_session(
            script_command(HERE / "collective_latency.py"),
            "latency",
            [base | {"process_id": i} for i in range(w)],
            tmp=tmp,
            timeout_s=600,
        )
        per = {}
        for n in map(str, sizes):
            per[n] = {}
            for kind in KINDS:
                slowest = np.max([r["times_s"][n][kind] for r in results], axis=0)  # each call: its slowest process
                per[n][kind] = {
                    "median_ms": 1e3 * float(np.median(slowest)),
                    "p90_ms": 1e3 * float(np.percentile(slowest, 90)),
                }
        res[str(w)] = per
        res["jax"] = results[0]["jax"]
    return res


def render(r: dict) -> str:
    lines = [
        "# Latency of one small collective between JAX processes (gloo, 127.0.0.1)",
        "",
        f"Command: `{r['command']}`  ",
        f"Machine: {describe_machine(r['machine'])}; jax {r['jax']}.  ",
        f"Load average (1/5/15 min) at start: {r['machine']['load_average']}; after: {r['load_after']}.",
        "",
        f"W processes of one CPU device each; {r['reps']} timed calls per kind after {r['warmup']} warm-up, the "
        "kinds interleaved call by call; each call counts its slowest process. int32 vectors of n elements "
        "(2: the step's counters; 24: capacity maxima). See the script's docstring for what each kind is.",
        "",
        "| W | n | all_reduce ms | all_gather ms | all_to_all ms | exchange ms | all_reduce / all_to_all "
        "| all_gather / all_to_all |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in r["worlds"]:
        for n in map(str, r["sizes"]):
            m = {k: r["results"][str(w)][n][k]["median_ms"] for k in KINDS}
            ratios = f"{m['all_reduce'] / m['all_to_all']:.2f}x | {m['all_gather'] / m['all_to_all']:.2f}x"
            times = " | ".join(f"{m[k]:.3f}" for k in KINDS)
            lines.append(f"| {w} | {n} | {times} | {ratios} |")
    lines += ["", "Medians; p90 in the JSON. CPU wall-clock: compare within this run only.", ""]
    lines += ["Findings (computed from the table):", ""]
    for w in r["worlds"]:
        big = {k: r["results"][str(w)]["24"][k]["median_ms"] for k in KINDS}
        two = {k: r["results"][str(w)]["2"][k]["median_ms"] for k in KINDS}
        lines.append(
            f"- W = {w}: gathering 24 values, the all-to-all takes {big['all_to_all']:.3f} ms and the all-gather "
            f"{big['all_gather']:.3f} ms ({big['all_gather'] / big['all_to_all']:.2f}x); adding up 2 counters, the "
            f"all-reduce takes {two['all_reduce']:.3f} ms and an all-to-all {two['all_to_all']:.3f} ms "
            f"({two['all_reduce'] / two['all_to_all']:.2f}x)."
        )
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "collective_latency"), help="results path without suffix")
    ap.add_argument("--render", metavar="RESULT.json", help="only rewrite the Markdown of a recorded JSON")
    args = ap.parse_args(argv)
    if args.render:
        path = Path(args.render)
        write_atomic(path.with_suffix(".md"), render(json.loads(path.read_text())))
        return 0
    worlds, reps, warmup = ((2,), 20, 5) if args.quick else ((2, 4), 200, 20)
    sizes = (2, 24)
    r = {
        "command": "python experiments/bench/collective_latency.py" + (" --quick" if args.quick else ""),
        "machine": machine(),
        "worlds": list(worlds),
        "sizes": list(sizes),
        "reps": reps,
        "warmup": warmup,
    }
    with tempfile.TemporaryDirectory(prefix="jaxscale_latency_") as tmp:
        res = run(worlds, sizes, warmup, reps, tmp)
    r["jax"] = res.pop("jax")
    r["results"] = res
    r["load_after"] = load_average()
    out = Path(args.out)
    write_atomic(out.with_suffix(".json"), json.dumps(r, indent=1))
    write_atomic(out.with_suffix(".md"), render(r))
    print(render(r))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "latency":
        sys.exit(worker_main({"latency": _worker}))
    sys.exit(main())
