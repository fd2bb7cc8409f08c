"""jaxscale's native fused CPU kernels vs FBGEMM's CPU TBE: one device, lookup + row-wise AdaGrad.

    python experiments/bench/bench_native.py            # full run, writes experiments/results/bench_native.md
    python experiments/bench/bench_native.py --quick    # small shapes, a smoke test of the script (~1 min)

Workload (the one-device workload of `python -m jaxscale.bench`): one table 1M x 64 f32, 4096 bags x 20
Zipf(1.1) ids per step (fresh ids and output gradients every step), pooled sum lookup + fused exact
row-wise AdaGrad (lr 0.01, eps 1e-8), every engine starting from the same table.

Engines, each in its OWN process, never two engine processes alive while one is timed:
  jaxscale-native  `jaxscale.engine.native.gather_pool` + `update_pooled(..., after=out)` in one jitted step with
                   the table and accumulator donated (updated in place), JAXSCALE_NATIVE=1;
  fbgemm           `SplitTableBatchedEmbeddingBagsCodegen` (HOST/CPU, EXACT_ROWWISE_ADAGRAD, SUM):
                   forward, then `backward` (the fused optimizer updates the table);
  jaxscale-jax     the same jitted step on the pure-JAX kernels (JAXSCALE_NATIVE=0), for reference.
Protocol: whole processes alternate (A, B, C, then rotated) for --rounds rounds; each process runs
--warmup untimed and --steps timed steps (each step timed alone, to completion); medians over all timed
steps of all rounds, and the median of each round. Each process also times --steps forward-only calls.
Afterwards the engines' final tables and accumulators (touched rows) must agree with each other and with
a NumPy replay of the same steps, or the run fails.

One CPU, one thread (on by default; --no-single-thread skips it): the same rounds for jaxscale-native and
fbgemm with each process pinned to one CPU and one thread: the work per step, without thread scheduling
(OpenMP teams suffer most when the machine is busy and their threads get descheduled).

Interference (on by default; --no-interference skips it): the old suite kept a JAX worker and an FBGEMM worker alive
side by side and interleaved their steps. Here FBGEMM (and jaxscale-native) are timed again with the other
engine's process alive: (idle) the other process waits, blocked on a pipe; (interleaved) it runs one step
before each timed step. The table reports the medians beside the alone medians.

The load average is printed beside every table: on a busy machine the numbers are indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
from jaxscale.benchmarks.machine import recorded_machine as machine  # noqa: E402  (no JAX in this process)
from jaxscale.benchmarks.stats import zipf_ids  # noqa: E402

RESULTS = REPO / "experiments" / "results" / "bench_native.md"
LR, EPS = 0.01, 1e-8
ENGINES = ("jaxscale-native", "fbgemm", "jaxscale-jax")
FULL = dict(rows=1_000_000, dim=64, batch=4096, hotness=20, zipf=1.1, rounds=3, warmup=3, steps=15)
QUICK = dict(rows=100_000, dim=64, batch=1024, hotness=20, zipf=1.1, rounds=2, warmup=2, steps=5)


def log(msg: str):
    print(f"[bench_native {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# ------------------------------------------------------------------------------------------- workers


def _data(spec: dict):
    d = Path(spec["dir"])
    table = np.load(d / "table.npy")
    ids = np.load(d / "ids.npy")  # [steps, B, L] int32
    grads = np.load(d / "grads.npy")  # [steps, B, dim] float32
    return table, ids, grads


def _jax_engine(spec: dict, native_mode: str):
    """(step(i) -> seconds, forward(i) -> seconds, final() -> (table, acc), info) for a JAX engine."""
    os.environ["JAXSCALE_NATIVE"] = native_mode
    import jax
    import jax.numpy as jnp

    from jaxscale.engine import native

    table, ids, grads = _data(spec)
    state = {"t": jnp.asarray(table), "a": jnp.zeros((table.shape[0],), jnp.float32)}
    del table
    ids_dev = [jnp.asarray(x) for x in ids]
    grads_dev = [jnp.asarray(g) for g in grads]

    def step(t, a, x, g):
        out = native.gather_pool(t, x, pooling="sum")
        t, a = native.update_pooled(
            t, a, x, g, pooling="sum", optimizer="rowwise_adagrad", learning_rate=LR, eps=EPS, after=out
        )
        return out, t, a

    step_jit = jax.jit(step, donate_argnums=(0, 1))
    fwd_jit = jax.jit(lambda t, x: native.gather_pool(t, x, pooling="sum"))
    lowered = step_jit.lower(state["t"], state["a"], ids_dev[0], grads_dev[0])
    hlo = lowered.as_text()
    compiled = lowered.compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    first_out = []

    def run_step(i):
        t0 = time.perf_counter()
        out, state["t"], state["a"] = compiled(state["t"], state["a"], ids_dev[i], grads_dev[i])
        jax.block_until_ready((out, state["t"], state["a"]))
        dt = time.perf_counter() - t0
        if i == 0:
            first_out.append(np.asarray(out))
        return dt

    def run_forward(i):
        t0 = time.perf_counter()
        jax.block_until_ready(fwd_jit(state["t"], ids_dev[i]))
        return time.perf_counter() - t0

    info = {
        "jax": jax.__version__,
        "native_kernels": "jaxscale_update_pooled" in hlo,
        "native_library": str(native.library_path()) if native_mode == "1" else None,
        "step_temp_bytes": int(temp),
        "table_bytes": int(state["t"].size * 4),
    }
    return run_step, run_forward, lambda: (np.asarray(state["t"]), np.asarray(state["a"])), first_out, info


def _fbgemm_engine(spec: dict):
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    table, ids, grads = _data(spec)
    rows, dim = table.shape
    _, B, L = ids.shape
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM,
    )
    w = tbe.split_embedding_weights()[0]
    with torch.no_grad():
        w.copy_(torch.from_numpy(table))
    del table
    idx = [torch.from_numpy(x.reshape(-1).astype(np.int64)) for x in ids]
    offsets = torch.arange(0, B * L + 1, L, dtype=torch.int64)
    g = [torch.from_numpy(x) for x in grads]
    first_out = []

    def run_step(i):
        t0 = time.perf_counter()
        out = tbe(idx[i], offsets)
        out.backward(g[i])  # the fused optimizer updates the touched rows here
        dt = time.perf_counter() - t0
        if i == 0:
            first_out.append(out.detach().numpy().copy())
        return dt

    def run_forward(i):
        t0 = time.perf_counter()
        with torch.no_grad():
            tbe(idx[i], offsets)
        return time.perf_counter() - t0

    def final():
        acc = tbe.split_optimizer_states()[0][0].detach().numpy().copy()
        return w.detach().numpy().copy(), acc

    import fbgemm_gpu

    info = {
        "torch": torch.__version__,
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"),
        "torch_threads": torch.get_num_threads(),
        "kernel": "SplitTableBatchedEmbeddingBagsCodegen(HOST/CPU, EXACT_ROWWISE_ADAGRAD, SUM)",
    }
    return run_step, run_forward, final, first_out, info


def _engine(name: str, spec: dict):
    if name == "fbgemm":
        return _fbgemm_engine(spec)
    return _jax_engine(spec, "1" if name == "jaxscale-native" else "0")


def pin_to_one_cpu(cpu: int):
    """This process on one CPU with one thread (before JAX / torch start): per-thread efficiency."""
    os.sched_setaffinity(0, {cpu})
    os.environ["OMP_NUM_THREADS"] = "1"  # torch's OpenMP pool; the native kernels follow the affinity


def worker(name: str, spec_path: str, out_path: str):
    """One engine, one process: warm-up + timed steps, forward-only timings, final state saved."""
    spec = json.loads(Path(spec_path).read_text())
    if os.environ.get("BENCH_NATIVE_PIN"):
        pin_to_one_cpu(int(os.environ["BENCH_NATIVE_PIN"]))
    run_step, run_forward, final, first_out, info = _engine(name, spec)
    if os.environ.get("BENCH_NATIVE_PIN") and name == "fbgemm":
        import torch

        torch.set_num_threads(1)
        info["torch_threads"] = torch.get_num_threads()
    nsteps = spec["warmup"] + spec["steps"]
    step_s = [run_step(i) for i in range(nsteps)][spec["warmup"] :]
    fwd_s = [run_forward(i) for i in range(nsteps)][spec["warmup"] :]
    table, acc = final()
    touched = np.load(Path(spec["dir"]) / "touched.npy")
    np.save(out_path + ".table.npy", table[touched])
    np.save(out_path + ".acc.npy", acc[touched])
    np.save(out_path + ".out0.npy", first_out[0])
    Path(out_path).write_text(json.dumps({"step_s": step_s, "forward_s": fwd_s, "info": info}))


IDLE_PROBE_S = 0.5


def process_cpu_s() -> float:
    """CPU seconds used so far by every thread of this process."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def server(name: str, spec_path: str):
    """A persistent engine process (interference runs), driven by stdin lines:
    'step' runs one step and replies its time; 'probe' runs one step, then sleeps IDLE_PROBE_S and replies
    the CPU seconds its threads burnt meanwhile (worker threads that spin after a step show up here)."""
    spec = json.loads(Path(spec_path).read_text())
    run_step, *_ = _engine(name, spec)
    n = spec["warmup"] + spec["steps"]
    i = 0
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd not in ("step", "probe"):
            break
        dt = run_step(i % n)
        i += 1
        if cmd == "probe":
            c0 = process_cpu_s()
            time.sleep(IDLE_PROBE_S)
            dt = process_cpu_s() - c0
        print(json.dumps(dt), flush=True)


# ---------------------------------------------------------------------------------------- orchestrator


def _child_env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)  # one CPU device, default XLA settings
    return env


def run_worker(name: str, spec_path: str, tmp: str, tag: str, pin: int | None = None) -> dict:
    out = os.path.join(tmp, f"{name}.{tag}.json")
    cmd = [sys.executable, __file__, "--worker", name, "--spec", spec_path, "--out", out]
    env = _child_env()
    if pin is not None:
        env["BENCH_NATIVE_PIN"] = str(pin)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} worker failed:\n{proc.stderr[-4000:]}")
    res = json.loads(Path(out).read_text())
    res["out"] = out
    return res


class Server:
    def __init__(self, name: str, spec_path: str):
        cmd = [sys.executable, __file__, "--serve", name, "--spec", spec_path]
        self.proc = subprocess.Popen(
            cmd, env=_child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        line = self.proc.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"{name} server did not start: {line!r}")

    def step(self, cmd: str = "step") -> float:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def idle_probe(name: str, spec_path: str, cfg: dict) -> float:
    """Median CPU ms a waiting engine process burns in the IDLE_PROBE_S after a step."""
    srv = Server(name, spec_path)
    try:
        for _ in range(cfg["warmup"]):
            srv.step()
        return 1e3 * statistics.median(srv.step("probe") for _ in range(5))
    finally:
        srv.close()


def interference(spec_path: str, cfg: dict, engines) -> dict:
    """Medians of each timed engine with the other engine's process alive (idle, or stepping in between)."""
    n = cfg["warmup"] + cfg["steps"]
    out = {}
    for timed, other in (("fbgemm", "jaxscale-native"), ("jaxscale-native", "fbgemm")):
        a = Server(timed, spec_path)
        try:
            b = Server(other, spec_path)
            try:
                for _ in range(cfg["warmup"]):
                    b.step()
                idle = [a.step() for _ in range(n)][cfg["warmup"] :]
                inter = []
                for i in range(n):
                    b.step()
                    t = a.step()
                    if i >= cfg["warmup"]:
                        inter.append(t)
                spin = statistics.median(a.step("probe") for _ in range(5))
            finally:
                b.close()
        finally:
            a.close()
        out[timed] = {
            "other": other,
            "idle_ms": med_ms(idle),
            "interleaved_ms": med_ms(inter),
            "cpu_ms_while_waiting": 1e3 * spin,
            "load": loadavg(),
        }
        log(
            f"interference: {timed} with {other} alive: idle {out[timed]['idle_ms']:.2f} ms, "
            f"interleaved {out[timed]['interleaved_ms']:.2f} ms"
        )
    if "jaxscale-jax" in engines:  # the engine the old suite's JAX worker ran: XLA's own threads at work
        out["jaxscale-jax"] = {"cpu_ms_while_waiting": idle_probe("jaxscale-jax", spec_path, cfg), "load": loadavg()}
    return out


def rounds(engines, spec: str, tmp: str, cfg: dict, pin: int | None = None):
    """Whole processes alternate (order rotated each round); returns (runs, medians per engine)."""
    runs = {e: [] for e in engines}
    loads = {e: [] for e in engines}
    tag = "pinned" if pin is not None else "r"
    for r in range(cfg["rounds"]):
        order = engines[r % len(engines) :] + engines[: r % len(engines)]
        for name in order:
            runs[name].append(run_worker(name, spec, tmp, f"{tag}{r}", pin=pin))
            loads[name].append(loadavg())
            log(
                f"round {r}{' (one CPU, one thread)' if pin is not None else ''}: {name} step median "
                f"{med_ms(runs[name][-1]['step_s']):.2f} ms (load {loads[name][-1]})"
            )
    medians = {
        name: {
            "step": med_ms([t for run in runs[name] for t in run["step_s"]]),
            "forward": med_ms([t for run in runs[name] for t in run["forward_s"]]),
            "per_round": [med_ms(run["step_s"]) for run in runs[name]],
            "load": loads[name],
        }
        for name in engines
    }
    return runs, medians


def med_ms(seconds) -> float:
    return 1e3 * statistics.median(seconds) if seconds else float("nan")


def make_data(cfg: dict, tmp: str) -> str:
    rng = np.random.default_rng(1)
    rows, dim, B, L = cfg["rows"], cfg["dim"], cfg["batch"], cfg["hotness"]
    n = cfg["warmup"] + cfg["steps"]
    table = rng.uniform(-0.05, 0.05, (rows, dim)).astype(np.float32)
    ids = np.stack([zipf_ids(rng, rows, (B, L), cfg["zipf"]) for _ in range(n)])
    grads = rng.normal(size=(n, B, dim)).astype(np.float32)
    d = Path(tmp)
    np.save(d / "table.npy", table)
    np.save(d / "ids.npy", ids)
    np.save(d / "grads.npy", grads)
    np.save(d / "touched.npy", np.unique(ids))
    spec = d / "spec.json"
    spec.write_text(json.dumps({"dir": tmp, **cfg}))
    return str(spec)


def numpy_replay(tmp: str):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD replayed in NumPy (float64 sums) over every step: touched rows."""
    d = Path(tmp)
    table = np.load(d / "table.npy").astype(np.float64)
    ids, grads = np.load(d / "ids.npy"), np.load(d / "grads.npy")
    acc = np.zeros(table.shape[0], np.float64)
    out0 = table[ids[0]].sum(1)
    for x, g in zip(ids, grads):
        uniq, inv = np.unique(x.reshape(-1), return_inverse=True)
        gs = np.zeros((len(uniq), table.shape[1]))
        np.add.at(gs, inv, np.repeat(g.astype(np.float64), x.shape[1], axis=0))
        acc[uniq] += (gs * gs).mean(1)
        table[uniq] -= LR * gs / (np.sqrt(acc[uniq])[:, None] + EPS)
    touched = np.load(d / "touched.npy")
    return table[touched], acc[touched], out0


def check(results: dict, tmp: str) -> dict:
    ref_t, ref_a, ref_out = numpy_replay(tmp)
    scale = max(1.0, float(np.abs(ref_t).max()))
    out = {"touched_rows": int(len(ref_t)), "max_rows_moved": None, "engines": {}}
    table0 = np.load(Path(tmp) / "table.npy")[np.load(Path(tmp) / "touched.npy")]
    out["max_rows_moved"] = float(np.abs(ref_t - table0).max())
    for name, runs in results.items():
        last = runs[-1]["out"]
        t, a, o = (np.load(last + s) for s in (".table.npy", ".acc.npy", ".out0.npy"))
        out["engines"][name] = {
            "max_abs_diff_table_vs_numpy": float(np.abs(t - ref_t).max()),
            "max_rel_diff_acc_vs_numpy": float((np.abs(a - ref_a) / np.maximum(np.abs(ref_a), 1e-12)).max()),
            "max_abs_diff_first_output_vs_numpy": float(np.abs(o - ref_out).max()),
        }
    tol = 1e-4 * scale
    out["tolerance"] = tol
    out["ok"] = out["max_rows_moved"] > 0 and all(
        e["max_abs_diff_table_vs_numpy"] <= tol
        and e["max_rel_diff_acc_vs_numpy"] <= 1e-3
        and e["max_abs_diff_first_output_vs_numpy"] <= tol
        for e in out["engines"].values()
    )
    if "jaxscale-native" in results and "fbgemm" in results:
        tn = np.load(results["jaxscale-native"][-1]["out"] + ".table.npy")
        tf = np.load(results["fbgemm"][-1]["out"] + ".table.npy")
        out["max_abs_diff_native_vs_fbgemm"] = float(np.abs(tn - tf).max())
        out["ok"] = out["ok"] and out["max_abs_diff_native_vs_fbgemm"] <= tol
    return out


def markdown(res: dict) -> str:
    cfg, m = res["config"], res["machine"]
    med = res["median_ms"]
    lines = [
        "# Native fused CPU kernels vs FBGEMM's CPU TBE (one device)",
        "",
        f"Generated by `python experiments/bench/bench_native.py{' --quick' if res['quick'] else ''}` "
        f"on {res['date']}.",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} CPUs, {m['memory']} RAM; {m['platform']}, Python {m['python']}. "
        f"Load average (1, 5, 15 min): **{res['load_start']}** at start, **{res['load_end']}** at end.",
        "",
        f"Workload: table {cfg['rows']:,} x {cfg['dim']} f32, {cfg['batch']} bags x {cfg['hotness']} "
        f"Zipf({cfg['zipf']}) ids per step (fresh ids and gradients each step), pooled sum lookup + exact "
        f"row-wise AdaGrad (lr {LR}, eps {EPS}). Each engine alone in its own process; whole processes "
        f"alternate for {cfg['rounds']} rounds; {cfg['warmup']} warm-up + {cfg['steps']} timed steps per "
        "process; medians over all timed steps.",
        "",
        "| engine | lookup + update step (ms) | ratio vs FBGEMM (>1 = faster) | forward only (ms) | "
        "per-round step medians (ms) | load avg during its runs |",
        "|---|---|---|---|---|---|",
    ]
    busy = max([res["load_start"][0], res["load_end"][0]] if res["load_start"] and res["load_end"] else [0.0])
    if m["cores"] and busy > 0.5 * m["cores"]:
        lines[-2:-2] = [
            f"**The machine was busy** (1-min load average up to {busy:.1f} on {m['cores']} CPUs): other "
            "processes shared the cores, so these times and ratios are indicative only (an OpenMP engine "
            "suffers more than others when its threads are descheduled). Re-run on an idle machine.",
            "",
        ]
    lines += engine_rows(med)
    c = res["check"]
    lines += [
        "",
        f"Check ({'passed' if c['ok'] else 'FAILED'}): after every step of the run, the {c['touched_rows']:,} touched "
        f"rows of each engine's table vs a NumPy float64 replay: "
        + ", ".join(
            f"{k} {v['max_abs_diff_table_vs_numpy']:.1e} (accumulator rel. {v['max_rel_diff_acc_vs_numpy']:.1e}, "
            f"first output {v['max_abs_diff_first_output_vs_numpy']:.1e})"
            for k, v in c["engines"].items()
        )
        + (
            f"; jaxscale-native vs FBGEMM {c['max_abs_diff_native_vs_fbgemm']:.1e}"
            if "max_abs_diff_native_vs_fbgemm" in c
            else ""
        )
        + f" (tolerance {c['tolerance']:.1e}; rows moved up to {c['max_rows_moved']:.1e}).",
        "",
    ]
    info = res["info"]
    if "fbgemm" in info:
        f = info["fbgemm"]
        lines.append(
            f"FBGEMM: {f['kernel']}, torch {f['torch']}, fbgemm-gpu {f['fbgemm_gpu']}, {f['torch_threads']} threads."
        )
    if "jaxscale-native" in info:
        j = info["jaxscale-native"]
        lines.append(
            f"jaxscale-native: jax {j['jax']}, native kernels in the compiled step: {j['native_kernels']}; "
            f"temporary memory of the step {j['step_temp_bytes'] / 2**20:.1f} MiB for a "
            f"{j['table_bytes'] / 2**20:.0f} MiB table (updated in place). Library: {res['native_build']}."
        )
    if res.get("interference"):
        lines += [
            "",
            "## Interference: timing with the other engine's process alive",
            "",
            "| timed engine | alone (main rounds) | other process alive, idle | other process stepping in between "
            f"| CPU its threads burn in the {IDLE_PROBE_S:g} s after a step | load avg |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in res["interference"].items():
            if "idle_ms" not in r:
                continue
            alone = med[name]["step"]
            idle, inter = r["idle_ms"], r["interleaved_ms"]
            load = r["load"][0] if r["load"] else "?"
            spin = r.get("cpu_ms_while_waiting", float("nan"))
            lines.append(
                f"| {name} (other: {r['other']}) | {alone:.2f} ms | {idle:.2f} ms ({idle / alone:.2f}x) "
                f"| {inter:.2f} ms ({inter / alone:.2f}x) | {spin:.1f} ms | {load} |"
            )
        lines += ["", *interference_notes(res)]
    if res.get("single_thread_ms"):
        st = res["single_thread_ms"]
        sc = res["single_thread_check"]
        lines += [
            "",
            f"## One CPU, one thread each (both pinned to CPU {res['single_thread_cpu']})",
            "",
            "The same rounds with every engine process pinned to one CPU (`sched_setaffinity`), FBGEMM with one "
            "OpenMP thread, the native kernels single-threaded (they follow the affinity): the work each engine "
            "does per step, with no thread scheduling in the way.",
            "",
            "| engine | lookup + update step (ms) | ratio vs FBGEMM (>1 = faster) | forward only (ms) | "
            "per-round step medians (ms) | load avg during its runs |",
            "|---|---|---|---|---|---|",
            *engine_rows(st),
            "",
            f"Check ({'passed' if sc['ok'] else 'FAILED'}): jaxscale-native vs FBGEMM "
            f"{sc.get('max_abs_diff_native_vs_fbgemm', float('nan')):.1e} after the same steps.",
        ]
    lines += ["", "Raw per-step times (ms) are in the JSON written next to this file."]
    return "\n".join(lines) + "\n"


def engine_rows(med: dict) -> list[str]:
    fb = med["fbgemm"]["step"]
    rows = []
    for name, s in med.items():
        per_round = ", ".join(f"{x:.2f}" for x in s["per_round"])
        loads = "; ".join(str(x[0]) for x in s["load"])
        rows.append(
            f"| {name} | {s['step']:.2f} | {fb / s['step']:.2f}x | {s['forward']:.2f} | {per_round} | {loads} |"
        )
    return rows


def interference_notes(res: dict) -> list[str]:
    """Sentences computed from the interference medians (nothing typed by hand)."""
    notes = []
    for name, r in res["interference"].items():
        alone = res["median_ms"][name]["step"]
        for key, label in (("idle_ms", "idle"), ("interleaved_ms", "stepping in between")):
            if key not in r:
                continue
            ratio = r[key] / alone
            verdict = "slower" if ratio > 1.1 else ("faster" if ratio < 0.9 else "within 10% of alone")
            notes.append(
                f"- {name} with a {r['other']} process alive and {label}: {ratio:.2f}x its alone time ({verdict})."
            )
        if "cpu_ms_while_waiting" in r:
            spin = r["cpu_ms_while_waiting"]
            share = spin / (1e3 * IDLE_PROBE_S)
            notes.append(
                f"- a waiting {name} process burns {spin:.1f} ms of CPU in the {IDLE_PROBE_S:g} s after a step "
                f"({share:.1%} of one core): "
                + ("its threads keep spinning after the step." if share > 0.05 else "its threads go to sleep.")
            )
    return notes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke test of this script)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {ENGINES}")
    p.add_argument("--no-interference", action="store_true", help="skip the interference runs")
    p.add_argument("--no-single-thread", action="store_true", help="skip the one-CPU, one-thread rounds")
    p.add_argument("--out", default=str(RESULTS), help="Markdown results file (a .json is written beside it)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.spec, args.out)
        return 0
    if args.serve:
        server(args.serve, args.spec)
        return 0

    cfg = dict(QUICK if args.quick else FULL)
    for k in ("rounds", "steps", "warmup"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown or "fbgemm" not in engines:
        p.error(f"--engines must include fbgemm and name only {ENGINES}; got {engines}")

    build = subprocess.run(
        [sys.executable, "-m", "jaxscale.engine.native", "--json"], env=_child_env(), capture_output=True, text=True
    )
    try:
        native_build = json.loads(build.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        native_build = {"ok": False, "reason": build.stderr[-2000:]}
    if "jaxscale-native" in engines and not native_build.get("ok"):
        raise SystemExit(f"the native kernels are not available: {native_build.get('reason')}")
    log(f"native library: {native_build.get('library')} ({native_build.get('flags')})")

    res = {"quick": args.quick, "config": cfg, "engines": engines, "machine": machine(), "load_start": loadavg()}
    res["date"] = time.strftime("%Y-%m-%d %H:%M")
    res["native_build"] = f"{native_build.get('compiler')}, flags `{native_build.get('flags')}`"
    with tempfile.TemporaryDirectory(prefix="bench_native_") as tmp:
        log("generating data")
        spec = make_data(cfg, tmp)
        runs, res["median_ms"] = rounds(engines, spec, tmp, cfg)
        res["all_step_ms"] = {
            name: [[round(1e3 * t, 3) for t in run["step_s"]] for run in runs[name]] for name in engines
        }
        res["info"] = {name: runs[name][-1]["info"] for name in engines}
        log("checking the updated tables against a NumPy replay")
        res["check"] = check(runs, tmp)
        if not args.no_interference and "jaxscale-native" in engines:
            res["interference"] = interference(spec, cfg, engines)
        if not args.no_single_thread and "jaxscale-native" in engines and hasattr(os, "sched_setaffinity"):
            cpu = sorted(os.sched_getaffinity(0))[-1]
            pinned = ["jaxscale-native", "fbgemm"]
            pruns, res["single_thread_ms"] = rounds(pinned, spec, tmp, cfg, pin=cpu)
            res["single_thread_cpu"] = cpu
            res["single_thread_check"] = check(pruns, tmp)
    res["load_end"] = loadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(res))
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return 0 if res["check"]["ok"] and res.get("single_thread_check", {"ok": True})["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
