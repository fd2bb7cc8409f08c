"""The GPU checks run by `experiments/gpu/check.sh` (one part per process; see that script).

    python experiments/gpu/check.py --part lookup     # (a) lookup + update throughput vs the HBM limit
    python experiments/gpu/check.py --part scatter    # (b) duplicate-heavy f32 scatter-add / segment-sum
    python experiments/gpu/check.py --part ragged     # (c) jax.lax.ragged_all_to_all
    python experiments/gpu/check.py --part compare-scatter A.json B.json   # (b) without vs with the flag
    add --quick for small shapes (runs on CPU too: how the script itself is tested).

Every part prints readable lines, then one line `JSON {...}` with its numbers (check.sh keeps them).
The LLVM option of (b) is process-wide and read once, when the backend starts, so check.sh runs the
scatter part twice, with and without XLA_FLAGS=--xla_backend_extra_options=-nvptx-allow-ftz-atomics.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]

FTZ_OPTION = "-nvptx-allow-ftz-atomics"
# Peak HBM bandwidth of common accelerators (vendor data sheets), bytes/s, by jax device_kind prefix.
PEAK_HBM = {
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100 80GB HBM3": 3.35e12,
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA H100": 3.35e12,
    "NVIDIA A100-SXM4-80GB": 2.039e12,
    "NVIDIA A100-SXM4-40GB": 1.555e12,
    "NVIDIA A100": 1.555e12,
    "NVIDIA GH200": 4.0e12,
    "NVIDIA B200": 8.0e12,
}


def out(msg: str = ""):
    print(msg, flush=True)


def timed(fn, *args, reps: int, budget_s: float = 20.0):
    """Median seconds of fn(*args) (compiled and warmed first); stops early past `budget_s`."""
    import jax

    jax.block_until_ready(fn(*args))
    times, start = [], time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times), len(times)


def zipf_ids(rng, rows, shape, a=1.1):
    return ((rng.zipf(a, size=shape).astype(np.int64) - 1) * 2654435761 % rows).astype(np.int32)


def ftz_option_parsed() -> bool | None:
    """Whether XLA parsed the LLVM option from XLA_FLAGS (None if this jaxlib cannot tell)."""
    try:
        from jaxlib import xla_client

        return FTZ_OPTION.encode() in xla_client.CompileOptions().SerializeAsString()
    except Exception:  # an internal API: absent or changed in another jaxlib
        return None


def device_info() -> dict:
    import jax
    import jaxlib

    d = jax.devices()[0]
    kind = getattr(d, "device_kind", "?")
    peak = next((v for k, v in PEAK_HBM.items() if kind.startswith(k)), None)
    return {
        "backend": jax.default_backend(),
        "device_kind": kind,
        "devices": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "ftz_option_parsed": ftz_option_parsed(),
        "peak_hbm_bytes_per_s": peak,
    }


# ------------------------------------------------------------------------------ (a) lookup + update


def copy_bandwidth(nbytes: int) -> float:
    """Achievable device memory bandwidth: bytes read + written per second by a large on-device copy."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001)
    t, _ = timed(f, x, reps=10)
    return 2 * nbytes / t


def part_lookup(quick: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxscale.engine import native

    info = device_info()
    R, w, B, L = (20_000, 64, 256, 8) if quick else (10_000_000, 128, 16384, 64)
    rng = np.random.default_rng(0)
    table = jax.random.uniform(jax.random.key(0), (R, w), jnp.float32, -0.05, 0.05)
    acc = jnp.zeros((R,), jnp.float32)
    grad = jnp.asarray(rng.normal(size=(B, w)).astype(np.float32))
    res = {"device": info, "shape": {"rows": R, "dim": w, "batch": B, "hotness": L}, "cases": {}}
    bw = copy_bandwidth((64 if quick else 4096) * 2**20)
    res["copy_bandwidth_bytes_per_s"] = bw
    peak = info["peak_hbm_bytes_per_s"]
    out(f"(a) lookup + update, table {R:,} x {w} f32, batch {B} x {L}, on {info['device_kind']} ({info['backend']})")
    out(
        f"    HBM limit: data-sheet peak {peak / 1e9:.0f} GB/s; measured copy {bw / 1e9:.0f} GB/s"
        if peak
        else f"    HBM limit: no data-sheet figure for this device; measured copy {bw / 1e9:.0f} GB/s"
    )

    fwd = jax.jit(lambda t, x: native.gather_pool(t, x, pooling="sum"))

    def step(t, a, x, g):
        o = native.gather_pool(t, x, pooling="sum")
        t, a = native.update_pooled(
            t, a, x, g, pooling="sum", optimizer="rowwise_adagrad", learning_rate=0.01, eps=1e-8, after=o
        )
        return o, t, a

    step_jit = jax.jit(step, donate_argnums=(0, 1))
    for kind in ("zipf", "uniform"):
        ids_np = zipf_ids(rng, R, (B, L)) if kind == "zipf" else rng.integers(0, R, (B, L)).astype(np.int32)
        ids = jnp.asarray(ids_np)
        uniq = int(np.unique(ids_np).size)
        t_fwd, _ = timed(fwd, table, ids, reps=20)
        times = []
        for _ in range(3 if quick else 10):
            t0 = time.perf_counter()
            o, table, acc = step_jit(table, acc, ids, grad)
            jax.block_until_ready((o, table, acc))
            times.append(time.perf_counter() - t0)
        t_step = statistics.median(times[1:])
        # Bytes the step must move at least: rows gathered, bags written, unique rows + accumulators
        # read and written by the update, output gradients read.
        fwd_bytes = B * L * w * 4 + B * w * 4 + B * L * 4
        upd_bytes = uniq * (w * 4 + 4) * 2 + B * w * 4 + B * L * 4
        case = {
            "unique_ids": uniq,
            "forward_s": t_fwd,
            "step_s": t_step,
            "forward_bytes": fwd_bytes,
            "step_bytes": fwd_bytes + upd_bytes,
            "forward_bytes_per_s": fwd_bytes / t_fwd,
            "step_bytes_per_s": (fwd_bytes + upd_bytes) / t_step,
            "ids_per_s": B * L / t_step,
        }
        res["cases"][kind] = case
        for label, key in (("forward (gather + sum)", "forward"), ("lookup + update step", "step")):
            rate = case[f"{key}_bytes_per_s"]
            frac = f", {rate / peak:.1%} of peak" if peak else ""
            out(
                f"    {kind:7s} {label:22s} {1e3 * case[f'{key}_s']:8.3f} ms  {rate / 1e9:7.1f} GB/s "
                f"({rate / bw:.1%} of copy{frac})"
            )
        out(f"    {kind:7s} unique ids {uniq:,} of {B * L:,}; {case['ids_per_s'] / 1e6:.1f} M ids/s through the step")
    return res


# ----------------------------------------------------------------------------- (b) scatter-add


def sort_segment_sum(updates, ids, num_segments):
    """Sum of `updates` rows per id with no atomics: sort, segmented scan, one write per unique id."""
    import jax
    import jax.numpy as jnp

    order = jnp.argsort(ids)
    sid, su = ids[order], updates[order]
    head = jnp.concatenate([jnp.ones((1,), bool), sid[1:] != sid[:-1]])

    def combine(a, b):
        fa, va = a
        fb, vb = b
        return fa | fb, jnp.where(fb[:, None], vb, va + vb)

    _, scanned = jax.lax.associative_scan(combine, (head, su))
    last = jnp.concatenate([sid[1:] != sid[:-1], jnp.ones((1,), bool)])
    idx = jnp.where(last, sid, num_segments)  # only each id's last (complete) scanned row is written
    # An assignment scatter is plain stores on GPU: the valid indices are unique, the rest are dropped.
    return jnp.zeros((num_segments, updates.shape[1]), updates.dtype).at[idx].set(scanned, mode="drop")


def part_scatter(quick: bool) -> dict:
    import jax
    import jax.numpy as jnp

    info = device_info()
    N, w = (4096, 32) if quick else (1 << 16, 128)
    rng = np.random.default_rng(1)
    upd_np = rng.normal(size=(N, w)).astype(np.float32)
    upd = jnp.asarray(upd_np)
    flag = FTZ_OPTION in info["xla_flags"]
    parsed = {True: "parsed by XLA", False: "NOT in XLA's parsed options", None: "parsing not checkable"}
    out(
        f"(b) f32 scatter-add / segment-sum, {N:,} updates x {w}, {FTZ_OPTION}: "
        f"{'ON' if flag else 'off'} ({parsed[info['ftz_option_parsed']]})"
    )
    cases = {
        "all-same-row": (1, np.zeros(N, np.int32)),
        "uniform-399-rows": (399, rng.integers(0, 399, N).astype(np.int32)),
        "zipf-100k-rows": (100_000, zipf_ids(rng, 100_000, (N,))),
    }
    methods = {
        "scatter_add": lambda u, i, s: jnp.zeros((s, w), jnp.float32).at[i].add(u),
        "segment_sum": lambda u, i, s: jax.ops.segment_sum(u, i, num_segments=s),
        "sort_then_segment_sum": lambda u, i, s: jax.ops.segment_sum(
            u[jnp.argsort(i)], jnp.sort(i), num_segments=s, indices_are_sorted=True
        ),
        "sort_scan_no_atomics": sort_segment_sum,
    }
    res = {"device": info, "ftz_atomics": flag, "updates": N, "width": w, "ms": {}, "max_err": {}}
    for cname, (segs, ids_np) in cases.items():
        ref = np.zeros((segs, w))
        np.add.at(ref, ids_np, upd_np.astype(np.float64))
        tol = 1e-4 * max(1.0, float(np.abs(ref).max()))
        ids = jnp.asarray(ids_np)
        res["ms"][cname], res["max_err"][cname] = {}, {}
        for mname, m in methods.items():
            f = jax.jit(m, static_argnums=2)
            got = np.asarray(f(upd, ids, segs))
            err = float(np.abs(got - ref).max())
            t, reps = timed(f, upd, ids, segs, reps=10, budget_s=4.0)
            res["ms"][cname][mname] = 1e3 * t
            res["max_err"][cname][mname] = err
            ok = "ok" if err <= tol else f"WRONG (tolerance {tol:.1e})"
            out(f"    {cname:17s} {mname:22s} {1e3 * t:10.3f} ms  ({reps} runs, max err {err:.1e} {ok})")
    return res


def compare_scatter(path_off: str, path_on: str):
    off, on = json.loads(Path(path_off).read_text()), json.loads(Path(path_on).read_text())
    out(f"(b) summary: median ms without / with {FTZ_OPTION}, and the sort-based version (no atomics)")
    out(f"    {'ids':17s} {'method':22s} {'flag off':>10s} {'flag on':>10s} {'off/on':>8s}")
    for cname, row in off["ms"].items():
        for mname, t_off in row.items():
            t_on = on["ms"][cname][mname]
            out(f"    {cname:17s} {mname:22s} {t_off:10.3f} {t_on:10.3f} {t_off / t_on:8.1f}x")


# ---------------------------------------------------------------------------- (c) ragged all-to-all


def part_ragged(quick: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    info = device_info()
    n = jax.device_count()
    rows_per_dev, w = (64, 8) if quick else (1 << 18, 64)
    out(
        f"(c) ragged_all_to_all over {n} device(s) ({info['backend']}), up to {rows_per_dev:,} rows x {w} f32 "
        "per device" + (": one device, so each device exchanges with itself (no link traffic)" if n == 1 else "")
    )
    rng = np.random.default_rng(2)
    # send[i, j]: rows device i sends to device j; device i's operand holds them back to back by j.
    send = rng.integers(0, rows_per_dev // n + 1, (n, n)).astype(np.int32)
    send = np.minimum(send, rows_per_dev // n)
    in_off = np.concatenate([np.zeros((n, 1), np.int32), np.cumsum(send, 1)[:, :-1]], 1).astype(np.int32)
    recv = send.T.copy()  # recv[j, i] = send[i, j]
    # Where device i's slice lands on device j: after the slices of devices < i.
    out_off_recv = np.concatenate([np.zeros((n, 1), np.int32), np.cumsum(recv, 1)[:, :-1]], 1)  # [j, i]
    out_off = out_off_recv.T.copy().astype(np.int32)  # [i, j]
    operand = np.zeros((n, rows_per_dev, w), np.float32)
    for i in range(n):
        operand[i, : send[i].sum()] = rng.normal(size=(send[i].sum(), w))
    expected = np.zeros_like(operand)
    for j in range(n):
        for i in range(n):
            src = operand[i, in_off[i, j] : in_off[i, j] + send[i, j]]
            expected[j, out_off_recv[j, i] : out_off_recv[j, i] + recv[j, i]] = src
    mesh = jax.make_mesh((n,), ("x",))
    spec = P("x")

    def body(op, io, ss, oo, rs):
        res = jax.lax.ragged_all_to_all(op[0], jnp.zeros_like(op[0]), io[0], ss[0], oo[0], rs[0], axis_name="x")
        return res[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec))
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (operand, in_off, send, out_off, recv)]
    res = {"device": info, "devices": n, "rows_per_device": rows_per_dev, "width": w}
    try:
        got = np.asarray(fn(*args))
    except Exception as e:  # XLA:CPU has no ragged-all-to-all thunk (jax 0.10.2): reported, not hidden
        msg = str(e).strip().splitlines()[0][:300]
        out(f"    NOT SUPPORTED on {info['backend']}: {type(e).__name__}: {msg}")
        res.update(supported=False, error=f"{type(e).__name__}: {msg}")
        return res
    err = float(np.abs(got - expected).max())
    t, reps = timed(fn, *args, reps=20)
    moved = int(send.sum()) * w * 4
    res.update(supported=True, max_err=err, ms=1e3 * t, bytes=moved, bytes_per_s=moved / t)
    out(
        f"    {'correct' if err == 0 else f'WRONG (max err {err})'}; {1e3 * t:.3f} ms for {moved / 2**20:.1f} MiB "
        f"({moved / t / 1e9:.1f} GB/s, {reps} runs)"
    )
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", required=True, choices=["lookup", "scatter", "ragged", "compare-scatter"])
    p.add_argument("files", nargs="*", help="compare-scatter: the JSON of the run without, then with the flag")
    p.add_argument("--quick", action="store_true", help="small shapes (any backend)")
    p.add_argument("--json-out", help="also write the part's JSON here")
    args = p.parse_args(argv)
    if args.part == "compare-scatter":
        if len(args.files) != 2:
            p.error("compare-scatter takes two JSON files: without the flag, with the flag")
        compare_scatter(*args.files)
        return 0
    import jax

    if not args.quick and jax.default_backend() != "gpu":
        print(f"this check needs a GPU (JAX backend is {jax.default_backend()!r}); use --quick on CPU", file=sys.stderr)
        return 2
    res = {"lookup": part_lookup, "scatter": part_scatter, "ragged": part_ragged}[args.part](args.quick)
    line = json.dumps(res)
    if args.json_out:
        Path(args.json_out).write_text(line)
    out("JSON " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
