"""The suite's Markdown, computed from its recorded JSON only (`--render RESULT.json` redoes it).

Every ratio is printed with its spread: the pooled medians' ratio, each round's ratio (sessions of the
engines compared ran side by side in round r) and the worst round's; a row "holds" on the worst round when
that ratio meets the target too. Threads per process and the CPU's vector flags are printed beside them.
"""

from __future__ import annotations

from jaxscale.benchmarks.machine import describe_machine, load_line
from jaxscale.benchmarks.one_device import speed_vs_fbgemm

FP32_TOLERANCE = 1e-5
_SHARDING_ORDER = ("-", "table_wise", "row_wise", "column_wise")
_PRECISION_ORDER = ("fp32", "fp16", "bf16", "fp8/bf16", "fp8")


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _ratios(xs) -> str:
    return "-" if not xs else " / ".join(f"{x:.2f}" for x in xs)


def _bytes(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _problems(part: dict) -> list[str]:
    if part.get("problems"):
        return ["", f"> **Timings not valid: {'; '.join(part['problems'])}.**", ""]
    return []


def _threads(t: dict | None) -> str:
    """'1 (measured 1)' from {"set": 1, "measured": [1]}."""
    if not t:
        return "-"
    measured = ", ".join(str(x) for x in t.get("measured") or []) or "?"
    return f"{t.get('set', '?')} (measured {measured})"


def row_order(r: dict):
    """Rows by devices, sharding, precision; a counted-every-batch row right after its reused twin."""
    sharding = _SHARDING_ORDER.index(r["sharding"]) if r["sharding"] in _SHARDING_ORDER else 9
    precision = _PRECISION_ORDER.index(r["precision"]) if r["precision"] in _PRECISION_ORDER else 9
    return r["devices"], sharding, precision, r.get("capacities", "reuse") != "reuse"


def holds(r: dict, key: str) -> bool | None:
    """Whether the row's time ratio `key` ('time' or 'time_fastest') is <= 1.0x on its worst round."""
    worst = r.get(f"{key}_worst_ratio")
    return None if worst is None else worst <= 1.0


# ------------------------------------------------------------------------------------------ parts


def render_one_device(p: dict) -> list[str]:
    s, e = p["shape"], p["engines"]
    what = {
        "jaxscale": "`shard_batch` + jitted lookup + update (donated), 1 CPU device",
        "fbgemm": "TBE forward + backward with the fused optimizer",
        "numpy": "`jaxscale.engine.reference`: lookup, per-row sums, AdaGrad in place",
    }
    speeds = speed_vs_fbgemm(e)
    L = [
        "## 1. One device: lookup + row-wise AdaGrad",
        "",
        f"Table {s['rows']:,} x {s['dim']} fp32, {s['batch']} bags x {s['hotness']} Zipf({s['zipf']}) ids, fresh ids "
        f"every step ({s['touched_rows']:,} rows touched over {s['warmup'] + s['steps']} steps), sum pooling, row-wise "
        f"AdaGrad (lr {s['lr']}, eps {s['eps']}). {p['rounds']} sessions per engine, alternated in rounds "
        f"({' -> '.join(p['order'])}); each: {s['warmup']} warm-up + {s['steps']} timed steps. Threads: jaxscale's "
        f"XLA intra-op pool and FBGEMM's torch threads both set to {p.get('threads', '?')} (read back per session "
        "below). " + load_line(p["load_average_before"], p["load_average_after"], p["background_busy"]) + ".",
        *_problems(p),
        "",
        "| engine | what | threads | median ms | p10 | p90 | session medians ms | M ids/s | speed vs FBGEMM "
        "| per-round speed | worst round |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    for name, x in e.items():
        sessions = ", ".join(_ms(m) for m in x["session_medians_ms"])
        sp = speeds.get(name, {})
        L.append(
            f"| {name} | {what.get(name, '')} | {x.get('info', {}).get('threads', '?')} | {_ms(x['median_ms'])} | "
            f"{_ms(x['p10_ms'])} | {_ms(x['p90_ms'])} | {sessions} | "
            f"{s['batch'] * s['hotness'] / x['median_ms'] / 1e3:.2f} | {_ratio(sp.get('speed'))} | "
            f"{_ratios(sp.get('round_speeds'))} | {_ratio(sp.get('worst_round'))} |"
        )
    info = e.get("fbgemm", {}).get("info", {})
    c = p["check"]
    diffs = ", ".join(f"{n} {x['max_abs_diff_rows']:.1e}" for n, x in e.items())
    L += [
        "",
        "Speed vs FBGEMM = FBGEMM's median / the engine's (> 1: faster than FBGEMM); per round: the two engines' "
        "session medians of that round; worst round: the lowest. FBGEMM: torch "
        f"{info.get('torch', '?')}, fbgemm-gpu-cpu {info.get('fbgemm', '?')}; "
        f"jax {e.get('jaxscale', {}).get('info', {}).get('jax', '?')}.",
        "",
        f"Check (every session, against `engine.reference`): max |rows - reference| after the last step: {diffs} "
        f"(tolerance {c['tolerance']:.1e}; rows moved up to {c['rows_moved_up_to']:.2e}): "
        f"**{'OK' if c['ok'] else 'MISMATCH'}**.",
        "",
    ]
    return L


def _capacity_line(p: dict) -> str:
    """How jaxscale sized its exchanges in this run."""
    if p.get("capacity_factor"):
        return f"jaxscale: fixed capacities (capacity_factor {p['capacity_factor']})."
    if p.get("reuse_capacities"):
        return (
            "jaxscale `reuse`: `reuse_capacities=True`: the host counts the first batch's capacities (and those of "
            "a batch that overflowed them); every other batch reuses the largest counted set, with no host "
            "counting and no exchange between the processes before the step; a batch that does not fit is "
            "skipped and re-run counted, and that step's time includes both attempts (re-runs: last table). "
            "jaxscale `count` rows (beside fp32): capacities counted on the host for every batch and agreed "
            "between the processes before each step."
        )
    return "jaxscale `count`: capacities counted on the host for every batch (exchanged between the processes)."


def _reruns(c: dict) -> str:
    if "reruns" not in c:
        return "-"
    return f"{c['reruns']} (+{c['reruns_warmup']} warm-up)" if c.get("reruns_warmup") else str(c["reruns"])


def _jaxscale_label(r: dict) -> str:
    return r["precision"] + (f" ({r['capacities']})" if r.get("capacities", "reuse") != "reuse" else "")


def thread_lines(p: dict) -> list[str]:
    """Threads per process of every engine and W, as set and as read back in its processes."""
    L = ["| engine | devices | processes | intra-op threads per process: set (measured) |", "|---|---:|---:|---|"]
    labels = {
        "jaxscale_mp": "jaxscale, W processes",
        "torchrec": "TorchRec, W ranks",
        "jaxscale_sim": "jaxscale, 1 process",
    }
    for engine in ("jaxscale_mp", "torchrec", "jaxscale_sim"):
        for w, x in sorted(p["engines"].get(engine, {}).items(), key=lambda kv: int(kv[0])):
            procs = 1 if engine == "jaxscale_sim" else w
            L.append(f"| {labels[engine]} | {w} | {procs} | {_threads(x.get('threads'))} |")
    return L


def render_equal_devices(p: dict) -> list[str]:
    s = p["shape"]
    rows = sorted(p["comparisons"], key=row_order)
    L = [
        "## 2. Equal devices: jaxscale on W processes vs TorchRec on W ranks",
        "",
        f"{s['tables']} pooled tables x {s['rows']:,} x {s['dim']}, global batch {s['batch']} x {s['hotness']} "
        f"Zipf({s['zipf']}) ids per table, fresh every step, row-wise AdaGrad (lr {s['lr']}); {p['rounds']} "
        f"round(s): in each, one session per engine and device count, alternated; each session: {s['warmup']} "
        f"warm-up + {s['steps']} timed steps per configuration. jaxscale: W processes of one CPU device, gloo on "
        "127.0.0.1 (mesh W x 1; one process at W = 1); TorchRec: DMP on W gloo ranks, fused TBE. Both run the "
        "same intra-op threads per process (table below). "
        f"{_capacity_line(p)} Step time: median over timed steps, each step's slowest process. Time ratio = "
        "jaxscale / TorchRec (< 1: jaxscale faster), against TorchRec at the matched precision and against "
        "TorchRec's fastest configuration that ran for the same sharding and W; per round: the two engines' "
        "session medians of that round; worst: the highest; target <= 1.0x. "
        + load_line(p["load_average_before"], p["load_average_after"], p["background_busy"])
        + ".",
        *_problems(p),
        "",
        *thread_lines(p),
        "",
        "| devices | sharding | jaxscale | jaxscale ms | TorchRec | TorchRec ms | ratio | per-round ratios | worst "
        "| TorchRec fastest | fastest ms | ratio | per-round ratios | worst | holds on the worst round |",
        "|---:|---|---|---:|---|---:|---:|---|---:|---|---:|---:|---|---:|---|",
    ]
    for r in rows:
        tr = r["torchrec_precision"] if not r["torchrec_error"] else f"{r['torchrec_precision']} (failed)"
        verdict = [
            f"{label} {'yes' if ok else 'no'}"
            for label, ok in (("matched", holds(r, "time")), ("fastest", holds(r, "time_fastest")))
            if ok is not None
        ]
        if r.get("jaxscale_error"):
            verdict.append("jaxscale failed: see below")
        L.append(
            f"| {r['devices']} | {r['sharding']} | {_jaxscale_label(r)} | {_ms(r['jaxscale_ms'])} | {tr} | "
            f"{_ms(r['torchrec_ms'])} | {_ratio(r['time_ratio'])} | {_ratios(r['time_round_ratios'])} | "
            f"{_ratio(r['time_worst_ratio'])} | {r['torchrec_fastest_precision'] or '-'} | "
            f"{_ms(r['torchrec_fastest_ms'])} | {_ratio(r['time_fastest_ratio'])} | "
            f"{_ratios(r['time_fastest_round_ratios'])} | {_ratio(r['time_fastest_worst_ratio'])} | "
            f"{', '.join(verdict) or '-'} |"
        )
    matches = sorted({(r["precision"], r["torchrec_precision"], r["match"]) for r in rows})
    L += [
        "",
        "Matched precisions: " + "; ".join(f"jaxscale {a} vs TorchRec {b} ({why})" for a, b, why in matches) + ".",
        "",
        "Bytes: what leaves the devices per step, summed over the W devices, one byte model for both (jaxscale "
        "from the compiled HLO), against TorchRec at the matched precision; targets: <= 1.0x (fp8 <= 0.5x, "
        "fp8/bf16 <= 0.75x: its fp8 forward at 0.5x, its bf16 backward at 1.0x).",
        "",
        "| devices | sharding | jaxscale | jaxscale bytes | TorchRec | TorchRec bytes | bytes ratio | target | meets |",
        "|---:|---|---|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        meets = "-" if r["bytes_ratio"] is None else ("yes" if r["bytes_ratio"] <= r["bytes_target"] else "no")
        L.append(
            f"| {r['devices']} | {r['sharding']} | {_jaxscale_label(r)} | {_bytes(r['jaxscale_bytes'])} | "
            f"{r['torchrec_precision']} | {_bytes(r['torchrec_bytes'])} | {_ratio(r['bytes_ratio'])} | "
            f"{r['bytes_target']:.2f}x | {meets} |"
        )
    inproc = [r for r in rows if r["devices"] > 1 and r.get("in_process_ms") is not None]
    if inproc:
        L += [
            "",
            "In one process, NOT equal devices: jaxscale on W simulated CPU devices of one process (mesh 1 x W): its "
            "collectives are copies inside the process, with no transport and no peer to wait for, so it is not "
            "compared with TorchRec's W ranks above; beside the W-process time it shows what the transport costs.",
            "",
            "| devices | sharding | jaxscale | in one process ms | W processes ms | W processes / one process |",
            "|---:|---|---|---:|---:|---:|",
        ]
        for r in inproc:
            cost = r["jaxscale_ms"] / r["in_process_ms"] if r["jaxscale_ms"] and r["in_process_ms"] else None
            L.append(
                f"| {r['devices']} | {r['sharding']} | {_jaxscale_label(r)} | {_ms(r['in_process_ms'])} | "
                f"{_ms(r['jaxscale_ms'])} | {_ratio(cost)} |"
            )
    probe = p["engines"].get("torchrec_fp8_probe")
    if probe:
        L += ["", "TorchRec asked for FP8 QComms on 2 ranks (not timed):", ""]
        for sharding, r in probe.items():
            what = (
                f"ran; its collectives: {', '.join(r['collectives']) or 'none'}"
                if r["ran"]
                else f"failed: `{r['error'].splitlines()[0][:300]}`"
            )
            L.append(f"- {sharding}: {what}")
    L += [
        "",
        "Per engine and configuration (bytes per step summed over devices, by collective; check: max |table - "
        "reference| after the last step, fp32 must be <= " + f"{FP32_TOLERANCE:g}):",
        "",
        "| engine | devices | config | median ms | p10 | p90 | session medians ms | bytes by collective | overflow "
        "| re-runs | check |",
        "|---|---:|---|---:|---:|---:|---|---|---:|---:|---|",
    ]
    for engine, worlds in p["engines"].items():
        if engine == "torchrec_fp8_probe":
            continue
        for w, x in worlds.items():
            for name, c in x["configs"].items():
                if "error" in c:
                    L.append(f"| {engine} | {w} | {name} | failed | | | | `{c['error'].splitlines()[0][:120]}` | | | |")
                    continue
                kinds = "; ".join(f"{k} {v:,.0f}" for k, v in sorted(c["bytes_cluster_per_kind"].items())) or "none"
                chk = c.get("check")
                chk = f"{chk['max_abs_diff']:.1e} (acc/row {chk['col_parts']})" if chk else "-"
                sessions = ", ".join(_ms(m) for m in c.get("session_medians_ms", []))
                L.append(
                    f"| {engine} | {w} | {name} | {_ms(c.get('median_ms'))} | {_ms(c.get('p10_ms'))} | "
                    f"{_ms(c.get('p90_ms'))} | {sessions} | {kinds} | {c.get('overflow_rows', '-')} | {_reruns(c)} | "
                    f"{chk} |"
                )
    L.append("")
    return L


def render_stages(p: dict) -> list[str]:
    st = p["stages"]
    if not st:
        return []
    base = st[0]["total_bytes_per_example"]
    L = [
        f"## 3. Bytes per technique stage (foundation smoke config, {'x'.join(map(str, p['mesh']))} mesh)",
        "",
        f"The embedding step (lookup + update) of `{p['config']}` compiled per stage, global batch "
        f"{st[0]['global_batch']}; stages are cumulative. Bytes from the compiled HLO, split intra- / inter-node "
        "(`training.comm_report.split_bytes`). The dense model's all-reduce is the same in every stage and not "
        "included.",
        "",
        "| stage | topology | forward / backward | planner plan | half_dim | intra-node B/example "
        "| inter-node B/example | total B/example | vs baseline |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for x in st:
        c = x["settings"]
        L.append(
            f"| {x['stage']} | {c['topology']} | {c['comm_forward']} / {c['comm_backward']} | "
            f"{'yes' if c['balanced'] else 'no'} | {'yes' if c['half_dim'] else 'no'} | "
            f"{x['intra_node_bytes_per_example']:,.1f} | {x['inter_node_bytes_per_example']:,.1f} | "
            f"{x['total_bytes_per_example']:,.1f} | {x['total_bytes_per_example'] / base:.3f} |"
        )
    L.append("")
    return L


# ------------------------------------------------------------------------------------------ summary


def _span(vals) -> str:
    return f"{min(vals):.2f}x to {max(vals):.2f}x"


def findings(res: dict) -> list[str]:
    """Sentences computed from the numbers."""
    out = []
    one = res["parts"].get("one_device")
    if one and "fbgemm" in one["engines"] and "jaxscale" in one["engines"]:
        j, f = one["engines"]["jaxscale"]["median_ms"], one["engines"]["fbgemm"]["median_ms"]
        sp = speed_vs_fbgemm(one["engines"])["jaxscale"]
        out.append(
            f"One device: jaxscale {_ms(j)} ms vs FBGEMM {_ms(f)} ms per step: {f / j:.2f}x FBGEMM's speed "
            f"(target >= 1.0x: {'met' if f / j >= 1 else 'not met'}); per round {_ratios(sp['round_speeds'])}, "
            f"worst round {sp['worst_round']:.2f}x ({'holds' if sp['worst_round'] >= 1 else 'does not hold'})."
        )
    dist = res["parts"].get("equal_devices")
    if dist:
        rows = dist["comparisons"]
        for key, label in (("time", "TorchRec at the matched precision"), ("time_fastest", "TorchRec's fastest")):
            vals = [r[f"{key}_ratio"] for r in rows if r.get(f"{key}_ratio") is not None]
            worst = [r[f"{key}_worst_ratio"] for r in rows if r.get(f"{key}_worst_ratio") is not None]
            if vals:
                out.append(
                    f"Equal devices, jaxscale on W processes vs {label}: time ratio {_span(vals)}; "
                    f"{sum(v <= 1.0 for v in vals)} of {len(vals)} rows meet <= 1.0x on the pooled medians, "
                    f"{sum(v <= 1.0 for v in worst)} of {len(worst)} on their worst round "
                    f"(worst rounds {_span(worst)})."
                )
        both = [r for r in rows if holds(r, "time") is not None and holds(r, "time_fastest") is not None]
        if both:
            n = sum(holds(r, "time") and holds(r, "time_fastest") for r in both)
            out.append(
                f"**On the worst round, {n} of {len(both)} equal-device rows hold (<= 1.0x against both TorchRec's "
                "matched and its fastest configuration).**"
            )
        b = [(r["bytes_ratio"], r["bytes_target"]) for r in rows if r["devices"] > 1 and r["bytes_ratio"] is not None]
        if b:
            met = sum(v <= t for v, t in b)
            out.append(
                f"Equal devices, bytes: {min(v for v, _ in b):.2f}x to {max(v for v, _ in b):.2f}x TorchRec; "
                f"{met} of {len(b)} rows meet their target (<= 1.0x, fp8 <= 0.5x, fp8/bf16 <= 0.75x)."
            )
        reuse = {(r["devices"], r["sharding"], r["precision"]): r for r in rows if r.get("capacities") == "reuse"}
        cost = [
            r["jaxscale_ms"] / reuse[k]["jaxscale_ms"]
            for r in rows
            if r.get("capacities") == "count"
            and (k := (r["devices"], r["sharding"], r["precision"])) in reuse
            and r["jaxscale_ms"]
            and reuse[k]["jaxscale_ms"]
        ]
        if cost:
            out.append(f"Counting every batch instead of `reuse_capacities`: {_span(cost)} the reused rows' time.")
    if not res.get("ok", True):
        out.append("**A correctness check failed** (see the check columns): the timings compare different work.")
    return out


def render_train_step(p: dict) -> list[str]:
    """The training-step table: examples/s of each engine (median and worst step), per-round speeds."""
    s, e = p["shape"], p["engines"]
    what = {
        "jaxscale": "foundation model (`movielens_foundation.yaml`), Trainer step: prepare + AOT-compiled donated "
        f"`train_step` + metrics read-back, {s.get('mesh', '1x1')} mesh",
        "torch": "SASRec+ (`jaxscale.benchmarks.sasrec_torch`), eager",
        "torch_compile": "SASRec+ under `torch.compile`",
    }
    L = [
        "## 4. A real training step: the foundation model vs SASRec+ in PyTorch",
        "",
        f"Batch {s['batch']} histories of {s['events']} events, {s['items']:,} items, cross-entropy over every item at "
        f"every position; {s['layers']} layers, d {s['d_model']}, {s['heads']} heads, inner {s['inner']}, dropout, "
        f"Adam. {p['rounds']} sessions per engine, alternated in rounds ({' -> '.join(p['order'])}); each: "
        f"{s['warmup']} warm-up + {s['steps']} timed steps (start-up and compile excluded). Threads: XLA's intra-op "
        f"pool and torch's both set to {p['threads']}. "
        + load_line(p["load_average_before"], p["load_average_after"], p["background_busy"])
        + ".",
        *_problems(p),
    ]
    if p.get("torch_skipped"):
        L += ["", f"**{p['torch_skipped']}.**"]
    L += [
        "",
        "| engine | what | threads (measured) | median ms | worst ms | examples/s (median) | examples/s (worst) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in e.items():
        if "error" in r:
            L.append(f"| {name} | {what.get(name, name)} | - | failed: {r['error'].splitlines()[0][:120]} | | | |")
            continue
        measured = ", ".join(str(t) for t in r["session_threads"])
        L.append(
            f"| {name} | {what.get(name, name)} | {r['info'].get('threads_set', '?')} ({measured}) | "
            f"{_ms(r['median_ms'])} | {_ms(r['max_ms'])} | {r['examples_per_s']:,.0f} | "
            f"{r['worst_examples_per_s']:,.0f} |"
        )
    if p["speed"]:
        L += [
            "",
            "| jaxscale against | speed (median) | per round | worst round |",
            "|---|---|---|---|",
        ]
        for name, sp in p["speed"].items():
            L.append(
                f"| {name} | {_ratio(sp['speed'])} | {_ratios(sp['round_speeds'])} | {_ratio(sp['worst_round'])} |"
            )
    return L + [""]


def render(res: dict) -> str:
    m = res["machine"]
    L = [
        f"# jaxscale benchmark suite{' (--quick)' if res['quick'] else ''}",
        "",
        f"Command: `{res['command']}`  ",
        f"Machine: {describe_machine(m)}.  ",
        f"Load average (1/5/15 min) at start: {m['load_average']}; wall time {res['wall_s']:.0f} s.",
        "",
        "Every engine is timed in its own processes with no other engine process alive (sessions alternate in "
        "rounds; see docs/benchmarks.md for why). CPU wall-clock is comparable only within one run and on one "
        "CPU; bytes are exact.",
        "",
    ]
    if not res.get("torchrec_installed", True):
        L += [
            "**TorchRec / FBGEMM are not installed here, so their columns are empty** "
            "(`bash experiments/baselines/install_torchrec.sh` in a source checkout).",
            "",
        ]
    f = findings(res)
    if f:
        L += ["**Summary (computed from the tables below):**", ""] + [f"- {x}" for x in f] + [""]
    parts = res["parts"]
    if "one_device" in parts:
        L += render_one_device(parts["one_device"])
    if "equal_devices" in parts:
        L += render_equal_devices(parts["equal_devices"])
    if "stages" in parts:
        L += render_stages(parts["stages"])
    if "train_step" in parts:
        L += render_train_step(parts["train_step"])
    return "\n".join(L)
