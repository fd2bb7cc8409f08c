"""Open-loop HTTP load on 127.0.0.1 against the sequence server and the serving root->leaf path.

    python experiments/sequences/bench_serving.py                      # 1e6 events; writes serving_results.json/.md
    python experiments/sequences/bench_serving.py --events 1e5 --seconds 5 --out /tmp/quick.json

Open loop: request i is due at ``start + i / rate`` and is sent then whatever happened to the ones before it;
its latency is measured from that due time, so queueing (a slow server, a busy connection pool) shows in the
percentiles instead of silently lowering the rate (no coordinated omission). The client is aiohttp's (asyncio,
``--connections`` keep-alive connections); each server runs in its own process, started by its CLI.

  sequences  `python -m jaxscale.sequences serve` over a store backfilled from make_events.py's log (7 days, 3%
             late events): GET /v1/users/{u}/sequences/engagement?as_of=T&limit=256 for users with >= 300
             events and a random as_of in the last five days (most answers hold 256 events).
  root->leaf the demo's six leaf model versions in one process and `python -m jaxscale.serving root` (trimming
             on): POST /predict of a demo request (200 features, ``--root-batch`` candidates), fanned out to
             ``--root-models`` (default one leaf; "all" = the six).

Rates: 200, 500 and 1,000 req/s (root->leaf also 100), each run ``--rounds`` times for ``--seconds`` (rounds
go round-robin over the rates, so a drift in background load spreads over all of them). For each rate: p50 /
p99 / max ms over all rounds, each round's p50 and p99 and the worst round's p99, errors (non-200 or failed),
achieved rate, and the CPU time per request of each process (server processes from /proc, the client's own);
the highest rate whose p99 is <= 10 ms with no errors (pooled over the rounds, and in every round). The
machine's CPU model, load average (start and end) and each process's thread count are recorded.

`run(...)` returns the same dict the CLI writes (bench_sequences.py calls it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxscale.benchmarks.http_load import P99_TARGET_MS, load
from jaxscale.benchmarks.machine import machine
from jaxscale.infra import atomic

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MS_PER_DAY = 86_400_000
DEFAULT_RATES = (200, 500, 1000)


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}


def sh(cmd: list[str]) -> None:
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")


def start_process(cmd: list[str], ready: str) -> tuple[subprocess.Popen, str]:
    """Start a server process; -> (process, the URL on its first stdout line containing ``ready``)."""
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if ready not in line:
        proc.kill()
        raise RuntimeError(f"{cmd[:4]} did not start: {line!r}")
    return proc, re.search(r"https?://[0-9.]+:\d+", line).group(0)


def server_args() -> list[str]:
    """Extra flags for every server (``BENCH_SERVER_ARGS``, e.g. ``--no-uvloop``; the leaves read only that)."""
    return os.environ.get("BENCH_SERVER_ARGS", "").split()


def stop_process(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


# ------------------------------------------------------------------------------------------------ load generator


# ---------------------------------------------------------------------------------------------------- sequences


def build_store(events: int, work: Path) -> Path:
    """make_events.py's log (reused when present, the layout bench_sequences.py uses) backfilled into a store."""
    log, defs, store = work / f"log-{events}", work / "defs.json", work / f"serving-store-{events}"
    if not (log / "items.parquet").exists():
        print(f"generating {events:,} events", flush=True)
        sh([sys.executable, str(HERE / "make_events.py"), "--out", str(log), "--events", str(events), "--days", "7"])
    sh([sys.executable, "-m", "jaxscale.sequences", "compile", str(HERE / "engagement.py"), "--out", str(defs)])
    shutil.rmtree(store, ignore_errors=True)  # always rebuilt: a store left by an older or failed run is no reference
    print(f"backfill {events:,} events", flush=True)
    cmd = ["backfill", "--defs", str(defs), "--events", str(log / "events"), "--items", str(log / "items.parquet")]
    sh([sys.executable, "-m", "jaxscale.sequences", *cmd, "--out", str(store)])
    return store


def sequence_requests(store: Path, n: int, seed: int = 0) -> tuple[list[tuple], dict]:
    import pyarrow.dataset as ds

    table = ds.dataset(store / "engagement", format="parquet").to_table(columns=["user_id", "ts"])
    users, counts = np.unique(table.column("user_id").to_numpy(), return_counts=True)
    heavy = users[counts >= 300]
    ts = table.column("ts").to_numpy()
    t_hi = int(ts.max()) + 1
    t_lo = t_hi - 5 * MS_PER_DAY
    rng = np.random.default_rng(seed)
    requests = [
        ("GET", f"/v1/users/{int(rng.choice(heavy))}/sequences/engagement?as_of={int(rng.integers(t_lo, t_hi))}"
         "&limit=256", None, None)
        for _ in range(n)
    ]  # fmt: skip
    return requests, {"events": int(table.num_rows), "users_with_300_events": int(len(heavy))}


def bench_sequences(store: Path, rates, seconds: float, connections: int, max_in_flight: int, rounds: int) -> dict:
    requests, info = sequence_requests(store, 20_000)
    proc, url = start_process(
        [sys.executable, "-m", "jaxscale.sequences", "serve", "--store", str(store), "--port", "0",
         "--max-in-flight", str(max_in_flight), *server_args()],
        "serving ",
    )  # fmt: skip
    try:
        result = load(url, requests, rates, seconds, connections, rounds, {"server": proc.pid})
    finally:
        exit_status = stop_process(proc)
    return {**info, **result, "server_exit_status": exit_status}


# --------------------------------------------------------------------------------------------------- root->leaf


def leaves_child(store: str, buckets: str, server_args: list[str]) -> None:
    """``--child-leaves``: the six demo leaves in this process; prints their URLs as JSON, serves until SIGTERM."""
    from jaxscale.infra.http_server import ServerConfig
    from jaxscale.serving import demo
    from jaxscale.serving.leaf import Leaf, LeafConfig

    sizes = tuple(int(b) for b in buckets.split(","))
    server = ServerConfig(uvloop="--no-uvloop" not in server_args)
    leaves = [
        Leaf(LeafConfig(store, m, v, batch_buckets=sizes, warmup=True, server=server)).start()
        for m, v in demo.MODEL_SPECS
    ]
    print("leaves " + json.dumps({leaf.signature.label: leaf.url for leaf in leaves}), flush=True)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    while not stop["now"]:
        time.sleep(0.2)
    for leaf in leaves:
        leaf.stop()


def bench_root(
    rates, seconds: float, connections: int, batch: int, models: str, max_in_flight: int, rounds: int
) -> dict:
    from jaxscale.serving import demo, wire

    with tempfile.TemporaryDirectory(prefix="bench-serving-models-") as tmp:
        sh([sys.executable, "-m", "jaxscale.serving", "export-demo", "--store", tmp])
        leaves = subprocess.Popen(
            [sys.executable, __file__, "--child-leaves", tmp, "--root-batch", str(batch)],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        root, root_exit = None, None
        try:
            line = leaves.stdout.readline()
            if not line.startswith("leaves "):
                raise RuntimeError(f"leaves did not start: {line!r}")
            urls = json.loads(line[len("leaves ") :])
            leaf_args = [a for label, url in urls.items() for a in ("--leaf", f"{label}={url}")]
            root, root_url = start_process(
                [sys.executable, "-m", "jaxscale.serving", "root", "--store", tmp, *leaf_args,
                 "--max-in-flight", str(max_in_flight), *server_args()],
                "root serving on",
            )  # fmt: skip
            rng = np.random.default_rng(1)
            universe = demo.feature_universe()
            bodies = [wire.encode(demo.make_request(universe, batch, rng)) for _ in range(16)]
            path = "/predict" if models == "all" else f"/predict?models={models}"
            requests = [("POST", path, b, {"Content-Type": wire.MEDIA_TYPE}) for b in bodies]
            pids = {"root": root.pid, "leaves": leaves.pid}
            result = load(root_url, requests, rates, seconds, connections, rounds, pids)
            for r in result["runs"]:
                r.pop("mean_events")  # counts sequence events; an Arrow answer has none
            result.update(batch=batch, models=models, request_bytes=int(np.mean([len(b) for b in bodies])))
        finally:
            if root is not None:
                root_exit = stop_process(root)
            stop_process(leaves)
    return {**result, "root_exit_status": root_exit}


# ---------------------------------------------------------------------------------------------------------- run


def run(
    store: str | Path | None = None,
    *,
    events: int = 1_000_000,
    work: str | Path = "/tmp/jaxscale-serving-bench",
    rates=DEFAULT_RATES,
    root_rates=(100, *DEFAULT_RATES),
    seconds: float = 10.0,
    connections: int = 8,
    max_in_flight: int = 256,
    root_batch: int = 8,
    root_models: str = "ctr/1",
    skip_root: bool = False,
    skip_sequences: bool = False,
    rounds: int = 3,
) -> dict:
    """Both benchmarks; ``store`` = an existing store with an ``engagement`` sequence (else one is built from
    make_events.py's log of ``events`` events under ``work``)."""
    t0 = time.time()
    result = {
        "command": "python experiments/sequences/bench_serving.py " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "client": f"aiohttp, open loop, {connections} keep-alive connections, 127.0.0.1",
        "server_args": server_args(),
        "seconds_per_rate": seconds,
        "rounds": rounds,
        "p99_target_ms": P99_TARGET_MS,
    }
    m = result["machine"]
    print(f"{m['cpu_model']}, {m['nproc']} CPUs; load average {m['loadavg_at_start']}", flush=True)
    if not skip_sequences:
        work = Path(work)
        work.mkdir(parents=True, exist_ok=True)
        store = Path(store) if store else build_store(events, work)
        print(f"sequence server over {store}", flush=True)
        result["sequences"] = bench_sequences(store, rates, seconds, connections, max_in_flight, rounds)
    if not skip_root:
        print(f"root->leaf ({root_models}, batch {root_batch})", flush=True)
        result["root_leaf"] = bench_root(
            root_rates, seconds, connections, root_batch, root_models, max_in_flight, rounds
        )
    result["loadavg_at_end"] = list(os.getloadavg())
    print(f"load average at end {result['loadavg_at_end']}", flush=True)
    result["wall_s"] = round(time.time() - t0, 1)
    return result


def render(result: dict) -> str:
    """The recorded result as Markdown (docs copy these tables; numbers only from the JSON)."""
    m = result["machine"]
    load = ", ".join(f"{x:.2f}" for x in m["loadavg_at_start"])
    end = ", ".join(f"{x:.2f}" for x in result["loadavg_at_end"])
    lines = [
        "# Serving latency under open-loop load",
        "",
        f"Recorded with `{result['command'].strip()}` on {m['cpu_model']} ({m['nproc']} CPUs, {m['memory']}), "
        f"Python {m['python']}; load average (1/5/15 min) at start {load}, at end {end}. Client: "
        f"{result['client']}; {result.get('rounds', 1)} round(s) of {result['seconds_per_rate']:g} s per rate "
        "(round-robin over the rates); latency from each request's scheduled send time. p50/p99/max over all "
        "rounds; per-round p50 and p99 listed; CPU ms per request of each process (median round).",
    ]
    sections = []
    if "sequences" in result:
        sections.append(("sequences", "Sequence server: GET 256-event answers (limit=256, random as_of)"))
    if "root_leaf" in result:
        r = result["root_leaf"]
        what = (
            f"Root->leaf with trimming: POST /predict, {r['batch']} candidates, {r['request_bytes']:,} B, "
            f"models {r['models']}"
        )
        sections.append(("root_leaf", what))
    for key, title in sections:
        r = result[key]
        lines += ["", f"## {title}", ""]
        head = "| target req/s | achieved req/s | requests | p50 ms | p99 ms | max ms | errors | rounds: p50 / p99 ms |"
        rule = "|---:|---:|---:|---:|---:|---:|---:|---|"
        if "rounds" in r:
            head += " worst round p99 ms | CPU ms/request |"
            rule += "---:|---|"
        lines += [head, rule]
        for run in r["runs"]:
            rounds = run.get("rounds", [run])
            per_round = ", ".join(f"{x['p50_ms']:.2f} / {x['p99_ms']:.2f}" for x in rounds)
            row = (
                f"| {run['target_rps']:,.0f} | {run['achieved_rps']:,.1f} | {run['requests']:,} | {run['p50_ms']:.2f} "
                f"| {run['p99_ms']:.2f} | {run['max_ms']:.2f} | {run['errors']} | {per_round} |"
            )
            if "rounds" in r:
                cpu = ", ".join(f"{name} {ms:.2f}" for name, ms in run["cpu_ms_per_request"].items())
                row += f" {run['worst_round_p99_ms']:.2f} | {cpu} |"
            lines.append(row)
        best = r["best_rate_p99_le_10ms"]
        best_text = f"{best:g} req/s" if best else "none of the rates"
        lines += ["", f"Highest rate with p99 <= {P99_TARGET_MS:g} ms and no errors: {best_text}"]
        if "rounds" in r:
            every = r["best_rate_every_round_p99_le_10ms"]
            lines[-1] += f" (in every one of the {r['rounds']} rounds: {f'{every:g} req/s' if every else 'none'})"
            threads = ", ".join(f"{name} {n}" for name, n in r["threads"].items())
            lines[-1] += f". Threads per process: {threads}."
        else:
            lines[-1] += "."
    return "\n".join(lines) + "\n"


DOCS = REPO / "docs" / "serving.md"
DOCS_START, DOCS_END = "<!-- bench-serving:start (written by bench_serving.py) -->", "<!-- bench-serving:end -->"


def update_docs(markdown: str) -> None:
    """Copy the recorded tables into docs/serving.md between the bench-serving markers (where docs/ is there)."""
    body = markdown.split("\n", 2)[2].strip().replace("\n## ", "\n#### ")  # drop the title, nest the headings
    if DOCS.exists():  # not in an installed wheel
        atomic.replace_between(DOCS, DOCS_START, DOCS_END, body)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", help="an existing store (default: build one from make_events.py)")
    ap.add_argument("--events", type=float, default=1e6, help="log size when building the store")
    ap.add_argument("--work", default="/tmp/jaxscale-serving-bench")
    ap.add_argument("--rates", default="200,500,1000", help="sequence server req/s, comma-separated")
    ap.add_argument("--root-rates", default="100,200,500,1000", help="root->leaf req/s, comma-separated")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of load per rate")
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--max-in-flight", type=int, default=256)
    ap.add_argument("--root-batch", type=int, default=8, help="candidates per root request")
    ap.add_argument("--root-models", default="ctr/1", help='models a root request targets ("all" = the six)')
    ap.add_argument("--rounds", type=int, default=3, help="rounds per rate (round-robin over the rates)")
    ap.add_argument("--skip-root", action="store_true")
    ap.add_argument("--skip-sequences", action="store_true")
    ap.add_argument("--out", default=str(HERE / "serving_results.json"))
    ap.add_argument("--render-only", action="store_true", help="only rewrite the Markdown from --out's JSON")
    ap.add_argument("--child-leaves", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_leaves:
        return leaves_child(args.child_leaves, str(args.root_batch), server_args())
    out = Path(args.out)
    if args.render_only:
        out.with_suffix(".md").write_text(render(json.loads(out.read_text())))
        if out.resolve() == (HERE / "serving_results.json").resolve():
            update_docs(render(json.loads(out.read_text())))
        return None
    result = run(
        args.store,
        events=int(args.events),
        work=args.work,
        rates=[int(r) for r in args.rates.split(",")],
        root_rates=[int(r) for r in args.root_rates.split(",")],
        seconds=args.seconds,
        connections=args.connections,
        max_in_flight=args.max_in_flight,
        root_batch=args.root_batch,
        root_models=args.root_models,
        skip_root=args.skip_root,
        skip_sequences=args.skip_sequences,
        rounds=args.rounds,
    )
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(render(result))
    if out.resolve() == (HERE / "serving_results.json").resolve():  # the recorded run, not a quick check
        update_docs(render(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
