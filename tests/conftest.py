"""Test setup: 8 simulated CPU devices, set before anything imports JAX."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import socket  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

MESH_SHAPES = [(1, 8), (2, 4), (4, 2)]
MESH_IDS = ["1x8", "2x4", "4x2"]


def pytest_sessionstart(session):
    # A plugin that imported JAX first would silently leave us with one device.
    assert jax.device_count() == 8, f"expected 8 simulated CPU devices, got {jax.device_count()}"


@pytest.fixture(params=MESH_SHAPES, ids=MESH_IDS)
def mesh(request):
    import jaxscale

    return jaxscale.make_mesh(*request.param)


TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
_LAUNCH_VARS = ("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAXSCALE_", "SLURM_")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for coordinators and servers that tests start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(cache_dir=None) -> dict:
    """The environment for JAX subprocesses that tests launch (`python -m jaxscale.train`, workers).

    Without this conftest's 8-device flag (the launched program sets its own device count) and without
    launch variables; XLA:CPU at optimisation level 0 (compile time dominates these runs); with the tests
    folder importable (workers use the reference modules); optionally one persistent compilation cache.
    """
    e = dict(os.environ)
    flags = [f for f in e.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append("--xla_backend_optimization_level=0")
    e["XLA_FLAGS"] = " ".join(flags)
    e["JAX_PLATFORMS"] = "cpu"
    if cache_dir is not None:
        e["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
        e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)] + [p for p in [e.get("PYTHONPATH")] if p])
    for k in list(e):
        if k.startswith(_LAUNCH_VARS):
            del e[k]
    return e
