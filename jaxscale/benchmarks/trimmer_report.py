"""The feature-trimmer benchmark's report: every figure `experiments/serving/RESULTS.md` quotes, computed from the
per-request numbers the benchmark records (`experiments/serving/bench_trimmer.py` runs it), and the verdicts
against the targets. Library code so that the arithmetic is tested (tests/test_serving_bench.py) without
importing an experiment script."""

from __future__ import annotations

import statistics

import numpy as np

COMPRESSIONS = ("none", "lz4", "zstd")
TARGET_BYTES_REDUCTION = 0.60
TARGET_TRIM_CPU = 0.05


def machine() -> dict:
    """`jaxscale.benchmarks.machine.machine()` plus the versions this benchmark depends on."""
    import jax
    import pyarrow

    from jaxscale.benchmarks.machine import machine as suite_machine

    return {**suite_machine(), "jax": jax.__version__, "pyarrow": pyarrow.__version__}


def kinds_of(universe) -> dict:
    """How many features of each kind (the name's prefix: count, ratio, flag, emb, ids, id) a workload has."""
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
