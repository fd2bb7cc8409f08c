"""Benchmark of the embedding engine on CPU (not a test).

(a) lookup+update step time (one jitted step, state donated) for tables of 1e5, 1e6 and 1e7 rows x 64 at
    the same batch (B x L Zipf ids), on 8 simulated devices (2x4 mesh) and on 1 device (1x1 mesh). The
    configurations are run interleaved, one step each per round; medians over the timed rounds. The
    ratio 1e7/1e5 shows whether the step cost grows with the table (a dense update would: x100).
(b) rows gathered per second by `lookup` on one device, beside NumPy `table[ids].sum(1)` and a plain
    `jnp.take` of the same ids on the same table, measured interleaved.
(c) a breakdown of the 1-device step (routing sort, gather, the update's sort/segment-sum/scatter) and of
    the all_to_all payloads on 8 devices, timed as separate jitted pieces of the engine.

Usage: python experiments/bench/bench_embedding.py [--steps 20] [--json out.json]
Prints one JSON object, then a Markdown summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1e5,1e6,1e7", help="comma-separated table sizes")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--hotness", type=int, default=20, help="ids per example (sum pooling)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (mesh 2 x devices/2)")
    p.add_argument("--topology", default="1d", help="topology of the multi-device runs")
    p.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="EmbeddingCollection capacity_factor of the multi-device runs (default: exact worst case)",
    )
    p.add_argument("--steps", type=int, default=20, help="timed rounds (>= 20 for the recorded run)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gather-rows", type=float, default=1e6, help="table rows for the gather comparison (b)")
    p.add_argument("--gather-reps", type=int, default=30)
    p.add_argument("--json", default=None, help="also write the JSON here")
    return p.parse_args()


ARGS = parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", ARGS.devices)  # before the backend starts
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxscale  # noqa: E402
from jaxscale import collectives  # noqa: E402


def machine() -> dict:
    """The machine description of the benchmark suite, plus the JAX version."""
    from jaxscale.bench import machine as suite_machine

    return dict(suite_machine(), jax=jax.__version__)


def zipf_ids(rng, rows: int, shape, a: float) -> np.ndarray:
    """Zipf ranks, scattered over the whole table by a multiplicative hash (hot rows are not adjacent)."""
    rank = rng.zipf(a, size=shape).astype(np.int64) - 1
    return ((rank * 2654435761) % rows).astype(np.int32)


def summary(ts) -> dict:
    ts = sorted(ts)
    return {
        "median_ms": 1e3 * statistics.median(ts),
        "min_ms": 1e3 * ts[0],
        "max_ms": 1e3 * ts[-1],
        "p10_ms": 1e3 * ts[len(ts) // 10],
        "p90_ms": 1e3 * ts[(9 * len(ts)) // 10],
        "n": len(ts),
    }


def make_step(ec):
    def step(state, ids):
        emb = ec.lookup(state, ids)
        grads = jax.tree.map(lambda e: 2.0 * e, emb)  # d/de sum(e**2)
        return ec.update(state, ids, grads), emb["f"][0, 0]

    return jax.jit(step, donate_argnums=0)


# ---------------------------------------------------------------- (a) step time vs table size


def bench_steps(rows_list, rng):
    devs = jax.devices()
    setups = []
    for label, mesh, topology in (
        (f"{ARGS.devices}dev_{ARGS.topology}", jaxscale.make_mesh(2, ARGS.devices // 2, devices=devs), ARGS.topology),
        ("1dev", jaxscale.make_mesh(1, 1, devices=devs[:1]), "1d"),
    ):
        for rows in rows_list:
            table = jaxscale.TableConfig("t", rows=rows, dim=ARGS.dim, pooling="sum", features=("f",))
            ec = jaxscale.EmbeddingCollection(
                [table],
                mesh,
                topology=topology,
                sharding="row_wise",
                optimizer=jaxscale.RowWiseAdagrad(0.01),
                capacity_factor=ARGS.capacity_factor if label != "1dev" else None,
            )
            t0 = time.perf_counter()
            state = ec.init(jax.random.key(0))  # generated on the devices: no host table
            jax.block_until_ready(state)
            t_init = time.perf_counter() - t0
            ids = ec.shard_batch({"f": zipf_ids(rng, rows, (ARGS.batch, ARGS.hotness), ARGS.zipf)})
            step = make_step(ec)
            t0 = time.perf_counter()
            state, probe = step(state, ids)
            jax.block_until_ready(probe)
            t_compile = time.perf_counter() - t0
            setups.append(
                {
                    "label": label,
                    "rows": rows,
                    "ec": ec,
                    "state": state,
                    "ids": ids,
                    "step": step,
                    "init_s": t_init,
                    "first_step_s": t_compile,
                    "times": [],
                }
            )
            print(
                f"  ready {label} rows={rows:.0e}: init {t_init:.1f} s, first step {t_compile:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    for _ in range(ARGS.warmup):
        for s in setups:
            s["state"], probe = s["step"](s["state"], s["ids"])
            jax.block_until_ready((s["state"], probe))
    for r in range(ARGS.steps):  # interleaved: one step of every configuration per round
        for s in setups if r % 2 == 0 else setups[::-1]:
            t0 = time.perf_counter()
            s["state"], probe = s["step"](s["state"], s["ids"])
            jax.block_until_ready((s["state"], probe))
            s["times"].append(time.perf_counter() - t0)
    out = {}
    for s in setups:
        out.setdefault(s["label"], {})[f"{s['rows']:.0e}"] = dict(
            summary(s["times"]), init_s=s["init_s"], first_step_s=s["first_step_s"]
        )
    for by_rows in out.values():
        keys = list(by_rows)
        by_rows["ratio_largest_over_smallest"] = by_rows[keys[-1]]["median_ms"] / by_rows[keys[0]]["median_ms"]
    # free the big tables before the next part
    for s in setups:
        s["state"] = None
    return out, setups


# ---------------------------------------------------------------- (b) lookup rows/s vs NumPy


def bench_gather(rng):
    rows = int(ARGS.gather_rows)
    mesh = jaxscale.make_mesh(1, 1, devices=jax.devices()[:1])
    ec = jaxscale.EmbeddingCollection(
        [jaxscale.TableConfig("t", rows=rows, dim=ARGS.dim, pooling="sum", features=("f",))],
        mesh,
        topology="1d",
        sharding="row_wise",
    )
    state = ec.init(jax.random.key(1))
    host_ids = zipf_ids(rng, rows, (ARGS.batch, ARGS.hotness), ARGS.zipf)
    ids = ec.shard_batch({"f": host_ids})
    table_dev = (
        state["weights"]["w64"][0, 0] if "w64" in state["weights"] else next(iter(state["weights"].values()))[0, 0]
    )
    table = np.asarray(table_dev)  # 1 shard, 1 piece: the block IS the table
    flat = jax.device_put(jnp.asarray(host_ids))

    lookup = lambda: ec.lookup(state, ids)["f"]  # noqa: E731
    take = jax.jit(lambda t, i: jnp.take(t, i.reshape(-1), axis=0, mode="clip").reshape(i.shape + (t.shape[1],)).sum(1))
    numpy_gather = lambda: table[host_ids].sum(1)  # noqa: E731

    ref = numpy_gather()
    np.testing.assert_allclose(np.asarray(lookup()), ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(take(table_dev, flat)), ref, rtol=1e-4, atol=1e-5)
    variants = {
        "engine_lookup": lambda: jax.block_until_ready(lookup()),
        "jnp_take_clip": lambda: jax.block_until_ready(take(table_dev, flat)),
        "numpy_fancy_index": numpy_gather,
    }
    times = {k: [] for k in variants}
    for _ in range(3):
        for fn in variants.values():
            fn()
    for r in range(ARGS.gather_reps):
        for k in list(variants) if r % 2 == 0 else list(variants)[::-1]:
            t0 = time.perf_counter()
            variants[k]()
            times[k].append(time.perf_counter() - t0)
    n = host_ids.size
    out = {"table_rows": rows, "ids": n, "unique_ids": int(np.unique(host_ids).size)}
    for k, ts in times.items():
        s = summary(ts)
        out[k] = dict(s, rows_per_s=n / (s["median_ms"] / 1e3))
    out["engine_over_numpy"] = out["engine_lookup"]["rows_per_s"] / out["numpy_fancy_index"]["rows_per_s"]
    out["jnp_take_over_numpy"] = out["jnp_take_clip"]["rows_per_s"] / out["numpy_fancy_index"]["rows_per_s"]
    return out, ec, state, ids


# ---------------------------------------------------------------- (c) where the time goes


def timeit(fn, reps=31):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def breakdown(ec, state, ids):
    """Pieces of the 1-device engine step, each jitted alone (the engine's own methods)."""
    ((key, st),) = ec._stacks.items()
    feats = ("f",)
    w = state["weights"][key]
    acc = state["accumulator"][key]

    def route(ids):
        reqs = ec._requests(key, feats, ids)
        return ec._route(st, reqs)

    route_j = jax.jit(route)
    r = route_j(ids)
    S, C = r["send_rows"].shape
    n = r["dest"].shape[0]
    gather_j = jax.jit(
        lambda w, recv: jnp.where(
            (recv >= 0)[..., None], jnp.take(w[0, 0], jnp.clip(recv, 0, st.rows - 1), axis=0, mode="clip"), 0.0
        )
    )
    back = gather_j(w, r["send_rows"])
    unpack_j = jax.jit(
        lambda back, r: (
            (back.at[r["dest"], r["slot"]].get(mode="fill", fill_value=0.0) * r["keep"][:, None])
            .reshape(ARGS.batch, ARGS.hotness, -1)
            .sum(1)
        )
    )
    g = jnp.ones((ARGS.batch, ARGS.dim), jnp.float32)
    req_grads_j = jax.jit(
        lambda r, g: (
            jnp.zeros((S, C, st.width), jnp.float32)
            .at[r["dest"], r["slot"]]
            .add(jnp.repeat(g, ARGS.hotness, axis=0) * r["keep"][:, None], mode="drop")
        )
    )
    send_g = req_grads_j(r, g)
    apply_j = jax.jit(
        lambda w, acc, rows, g: ec._apply_rows(w, {"accumulator": acc}, rows, g, st.rows, True), donate_argnums=(0, 1)
    )
    rows_flat, g_flat = r["send_rows"].reshape(-1), send_g.reshape(-1, st.width)
    holder = {"w": w, "acc": acc}

    def apply_once():
        holder["w"], s = apply_j(holder["w"], holder["acc"], rows_flat, g_flat)
        holder["acc"] = s["accumulator"]
        return holder["w"]

    sort_only = jax.jit(lambda rows: jnp.argsort(jnp.where(rows >= 0, rows, st.rows)))
    reqs = jax.jit(lambda ids: {k: v for k, v in ec._requests(key, feats, ids).items() if k in ("dest", "row")})(ids)
    iota = jnp.arange(n, dtype=jnp.int32)
    # the route's 3-operand, 2-key sort vs one packed uint32 key (dest * R_w + row < 2**31 by _layout)
    sort3 = jax.jit(lambda d, r: jax.lax.sort((d, r, iota), num_keys=2))
    sort_packed = jax.jit(
        lambda d, r: jax.lax.sort((d.astype(jnp.uint32) * jnp.uint32(st.rows) + r.astype(jnp.uint32), iota), num_keys=1)
    )
    out = {
        "shapes": {"requests_n": n, "send_buffer": [S, C, st.width], "unique_rows": int(jnp.sum(r["send_rows"] >= 0))},
        "full_lookup_ms": timeit(lambda: ec.lookup(state, ids)["f"]),  # before apply_once donates the table
        "route_sort_dedup_slots_ms": timeit(lambda: route_j(ids)),
        "owner_gather_ms": timeit(lambda: gather_j(w, r["send_rows"])),
        "unpack_and_pool_ms": timeit(lambda: unpack_j(back, r)),
        "grad_scatter_to_send_buffer_ms": timeit(lambda: req_grads_j(r, g)),
        "apply_rows_sort_segsum_scatter_ms": timeit(apply_once),
        "  of_which_argsort_ms": timeit(lambda: sort_only(rows_flat)),
        "route_sort_3_operands_2_keys_ms": timeit(lambda: sort3(reqs["dest"], reqs["row"])),
        "alternative_packed_1_key_sort_ms": timeit(lambda: sort_packed(reqs["dest"], reqs["row"])),
    }
    return out


def a2a_cost(setups):
    """The padded all_to_all the multi-device step runs, alone (ids + fp32 rows), on the same mesh."""
    s = [s for s in setups if s["label"] != "1dev"][-1]  # the largest table (capacity grows up to the batch)
    ec = s["ec"]
    S = ec.num_shards
    mesh = ec.mesh
    ((key, st),) = ec._stacks.items()
    per_dev = ARGS.batch * ARGS.hotness // (mesh.shape["node"] * mesh.shape["local"])
    C = ec._capacity(key, ("f",), {"f": np.zeros((ARGS.batch // (mesh.size), ARGS.hotness))})
    P = jax.sharding.PartitionSpec
    spec = P(("node", "local"))
    x = jnp.zeros((mesh.size * S, C, st.width), jnp.float32, device=jax.sharding.NamedSharding(mesh, spec))
    i = jnp.zeros((mesh.size * S, C), jnp.int32, device=jax.sharding.NamedSharding(mesh, spec))
    axes = ec.shard_axes
    f = jax.jit(
        jax.shard_map(
            lambda x, i: (collectives.all_to_all(x, axes), collectives.all_to_all_ids(i, axes)),
            mesh=mesh,
            in_specs=(spec, spec),
            out_specs=(spec, spec),
        )
    )
    return {
        "mesh": f"{mesh.shape['node']}x{mesh.shape['local']}",
        "requests_per_device": per_dev,
        "capacity_per_destination": C,
        "rows_buffer_per_device_MB": S * C * st.width * 4 / 1e6,
        "one_a2a_rows_plus_ids_ms": timeit(lambda: f(x, i)),
    }


def main():
    rng = np.random.default_rng(0)
    rows_list = [int(float(r)) for r in ARGS.rows.split(",")]
    result = {
        "machine": machine(),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "config": {k: v for k, v in vars(ARGS).items()},
    }
    steps, setups = bench_steps(rows_list, rng)
    result["step_time"] = steps
    result["a2a_alone"] = a2a_cost(setups)
    del setups
    gather, ec, state, ids = bench_gather(rng)
    result["gather_1dev"] = gather
    result["breakdown_1dev"] = breakdown(ec, state, ids)
    result["loadavg_1_5_15_at_end"] = os.getloadavg()
    text = json.dumps(result, indent=1, default=float)
    print(text)
    if ARGS.json:
        Path(ARGS.json).write_text(text)

    m = result["machine"]
    print(
        f"\n**Machine**: {m['nproc']} CPUs, {m['cpu_model']}; jax {m['jax']}; load average at start "
        f"{m['loadavg_1_5_15_at_start'][0]:.1f}, at end {result['loadavg_1_5_15_at_end'][0]:.1f}\n"
    )
    print("| config | rows | median ms | p10 | p90 | ratio largest/smallest |")
    print("|---|---|---|---|---|---|")
    for label, by_rows in steps.items():
        for k, v in by_rows.items():
            if isinstance(v, dict):
                print(f"| {label} | {k} | {v['median_ms']:.1f} | {v['p10_ms']:.1f} | {v['p90_ms']:.1f} | |")
        print(f"| {label} | | | | | **{by_rows['ratio_largest_over_smallest']:.2f}** |")
    print(
        f"\n| 1-device gather of {gather['ids']} ids ({gather['unique_ids']} unique), table {gather['table_rows']:.0e}x{ARGS.dim} "  # noqa: E501
        f"| median ms | rows/s |\n|---|---|---|"
    )
    for k in ("engine_lookup", "jnp_take_clip", "numpy_fancy_index"):
        print(f"| {k} | {gather[k]['median_ms']:.2f} | {gather[k]['rows_per_s']:.3g} |")
    print(
        f"\nengine / NumPy: **{gather['engine_over_numpy']:.2f}x**; jnp.take / NumPy: {gather['jnp_take_over_numpy']:.2f}x\n"  # noqa: E501
    )
    print("| 1-device step piece | ms |\n|---|---|")
    for k, v in result["breakdown_1dev"].items():
        if k != "shapes":
            print(f"| {k.strip()} | {v:.2f} |")
    a = result["a2a_alone"]
    print(
        f"\n{a['mesh']} all_to_all alone (ids + fp32 rows, C={a['capacity_per_destination']}, "
        f"{a['rows_buffer_per_device_MB']:.1f} MB/device): {a['one_a2a_rows_plus_ids_ms']:.1f} ms"
    )


if __name__ == "__main__":
    main()
