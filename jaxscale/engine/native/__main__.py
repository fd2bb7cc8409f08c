"""`python -m jaxscale.engine.native`: build (or find in the cache) the native kernels, check them, print the status.

Exit status 0 when the native kernels are available and agree with the pure-JAX kernels on a small
lookup + update, 1 otherwise (the reason is printed). `--json` prints the status as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def self_check() -> float:
    """Max |native - pure JAX| over a pooled lookup and a row-wise AdaGrad update of random data."""
    import jax
    import numpy as np

    from jaxscale.engine import native

    rng = np.random.default_rng(0)
    table = rng.normal(size=(500, 24)).astype(np.float32)
    acc = rng.uniform(0, 1, 500).astype(np.float32)
    ids = rng.integers(-1, 500, (64, 8)).astype(np.int32)
    grad = rng.normal(size=(64, 24)).astype(np.float32)
    results = {}
    for mode in ("1", "0"):
        os.environ["JAXSCALE_NATIVE"] = mode

        def step(t, a, x, g):
            out = native.gather_pool(t, x, pooling="mean")
            t, a = native.update_pooled(
                t, a, x, g, pooling="mean", optimizer="rowwise_adagrad", learning_rate=0.1, eps=1e-8, after=out
            )
            return out, t, a

        results[mode] = [np.asarray(v) for v in jax.jit(step)(table, acc, ids, grad)]
    return max(float(np.abs(a - b).max()) for a, b in zip(results["1"], results["0"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxscale.engine.native", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    args = parser.parse_args(argv)
    from jaxscale.engine.native import build, runtime

    requested = runtime.mode()
    if requested == "0":
        os.environ["JAXSCALE_NATIVE"] = "auto"  # report on the build even when it is disabled for use
    status = {"JAXSCALE_NATIVE": requested, "available": runtime.available()}
    status["reason"] = runtime.unavailable_reason()
    try:
        plan = build.plan_build()
        status.update(compiler=plan.compiler_version, flags=" ".join(plan.flags), cache_key=plan.key)
    except build.BuildError as e:
        status["compiler"] = f"none ({e})"
    status["library"] = str(runtime.library_path()) if status["available"] else None
    if status["available"]:
        status["max_abs_diff_native_vs_jax"] = self_check()
        status["ok"] = status["max_abs_diff_native_vs_jax"] < 1e-4
    else:
        status["ok"] = False
    os.environ["JAXSCALE_NATIVE"] = requested
    if args.json:
        print(json.dumps(status))
    else:
        for k, v in status.items():
            print(f"{k}: {v}")
    return 0 if status["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
