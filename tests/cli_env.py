"""The environment for `python -m jaxscale.train` subprocesses launched by tests."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LAUNCH_VARS = ("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAXSCALE_", "SLURM_")


def cli_env(cache_dir) -> dict:
    """os.environ without conftest's 8-device flag or any launch variables, compiling at XLA:CPU
    optimisation level 0 (compile time dominates these runs) into a shared persistent cache."""
    e = dict(os.environ)
    flags = [f for f in e.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append("--xla_backend_optimization_level=0")
    e["XLA_FLAGS"] = " ".join(flags)
    e["JAX_PLATFORMS"] = "cpu"
    e["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [e.get("PYTHONPATH")] if p])
    for k in list(e):
        if k.startswith(_LAUNCH_VARS):
            del e[k]
    return e
