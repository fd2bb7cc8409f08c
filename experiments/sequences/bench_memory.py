"""The serving reader's memory over a long stream: does it stay flat while a stream adds a file per micro-batch?

    python experiments/sequences/bench_memory.py                      # 1e6 events, micro-batch 2000
    python experiments/sequences/bench_memory.py --events 1000000 --out /tmp/memory.json

A file-replay stream (`jaxscale.sequences.runtime.stream`, the `engagement` example, make_events.py's log
with 3% late events) runs in a child process; after every micro-batch it waits until this process (the
reader) has refreshed. Per micro-batch the reader records its RSS, the bytes of the columns it holds, the
files its incremental refresh loaded and dropped, and the refresh's time. Every `--reload-every` batches
it also times what the previous reader did for the same micro-batch: reload every changed day whole
(read all its files, merge-sort them, rebuild the arrays). The RSS grows only with the events held; RSS
minus the held bytes (the reader's overhead) is what must stay flat.

Writes a JSON summary (`--out`, default experiments/sequences/memory.json), prints one line per sample
and copies a summary table into docs/sequences.md between the memory markers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from jaxscale.benchmarks.machine import recorded_machine
from jaxscale.infra import atomic

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def rss_mb() -> float:
    """This process's resident set size, MB (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_log(work: Path, events: int, days: int) -> Path:
    """make_events.py's log (cached in `work`), generated in another process so that its memory is not
    counted in the reader's RSS."""
    import subprocess

    log = work / f"log-{events}-{days}"
    if not (log / "items.parquet").exists():
        cmd = [sys.executable, str(HERE / "make_events.py"), "--out", str(log), "--events", str(events)]
        subprocess.run([*cmd, "--days", str(days)], check=True)
    return log


def _stream_child(log: str, store: str, micro_batch: int, conn) -> None:
    """The writer: streams the log, handing each commit to the reader and waiting for its answer."""
    from jaxscale.sequences.runtime import stream

    defs = _module(HERE / "engagement.py", "engagement").DEFINITIONS

    def on_commit(i, report):
        conn.send((i, report.totals().rows))
        conn.recv()

    stream(
        defs,
        Path(log) / "events",
        store,
        sources={"items": str(Path(log) / "items.parquet")},
        micro_batch=micro_batch,
        on_commit=on_commit,
    )
    conn.send(None)


def whole_day_reload_s(reader, days: list[str]) -> float:
    """Seconds the previous reader spent on one refresh: every changed day read whole, merge-sorted and
    turned into arrays (what `SequenceReader` did before its refresh became incremental)."""
    import pyarrow.compute as pc

    from jaxscale.sequences.store import list_partitions, read_partition

    parts = list_partitions(reader.seq_dir)
    t0 = time.perf_counter()
    for day in days:
        if day not in parts:
            continue
        table = read_partition(parts[day], list(reader.read_columns))
        user = table.column("user_id").to_numpy()
        np.flatnonzero(np.diff(user))
        for name, typ in reader.read_columns.items():
            col = table.column(name)
            if typ == "string":
                enc = pc.dictionary_encode(col).combine_chunks()
                enc.indices.to_numpy(zero_copy_only=False)
                enc.dictionary.to_pylist()
            else:
                col.to_numpy()
    return time.perf_counter() - t0


def run(
    events: int = 1_000_000,
    micro_batch: int = 2_000,
    days: int = 7,
    work: str = "/tmp/jaxscale-seq-memory",
    reload_every: int = 25,
) -> dict:
    """Streams `events` in micro-batches of `micro_batch` while this process refreshes a reader after each."""
    import shutil

    from jaxscale.sequences.query import SequenceReader

    work_dir = Path(work)
    work_dir.mkdir(parents=True, exist_ok=True)
    log = make_log(work_dir, events, days)
    store = work_dir / "store"
    shutil.rmtree(store, ignore_errors=True)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_stream_child, args=(str(log), str(store), micro_batch, child))
    proc.start()
    reader, samples, start_rss = None, [], rss_mb()
    t_start = time.perf_counter()
    try:
        while True:
            msg = parent.recv()
            if msg is None:
                break
            batch, rows = msg
            if reader is None:
                reader = SequenceReader(store, "engagement")
                refresh_s, before = None, {}
            else:
                before = {p.day: p.signature for p in reader.partitions}
                t0 = time.perf_counter()
                reader.refresh()
                refresh_s = time.perf_counter() - t0
            sample = {
                "micro_batch": batch,
                "events_streamed": rows,
                "events_held": reader.num_events,
                "files_held": sum(len(p.segments) for p in reader.partitions),
                "files_loaded": reader.stats["files_loaded"],
                "files_dropped": reader.stats["files_dropped"],
                "rss_mb": round(rss_mb(), 1),
                "held_mb": round(reader.memory_bytes / 2**20, 1),
                "refresh_ms": None if refresh_s is None else round(refresh_s * 1000, 2),
                "seconds": round(time.perf_counter() - t_start, 2),
            }
            if batch % reload_every == 0:
                changed = [p.day for p in reader.partitions if before.get(p.day) != p.signature]
                sample["whole_day_reload_ms"] = round(whole_day_reload_s(reader, changed) * 1000, 2)
            sample["overhead_mb"] = round(sample["rss_mb"] - sample["held_mb"], 1)
            samples.append(sample)
            if batch % reload_every == 0:
                print(json.dumps(sample), flush=True)
            parent.send(True)
    finally:
        proc.join(timeout=600)
    return summarize(samples, events, micro_batch, start_rss)


def summarize(samples: list[dict], events: int, micro_batch: int, start_rss: float) -> dict:
    """The run's samples and the figures the write-up quotes (RSS, overhead, refresh cost)."""
    refresh = [s["refresh_ms"] for s in samples if s["refresh_ms"] is not None]
    reload = [s["whole_day_reload_ms"] for s in samples[1:] if "whole_day_reload_ms" in s]
    half = len(samples) // 2
    overhead = [s["overhead_mb"] for s in samples]
    return {
        "events": events,
        "micro_batch": micro_batch,
        "micro_batches": len(samples),
        "machine": recorded_machine(),
        "rss_before_reader_mb": round(start_rss, 1),
        "rss_first_mb": samples[0]["rss_mb"],
        "rss_last_mb": samples[-1]["rss_mb"],
        "rss_max_mb": max(s["rss_mb"] for s in samples),
        "held_last_mb": samples[-1]["held_mb"],
        "overhead_first_half_max_mb": max(overhead[:half] or overhead),
        "overhead_second_half_max_mb": max(overhead[half:]),
        "refresh_ms_median": statistics.median(refresh) if refresh else None,
        "refresh_ms_p99": float(np.percentile(refresh, 99)) if refresh else None,
        "whole_day_reload_ms_median": statistics.median(reload) if reload else None,
        "files_loaded": samples[-1]["files_loaded"],
        "files_dropped": samples[-1]["files_dropped"],
        "samples": samples,
    }


DOCS = REPO / "docs" / "sequences.md"
START, END = "<!-- memory:start (written by bench_memory.py) -->", "<!-- memory:end -->"


def markdown(res: dict) -> list[str]:
    """The summary table quoted in docs/sequences.md."""
    samples = res["samples"]
    picks = sorted({0, len(samples) // 4, len(samples) // 2, 3 * len(samples) // 4, len(samples) - 1})
    lines = [
        f"`python experiments/sequences/bench_memory.py --events {res['events']} --micro-batch "
        f"{res['micro_batch']}` ({res['micro_batches']} micro-batches, {res['machine']['cores']} cores, load "
        f"average {res['machine']['load_average'][0]:.1f}): the reader's refresh took "
        f"{res['refresh_ms_median']:.1f} ms median (p99 {res['refresh_ms_p99']:.1f} ms) against "
        f"{res['whole_day_reload_ms_median']:.1f} ms to reload the changed days whole; it loaded "
        f"{res['files_loaded']} files and dropped {res['files_dropped']}.",
        "",
        "| micro-batch | events held | files held | reader RSS MB | held columns MB | RSS - held MB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for i in picks:
        x = samples[i]
        lines.append(
            f"| {x['micro_batch']} | {x['events_held']:,} | {x['files_held']} | {x['rss_mb']:.0f} | "
            f"{x['held_mb']:.1f} | {x['overhead_mb']:.0f} |"
        )
    return lines


def update_docs(res: dict) -> None:
    """Copies the summary table into docs/sequences.md between the memory markers (if present)."""
    if DOCS.exists():  # not in an installed wheel
        atomic.replace_between(DOCS, START, END, "\n".join(markdown(res)))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--micro-batch", type=int, default=2_000)
    ap.add_argument("--days", type=int, default=7)
    ap.add_argument("--reload-every", type=int, default=25, help="time a whole-day reload every N micro-batches")
    ap.add_argument("--work", default="/tmp/jaxscale-seq-memory")
    ap.add_argument("--out", default=str(HERE / "memory.json"))
    ap.add_argument("--from-results", help="only rewrite the docs table from a recorded JSON")
    args = ap.parse_args(argv)
    if args.from_results:
        res = json.loads(Path(args.from_results).read_text())
        update_docs(res)
        return res
    res = run(args.events, args.micro_batch, args.days, args.work, reload_every=args.reload_every)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    update_docs(res)
    brief = {k: v for k, v in res.items() if k != "samples"}
    print(json.dumps(brief, indent=2))
    return res


if __name__ == "__main__":
    main()
