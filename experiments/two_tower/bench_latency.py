"""Hybrid-inference latency: the online step (cached encoder state + the request's context -> context layer
and head) against the end-to-end forward it replaces (history lookups, encoder, context layer, head), per
request, at batch 1 and 64, on CPU.

    python experiments/two_tower/bench_latency.py              # writes latency.json and the "latency" section
    python experiments/two_tower/bench_latency.py --requests 200 --results none   # quicker, records nothing

Setup: the model of jaxscale/configs/two_tower_smoke.yaml (or --config), tables on one device (a serving
host), `--users` users' histories encoded offline into an `EncoderStateStore` file (that step is timed too).
A request is `batch` users drawn at random with their request context. Both paths are timed from host NumPy
inputs to the host NumPy query: online = store lookup + context checks + the jitted context layer and head;
end-to-end = id checks + the jitted lookups, encoder, context layer and head. The two paths alternate request
by request (which goes first alternates too), so load changes hit both alike; every online query is checked
against its end-to-end twin (max abs difference recorded). Latency depends on shapes, not on trained weights,
so the model is freshly initialised. Targets: online p99 <= 5 ms at batch 1; online at least 5x faster.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from jaxscale.infra import atomic

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

DEFAULT_CONFIG = REPO / "jaxscale" / "configs" / "two_tower_smoke.yaml"
TARGET_P99_MS = 5.0
TARGET_SPEEDUP = 5.0


def setup(args):
    import jax
    import numpy as np
    from flax import nnx

    import jaxscale
    from jaxscale.training.config import load_config
    from jaxscale_models.contextual_two_tower import ContextualTwoTower, two_tower_tables
    from jaxscale_models.contextual_two_tower_data import SyntheticContextualData
    from jaxscale_models.two_tower_inference import (
        EndToEndQueryTower,
        OfflineEncoder,
        OnlineQueryTower,
        build_state_store,
    )

    overrides = [f"model.contextual_two_tower.max_seq_len={args.seq_len}"] if args.seq_len else []
    cfg = load_config(str(args.config), ["model.kind=contextual_two_tower", *overrides]).model.params
    mesh = jaxscale.make_mesh(1, 1, devices=jax.devices()[:1])
    ec = jaxscale.EmbeddingCollection(two_tower_tables(cfg), mesh, jaxscale.EmbeddingSettings(sharding="table_wise"))
    emb_state = ec.init(jax.random.key(0))
    model = ContextualTwoTower(cfg, rngs=nnx.Rngs(0))
    data = SyntheticContextualData(cfg, 256, seed=0).held_out().with_options(corpus=False)
    steps = -(-args.users // 256)
    batches = [data.batch(s) for s in range(steps)]
    histories = {k: np.concatenate([b[k] for b in batches])[: args.users] for k in batches[0]}
    user_ids = np.concatenate([data.user_ids(s) for s in range(steps)])[: args.users]

    encoder = OfflineEncoder(model, ec, emb_state)
    encoder({k: v[:256] for k, v in histories.items()})  # compile outside the timing
    store_dir = Path(tempfile.mkdtemp(prefix="two_tower_states_"))
    t0 = time.perf_counter()
    chunks = [
        (user_ids[i : i + 256], {k: v[i : i + 256] for k, v in histories.items()}) for i in range(0, args.users, 256)
    ]
    store = build_state_store(store_dir / "states.arrow", encoder, chunks, version="bench")
    offline_s = time.perf_counter() - t0
    online = OnlineQueryTower.from_collection(model, ec, emb_state, store)
    e2e = EndToEndQueryTower(model, ec, emb_state)
    info = {
        "users": args.users,
        "offline_seconds": offline_s,
        "offline_users_per_s": args.users / offline_s,
        "store_bytes": store.path.stat().st_size,
        "model": {
            k: getattr(cfg, k)
            for k in ("d_model", "num_layers", "num_heads", "max_seq_len", "item_rows", "context_dim", "embed_dim")
        },
    }
    return online, e2e, histories, user_ids, info, store_dir


def measure(online, e2e, histories, user_ids, batch: int, requests: int, warmup: int, seed: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed + batch)
    pool = [rng.integers(0, user_ids.shape[0], batch) for _ in range(requests + warmup)]

    def request(rows):
        return user_ids[rows], {k: v[rows] for k, v in histories.items()}

    for rows in pool[:warmup]:  # compiles (one per batch shape) and warms caches
        users, req = request(rows)
        online.for_users(users, req)
        e2e(req)
    times = {"online": [], "end_to_end": []}
    max_diff = 0.0
    for i, rows in enumerate(pool[warmup:]):
        users, req = request(rows)
        runs = [("online", lambda u=users, r=req: online.for_users(u, r)), ("end_to_end", lambda r=req: e2e(r))]
        out = {}
        for name, fn in runs if i % 2 == 0 else runs[::-1]:
            t0 = time.perf_counter_ns()
            out[name] = fn()
            times[name].append((time.perf_counter_ns() - t0) / 1e6)
        max_diff = max(max_diff, float(np.abs(out["online"] - out["end_to_end"]).max()))
    stats = {
        name: {
            "p50_ms": float(np.percentile(t, 50)),
            "p99_ms": float(np.percentile(t, 99)),
            "mean_ms": float(np.mean(t)),
            "per_user_p50_ms": float(np.percentile(t, 50)) / batch,
        }
        for name, t in times.items()
    }
    stats["speedup_p50"] = stats["end_to_end"]["p50_ms"] / stats["online"]["p50_ms"]
    stats["speedup_p99"] = stats["end_to_end"]["p99_ms"] / stats["online"]["p99_ms"]
    stats["max_abs_diff_online_vs_end_to_end"] = max_diff
    stats["requests"] = requests
    return stats


def render(args, result) -> str:
    from jaxscale.benchmarks.machine import machine_lines

    info = result["setup"]
    lines = [
        "## bench_latency.py: hybrid inference, online step vs end-to-end forward (CPU, one device)",
        "",
        f"Command: `python experiments/two_tower/bench_latency.py{''.join(' ' + a for a in args.argv)}`",
        "",
        "Model: " + ", ".join(f"{k} {v}" for k, v in info["model"].items()) + f". Store: {info['users']} users, "
        f"{info['store_bytes'] / 1e6:.1f} MB, built offline in {info['offline_seconds']:.2f} s "
        f"({info['offline_users_per_s']:.0f} users/s).",
        "",
        "| batch | path | p50 ms | p99 ms | mean ms | p50 per user ms |",
        "|---|---|---|---|---|---|",
    ]
    for b, s in result["batches"].items():
        for name in ("online", "end_to_end"):
            r = s[name]
            lines.append(
                f"| {b} | {name.replace('_', '-')} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['mean_ms']:.3f} | "
                f"{r['per_user_p50_ms']:.4f} |"
            )
    lines.append("")
    for b, s in result["batches"].items():
        lines.append(
            f"- batch {b}: online is {s['speedup_p50']:.1f}x faster at p50, {s['speedup_p99']:.1f}x at p99 "
            f"({s['requests']} requests each); max |online - end-to-end| = {s['max_abs_diff_online_vs_end_to_end']:.1e}"
        )
    one = result["batches"]["1"]
    ok_p99 = one["online"]["p99_ms"] <= TARGET_P99_MS
    ok_speed = min(one["speedup_p50"], one["speedup_p99"]) >= TARGET_SPEEDUP
    lines += [
        f"- target online p99 <= {TARGET_P99_MS:g} ms at batch 1: **{'yes' if ok_p99 else 'NO'}**",
        f"- target online >= {TARGET_SPEEDUP:g}x faster than end-to-end at batch 1 (p50 and p99): "
        f"**{'yes' if ok_speed else 'NO'}**",
        *machine_lines(result["machine"], result["loadavg_at_end"]),
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="YAML with a model.contextual_two_tower section")
    p.add_argument("--seq-len", type=int, default=None, help="override the history length (max_seq_len)")
    p.add_argument("--users", type=int, default=4096, help="users in the state store")
    p.add_argument("--requests", type=int, default=1000, help="timed requests per batch size and path")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=HERE / "latency.json")
    p.add_argument("--results", default=None, help="RESULTS.md to update (default: next to this script; 'none')")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.users < 1 or args.requests < 1 or args.warmup < 1 or min(args.batch_sizes) < 1:
        p.error("--users, --requests, --warmup and --batch-sizes must be >= 1")
    if 1 not in args.batch_sizes:
        p.error("--batch-sizes must include 1 (the targets are stated at batch 1)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from results import RESULTS, machine, write_section

    m = machine()
    online, e2e, histories, user_ids, info, store_dir = setup(args)
    try:
        batches = {}
        for b in args.batch_sizes:
            batches[str(b)] = measure(online, e2e, histories, user_ids, b, args.requests, args.warmup, args.seed)
            s = batches[str(b)]
            print(
                f"batch {b:3d}: online p50 {s['online']['p50_ms']:.3f} ms p99 {s['online']['p99_ms']:.3f} ms | "
                f"end-to-end p50 {s['end_to_end']['p50_ms']:.3f} ms p99 {s['end_to_end']['p99_ms']:.3f} ms | "
                f"speedup p50 {s['speedup_p50']:.1f}x p99 {s['speedup_p99']:.1f}x | "
                f"max diff {s['max_abs_diff_online_vs_end_to_end']:.1e}"
            )
    finally:
        for f in store_dir.iterdir():
            f.unlink()
        store_dir.rmdir()
    result = {"setup": info, "batches": batches, "machine": m, "loadavg_at_end": os.getloadavg()}
    if args.json and str(args.json) != "none":
        atomic.write_json(args.json, result)
        print(f"wrote {args.json}")
    if args.results != "none":
        print(f"wrote {write_section('latency', render(args, result), Path(args.results or RESULTS))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
