"""Feature trimmer benchmark: bytes per leaf request and over the fan-out, raw and compressed, trimmed vs
untrimmed, through real root/leaf HTTP servers on 127.0.0.1; and the root's trimming CPU time against the
request's serialization cost.

    python experiments/serving/bench_trimmer.py                 # writes results.json and RESULTS.md here
    python experiments/serving/bench_trimmer.py --requests 40   # quicker
    python experiments/serving/bench_trimmer.py --render-only   # re-render RESULTS.md from results.json

Workload (`jaxscale.serving.demo`): 200 shared features (dense floats: counters, ratios, flags, embeddings; id
lists of 5-100 ids; single ids), 3 models x 2 versions each reading 20-60 of them (ctr/1 also declares 3 it never
reads), requests of log-normal batch size (median 64 candidates, clipped to [1, 512]) carrying all 200 features.

Bytes: six roots (uncompressed / lz4 / zstd x trimmed / untrimmed) over the same six leaves; every request goes
through all six (order rotated); the root reports the body bytes it sent each leaf (response header, cross-checked
against its /metrics counters), and the outputs of trimmed and untrimmed roots must be bit-identical (the run
fails otherwise).

CPU: in process, per request, interleaved and repeated (median of repeats), process CPU time of
(a) trimming: reading dtypes/shapes from the Arrow schema, checking every leaf's signature, choosing and selecting
each leaf's columns (`plan_fanout` + `trim_batch`), and (b) serializing the whole request once to the wire format
(`wire.encode`), the least any root does per request. The target is (a) < 5% of (b).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

COMPRESSIONS = ("none", "lz4", "zstd")
BUCKETS = (8, 16, 32, 64, 128, 256, 512)
TARGET_BYTES_REDUCTION = 0.60
TARGET_TRIM_CPU = 0.05


def machine() -> dict:
    import jax
    import pyarrow

    from jaxscale.bench import machine as suite_machine

    return {**suite_machine(), "jax": jax.__version__, "pyarrow": pyarrow.__version__}


def post(url: str, body: bytes, media: str):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": media}, method="POST")
    with urllib.request.urlopen(req, timeout=600) as r:
        return dict(r.headers), r.read()


# ------------------------------------------------------------------------------------------------------ running


def start_servers(store: Path, keys):
    from jaxscale.serving.leaf import Leaf, LeafConfig
    from jaxscale.serving.root import LeafAddress, Root, RootConfig

    leaves = {k: Leaf(LeafConfig(store, *k, batch_buckets=BUCKETS, warmup=True)).start() for k in keys}
    addresses = tuple(LeafAddress(m, v, leaf.url) for (m, v), leaf in leaves.items())
    roots = {}
    for comp in COMPRESSIONS:
        for trim in (True, False):
            cfg = RootConfig(
                store, addresses, trim=trim, compression=None if comp == "none" else comp, leaf_timeout_s=600
            )
            roots[(comp, trim)] = Root(cfg).start()
    return leaves, roots


def run_http(roots, requests, bodies, used) -> tuple[list[dict], dict]:
    """Every request through every root; per request and root: per-leaf body bytes and wall time. Checks that
    outputs are bit-identical across roots and that trimmed roots sent each leaf exactly its ``used`` features."""
    from jaxscale.serving import wire
    from jaxscale.serving.root import FANOUT_HEADER

    configs = list(roots)
    records, mismatches, feature_count_errors = [], 0, 0
    for i, body in enumerate(bodies):
        rec = {"batch": int(next(iter(requests[i].values())).shape[0]), "request_bytes": len(body), "roots": {}}
        outputs = {}
        for j in range(len(configs)):
            comp, trim = configs[(i + j) % len(configs)]
            t0 = time.perf_counter()
            headers, data = post(roots[(comp, trim)].url + "/predict", body, wire.MEDIA_TYPE)
            wall = time.perf_counter() - t0
            fanout = json.loads(headers[FANOUT_HEADER])
            rec["roots"][f"{comp}/{'trim' if trim else 'full'}"] = {
                "wall_s": round(wall, 6),
                "bytes": {k: v["bytes"] for k, v in fanout.items()},
            }
            expected = {k: len(used[k]) if trim else None for k in fanout}
            feature_count_errors += sum(v["features"] != expected[k] for k, v in fanout.items())
            outputs[(comp, trim)] = data
        reference = outputs[configs[0]]
        mismatches += sum(data != reference for data in outputs.values())  # same Arrow bytes = same bits
        records.append(rec)
        if (i + 1) % 20 == 0:
            print(f"  {i + 1}/{len(bodies)} requests", flush=True)
    counters = {
        f"{comp}/{'trim' if trim else 'full'}": root.metrics.snapshot()["leaf_request_bytes"]
        for (comp, trim), root in roots.items()
    }
    checks = {"output_mismatches": mismatches, "feature_count_errors": feature_count_errors}
    return records, {**checks, "root_byte_counters": counters}


def _cpu_ns(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.process_time_ns()
        fn()
        samples.append(time.process_time_ns() - t0)
    return float(statistics.median(samples))


def run_cpu(store: Path, keys, requests, repeats: int) -> list[dict]:
    """Per request, process CPU time (ns, median of repeats, interleaved) of: trimming with the root's planner
    warm (the steady state: this request's schema was seen before), trimming cold (schema read and every
    signature checked), and serializing (whole request from its arrays; re-encoding the built Arrow batch; the
    six trimmed payloads). The HTTP servers are idle meanwhile."""
    from jaxscale.serving import wire
    from jaxscale.serving.routes import RouteTable
    from jaxscale.serving.trim import FanoutPlanner, plan_fanout, trim_batch

    routes = RouteTable(store, keys).current()
    planner = FanoutPlanner()
    out = []
    for request in requests:
        batch = wire.to_record_batch(request)
        planner.plan(batch, routes, keys)  # warm: the root has seen this schema

        def trim_warm(batch=batch):
            return [trim_batch(batch, p) for p in planner.plan(batch, routes, keys)]

        def trim_cold(batch=batch):
            return [trim_batch(batch, p) for p in plan_fanout(wire.describe(batch), routes, keys)]

        subs = trim_warm()
        timers = {"trim_ns": trim_warm, "trim_cold_ns": trim_cold}
        for c in COMPRESSIONS:
            comp = None if c == "none" else c
            timers[f"serialize_arrays_ns/{c}"] = lambda comp=comp, r=request: wire.encode(wire.to_record_batch(r), comp)
            timers[f"serialize_ns/{c}"] = lambda comp=comp, b=batch: wire.encode(b, comp)
            timers[f"serialize_trimmed_fanout_ns/{c}"] = lambda comp=comp, s=subs: [wire.encode(x, comp) for x in s]
        samples = {k: [] for k in timers}
        for _ in range(repeats):  # interleaved, so load changes hit every measurement alike
            for k, fn in timers.items():
                samples[k].append(_cpu_ns(fn, 3 if k.startswith("trim") else 1))
        rec = {"batch": batch.num_rows}
        for k, v in samples.items():
            name, _, comp = k.partition("/")
            if comp:
                rec.setdefault(name, {})[comp] = statistics.median(v)
            else:
                rec[name] = statistics.median(v)
        out.append(rec)
    return out


def run(args) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxscale.serving import demo, wire
    from jaxscale.serving.signature import Signature
    from jaxscale.serving.store import signature_path

    result = {"command": "python experiments/serving/bench_trimmer.py " + " ".join(sys.argv[1:]), "machine": machine()}
    t_start = time.time()
    rng = np.random.default_rng(args.seed)
    universe = demo.feature_universe(seed=args.seed)
    sizes = demo.batch_sizes(args.requests, rng)
    requests = [demo.make_request(universe, int(b), rng) for b in sizes]
    bodies = [wire.encode(r) for r in requests]
    with tempfile.TemporaryDirectory(prefix="bench-trimmer-") as tmp:
        store = Path(tmp)
        print("exporting 6 model versions ...", flush=True)
        demo.export_demo(store, seed=args.seed)
        keys = list(demo.MODEL_SPECS)
        sigs = {f"{m}/{v}": Signature.load(signature_path(store, m, v)) for m, v in keys}
        result["models"] = {
            k: {"declared": len(s.features), "used": len(s.required), "unused": list(s.unused)} for k, s in sigs.items()
        }
        result["universe"] = {"features": len(universe), "kinds": _kinds(universe)}
        print("starting 6 leaves (compiling batch buckets) and 6 roots ...", flush=True)
        leaves, roots = start_servers(store, keys)
        try:
            print(f"sending {len(bodies)} requests through every root ...", flush=True)
            used = {k: s.required for k, s in sigs.items()}
            result["http"], checks = run_http(roots, requests, bodies, used)
            result.update(checks)
        finally:
            for r in roots.values():
                r.stop()
            for leaf in leaves.values():
                leaf.stop()
        print("timing trimming vs serialization ...", flush=True)
        cpu_requests = requests[: args.cpu_requests]
        result["cpu"] = run_cpu(store, keys, cpu_requests, args.repeats)
    result["wall_s"] = time.time() - t_start
    result["loadavg_at_end"] = os.getloadavg()
    return result


def _kinds(universe) -> dict:
    kinds = {}
    for s in universe:
        kind = s.name.split("_", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


# ------------------------------------------------------------------------------------------------- summarising


def summarize(result: dict) -> dict:
    """Every figure RESULTS.md quotes, computed from the recorded per-request numbers."""
    http = result["http"]
    leaves = sorted(http[0]["roots"]["none/trim"]["bytes"])
    summary = {"per_leaf": {}, "fanout": {}, "cpu": {}, "latency": {}}
    for leaf in leaves:
        row = {}
        for comp in COMPRESSIONS:
            for mode in ("full", "trim"):
                row[f"{comp}/{mode}"] = statistics.mean(r["roots"][f"{comp}/{mode}"]["bytes"][leaf] for r in http)
        summary["per_leaf"][leaf] = row
    for comp in COMPRESSIONS:
        sums = {mode: [sum(r["roots"][f"{comp}/{mode}"]["bytes"].values()) for r in http] for mode in ("full", "trim")}
        total_full, total_trim = sum(sums["full"]), sum(sums["trim"])
        summary["fanout"][comp] = {
            "mean_full": statistics.mean(sums["full"]),
            "mean_trim": statistics.mean(sums["trim"]),
            "reduction": 1 - total_trim / total_full,
            "median_reduction": statistics.median(1 - t / f for t, f in zip(sums["trim"], sums["full"])),
        }
        for mode in ("full", "trim"):
            walls = [r["roots"][f"{comp}/{mode}"]["wall_s"] * 1e3 for r in http]
            summary["latency"][f"{comp}/{mode}"] = {
                "p50_ms": float(np.percentile(walls, 50)),
                "p99_ms": float(np.percentile(walls, 99)),
            }
    base = summary["fanout"]["none"]["mean_full"]
    summary["trim_zstd_vs_full_raw"] = 1 - summary["fanout"]["zstd"]["mean_trim"] / base
    cpu = result["cpu"]
    trim = [r["trim_ns"] for r in cpu]
    summary["cpu_trim"] = {
        "warm_us_median": statistics.median(trim) / 1e3,
        "cold_us_median": statistics.median(r["trim_cold_ns"] for r in cpu) / 1e3,
    }
    for comp in COMPRESSIONS:
        row = {}
        for key, label in (
            ("serialize_arrays_ns", "arrays"),
            ("serialize_ns", "batch"),
            ("serialize_trimmed_fanout_ns", "trimmed_fanout"),
        ):
            ser = [r[key][comp] for r in cpu]
            row[label] = {
                "us_median": statistics.median(ser) / 1e3,
                "ratio_median": statistics.median(t / s for t, s in zip(trim, ser)),
                "ratio_of_sums": sum(trim) / sum(ser),
                "ratio_max": max(t / s for t, s in zip(trim, ser)),
            }
        row["untrimmed_fanout"] = {"us_median": statistics.median(6 * r["serialize_ns"][comp] for r in cpu) / 1e3}
        summary["cpu"][comp] = row
    batches = [r["batch"] for r in http]
    summary["batches"] = {
        "n": len(batches),
        "p10": float(np.percentile(batches, 10)),
        "median": float(np.median(batches)),
        "p90": float(np.percentile(batches, 90)),
        "max": max(batches),
    }
    summary["request_bytes_mean"] = statistics.mean(r["request_bytes"] for r in http)
    counted = {cfg: sum(c.values()) for cfg, c in result["root_byte_counters"].items()}
    recorded = {cfg: sum(sum(r["roots"][cfg]["bytes"].values()) for r in http) for cfg in counted}
    summary["counters_agree"] = all(counted[c] == recorded[c] for c in counted)
    return summary


def _kb(x: float) -> str:
    return f"{x / 1024:,.1f}"


def render(result: dict) -> str:
    s = summarize(result)
    m = result["machine"]
    load_start = ", ".join(f"{x:.2f}" for x in m["loadavg_at_start"])
    load_end = ", ".join(f"{x:.2f}" for x in result["loadavg_at_end"])
    b = s["batches"]
    c0 = s["cpu_trim"]
    lines = [
        "# Feature trimmer: bytes and CPU",
        "",
        "Regenerate (repo root, venv active): `python experiments/serving/bench_trimmer.py` "
        "(writes `results.json` and this file; `--render-only` re-renders from `results.json`).",
        "",
        f"Recorded with `{result['command'].strip()}` in {result['wall_s']:.0f} s on {m['cpu_model']} "
        f"({m['nproc']} CPUs, {m['memory']}), {m['platform']}, Python {m['python']}, JAX {m['jax']}, "
        f"pyarrow {m['pyarrow']}. Load average (1/5/15 min) at start {load_start}, at end {load_end}.",
        "",
        f"Workload: {result['universe']['features']} shared features ({_kind_text(result['universe']['kinds'])}); "
        f"{b['n']} requests, candidates per request p10 {b['p10']:.0f} / median {b['median']:.0f} / "
        f"p90 {b['p90']:.0f} / max {b['max']}; mean request {_kb(s['request_bytes_mean'])} KiB (Arrow IPC, "
        "uncompressed). Each request fans out to all 6 model versions. Bytes are leaf request bodies as sent "
        "(Arrow IPC stream, schema included; lz4/zstd = Arrow IPC buffer compression).",
        "",
        "## Bytes per leaf request (mean KiB)",
        "",
        "| leaf | features used / declared | uncompressed untrimmed | uncompressed trimmed | lz4 untrimmed "
        "| lz4 trimmed | zstd untrimmed | zstd trimmed | reduction (uncompressed) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for leaf, row in s["per_leaf"].items():
        info = result["models"][leaf]
        unused = f" ({len(info['unused'])} unused)" if info["unused"] else ""
        lines.append(
            f"| {leaf} | {info['used']} / {info['declared']}{unused} | "
            + " | ".join(_kb(row[f"{c}/{mode}"]) for c in COMPRESSIONS for mode in ("full", "trim"))
            + f" | {100 * (1 - row['none/trim'] / row['none/full']):.1f}% |"
        )
    lines += [
        "",
        "## Summed over the fan-out (6 leaves), per request",
        "",
        "| compression | untrimmed mean KiB | trimmed mean KiB | reduction (total bytes) | median reduction "
        f"per request | target >= {100 * TARGET_BYTES_REDUCTION:.0f}% |",
        "|---|---|---|---|---|---|",
    ]
    for comp, f in s["fanout"].items():
        ok = "met" if f["reduction"] >= TARGET_BYTES_REDUCTION else "MISSED"
        lines.append(
            f"| {comp} | {_kb(f['mean_full'])} | {_kb(f['mean_trim'])} | {100 * f['reduction']:.1f}% | "
            f"{100 * f['median_reduction']:.1f}% | {ok} |"
        )
    lines += [
        "",
        f"Trimmed + zstd against untrimmed uncompressed: {100 * s['trim_zstd_vs_full_raw']:.1f}% fewer bytes. "
        f"Outputs of trimmed and untrimmed roots bit-identical on every request: "
        f"{'yes' if result['output_mismatches'] == 0 else 'NO (' + str(result['output_mismatches']) + ')'}; "
        "every trimmed leaf request carried exactly its signature's used features: "
        f"{'yes' if result['feature_count_errors'] == 0 else 'NO (' + str(result['feature_count_errors']) + ')'}; "
        f"root `/metrics` byte counters equal the per-request records: {'yes' if s['counters_agree'] else 'NO'}.",
        "",
        "## Trimming CPU vs serializing the request (process CPU time, median over requests)",
        "",
        f"Over the first {len(result['cpu'])} requests. Trimming = the root's work to cut one request for its 6 "
        "leaves: look up the plan for the request's schema (`FanoutPlanner`: one schema comparison when the "
        "schema was seen under the current route map) and select each leaf's columns (`trim_batch`, zero-copy): "
        f"median {c0['warm_us_median']:.0f} us. The first request with a new schema also reads the schema and "
        f"checks all 6 signatures: median {c0['cold_us_median']:.0f} us, once per schema. Serialization cost of "
        "the request, three ways: from its feature arrays to wire bytes (`to_record_batch` + `encode`, what "
        "putting the request on the wire costs), re-encoding an already built Arrow batch (`encode` only: the "
        "strictest reference, close to a memory copy when uncompressed), and the 6 trimmed payloads together.",
        "",
        "| wire compression | serialize from arrays us | trim / that | re-encode built batch us | trim / that "
        f"| worst request, vs re-encode | 6 trimmed payloads us | untrimmed fan-out (6 x whole) us | target: trim < "
        f"{100 * TARGET_TRIM_CPU:.0f}% of serialization |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for comp, c in s["cpu"].items():
        arrays, batch = c["arrays"], c["batch"]
        verdict = (
            "met against both"
            if batch["ratio_median"] < TARGET_TRIM_CPU and batch["ratio_of_sums"] < TARGET_TRIM_CPU
            else "met from arrays, missed against re-encoding"
            if arrays["ratio_median"] < TARGET_TRIM_CPU
            else "MISSED"
        )
        lines.append(
            f"| {comp} | {arrays['us_median']:.0f} | {100 * arrays['ratio_median']:.2f}% | {batch['us_median']:.0f} | "
            f"{100 * batch['ratio_median']:.2f}% | {100 * batch['ratio_max']:.2f}% | "
            f"{c['trimmed_fanout']['us_median']:.0f} | {c['untrimmed_fanout']['us_median']:.0f} | {verdict} |"
        )
    lines += [
        "",
        "## End-to-end latency through the root (informational)",
        "",
        "Client -> root -> 6 leaves -> root -> client on 127.0.0.1, all servers in one process; wall time on a "
        "shared machine, only comparable within this run.",
        "",
        "| root | p50 ms | p99 ms |",
        "|---|---|---|",
    ]
    for cfg, lat in s["latency"].items():
        comp, mode = cfg.split("/")
        lines.append(
            f"| {comp}, {'trimmed' if mode == 'trim' else 'untrimmed'} | {lat['p50_ms']:.1f} | {lat['p99_ms']:.1f} |"
        )
    lines.append("")
    return "\n".join(lines)


def _kind_text(kinds: dict) -> str:
    names = {
        "count": "counters",
        "ratio": "ratios",
        "flag": "flags",
        "emb": "embeddings",
        "ids": "id lists",
        "id": "single ids",
    }
    return ", ".join(f"{n} {names.get(k, k)}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--cpu-requests", type=int, default=60, help="requests timed for trimming vs serialization")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=HERE / "results.json")
    p.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--render-only", action="store_true", help="re-render --out from --json")
    args = p.parse_args(argv)
    if args.render_only:
        result = json.loads(args.json.read_text())
    else:
        result = run(args)
        args.json.write_text(json.dumps(result, separators=(",", ":")) + "\n")
    text = render(result)
    args.out.write_text(text)
    print(text)
    if result["output_mismatches"] or result["feature_count_errors"]:
        raise SystemExit(
            f"{result['output_mismatches']} outputs differ between trimmed and untrimmed roots; "
            f"{result['feature_count_errors']} leaf requests carried other features than their signature's"
        )


if __name__ == "__main__":
    main()
