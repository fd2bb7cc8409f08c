"""Why an engine's time depends on which other processes are alive: a measurement, not a benchmark.

    python experiments/bench/timing_probe.py            # writes experiments/results/timing_probe.{md,json}
    python experiments/bench/timing_probe.py --quick    # a 100,000-row table, fewer steps

FBGEMM's CPU TBE ran the one-device workload (1M x 64, 4096 x 20 Zipf ids, lookup + row-wise AdaGrad) in
about 5 ms per step alone, but about twice that in the old suite, which kept a JAX worker process alive
beside it and interleaved one step of each. This script times each engine (persistent workers of
`jaxscale.benchmarks.one_device`'s engines, fresh ids every step) under several conditions, each in fresh processes:

  alone            the engine's process is the only one
  beside idle JAX  a JAX worker that has run 3 steps is alive but blocked waiting for a command
  interleaved JAX  one JAX step, then one step of the engine, alternately (the old suite's protocol)
  interleaved NumPy  the same with the NumPy reference step (memory traffic, no thread pool)
  interleaved FBGEMM (for JAX)

and measures the CPU time a worker consumes while its main thread sleeps right after a step, in consecutive
windows (0-2, 2-5, 5-10, 10-20, 20-50 and 50-500 ms): threads that keep spinning after a step burn CPU that
another process needs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from jaxscale.benchmarks import one_device
from jaxscale.benchmarks.machine import describe_machine, load_average
from jaxscale.benchmarks.machine import recorded_machine as machine
from jaxscale.benchmarks.sessions import Worker, log, reply, serve
from jaxscale.benchmarks.stats import spread
from jaxscale.benchmarks.threads import usable_cores
from jaxscale.infra.atomic import write_text as write_atomic

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"

IDLE_WINDOWS_S = (0.002, 0.003, 0.005, 0.01, 0.03, 0.45)  # consecutive: 0-2, 2-5, 5-10, 10-20, 20-50, 50-500 ms


# ---------------------------------------------------------------------------------------- worker


def _worker(kind: str, d: str) -> None:
    engine = one_device.ENGINE_CLASSES[kind](d, one_device.LR, one_device.EPS, usable_cores())
    steps = len(engine.ids)

    def step(cmd):
        cpu = time.process_time()
        dt, _ = engine.step(int(cmd["s"]) % steps)
        return {"s": dt, "cpu_s": time.process_time() - cpu}

    def idle(cmd):
        """CPU and wall seconds of consecutive windows in which this process's main thread slept."""
        cpu, wall = [], []
        for w in cmd["windows"]:
            c, t = time.process_time(), time.perf_counter()
            time.sleep(w)
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - t)
        return {"cpu_s": cpu, "wall_s": wall}

    reply(op="ready", **engine.info)
    serve({"step": step, "idle": idle})


def start(kind: str, d: str) -> Worker:
    w = Worker([HERE / "timing_probe.py", "--worker", kind, d])
    w.info = w.read()
    return w


# ------------------------------------------------------------------------------------ conditions


def timed(target: Worker, steps: int, warmup: int, other: Worker | None = None) -> list[float]:
    """Step times of `target`; with `other`, one step of `other` before each step of `target`."""
    out = []
    for s in range(warmup + steps):
        if other is not None:
            other.ask(op="step", s=s)
        t = target.ask(op="step", s=s)["s"]
        if s >= warmup:
            out.append(t)
    return out


def condition(name: str, engine: str, partner: str | None, mode: str, d: str, steps: int, warmup: int) -> dict:
    """One condition in fresh processes. mode: 'alone', 'idle' (partner alive, blocked) or 'interleaved'."""
    log(f"{name}: {engine}" + (f" with {partner} ({mode})" if partner else ""))
    workers = []
    try:
        other = None
        if partner:
            other = start(partner, d)
            workers.append(other)
            for s in range(3):
                other.ask(op="step", s=s)
        target = start(engine, d)
        workers.append(target)
        times = timed(target, steps, warmup, other if mode == "interleaved" else None)
        idle = None
        if mode == "alone":  # CPU burnt right after each step, while the process waits
            idle = []
            for s in range(5):
                target.ask(op="step", s=s)
                idle.append(target.ask(op="idle", windows=list(IDLE_WINDOWS_S)))
        return {"name": name, "engine": engine, "partner": partner, "mode": mode, **spread(times), "idle_cpu_s": idle}
    finally:
        for w in workers:
            w.close()


CONDITIONS = (
    ("fbgemm alone", "fbgemm", None, "alone"),
    ("fbgemm beside an idle JAX process", "fbgemm", "jaxscale", "idle"),
    ("fbgemm interleaved with JAX steps", "fbgemm", "jaxscale", "interleaved"),
    ("fbgemm interleaved with NumPy steps", "fbgemm", "numpy", "interleaved"),
    ("jaxscale alone", "jaxscale", None, "alone"),
    ("jaxscale interleaved with FBGEMM steps", "jaxscale", "fbgemm", "interleaved"),
)


# ---------------------------------------------------------------------------------------- report


def render(res: dict) -> str:
    m = res["machine"]
    by_engine = {}
    for r in res["conditions"]:
        by_engine.setdefault(r["engine"], []).append(r)
    L = [
        "# Timing probe: what other processes do to an engine's step time",
        "",
        f"Command: `{res['command']}`  ",
        f"Machine: {describe_machine(m)}.  ",
        f"Load average (1/5/15 min) before: {res['load_before']}, after: {res['load_after']}.",
        "",
        f"Workload: {res['shape']['rows']:,} x {res['shape']['dim']} table, {res['shape']['batch']} x "
        f"{res['shape']['hotness']} Zipf(1.1) ids (fresh every step), sum pooling, lookup + row-wise AdaGrad. "
        f"Each condition in fresh processes, {res['warmup']} warm-up + {res['steps']} timed steps; the "
        f"conditions ran {res['rounds']} time(s), in order, and the table gives the median over all their steps.",
        "",
        "| condition | median ms | p10 | p90 | per round | vs alone |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for rows in by_engine.values():
        names = list(dict.fromkeys(r["name"] for r in rows))
        alone = statistics.median([r["median_ms"] for r in rows if r["mode"] == "alone"])
        for n in names:
            rs = [r for r in rows if r["name"] == n]
            med = statistics.median([r["median_ms"] for r in rs])
            L.append(
                f"| {n} | {med:.2f} | {min(r['p10_ms'] for r in rs):.2f} | {max(r['p90_ms'] for r in rs):.2f} | "
                f"{', '.join(format(r['median_ms'], '.2f') for r in rs)} | {med / alone:.2f}x |"
            )
    edges = [0.0]
    for w in IDLE_WINDOWS_S:
        edges.append(edges[-1] + w)
    L += [
        "",
        "CPU a process used while its main thread slept right after a step: CPU ms in each window after the step "
        "(as a share of one core: CPU time / the window's measured wall time), median of 5 steps per round:",
        "",
        "| process | " + " | ".join(f"{1e3 * a:g}-{1e3 * b:g} ms" for a, b in zip(edges, edges[1:])) + " |",
        "|---|" + "---:|" * len(IDLE_WINDOWS_S),
    ]
    for engine in by_engine:
        cpu, share = idle_profile(res, engine)
        if cpu:
            cells = [f"{1e3 * c:.2f} ({100 * f:.0f}%)" for c, f in zip(cpu, share)]
            L.append(f"| {engine} | " + " | ".join(cells) + " |")
    L += ["", "Findings (computed from the tables above):", ""] + [f"- {x}" for x in findings(res)] + [""]
    return "\n".join(L)


def idle_profile(res: dict, engine: str) -> tuple[list, list]:
    """Median CPU seconds and core share per idle window after a step, over every sample of `engine`."""
    samples = [s for r in res["conditions"] if r["engine"] == engine and r["idle_cpu_s"] for s in r["idle_cpu_s"]]
    if not samples:
        return [], []
    n = len(IDLE_WINDOWS_S)
    cpu = [statistics.median(s["cpu_s"][i] for s in samples) for i in range(n)]
    share = [statistics.median(s["cpu_s"][i] / s["wall_s"][i] for s in samples) for i in range(n)]
    return cpu, share


def _median_of(res, name):
    vals = [r["median_ms"] for r in res["conditions"] if r["name"] == name]
    return statistics.median(vals) if vals else None


def findings(res: dict) -> list[str]:
    out = []
    alone = _median_of(res, "fbgemm alone")
    for name in (
        "fbgemm beside an idle JAX process",
        "fbgemm interleaved with JAX steps",
        "fbgemm interleaved with NumPy steps",
    ):
        v = _median_of(res, name)
        if alone and v:
            out.append(f"{name}: {v:.2f} ms, {v / alone:.2f}x FBGEMM alone ({alone:.2f} ms).")
    j_alone, j_mixed = _median_of(res, "jaxscale alone"), _median_of(res, "jaxscale interleaved with FBGEMM steps")
    if j_alone and j_mixed:
        out.append(f"jaxscale interleaved with FBGEMM: {j_mixed / j_alone:.2f}x jaxscale alone.")
    for engine in ("jaxscale", "fbgemm"):
        cpu, share = idle_profile(res, engine)
        if cpu:
            busy_ms = 1e3 * sum(cpu[:-1])
            span = 1e3 * sum(IDLE_WINDOWS_S[:-1])
            out.append(
                f"{engine} process, main thread asleep after a step: {busy_ms:.1f} ms of CPU in the first "
                f"{span:g} ms ({100 * share[0]:.0f}% of a core in the first {1e3 * IDLE_WINDOWS_S[0]:g} ms), "
                f"{1e3 * cpu[-1]:.2f} ms in the following {1e3 * IDLE_WINDOWS_S[-1]:g} ms."
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="100,000-row table, fewer steps")
    ap.add_argument("--rounds", type=int, default=2, help="how many times every condition runs")
    ap.add_argument("--out", default=str(RESULTS / "timing_probe"), help="results path without suffix")
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "DIR"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(*a.worker)
        return 0
    shape = dict(rows=100_000 if a.quick else 1_000_000, dim=64, batch=4096, hotness=20)
    warmup, steps = (2, 6) if a.quick else (3, 15)
    res = {
        "command": "python experiments/bench/timing_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "load_before": load_average(),
        "shape": shape,
        "warmup": warmup,
        "steps": steps,
        "rounds": a.rounds,
        "conditions": [],
    }
    with tempfile.TemporaryDirectory(prefix="jaxscale_probe_") as d:
        one_device.make_data(d, shape["rows"], shape["dim"], shape["batch"], shape["hotness"], warmup + steps, 1.1)
        for _ in range(a.rounds):
            for name, engine, partner, mode in CONDITIONS:
                res["conditions"].append(condition(name, engine, partner, mode, d, steps, warmup))
    res["load_after"] = load_average()
    text = render(res)
    out = Path(a.out)
    write_atomic(out.with_suffix(".json"), json.dumps(res, indent=1) + "\n")
    write_atomic(out.with_suffix(".md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
