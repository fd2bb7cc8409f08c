"""Equal devices: jaxscale's distributed lookup + row-wise AdaGrad step against TorchRec's, same work.

Same tables (pooled, sum), same weights, same global batch of Zipf ids (fresh every step), same output
gradients, same optimizer, same number of devices W, same intra-op threads per process
(`threads.per_process`: max(1, usable cores // processes)):
  jaxscale_mp   W processes of one CPU device each (mesh W x 1, 'node' = process), gloo over 127.0.0.1,
                started by `jaxscale.infra.distributed.initialize` as the trainer starts them; at W = 1 one
                process of one device (no communication)
  torchrec      TorchRec `DistributedModelParallel` on W gloo ranks (`jaxscale.benchmarks.torchrec_runner`),
                fused FBGEMM TBE kernels
  jaxscale_sim  one process, W simulated CPU devices (mesh 1 x W): NOT equal devices (its collectives are
                in-process copies, no transport), reported apart from the comparison as what the transport costs
per sharding type (table_wise, row_wise, column_wise), payload precision, and exchange sizing (`reuse`:
`reuse_capacities=True`; `count`: counted on the host every batch, one row per sharding beside fp32).

Each jaxscale row is compared with TorchRec at its matched precision (`TORCHREC_MATCH`) and with TorchRec's
fastest configuration that ran for the same sharding and W (fp32 or fp16; on CPU its fp16 is often the
slower). A session is one engine at one W, all its configurations, in its own processes; sessions
alternate in rounds (`sessions.alternate`), so no other engine process is alive while one is timed, and
session r of every engine ran in round r: each row carries the per-round ratios and the worst round's.
Step time: median over the timed steps of all sessions (for several processes or ranks: the slowest of
them in each step). Bytes:
what leaves a device per step, summed over the W devices: jaxscale's from the compiled HLO
(`jaxscale.engine.comm_inspect.list_collectives`, for the executable each step ran), TorchRec's from the
torch.distributed collectives it calls, both under one byte model (all-to-all: the part sent to others;
all-reduce 2(W-1)/W, all-gather (W-1)/W of the result, reduce-scatter (W-1)/W of the input).
After the last step the fp32 tables are checked against `jaxscale.engine.reference` (column-wise tables with one
AdaGrad accumulator per column shard are checked against the reference with those accumulators).

Column-wise tables run with `RowWiseAdagrad(per_column_shard=True)`: TorchRec keeps one accumulator per row
and column shard, so that is the same work. jaxscale's default instead keeps one accumulator per full row
(the result does not depend on the layout), which sends each touched row's squared-gradient sum once more.

`python -m jaxscale.benchmarks.equal_devices jaxscale SPEC RESULT` is the jaxscale worker (one process).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxscale.benchmarks.sessions import child_env, free_port, module_command, run_session, worker_main
from jaxscale.benchmarks.stats import round_ratios, spread, zipf_ids
from jaxscale.benchmarks.threads import per_process, xla_env, xla_intra_op_threads
from jaxscale.engine import reference
from jaxscale.engine.tables import TableConfig

WORKER = "jaxscale.benchmarks.equal_devices"  # python -m WORKER jaxscale SPEC RESULT
RUNNER = "jaxscale.benchmarks.torchrec_runner"
LR, EPS = 0.01, 1e-8
SHARDINGS = ("table_wise", "row_wise", "column_wise")
# jaxscale payload precision -> (forward, backward). 'fp8' is fp8 both ways (gradients in e5m2), as
# TorchRec's FP8 QComms; 'fp8/bf16' is the technique ladder's (fp8 forward, bf16 backward).
JAXSCALE_PRECISIONS = {
    "fp32": ("fp32", "fp32"),
    "fp16": ("fp16", "fp16"),
    "bf16": ("bf16", "bf16"),
    "fp8/bf16": ("fp8", "bf16"),
    "fp8": ("fp8", "fp8"),
}
# The TorchRec run each jaxscale precision is compared with, and why.
_FP8_WHY = (
    "TorchRec's FP8 QComms fail on CPU for its all-to-alls and run as FP16 for row-wise reduce-scatters; "
    "FP16 is its narrowest precision that runs"
)
TORCHREC_MATCH = {
    "fp32": ("fp32", "same precision"),
    "fp16": ("fp16", "same precision"),
    "bf16": ("fp16", "TorchRec's BF16 QComms run as FP16 on CPU/gloo"),
    "fp8/bf16": ("fp16", _FP8_WHY),
    "fp8": ("fp16", _FP8_WHY),
}
# TorchRec always runs these too at W > 1, so every row also has TorchRec's fastest configuration beside it.
TORCHREC_ALWAYS = ("fp32", "fp16")
# Bytes targets vs TorchRec: 1.0x; fp8 0.5x (TorchRec's fp8 does not run on CPU, its int64 ids are never
# compressed); fp8/bf16 0.75x: its fp8 forward held to 0.5x and its bf16 backward to 1.0x of TorchRec's fp16,
# two payloads of the same size.
BYTES_TARGETS = {"fp8": 0.5, "fp8/bf16": 0.75}


# Byte model for TorchRec's counted collectives (what leaves a rank), given the input bytes b and world w.
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


def tables(n: int, rows: int, dim: int) -> list[TableConfig]:
    return [TableConfig(f"t{i}", rows=rows, dim=dim, pooling="sum", features=(f"f{i}",)) for i in range(n)]


def config_name(sharding: str, precision: str, capacities: str = "reuse") -> str:
    """'row_wise/fp32', or 'row_wise/fp32+count' for jaxscale counting every batch."""
    return f"{sharding}/{precision}" + ("" if capacities == "reuse" else f"+{capacities}")


# ------------------------------------------------------------------------------------------ data


def make_data(d: str, cfg: dict, worlds, seed: int = 2) -> None:
    """data.pkl (weights, batches, grads), and expected_cp{k}.npz: the reference's tables after every step
    with k AdaGrad accumulators per row (k = 1, and k = W for TorchRec-style column-wise shards)."""
    rng = np.random.default_rng(seed)
    ts = tables(cfg["tables"], cfg["rows"], cfg["dim"])
    steps = cfg["warmup"] + cfg["steps"]
    weights = {t.name: rng.normal(scale=0.01, size=(t.rows, t.dim)).astype(np.float32) for t in ts}
    batches = [
        {f"f{i}": zipf_ids(rng, cfg["rows"], (cfg["batch"], cfg["hotness"]), cfg["zipf"]) for i in range(len(ts))}
        for _ in range(steps)
    ]
    grads = [
        {f"f{i}": rng.normal(size=(cfg["batch"], cfg["dim"])).astype(np.float32) for i in range(len(ts))}
        for _ in range(steps)
    ]
    for name, obj in (("weights", weights), ("batches", batches), ("grads", grads)):
        with open(os.path.join(d, f"{name}.pkl"), "wb") as fh:
            pickle.dump(obj, fh)
    for k in sorted({1, *worlds}):
        if cfg["dim"] % k:
            continue
        col_parts = {t.name: k for t in ts} if k > 1 else None
        res = reference.train(
            weights, ts, batches, grads, optimizer="rowwise_adagrad", lr=LR, eps=EPS, col_parts=col_parts
        )
        np.savez(os.path.join(d, f"expected_cp{k}.npz"), **res["tables"])


def _load(d: str, name: str):
    with open(os.path.join(d, f"{name}.pkl"), "rb") as fh:
        return pickle.load(fh)


# ------------------------------------------------------------------------------- jaxscale worker


def _jaxscale(spec: dict) -> dict:
    """All configurations of one jaxscale session (this process's part of it)."""
    import jax

    nproc, pid, local = spec["num_processes"], spec["process_id"], spec["local_devices"]
    if nproc > 1:
        from jaxscale.infra import distributed

        distributed.initialize(spec["coordinator"], nproc, pid, local_devices=local)
    else:
        jax.config.update("jax_num_cpu_devices", local)
    import jaxscale

    d = spec["dir"]
    weights, batches, grads = _load(d, "weights"), _load(d, "batches"), _load(d, "grads")
    ts = tables(len(weights), *next(iter(weights.values())).shape)
    mesh = jaxscale.make_mesh(nproc, local)
    devices = nproc * local
    out = {"devices": devices, "mesh": [nproc, local], "process_id": pid, "jax": jax.__version__, "configs": {}}
    for sharding, precision, capacities in spec["configs"]:
        name = config_name(sharding, precision, capacities)
        try:
            out["configs"][name] = _time_config(
                spec, mesh, ts, weights, batches, grads, sharding, precision, capacities
            )
        except Exception as e:  # noqa: BLE001 - recorded; the other configurations still run
            out["configs"][name] = {
                "sharding": sharding,
                "precision": precision,
                "capacities": capacities,
                "error": f"{type(e).__name__}: {e}",
            }
        print(f"[jaxscale {devices} dev, process {pid}] {name} done", file=sys.stderr, flush=True)
    out["threads"] = xla_intra_op_threads()  # XLA's intra-op pool as it ran (set by the environment)
    return out


def _time_config(spec, mesh, ts, weights, batches, grads, sharding, precision, capacities) -> dict:
    """Warm-up and timed steps of one configuration; bytes per step from each executable's HLO; the check."""
    import jax
    from jax.experimental import multihost_utils

    import jaxscale
    from jaxscale.engine import comm_inspect

    nproc, pid = spec["num_processes"], spec["process_id"]
    devices = mesh.devices.size
    B = next(iter(batches[0].values())).shape[0]
    mine = slice(pid * B // nproc, (pid + 1) * B // nproc)
    d = spec["dir"]
    fwd, bwd = JAXSCALE_PRECISIONS[precision]
    ec = jaxscale.EmbeddingCollection(
        ts,
        mesh,
        jaxscale.EmbeddingSettings(
            topology="1d",
            sharding=sharding,
            optimizer=jaxscale.RowWiseAdagrad(LR, eps=EPS, per_column_shard=sharding == "column_wise"),
            comm=jaxscale.CommConfig(forward=fwd, backward=bwd),
            capacity_factor=spec.get("capacity_factor"),
            reuse_capacities=capacities == "reuse",
        ),
    )
    state = ec.from_dense(weights)

    def step(state, ids, g, ec=ec):
        emb, stats = ec.lookup(state, ids, return_stats=True)
        # a batch that overflowed reused capacities changes nothing; it is re-run counted below
        new = ec.update(state, ids, g, apply=stats["overflow"] == 0, after=emb)  # after: no table copy
        return new, (emb, stats["overflow"])

    step = jax.jit(step, donate_argnums=0)
    times, overflow, reran, bytes_by_exe, step_bytes = [], 0, [], {}, []

    def bytes_of(ids_dev, g_dev):
        key = str(jax.tree.structure(ids_dev))  # the batch's static metadata selects the executable
        if key not in bytes_by_exe:
            bytes_by_exe[key] = _collective_bytes(comm_inspect.list_collectives(step, state, ids_dev, g_dev, mesh=mesh))
        return bytes_by_exe[key]

    for s, (ids, g) in enumerate(zip(batches, grads)):
        g_dev = {f: jax.make_array_from_process_local_data(ec.batch_sharding, v[mine], v.shape) for f, v in g.items()}
        jax.block_until_ready(g_dev)
        if nproc > 1:
            multihost_utils.sync_global_devices(f"step {s}")
        t = time.perf_counter()
        ids_dev = ec.shard_batch({f: v[mine] for f, v in ids.items()})
        state, (emb, ovf) = step(state, ids_dev, g_dev)
        attempts = [ids_dev]
        if int(np.asarray(ovf.addressable_data(0))):  # reused capacities did not fit: re-run, counted
            ids_dev = ec.shard_batch({f: v[mine] for f, v in ids.items()}, recount=True)
            state, (emb, ovf) = step(state, ids_dev, g_dev)
            attempts.append(ids_dev)
        jax.block_until_ready((state, emb, ovf))
        times.append(time.perf_counter() - t)  # a re-run step's time includes both attempts
        reran.append(len(attempts) > 1)
        overflow += int(np.asarray(ovf.addressable_data(0)))
        per_attempt = [bytes_of(a, g_dev) for a in attempts]  # a re-run step sends both attempts' bytes
        step_bytes.append(
            {
                "per_device": sum(b["per_device"] for b in per_attempt),
                "per_kind": {
                    k: sum(b["per_kind"].get(k, 0.0) for b in per_attempt)
                    for k in {k for b in per_attempt for k in b["per_kind"]}
                },
            }
        )
    dense = ec.to_dense(state)
    acc = ec.slots_to_dense(state)["accumulator"]
    cp = {a.shape[1] if a.ndim == 2 else 1 for a in acc.values()}
    check = None
    path = os.path.join(d, f"expected_cp{max(cp)}.npz")
    if len(cp) == 1 and os.path.exists(path):
        with np.load(path) as want:
            check = {
                "col_parts": max(cp),
                "max_abs_diff": max(float(np.abs(dense[n] - want[n]).max()) for n in dense),
            }
    timed = slice(spec["warmup"], None)
    per_kind: dict = {}
    for b in step_bytes[timed]:
        for k, v in b["per_kind"].items():
            per_kind[k] = per_kind.get(k, 0.0) + v / len(step_bytes[timed])
    return {
        "sharding": sharding,
        "precision": precision,
        "capacities": capacities,
        "comm": [fwd, bwd],
        "times_s": times[timed],
        "warmup_s": times[: spec["warmup"]],
        "overflow_rows": overflow,
        "reruns": int(sum(reran[timed])),  # timed steps re-run after reused capacities overflowed
        "reruns_warmup": int(sum(reran[: spec["warmup"]])),
        "bytes_per_device": float(np.mean([b["per_device"] for b in step_bytes[timed]])),
        "bytes_cluster_per_kind": {k: v * devices for k, v in per_kind.items()},
        "executables": len(bytes_by_exe),
        "check": check,
    }


def _collective_bytes(collectives) -> dict:
    per_kind: dict = {}
    for c in collectives:
        key = f"{c.kind}[{'/'.join(sorted(set(c.dtypes)))}]"
        per_kind[key] = per_kind.get(key, 0.0) + c.bytes_per_device
    return {"per_device": sum(per_kind.values()), "per_kind": per_kind}


# --------------------------------------------------------------------------------------- sessions


def jaxscale_session(d: str, tmp: str, world: int, configs, cfg: dict, multiprocess: bool, timeout_s: float) -> dict:
    """One jaxscale session at W devices: one process of W devices, or W processes of one, each with
    `threads.per_process(processes)` intra-op threads."""
    nproc, local = (world, 1) if multiprocess else (1, world)
    threads = per_process(nproc, cfg.get("cores"))
    base = {
        "dir": d,
        "configs": configs,
        "warmup": cfg["warmup"],
        "num_processes": nproc,
        "local_devices": local,
        "capacity_factor": cfg.get("capacity_factor"),
        "coordinator": f"127.0.0.1:{free_port()}",
    }
    results = run_session(
        module_command(WORKER),
        "jaxscale",
        [base | {"process_id": i} for i in range(nproc)],
        tmp=tmp,
        timeout_s=timeout_s,
        env=child_env(**xla_env(threads)),
    )
    first = results[0]
    first["threads"] = {"set": threads, "measured": [r.get("threads") for r in results]}
    for name, c in first["configs"].items():  # the slowest process in each step
        errors = [r["configs"][name]["error"] for r in results if "error" in r["configs"][name]]
        if errors:
            first["configs"][name] = {k: c[k] for k in ("sharding", "precision", "capacities")} | {"error": errors[0]}
            continue
        c["times_s"] = np.max([r["configs"][name]["times_s"] for r in results], axis=0).tolist()
    return first


def torchrec_jobs(d: str, cfg: dict, world: int, shardings, precisions) -> list[dict]:
    ts = tables(cfg["tables"], cfg["rows"], cfg["dim"])
    jobs = []
    for sharding in shardings:
        for precision in precisions:
            cp = world if sharding == "column_wise" else 1
            jobs.append(
                dict(
                    tables=[
                        {
                            "name": t.name,
                            "rows": t.rows,
                            "dim": t.dim,
                            "pooling": t.pooling,
                            "features": list(t.features),
                        }
                        for t in ts
                    ],
                    weights=os.path.join(d, "weights.pkl"),
                    batches=os.path.join(d, "batches.pkl"),
                    grads=os.path.join(d, "grads.pkl"),
                    sharding=sharding,
                    world_size=world,
                    optimizer="rowwise_adagrad",
                    lr=LR,
                    eps=EPS,
                    qcomms=precision,
                    threads=per_process(world, cfg.get("cores")),  # the same as a jaxscale process at W
                    expected_tables=os.path.join(d, f"expected_cp{cp}.npz"),
                    keep_arrays=False,
                    timeout_s=600,
                )
            )
    return jobs


def run_torchrec_jobs(jobs: list[dict], tmp: str, timeout_s: float) -> list[dict]:
    """The TorchRec runner on a list of jobs, in its own process group (killed whole on timeout)."""
    fd, inp = tempfile.mkstemp(dir=tmp, prefix="torchrec_jobs_", suffix=".pkl")
    out = inp.replace(".pkl", ".out.pkl")
    with os.fdopen(fd, "wb") as fh:
        pickle.dump(jobs, fh)
    proc = subprocess.Popen(
        [*module_command(RUNNER), "--input", inp, "--output", out],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise RuntimeError(f"TorchRec runner still running after {timeout_s:.0f} s, killed") from None
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"TorchRec runner failed (exit {proc.returncode}):\n{text[-4000:]}")
    with open(out, "rb") as fh:
        return pickle.load(fh)


def torchrec_bytes(res: dict, world: int, timed: slice) -> dict:
    """{op[dtype]: bytes leaving the ranks per step, summed over ranks}, averaged over the timed steps."""
    out: dict = {}
    for rank_steps in res["comm"]:
        steps = rank_steps[timed]
        for step in steps:
            for key, v in step.items():
                op = key.split("[")[0]
                if op in ("all_to_all_single", "all_to_all") and v.get("offrank_bytes"):
                    b = float(v["offrank_bytes"])
                else:
                    b = _OFFRANK.get(op, lambda x, w: x)(float(v["bytes"]), world)
                out[key] = out.get(key, 0.0) + b / len(steps)
    return out


def torchrec_session(d: str, tmp: str, world: int, cfg: dict, shardings, precisions, timeout_s: float) -> dict:
    jobs = torchrec_jobs(d, cfg, world, shardings, precisions)
    results = run_torchrec_jobs(jobs, tmp, timeout_s)
    timed = slice(cfg["warmup"], None)
    out = {"devices": world, "configs": {}, "threads": {"set": jobs[0]["threads"] if jobs else None, "measured": []}}
    for job, res in zip(jobs, results):
        name = config_name(job["sharding"], job["qcomms"])
        if "error" in res:
            error = res["error"][:400]
            out["configs"][name] = {"sharding": job["sharding"], "precision": job["qcomms"], "error": error}
            continue
        out["threads"]["measured"] = sorted({*out["threads"]["measured"], *res.get("threads_per_rank", [])})
        per_kind = torchrec_bytes(res, world, timed)
        out["configs"][name] = {
            "sharding": job["sharding"],
            "precision": job["qcomms"],
            "times_s": np.array(res["step_times"]).max(0)[timed].tolist(),  # the slowest rank in each step
            "bytes_cluster_per_kind": per_kind,
            "bytes_per_device": sum(per_kind.values()) / world,
            "threads": job["threads"],
            "threads_per_rank": res.get("threads_per_rank"),
            "notes": res["config"]["notes"],
            "check": {
                "col_parts": world if job["sharding"] == "column_wise" else 1,
                "max_abs_diff": max(res["max_abs_diff"].values()),
            },
        }
    return out


# ------------------------------------------------------------------------------------------ parent


def plan(cfg: dict) -> dict:
    """{world: {"jaxscale": [(sharding, precision, capacities)], "torchrec": (shardings, precisions)}}.

    jaxscale: every sharding x precision with `cfg["capacities"]` ("reuse", the default, or "count"), plus
    one counted-every-batch fp32 row per sharding beside the reused ones when `cfg["count_row"]`. TorchRec:
    every precision a row is matched with, and always fp32 and fp16 (its fastest is one of them)."""
    mode = cfg.get("capacities", "reuse")
    w1 = [("table_wise", "fp32", mode)] + ([("table_wise", "fp32", "count")] if _count_row(cfg) else [])
    out = {"1": {"jaxscale": w1, "torchrec": (("table_wise",), ("fp32",))}}
    wanted = {TORCHREC_MATCH[p][0] for p in cfg["precisions"]} | set(TORCHREC_ALWAYS)
    tr_precisions = tuple(p for p in TORCHREC_MATCH if p in wanted)
    for w in cfg["worlds"]:
        configs = [(s, p, mode) for s in cfg["shardings"] for p in cfg["precisions"]]
        if _count_row(cfg):
            configs += [(s, "fp32", "count") for s in cfg["shardings"]]
        out[str(w)] = {"jaxscale": configs, "torchrec": (tuple(cfg["shardings"]), tr_precisions)}
    return out


def _count_row(cfg: dict) -> bool:
    """The count-every-batch rows run beside reused capacities (not when every row counts, nor with fixed ones)."""
    return (
        bool(cfg.get("count_row", True))
        and cfg.get("capacities", "reuse") == "reuse"
        and not cfg.get("capacity_factor")
    )


def run(cfg: dict, tmp: str, alternate, timeout_s: float = 3600) -> dict:
    d = os.path.join(tmp, "distributed")
    os.makedirs(d, exist_ok=True)
    make_data(d, cfg, cfg["worlds"])
    todo = plan(cfg)
    sessions = {}
    for key, p in todo.items():
        w = int(key)
        if w > 1:  # in one process: W simulated devices, no transport (reported apart, not compared)
            sessions[f"jaxscale_sim@{w}"] = lambda w=w, p=p: jaxscale_session(
                d, tmp, w, p["jaxscale"], cfg, False, timeout_s
            )
        sessions[f"jaxscale_mp@{w}"] = lambda w=w, p=p: jaxscale_session(d, tmp, w, p["jaxscale"], cfg, True, timeout_s)
        if cfg.get("torchrec", True):
            sessions[f"torchrec@{w}"] = lambda w=w, p=p: torchrec_session(d, tmp, w, cfg, *p["torchrec"], timeout_s)
    runs = alternate(sessions)
    engines = {}
    for name, results in runs["results"].items():
        engine, world = name.split("@")
        merged = merge_sessions(results)
        engines.setdefault(engine, {})[world] = {
            "configs": merged,
            "background_busy": runs["busy"][name],
            "threads": {
                "set": results[0]["threads"]["set"],
                "measured": sorted({t for r in results for t in r["threads"]["measured"] if t is not None}),
            },
        }
        if engine.startswith("jaxscale"):
            engines[engine][world]["mesh"] = results[0]["mesh"]
    if cfg.get("torchrec_fp8_probe") and cfg.get("torchrec", True):
        engines["torchrec_fp8_probe"] = _fp8_probe(d, tmp, cfg, timeout_s)
    return {
        "capacity_factor": cfg.get("capacity_factor"),
        "capacities": cfg.get("capacities", "reuse"),
        "reuse_capacities": cfg.get("capacities", "reuse") == "reuse",
        "shape": {k: cfg[k] for k in ("tables", "rows", "dim", "batch", "hotness", "zipf", "warmup", "steps")}
        | {"lr": LR, "eps": EPS},
        "worlds": sorted(todo, key=int),
        "engines": engines,
        "comparisons": comparisons(engines, sorted(todo, key=int)),
        "order": runs["order"],
    }


def merge_sessions(results: list[dict]) -> dict:
    """{config: description + timing spread over every session's timed steps + per-session medians, in
    round order}. A configuration that failed in any session keeps only its error: its sessions did not do
    the same work."""
    merged = {}
    for res in results:
        for cname, c in res["configs"].items():
            m = merged.setdefault(
                cname,
                {"sharding": c["sharding"], "precision": c["precision"], "times_s": [], "session_medians_ms": []},
            )
            if "capacities" in c:
                m["capacities"] = c["capacities"]
            if "error" in c:
                m["error"] = c["error"]
                continue
            summed = ("overflow_rows", "reruns", "reruns_warmup")  # counts add up over the sessions
            m.update({k: v for k, v in c.items() if k not in ("times_s", "warmup_s", *summed)})
            for k in summed:
                if k in c:
                    m[k] = m.get(k, 0) + c[k]
            m["times_s"] += c["times_s"]
            m["session_medians_ms"].append(spread(c["times_s"])["median_ms"])
    for m in merged.values():
        times = m.pop("times_s")
        if "error" in m:
            for k in [k for k in m if k not in ("error", "sharding", "precision", "capacities")]:
                del m[k]
        else:
            m.update(spread(times))
    return merged


def _fp8_probe(d, tmp, cfg, timeout_s) -> dict:
    """Asks TorchRec for FP8 QComms on 2 ranks, per sharding type, to record what happens on CPU (not timed):
    {sharding: {"ran": bool, "error": str, "collectives": [op[dtype] it called]}}."""
    jobs = torchrec_jobs(d, cfg, 2, cfg["shardings"], ("fp8",))
    out = {}
    for job, res in zip(jobs, run_torchrec_jobs(jobs, tmp, timeout_s)):
        kinds = sorted({k for rank in res.get("comm", []) for step in rank for k in step})
        out[job["sharding"]] = {"ran": "error" not in res, "error": res.get("error", "")[:600], "collectives": kinds}
    return out


def _against(prefix: str, j: dict, t: dict) -> dict:
    """jaxscale / TorchRec: the pooled medians' ratio, each round's, and the worst round's (None when either
    did not run)."""
    if "median_ms" not in j or "median_ms" not in t:
        return {f"{prefix}_ratio": None, f"{prefix}_round_ratios": None, f"{prefix}_worst_ratio": None}
    rounds = round_ratios(j["session_medians_ms"], t["session_medians_ms"])
    return {
        f"{prefix}_ratio": j["median_ms"] / t["median_ms"],
        f"{prefix}_round_ratios": rounds,
        f"{prefix}_worst_ratio": max(rounds),
    }


def comparisons(engines: dict, worlds) -> list[dict]:
    """One row per (W, sharding, jaxscale precision, capacities): jaxscale on W processes of one device (one
    process at W = 1) against TorchRec on W ranks, at the matched precision and at TorchRec's fastest
    configuration for that sharding; the in-process time (W simulated devices) rides along, labelled."""
    rows = []
    sim, mp, tr = engines.get("jaxscale_sim", {}), engines.get("jaxscale_mp", {}), engines.get("torchrec", {})
    for key in worlds:
        w = int(key)
        tr_configs = tr.get(key, {}).get("configs", {})
        for cname, j in mp.get(key, {}).get("configs", {}).items():
            tr_precision, why = TORCHREC_MATCH[j["precision"]]
            t = tr_configs.get(config_name(j["sharding"], tr_precision), {})
            ran = {n: c for n, c in tr_configs.items() if c["sharding"] == j["sharding"] and "median_ms" in c}
            fastest = ran[min(ran, key=lambda n: ran[n]["median_ms"])] if ran else {}
            inproc = sim.get(key, {}).get("configs", {}).get(cname, {})
            ok_t = "median_ms" in t
            row = {
                "devices": w,
                "sharding": j["sharding"] if w > 1 else "-",
                "precision": j["precision"],
                "capacities": j.get("capacities", "reuse"),
                "torchrec_precision": tr_precision,
                "match": why,
                "jaxscale_ms": j.get("median_ms"),
                "jaxscale_session_ms": j.get("session_medians_ms"),
                "torchrec_ms": t.get("median_ms"),
                "torchrec_session_ms": t.get("session_medians_ms"),
                "torchrec_fastest_precision": fastest.get("precision"),
                "torchrec_fastest_ms": fastest.get("median_ms"),
                "in_process_ms": inproc.get("median_ms"),
                "jaxscale_bytes": j["bytes_per_device"] * w if "bytes_per_device" in j else None,
                "torchrec_bytes": t.get("bytes_per_device", float("nan")) * w if ok_t else None,
                "torchrec_error": t.get("error"),
                "jaxscale_error": j.get("error") or inproc.get("error"),
            }
            row |= _against("time", j, t) | _against("time_fastest", j, fastest)
            row["in_process_ratio"] = (
                row["in_process_ms"] / row["torchrec_ms"] if ok_t and row["in_process_ms"] else None
            )
            row["bytes_ratio"] = (
                row["jaxscale_bytes"] / row["torchrec_bytes"]
                if ok_t and row["torchrec_bytes"] and row["jaxscale_bytes"] is not None
                else None
            )
            row["bytes_target"] = BYTES_TARGETS.get(j["precision"], 1.0)
            rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(worker_main({"jaxscale": _jaxscale}))
