"""The serving command line: a leaf and a root started as separate processes (`python -m jaxscale.serving`),
on free ports of 127.0.0.1, answering a real HTTP request exactly like the in-process model."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.serving import wire
from jaxscale.serving.export import UnusedFeatureWarning, export_model
from jaxscale.serving.signature import FeatureSpec

REPO = Path(__file__).resolve().parents[1]
SPECS = (FeatureSpec("dense", "float32", (3,)), FeatureSpec("ids", "int32", (4,)), FeatureSpec("spare", "float32"))


def model(f):
    ids = f["ids"]
    return {"score": jnp.tanh(f["dense"].sum(-1) + jnp.where(ids >= 0, ids, 0).sum(-1).astype(jnp.float32) / 10)}


def start(args, env):
    """Start ``python -m jaxscale.serving ARGS``; return the process and the URL it prints once it serves."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxscale.serving", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()  # "... serving on http://127.0.0.1:PORT"
    if "serving on " not in line:
        proc.kill()
        raise AssertionError(f"{args[0]} did not start: {line!r} (exit {proc.wait()})")
    return proc, line.rsplit(" ", 1)[1].strip()


def test_leaf_and_root_processes_serve_a_request(tmp_path):
    with pytest.warns(UnusedFeatureWarning, match="spare"):
        exported = export_model(model, SPECS, model="tiny", version="1", store=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    procs = []
    try:
        leaf, leaf_url = start(["leaf", "--store", str(tmp_path), "--model", "tiny", "--version", "1"], env)
        procs.append(leaf)
        root, root_url = start(
            ["root", "--store", str(tmp_path), "--leaf", f"tiny/1={leaf_url}", "--compression", "lz4"], env
        )
        procs.append(root)
        rng = np.random.default_rng(0)
        features = {
            "dense": rng.standard_normal((6, 3)).astype(np.float32),
            "ids": rng.integers(-1, 9, (6, 4)).astype(np.int32),
            "other": rng.standard_normal((6, 7)).astype(np.float32),
        }
        request = urllib.request.Request(
            root_url + "/predict", data=wire.encode(features), headers={"Content-Type": wire.MEDIA_TYPE}
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            fanout = json.loads(r.headers["X-Jaxscale-Fanout"])
            out = wire.decode(r.read())
        assert fanout["tiny/1"]["features"] == 2 and fanout["tiny/1"]["fail_open"] is None
        expected = np.asarray(exported.call({**features, "spare": np.zeros((6,), np.float32)})["score"])
        assert wire.to_numpy(out, "tiny/1/score").tobytes() == expected.tobytes()
        for p in reversed(procs):  # SIGTERM: a graceful stop, exit status 0
            p.terminate()
            assert p.wait(timeout=30) == 0
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def test_the_root_does_not_import_jax():
    code = "import sys; import jaxscale.serving.root, jaxscale.serving.trim; print('jax' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def independent(f):
    return {"score": jnp.tanh(f["dense"].sum(-1))}


def test_warmup_compiles_the_default_buckets_of_a_model_scoring_examples_independently(tmp_path):
    """No --batch-buckets: a signature saying examples are scored independently gets powers of two up to
    max_batch, all compiled at warm-up; requests of new sizes compile nothing more. Without the flag nothing is
    padded (a batch-dependent model must see its real batch), and warm-up still runs batch 1."""
    from jaxscale.serving.leaf import Leaf, LeafConfig, default_buckets
    from jaxscale.serving.signature import Signature

    specs = SPECS[:1]
    export_model(independent, specs, model="ind", version="1", store=tmp_path, independent_examples=True)
    export_model(independent, specs, model="dep", version="1", store=tmp_path)
    assert Signature.load(tmp_path / "ind" / "1" / "signature.json").independent_examples
    assert not Signature.load(tmp_path / "dep" / "1" / "signature.json").independent_examples
    assert default_buckets(8) == (1, 2, 4, 8) and default_buckets(12) == (1, 2, 4, 8, 12)
    leaf = Leaf(LeafConfig(tmp_path, "ind", "1", warmup=True, max_batch=8))
    assert leaf.buckets == (1, 2, 4, 8) and leaf._call._cache_size() == 4  # every bucket compiled before serving
    rng = np.random.default_rng(0)
    for rows in (3, 5, 7, 8, 1):
        dense = rng.standard_normal((rows, 3)).astype(np.float32)
        out = leaf.predict({"dense": dense})["score"]
        np.testing.assert_allclose(out, np.tanh(dense.sum(-1)), rtol=1e-6)
    assert leaf._call._cache_size() == 4  # served from the warm programs
    dep = Leaf(LeafConfig(tmp_path, "dep", "1", warmup=True))
    assert dep.buckets == () and dep._call._cache_size() == 1


def test_a_model_that_cannot_run_here_fails_the_leaf_start_up(tmp_path):
    """Exported for GPUs only, served on CPUs: --warmup makes the leaf exit non-zero with a message naming the
    problem, instead of reporting healthy and failing every request."""
    export_model(independent, SPECS[:1], model="gpu", version="1", store=tmp_path, platforms=["cuda"])
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    args = ["leaf", "--store", str(tmp_path), "--model", "gpu", "--version", "1", "--warmup"]
    proc = subprocess.run(
        [sys.executable, "-m", "jaxscale.serving", *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 3 and "serving on" not in proc.stdout, (proc.returncode, proc.stdout)
    assert "gpu/1: the model cannot run on this machine (cpu)" in proc.stderr and "cuda" in proc.stderr


def test_sigterm_drains_readyz_first_then_the_leaf_exits(tmp_path):
    """--drain: on SIGTERM /readyz answers 503 (draining) while /healthz and requests still answer, then the
    listener closes and the process exits 0."""
    import signal
    import time
    import urllib.error

    export_model(independent, SPECS[:1], model="tiny", version="1", store=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    proc, url = start(["leaf", "--store", str(tmp_path), "--model", "tiny", "--version", "1", "--drain", "5"], env)

    def status(path):
        try:
            with urllib.request.urlopen(url + path, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        assert status("/readyz") == 200 and status("/healthz") == 200
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 4
        while status("/readyz") != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status("/readyz") == 503 and status("/healthz") == 200  # not ready, still live and serving
        assert proc.wait(timeout=60) == 0 and time.monotonic() - t0 >= 4.5
    finally:
        proc.kill()
        proc.wait(timeout=30)
