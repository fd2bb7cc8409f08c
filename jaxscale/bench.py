"""`python -m jaxscale.bench`: runs the benchmark suite of a jaxscale source checkout.

The suite (experiments/bench/suite.py) is an application, not library code: it drives FBGEMM and the
TorchRec baseline (experiments/baselines/, installed by its own script), starts worker processes and
writes experiments/results/. So it lives in the source tree, and this entry point only finds it and runs
it in a fresh interpreter with the same arguments; it imports nothing from experiments/.

Where it looks: $JAXSCALE_SOURCE (a checkout), then the checkout this package was imported from (an
editable install or PYTHONPATH), then the current directory and its parents.

An installed package without a checkout still benchmarks itself: `installed_benchmark` times one device's
lookup + row-wise AdaGrad with the engine (native kernels where they build, else pure JAX) beside the NumPy
reference (`jaxscale.reference`) on the same ids, checks the updated tables agree, and says what the full
suite (FBGEMM, TorchRec, equal devices) needs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SUITE = Path("experiments") / "bench" / "suite.py"


def candidates() -> list[Path]:
    out = []
    if os.environ.get("JAXSCALE_SOURCE"):
        out.append(Path(os.environ["JAXSCALE_SOURCE"]).expanduser())
    out.append(Path(__file__).resolve().parents[1])
    cwd = Path.cwd().resolve()
    out += [cwd, *cwd.parents]
    return out


def find_suite() -> Path | None:
    for root in candidates():
        if (root / SUITE).is_file() and (root / "jaxscale").is_dir():
            return root / SUITE
    return None


def _first_field(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> dict:
    """The machine a benchmark ran on (CPU model, cores, memory, load average now, software), for the
    description every recorded result carries (the experiment scripts add their own versions)."""
    import platform

    import numpy as np

    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "cpu_model": _first_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "nproc": os.cpu_count(),
        "memory": _first_field("/proc/meminfo", "MemTotal"),
        "loadavg_at_start": load,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
    }


def installed_benchmark(quick: bool) -> int:
    """One device: the engine's lookup + row-wise AdaGrad step vs the NumPy reference (medians, ratio)."""
    import statistics
    import time

    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    import jax.numpy as jnp
    import numpy as np

    import jaxscale
    from jaxscale import native, reference

    rows, batch, hot, dim, steps = (100_000, 1024, 20, 64, 8) if quick else (1_000_000, 4096, 20, 64, 15)
    table = jaxscale.TableConfig("t", rows=rows, dim=dim, pooling="sum")
    ec = jaxscale.EmbeddingCollection(
        [table], jaxscale.make_mesh(1, 1), jaxscale.EmbeddingSettings(optimizer=jaxscale.RowWiseAdagrad(0.01))
    )
    rng = np.random.default_rng(0)
    w0 = rng.normal(scale=0.01, size=(rows, dim)).astype(np.float32)
    batches = [np.minimum(rng.zipf(1.1, (batch, hot)) - 1, rows - 1).astype(np.int32) for _ in range(steps + 3)]

    @jax.jit
    def step(state, ids):
        out = ec.lookup(state, ids)
        return ec.update(state, ids, out)  # d(0.5 * |emb|^2)/d(emb) = emb

    state, times = ec.from_dense({"t": w0}), []
    for i, ids in enumerate(batches):
        sharded = ec.shard_batch({"t": ids})
        t0 = time.perf_counter()
        state = jax.block_until_ready(step(state, sharded))
        if i >= 3:  # after 3 warm-up steps (compilation)
            times.append(time.perf_counter() - t0)
    ref_w, ref_acc, ref_t = {"t": w0.copy()}, {"t": np.zeros(rows, np.float32)}, []
    for i, ids in enumerate(batches):
        t0 = time.perf_counter()
        out = reference.lookup(ref_w, [table], {"t": ids})
        ref_w, ref_acc = reference.adagrad_step(ref_w, ref_acc, [table], {"t": ids}, out, 0.01, 1e-8)
        if i >= 3:
            ref_t.append(time.perf_counter() - t0)
    diff = float(np.abs(ec.to_dense(state)["t"] - ref_w["t"]).max())
    ms, ref_ms = 1e3 * statistics.median(times), 1e3 * statistics.median(ref_t)
    kernels = "native" if native.available() else f"pure JAX ({native.unavailable_reason()})"
    print(
        f"| engine | median ms/step | speed vs NumPy |\n|---|---|---|\n| jaxscale ({kernels}) | {ms:.2f} | "
        f"{ref_ms / ms:.2f}x |\n| NumPy reference | {ref_ms:.2f} | 1.00x |"
    )
    print(
        f"one device, {rows} x {dim} table, {batch} bags x {hot} Zipf(1.1) ids, lookup + row-wise AdaGrad; "
        f"max |table difference| {diff:.1e}; load average {os.getloadavg()[0]:.2f}"
    )
    print(
        "The full suite (FBGEMM's CPU TBE, TorchRec on gloo ranks, equal-device and per-stage bytes) runs from "
        "a source checkout: python -m jaxscale.bench there, or set JAXSCALE_SOURCE."
    )
    return 0 if diff < 1e-4 and jnp.isfinite(diff) else 1


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    suite = find_suite()
    if suite is None:
        if any(a in ("-h", "--help") for a in argv):
            print(__doc__)
            return 0
        print(
            f"no jaxscale source checkout found ({SUITE}; set JAXSCALE_SOURCE to point at one): benchmarking the "
            "installed package",
            file=sys.stderr,
        )
        # a fresh interpreter: the benchmark sets JAX's device count, which must happen before JAX starts
        code = f"from jaxscale.bench import installed_benchmark as b; raise SystemExit(b(quick={'--quick' in argv}))"
        return subprocess.call([sys.executable, "-c", code])
    return subprocess.call([sys.executable, str(suite), *argv])


if __name__ == "__main__":
    sys.exit(main())
