"""The benchmark suite's machinery (experiments/bench/, importable through pytest's `pythonpath`).

Fast checks of what decides the numbers: the alternation of whole sessions, the worker protocol's failure
handling (a failed process takes its peers down, a hung one is killed), the load gate, the byte model
applied to TorchRec's collectives, the ratios and targets of the comparison rows, and the Markdown being
computed from the recorded JSON. One slow test runs a tiny one-device session end to end."""

from __future__ import annotations

import ast
import json
import os
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import common
import equal_devices
import numpy as np
import pytest
import stages
import suite

from jaxscale import bench as entry

BENCH_DIR = Path(common.__file__).resolve().parent


def test_zipf_ids_are_in_range_and_skewed():
    ids = common.zipf_ids(np.random.default_rng(0), 1000, (256, 20), 1.1)
    assert ids.dtype == np.int32 and ids.shape == (256, 20)
    assert ids.min() >= 0 and ids.max() < 1000
    counts = np.bincount(ids.ravel(), minlength=1000)
    assert counts.max() > 20 * np.median(counts[counts > 0])  # a hot row
    np.testing.assert_array_equal(ids, common.zipf_ids(np.random.default_rng(0), 1000, (256, 20), 1.1))


def test_alternate_rotates_and_runs_one_session_at_a_time():
    running, log = [], []

    def session(name):
        def go():
            assert not running, f"{name} started while {running} ran"
            running.append(name)
            log.append(name)
            running.remove(name)
            return len(log)

        return go

    out = common.alternate({n: session(n) for n in "ABC"}, rounds=3)
    assert out["order"] == list("ABCBCACAB") == log
    assert out["results"]["A"] == [1, 6, 8]


def _worker_script(tmp_path: Path) -> Path:
    script = tmp_path / "toy_worker.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            import common

            def ok(spec):
                return {"double": 2 * spec["x"]}

            def fail(spec):
                raise ValueError(f"bad x {spec['x']}")

            def hang(spec):
                time.sleep(60)
                return {}

            def mixed(spec):
                if spec["x"] == 0:
                    raise RuntimeError("rank 0 broke")
                time.sleep(60)  # a peer that would wait forever
                return {}

            sys.exit(common.worker_main({"ok": ok, "fail": fail, "hang": hang, "mixed": mixed}))
            """
        )
    )
    return script


def _env():
    return common.child_env(PYTHONPATH=os.pathsep.join([str(BENCH_DIR), os.environ.get("PYTHONPATH", "")]))


def test_run_session_returns_every_result(tmp_path):
    script = _worker_script(tmp_path)
    out = common.run_session(script, "ok", [{"x": 1}, {"x": 5}], tmp=tmp_path, timeout_s=60, env=_env())
    assert out == [{"double": 2}, {"double": 10}]


def test_run_session_failure_names_the_error_and_kills_the_peers(tmp_path):
    script = _worker_script(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(common.WorkerError, match="rank 0 broke"):
        common.run_session(script, "mixed", [{"x": 0}, {"x": 1}], tmp=tmp_path, timeout_s=50, env=_env())
    assert time.monotonic() - t0 < 30  # the sleeping peer was killed, not waited for
    with pytest.raises(common.WorkerError, match=r"ValueError: bad x 3"):
        common.run_session(script, "fail", [{"x": 3}], tmp=tmp_path, timeout_s=60, env=_env())


def test_run_session_kills_a_hung_worker_at_the_timeout(tmp_path):
    script = _worker_script(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(common.WorkerError, match="still running after 2 s, killed"):
        common.run_session(script, "hang", [{"x": 0}], tmp=tmp_path, timeout_s=2, env=_env())
    assert time.monotonic() - t0 < 20


def test_worker_main_writes_errors_and_usage(tmp_path):
    result = tmp_path / "r.json"
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"x": 2}))
    assert common.worker_main({"ok": lambda s: {"y": s["x"]}}, ["ok", str(spec), str(result)]) == 0
    assert json.loads(result.read_text()) == {"y": 2}
    assert common.worker_main({"ok": lambda s: 1 / 0}, ["ok", str(spec), str(result)]) == 1
    assert json.loads(result.read_text())["error"].startswith("ZeroDivisionError")
    assert common.worker_main({"ok": lambda s: {}}, ["nope", str(spec), str(result)]) == 2


def test_load_gate(monkeypatch):
    monkeypatch.setattr(common, "load_average", lambda: [3.0, 2.0, 1.0])
    gate = common.LoadGate(max_load=0.5, max_busy=0.2, allow=False)
    assert not gate.start_ok
    assert gate.problems([0.1]) == ["load average 3.00 at start > 0.5"]
    monkeypatch.setattr(common, "load_average", lambda: [0.1, 0.2, 0.3])
    gate = common.LoadGate(max_load=0.5, max_busy=0.2, allow=False)
    assert gate.start_ok and gate.problems([0.1, 0.05]) == []
    assert gate.problems([0.1, 0.5]) == ["other processes used 50% of the CPU > 20%"]
    busy = common.background_busy(0.2)
    assert busy is None or 0.0 <= busy <= 1.0


def test_suite_refuses_a_loaded_machine(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(common, "load_average", lambda: [9.0, 9.0, 9.0])
    code = suite.main(["--quick", "--out", str(tmp_path / "r"), "--max-load", "1"])
    assert code == suite.EXIT_LOADED
    assert "refusing to benchmark: load average 9.00 > --max-load 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_torchrec_byte_model():
    """all-to-all: the part leaving the rank (exact splits when counted); all-gather (W-1) x input;
    reduce-scatter (W-1)/W x input; all-reduce 2(W-1)/W x input; averaged over the timed steps."""
    step = {
        "all_to_all_single[int64]": {"calls": 1, "bytes": 800, "offrank_bytes": 600},
        "all_gather_into_tensor[float32]": {"calls": 1, "bytes": 100, "offrank_bytes": 0},
        "reduce_scatter_tensor[float32]": {"calls": 1, "bytes": 400, "offrank_bytes": 0},
        "all_reduce[float32]": {"calls": 1, "bytes": 40, "offrank_bytes": 0},
    }
    twice = dict(step, **{"all_to_all_single[int64]": {"calls": 1, "bytes": 800, "offrank_bytes": 200}})
    res = {"comm": [[{}, step, twice], [{}, step, step]]}  # 2 ranks x 3 steps; step 0 is warm-up
    got = equal_devices.torchrec_bytes(res, world=4, timed=slice(1, None))
    assert got["all_to_all_single[int64]"] == pytest.approx((600 + 200) / 2 + 600)
    assert got["all_gather_into_tensor[float32]"] == pytest.approx(2 * 300)
    assert got["reduce_scatter_tensor[float32]"] == pytest.approx(2 * 300)
    assert got["all_reduce[float32]"] == pytest.approx(2 * 60)


def _engines():
    def cfg(sharding, precision, ms, per_device):
        return {
            "sharding": sharding,
            "precision": precision,
            "median_ms": ms,
            "bytes_per_device": per_device,
            "bytes_cluster_per_kind": {"all-to-all[u8]": per_device},
        }

    return {
        "jaxscale_sim": {
            "2": {
                "configs": {
                    "row_wise/fp32": cfg("row_wise", "fp32", 30.0, 1000),
                    "row_wise/fp8": cfg("row_wise", "fp8", 20.0, 200),
                }
            },
        },
        "jaxscale_mp": {
            "2": {"configs": {"row_wise/fp32": cfg("row_wise", "fp32", 15.0, 1000) | {"reruns": 1, "reruns_warmup": 2}}}
        },
        "torchrec": {
            "2": {
                "configs": {
                    "row_wise/fp32": cfg("row_wise", "fp32", 20.0, 1000),
                    "row_wise/fp16": cfg("row_wise", "fp16", 10.0, 500),
                }
            },
        },
    }


def test_comparisons_match_precisions_and_compute_ratios():
    rows = {r["precision"]: r for r in equal_devices.comparisons(_engines(), ["2"])}
    fp32, fp8 = rows["fp32"], rows["fp8"]
    assert fp32["torchrec_precision"] == "fp32" and fp32["time_ratio_sim"] == pytest.approx(1.5)
    assert fp32["time_ratio_mp"] == pytest.approx(0.75) and fp32["bytes_ratio"] == pytest.approx(1.0)
    assert fp32["jaxscale_bytes"] == 2000 and fp32["bytes_target"] == 1.0
    # fp8 is compared with TorchRec's narrowest precision that runs on CPU, against the 0.5x bytes target
    assert fp8["torchrec_precision"] == "fp16" and "FP8 QComms fail on CPU" in fp8["match"]
    assert fp8["time_ratio_sim"] == pytest.approx(2.0) and fp8["bytes_ratio"] == pytest.approx(0.4)
    assert fp8["bytes_target"] == 0.5 and fp8["time_ratio_mp"] is None
    assert equal_devices.JAXSCALE_PRECISIONS["fp8"] == ("fp8", "fp8")  # fp8 both ways, as TorchRec's FP8 QComms


def test_the_ladders_fp8_bf16_row_holds_each_direction_to_its_target():
    engines = _engines()
    engines["jaxscale_sim"]["2"]["configs"]["row_wise/fp8/bf16"] = {
        "sharding": "row_wise",
        "precision": "fp8/bf16",
        "median_ms": 25.0,
        "bytes_per_device": 370,
    }
    rows = {r["precision"]: r for r in equal_devices.comparisons(engines, ["2"])}
    mixed = rows["fp8/bf16"]
    assert equal_devices.JAXSCALE_PRECISIONS["fp8/bf16"] == ("fp8", "bf16")
    assert mixed["torchrec_precision"] == "fp16" and mixed["bytes_target"] == 0.75
    assert mixed["bytes_ratio"] == pytest.approx(0.74)


def test_merge_sessions_pools_steps_and_keeps_only_the_error_of_a_failed_config():
    def session(a_times, b):
        return {
            "configs": {
                "row_wise/fp32": {"sharding": "row_wise", "precision": "fp32", "times_s": a_times, "warmup_s": [9.0]},
                "table_wise/fp8": b,
            }
        }

    ok_b = {"sharding": "table_wise", "precision": "fp8", "times_s": [0.5], "bytes_per_device": 10.0}
    bad_b = {"sharding": "table_wise", "precision": "fp8", "error": "RuntimeError: boom"}
    merged = equal_devices.merge_sessions([session([0.010, 0.030], ok_b), session([0.020], bad_b)])
    a = merged["row_wise/fp32"]
    assert a["n"] == 3 and a["median_ms"] == pytest.approx(20.0)
    counted = {"reruns": 1, "reruns_warmup": 2, "overflow_rows": 0}
    twice = equal_devices.merge_sessions([{"configs": {"t": ok_b | counted}}, {"configs": {"t": ok_b | counted}}])
    assert (twice["t"]["reruns"], twice["t"]["reruns_warmup"], twice["t"]["overflow_rows"]) == (2, 4, 0)
    assert a["session_medians_ms"] == pytest.approx([20.0, 20.0])
    assert merged["table_wise/fp8"] == bad_b  # no timings or bytes from the session that worked


def test_plan_pairs_every_jaxscale_precision_with_a_torchrec_run():
    cfg = {"worlds": (2, 4), "shardings": ("table_wise", "row_wise"), "precisions": ("fp32", "bf16", "fp8")}
    p = equal_devices.plan(cfg)
    assert set(p) == {"1", "2", "4"}
    assert p["4"]["torchrec"] == (("table_wise", "row_wise"), ("fp32", "fp16"))
    assert len(p["2"]["jaxscale"]) == 6 and p["1"]["jaxscale"] == [("table_wise", "fp32")]


def test_technique_ladder():
    ladder = stages.technique_stages()
    assert [s.name for s in ladder] == ["baseline", "+fp8", "+balanced", "+half_dim", "2d_ar", "2d_a2a"]
    comm = [(s.settings.comm.forward, s.settings.comm.backward) for s in ladder]
    assert comm == [("fp32", "fp32")] + [("fp8", "bf16")] * 5  # then fp8 fwd, bf16 bwd
    assert [s.settings.topology for s in ladder] == ["1d"] * 4 + ["2d_ar", "2d_a2a"]
    for before, after in zip(ladder, ladder[1:]):  # cumulative: a technique once on stays on
        assert after.balanced >= before.balanced and after.half_dim >= before.half_dim


def _recorded():
    comparisons = equal_devices.comparisons(_engines(), ["2"])
    return {
        "command": "python -m jaxscale.bench --quick",
        "quick": True,
        "machine": {
            "cpu_model": "Test CPU",
            "cores": 2,
            "usable_cores": 2,
            "memory": "1 kB",
            "load_average": [0.1, 0.1, 0.1],
            "python": "3.11",
            "platform": "test",
            "numpy": "2",
        },
        "wall_s": 12.0,
        "ok": True,
        "parts": {
            "equal_devices": {
                "shape": {"tables": 2, "rows": 100, "dim": 8, "batch": 16, "hotness": 4, "zipf": 1.1, "warmup": 1}
                | {"steps": 2, "lr": 0.01, "eps": 1e-8},
                "rounds": 1,
                "reuse_capacities": True,
                "engines": _engines(),
                "comparisons": comparisons,
                "load_average_before": [0.1, 0.1, 0.1],
                "load_average_after": [0.7, 0.2, 0.1],
                "background_busy": [0.02, 0.03],
                "problems": [],
            }
        },
    }


def test_render_is_computed_from_the_recorded_result(tmp_path):
    res = _recorded()
    text = suite.render(res)
    assert "| 2 | row_wise | fp32 | fp32 | 30.0 | 15.0 | 20.0 | 1.50x | 0.75x | 2,000 | 2,000 | 1.00x |" in text
    assert "time 1p no, time Wp yes, bytes yes" in text
    assert (
        "| 2 | row_wise | fp8 | fp16 | 20.0 | - | 10.0 | 2.00x | - | 400 | 1,000 | 0.40x | time 1p no, bytes yes |"
        in text
    )
    assert "Load average (1 min) 0.10 before, 0.70 after; other processes' CPU before each session: max 3%" in text
    assert "time ratio 1.50x to 2.00x TorchRec; 0 of 2 rows meet" in text
    assert "jaxscale: `reuse_capacities=True`: the host counts the first batch's capacities" in text
    assert "| jaxscale_mp | 2 | row_wise/fp32 | 15.0 | - | - | all-to-all[u8] 1,000 | - | 1 (+2 warm-up) | - |" in text
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    assert suite.main(["--render", str(path)]) == 0
    assert (tmp_path / "r.md").read_text() == text + "\n"
    res["parts"]["equal_devices"]["problems"] = ["load average 3.00 at start > 0.5"]
    assert "**Timings not valid: load average 3.00 at start > 0.5.**" in suite.render(res)


def test_entry_point_finds_the_checkout_and_explains_when_it_cannot(monkeypatch, tmp_path, capsys):
    found = entry.find_suite()
    assert found is not None and found == BENCH_DIR / "suite.py"
    monkeypatch.setattr(entry, "candidates", lambda: [tmp_path])
    assert entry.main(["--help"]) == 0
    calls = []
    monkeypatch.setattr(entry.subprocess, "call", lambda args: calls.append(args) or 0)
    assert entry.main(["--quick"]) == 0  # an installed package benchmarks itself in a fresh interpreter
    assert "set JAXSCALE_SOURCE" in capsys.readouterr().err
    assert calls and "installed_benchmark" in calls[0][-1] and "quick=True" in calls[0][-1]


def test_nothing_in_the_package_imports_experiments():
    pkg = Path(entry.__file__).resolve().parent
    bench_modules = {p.stem for p in BENCH_DIR.glob("*.py")} | {"torchrec_runner", "experiments"}
    for path in pkg.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.split(".")[0] in bench_modules for n in names), f"{path} imports {names}"
        assert "sys.path.insert" not in path.read_text(), path


@pytest.mark.slow
def test_one_device_session_end_to_end(tmp_path):
    """Tiny workload, jaxscale and the NumPy reference, one session each: timings and the table check."""
    cfg = dict(rows=2000, dim=8, batch=64, hotness=4, zipf=1.1, warmup=1, steps=2, engines=("jaxscale", "numpy"))
    out = __import__("one_device").run(cfg, str(tmp_path), partial(common.alternate, rounds=1))
    assert out["check"]["ok"], out
    for name in ("jaxscale", "numpy"):
        e = out["engines"][name]
        assert e["n"] == 2 and e["median_ms"] > 0
        assert e["max_abs_diff_rows"] <= 1e-6
    assert out["order"] == ["jaxscale", "numpy"]
    assert sys.executable  # the sessions ran under this interpreter (child_env keeps the environment)


def test_collective_latency_runs_checks_every_result_and_renders_its_json(tmp_path):
    """The collective latency script end to end on 2 processes (--quick): every kind's result is checked
    inside the workers (a wrong sum or gather raises), and the Markdown is computed from the JSON."""
    import collective_latency

    out = tmp_path / "latency"
    assert collective_latency.main(["--quick", "--out", str(out)]) == 0
    r = json.loads(out.with_suffix(".json").read_text())
    assert r["worlds"] == [2] and r["sizes"] == [2, 24]
    for n in ("2", "24"):
        for kind in collective_latency.KINDS:
            assert r["results"]["2"][n][kind]["median_ms"] > 0
    md = out.with_suffix(".md").read_text()
    assert md == collective_latency.render(r)
    m = r["results"]["2"]["2"]
    assert f"| 2 | 2 | {m['all_reduce']['median_ms']:.3f} |" in md
