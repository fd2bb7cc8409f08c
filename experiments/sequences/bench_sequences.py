"""Benchmark of the sequence platform; writes experiments/sequences/RESULTS.md (and results.json).

    python experiments/sequences/bench_sequences.py                 # 1e6 and 1e7 events
    python experiments/sequences/bench_sequences.py --sizes 1e6     # quicker

For every log size (make_events.py, 7 days, 3% late events):
  backfill   jaxscale's backfill beside a DuckDB query and a Polars query that compute the same sequences
             (filter, normalize, join the items table, order by (user_id, ts, arrival), write day-partitioned
             Parquet); each engine runs in its own fresh process: a cold run, then warm runs (median);
             peak RSS of that process; an order-sensitive checksum of the output proves they agree.
  transform  the engine's per-batch transform on one raw file in Polars (what the engine uses), pyarrow
             compute and DuckDB (median of repeats, same output rows).
  stream     jaxscale's stream runtime at several micro-batch sizes (events/s of the whole command).
  companions bench_serving.py (open-loop HTTP load), bench_stream_redis.py (the broker stream) and
             bench_memory.py (the reader over a long stream) run last, each recording its own file, so this
             one command regenerates every figure of the sequence platform (`--skip-companions` leaves them).
  training   the Grain reader's examples/s beside the trainer's steps/s x batch size
             (`python -m jaxscale.train --steps 20`, the smoke model).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxscale.infra import atomic

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

EVENT_MAP = {"click": "click", "pin_click": "click", "save": "save", "repin": "save", "closeup": "closeup"}
MS_PER_DAY = 86_400_000
COLUMNS = ["user_id", "ts", "arrival", "ingest_ts", "item_id", "event_type", "surface", "category"]


# ------------------------------------------------------------------------------------------- helpers


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, **kw)


def event_files(events: Path) -> list[Path]:
    return sorted(events.rglob("*.parquet"))


def checksum(out_dir: Path) -> str:
    """Order-sensitive hash of a day-partitioned output: days in order, rows in file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    h = hashlib.sha256()
    rows = 0
    for day in sorted(p for p in Path(out_dir).iterdir() if p.name.startswith("dt=")):
        tables = [pq.read_table(f, columns=COLUMNS) for f in sorted(day.glob("*.parquet"))]
        t = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        h.update(day.name.encode())
        for c in COLUMNS:
            col = t.column(c).combine_chunks()
            if pa.types.is_integer(col.type):
                h.update(col.cast(pa.int64()).to_numpy().tobytes())
            else:
                h.update("\x00".join(col.cast(pa.string()).to_pylist()).encode())
        rows += t.num_rows
    return f"{h.hexdigest()[:16]} ({rows} rows)"


# --------------------------------------------------------------------------------- backfill engines


def run_jaxscale(events: Path, items: Path, out: Path, defs: Path) -> dict:
    from jaxscale.sequences.definitions import load_definitions
    from jaxscale.sequences.runtime import backfill

    report = backfill(load_definitions(defs), events, out, sources={"items": items})
    return {"threads": report.extra["threads"], "spilled_mb": report.extra["spilled_bytes"] / 2**20}


def run_duckdb(events: Path, items: Path, out: Path, defs: Path) -> None:
    import duckdb

    files = [str(f) for f in event_files(events)]
    con = duckdb.connect()
    con.execute("CREATE TEMP TABLE ranks(filename VARCHAR, rank BIGINT)")
    con.executemany("INSERT INTO ranks VALUES (?, ?)", [(f, i) for i, f in enumerate(files)])
    con.execute("CREATE TEMP TABLE etypes(raw VARCHAR, name VARCHAR)")
    con.executemany("INSERT INTO etypes VALUES (?, ?)", list(EVENT_MAP.items()))
    out.mkdir(parents=True, exist_ok=True)
    con.execute(
        f"""
        CREATE TEMP TABLE seq AS
          SELECT e.user_id, e.ts, (r.rank << 32) + e.file_row_number AS arrival,
                 coalesce(e.ingest_ts, e.ts) AS ingest_ts, e.item_id, t.name AS event_type,
                 e.surface, coalesce(i.category, -1) AS category,
                 strftime(make_timestamp((e.ts // {MS_PER_DAY}) * {MS_PER_DAY} * 1000), '%Y-%m-%d') AS dt
          FROM read_parquet(?, filename=true, file_row_number=true) e
          JOIN ranks r USING (filename)
          JOIN etypes t ON t.raw = e.event_type
          LEFT JOIN read_parquet('{items}') i ON i.item_id = e.item_id
          WHERE e.user_id IS NOT NULL AND e.ts IS NOT NULL AND e.item_id IS NOT NULL AND e.surface IS NOT NULL
        """,
        [files],
    )
    # COPY ... PARTITION_BY writes in parallel and loses the ORDER BY: one ordered COPY per day instead.
    for (day,) in con.execute("SELECT DISTINCT dt FROM seq ORDER BY dt").fetchall():
        (out / f"dt={day}").mkdir()
        con.execute(
            f"""COPY (SELECT * EXCLUDE (dt) FROM seq WHERE dt = '{day}' ORDER BY user_id, ts, arrival)
                TO '{out}/dt={day}/part-0.parquet' (FORMAT parquet, COMPRESSION zstd)"""
        )


def run_polars(events: Path, items: Path, out: Path, defs: Path) -> None:
    import polars as pl

    frames = [
        pl.scan_parquet(f, row_index_name="row").with_columns(pl.lit(i << 32, pl.Int64).alias("rank"))
        for i, f in enumerate(event_files(events))
    ]
    q = (
        pl.concat(frames)
        .select(
            "user_id",
            "ts",
            (pl.col("rank") + pl.col("row").cast(pl.Int64)).alias("arrival"),
            pl.coalesce("ingest_ts", "ts").alias("ingest_ts"),
            "item_id",
            pl.col("event_type").replace_strict(EVENT_MAP, default=None).alias("event_type"),
            "surface",
        )
        .drop_nulls()
        .join(pl.scan_parquet(items), on="item_id", how="left")
        .with_columns(
            pl.col("category").fill_null(-1),
            (pl.col("ts") // MS_PER_DAY * MS_PER_DAY).cast(pl.Datetime("ms")).dt.strftime("%Y-%m-%d").alias("dt"),
        )
        .sort(["user_id", "ts", "arrival"])
    )
    df = q.collect()
    out.mkdir(parents=True, exist_ok=True)
    for (day,), part in df.partition_by("dt", as_dict=True, maintain_order=True).items():
        (out / f"dt={day}").mkdir(exist_ok=True)
        part.drop("dt").write_parquet(out / f"dt={day}" / "part-0.parquet", compression="zstd")


ENGINES = {"jaxscale": run_jaxscale, "duckdb": run_duckdb, "polars": run_polars}


def engine_child(args) -> None:
    """Runs one engine cold then warm in this (fresh) process; prints JSON."""
    fn = ENGINES[args.engine]
    import duckdb  # libraries loaded before timing: cold = first run, libraries in memory
    import polars
    import pyarrow

    import jaxscale.sequences.runtime  # noqa: F401

    threads = {
        "polars_pool": polars.thread_pool_size(),
        "duckdb": int(duckdb.connect().execute("SELECT current_setting('threads')").fetchone()[0]),
        "pyarrow_cpu": pyarrow.cpu_count(),
    }
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, extra = [], None
    for i in range(1 + args.warm):
        out = Path(args.out) / f"run{i}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        extra = fn(Path(args.events), Path(args.items), out, Path(args.defs))
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if extra and "threads" in extra:  # jaxscale's backfill workers, beside the pools every engine process has
        extra["threads"] = {"workers": extra["threads"], **threads}
    store = Path(args.out) / "run0"
    out_dir = store / "engagement" if args.engine == "jaxscale" else store
    print(
        json.dumps(
            {
                "engine": args.engine,
                "cold_s": times[0],
                "warm_s": statistics.median(times[1:]) if len(times) > 1 else None,
                "peak_rss_mb": peak / 1024,
                "rss_after_import_mb": base_rss / 1024,
                "checksum": checksum(out_dir),
                "threads": threads,
                **(extra or {}),
            }
        )
    )


def bench_backfill_rounds(log: Path, defs: Path, work: Path, n: int, warm: int, rounds: int) -> dict:
    """`rounds` rounds of every engine (each a fresh process per engine, as in `bench_backfill`); per round
    jaxscale's warm events/s over the faster reference's of that round. The table's rows are the engines'
    medians over the rounds; the ratio is reported as the median and the worst round."""
    per_round = []
    for i in range(rounds):
        load = os.getloadavg()
        print(f"  round {i + 1}/{rounds} (load average {load[0]:.1f})", flush=True)
        rows = bench_backfill(log, defs, work, n, warm)
        best_ref = max(r["warm_events_per_s"] for r in rows if r["engine"] != "jaxscale")
        mine = next(r for r in rows if r["engine"] == "jaxscale")
        per_round.append(
            {"round": i + 1, "load_average": load, "rows": rows, "ratio": mine["warm_events_per_s"] / best_ref}
        )
        print(f"  round {i + 1}: jaxscale / faster reference (warm) {per_round[-1]['ratio']:.2f}x", flush=True)
    medians = []
    for engine in ENGINES:
        runs = [next(r for r in rnd["rows"] if r["engine"] == engine) for rnd in per_round]
        row = dict(runs[0])
        for key in ("cold_s", "warm_s", "peak_rss_mb"):
            vals = [r[key] for r in runs if r.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
        row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)  # the worst round's peak
        row["cold_events_per_s"] = n / row["cold_s"]
        row["warm_events_per_s"] = n / row["warm_s"] if row["warm_s"] else None
        row["checksums_equal_over_rounds"] = len({r["checksum"] for r in runs}) == 1
        medians.append(row)
    ratios = [rnd["ratio"] for rnd in per_round]
    return {
        "events": n,
        "rows": medians,
        "rounds": per_round,
        "ratio_median": statistics.median(ratios),
        "ratio_worst": min(ratios),
    }


def bench_backfill(log: Path, defs: Path, work: Path, n: int, warm: int) -> list[dict]:
    rows = []
    for engine in ENGINES:
        out = work / f"backfill-{engine}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [
            sys.executable,
            __file__,
            "--child",
            engine,
            "--events",
            str(log / "events"),
            "--items",
            str(log / "items.parquet"),
            "--out",
            str(out),
            "--defs",
            str(defs),
            "--warm",
            str(warm),
        ]
        r = json.loads(sh(cmd).stdout.strip().splitlines()[-1])
        r["events"] = n
        r["cold_events_per_s"] = n / r["cold_s"]
        r["warm_events_per_s"] = n / r["warm_s"] if r["warm_s"] else None
        rows.append(r)
        shutil.rmtree(out, ignore_errors=True)
        print(f"  backfill {engine}: {r}", flush=True)
    return rows


# --------------------------------------------------------------------------------- transform backends


def bench_transform(log: Path, defs_path: Path, repeats: int) -> list[dict]:
    """The engine's per-batch work on one raw file: drop null rows, map event types, join the items table,
    sort by (user_id, ts, arrival); the same steps in Polars, pyarrow compute and DuckDB, then the engine
    itself (Polars, plus per-row type validation and the row accounting)."""
    import duckdb
    import polars as pl
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from jaxscale.sequences.definitions import load_definitions
    from jaxscale.sequences.engine import Engine, load_enrichment_tables

    defs = load_definitions(defs_path)
    engine = Engine(defs, load_enrichment_tables(defs, {"items": str(log / "items.parquet")}))
    raw = pq.read_table(event_files(log / "events")[0], columns=["user_id", "ts", "event_type", "item_id", "surface"])
    items = pq.read_table(log / "items.parquet")
    cols = ["user_id", "ts", "arrival", "item_id", "event_type", "surface", "category"]
    keys = ["user_id", "ts", "arrival"]

    def jaxscale_engine():
        out, _ = engine.transform(raw, "f", 0)
        return engine.assemble("engagement", [out["engagement"]])

    def polars_core():
        df = pl.from_arrow(raw).with_row_index("arrival").with_columns(pl.col("arrival").cast(pl.Int64))
        df = df.drop_nulls().with_columns(pl.col("event_type").replace_strict(EVENT_MAP, default=None))
        df = df.drop_nulls().join(pl.from_arrow(items), on="item_id", how="left")
        return df.with_columns(pl.col("category").fill_null(-1)).select(cols).sort(keys).to_arrow()

    def pyarrow_compute():
        valid = pc.and_(
            pc.and_(pc.is_valid(raw["user_id"]), pc.is_valid(raw["ts"])),
            pc.and_(pc.and_(pc.is_valid(raw["item_id"]), pc.is_valid(raw["surface"])), pc.is_valid(raw["event_type"])),
        )
        t = raw.append_column("arrival", pa.array(np.arange(raw.num_rows, dtype=np.int64))).filter(valid)
        idx = pc.index_in(t["event_type"], value_set=pa.array(list(EVENT_MAP)))
        names = pc.take(pa.array(list(EVENT_MAP.values())), idx)
        t = t.set_column(t.schema.get_field_index("event_type"), "event_type", names).filter(pc.is_valid(idx))
        cat = pc.fill_null(pc.take(items["category"], pc.index_in(t["item_id"], value_set=items["item_id"])), -1)
        return t.append_column("category", cat).select(cols).sort_by([(k, "ascending") for k in keys])

    con = duckdb.connect()
    con.register("raw", raw)
    con.register("items", items)
    con.register("etypes", pa.table({"raw": list(EVENT_MAP), "name": list(EVENT_MAP.values())}))

    def duckdb_sql():
        return con.execute(
            """SELECT r.user_id, r.ts, r.arrival, r.item_id, t.name AS event_type, r.surface,
                      coalesce(i.category, -1) AS category
               FROM (SELECT *, file_row - 1 AS arrival FROM (SELECT *, row_number() OVER () AS file_row FROM raw)) r
               JOIN etypes t ON t.raw = r.event_type LEFT JOIN items i ON i.item_id = r.item_id
               WHERE r.user_id IS NOT NULL AND r.ts IS NOT NULL AND r.item_id IS NOT NULL AND r.surface IS NOT NULL
               ORDER BY r.user_id, r.ts, arrival"""
        ).to_arrow_table()

    backends = [
        ("polars", polars_core),
        ("pyarrow compute", pyarrow_compute),
        ("duckdb", duckdb_sql),
        ("jaxscale engine (polars + validation + accounting)", jaxscale_engine),
    ]
    types = {c: pa.string() if c in ("event_type", "surface") else pa.int64() for c in cols}
    results, ref = [], None
    for name, fn in backends:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        table = pa.table({c: out.column(c).cast(types[c]) for c in cols})
        same = ref is None or table.equals(ref)
        ref = table if ref is None else ref
        median = statistics.median(times)
        results.append({"backend": name, "rows": raw.num_rows, "median_s": median, "same_output": same})
        print(f"  transform {name}: {results[-1]}", flush=True)
    return results


# ------------------------------------------------------------------------------------------ stream


def bench_stream(log: Path, defs: Path, work: Path, n: int, micro_batches: list[int]) -> list[dict]:
    rows = []
    for mb in micro_batches:
        out = work / f"stream-{mb}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [
            sys.executable,
            "-m",
            "jaxscale.sequences",
            "stream",
            "--defs",
            str(defs),
            "--events",
            str(log / "events"),
            "--items",
            str(log / "items.parquet"),
            "--out",
            str(out),
            "--micro-batch",
            str(mb),
        ]
        t0 = time.perf_counter()
        report = json.loads(sh(cmd).stdout)
        wall = time.perf_counter() - t0
        rows.append(
            {
                "events": n,
                "micro_batch": mb,
                "seconds": report["seconds"],
                "events_per_s": n / report["seconds"],
                "command_wall_s": wall,
                "checksum": checksum(out / "engagement"),
            }
        )
        shutil.rmtree(out, ignore_errors=True)
        print(f"  stream: {rows[-1]}", flush=True)
    return rows


def bench_training(store: Path, defs: Path, work: Path) -> dict:
    from jaxscale.sequences.examples import SequenceBatches

    out = {}
    for L in (32, 256):
        sb = SequenceBatches(
            store, "engagement", defs, global_batch_size=64, max_seq_len=L, num_actions=4, num_surfaces=4
        )
        sb.batch(0)
        t0 = time.perf_counter()
        steps = 100
        for s in range(1, steps + 1):
            sb.batch(s)
        out[f"examples_per_s_L{L}"] = steps * 64 / (time.perf_counter() - t0)
        print(f"  training L={L}: {out[f'examples_per_s_L{L}']:.0f} examples/s", flush=True)
    workdir = work / "train-smoke"
    shutil.rmtree(workdir, ignore_errors=True)
    sh([sys.executable, "-m", "jaxscale.train", "--steps", "20", "--workdir", str(workdir), "--no-progress"])
    metrics = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [m["step_time_s"] for m in metrics if "step_time_s" in m and m.get("step", 0) > 1]  # after compile
    out["trainer_steps_per_s"] = 1.0 / statistics.median(times)
    out["trainer_examples_per_s"] = out["trainer_steps_per_s"] * 64
    shutil.rmtree(workdir, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------ report


def machine() -> dict:
    """The library's machine description (`jaxscale.benchmarks.machine`) plus the engines' versions."""
    import duckdb
    import polars
    import pyarrow

    from jaxscale.benchmarks.machine import recorded_machine

    return {
        **recorded_machine(),
        "cpu": platform.processor() or platform.machine(),
        "pyarrow": pyarrow.__version__,
        "polars": polars.__version__,
        "duckdb": duckdb.__version__,
    }


def backfill_run_lines(res: dict) -> list[str]:
    """The backfill's own machine line when it was recorded by a separate `--only backfill` run."""
    run = res.get("backfill_run")
    if not run:
        return []
    m = run["machine"]
    return [
        "Recorded by `python experiments/sequences/bench_sequences.py --only backfill "
        f"--sizes {' '.join(run['sizes'])}"
        + (f" --rounds {run['rounds']} --warm {run['warm']}" if "rounds" in run else "")
        + "` "
        f"(load average at start {m['load_average'][0]:.1f}, at end {run['load_average_end'][0]:.1f}); the other "
        "sections below come from the run named above. jaxscale's backfill holds at most `spill_budget` (256 MiB) "
        "of transformed frames and spills the rest per day (spilled MB in the last column).",
        "",
    ]


def backfill_rounds_lines(res: dict) -> list[str]:
    """Per-round warm seconds and ratios (each round: every engine in a fresh process), the median and the
    worst round, and the threads each engine ran with."""
    sized = [size for size in res["backfill"] if "rounds" in size]
    if not sized:
        return []
    m = res.get("backfill_run", {}).get("machine", res["machine"])
    lines = [
        f"Rounds (CPU: {m.get('cpu_model', m['cpu'])}, {m['cores']} cores). Ratio: jaxscale's warm events/s over "
        "the faster reference's in the same round.",
        "",
        "| events | round | load average | jaxscale warm s | duckdb warm s | polars warm s | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sized:
        for rnd in size["rounds"]:
            warm = {r["engine"]: r["warm_s"] for r in rnd["rows"]}
            lines.append(
                f"| {size['events']:,} | {rnd['round']} | {rnd['load_average'][0]:.1f} | {warm['jaxscale']:.2f} | "
                f"{warm['duckdb']:.2f} | {warm['polars']:.2f} | {rnd['ratio']:.2f}x |"
            )
        lines.append(
            f"| {size['events']:,} | median | | | | | **{size['ratio_median']:.2f}x** (worst round "
            f"{size['ratio_worst']:.2f}x) |"
        )
    threads = {r["engine"]: r.get("threads") for r in sized[0]["rows"]}
    lines += [
        "",
        "Threads: " + "; ".join(f"{engine} {json.dumps(t, sort_keys=True)}" for engine, t in threads.items() if t),
        "(jaxscale `workers`: its backfill's worker threads; every process also has Polars' pool, DuckDB's and "
        "pyarrow's).",
        "",
    ]
    return lines


def fmt(x, digits=0):
    return "-" if x is None else f"{x:,.{digits}f}"


def write_markdown(res: dict, path: Path) -> None:
    m = res["machine"]
    lines = [
        "# Sequence platform benchmark",
        "",
        f"Regenerate: `python experiments/sequences/bench_sequences.py --sizes {' '.join(res['sizes'])}` "
        "(writes this file and results.json).",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), Python {m['python']}, pyarrow {m['pyarrow']}, "
        f"polars {m['polars']}, duckdb {m['duckdb']}; load average at start {m['load_average'][0]:.1f}, at end "
        f"{res['load_average_end'][0]:.1f}. Numbers from a shared machine are indicative; compare within a run.",
        "",
        "## Backfill (7 days, 3% late events; each engine in a fresh process)",
        "",
        *backfill_run_lines(res),
        "| events | engine | cold s | cold events/s | warm s | warm events/s | peak RSS MB "
        "| vs faster reference (warm) | checksum | spilled MB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for size in res["backfill"]:
        rows = size["rows"]
        best_ref = max(r["warm_events_per_s"] for r in rows if r["engine"] != "jaxscale")
        if "rounds" in size:
            lines.append(f"| {size['events']:,} | (median of {len(size['rounds'])} rounds) | | | | | | | | |")
        for r in rows:
            ratio = r["warm_events_per_s"] / best_ref
            lines.append(
                f"| {r['events']:,} | {r['engine']} | {r['cold_s']:.2f} | {fmt(r['cold_events_per_s'])} | "
                f"{fmt(r['warm_s'], 2)} | {fmt(r['warm_events_per_s'])} | {r['peak_rss_mb']:.0f} | {ratio:.2f}x | "
                f"`{r['checksum']}` | {fmt(r.get('spilled_mb'))} |"
            )
        same = len({r["checksum"] for r in rows}) == 1
        lines.append(f"| | | | | | | | | {'all equal' if same else '**MISMATCH**'} | |")
    lines += ["", "Target: jaxscale >= 0.8x the faster of DuckDB and Polars.", ""]
    lines += backfill_rounds_lines(res)
    lines += [
        "## Per-batch transform backends (one raw file)",
        "",
        "| backend | rows | median ms | same output |",
        "|---|---:|---:|---|",
    ]
    for r in res["transform"]:
        lines.append(f"| {r['backend']} | {r['rows']:,} | {r['median_s'] * 1000:.1f} | {r['same_output']} |")
    lines += [
        "",
        "## Stream indexing (whole command incl. final merge)",
        "",
        "| events | micro-batch | seconds | events/s | checksum |",
        "|---:|---:|---:|---:|---|",
    ]
    for r in res["stream"]:
        lines.append(
            f"| {r['events']:,} | {r['micro_batch']:,} | {r['seconds']:.2f} | {fmt(r['events_per_s'])} | "
            f"`{r['checksum']}` |"
        )
    lines += ["", "Target: >= 100k events/s. The checksum equals the backfill's.", ""]
    lines += [
        "## Serving, the broker stream and the reader's memory",
        "",
        "Recorded by the companion benchmarks this command runs after the parts above (their own machine and load "
        "lines): `experiments/sequences/serving_results.md` (`bench_serving.py`: open-loop load at 200 / 500 / "
        "1,000 req/s on the sequence server and the trimmed root->leaf path), "
        "`experiments/sequences/stream_redis_results.json` (`bench_stream_redis.py`: Redis Streams events/s "
        "acknowledged, lag under a steady producer) and `experiments/sequences/memory.json` (`bench_memory.py`: "
        "the reader's RSS over a long stream). docs/sequences.md and docs/serving.md quote them.",
        "",
    ]
    t = res["training"]
    lines += [
        "## Training reader (Grain, global batch 64) vs the trainer",
        "",
        "| examples/s, L=32 | examples/s, L=256 | trainer steps/s (smoke, batch 64) | trainer examples/s |",
        "|---:|---:|---:|---:|",
        f"| {fmt(t['examples_per_s_L32'])} | {fmt(t['examples_per_s_L256'])} | {fmt(t['trainer_steps_per_s'], 2)} | "
        f"{fmt(t['trainer_examples_per_s'])} |",
        "",
    ]
    path.write_text("\n".join(lines) + "\n")
    update_docs(lines[4:])


DOCS = REPO / "docs" / "sequences.md"
START, END = "<!-- bench:start (written by bench_sequences.py) -->", "<!-- bench:end -->"


def update_docs(lines: list[str]) -> None:
    """Copies the result tables into docs/sequences.md between the bench markers."""
    body = "\n".join(line.replace("## ", "### ", 1) if line.startswith("## ") else line for line in lines)
    if DOCS.exists():  # not in an installed wheel
        atomic.replace_between(DOCS, START, END, body)


def generate_log(work: Path, n: int) -> Path:
    """make_events.py's log of n events over 7 days (cached under `work`)."""
    log = work / f"log-{n}"
    if not (log / "items.parquet").exists():
        print(f"generating {n:,} events", flush=True)
        sh([sys.executable, str(HERE / "make_events.py"), "--out", str(log), "--events", str(n), "--days", "7"])
    return log


def only_backfill(args, work: Path, defs: Path) -> None:
    """The backfill part alone, merged into the recorded results.json (its machine and load recorded beside it)."""
    results = Path(args.out).parent / "results.json"
    res = json.loads(results.read_text())
    run = {"sizes": args.sizes, "rounds": args.rounds, "warm": args.warm, "machine": machine()}
    res["backfill"] = []
    for size in args.sizes:
        n = int(float(size))
        log = generate_log(work, n)
        print(f"backfill {n:,} (load average {os.getloadavg()[0]:.1f})", flush=True)
        res["backfill"].append(bench_backfill_rounds(log, defs, work, n, args.warm, args.rounds))
    run["load_average_end"] = os.getloadavg()
    res["backfill_run"] = run
    results.write_text(json.dumps(res, indent=2) + "\n")
    write_markdown(res, Path(args.out))
    print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["1e6", "1e7"])
    ap.add_argument("--work", default="/tmp/jaxscale-seq-bench")
    ap.add_argument("--warm", type=int, default=2, help="warm runs per engine (median)")
    ap.add_argument(
        "--rounds", type=int, default=3, help="backfill rounds (every engine in a fresh process each round)"
    )
    ap.add_argument("--serve-seconds", type=float, default=10.0, help="seconds of load per rate (bench_serving)")
    ap.add_argument("--skip-companions", action="store_true", help="leave serving, broker and memory as recorded")
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"))
    ap.add_argument("--from-results", help="only rewrite the Markdown from a recorded results.json")
    ap.add_argument(
        "--only",
        choices=["backfill"],
        help="run only this part and merge it into the recorded results.json (the other parts stay as recorded)",
    )
    ap.add_argument("--child", choices=list(ENGINES), help=argparse.SUPPRESS)
    ap.add_argument("--events", help=argparse.SUPPRESS)
    ap.add_argument("--items", help=argparse.SUPPRESS)
    ap.add_argument("--defs", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.engine = args.child
        return engine_child(args)
    if args.from_results:
        return write_markdown(json.loads(Path(args.from_results).read_text()), Path(args.out))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    res = {"sizes": args.sizes, "machine": machine(), "backfill": [], "stream": []}
    defs = work / "defs.json"
    sh([sys.executable, "-m", "jaxscale.sequences", "compile", str(HERE / "engagement.py"), "--out", str(defs)])
    if args.only == "backfill":
        return only_backfill(args, work, defs)
    logs = {}
    for size in args.sizes:
        n = int(float(size))
        log = work / f"log-{n}"
        if not (log / "items.parquet").exists():
            print(f"generating {n:,} events", flush=True)
            sh([sys.executable, str(HERE / "make_events.py"), "--out", str(log), "--events", str(n), "--days", "7"])
        logs[n] = log
        print(f"backfill {n:,}", flush=True)
        res["backfill"].append(bench_backfill_rounds(log, defs, work, n, args.warm, args.rounds))
        print(f"stream {n:,}", flush=True)
        res["stream"] += bench_stream(log, defs, work, n, [10_000, 100_000] if n <= 1_000_000 else [100_000])
    n0 = min(logs)
    res["transform"] = bench_transform(logs[n0], defs, repeats=5)
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    sh(
        [
            sys.executable,
            "-m",
            "jaxscale.sequences",
            "backfill",
            "--defs",
            str(defs),
            "--events",
            str(logs[n0] / "events"),
            "--items",
            str(logs[n0] / "items.parquet"),
            "--out",
            str(store),
        ]
    )
    print("training", flush=True)
    res["training"] = bench_training(store, defs, work)
    res["load_average_end"] = os.getloadavg()
    (Path(args.out).parent / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    write_markdown(res, Path(args.out))
    print(f"wrote {args.out}")
    if not args.skip_companions:
        run_companions(store, args.serve_seconds)


def run_companions(store: Path, serve_seconds: float) -> None:
    """The serving, broker-stream and memory benchmarks, each recording its own file (see the docstring)."""
    import bench_memory
    import bench_serving
    import bench_stream_redis

    print("serving (bench_serving.py)", flush=True)
    bench_serving.main(["--store", str(store), "--seconds", str(serve_seconds)])
    print("broker stream (bench_stream_redis.py)", flush=True)
    bench_stream_redis.main([])
    print("reader memory (bench_memory.py)", flush=True)
    bench_memory.main([])


if __name__ == "__main__":
    main()
