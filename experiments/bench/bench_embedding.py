"""The embedding engine on CPU: does a step's cost grow with the table, and how fast is a lookup?

    python experiments/bench/bench_embedding.py            # writes experiments/results/bench_embedding.{md,json}
    python experiments/bench/bench_embedding.py --rows 1e5,1e6 --steps 10 --out /tmp/be

(a) Step time vs table size: one jitted lookup + row-wise AdaGrad update (state donated) for one row-wise
    table of 1e5, 1e6 and 1e7 rows x 64 at the same batch (B x L Zipf ids, sum pooling), on 8 simulated
    devices (2 x 4 mesh) and on 1 device. All configurations live in this one process and run interleaved,
    one step each per round (order alternating); medians. A dense update would cost x100 from 1e5 to 1e7
    rows; the sparse one should not grow.
(b) Where the one-device step goes: the same jitted lookup alone vs lookup + update, and what the 8-device
    step sends, per collective, from its compiled HLO (`jaxscale.engine.comm_inspect`).
(c) Rows gathered per second on one device: `ec.lookup` beside a plain `jnp.take(mode='clip')` + sum of the
    same ids and NumPy's `table[ids].sum(1)`, interleaved. The NumPy variant runs in this JAX process:
    XLA's threads that are still busy after a JAX call can slow it (see timing_probe.py).

Every figure in the Markdown is computed from the JSON written beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxscale.benchmarks.machine import describe_machine, load_average
from jaxscale.benchmarks.machine import recorded_machine as machine
from jaxscale.benchmarks.sessions import log
from jaxscale.benchmarks.stats import spread, zipf_ids
from jaxscale.infra.atomic import write_text as write_atomic

RESULTS = Path(__file__).resolve().parents[1] / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1e5,1e6,1e7", help="comma-separated table sizes")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--hotness", type=int, default=20, help="ids per example (sum pooling)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (mesh 2 x devices/2)")
    p.add_argument("--topology", default="1d", help="topology of the multi-device runs")
    p.add_argument("--capacity-factor", type=float, default=None, help="capacity_factor of the multi-device runs")
    p.add_argument("--steps", type=int, default=20, help="timed rounds")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gather-rows", type=float, default=1e6, help="table rows for the gather comparison (c)")
    p.add_argument("--gather-reps", type=int, default=30)
    p.add_argument("--out", default=str(RESULTS / "bench_embedding"), help="results path without suffix")
    return p.parse_args(argv)


def make_step(ec, lookup_only=False):
    """(state, ids) -> (state, probe): lookup + update with the state donated, or the lookup alone (the
    state passes through outside jit: returning it from jit would copy the whole table every call)."""
    import jax

    if lookup_only:
        lookup = jax.jit(lambda state, ids: ec.lookup(state, ids)["f"][0, 0])
        return lambda state, ids: (state, lookup(state, ids))

    def step(state, ids):
        emb = ec.lookup(state, ids)
        grads = jax.tree.map(lambda e: 2.0 * e, emb)  # d/de sum(e**2)
        return ec.update(state, ids, grads), emb["f"][0, 0]

    return jax.jit(step, donate_argnums=0)


def run_interleaved(setups, warmup, steps):
    """Every setup's step once per round, order alternating; fills setup['times']."""
    import jax

    for r in range(warmup + steps):
        for s in setups if r % 2 == 0 else setups[::-1]:
            t0 = time.perf_counter()
            s["state"], probe = s["step"](s["state"], s["ids"])
            jax.block_until_ready((s["state"], probe))
            if r >= warmup:
                s["times"].append(time.perf_counter() - t0)


# ---------------------------------------------------------------- (a) step time vs table size


def collection(jaxscale, rows, mesh, topology, args, capacity_factor=None):
    table = jaxscale.TableConfig("t", rows=rows, dim=args.dim, pooling="sum", features=("f",))
    return jaxscale.EmbeddingCollection(
        [table],
        mesh,
        jaxscale.EmbeddingSettings(
            topology=topology,
            sharding="row_wise",
            optimizer=jaxscale.RowWiseAdagrad(0.01),
            capacity_factor=capacity_factor,
        ),
    )


def bench_steps(args, rng):
    import jax

    import jaxscale
    from jaxscale.engine import comm_inspect

    devs = jax.devices()
    meshes = (
        (f"{args.devices}dev_{args.topology}", jaxscale.make_mesh(2, args.devices // 2, devices=devs), args.topology),
        ("1dev", jaxscale.make_mesh(1, 1, devices=devs[:1]), "1d"),
    )
    setups = []
    for label, mesh, topology in meshes:
        for rows in args.rows_list:
            ec = collection(jaxscale, rows, mesh, topology, args, args.capacity_factor if label != "1dev" else None)
            t0 = time.perf_counter()
            state = jax.block_until_ready(ec.init(jax.random.key(0)))  # generated on the devices
            init_s = time.perf_counter() - t0
            ids = ec.shard_batch({"f": zipf_ids(rng, rows, (args.batch, args.hotness), args.zipf)})
            step = make_step(ec)
            sent = comm_inspect.summarize(comm_inspect.list_collectives(step, state, ids, mesh=mesh))
            setups.append(
                dict(label=label, rows=rows, state=state, ids=ids, step=step, init_s=init_s, sent=sent, times=[])
            )
            log(f"ready {label} rows={rows:.0e}: init {init_s:.1f} s")
    run_interleaved(setups, args.warmup, args.steps)
    out = {}
    for s in setups:
        out.setdefault(s["label"], {})[f"{s['rows']:.0e}"] = dict(
            spread(s["times"]), init_s=s["init_s"], bytes_per_device=s["sent"]["total"], by_kind=s["sent"]["by_kind"]
        )
        s["state"] = None  # free the large tables before the next part
    for by_rows in out.values():
        keys = list(by_rows)
        by_rows["ratio_largest_over_smallest"] = by_rows[keys[-1]]["median_ms"] / by_rows[keys[0]]["median_ms"]
    return out


# ------------------------------------------------------------------------ (b) lookup vs update


def bench_breakdown(args, rng):
    import jax

    import jaxscale

    rows = args.rows_list[len(args.rows_list) // 2]
    mesh = jaxscale.make_mesh(1, 1, devices=jax.devices()[:1])
    ec = collection(jaxscale, rows, mesh, "1d", args)
    ids = ec.shard_batch({"f": zipf_ids(rng, rows, (args.batch, args.hotness), args.zipf)})
    setups = [
        dict(name="lookup", state=ec.init(jax.random.key(2)), ids=ids, step=make_step(ec, lookup_only=True), times=[]),
        dict(name="lookup+update", state=ec.init(jax.random.key(2)), ids=ids, step=make_step(ec), times=[]),
    ]
    run_interleaved(setups, args.warmup, args.steps)
    med = {s["name"]: spread(s["times"])["median_ms"] for s in setups}
    return {"table_rows": rows, "lookup_ms": med["lookup"], "step_ms": med["lookup+update"]}


# ---------------------------------------------------------------- (c) lookup rows/s vs NumPy


def bench_gather(args, rng):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxscale

    rows = int(args.gather_rows)
    ec = collection(jaxscale, rows, jaxscale.make_mesh(1, 1, devices=jax.devices()[:1]), "1d", args)
    state = ec.init(jax.random.key(1))
    host_ids = zipf_ids(rng, rows, (args.batch, args.hotness), args.zipf)
    ids = ec.shard_batch({"f": host_ids})
    table = ec.to_dense(state)["t"]
    table_dev = jax.device_put(table)
    flat = jax.device_put(jnp.asarray(host_ids))
    take = jax.jit(lambda t, i: jnp.take(t, i.reshape(-1), axis=0, mode="clip").reshape(i.shape + (t.shape[1],)).sum(1))
    variants = {
        "engine_lookup": lambda: jax.block_until_ready(ec.lookup(state, ids)["f"]),
        "jnp_take_clip": lambda: jax.block_until_ready(take(table_dev, flat)),
        "numpy_fancy_index": lambda: table[host_ids].sum(1),
    }
    ref = variants["numpy_fancy_index"]()
    for name in ("engine_lookup", "jnp_take_clip"):
        np.testing.assert_allclose(np.asarray(variants[name]()), ref, rtol=1e-4, atol=1e-5, err_msg=name)
    times = {k: [] for k in variants}
    for r in range(3 + args.gather_reps):
        for k in list(variants) if r % 2 == 0 else list(variants)[::-1]:
            t0 = time.perf_counter()
            variants[k]()
            if r >= 3:
                times[k].append(time.perf_counter() - t0)
    n = host_ids.size
    out = {"table_rows": rows, "ids": n, "unique_ids": int(np.unique(host_ids).size)}
    for k, ts in times.items():
        s = spread(ts)
        out[k] = dict(s, rows_per_s=n / (s["median_ms"] / 1e3))
    out["engine_over_numpy"] = out["engine_lookup"]["rows_per_s"] / out["numpy_fancy_index"]["rows_per_s"]
    out["jnp_take_over_numpy"] = out["jnp_take_clip"]["rows_per_s"] / out["numpy_fancy_index"]["rows_per_s"]
    return out


# ------------------------------------------------------------------------------------- report


def render(res: dict) -> str:
    a, c = res["config"], res["gather_1dev"]
    L = [
        "# bench_embedding: step time vs table size, and one-device lookup speed",
        "",
        f"Command: `{res['command']}`  ",
        f"Machine: {describe_machine(res['machine'])}; jax {res['jax']}.  ",
        f"Load average (1/5/15 min) before: {res['machine']['load_average']}, after: {res['load_average_after']}; "
        f"wall time {res['wall_s']:.0f} s.",
        "",
        f"One row-wise table x {a['dim']}, batch {a['batch']} x {a['hotness']} Zipf({a['zipf']}) ids hashed over the "
        f"table, sum pooling, row-wise AdaGrad, state from `ec.init`; {a['devices']} devices = 2 x "
        f"{a['devices'] // 2} mesh, topology `{a['topology']}`, capacity_factor {a['capacity_factor']}; 1 device = "
        f"1 x 1. {a['warmup']} warm-up rounds, then {a['steps']} rounds, every configuration one step per round "
        "(order alternating); medians.",
        "",
        "## (a) Step time vs table size",
        "",
        "| config | rows | median ms | p10 | p90 | bytes sent per device per step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    ratios = []
    for label, by_rows in res["step_time"].items():
        for k, v in by_rows.items():
            if isinstance(v, dict):
                L.append(
                    f"| {label} | {k} | {v['median_ms']:.1f} | {v['p10_ms']:.1f} | {v['p90_ms']:.1f} | "
                    f"{v['bytes_per_device']:,.0f} |"
                )
        ratios.append(f"{label} {by_rows['ratio_largest_over_smallest']:.2f}")
    first, last = a["rows_list"][0], a["rows_list"][-1]
    L += [
        "",
        f"Median step time, {last:.0e} rows / {first:.0e} rows: **{', '.join(ratios)}** (a dense update would be "
        f"x{last / first:g}).",
        "",
        "## (b) Where the one-device step goes",
        "",
    ]
    b = res["breakdown_1dev"]
    L += [
        f"Table {b['table_rows']:.0e} rows: the jitted lookup alone {b['lookup_ms']:.1f} ms, lookup + update "
        f"{b['step_ms']:.1f} ms, so the update (gradient routing, per-row sums, AdaGrad) takes about "
        f"{b['step_ms'] - b['lookup_ms']:.1f} ms ({100 * (b['step_ms'] - b['lookup_ms']) / b['step_ms']:.0f}% of "
        "the step).",
        "",
        "What the multi-device step sends per device (compiled HLO), by collective kind, for the largest table:",
        "",
        "| kind | collectives | bytes per device |",
        "|---|---:|---:|",
    ]
    multi = next(k for k in res["step_time"] if k != "1dev")
    largest = res["step_time"][multi][f"{last:.0e}"]
    for kind, v in sorted(largest["by_kind"].items()):
        L.append(f"| {kind} | {v['count']} | {v['intra_node'] + v['cross_node']:,.0f} |")
    L += [
        "",
        f"## (c) One-device gather of {c['ids']:,} ids ({c['unique_ids']:,} distinct), table {c['table_rows']:.0e} x "
        f"{a['dim']}",
        "",
        "| variant | median ms | p10 | p90 | rows/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for k in ("engine_lookup", "jnp_take_clip", "numpy_fancy_index"):
        v = c[k]
        L.append(f"| {k} | {v['median_ms']:.2f} | {v['p10_ms']:.2f} | {v['p90_ms']:.2f} | {v['rows_per_s']:.3g} |")
    L += [
        "",
        f"Engine / NumPy: **{c['engine_over_numpy']:.2f}x**; plain `jnp.take` / NumPy: {c['jnp_take_over_numpy']:.2f}x "
        "(rows per second; > 1: faster than NumPy).",
        "",
    ]
    return "\n".join(L)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.rows_list = [int(float(r)) for r in args.rows.split(",")]
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)  # before the backend starts
    import numpy as np

    rng = np.random.default_rng(0)
    t0 = time.time()
    res = {
        "command": "python experiments/bench/bench_embedding.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(),
        "jax": jax.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
    }
    res["step_time"] = bench_steps(args, rng)
    res["breakdown_1dev"] = bench_breakdown(args, rng)
    res["gather_1dev"] = bench_gather(args, rng)
    res["load_average_after"] = load_average()
    res["wall_s"] = time.time() - t0
    out = Path(args.out)
    text = render(res)
    write_atomic(out.with_suffix(".json"), json.dumps(res, indent=1, default=float) + "\n")
    write_atomic(out.with_suffix(".md"), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
