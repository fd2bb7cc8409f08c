"""The worker protocol: every engine timed in its own processes, with no other engine process alive.

Why: on a small CPU machine an engine process that is idle in theory still distorts another engine's time
(an XLA process keeps its pool spinning after a step; experiments/bench/timing_probe.py measures it, and
docs/benchmarks.md explains it), so a *session* is one engine's whole processes: start, load the data,
build and compile, warm up, run the timed steps, write a result file, exit. `alternate` runs sessions
A, B, C, A, B, C, ... (order rotated each round); the parent process only waits (it never imports JAX or
torch).

Worker protocol: the parent writes a JSON spec and runs ``COMMAND KIND SPEC RESULT``, where COMMAND is
`module_command("jaxscale.benchmarks.one_device")` (``python -m ...``) or `script_command(path)`; the
worker calls `worker_main`, which runs the handler for KIND and writes its JSON result atomically to
RESULT (``{"error": ..., "traceback": ...}`` on failure, exit code 1). `run_session` starts one or several
such processes together (a multi-process engine), kills all of them when one fails or the timeout passes,
and raises `WorkerError` with the tail of their output. `Worker` / `serve` drive a persistent worker step
by step instead (timing_probe.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from jaxscale.benchmarks.threads import XLA_THREADS_ENV
from jaxscale.infra import atomic


def module_command(module: str) -> list[str]:
    """The command that runs `module` as a worker (``python -m module``) under this interpreter."""
    return [sys.executable, "-m", module]


def script_command(path: str | os.PathLike) -> list[str]:
    """The command that runs the script at `path` as a worker under this interpreter."""
    return [sys.executable, str(path)]


# ------------------------------------------------------------------------------------ processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a coordinator that must be told one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_processes(procs: Sequence[subprocess.Popen], timeout: float) -> None:
    """Stops each process's group, last started first: SIGCONT and SIGTERM, then SIGKILL after `timeout` s."""
    for proc in reversed(procs):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)  # a paused process would never see the SIGTERM
                os.killpg(proc.pid, signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def child_env(**extra: str) -> dict:
    """This environment without XLA_FLAGS (each worker sets its own device count) and without an XLA thread
    count (each session sets its own, `threads.xla_env`), CPU JAX, plus `extra`."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.pop(XLA_THREADS_ENV, None)
    env["JAX_PLATFORMS"] = "cpu"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class WorkerError(RuntimeError):
    """A worker process failed, produced no result, or ran past its timeout."""


def run_session(
    command: Sequence[str],
    kind: str,
    specs: Sequence[Mapping],
    *,
    tmp: str | os.PathLike,
    timeout_s: float,
    env: Mapping | None = None,
) -> list[dict]:
    """Run one process per spec (`COMMAND KIND SPEC RESULT`), all at once; return their results.

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
                    [*command, kind, spec_path, result_path],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=dict(env) if env is not None else child_env(),
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
    atomic.write_text(result_path, json.dumps(result, default=float))
    return code


def alternate(sessions: Mapping[str, Callable[[], object]], rounds: int, gate=None) -> dict:
    """Run every session once per round, order rotated each round (A B C, B C A, ...); returns
    {"results": {name: [result per round]}, "order": [names in run order], "busy": {name: [samples]}}.

    Only one session runs at a time, and each returns only after its processes exited. With a gate
    (`machine.LoadGate`), the background CPU load is sampled (1 s, nothing of ours running) before every session."""
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


# ------------------------------------------------------------------------------ persistent workers


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
