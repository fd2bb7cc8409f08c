"""What the benchmark scripts share: Zipf ids, the machine description, load checks, and the worker protocol.

Timing protocol (why the workers exist): on a small CPU machine an engine process that is idle in theory
still distorts another engine's time (see `timing_probe.py` and docs/benchmarks.md), so every engine is
timed in its own processes with no other engine process alive. A *session* is one engine's whole
processes: start, load the data, build and compile, warm up, run the timed steps, write a result file,
exit. `alternate` runs sessions A, B, C, A, B, C, ... (order rotated each round) and the report compares
medians over all timed steps. The parent process only waits (it never imports JAX or torch).

Worker protocol: the parent writes a JSON spec and runs ``python SCRIPT KIND SPEC RESULT``; the script
calls `worker_main`, which runs the handler for KIND and writes its JSON result atomically to RESULT
(``{"error": ..., "traceback": ...}`` on failure, exit code 1). `run_session` starts one or several such
processes together (a multi-process engine), kills all of them when one fails or the timeout passes, and
raises `WorkerError` with the tail of their output.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from jaxscale import atomic

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = REPO / "experiments" / "results"


# ------------------------------------------------------------------------------------------- data


def zipf_ids(rng: np.random.Generator, rows: int, shape, a: float) -> np.ndarray:
    """Zipf(a) ranks scattered over the table by a multiplicative hash (hot rows are not adjacent)."""
    rank = rng.zipf(a, size=shape).astype(np.int64) - 1
    return ((rank * 2654435761) % rows).astype(np.int32)


def median_ms(seconds: Sequence[float]) -> float:
    return 1e3 * statistics.median(seconds) if len(seconds) else float("nan")


def spread(seconds: Sequence[float]) -> dict:
    """Median, p10, p90, min and max in ms, and the count."""
    ts = sorted(seconds)
    if not ts:
        return {"n": 0}
    pick = lambda q: 1e3 * ts[min(len(ts) - 1, int(q * len(ts)))]  # noqa: E731
    return {
        "median_ms": median_ms(ts),
        "p10_ms": pick(0.1),
        "p90_ms": pick(0.9),
        "min_ms": 1e3 * ts[0],
        "max_ms": 1e3 * ts[-1],
        "n": len(ts),
    }


# -------------------------------------------------------------------------------------- machine


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def background_busy(window_s: float = 1.0) -> float | None:
    """Fraction of the machine's CPU time (0..1) spent busy during `window_s`, sampled while this
    process sleeps. Called when no benchmark process of ours runs, it measures everyone else's load,
    unlike the load average, which still carries our own previous sessions for minutes."""
    a = _cpu_jiffies()
    time.sleep(window_s)
    b = _cpu_jiffies()
    if a is None or b is None or b[1] == a[1]:
        return None
    return round((b[0] - a[0]) / (b[1] - a[1]), 3)


def machine() -> dict:
    """CPU model, cores, memory, load average and software versions: printed beside every result
    (`jaxscale.bench.machine`, plus the cores this process may use)."""
    from jaxscale import bench

    m = bench.machine()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    return {
        "cpu_model": m["cpu_model"],
        "cores": m["nproc"],
        "usable_cores": usable,
        "memory": m["memory"],
        "load_average": load_average(),
        "python": m["python"],
        "platform": m["platform"],
        "numpy": m["numpy"],
    }


def describe_machine(m: Mapping) -> str:
    return (
        f"{m['cpu_model']}, {m['cores']} cores ({m['usable_cores']} usable), {m['memory']} memory; "
        f"{m['platform']}, Python {m['python']}, numpy {m['numpy']}"
    )


def load_line(before, after, busy=None) -> str:
    """'load average 0.12 -> 0.95 (1 min)' [+ the others' CPU share sampled before each session]."""
    fmt = lambda la: "?" if not la else f"{la[0]:.2f}"  # noqa: E731
    text = f"Load average (1 min) {fmt(before)} before, {fmt(after)} after"
    if busy:
        text += f"; other processes' CPU before each session: max {100 * max(busy):.0f}% of the machine"
    return text


class LoadGate:
    """Decides whether timings may be recorded: the 1-min load average before anything of ours ran must
    be <= max_load, and every background sample taken before a session must be <= max_busy. With
    `allow=True` the run goes on and every affected table is marked instead."""

    def __init__(self, max_load: float, max_busy: float, allow: bool):
        self.max_load, self.max_busy, self.allow = max_load, max_busy, allow
        self.start = load_average()
        self.busy: list[float] = []

    @property
    def start_ok(self) -> bool:
        return self.start is None or self.start[0] <= self.max_load

    def sample(self) -> float | None:
        b = background_busy()
        if b is not None:
            self.busy.append(b)
        return b

    def problems(self, busy: Sequence[float] = ()) -> list[str]:
        out = []
        if not self.start_ok:
            out.append(f"load average {self.start[0]:.2f} at start > {self.max_load:g}")
        if busy and max(busy) > self.max_busy:
            out.append(f"other processes used {100 * max(busy):.0f}% of the CPU > {100 * self.max_busy:.0f}%")
        return out


# ------------------------------------------------------------------------------------ processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a coordinator that must be told one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict:
    """This environment without XLA_FLAGS (each worker sets its own device count), CPU JAX, plus `extra`."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: a reader never sees half a file."""
    atomic.write_text(path, text)


class WorkerError(RuntimeError):
    """A worker process failed, produced no result, or ran past its timeout."""


def run_session(
    script: str | os.PathLike,
    kind: str,
    specs: Sequence[Mapping],
    *,
    tmp: str | os.PathLike,
    timeout_s: float,
    env: Mapping | None = None,
) -> list[dict]:
    """Run one process per spec (`python SCRIPT KIND SPEC RESULT`), all at once; return their results.

    The processes form one session: if one fails the others are killed (peers of a failed rank would
    wait in a collective forever), and so are all of them at the timeout."""
    tmp = Path(tmp)
    procs, paths, logs = [], [], []
    try:
        for i, spec in enumerate(specs):
            fd, spec_path = tempfile.mkstemp(dir=tmp, prefix=f"{kind}_{i}_", suffix=".json")
            with os.fdopen(fd, "w") as fh:
                json.dump(spec, fh)
            result_path = spec_path[: -len(".json")] + ".result.json"
            log_file = open(spec_path[: -len(".json")] + ".log", "w+")  # noqa: SIM115 (closed below)
            logs.append(log_file)
            paths.append(result_path)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), kind, spec_path, result_path],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=dict(env) if env is not None else child_env(),
                    cwd=str(REPO),
                )
            )
        deadline = time.monotonic() + timeout_s
        failed = None
        while any(p.poll() is None for p in procs):
            failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        timed_out = any(p.poll() is None for p in procs) and failed is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results, problems = [], []
    for i, (p, path, log_file) in enumerate(zip(procs, paths, logs)):
        log_file.seek(0)
        tail = "\n".join(ln for ln in log_file.read().splitlines() if not ln.startswith("[Gloo]"))[-3000:]
        log_file.close()
        res = json.loads(Path(path).read_text()) if Path(path).exists() else None
        if res is None or "error" in res or p.returncode != 0:
            why = res["error"] if res and "error" in res else f"exit code {p.returncode}, no result"
            problems.append(f"--- {kind} process {i}: {why}\n{(res or {}).get('traceback', '')}{tail}")
        results.append(res)
    if timed_out:
        raise WorkerError(f"{kind}: still running after {timeout_s:.0f} s, killed\n" + "\n".join(problems))
    if problems:
        raise WorkerError(f"{kind} failed\n" + "\n".join(problems))
    return results


def worker_main(handlers: Mapping[str, Callable[[dict], dict]], argv: Sequence[str] | None = None) -> int:
    """Entry point of a worker script: ``KIND SPEC RESULT`` -> handlers[KIND](spec) -> RESULT (JSON)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 3 or argv[0] not in handlers:
        print(f"usage: {Path(sys.argv[0]).name} {{{','.join(handlers)}}} SPEC.json RESULT.json", file=sys.stderr)
        return 2
    kind, spec_path, result_path = argv
    try:
        result = handlers[kind](json.loads(Path(spec_path).read_text()))
        code = 0
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises WorkerError
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        code = 1
    write_atomic(result_path, json.dumps(result, default=float))
    return code


def alternate(sessions: Mapping[str, Callable[[], object]], rounds: int, gate: LoadGate | None = None) -> dict:
    """Run every session once per round, order rotated each round (A B C, B C A, ...); returns
    {"results": {name: [result per round]}, "order": [names in run order], "busy": {name: [samples]}}.

    Only one session runs at a time, and each returns only after its processes exited. With a gate,
    the background CPU load is sampled (1 s, nothing of ours running) before every session."""
    names = list(sessions)
    out = {"results": {n: [] for n in names}, "order": [], "busy": {n: [] for n in names}}
    for r in range(rounds):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:
            if gate is not None:
                b = gate.sample()
                if b is not None:
                    out["busy"][name].append(b)
            log(f"round {r + 1}/{rounds}: {name}")
            out["results"][name].append(sessions[name]())
            out["order"].append(name)
    return out


# ------------------------------------------------------------------ persistent workers (timing_probe.py)


class Worker:
    """A persistent worker process, driven step by step: JSON commands on its stdin, one JSON reply per
    command on its stdout (lines starting with '@@'; anything else it prints is passed through)."""

    def __init__(self, argv: Sequence[str], env: Mapping | None = None, timeout_s: float = 900):
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, *map(str, argv)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=sys.stderr,
            text=True,
            env=dict(env) if env is not None else child_env(),
            cwd=str(REPO),
            bufsize=1,
        )
        self.name = Path(str(argv[0])).stem + " " + " ".join(map(str, argv[1:2]))

    def read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise WorkerError(f"{self.name}: exited (code {self.proc.poll()}) before answering")
            if line.startswith("@@"):
                msg = json.loads(line[2:])
                if "error" in msg:
                    raise WorkerError(f"{self.name}: {msg['error']}")
                return msg
            sys.stderr.write(line)

    def ask(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def reply(**message) -> None:
    print("@@" + json.dumps(message, default=float), flush=True)


def serve(handlers: Mapping[str, Callable[[dict], dict]]) -> None:
    """The worker side of `Worker`: answer commands until 'quit' or end of input; an exception is
    answered as {"error": ...} and ends the worker."""
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            return
        try:
            reply(**handlers[command["op"]](command))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises WorkerError
            reply(error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            return
