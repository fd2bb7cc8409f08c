"""A real training step: the foundation model through the Trainer vs a SASRec+ reference in PyTorch.

Both engines train on the same synthetic histories (full `events`-long histories of item ids drawn from
`items` items, seeded, the same arrays in every session), the next item predicted at every position with a
cross-entropy over every item, each in its own processes with no other engine alive (`sessions.alternate`).

Engines (`python -m jaxscale.benchmarks.train_step ENGINE SPEC RESULT`):
  jaxscale        the foundation model of `movielens_foundation.yaml` (model and optimizer sections as shipped,
                  the shapes of the benchmark: max_seq_len = events, item_rows = items + 2 reserved, the loss at
                  every position) on `default_mesh` (1x2 on 2 cores), through the Trainer: per step
                  `Trainer.prepare` (engine ids, their check, placement, exchange sizing), the same AOT-compiled,
                  donated `train_step` the trainer runs, and the metrics' read-back the trainer does every step
  torch           `jaxscale.benchmarks.sasrec_torch` (eager), `torch.set_num_threads` = the XLA threads
  torch_compile   the same model under `torch.compile` (the peer's fastest configuration, when it compiles)

Timed per step: everything from the host batch to the step's loss on the host. Start-up, compile and
`warmup` steps are excluded. Threads: XLA's intra-op pool (`PJRT_NPROC`) and torch's are both set to
`threads`, and read back in each session.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxscale.benchmarks.sessions import child_env, module_command, run_session, worker_main
from jaxscale.benchmarks.stats import round_ratios, spread
from jaxscale.benchmarks.threads import usable_cores, xla_env, xla_intra_op_threads

WORKER = "jaxscale.benchmarks.train_step"
ENGINES = ("jaxscale", "torch", "torch_compile")
TORCH_ENGINES = ("torch", "torch_compile")
RESERVED = 2  # the sequence store's padding and out-of-vocabulary rows: never candidates
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "movielens_foundation.yaml"  # shipped in the wheel


@dataclasses.dataclass(frozen=True)
class Shape:
    """The benchmark's workload: `batch` histories of `events` items out of `items`, `layers` x `d_model`."""

    batch: int = 128
    events: int = 200
    items: int = 3416
    layers: int = 2
    d_model: int = 64
    heads: int = 2
    inner: int = 256
    warmup: int = 3
    steps: int = 10
    mesh: str = "1x1"
    """jaxscale's mesh, NODESxLOCAL simulated CPU devices in its one process; `run` defaults it to
    `default_mesh` (one device per thread)."""

    @property
    def devices(self) -> int:
        nodes, local = (int(x) for x in self.mesh.split("x"))
        return nodes * local


def histories(shape: Shape, step: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(items [B, L], targets [B]) of a step: ids 1..items (0 = padding, never drawn), uniform."""
    rng = np.random.default_rng([seed, step])
    items = rng.integers(1, shape.items + 1, (shape.batch, shape.events + 1))
    return items[:, :-1], items[:, -1]


# --------------------------------------------------------------------------------------- engines


class JaxscaleEngine:
    """The Trainer of the MovieLens foundation config at the benchmark's shapes, on `shape.mesh`."""

    def __init__(self, shape: Shape, threads: int):
        import jax

        from jaxscale.engine.mesh import make_mesh
        from jaxscale.training.checkpoint import host
        from jaxscale.training.config import load_config
        from jaxscale.training.trainer import Trainer

        self.jax, self.host, self.shape = jax, host, shape
        m = "model.foundation."
        nodes, local = (int(x) for x in shape.mesh.split("x"))
        overrides = [
            f"mesh.nodes={nodes}",
            f"mesh.local={local}",
            f"{m}item_rows={shape.items + RESERVED}",
            f"{m}reserved_rows={RESERVED}",
            f"{m}max_seq_len={shape.events}",
            f"{m}num_layers={shape.layers}",
            f"{m}d_model={shape.d_model}",
            f"{m}item_dim={shape.d_model}",
            f"{m}num_heads={shape.heads}",
            f"{m}mlp_ratio={shape.inner // shape.d_model}",
            f"{m}loss_last_positions=0",  # every position, as SASRec+
            f"train.batch_size={shape.batch}",
            "train.eval_every=0",
            "train.eval_metric=null",
            "train.early_stopping_patience=0",
            "data.source=synthetic",  # never read: the batches are passed in
            f"train.workdir={tempfile.mkdtemp(prefix='bench_train_step_')}",
        ]
        cfg = load_config(str(CONFIG), overrides)
        if shape.inner != cfg.model.params.mlp_ratio * shape.d_model:
            raise ValueError(f"inner={shape.inner} is not a multiple of d_model={shape.d_model}")
        batches = [self._batch(s) for s in range(shape.warmup + shape.steps)]
        source = _Batches(batches)
        mesh = make_mesh(nodes, local, devices=jax.devices()[: nodes * local])  # a test process may have more
        self.trainer = Trainer(cfg, mesh, data=source, eval_data=source, progress=False, log=False)
        self.batches = batches
        self.state = self.trainer.init_state()
        self.trainer.compile(self.state, self.trainer.prepare(batches[0]))
        self.info = {"jax": jax.__version__, "threads_set": threads, "mesh": shape.mesh, "devices": nodes * local}

    def _batch(self, step: int) -> dict[str, np.ndarray]:
        """The model's batch format (`jaxscale.sequences.examples`): store indices = item + 1."""
        items, target = histories(self.shape, step)
        b, l = items.shape
        return {
            "item_ids": (items + 1).astype(np.int32),
            "timestamps": (1_600_000_000 + 3600 * np.arange(l))[None].repeat(b, 0).astype(np.int32),
            "actions": np.full((b, l), 4, np.int32),
            "surfaces": np.zeros((b, l), np.int32),
            "engaged": np.zeros((b, l), np.float32),
            "mask": np.ones((b, l), bool),
            "target_item_ids": (target + 1).astype(np.int32),
        }

    def step(self, s: int) -> tuple[float, float]:
        t = time.perf_counter()
        batch = self.trainer.prepare(self.batches[s])
        self.state, metrics = self.trainer.train_step(self.state, batch)
        metrics = {k: float(self.host(v)) for k, v in metrics.items()}
        return time.perf_counter() - t, metrics["loss"]

    def read_threads(self):
        self.info["threads"] = xla_intra_op_threads()


class _Batches:
    def __init__(self, batches):
        self.batches = batches

    def batch(self, step: int):
        return self.batches[step % len(self.batches)]


class TorchEngine:
    """`sasrec_torch` with `threads` torch threads; `compiled`: under torch.compile."""

    def __init__(self, shape: Shape, threads: int, compiled: bool = False):
        import torch

        from jaxscale.benchmarks import sasrec_torch

        torch.set_num_threads(threads)
        torch.manual_seed(0)
        cfg = sasrec_torch.SASRecConfig(
            items=shape.items,
            max_len=shape.events,
            d_model=shape.d_model,
            num_layers=shape.layers,
            num_heads=shape.heads,
            inner=shape.inner,
        )
        self.model, self.opt = sasrec_torch.build(cfg)
        self.model.train()
        if compiled:
            self.model.loss = torch.compile(self.model.loss)
        self.torch, self.compiled = torch, compiled
        self.batches = []
        for s in range(shape.warmup + shape.steps):
            items, target = histories(shape, s)
            nxt = np.concatenate([items[:, 1:], target[:, None]], axis=1)
            self.batches.append((items, nxt))
        t = time.perf_counter()
        self.step(0)  # torch.compile compiles here
        self.info = {
            "torch": torch.__version__,
            "threads_set": threads,
            "threads": torch.get_num_threads(),
            "compiled": compiled,
            "first_step_s": time.perf_counter() - t,
        }

    def step(self, s: int) -> tuple[float, float]:
        from jaxscale.benchmarks.sasrec_torch import train_step

        items, nxt = self.batches[s]
        t = time.perf_counter()
        loss = train_step(self.model, self.opt, self.torch.from_numpy(items), self.torch.from_numpy(nxt))
        return time.perf_counter() - t, loss


def _engine(kind: str, shape: Shape, threads: int):
    if kind == "jaxscale":
        return JaxscaleEngine(shape, threads)
    return TorchEngine(shape, threads, compiled=kind == "torch_compile")


def session(kind: str):
    """The worker handler of one engine session: warm-up steps, then the timed ones."""

    def handler(spec: dict) -> dict:
        shape = Shape(**spec["shape"])
        engine = _engine(kind, shape, int(spec["threads"]))
        times, losses = [], []
        for s in range(shape.warmup + shape.steps):
            dt, loss = engine.step(s)
            times.append(dt)
            losses.append(loss)
        if hasattr(engine, "read_threads"):
            engine.read_threads()
        return {"warmup_s": times[: shape.warmup], "times_s": times[shape.warmup :], "losses": losses, **engine.info}

    return handler


# ----------------------------------------------------------------------------------------- parent


def launch_session(engine: str, spec: dict, tmp: str, timeout_s: float) -> dict:
    """One engine session in its own process, its XLA and torch threads set to spec['threads'] (and jaxscale's
    simulated CPU devices to its mesh's)."""
    threads = str(spec["threads"])
    devices = Shape(**spec["shape"]).devices if engine == "jaxscale" else 1
    flags = f"--xla_force_host_platform_device_count={devices}"
    env = child_env(**xla_env(int(threads)), OMP_NUM_THREADS=threads, XLA_FLAGS=flags)
    return run_session(module_command(WORKER), engine, [spec], tmp=tmp, timeout_s=timeout_s, env=env)[0]


def default_mesh(batch: int, threads: int) -> str:
    """One simulated device per intra-op thread (1x2 on 2 cores) when the batch splits evenly, else 1x1.

    Measured on a 2-core machine (docs/benchmarks.md): two single-threaded devices, each training half the
    batch, beat one device on two threads, which splits few of the step's many small fusions over both cores;
    what the second device adds (the row-wise exchanges of the item table and the dense gradients' all-reduce,
    in-process copies on CPU) costs less."""
    return f"1x{threads}" if threads > 1 and batch % threads == 0 else "1x1"


def run(cfg: dict, tmp: str, alternate, timeout_s: float = 1800, launch=launch_session) -> dict:
    """Sessions of every engine, alternated; returns examples/s, spread and per-round ratios.

    `cfg`: the `Shape` fields, `rounds`, `threads` (default: the usable cores), `engines` (default: all;
    without torch only jaxscale runs and `torch_skipped` says why). `launch(engine, spec, tmp, timeout_s)`
    runs one session (default: its own process)."""
    from jaxscale.benchmarks.sasrec_torch import torch_installed

    threads = int(cfg.get("threads") or usable_cores())
    fields = {f.name: cfg[f.name] for f in dataclasses.fields(Shape) if f.name in cfg}
    shape = Shape(**{"mesh": default_mesh(int(cfg.get("batch", Shape.batch)), threads), **fields})
    engines = list(cfg.get("engines", ENGINES))
    skipped = None
    if not torch_installed():
        skipped = "torch is not installed: the PyTorch reference was not run"
        engines = [e for e in engines if e not in TORCH_ENGINES]

    def go(engine):
        def one():
            spec = {"shape": dataclasses.asdict(shape), "threads": threads}
            try:
                return launch(engine, spec, tmp, timeout_s)
            except Exception as e:  # noqa: BLE001 - an engine that fails is reported, the others still run
                if engine == "jaxscale":
                    raise
                return {"error": str(e)[-2000:]}

        return one

    runs = alternate({e: go(e) for e in engines})
    out = {}
    for name, results in runs["results"].items():
        failed = [r["error"] for r in results if "error" in r]
        if failed:
            out[name] = {"error": failed[0]}
            continue
        times = [t for r in results for t in r["times_s"]]
        info = {k: v for k, v in results[0].items() if k not in ("times_s", "warmup_s", "losses")}
        s = spread(times)
        out[name] = {
            **s,
            "examples_per_s": shape.batch / (s["median_ms"] / 1e3),
            "worst_examples_per_s": shape.batch / (s["max_ms"] / 1e3),
            "session_medians_ms": [spread(r["times_s"])["median_ms"] for r in results],
            "session_threads": [r.get("threads") for r in results],
            "losses_first_session": results[0]["losses"],
            "info": info,
            "background_busy": runs["busy"][name],
        }
    return {
        "shape": dataclasses.asdict(shape),
        "threads": threads,
        "engines": out,
        "speed": speed_vs(out),
        "order": runs["order"],
        "torch_skipped": skipped,
    }


def speed_vs(engines: dict) -> dict:
    """jaxscale's speed against each torch engine that ran: their median step time / jaxscale's, the
    per-round ratios (sessions of round r ran side by side) and the worst round's."""
    jx = engines.get("jaxscale")
    if not jx or "error" in jx:
        return {}
    out = {}
    for name in TORCH_ENGINES:
        e = engines.get(name)
        if not e or "error" in e:
            continue
        rounds = [1 / r for r in round_ratios(jx["session_medians_ms"], e["session_medians_ms"])]
        out[name] = {"speed": e["median_ms"] / jx["median_ms"], "round_speeds": rounds, "worst_round": min(rounds)}
    return out


if __name__ == "__main__":
    import jax

    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", 1)  # one CPU device; its intra-op threads come from the environment
    sys.exit(worker_main({kind: session(kind) for kind in ENGINES}))
