"""One device: lookup + row-wise AdaGrad by jaxscale, FBGEMM's CPU TBE and the NumPy reference.

Same initial table, same Zipf ids (fresh ones every step), same per-bag output gradients, same number of
steps. Each engine runs in its own process with no other engine process alive (`sessions.alternate`); a
session warms up, then times its steps; every session ends with the same table, which is checked against
`jaxscale.engine.reference` (the rows touched by any step, and the first step's output).

Engines (`python -m jaxscale.benchmarks.one_device ENGINE SPEC RESULT`):
  jaxscale  `EmbeddingCollection` on a 1x1 mesh: `shard_batch` + one jitted, donated lookup + update step
  fbgemm    `SplitTableBatchedEmbeddingBagsCodegen` (HOST/CPU, EXACT_ROWWISE_ADAGRAD, SUM): forward, then
            backward with the fused optimizer (the kernel TorchRec runs for an unsharded CPU table)
  numpy     `jaxscale.engine.reference`: lookup, per-row gradient sums, row-wise AdaGrad in place

Timed per step: the engine's own input preparation (jaxscale `shard_batch`; FBGEMM's int64 indices and
offsets) and the step, until its results are ready. The output gradients are prepared before. Threads:
jaxscale's XLA pool and FBGEMM's torch both get the usable cores (`threads`), read back in each session.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from jaxscale.benchmarks.sessions import child_env, module_command, run_session, worker_main
from jaxscale.benchmarks.stats import round_ratios, spread, zipf_ids
from jaxscale.benchmarks.threads import usable_cores, xla_env, xla_intra_op_threads
from jaxscale.engine import reference
from jaxscale.engine.tables import TableConfig

WORKER = "jaxscale.benchmarks.one_device"  # python -m WORKER ENGINE SPEC RESULT
ENGINES = ("jaxscale", "fbgemm", "numpy")
LR, EPS = 0.01, 1e-8
TABLE = TableConfig("t", rows=1, dim=1, pooling="sum", features=("f",))  # the shape comes from the data


# ------------------------------------------------------------------------------------------ data


def make_data(d: str, rows: int, dim: int, batch: int, hotness: int, steps: int, zipf: float, seed: int = 1):
    """Writes table.npy, ids.npy [steps, B, L], grads.npy [steps, B, dim], touched.npy into `d`."""
    rng = np.random.default_rng(seed)
    scale = np.sqrt(1.0 / rows)
    np.save(os.path.join(d, "table.npy"), rng.uniform(-scale, scale, (rows, dim)).astype(np.float32))
    ids = np.stack([zipf_ids(rng, rows, (batch, hotness), zipf) for _ in range(steps)])
    np.save(os.path.join(d, "ids.npy"), ids)
    np.save(os.path.join(d, "grads.npy"), rng.normal(size=(steps, batch, dim)).astype(np.float32))
    np.save(os.path.join(d, "touched.npy"), np.unique(ids))


def expected(d: str, lr: float, eps: float) -> dict:
    """The reference's first-step output and the touched rows after every step."""
    W = np.load(os.path.join(d, "table.npy"))
    ids, grads = np.load(os.path.join(d, "ids.npy")), np.load(os.path.join(d, "grads.npy"))
    acc = np.zeros(W.shape[0], np.float32)
    first = None
    for s in range(len(ids)):
        out = _numpy_step(W, acc, ids[s], grads[s], lr, eps)
        first = out if first is None else first
    return {"first_output": first, "final_rows": W[np.load(os.path.join(d, "touched.npy"))]}


def _numpy_step(W, acc, ids, G, lr, eps):
    tables, configs = {"t": W}, [TABLE]
    out = reference.lookup(tables, configs, {"f": ids})["f"]
    rg = reference.row_gradients(tables, configs, {"f": ids}, {"f": G})["t"]
    reference.apply_rowwise_adagrad(W, acc, rg, lr, eps)
    return out


# --------------------------------------------------------------------------------------- engines


def _load(d: str):
    return tuple(np.load(os.path.join(d, f"{n}.npy")) for n in ("table", "ids", "grads", "touched"))


class JaxscaleEngine:
    """`EmbeddingCollection` on a 1x1 mesh; one jitted, donated lookup + update step (compiled on step 0)."""

    def __init__(self, d: str, lr: float, eps: float, threads: int):
        import jax

        jax.config.update("jax_num_cpu_devices", 1)  # its intra-op threads come from the environment
        import jaxscale

        self.jax = jax
        W0, self.ids, self.grads, self.touched = _load(d)
        table = TableConfig("t", rows=W0.shape[0], dim=W0.shape[1], pooling="sum", features=("f",))
        self.ec = ec = jaxscale.EmbeddingCollection(
            [table],
            jaxscale.make_mesh(1, 1, devices=jax.devices()[:1]),
            jaxscale.EmbeddingSettings(
                topology="1d", sharding="row_wise", optimizer=jaxscale.RowWiseAdagrad(lr, eps=eps)
            ),
        )
        self.state = ec.from_dense({"t": W0})

        def step(state, ids, g):
            emb = ec.lookup(state, ids)
            return ec.update(state, ids, {"f": g}, after=emb), emb["f"]  # after: no table copy

        self._step = jax.jit(step, donate_argnums=0)
        self.info = {"jax": jax.__version__, "threads_set": threads}

    def read_threads(self):
        self.info["threads"] = xla_intra_op_threads()  # the pool exists once a computation ran

    def step(self, s: int):
        """(seconds, output) of step s: `shard_batch` of its ids, then the jitted step, until ready."""
        jax = self.jax
        g = jax.block_until_ready(jax.device_put(self.grads[s], self.ec.batch_sharding))
        t = time.perf_counter()
        batch = self.ec.shard_batch({"f": self.ids[s]})
        self.state, out = self._step(self.state, batch, g)
        jax.block_until_ready((self.state, out))
        return time.perf_counter() - t, out

    def final_rows(self):
        return self.ec.to_dense(self.state)["t"][self.touched]


class FbgemmEngine:
    """`SplitTableBatchedEmbeddingBagsCodegen` (HOST/CPU, EXACT_ROWWISE_ADAGRAD, SUM), `threads` torch threads."""

    def __init__(self, d: str, lr: float, eps: float, threads: int):
        import fbgemm_gpu
        import torch
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        torch.set_num_threads(threads)
        self.torch = torch
        W0, self.ids, self.grads, self.touched = _load(d)
        rows, dim = W0.shape
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=lr,
            eps=eps,
            pooling_mode=PoolingMode.SUM,
        )
        self.w = self.tbe.split_embedding_weights()[0]
        with torch.no_grad():
            self.w.copy_(torch.from_numpy(W0))
        B, L = self.ids.shape[1:]
        self.offsets = torch.arange(0, B * L + 1, L, dtype=torch.int64)
        self.info = {
            "torch": torch.__version__,
            "fbgemm": getattr(fbgemm_gpu, "__version__", "?"),
            "threads_set": threads,
            "threads": torch.get_num_threads(),
        }

    def step(self, s: int):
        """(seconds, output) of step s: int64 indices, forward, backward (the fused optimizer updates rows)."""
        G = self.torch.from_numpy(self.grads[s])
        t = time.perf_counter()
        idx = self.torch.from_numpy(self.ids[s].reshape(-1).astype(np.int64))
        out = self.tbe(idx, self.offsets)
        out.backward(G)
        return time.perf_counter() - t, out.detach()

    def final_rows(self):
        return self.w.detach().numpy()[self.touched]


class NumpyEngine:
    """`jaxscale.engine.reference`: lookup, per-row gradient sums, row-wise AdaGrad in place."""

    def __init__(self, d: str, lr: float, eps: float, threads: int):
        self.W, self.ids, self.grads, self.touched = _load(d)
        self.acc = np.zeros(self.W.shape[0], np.float32)
        self.lr, self.eps = lr, eps
        self.info = {"numpy": np.__version__, "threads": 1}  # the reference's loops run on one thread

    def step(self, s: int):
        t = time.perf_counter()
        out = _numpy_step(self.W, self.acc, self.ids[s], self.grads[s], self.lr, self.eps)
        return time.perf_counter() - t, out

    def final_rows(self):
        return self.W[self.touched]


ENGINE_CLASSES = {"jaxscale": JaxscaleEngine, "fbgemm": FbgemmEngine, "numpy": NumpyEngine}


def session(kind: str):
    """The worker handler of one engine session: every step in order, warm-up first."""

    def handler(spec: dict) -> dict:
        engine = ENGINE_CLASSES[kind](spec["dir"], spec["lr"], spec["eps"], int(spec["threads"]))
        times, first = [], None
        for s in range(len(engine.ids)):
            dt, out = engine.step(s)
            times.append(dt)
            first = np.asarray(out) if first is None else first
        if hasattr(engine, "read_threads"):
            engine.read_threads()
        stem, warm = spec["result_stem"], int(spec["warmup"])
        np.save(stem + ".first.npy", np.asarray(first, np.float32))
        np.save(stem + ".rows.npy", np.asarray(engine.final_rows(), np.float32))
        return {
            "warmup_s": times[:warm],
            "times_s": times[warm:],
            "first_output": stem + ".first.npy",
            "final_rows": stem + ".rows.npy",
            **engine.info,
        }

    return handler


# ----------------------------------------------------------------------------------------- parent


def run(cfg: dict, tmp: str, alternate, timeout_s: float = 1800) -> dict:
    """Sessions of every engine, alternated; returns timings, checks and the workload description.

    `alternate(sessions)` is `sessions.alternate` bound to the round count and load gate. Every engine
    gets the usable cores as its intra-op threads (`cfg["threads"]` overrides)."""
    d = os.path.join(tmp, "one_device")
    os.makedirs(d, exist_ok=True)
    steps = cfg["warmup"] + cfg["steps"]
    make_data(d, cfg["rows"], cfg["dim"], cfg["batch"], cfg["hotness"], steps, cfg["zipf"])
    want = expected(d, LR, EPS)
    counter = iter(range(10**6))
    threads = int(cfg.get("threads") or usable_cores())

    def session(engine):
        def go():
            spec = {"dir": d, "lr": LR, "eps": EPS, "warmup": cfg["warmup"], "threads": threads}
            spec["result_stem"] = os.path.join(d, f"{engine}_{next(counter)}")
            env = child_env(**xla_env(threads))
            return run_session(module_command(WORKER), engine, [spec], tmp=tmp, timeout_s=timeout_s, env=env)[0]

        return go

    runs = alternate({e: session(e) for e in cfg.get("engines", ENGINES)})
    scale = max(1.0, float(np.abs(want["final_rows"]).max()))
    engines = {}
    for name, results in runs["results"].items():
        checks = []
        for res in results:
            first = np.load(res.pop("first_output"))
            rows = np.load(res.pop("final_rows"))
            checks.append(
                {
                    "max_abs_diff_rows": float(np.abs(rows - want["final_rows"]).max()),
                    "max_abs_diff_first_output": float(np.abs(first - want["first_output"]).max()),
                }
            )
        times = [t for res in results for t in res["times_s"]]
        info = {k: v for k, v in results[0].items() if k not in ("times_s", "warmup_s")}
        engines[name] = {
            **spread(times),
            "session_medians_ms": [spread(res["times_s"])["median_ms"] for res in results],
            "all_ms": [[round(1e3 * t, 3) for t in res["times_s"]] for res in results],
            "checks": checks,
            "max_abs_diff_rows": max(c["max_abs_diff_rows"] for c in checks),
            "max_abs_diff_first_output": max(c["max_abs_diff_first_output"] for c in checks),
            "info": info,
            "background_busy": runs["busy"][name],
        }
    tol = 1e-5 * scale
    ok = all(e["max_abs_diff_rows"] <= tol and e["max_abs_diff_first_output"] <= tol for e in engines.values())
    touched = np.load(os.path.join(d, "touched.npy"))
    moved = float(np.abs(want["final_rows"] - np.load(os.path.join(d, "table.npy"))[touched]).max())
    return {
        "shape": {k: cfg[k] for k in ("rows", "dim", "batch", "hotness", "zipf", "warmup", "steps")}
        | {"touched_rows": int(len(touched)), "lr": LR, "eps": EPS},
        "threads": threads,
        "engines": engines,
        "speed_vs_fbgemm": speed_vs_fbgemm(engines),
        "order": runs["order"],
        "check": {"ok": bool(ok and moved > 0), "tolerance": tol, "rows_moved_up_to": moved},
    }


def speed_vs_fbgemm(engines: dict) -> dict:
    """{engine: speed (FBGEMM's median / the engine's), per-round speeds, the worst round's} when FBGEMM ran."""
    fb = engines.get("fbgemm")
    if not fb:
        return {}
    out = {}
    for name, e in engines.items():
        rounds = [1 / r for r in round_ratios(e["session_medians_ms"], fb["session_medians_ms"])]
        out[name] = {"speed": fb["median_ms"] / e["median_ms"], "round_speeds": rounds, "worst_round": min(rounds)}
    return out


if __name__ == "__main__":
    sys.exit(worker_main({kind: session(kind) for kind in ENGINE_CLASSES}))
