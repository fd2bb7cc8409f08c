"""Test setup: 8 simulated CPU devices, set before anything imports JAX."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
