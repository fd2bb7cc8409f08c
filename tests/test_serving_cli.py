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
