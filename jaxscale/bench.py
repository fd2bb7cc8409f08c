"""The benchmark suite: jaxscale beside FBGEMM/TorchRec and NumPy, interleaved in one run.

    python -m jaxscale.bench                 # full run (~5-10 min on 2 shared cores)
    python -m jaxscale.bench --quick         # smaller shapes and fewer configurations (~2 min)
    python -m jaxscale.bench --json out.json

Three parts, printed as Markdown tables (and written as JSON with --json):

1. Lookup+update on ONE device, same table, same Zipf ids, same per-bag gradients, same initial weights:
   jaxscale (mesh 1x1, sparse RowWiseAdagrad, one jitted donated step) vs FBGEMM's CPU TBE kernel
   (`SplitTableBatchedEmbeddingBagsCodegen`, fused EXACT_ROWWISE_ADAGRAD: the kernel TorchRec runs
   unsharded; in a persistent subprocess, torch and JAX never share a process) vs NumPy (fancy-index
   gather+sum; and a gather+sum+unique/add.at AdaGrad step). Rounds alternate one step of each engine
   (order rotated every round); medians. After the last round the touched rows of all three tables are
   compared (they must agree: the check fails the run otherwise). This process runs JAX with 1 CPU
   device (`jax_num_cpu_devices=1`, set before JAX starts).
2. The distributed lookup+update step at one global batch: jaxscale on 8 simulated CPU devices (subprocess,
   1x8 mesh, `1d`, row_wise / table_wise / column_wise x fp32 / bf16 / fp8 payloads) vs TorchRec
   `DistributedModelParallel` on 2 and 4 gloo ranks (row_wise / table_wise / column_wise x fp32 / fp16,
   `experiments/baselines/torchrec_runner.py`). Blocks alternate: jaxscale (every config round-robin),
   TorchRec (every job), jaxscale, TorchRec. Bytes per step per collective: jaxscale from the compiled
   HLO (`jaxscale.comm_inspect`), TorchRec counted from the torch.distributed collectives it calls; both
   under the same byte model (what leaves a device: all-to-all (W-1)/W of the input, reduce-scatter
   (W-1)/W of the input, all-gather (W-1) x input, all-reduce 2(W-1)/W x input).
3. Comm bytes per example of the foundation smoke config's embedding step on a 2x4 mesh, per technique
   stage (1d fp32 -> fp8 -> half_dim -> 2d_ar -> 2d_a2a, cumulative), from the compiled HLO, split
   intra-/inter-node (`jaxscale.comm_report.split_bytes` when present).

CPU wall-clock on a shared machine is only comparable within one run: the ratios matter, not the
absolute times. Simulated devices share the same cores, so the 8-device times measure work, not a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RUNNER_DIR = REPO / "experiments" / "baselines"
FOUNDATION_CONFIG = REPO / "experiments" / "configs" / "foundation_smoke.yaml"
SHARDINGS = ("row_wise", "table_wise", "column_wise")
LR, EPS = 0.01, 1e-8
NOTE = (
    "CPU wall-clock times on a shared 2-core machine are only comparable within one run (ratios, not "
    "absolute times); the 8 simulated JAX devices and the gloo ranks share the same cores, so the "
    "distributed step times measure total work plus overhead, not a cluster's speed. Bytes are exact."
)

# Byte model applied to TorchRec's counted collectives (same as jaxscale.comm_inspect's for jaxscale).
_OFFRANK = {
    "all_to_all_single": lambda b, w: b * (w - 1) / w,
    "all_to_all": lambda b, w: b * (w - 1) / w,
    "reduce_scatter_tensor": lambda b, w: b * (w - 1) / w,
    "reduce_scatter": lambda b, w: b * (w - 1) / w,
    "all_gather_into_tensor": lambda b, w: b * (w - 1),
    "all_gather": lambda b, w: b * (w - 1),
    "all_gather_tensor": lambda b, w: b * (w - 1),
    "all_reduce": lambda b, w: 2 * b * (w - 1) / w,
    "all_reduce_coalesced": lambda b, w: 2 * b * (w - 1) / w,
    "allreduce_coalesced": lambda b, w: 2 * b * (w - 1) / w,
    "broadcast": lambda b, w: b * (w - 1),
}


# ----------------------------------------------------------------------------------------------- helpers


def sizes(quick: bool) -> dict:
    if quick:
        return dict(
            p1=dict(rows=100_000, dim=64, batch=1024, hotness=20, warmup=2, rounds=8),
            p2=dict(tables=4, rows=5_000, dim=64, batch=256, hotness=8, warmup=2, rounds=4, tr_steps=6, blocks=2),
            jax_configs=[("row_wise", "fp32"), ("table_wise", "fp32"), ("row_wise", "fp8"), ("row_wise", "fp32", 2.0)],
            tr_configs=[(2, "row_wise", "fp32"), (2, "table_wise", "fp32"), (4, "row_wise", "fp32")],
            zipf=1.1,
        )
    return dict(
        p1=dict(rows=1_000_000, dim=64, batch=4096, hotness=20, warmup=3, rounds=15),
        p2=dict(tables=8, rows=20_000, dim=64, batch=1024, hotness=10, warmup=2, rounds=6, tr_steps=6, blocks=2),
        jax_configs=[(s, p) for s in SHARDINGS for p in ("fp32", "bf16", "fp8")] + [("row_wise", "fp32", 2.0)],
        tr_configs=[(w, s, p) for w in (2, 4) for s in SHARDINGS for p in ("fp32", "fp16")],
        zipf=1.1,
    )


def zipf_ids(rng, rows: int, shape, a: float) -> np.ndarray:
    """Zipf ranks scattered over the table by a multiplicative hash (hot rows are not adjacent)."""
    rank = rng.zipf(a, size=shape).astype(np.int64) - 1
    return ((rank * 2654435761) % rows).astype(np.int32)


def med_ms(ts) -> float:
    return 1e3 * statistics.median(ts) if ts else float("nan")


def machine() -> dict:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = None
    try:
        load = os.getloadavg()
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {
        "cpu_model": model,
        "nproc": os.cpu_count(),
        "memory": mem,
        "loadavg_at_start": load,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
    }


def _child_env(devices: int | None = None) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if devices:
        env["JAXSCALE_BENCH_DEVICES"] = str(devices)
    return env


class Worker:
    """A persistent `python -m jaxscale.bench --_worker KIND SPEC` subprocess; JSON lines both ways."""

    def __init__(self, kind: str, spec_path: str, env: dict, timeout_s: float = 600):
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxscale.bench", "--_worker", kind, spec_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=sys.stderr,
            text=True,
            env=env,
            cwd=str(REPO),
            bufsize=1,
        )
        self.kind = kind

    def read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.kind} worker exited (rc={self.proc.poll()}) before answering")
            if line.startswith("@@"):
                msg = json.loads(line[2:])
                if "error" in msg:
                    raise RuntimeError(f"{self.kind} worker failed: {msg['error']}")
                return msg

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self):
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
        except Exception:  # noqa: BLE001
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _reply(**msg):
    print("@@" + json.dumps(msg), flush=True)


def _serve(handlers: dict):
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            return
        try:
            _reply(**handlers[cmd["op"]](cmd))
        except Exception as e:  # noqa: BLE001
            import traceback

            _reply(error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            return


def log(msg: str):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------- part 1: one device, 3 engines


def numpy_step(W, acc, ids, G, lr=LR, eps=EPS):
    """FBGEMM EXACT_ROWWISE_ADAGRAD in NumPy: gather+sum, then the summed gradient of each touched row."""
    out = W[ids].sum(1)
    uniq, inv = np.unique(ids.reshape(-1), return_inverse=True)
    g = np.zeros((len(uniq), W.shape[1]), np.float32)
    np.add.at(g, inv, np.repeat(G, ids.shape[1], axis=0))
    acc[uniq] += (g * g).mean(1)
    W[uniq] -= lr * g / (np.sqrt(acc[uniq])[:, None] + eps)
    return out


def part1(cfg: dict, zipf: float, tmp: str) -> dict:
    import jax
    import jax.numpy as jnp

    import jaxscale

    assert jax.device_count() == 1, f"part 1 needs 1 JAX device, got {jax.device_count()}"
    rows, dim, B, L = cfg["rows"], cfg["dim"], cfg["batch"], cfg["hotness"]
    rng = np.random.default_rng(1)
    ids = zipf_ids(rng, rows, (B, L), zipf)
    G = rng.normal(size=(B, dim)).astype(np.float32)
    table = jaxscale.TableConfig("t", rows=rows, dim=dim, pooling="sum", features=("f",))
    ec = jaxscale.EmbeddingCollection(
        [table],
        jaxscale.make_mesh(1, 1, devices=jax.devices()[:1]),
        topology="1d",
        sharding="row_wise",
        optimizer=jaxscale.RowWiseAdagrad(LR, eps=EPS),
    )
    state = ec.init(jax.random.key(0))
    W0 = ec.to_dense(state)["t"]
    np.save(os.path.join(tmp, "p1_table.npy"), W0)
    np.save(os.path.join(tmp, "p1_ids.npy"), ids)
    np.save(os.path.join(tmp, "p1_grad.npy"), G)

    def step(state, ids, G):
        emb = ec.lookup(state, ids)
        return ec.update(state, ids, {"f": G}), emb["f"]

    ids_dev = ec.shard_batch({"f": ids})
    G_dev = jax.device_put(jnp.asarray(G), ec.batch_sharding)
    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=0).lower(state, ids_dev, G_dev).compile()
    compile_s = time.perf_counter() - t0
    W_np, acc_np, W_lookup = W0.copy(), np.zeros(rows, np.float32), W0.copy()

    spec = os.path.join(tmp, "p1_spec.json")
    Path(spec).write_text(json.dumps({"dir": tmp, "rows": rows, "dim": dim}))
    fb = Worker("fbgemm", spec, _child_env())
    try:
        info = fb.read()
        log(
            f"part 1: jaxscale compiled in {compile_s:.1f} s; fbgemm ready ({info['torch']}, {info['threads']} threads)"
        )
        times = {"jaxscale": [], "fbgemm": [], "numpy_step": [], "numpy_lookup": []}
        out_check = {}

        def run_jax():
            nonlocal state
            t = time.perf_counter()
            state, out = compiled(state, ids_dev, G_dev)
            jax.block_until_ready((state, out))
            return time.perf_counter() - t, out

        def run_fb():
            return fb.ask(op="step", n=1)["times"][0], None

        def run_np_step():
            t = time.perf_counter()
            out = numpy_step(W_np, acc_np, ids, G)
            return time.perf_counter() - t, out

        def run_np_lookup():
            t = time.perf_counter()
            out = W_lookup[ids].sum(1)
            return time.perf_counter() - t, out

        engines = [
            ("jaxscale", run_jax),
            ("fbgemm", run_fb),
            ("numpy_step", run_np_step),
            ("numpy_lookup", run_np_lookup),
        ]
        for r in range(cfg["warmup"] + cfg["rounds"]):
            order = engines[r % len(engines) :] + engines[: r % len(engines)]
            for name, fn in order:
                dt, out = fn()
                if r == 0 and out is not None:
                    out_check[name] = np.asarray(out)
                if r >= cfg["warmup"]:
                    times[name].append(dt)
        steps = cfg["warmup"] + cfg["rounds"]
        # Same initial table, ids, gradients and number of steps: the touched rows must agree.
        uniq = np.unique(ids)
        np.save(os.path.join(tmp, "p1_uniq.npy"), uniq)
        fb_rows = np.load(fb.ask(op="rows", path=os.path.join(tmp, "p1_uniq.npy"))["path"])
    finally:
        fb.close()
    jax_rows = ec.to_dense(state)["t"][uniq]
    np_rows = W_np[uniq]
    ref_out = W0[ids].sum(1)
    check = {
        "steps_each": steps,
        "touched_rows": int(len(uniq)),
        "max_abs_diff_jaxscale_vs_fbgemm": float(np.abs(jax_rows - fb_rows).max()),
        "max_abs_diff_jaxscale_vs_numpy": float(np.abs(jax_rows - np_rows).max()),
        "max_abs_diff_first_output_jaxscale_vs_numpy": float(np.abs(out_check["jaxscale"] - ref_out).max()),
        "fbgemm_first_output_vs_numpy": info["fwd_err"],
        "max_rows_moved": float(np.abs(jax_rows - W0[uniq]).max()),
    }
    tol = 1e-4 * max(1.0, float(np.abs(np_rows).max()))
    check["ok"] = bool(
        check["max_abs_diff_jaxscale_vs_fbgemm"] <= tol
        and check["max_abs_diff_jaxscale_vs_numpy"] <= tol
        and check["max_abs_diff_first_output_jaxscale_vs_numpy"] <= tol
        and info["fwd_err"] <= tol
        and check["max_rows_moved"] > 0
    )
    med = {k: med_ms(v) for k, v in times.items()}
    ids_per_step = B * L
    return {
        "shape": {"rows": rows, "dim": dim, "batch": B, "hotness": L, "zipf": zipf, "distinct_ids": int(len(uniq))},
        "median_ms": med,
        "all_ms": {k: [round(1e3 * x, 3) for x in v] for k, v in times.items()},
        "ids_per_s": {k: ids_per_step / (m / 1e3) for k, m in med.items()},
        "speedup_jaxscale_over_fbgemm": med["fbgemm"] / med["jaxscale"],
        "speedup_jaxscale_over_numpy_step": med["numpy_step"] / med["jaxscale"],
        "jaxscale_compile_s": compile_s,
        "fbgemm": info,
        "jax": jax.__version__,
        "jax_devices": jax.device_count(),
        "check": check,
    }


def _fbgemm_worker(spec_path: str):
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    spec = json.loads(Path(spec_path).read_text())
    d = spec["dir"]
    W0 = np.load(os.path.join(d, "p1_table.npy"))
    ids = np.load(os.path.join(d, "p1_ids.npy")).astype(np.int64)
    G = torch.from_numpy(np.load(os.path.join(d, "p1_grad.npy")))
    B, L = ids.shape
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(spec["rows"], spec["dim"], EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM,
    )
    w = tbe.split_embedding_weights()[0]
    with torch.no_grad():
        w.copy_(torch.from_numpy(W0))
    idx = torch.from_numpy(ids.reshape(-1))
    off = torch.arange(0, B * L + 1, L, dtype=torch.int64)
    with torch.no_grad():
        fwd_err = float(np.abs(tbe(idx, off).numpy() - W0[ids].sum(1)).max())  # no step taken
    import fbgemm_gpu

    _reply(
        torch=torch.__version__,
        fbgemm=getattr(fbgemm_gpu, "__version__", "?"),
        threads=torch.get_num_threads(),
        fwd_err=fwd_err,
        kernel="SplitTableBatchedEmbeddingBagsCodegen(HOST/CPU, EXACT_ROWWISE_ADAGRAD, SUM)",
    )

    def step(cmd):
        ts = []
        for _ in range(int(cmd["n"])):
            t = time.perf_counter()
            out = tbe(idx, off)
            out.backward(G)  # the fused optimizer updates the touched rows here
            ts.append(time.perf_counter() - t)
        return {"times": ts}

    def rows(cmd):
        uniq = np.load(cmd["path"])
        path = cmd["path"] + ".fbgemm.npy"
        np.save(path, w.detach().numpy()[uniq])
        return {"path": path}

    _serve({"step": step, "rows": rows})


# ------------------------------------------------------------ part 2 + 3: the 8-device jaxscale worker


def _cname(sharding, prec, cf=None) -> str:
    return f"{sharding}/{prec}" + (f"/cf{cf:g}" if cf else "")


def _dist_worker(spec_path: str):
    import jax

    jax.config.update("jax_num_cpu_devices", int(os.environ.get("JAXSCALE_BENCH_DEVICES", "8")))
    import jax.numpy as jnp

    import jaxscale
    from jaxscale import comm_inspect

    spec = json.loads(Path(spec_path).read_text())
    data = np.load(spec["data"])
    n_tables, rows, dim = spec["tables"], spec["rows"], spec["dim"]
    tables = [
        jaxscale.TableConfig(f"t{i}", rows=rows, dim=dim, pooling="sum", features=(f"f{i}",)) for i in range(n_tables)
    ]
    mesh = jaxscale.make_mesh(1, jax.device_count())
    setups = []
    for sharding, prec, *cf in spec["configs"]:
        cf = cf[0] if cf else None
        ec = jaxscale.EmbeddingCollection(
            tables,
            mesh,
            topology="1d",
            sharding=sharding,
            optimizer=jaxscale.RowWiseAdagrad(LR, eps=EPS),
            comm=jaxscale.CommConfig(forward=prec, backward=prec),
            capacity_factor=cf,
        )
        state = ec.init(jax.random.key(0))
        ids = ec.shard_batch({f"f{i}": data[f"ids{i}"] for i in range(n_tables)})
        G = {f"f{i}": jax.device_put(jnp.asarray(data[f"g{i}"]), ec.batch_sharding) for i in range(n_tables)}

        def step(state, ids, G, ec=ec):
            emb, stats = ec.lookup(state, ids, return_stats=True)
            return ec.update(state, ids, G), (emb, stats["overflow"])

        t0 = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=0).lower(state, ids, G).compile()
        state, (_, overflow) = compiled(state, ids, G)
        overflow = int(np.asarray(overflow).sum())
        compile_s = time.perf_counter() - t0
        cs = comm_inspect.list_collectives(compiled, mesh=mesh)
        per = {}
        for c in cs:
            key = f"{c.kind}[{'/'.join(sorted(set(c.dtypes)))}]"
            e = per.setdefault(key, {"count": 0, "bytes_per_device": 0.0})
            e["count"] += 1
            e["bytes_per_device"] += c.bytes_per_device
        total = sum(c.bytes_per_device for c in cs)
        setups.append(
            {
                "name": _cname(sharding, prec, cf),
                "compiled": compiled,
                "state": state,
                "ids": ids,
                "G": G,
                "info": {
                    "sharding": sharding,
                    "precision": prec,
                    "capacity_factor": cf,
                    "overflow_rows": overflow,
                    "compile_s": compile_s,
                    "collectives": per,
                    "bytes_per_device": total,
                    "bytes_cluster": total * jax.device_count(),
                },
            }
        )
        print(f"[dist worker] compiled {_cname(sharding, prec, cf)} in {compile_s:.1f} s", file=sys.stderr, flush=True)
    stages = foundation_stages(spec.get("stages", ()))
    _reply(devices=jax.device_count(), jax=jax.__version__, configs=[s["info"] for s in setups], stages=stages)

    def block(cmd):
        times = {s["name"]: [] for s in setups}
        warm, rounds = int(cmd.get("warmup", 0)), int(cmd["rounds"])
        for r in range(warm + rounds):
            for s in setups if r % 2 == 0 else setups[::-1]:  # round-robin, order flipped every round
                t = time.perf_counter()
                s["state"], out = s["compiled"](s["state"], s["ids"], s["G"])
                jax.block_until_ready((s["state"], out))
                if r >= warm:
                    times[s["name"]].append(time.perf_counter() - t)
        return {"times": times}

    _serve({"block": block})


STAGES = (
    ("1d fp32", ["embedding.topology=1d", "embedding.comm_forward=fp32", "embedding.comm_backward=fp32"]),
    ("+ fp8", ["embedding.topology=1d", "embedding.comm_forward=fp8", "embedding.comm_backward=fp8"]),
    (
        "+ half_dim",
        [
            "embedding.topology=1d",
            "embedding.comm_forward=fp8",
            "embedding.comm_backward=fp8",
            "model.foundation.item_reshape=half_dim",
        ],
    ),
    (
        "+ 2d_ar",
        [
            "embedding.topology=2d_ar",
            "embedding.comm_forward=fp8",
            "embedding.comm_backward=fp8",
            "model.foundation.item_reshape=half_dim",
        ],
    ),
    (
        "+ 2d_a2a",
        [
            "embedding.topology=2d_a2a",
            "embedding.comm_forward=fp8",
            "embedding.comm_backward=fp8",
            "model.foundation.item_reshape=half_dim",
        ],
    ),
)


def foundation_stages(names) -> list:
    """Embedding-step bytes per example of the foundation smoke config on a 2x4 mesh, per technique stage.

    Compiles the embedding part of the train step (lookup, then update with d(loss)/d(emb) = emb) with the
    config's tables, batch and collection, and reads its collectives from the compiled HLO. The dense
    model's gradient all-reduce and its in-batch-negative gathers do not change across these stages
    (`python -m jaxscale.comm_report` shows them for the whole step)."""
    if not names:
        return []
    import jax

    from jaxscale import comm_inspect
    from jaxscale.config import load_config
    from jaxscale.data import make_data, to_global
    from jaxscale.mesh import make_mesh
    from jaxscale.trainer import make_collection, make_task

    try:
        from jaxscale import comm_report as cr
    except ImportError:  # pragma: no cover - comm_report is optional
        cr = None
    out = []
    for name, overrides in STAGES:
        if name not in names:
            continue
        cfg = load_config(str(FOUNDATION_CONFIG), ["mesh.nodes=2", "mesh.local=4", *overrides])
        mesh = make_mesh(2, 4, devices=jax.devices()[:8])
        task = make_task(cfg)
        batch = to_global(make_data(cfg, split="train").batch(0), mesh)
        ids = task.ids(batch)
        ec = make_collection(cfg, mesh, task.tables)
        state = ec.init(jax.random.key(0))

        def step(state, ids, ec=ec):
            emb = ec.lookup(state, ids)
            return ec.update(state, ids, emb)

        t0 = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=0).lower(state, ids).compile()
        cs = comm_inspect.list_collectives(compiled, mesh=mesh)
        intra = inter = 0.0
        cats: dict = {}
        for c in cs:
            if cr is not None:
                a, b = cr.split_bytes(c, tuple(mesh.devices.shape))
                cat = cr.categorize(c, cr._replica_groups(mesh, cfg.embedding.topology))
            else:
                a, b = (0.0, c.bytes_per_device) if c.cross_node else (c.bytes_per_device, 0.0)
                cat = c.kind
            intra, inter = intra + a, inter + b
            cats[cat] = cats.get(cat, 0.0) + (a + b) * 8 / cfg.train.batch_size
        gb = cfg.train.batch_size
        out.append(
            {
                "stage": name,
                "overrides": overrides,
                "global_batch": gb,
                "collectives": len(cs),
                "intra_node_bytes_per_example": intra * 8 / gb,
                "inter_node_bytes_per_example": inter * 8 / gb,
                "total_bytes_per_example": (intra + inter) * 8 / gb,
                "by_category_per_example": cats,
                "split": "comm_report.split_bytes" if cr is not None else "comm_inspect whole-collective",
                "compile_s": time.perf_counter() - t0,
            }
        )
        print(f"[dist worker] stage {name}: {(intra + inter) * 8 / gb:,.0f} B/example", file=sys.stderr, flush=True)
    return out


def torchrec_bytes(res: dict, world: int) -> dict:
    """{op[dtype]: off-rank bytes per step summed over ranks} from the runner's counted collectives."""
    out: dict = {}
    for rank_steps in res["comm"]:
        last = rank_steps[-1]
        for key, v in last.items():
            op = key.split("[")[0]
            if op in ("all_to_all_single", "all_to_all") and v.get("offrank_bytes"):
                b = float(v["offrank_bytes"])
            else:
                b = _OFFRANK.get(op, lambda x, w: x)(float(v["bytes"]), world)
            out[key] = out.get(key, 0.0) + b
    return out


def part2_and_3(p: dict, jax_configs, tr_configs, zipf: float, tmp: str, stages) -> tuple[dict, list]:
    sys.path.insert(0, str(RUNNER_DIR))
    from torchrec_runner import run_torchrec_subprocess

    rng = np.random.default_rng(2)
    T, R, D, B, L = p["tables"], p["rows"], p["dim"], p["batch"], p["hotness"]
    arrays = {}
    for i in range(T):
        arrays[f"ids{i}"] = zipf_ids(rng, R, (B, L), zipf)
        arrays[f"g{i}"] = rng.normal(size=(B, D)).astype(np.float32)
    np.savez(os.path.join(tmp, "p2.npz"), **arrays)
    spec = os.path.join(tmp, "p2_spec.json")
    Path(spec).write_text(
        json.dumps(
            {
                "data": os.path.join(tmp, "p2.npz"),
                "tables": T,
                "rows": R,
                "dim": D,
                "configs": jax_configs,
                "stages": [s for s, _ in STAGES if s in stages],
            }
        )
    )
    t0 = time.perf_counter()
    worker = Worker("dist", spec, _child_env(devices=8))
    try:
        ready = worker.read()
        log(f"part 2: jaxscale 8-device configs compiled ({time.perf_counter() - t0:.0f} s incl. part 3)")
        tables = [{"name": f"t{i}", "rows": R, "dim": D, "pooling": "sum", "features": [f"f{i}"]} for i in range(T)]
        weights = {f"t{i}": rng.normal(scale=0.01, size=(R, D)).astype(np.float32) for i in range(T)}
        batch = {f"f{i}": arrays[f"ids{i}"] for i in range(T)}
        grads = {f"f{i}": arrays[f"g{i}"] for i in range(T)}
        jobs = [
            dict(
                tables=tables,
                weights=weights,
                batches=[batch] * p["tr_steps"],
                grads=grads,
                sharding=s,
                world_size=w,
                optimizer="rowwise_adagrad",
                lr=LR,
                eps=EPS,
                qcomms=q,
            )
            for w, s, q in tr_configs
        ]
        jax_times = {_cname(*c): [] for c in jax_configs}
        tr_times = [[] for _ in tr_configs]
        tr_bytes = [None] * len(tr_configs)
        tr_err = [None] * len(tr_configs)
        for b in range(p["blocks"]):
            got = worker.ask(op="block", rounds=p["rounds"], warmup=p["warmup"] if b == 0 else 1)["times"]
            for k, v in got.items():
                jax_times[k] += v
            log(f"part 2: block {b + 1}/{p['blocks']} jaxscale done; TorchRec ({len(jobs)} jobs)")
            results = run_torchrec_subprocess(jobs=jobs, timeout_s=900)
            for j, res in enumerate(results):
                if "error" in res:
                    tr_err[j] = res["error"][:300]
                    continue
                times = np.array(res["step_times"]).max(0)[2:]  # max over ranks; first 2 steps are warm-up
                tr_times[j] += times.tolist()
                tr_bytes[j] = torchrec_bytes(res, tr_configs[j][0])
    finally:
        worker.close()
    jax_rows = []
    for info in ready["configs"]:
        name = _cname(info["sharding"], info["precision"], info["capacity_factor"])
        jax_rows.append(info | {"median_ms": med_ms(jax_times[name]), "n": len(jax_times[name])})
    tr_rows = []
    for (w, s, q), ts, by, err in zip(tr_configs, tr_times, tr_bytes, tr_err):
        tr_rows.append(
            {
                "world": w,
                "sharding": s,
                "precision": q,
                "median_ms": med_ms(ts),
                "n": len(ts),
                "collectives": by,
                "bytes_cluster": sum(by.values()) if by else None,
                "error": err,
            }
        )
    return {
        "shape": {
            "tables": T,
            "rows": R,
            "dim": D,
            "global_batch": B,
            "hotness": L,
            "zipf": zipf,
            "jax_devices": ready["devices"],
        },
        "jaxscale": jax_rows,
        "torchrec": tr_rows,
        "jax": ready["jax"],
    }, ready["stages"]


# ----------------------------------------------------------------------------------------------- report

TR_PRECISION = {"fp32": "fp32", "bf16": "fp16", "fp8": "fp16"}  # the TorchRec run each jaxscale precision meets


def comparisons(p2: dict) -> list:
    rows = []
    for j in p2["jaxscale"]:
        want = TR_PRECISION[j["precision"]]
        for t in p2["torchrec"]:
            if t["sharding"] != j["sharding"] or t["precision"] != want or t["error"]:
                continue
            rows.append(
                {
                    "sharding": j["sharding"],
                    "jaxscale_precision": j["precision"],
                    "capacity_factor": j["capacity_factor"],
                    "torchrec_precision": t["precision"],
                    "torchrec_world": t["world"],
                    "jaxscale_ms": j["median_ms"],
                    "torchrec_ms": t["median_ms"],
                    "time_ratio": j["median_ms"] / t["median_ms"],
                    "jaxscale_bytes_cluster": j["bytes_cluster"],
                    "torchrec_bytes_cluster": t["bytes_cluster"],
                    "bytes_ratio": j["bytes_cluster"] / t["bytes_cluster"] if t["bytes_cluster"] else None,
                }
            )
    return rows


def _fmt_coll(d: dict) -> str:
    if not d:
        return "-"
    return "; ".join(f"{k} {v['bytes_per_device'] if isinstance(v, dict) else v:,.0f}" for k, v in sorted(d.items()))


def markdown(res: dict) -> str:
    L = [
        f"# jaxscale benchmark suite{' (--quick)' if res['quick'] else ''}",
        "",
        f"Command: `{res['command']}`  ",
        f"Machine: {res['machine']['cpu_model']}, {res['machine']['nproc']} cores, "
        f"{res['machine']['memory']}, load average at start {res['machine']['loadavg_at_start']}; "
        f"{res['machine']['platform']}, Python {res['machine']['python']}, jax {res.get('jax', '?')}, "
        f"numpy {res['machine']['numpy']}.  ",
        f"Wall time of the run: {res['wall_s']:.0f} s.",
        "",
        f"**{NOTE}**",
        "",
    ]
    p1 = res.get("part1")
    if p1:
        s, m, c = p1["shape"], p1["median_ms"], p1["check"]
        L += [
            "## 1. Lookup+update on one device (interleaved rounds, medians)",
            "",
            f"Table {s['rows']:,} x {s['dim']} fp32, {s['batch']} bags x {s['hotness']} Zipf({s['zipf']}) ids "
            f"({s['distinct_ids']:,} distinct), sum pooling, row-wise AdaGrad (lr {LR}, eps {EPS}); "
            f"{len(p1['all_ms']['jaxscale'])} timed rounds. FBGEMM: {p1['fbgemm']['kernel']}, torch "
            f"{p1['fbgemm']['torch']}, fbgemm-gpu-cpu {p1['fbgemm']['fbgemm']}, {p1['fbgemm']['threads']} threads. "
            f"JAX: {p1['jax_devices']} CPU device.",
            "",
            "| engine | what | median ms | M ids/s | jaxscale speed-up |",
            "|---|---|---:|---:|---:|",
        ]
        what = {
            "jaxscale": "lookup + sparse update (jit, donated)",
            "fbgemm": "TBE forward + fused backward",
            "numpy_step": "gather+sum + unique/add.at AdaGrad",
            "numpy_lookup": "gather+sum only",
        }
        for k in ("jaxscale", "fbgemm", "numpy_step", "numpy_lookup"):
            L.append(f"| {k} | {what[k]} | {m[k]:.1f} | {p1['ids_per_s'][k] / 1e6:.2f} | {m[k] / m['jaxscale']:.2f}x |")
        L += [
            "",
            f"jaxscale vs FBGEMM: **{p1['speedup_jaxscale_over_fbgemm']:.2f}x** "
            f"({'faster' if p1['speedup_jaxscale_over_fbgemm'] >= 1 else 'slower'}; >1 = jaxscale faster). "
            f"Correctness after {c['steps_each']} steps each from the same table: max |jaxscale - FBGEMM| "
            f"{c['max_abs_diff_jaxscale_vs_fbgemm']:.2e}, max |jaxscale - NumPy| "
            f"{c['max_abs_diff_jaxscale_vs_numpy']:.2e} over {c['touched_rows']:,} touched rows (rows moved up to "
            f"{c['max_rows_moved']:.2e}): {'OK' if c['ok'] else 'MISMATCH'}.",
            "",
        ]
    p2 = res.get("part2")
    if p2:
        s = p2["shape"]
        L += [
            "## 2. Distributed step at the same global batch",
            "",
            f"{s['tables']} tables x {s['rows']:,} x {s['dim']}, sum pooling, global batch {s['global_batch']} x "
            f"{s['hotness']} Zipf ids per table, row-wise AdaGrad. jaxscale: {s['jax_devices']} simulated CPU "
            f"devices (1x8 mesh, 1d). TorchRec: DMP over gloo (fused TBE). Median step ms (TorchRec: max over ranks). "
            f"Bytes: what leaves a device per step, summed over the cluster.",
            "",
            "| engine | devices | sharding | payload | median ms | bytes/step (cluster) | per collective (cluster bytes) |",  # noqa: E501
            "|---|---:|---|---|---:|---:|---|",
        ]
        for j in p2["jaxscale"]:
            per = {k: v["bytes_per_device"] * s["jax_devices"] for k, v in j["collectives"].items()}
            cf = f" cf {j['capacity_factor']:g} (overflow {j['overflow_rows']})" if j["capacity_factor"] else ""
            L.append(
                f"| jaxscale | {s['jax_devices']} | {j['sharding']} | {j['precision']}{cf} | {j['median_ms']:.1f} | "
                f"{j['bytes_cluster']:,.0f} | {_fmt_coll(per)} |"
            )
        for t in p2["torchrec"]:
            if t["error"]:
                L.append(
                    f"| TorchRec | {t['world']} | {t['sharding']} | {t['precision']} | failed | - | {t['error'][:80]} |"
                )
                continue
            L.append(
                f"| TorchRec | {t['world']} | {t['sharding']} | {t['precision']} | {t['median_ms']:.1f} | "
                f"{t['bytes_cluster']:,.0f} | {_fmt_coll(t['collectives'])} |"
            )
        L += [
            "",
            "jaxscale / TorchRec per matched row (time ratio < 1 = jaxscale faster; bytes ratio < 1 = jaxscale "
            "sends less). jaxscale bf16 and fp8 are matched with TorchRec fp16 (TorchRec maps bf16 to fp16 on "
            "gloo and its FP8 QComms fail on CPU).",
            "",
            "| sharding | jaxscale | TorchRec | TorchRec ranks | jaxscale ms | TorchRec ms | time ratio | bytes ratio |",  # noqa: E501
            "|---|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in res["comparisons"]:
            br = f"{r['bytes_ratio']:.2f}" if r["bytes_ratio"] is not None else "-"
            cf = f" cf {r['capacity_factor']:g}" if r["capacity_factor"] else ""
            L.append(
                f"| {r['sharding']} | {r['jaxscale_precision']}{cf} | {r['torchrec_precision']} | {r['torchrec_world']} "  # noqa: E501
                f"| {r['jaxscale_ms']:.1f} | {r['torchrec_ms']:.1f} | {r['time_ratio']:.2f} | {br} |"
            )
        L.append("")
    st = res.get("stages")
    if st:
        base = st[0]["total_bytes_per_example"]
        L += [
            "## 3. Foundation smoke config: embedding comm bytes per example per technique stage (2x4 mesh)",
            "",
            f"From the compiled HLO of the embedding step (lookup + update) with the config's tables and batch "
            f"(global batch {st[0]['global_batch']}); stages are cumulative. Split by {st[0]['split']}. The dense "
            f"gradient all-reduce and model gathers are the same in every stage and not included.",
            "",
            "| stage | intra-node B/example | inter-node B/example | total B/example | vs 1d fp32 |",
            "|---|---:|---:|---:|---:|",
        ]
        for x in st:
            L.append(
                f"| {x['stage']} | {x['intra_node_bytes_per_example']:,.1f} | "
                f"{x['inter_node_bytes_per_example']:,.1f} | {x['total_bytes_per_example']:,.1f} | "
                f"{x['total_bytes_per_example'] / base:.3f} |"
            )
        L.append("")
    if res.get("notes"):
        L += ["## Notes", ""] + [f"- {n}" for n in res["notes"]] + [""]
    return "\n".join(L)


def auto_notes(res: dict) -> list:
    notes = [NOTE]
    p1 = res.get("part1")
    if p1:
        r = p1["speedup_jaxscale_over_fbgemm"]
        if r >= 1:
            notes.append(f"One device: jaxscale's jitted step is {r:.2f}x FBGEMM's CPU TBE step in this run.")
        else:
            notes.append(
                f"One device: jaxscale is {1 / r:.2f}x SLOWER than FBGEMM's CPU TBE kernel in this run. "
                "XLA:CPU runs the step as generic sort / gather / segment-sum / scatter ops; matching a "
                "hand-written fused kernel would take a native lookup+AdaGrad kernel called through "
                "jax.ffi (CPU) or Pallas (GPU)."
            )
    if res.get("part2"):
        notes.append(
            "Distributed: jaxscale runs 8 simulated devices, TorchRec 2 and 4 processes, all on the same "
            "2 cores; more devices at the same global batch means more of each batch is remote, so cluster "
            "bytes grow with the device count for the same algorithm."
        )
        notes.append(
            "jaxscale's all-to-all has static shapes: with capacity_factor=None (default) every "
            "destination slot is sized for the worst case (all of a device's ids landing on one peer), "
            "so the padded payload is ~devices x larger than the ids actually sent; TorchRec sends ragged "
            "(exact-size) buffers. The cf rows show a bounded capacity (overflow counted in the first "
            "step); ragged-all-to-all or a two-pass size exchange would remove the padding."
        )
    return notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxscale.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer configurations (~2 min)")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--markdown", default=None, help="also write the Markdown report here")
    ap.add_argument("--parts", default="1,2,3", help="which parts to run (comma-separated of 1,2,3)")
    ap.add_argument("--_worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._worker:
        kind, spec = a._worker
        try:
            (_fbgemm_worker if kind == "fbgemm" else _dist_worker)(spec)
        except Exception as e:  # noqa: BLE001
            import traceback

            _reply(error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            return 1
        return 0

    os.environ.pop("XLA_FLAGS", None)  # this process: exactly 1 CPU device (set before JAX starts)
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", 1)
    except RuntimeError:
        pass
    parts = {int(x) for x in a.parts.split(",") if x.strip()}
    S = sizes(a.quick)
    t0 = time.time()
    res = {
        "command": "python -m jaxscale.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": a.quick,
        "machine": machine(),
        "jax": jax.__version__,
        "note": NOTE,
    }
    with tempfile.TemporaryDirectory(prefix="jaxscale_bench_") as tmp:
        if 1 in parts:
            log("part 1: one device, jaxscale vs FBGEMM vs NumPy")
            res["part1"] = part1(S["p1"], S["zipf"], tmp)
        if parts & {2, 3}:
            stages = [s for s, _ in STAGES] if 3 in parts else []
            if 2 in parts:
                res["part2"], res["stages"] = part2_and_3(
                    S["p2"], S["jax_configs"], S["tr_configs"], S["zipf"], tmp, stages
                )
                res["comparisons"] = comparisons(res["part2"])
            else:
                res["stages"] = _stages_only(tmp, stages)
    res["wall_s"] = time.time() - t0
    res["notes"] = auto_notes(res)
    md = markdown(res)
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=float))
    if a.markdown:
        Path(a.markdown).write_text(md + "\n")
    ok = res.get("part1", {}).get("check", {}).get("ok", True)
    if not ok:
        print("FAILED: the one-device engines disagree (see part 1 check)", file=sys.stderr)
    return 0 if ok else 1


def _stages_only(tmp: str, stages) -> list:
    spec = os.path.join(tmp, "p3_spec.json")
    empty = os.path.join(tmp, "p3.npz")
    np.savez(empty, ids0=np.zeros((8, 1), np.int32), g0=np.zeros((8, 8), np.float32))
    Path(spec).write_text(
        json.dumps({"data": empty, "tables": 1, "rows": 8, "dim": 8, "configs": [], "stages": stages})
    )
    w = Worker("dist", spec, _child_env(devices=8))
    try:
        return w.read()["stages"]
    finally:
        w.close()


if __name__ == "__main__":
    sys.exit(main())
