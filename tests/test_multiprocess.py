"""A real 2-process run ('node' = process, 4 CPU devices each) against the 1-process 8-device run and
the NumPy reference. Each process feeds only its half of the batch."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import mp_embedding_worker as scenario
import numpy as np
import pytest
from conftest import free_port, subprocess_env
from embedding_reference import adagrad_step
from embedding_reference import lookup as ref_lookup

import jaxscale

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 240  # the whole 2-process run (each config compiles once or twice as its counted capacities settle; a minute idle on 2 CPUs); a hang fails here with the workers' stderr  # noqa: E501
KILL_AFTER_S = 5  # `timeout -k 5`: SIGTERM, then SIGKILL 5 s later


def _stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(KILL_AFTER_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run_two_processes(tmp_path) -> dict:
    out = tmp_path / "mp.npz"
    port, env = free_port(), subprocess_env()
    procs, logs, alive = [], [], []
    try:
        for pid in range(2):
            log = open(tmp_path / f"worker{pid}.log", "w+")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "mp_embedding_worker.py"), str(pid), "2", str(port), str(out)],
                    cwd=HERE.parent,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one worker failed: the other would wait for it forever
            time.sleep(0.1)
        alive = [p.poll() is None for p in procs]
        timed_out = any(alive)
    finally:
        for p in procs:
            _stop(p)

    def report():
        text = []
        for pid, (p, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            lines = [ln for ln in log.read().splitlines() if not ln.startswith("[Gloo]")]
            how = "still running at the deadline, killed" if pid < len(alive) and alive[pid] else f"exit {p.returncode}"
            text.append(f"--- worker {pid} ({how}) ---\n" + "\n".join(lines[-40:]))
        return "\n".join(text)

    try:
        if timed_out:
            pytest.fail(f"2-process run did not finish within {TIMEOUT_S} s (killed)\n{report()}")
        if any(p.returncode != 0 for p in procs):
            pytest.fail(f"2-process run failed\n{report()}")
        assert out.exists(), report()
        with np.load(out) as z:
            return dict(z)
    finally:
        for log in logs:
            log.close()


def _reference() -> dict:
    """The NumPy reference of the scenario (independent of topology and sharding)."""
    cfgs = scenario.tables()
    w = {k: v.copy() for k, v in scenario.dense_tables().items()}
    acc = {k: np.zeros(v.shape[0], np.float32) for k, v in w.items()}
    res = {}
    for step, (ids, targets) in enumerate(scenario.global_batches()):
        out = ref_lookup(w, cfgs, ids)
        for f, v in out.items():
            res[f"out/{step}/{f}"] = v
        grads = {f: out[f] - targets[f] for f in ids}
        w, acc = adagrad_step(w, acc, cfgs, ids, grads, scenario.LR, scenario.EPS)
    for name in w:
        res[f"table/{name}"], res[f"acc/{name}"] = w[name], acc[name]
    return res


def test_two_processes_match_single_process_and_reference(tmp_path):
    multi = _run_two_processes(tmp_path)
    assert int(multi.pop("meta/process_count")) == 2 and int(multi.pop("meta/device_count")) == 8

    single = scenario.run_scenario(jaxscale.make_mesh(2, 4))
    # every process takes the same reuse / re-run decisions, and as many as one process does
    reruns = {k: (int(multi.pop(k)), int(single.pop(k))) for k in list(single) if k.endswith("/reruns")}
    assert sorted(reruns) == sorted(f"{scenario.key(*c)}/reruns" for c in scenario.CONFIGS)
    assert all(m == s for m, s in reruns.values()), reruns
    assert reruns[f"{scenario.key('1d', 'reuse')}/reruns"][0] >= 1, reruns  # the re-run path ran
    assert sorted(multi) == sorted(single)
    expected_keys = {f"{scenario.key(*c)}/{kind}" for c in scenario.CONFIGS for kind in ("out", "table", "acc")}
    assert {k.rsplit("/", 2)[0] if "/out/" in k else k.rsplit("/", 1)[0] for k in single} == expected_keys
    for k in sorted(single):
        assert multi[k].shape == single[k].shape, k
        np.testing.assert_allclose(multi[k], single[k], rtol=1e-6, atol=1e-7, err_msg=f"2-process vs 1-process: {k}")

    ref = _reference()
    w0 = scenario.dense_tables()
    for topology, sharding in scenario.CONFIGS:
        prefix = scenario.key(topology, sharding)
        for k, v in ref.items():
            np.testing.assert_allclose(
                multi[f"{prefix}/{k}"], v, rtol=1e-5, atol=1e-6, err_msg=f"vs reference: {prefix}/{k}"
            )
        for name, w in w0.items():  # training really moved the tables, and only the looked-up rows
            got = multi[f"{prefix}/table/{name}"]
            changed = np.any(got != w, axis=-1)
            assert changed.any(), (prefix, name)
            np.testing.assert_array_equal(changed, np.any(ref[f"table/{name}"] != w, axis=-1))
