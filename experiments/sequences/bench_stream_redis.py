"""The streaming runtime from Redis Streams: events/s acknowledged, and lag under a steady producer.

    python experiments/sequences/bench_stream_redis.py            # 1e6 events; writes stream_redis_results.json
    python experiments/sequences/bench_stream_redis.py --events 2e5 --seconds 5 --out /tmp/quick.json

A local `redis-server` (no persistence) is started on a free port; the log is make_events.py's (7 days, 3%
late events, the shipped `engagement` definitions with their item vocabulary).

  throughput  the whole log is published first (`Producer`, 1024 events per entry), then one consumer drains
              it: micro-batches of --micro-batch events, each transformed, committed to the store and only
              then acknowledged. events/s = events acknowledged / seconds from the consumer's start to its last
              acknowledgement (and, separately, including the final merge of the touched partitions).
  steady      a producer process publishes at a fixed --rate (events/s, below the consumer's capacity) for
              --seconds while the consumer runs: the group's lag (entries not yet delivered, sampled every
              100 ms) and the latency of every micro-batch (acknowledged minus the broker's receive time of
              its oldest entry): median and max.
  entry size  100k events published with 1, 64 and 1024 events per entry, then consumed: why entries carry
              several events (per-entry costs in Redis and its Python client dominate at one per entry).

The CPU model and load average (start and end) are recorded. `run(...)` returns the dict the CLI writes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

from jaxscale.benchmarks.machine import machine
from jaxscale.benchmarks.sessions import free_port
from jaxscale.sequences.broker import Producer, StreamConsumer, publish_columns
from jaxscale.sequences.definitions import compile_definitions
from jaxscale.sequences.events import find_event_files

TARGET_EVENTS_PER_SECOND = 100_000


def start_redis(folder: Path) -> tuple[subprocess.Popen, int]:
    """A redis-server without persistence on a free port (waits for PING)."""
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH (apt-get install redis-server)")
    port = free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client, deadline = redis.Redis(port=port), time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {port}") from None
            time.sleep(0.02)


def make_log(work: Path, events: int) -> Path:
    log = work / f"log-{events}"
    if not (log / "items.parquet").exists():
        cmd = [sys.executable, str(HERE / "make_events.py"), "--out", str(log), "--events", str(events), "--days", "7"]
        subprocess.run(cmd, check=True, capture_output=True)
    return log


def read_log(log: Path, limit: int | None = None) -> pa.Table:
    import pyarrow.parquet as pq

    tables, n = [], 0
    for f in find_event_files(log / "events"):
        t = pq.read_table(f.path)
        tables.append(t.select(publish_columns(t.schema)))
        n += t.num_rows
        if limit is not None and n >= limit:
            break
    table = pa.concat_tables(tables)
    return table if limit is None else table.slice(0, limit)


def consumer(defs, url: str, store: Path, log: Path, micro_batch: int, stream_name: str) -> StreamConsumer:
    return StreamConsumer(
        defs, url.rsplit("/", 1)[0] + "/" + stream_name, "bench", store, micro_batch=micro_batch,
        sources={"items": str(log / "items.parquet")}, block_ms=100,
    )  # fmt: skip


def timed_consumer(c: StreamConsumer) -> dict:
    """Wraps c.process to record when each micro-batch was acknowledged and its latency."""
    marks = {"last_ack": None, "latencies": [], "events": []}
    process = c.process

    def timed(entries):
        process(entries)
        marks["last_ack"] = time.perf_counter()
        marks["latencies"].append(c.metrics.snapshot()["latency_seconds"])
        marks["events"].append(sum(e.events for e in entries))

    c.process = timed
    return marks


def bench_throughput(defs, url: str, log: Path, work: Path, micro_batch: int, entry_events: int) -> dict:
    table = read_log(log)
    producer = Producer(url.rsplit("/", 1)[0] + "/throughput", batch=entry_events)
    t0 = time.perf_counter()
    producer.publish(table)
    produce_s = time.perf_counter() - t0
    c = consumer(defs, url, work / "store-throughput", log, micro_batch, "throughput")
    marks = timed_consumer(c)
    t0 = time.perf_counter()
    report = c.run(until_idle=0.5)
    total_s = time.perf_counter() - t0 - 0.5  # the idle wait that ends the run is not work
    acked_s = marks["last_ack"] - t0
    m = report.extra["metrics"]
    return {
        "events": table.num_rows,
        "entries": producer.entries,
        "events_per_entry": entry_events,
        "micro_batch": micro_batch,
        "produce_seconds": round(produce_s, 3),
        "produce_events_per_second": round(table.num_rows / produce_s),
        "consume_seconds_to_last_ack": round(acked_s, 3),
        "events_acked_per_second": round(m["events_acked"] / acked_s),
        "seconds_incl_final_merge": round(total_s, 3),
        "events_per_second_incl_final_merge": round(m["events_acked"] / total_s),
        "micro_batches": report.extra["micro_batches"],
        "metrics": m,
        "commits": report.extra["commits"],
        "meets_target": m["events_acked"] / acked_s >= TARGET_EVENTS_PER_SECOND,
    }


def produce_steadily(url: str, log: str, rate: float, seconds: float, entry_events: int, tick: float) -> None:
    """Child process: publishes `rate` events/s for `seconds`, one chunk per tick, open loop."""
    from jaxscale.sequences.definitions import RAW_FIELDS  # noqa: F401  (import cost before the clock starts)

    table = read_log(Path(log), int(rate * seconds))
    producer = Producer(url, batch=entry_events)
    per_tick = max(int(round(rate * tick)), 1)
    print("ready", flush=True)
    t0 = time.perf_counter()
    for i, start in enumerate(range(0, table.num_rows, per_tick)):
        delay = t0 + i * tick - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        producer.publish(table.slice(start, per_tick))
    print(json.dumps({"events": producer.events, "seconds": time.perf_counter() - t0}), flush=True)


def bench_steady(defs, url: str, log: Path, work: Path, rate: float, seconds: float, entry_events: int) -> dict:
    import redis

    steady_url = url.rsplit("/", 1)[0] + "/steady"
    tick = 0.01
    child = subprocess.Popen(
        [sys.executable, __file__, "--child-produce", steady_url, str(log), str(rate), str(seconds),
         str(entry_events), str(tick)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout.readline().strip() == "ready"
    c = consumer(defs, url, work / "store-steady", log, 100_000, "steady")
    marks = timed_consumer(c)
    client = redis.Redis(port=int(url.rsplit(":", 1)[1].split("/")[0]))
    samples, done = [], threading.Event()

    def sample():
        while not done.is_set():
            groups = client.xinfo_groups("steady") if client.exists("steady") else []
            for g in groups:
                samples.append((g.get("lag") or 0, g.get("pending") or 0))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    report = c.run(until_idle=1.5)
    done.set()
    sampler.join()
    produced = json.loads(child.stdout.readline())
    child.wait()
    lag = np.array([s[0] for s in samples] or [0])
    behind = np.array([s[0] + s[1] for s in samples] or [0])
    latency = np.array(marks["latencies"] or [0.0])
    return {
        "rate_events_per_second": rate,
        "seconds": seconds,
        "events_per_entry": entry_events,
        "producer": {"events": produced["events"], "achieved_rate": round(produced["events"] / produced["seconds"])},
        "events_acked": report.extra["metrics"]["events_acked"],
        "micro_batches": report.extra["micro_batches"],
        "median_events_per_micro_batch": float(np.median(marks["events"] or [0])),
        "lag_entries": {"median": float(np.median(lag)), "max": int(lag.max()), "samples": len(samples)},
        "unacknowledged_entries": {"median": float(np.median(behind)), "max": int(behind.max())},
        "unacknowledged_events_max_estimate": int(behind.max()) * min(entry_events, max(int(rate * tick), 1)),
        "latency_seconds": {
            "median": round(float(np.median(latency)), 4),
            "p99": round(float(np.quantile(latency, 0.99)), 4),
            "max": round(float(latency.max()), 4),
        },
    }


def bench_entry_sizes(defs, url: str, log: Path, work: Path, events: int, sizes=(1, 64, 1024)) -> list[dict]:
    table = read_log(log, events)
    rows = []
    for size in sizes:
        name = f"entries-{size}"
        producer = Producer(url.rsplit("/", 1)[0] + "/" + name, batch=size)
        t0 = time.perf_counter()
        producer.publish(table)
        produce_s = time.perf_counter() - t0
        c = consumer(defs, url, work / f"store-{name}", log, 100_000, name)
        marks = timed_consumer(c)
        t0 = time.perf_counter()
        report = c.run(until_idle=0.3)
        acked_s = marks["last_ack"] - t0
        rows.append(
            {
                "events_per_entry": size,
                "events": table.num_rows,
                "produce_events_per_second": round(table.num_rows / produce_s),
                "events_acked_per_second": round(report.extra["metrics"]["events_acked"] / acked_s),
            }
        )
        print(f"  entry size {size}: {rows[-1]}", flush=True)
    return rows


def run(
    events: int = 1_000_000,
    rate: float = 50_000,
    seconds: float = 10.0,
    micro_batch: int = 100_000,
    entry_events: int = 1024,
    work: Path | None = None,
) -> dict:
    res = {"machine": machine(), "events": events}
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="jaxscale-stream-redis-"))
    work.mkdir(parents=True, exist_ok=True)
    defs = compile_definitions(str(HERE / "engagement.py"), str(work / "defs.json"))
    log = make_log(work, events)
    (work / "redis").mkdir(exist_ok=True)
    proc, port = start_redis(work / "redis")
    url = f"redis://127.0.0.1:{port}/bench"
    try:
        print(f"throughput: {events:,} events", flush=True)
        res["throughput"] = bench_throughput(defs, url, log, work, micro_batch, entry_events)
        print(f"  {res['throughput']['events_acked_per_second']:,} events/s acknowledged", flush=True)
        print(f"steady producer: {rate:,.0f} events/s for {seconds} s", flush=True)
        res["steady"] = bench_steady(defs, url, log, work, rate, seconds, entry_events)
        print(f"  {res['steady']}", flush=True)
        print("entry sizes", flush=True)
        res["entry_sizes"] = bench_entry_sizes(defs, url, log, work, min(events, 100_000))
    finally:
        proc.kill()
        proc.wait()
        if own:
            shutil.rmtree(work, ignore_errors=True)
    res["machine"]["loadavg_at_end"] = list(os.getloadavg())
    print(f"cpu {res['machine']['cpu_model']}, load average {res['machine']['loadavg_at_start']} -> "
          f"{res['machine']['loadavg_at_end']}", flush=True)  # fmt: skip
    return res


def summary_lines(res: dict) -> list[str]:
    """The Markdown lines docs/sequences.md quotes (regenerate with --summary FILE.json)."""
    t, s, m = res["throughput"], res["steady"], res["machine"]
    entry = "; ".join(
        f"{e['events_per_entry']} per entry: {e['events_acked_per_second']:,}" for e in res["entry_sizes"]
    )
    return [
        f"- throughput: {t['events']:,} events ({t['entries']:,} entries of up to {t['events_per_entry']:,} events), "
        f"micro-batches of {t['micro_batch']:,}: **{t['events_acked_per_second']:,} events/s acknowledged** "
        f"({t['consume_seconds_to_last_ack']} s to the last ack; {t['events_per_second_incl_final_merge']:,} events/s "
        f"including the final merge); the producer published {t['produce_events_per_second']:,} events/s.",
        f"- steady producer at {s['rate_events_per_second']:,.0f} events/s for {s['seconds']:.0f} s "
        f"({s['producer']['events']:,} events, achieved {s['producer']['achieved_rate']:,}/s): group lag median "
        f"{s['lag_entries']['median']:g} / max {s['lag_entries']['max']} entries, unacknowledged entries median "
        f"{s['unacknowledged_entries']['median']:g} / max {s['unacknowledged_entries']['max']}; micro-batch latency "
        f"(acknowledged minus the broker's receive time of its oldest entry) median "
        f"{s['latency_seconds']['median'] * 1000:.0f} ms, p99 {s['latency_seconds']['p99'] * 1000:.0f} ms, max "
        f"{s['latency_seconds']['max'] * 1000:.0f} ms.",
        f"- events per entry ({res['entry_sizes'][0]['events']:,} events), events/s acknowledged: {entry}.",
        f"- machine: {m['cpu_model']}, {m['nproc']} cores; load average {m['loadavg_at_start'][0]:.2f} at the start, "
        f"{m['loadavg_at_end'][0]:.2f} at the end.",
    ]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", default="1e6")
    ap.add_argument("--rate", type=float, default=50_000, help="steady producer, events/s")
    ap.add_argument("--seconds", type=float, default=10.0, help="steady producer duration")
    ap.add_argument("--micro-batch", type=int, default=100_000)
    ap.add_argument("--entry-events", type=int, default=1024, help="events per stream entry")
    ap.add_argument("--work", help="working directory (kept; default: a temporary one, removed)")
    ap.add_argument("--out", default=str(HERE / "stream_redis_results.json"))
    ap.add_argument("--summary", metavar="RESULTS.json", help="only print the docs' Markdown lines of a recorded run")
    ap.add_argument("--child-produce", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.summary:
        res = json.loads(Path(args.summary).read_text())
        print("\n".join(summary_lines(res)))
        return res
    if args.child_produce:
        url, log, rate, seconds, entry, tick = args.child_produce
        produce_steadily(url, log, float(rate), float(seconds), int(entry), float(tick))
        return {}
    res = run(
        int(float(args.events)), args.rate, args.seconds, args.micro_batch, args.entry_events,
        Path(args.work) if args.work else None,
    )  # fmt: skip
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print("\n".join(summary_lines(res)))
    print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
