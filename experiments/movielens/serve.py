"""MovieLens-100K served end to end: the contextual two-tower trained by `run.sh`, answered by the serving stack.

    bash experiments/movielens/run.sh OUT                                  # trains, evaluates offline
    python experiments/movielens/serve.py --run OUT [--json OUT/serving.json] [--load-seconds 10]

Steps (each a public command, run as its own process, like a deployment would):

1. `python -m jaxscale.serving build-index` twice from the best checkpoint: an HNSW index (what is served) and
   a flat one (exact search, the reference); `export-retrieval` puts each beside the exported online query step
   in a model store (model `movielens`, versions `hnsw` and `exact`).
2. A `redis-server` on a free port; `python -m jaxscale.sequences produce` publishes every user's ratings but
   the held-out test one (the history the offline test split reads), in the ratings file's order;
   `python -m jaxscale.sequences stream` consumes them into a fresh store (consumer group, acks after commit);
   `python -m jaxscale.sequences serve` serves that store; `python -m jaxscale.serving states --follow` keeps
   the encoder states of its users fresh.
3. Two leaves (`python -m jaxscale.serving leaf --states ...`, one per version) and one root.
4. Every test user is asked through the root (`POST /v1/models/movielens:retrieve?version=...`, JSON, one
   user per request on a keep-alive connection) with the test example's context (the held-out rating's
   genre with confidence 1, its surface and hour: `eval_context: label`, as the offline evaluation). The
   request also carries the user's history arrays, as a request a root serves for several models would: the
   root trims them away (the retrieval signature reads `user_id` + the context).
5. Served vs offline: recall@10 of the served answers (exact and HNSW) against the offline evaluation's
   (`OUT/eval/two_tower_context_test.json`), and per user whether the exact-served top 10 is the offline top
   10 (`OUT/topk_two_tower_context.parquet`). The HNSW answers may lose what the index's own recall@10
   against exact search (measured by build-index) loses.
6. Bytes root -> leaf with and without trimming (the root's counters; a second root with `--no-trim`), the
   latency breakdown (the leaf's stage timings: state lookup, online step, ANN; the rest is network + root),
   and an open-loop load at `--rate` requests/s (latency from each request's scheduled send time).

It writes the result as JSON (`--json`, default RUN/serving.json) and as Markdown computed from it (`--md`);
`--render JSON` re-renders the Markdown of a recorded run. Recorded: experiments/movielens/SERVING.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from jaxscale.benchmarks.sessions import free_port, stop_processes

MODEL = "movielens"
LEAF_BYTES = "jaxscale_root_leaf_request_bytes"
K = 10


class Services:
    """The processes of one run: started with their logs in `logs`, all stopped (`stop_processes`) at exit."""

    def __init__(self, logs: Path):
        self.logs, self.procs = logs, []
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, args: list[str], env=None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        proc.name = name
        self.procs.append(proc)
        return proc

    def run(self, name: str, args: list[str], timeout: float = 1800) -> str:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        (self.logs / f"{name}.log").write_text(out.stdout + out.stderr)
        if out.returncode != 0:
            raise SystemExit(f"{name} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        return out.stdout

    def stop(self) -> None:
        stop_processes(self.procs, timeout=20)


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.name} exited ({proc.returncode}) before serving {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{proc.name} did not serve {url} within {timeout} s")


# ------------------------------------------------------------------------------------------- test requests


def split_log(run: Path):
    """(history table, test targets): the raw ratings in file order without each user's last rating in
    (ts, file order) -- the leave-one-out test target -- and {user: raw item id of that target}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted((run / "events" / "events").glob("*.parquet"))
    table = pa.concat_tables([pq.read_table(f) for f in files])
    users, ts = table["user_id"].to_numpy(), table["ts"].to_numpy()
    order = np.lexsort((np.arange(len(users)), ts, users))  # by user, ts, file order
    last = np.ones(len(order), bool)
    last[:-1] = users[order][1:] != users[order][:-1]
    target_rows = order[last]
    keep = np.ones(len(users), bool)
    keep[target_rows] = False
    items = table["item_id"].to_numpy()
    return table.filter(pa.array(keep)), dict(zip(users[target_rows].tolist(), items[target_rows].tolist()))


def test_requests(cfg, run: Path):
    """One retrieve request per test user: the offline test example's context and history (the model's own
    data source, `eval_context: label`), keyed by raw user id."""
    from jaxscale_models.contextual_two_tower_data import CONTEXT_KEYS
    from jaxscale_models.contextual_two_tower_sequences import ContextualExamples

    m, seq = cfg.model.contextual_two_tower, cfg.data.sequences
    examples = ContextualExamples(
        str(run / "store"),
        seq.sequence,
        str(run / "defs.json"),
        max_seq_len=m.max_seq_len,
        num_actions=m.num_actions,
        num_surfaces=m.num_surfaces,
        num_categories=m.num_categories,
        category_field=m.category_field,
        split="test",
        min_history=seq.min_history,
        missing_category=m.missing_category,
        eval_context=m.eval_context,
        split_mode="leave_one_out",
    )
    history_keys = ("item_ids", "item_categories", "timestamps", "actions", "surfaces", "mask")
    requests = {}
    for i in range(len(examples)):
        user, _ = examples.anchor(i)
        ex = examples[i]
        inputs = {"user_id": [int(user)], **{k: [ex[k].item()] for k in CONTEXT_KEYS}}
        extra = {k: [np.asarray(ex[k]).tolist()] for k in history_keys if k in ex}
        requests[int(user)] = (inputs, extra)
    return requests


# ------------------------------------------------------------------------------------------------ clients


def post(conn, path: str, body: bytes) -> tuple[dict, dict, float]:
    t0 = time.perf_counter()
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    dt = (time.perf_counter() - t0) * 1e3
    if resp.status != 200:
        raise SystemExit(f"{path}: HTTP {resp.status}: {data[:500]!r}")
    return json.loads(data), dict(resp.getheaders()), dt


def ask_everyone(root_url: str, version: str, requests: dict, with_history: bool) -> dict:
    """Every user's top K through the root, sequentially on one keep-alive connection."""
    import http.client

    host, port = root_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port))
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    path = f"/v1/models/{MODEL}:retrieve?version={version}"
    answers, latency, stages, found = {}, [], [], []
    for user, (inputs, extra) in requests.items():
        body = json.dumps({"k": K, "inputs": {**inputs, **(extra if with_history else {})}}).encode()
        out, headers, dt = post(conn, path, body)
        answers[user] = out["item_ids"][0]
        found.append(out["state_found"][0])
        latency.append(dt)
        timings = {k.lower(): v for k, v in headers.items()}.get("x-jaxscale-timings")
        if timings:
            stages.append(json.loads(timings))
    conn.close()
    return {"answers": answers, "latency_ms": latency, "stages": stages, "state_found": found}


async def open_loop(root_url: str, version: str, bodies: list[bytes], rate: float, seconds: float) -> dict:
    """Requests sent at fixed times (rate/s) over a pool of keep-alive connections; each latency counts from its
    scheduled send time, so a server slower than the rate shows it (no coordinated omission)."""
    import aiohttp

    n = int(rate * seconds)
    connector = aiohttp.TCPConnector(limit=64, force_close=False)
    latencies, errors = [], 0
    url = f"{root_url}/v1/models/{MODEL}:retrieve?version={version}"
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter() + 0.2

        async def one(i: int):
            nonlocal errors
            scheduled = start + i / rate
            await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
            try:
                async with session.post(
                    url, data=bodies[i % len(bodies)], headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
            except aiohttp.ClientError:
                errors += 1
            latencies.append((time.perf_counter() - scheduled) * 1e3)

        await asyncio.gather(*(one(i) for i in range(n)))
    lat = np.asarray(latencies)
    return {
        "rate": rate,
        "seconds": seconds,
        "requests": n,
        "errors": errors,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "max_ms": float(lat.max()),
    }


def metric(url: str, name: str, **labels) -> float:
    """The sum of a Prometheus counter's samples (whose labels include `labels`) from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (name, f"{name}_total") and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


# ------------------------------------------------------------------------------------------------- the run


def recall(answers: dict, targets: dict) -> float:
    return float(np.mean([targets[u] in a[:K] for u, a in answers.items()]))


def run(args) -> dict:
    import pyarrow.parquet as pq

    from jaxscale.serving.retrieval import saved_config
    from jaxscale.training.config import dump_config
    from jaxscale.training.evaluate import find_checkpoints

    run_dir = Path(args.run).resolve()
    checkpoint = run_dir / "runs" / args.model / "best"
    offline = json.loads((run_dir / "eval" / f"{args.model}_test.json").read_text())
    offline_topk = pq.read_table(run_dir / f"topk_{args.model}.parquet").to_pandas()
    offline_top = {
        int(u): g.sort_values("rank")["item_id"].astype(int).tolist()[:K] for u, g in offline_topk.groupby("user_id")
    }
    checkpoints = find_checkpoints(str(checkpoint))
    cfg = saved_config(checkpoints)
    work = Path(args.work or tempfile.mkdtemp(prefix="ml-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    config_file = work / "config.yaml"  # the run's own config, as its checkpoint saved it
    config_file.write_text(dump_config(cfg))
    py = sys.executable
    svc = Services(work / "logs")
    result = {"run": str(run_dir), "model": args.model, "offline": offline["metrics"], "k": K}
    try:
        # 1. indexes and exported query step
        t0 = time.perf_counter()
        index_meta = {}
        for version, kind in (("hnsw", "hnsw"), ("exact", "flat")):
            svc.run(
                f"build-index-{version}",
                [py, "-m", "jaxscale.serving", "build-index", "--checkpoint", str(checkpoint), "--kind", kind,
                 "--out", str(work / f"index-{version}")],
            )  # fmt: skip
            svc.run(
                f"export-{version}",
                [py, "-m", "jaxscale.serving", "export-retrieval", "--checkpoint", str(checkpoint),
                 "--index", str(work / f"index-{version}"), "--store", str(work / "models"), "--model", MODEL,
                 "--version", version, "--overwrite"],
            )  # fmt: skip
            index_meta[version] = json.loads(next((work / f"index-{version}").glob("*.json")).read_text())
        result["index"] = index_meta
        result["build_seconds"] = time.perf_counter() - t0

        # 2. the broker, the stream, the sequence server, the state builder
        history, targets = split_log(run_dir)
        import pyarrow.parquet as pq_w

        pq_w.write_table(history, work / "history.parquet")
        redis_port = free_port()
        redis = svc.start(
            "redis",
            ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(work)],
        )  # fmt: skip
        time.sleep(0.5)
        if redis.poll() is not None:
            raise SystemExit("redis-server did not start (bash tests/install_services.sh installs it)")
        stream_url = f"redis://127.0.0.1:{redis_port}/ratings"
        t_stream = time.perf_counter()
        svc.run("produce", [py, "-m", "jaxscale.sequences", "produce", "--events", str(work / "history.parquet"),
                            "--target", stream_url])  # fmt: skip
        svc.run(
            "stream",
            [py, "-m", "jaxscale.sequences", "stream", "--defs", str(run_dir / "defs.json"), "--source", stream_url,
             "--group", "serving", "--out", str(work / "store"), "--items", str(run_dir / "events" / "items.parquet"),
             "--micro-batch", "8192", "--until-idle", "2"],
        )  # fmt: skip
        result["stream_seconds"] = time.perf_counter() - t_stream
        seq_port = free_port()
        seq = svc.start(
            "sequence-server", [py, "-m", "jaxscale.sequences", "serve", "--store", str(work / "store"),
                                "--port", str(seq_port)],
        )  # fmt: skip
        states = svc.start(
            "states",
            [py, "-m", "jaxscale.serving", "states", "--config", str(config_file), "--checkpoint", str(checkpoint),
             "--store", str(work / "store"),
             "--out", str(work / "states"), "--follow", "--interval", "0.5"],
        )  # fmt: skip
        wait_http(f"http://127.0.0.1:{seq_port}/healthz", seq)
        from jaxscale.serving.states import StateReader

        deadline = time.monotonic() + 900
        while not (work / "states" / "CURRENT").exists():
            if states.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the state builder published nothing (see {work / 'logs' / 'states.log'})")
            time.sleep(0.5)
        reader = StateReader(work / "states")
        while len(reader) < len(targets) and time.monotonic() < deadline:
            time.sleep(0.5)
            reader.reload_if_changed()
        result["states"] = {"users": len(reader), "version": reader.version, "model_version": reader.model_version}

        # 3. leaves and roots
        leaves = {}
        for version in ("hnsw", "exact"):
            port = free_port()
            proc = svc.start(
                f"leaf-{version}",
                [py, "-m", "jaxscale.serving", "leaf", "--store", str(work / "models"), "--model", MODEL,
                 "--version", version, "--port", str(port), "--states", str(work / "states"), "--warmup"],
            )  # fmt: skip
            wait_http(f"http://127.0.0.1:{port}/healthz", proc)
            leaves[version] = f"http://127.0.0.1:{port}"
        roots = {}
        for name, extra in (("trim", []), ("no_trim", ["--no-trim"])):
            port = free_port()
            proc = svc.start(
                f"root-{name}",
                [py, "-m", "jaxscale.serving", "root", "--store", str(work / "models"), "--port", str(port),
                 *[a for v, url in leaves.items() for a in ("--leaf", f"{MODEL}/{v}={url}")], *extra],
            )  # fmt: skip
            wait_http(f"http://127.0.0.1:{port}/healthz", proc)
            roots[name] = f"http://127.0.0.1:{port}"

        # 4-5. every test user, served vs offline
        requests = test_requests(cfg, run_dir)
        missing = sorted(set(targets) - set(requests))
        if missing:
            raise SystemExit(f"{len(missing)} users have a held-out rating but no test example, e.g. {missing[:5]}")
        served = {}
        for version in ("exact", "hnsw"):
            before = metric(roots["trim"], LEAF_BYTES)
            served[version] = ask_everyone(roots["trim"], version, requests, with_history=True)
            served[version]["bytes_to_leaf"] = metric(roots["trim"], LEAF_BYTES) - before
        before = metric(roots["no_trim"], LEAF_BYTES)
        untrimmed = ask_everyone(roots["no_trim"], "hnsw", requests, with_history=True)
        untrimmed_bytes = metric(roots["no_trim"], LEAF_BYTES) - before
        same_answers = float(np.mean([served["hnsw"]["answers"][u] == untrimmed["answers"][u] for u in requests]))
        exact = served["exact"]["answers"]
        result["served"] = {v: summarize(s, targets, offline_top, exact) for v, s in served.items()}
        result["trimming"] = {
            "bytes_per_request_trimmed": served["hnsw"]["bytes_to_leaf"] / len(requests),
            "bytes_per_request_untrimmed": untrimmed_bytes / len(requests),
            "same_answers": same_answers,
            "untrimmed_latency_ms": percentiles(untrimmed["latency_ms"]),
        }

        # 6. open-loop load
        bodies = [json.dumps({"k": K, "inputs": {**inputs, **extra}}).encode() for inputs, extra in requests.values()]
        loads = []
        for rate in args.rate:
            asyncio.run(open_loop(roots["trim"], "hnsw", bodies, rate, 1.0))  # warm the connections
            loads.append(asyncio.run(open_loop(roots["trim"], "hnsw", bodies, rate, args.load_seconds)))
        result["load"] = loads
    finally:
        svc.stop()
    from jaxscale.benchmarks.machine import machine

    m = machine()
    result["machine"] = {
        "cpu_model": m["cpu_model"],
        "nproc": m["nproc"],
        "loadavg_at_end": list(os.getloadavg()),
        "python": m["python"],
    }
    return result


def summarize(s: dict, targets: dict, offline_top: dict, exact: dict) -> dict:
    """One version's answers against the held-out ratings, the offline top 10 and the exact-served top 10."""
    users = list(s["answers"])
    stages = s["stages"]
    return {
        "recall@10": recall(s["answers"], targets),
        "users": len(users),
        "state_found": int(np.sum(s["state_found"])),
        "top10_equals_offline": float(np.mean([exact_set(s["answers"][u]) == exact_set(offline_top[u])
                                               for u in users])),
        "top10_overlap_with_exact_served": float(np.mean([len(exact_set(s["answers"][u]) & exact_set(exact[u])) / K
                                                          for u in users])),
        "latency_ms": percentiles(s["latency_ms"]),
        "stages_ms": {k: percentiles([t[k] for t in stages]) for k in (stages[0] if stages else {})},
        "bytes_to_leaf_per_request": s["bytes_to_leaf"] / len(users),
    }  # fmt: skip


def exact_set(items) -> frozenset:
    return frozenset(int(i) for i in items[:K])


def percentiles(values) -> dict:
    v = np.asarray(values, float)
    if v.size == 0:
        return {}
    return {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)), "max": float(v.max())}


def render(r: dict) -> str:
    """The write-up of one run: every figure from the recorded JSON."""
    ms = lambda d: f"{d['p50']:.2f} / {d['p99']:.2f} / {d['max']:.2f}" if d else "n/a"  # noqa: E731
    off = r["offline"]["recall@10"]
    lines = [
        "# MovieLens-100K served end to end",
        "",
        "Written by `python experiments/movielens/serve.py --run OUT` (after `bash experiments/movielens/run.sh OUT`);"
        " every figure below comes from its JSON.",
        "",
        f"- run: `{Path(r['run']).name}/` (run.sh's output), model `{r['model']}`, k = {r['k']}; states: "
        f"{r['states']['users']} users, version "
        f"{r['states']['version']}, model version `{r['states']['model_version']}`",
        f"- machine: {r['machine']['cpu_model']}, {r['machine']['nproc']} cores, load at end "
        + ", ".join(f"{x:.2f}" for x in r["machine"]["loadavg_at_end"]),
        "",
        "## Served vs offline",
        "",
        "| index | index recall@10 vs exact (build-index) | served recall@10 | offline recall@10 | users whose served"
        " top 10 = offline top 10 | mean overlap with exact-served top 10 |",
        "|---|---|---|---|---|---|",
    ]
    for v, s in r["served"].items():
        idx = r["index"][v]
        lines.append(
            f"| {v} ({idx['params']['kind']}) | {idx['recall']['recall@10']:.4f} | {s['recall@10']:.4f} | {off:.4f} "
            f"| {s['top10_equals_offline']:.1%} | {s['top10_overlap_with_exact_served']:.1%} |"
        )
    t = r["trimming"]
    lines += [
        "",
        "## Trimming (root -> leaf bytes per request, the real model's signature)",
        "",
        f"- trimmed: {t['bytes_per_request_trimmed']:.0f} B; untrimmed: {t['bytes_per_request_untrimmed']:.0f} B "
        f"({1 - t['bytes_per_request_trimmed'] / t['bytes_per_request_untrimmed']:.1%} less); answers identical for "
        f"{t['same_answers']:.1%} of users",
        "",
        "## Latency (ms, p50 / p99 / max; sequential requests on one keep-alive connection)",
        "",
        "| index | client (root + leaf + network) | leaf: state lookup | leaf: online step | leaf: ANN | leaf total |",
        "|---|---|---|---|---|---|",
    ]
    for v, s in r["served"].items():
        st = s["stages_ms"]
        lines.append(
            f"| {v} | {ms(s['latency_ms'])} | {ms(st.get('state_lookup'))} | {ms(st.get('online_step'))} | "
            f"{ms(st.get('ann'))} | {ms(st.get('total'))} |"
        )
    lines += ["", "## Open-loop load through the root (hnsw, latency from each request's scheduled send)", ""]
    lines += ["| rate (req/s) | requests | errors | p50 | p99 | max |", "|---|---|---|---|---|---|"]
    for x in r["load"]:
        lines.append(
            f"| {x['rate']:.0f} | {x['requests']} | {x['errors']} | {x['p50_ms']:.2f} | {x['p99_ms']:.2f} | "
            f"{x['max_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", help="the output folder of experiments/movielens/run.sh")
    p.add_argument("--md", default=None, help="write the Markdown write-up here too")
    p.add_argument("--render", default=None, help="only re-render the Markdown of this recorded JSON (to --md)")
    p.add_argument("--model", default="two_tower_context", help="which of run.sh's two-tower runs to serve")
    p.add_argument("--work", default=None, help="where the artifacts, store, states and logs go (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the result here (default: RUN/serving.json)")
    p.add_argument("--rate", type=float, action="append", default=None, help="open-loop requests/s (repeat)")
    p.add_argument("--load-seconds", type=float, default=10.0)
    args = p.parse_args(argv)
    if args.render:
        text = render(json.loads(Path(args.render).read_text()))
        Path(args.md).write_text(text) if args.md else print(text)
        return 0
    if not args.run:
        p.error("--run is required (or --render)")
    args.rate = args.rate or [200.0]
    result = run(args)
    out = Path(args.json or Path(args.run) / "serving.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.md:
        Path(args.md).write_text(render(result))
    print(json.dumps({k: result[k] for k in ("served", "trimming", "load")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
