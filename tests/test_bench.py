"""The benchmark suite's machinery (`jaxscale.benchmarks`, library code: an installed wheel runs it too).

Fast checks of what decides the numbers: the alternation of whole sessions, the worker protocol's failure
handling (a failed process takes its peers down, a hung one is killed), the load gate, thread parity (the
XLA pool's size is set and read back), the CPU flags, the byte model applied to TorchRec's collectives, the
ratios of the comparison rows (matched and fastest TorchRec configuration, per round, worst round), and the
Markdown being computed from the recorded JSON. One slow test runs a tiny one-device session end to end."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest

import jaxscale.bench as entry
from jaxscale.benchmarks import equal_devices, machine, one_device, report, sessions, stages, stats, suite, threads

REPO = Path(__file__).resolve().parents[1]


def test_zipf_ids_are_in_range_and_skewed():
    ids = stats.zipf_ids(np.random.default_rng(0), 1000, (256, 20), 1.1)
    assert ids.dtype == np.int32 and ids.shape == (256, 20)
    assert ids.min() >= 0 and ids.max() < 1000
    counts = np.bincount(ids.ravel(), minlength=1000)
    assert counts.max() > 20 * np.median(counts[counts > 0])  # a hot row
    np.testing.assert_array_equal(ids, stats.zipf_ids(np.random.default_rng(0), 1000, (256, 20), 1.1))


def test_round_ratios_pair_sessions_of_the_same_round():
    assert stats.round_ratios([10.0, 30.0], [20.0, 20.0]) == [0.5, 1.5]
    with pytest.raises(ValueError, match="rounds differ: 2 sessions against 1"):
        stats.round_ratios([1.0, 2.0], [1.0])


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

    out = sessions.alternate({n: session(n) for n in "ABC"}, rounds=3)
    assert out["order"] == list("ABCBCACAB") == log
    assert out["results"]["A"] == [1, 6, 8]


def _worker_script(tmp_path: Path) -> list[str]:
    script = tmp_path / "toy_worker.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            from jaxscale.benchmarks import sessions

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

            sys.exit(sessions.worker_main({"ok": ok, "fail": fail, "hang": hang, "mixed": mixed}))
            """
        )
    )
    return sessions.script_command(script)


def test_run_session_returns_every_result(tmp_path):
    command = _worker_script(tmp_path)
    out = sessions.run_session(command, "ok", [{"x": 1}, {"x": 5}], tmp=tmp_path, timeout_s=60)
    assert out == [{"double": 2}, {"double": 10}]


def test_run_session_failure_names_the_error_and_kills_the_peers(tmp_path):
    command = _worker_script(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(sessions.WorkerError, match="rank 0 broke"):
        sessions.run_session(command, "mixed", [{"x": 0}, {"x": 1}], tmp=tmp_path, timeout_s=50)
    assert time.monotonic() - t0 < 30  # the sleeping peer was killed, not waited for
    with pytest.raises(sessions.WorkerError, match=r"ValueError: bad x 3"):
        sessions.run_session(command, "fail", [{"x": 3}], tmp=tmp_path, timeout_s=60)


def test_run_session_kills_a_hung_worker_at_the_timeout(tmp_path):
    command = _worker_script(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(sessions.WorkerError, match="still running after 2 s, killed"):
        sessions.run_session(command, "hang", [{"x": 0}], tmp=tmp_path, timeout_s=2)
    assert time.monotonic() - t0 < 20


def test_worker_main_writes_errors_and_usage(tmp_path):
    result = tmp_path / "r.json"
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"x": 2}))
    assert sessions.worker_main({"ok": lambda s: {"y": s["x"]}}, ["ok", str(spec), str(result)]) == 0
    assert json.loads(result.read_text()) == {"y": 2}
    assert sessions.worker_main({"ok": lambda s: 1 / 0}, ["ok", str(spec), str(result)]) == 1
    assert json.loads(result.read_text())["error"].startswith("ZeroDivisionError")
    assert sessions.worker_main({"ok": lambda s: {}}, ["nope", str(spec), str(result)]) == 2


def test_load_gate(monkeypatch):
    monkeypatch.setattr(machine, "load_average", lambda: [3.0, 2.0, 1.0])
    gate = machine.LoadGate(max_load=0.5, max_busy=0.2, allow=False)
    assert not gate.start_ok
    assert gate.problems([0.1]) == ["load average 3.00 at start > 0.5"]
    monkeypatch.setattr(machine, "load_average", lambda: [0.1, 0.2, 0.3])
    gate = machine.LoadGate(max_load=0.5, max_busy=0.2, allow=False)
    assert gate.start_ok and gate.problems([0.1, 0.05]) == []
    assert gate.problems([0.1, 0.5]) == ["other processes used 50% of the CPU > 20%"]
    busy = machine.background_busy(0.2)
    assert busy is None or 0.0 <= busy <= 1.0


def test_suite_refuses_a_loaded_machine(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(machine, "load_average", lambda: [9.0, 9.0, 9.0])
    code = suite.main(["--parts", "stages", "--out", str(tmp_path / "r"), "--max-load", "1"])
    assert code == suite.EXIT_LOADED
    assert "refusing to benchmark: load average 9.00 > --max-load 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_machine_records_the_cpu_model_and_its_vector_flags():
    m = machine.machine()
    for key in ("cpu_model", "cpu_flags", "nproc", "usable_cores", "memory", "loadavg_at_start", "python"):
        assert key in m, key
    if Path("/proc/cpuinfo").exists():
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
        every = set(line.split(":", 1)[1].split())
        assert set(m["cpu_flags"]) <= every
        assert ("avx2" in m["cpu_flags"]) == ("avx2" in every)
        assert {f for f in every if f.startswith(("avx512", "amx"))} <= set(m["cpu_flags"])
    assert "CPU flags: avx2 avx512f (no AMX)" not in machine.describe_flags(["avx2", "avx512f"])
    assert machine.describe_flags(["avx", "avx2"]) == "CPU flags: avx avx2 (no AVX-512, no AMX)"
    assert machine.describe_flags([]) == "CPU flags: none of AVX/AVX2/AVX-512/AMX (no AVX-512, no AMX)"


def test_the_xla_pool_size_is_set_by_the_environment_and_read_back():
    """Thread parity rests on this: PJRT_NPROC sizes XLA:CPU's intra-op pool, counted after a computation."""
    assert threads.per_process(4, cores=2) == 1 and threads.per_process(1, cores=2) == 2
    assert threads.per_process(2, cores=16) == 8
    code = (
        "import jax.numpy as jnp; from jaxscale.benchmarks.threads import xla_intra_op_threads as t; "
        "(jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready(); print(t())"
    )
    n = threads.usable_cores() + 1  # not XLA's default (the usable cores): the environment decides
    env = sessions.child_env(**threads.xla_env(n))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == str(n)


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


def _cfg(sharding, precision, ms, sessions_ms, per_device, capacities=None):
    c = {
        "sharding": sharding,
        "precision": precision,
        "median_ms": ms,
        "session_medians_ms": sessions_ms,
        "bytes_per_device": per_device,
        "bytes_cluster_per_kind": {"all-to-all[u8]": per_device},
    }
    return c | ({"capacities": capacities} if capacities else {})


def _engines():
    return {
        "jaxscale_sim": {
            "2": {
                "threads": {"set": 2, "measured": [2]},
                "configs": {
                    "row_wise/fp32": _cfg("row_wise", "fp32", 30.0, [30.0, 30.0], 1000, "reuse"),
                    "row_wise/fp8": _cfg("row_wise", "fp8", 25.0, [25.0, 25.0], 200, "reuse"),
                },
            },
        },
        "jaxscale_mp": {
            "2": {
                "threads": {"set": 1, "measured": [1]},
                "configs": {
                    "row_wise/fp32": _cfg("row_wise", "fp32", 15.0, [14.0, 16.0], 1000, "reuse")
                    | {"reruns": 1, "reruns_warmup": 2},
                    "row_wise/fp8": _cfg("row_wise", "fp8", 20.0, [18.0, 22.0], 200, "reuse"),
                    "row_wise/fp32+count": _cfg("row_wise", "fp32", 18.0, [18.0, 18.0], 1100, "count"),
                },
            }
        },
        "torchrec": {
            "2": {
                "threads": {"set": 1, "measured": [1]},
                "configs": {
                    "row_wise/fp32": _cfg("row_wise", "fp32", 20.0, [20.0, 20.0], 1000),
                    "row_wise/fp16": _cfg("row_wise", "fp16", 25.0, [20.0, 30.0], 500),
                },
            },
        },
    }


def test_comparisons_set_w_processes_against_torchrec_matched_and_fastest_per_round():
    rows = {(r["precision"], r["capacities"]): r for r in equal_devices.comparisons(_engines(), ["2"])}
    fp32, fp8, count = rows["fp32", "reuse"], rows["fp8", "reuse"], rows["fp32", "count"]
    # equal devices: the W-process engine against TorchRec's W ranks; the in-process time rides along, labelled
    assert fp32["jaxscale_ms"] == 15.0 and fp32["in_process_ms"] == 30.0
    assert fp32["torchrec_precision"] == "fp32" and fp32["time_ratio"] == pytest.approx(0.75)
    assert fp32["time_round_ratios"] == pytest.approx([0.7, 0.8]) and fp32["time_worst_ratio"] == pytest.approx(0.8)
    assert fp32["torchrec_fastest_precision"] == "fp32" and fp32["time_fastest_worst_ratio"] == pytest.approx(0.8)
    assert fp32["bytes_ratio"] == pytest.approx(1.0) and fp32["jaxscale_bytes"] == 2000
    # fp8 is matched with TorchRec's fp16 (its narrowest that runs on CPU) and also set against its fastest, fp32
    assert fp8["torchrec_precision"] == "fp16" and "FP8 QComms fail on CPU" in fp8["match"]
    assert fp8["time_ratio"] == pytest.approx(0.8) and fp8["time_worst_ratio"] == pytest.approx(0.9)
    assert fp8["torchrec_fastest_precision"] == "fp32" and fp8["torchrec_fastest_ms"] == 20.0
    assert fp8["time_fastest_ratio"] == pytest.approx(1.0)
    assert fp8["time_fastest_round_ratios"] == pytest.approx([0.9, 1.1])
    assert report.holds(fp8, "time") and not report.holds(fp8, "time_fastest")  # fails on its worst round
    assert fp8["bytes_ratio"] == pytest.approx(0.4) and fp8["bytes_target"] == 0.5
    assert count["time_ratio"] == pytest.approx(0.9) and count["bytes_ratio"] == pytest.approx(1.1)
    assert equal_devices.JAXSCALE_PRECISIONS["fp8"] == ("fp8", "fp8")  # fp8 both ways, as TorchRec's FP8 QComms


def test_the_ladders_fp8_bf16_row_holds_each_direction_to_its_target():
    engines = _engines()
    engines["jaxscale_mp"]["2"]["configs"]["row_wise/fp8/bf16"] = _cfg("row_wise", "fp8/bf16", 25.0, [25, 25], 370)
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


def test_plan_runs_torchrec_fp32_and_fp16_and_a_count_row_beside_reuse():
    cfg = {"worlds": (2, 4), "shardings": ("table_wise", "row_wise"), "precisions": ("fp32", "bf16", "fp8")}
    p = equal_devices.plan(cfg)
    assert set(p) == {"1", "2", "4"}
    assert p["4"]["torchrec"] == (("table_wise", "row_wise"), ("fp32", "fp16"))
    assert equal_devices.plan(cfg | {"precisions": ("fp32",)})["2"]["torchrec"][1] == ("fp32", "fp16")
    assert len(p["2"]["jaxscale"]) == 6 + 2
    assert ("row_wise", "fp32", "count") in p["2"]["jaxscale"] and ("row_wise", "fp8", "reuse") in p["2"]["jaxscale"]
    assert p["1"]["jaxscale"] == [("table_wise", "fp32", "reuse"), ("table_wise", "fp32", "count")]
    every = equal_devices.plan(cfg | {"capacities": "count"})  # --count-every-batch: every row counts, no twin
    assert {c for _, _, c in every["2"]["jaxscale"]} == {"count"} and len(every["2"]["jaxscale"]) == 6
    assert equal_devices.config_name("row_wise", "fp8/bf16", "count") == "row_wise/fp8/bf16+count"


def test_technique_ladder():
    ladder = stages.technique_stages()
    assert [s.name for s in ladder] == ["baseline", "+fp8", "+balanced", "+half_dim", "2d_ar", "2d_a2a"]
    comm = [(s.settings.comm.forward, s.settings.comm.backward) for s in ladder]
    assert comm == [("fp32", "fp32")] + [("fp8", "bf16")] * 5  # then fp8 fwd, bf16 bwd
    assert [s.settings.topology for s in ladder] == ["1d"] * 4 + ["2d_ar", "2d_a2a"]
    for before, after in zip(ladder, ladder[1:]):  # cumulative: a technique once on stays on
        assert after.balanced >= before.balanced and after.half_dim >= before.half_dim


def test_stage_settings_are_the_flat_json_the_report_prints():
    rows = []
    for stage in stages.technique_stages():
        settings = stages.stage_settings(stage)
        json.dumps(settings)
        rows.append(
            {"stage": stage.name, "settings": settings, "global_batch": 8}
            | dict.fromkeys(
                ("intra_node_bytes_per_example", "inter_node_bytes_per_example", "total_bytes_per_example"), 2.0
            )
        )
    text = "\n".join(report.render_stages({"stages": rows, "mesh": [2, 4], "config": "c.yaml"}))
    assert "| +fp8 | 1d | fp8 / bf16 | no | no | 2.0 | 2.0 | 2.0 | 1.000 |" in text
    assert "| 2d_a2a | 2d_a2a | fp8 / bf16 | yes | yes |" in text


def _recorded():
    comparisons = equal_devices.comparisons(_engines(), ["2"])
    return {
        "command": "python -m jaxscale.bench --quick",
        "quick": True,
        "machine": {
            "cpu_model": "Test CPU",
            "cpu_flags": ["avx", "avx2", "avx512f"],
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
                "rounds": 2,
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
    text = report.render(res)
    assert "Test CPU, 2 cores (2 usable), 1 kB memory; CPU flags: avx avx2 avx512f;" in text
    assert (
        "| 2 | row_wise | fp32 | 15.0 | fp32 | 20.0 | 0.75x | 0.70 / 0.80 | 0.80x | fp32 | 20.0 | 0.75x | 0.70 / 0.80 "
        "| 0.80x | matched yes, fastest yes |" in text
    )
    assert (
        "| 2 | row_wise | fp8 | 20.0 | fp16 | 25.0 | 0.80x | 0.90 / 0.73 | 0.90x | fp32 | 20.0 | 1.00x | 0.90 / 1.10 "
        "| 1.10x | matched yes, fastest no |" in text
    )
    assert "| 2 | row_wise | fp32 (count) | 18.0 | fp32 | 20.0 | 0.90x |" in text
    lines = text.splitlines()
    reuse = next(i for i, ln in enumerate(lines) if ln.startswith("| 2 | row_wise | fp32 | 15.0"))
    assert lines[reuse + 1].startswith("| 2 | row_wise | fp32 (count) |")  # the count row beside its reused twin
    assert "| jaxscale, W processes | 2 | 2 | 1 (measured 1) |" in text
    assert "| TorchRec, W ranks | 2 | 2 | 1 (measured 1) |" in text
    assert "| jaxscale, 1 process | 2 | 1 | 2 (measured 2) |" in text
    assert "| 2 | row_wise | fp8 | 400 | fp16 | 1,000 | 0.40x | 0.50x | yes |" in text
    assert "| 2 | row_wise | fp32 (count) | 2,200 | fp32 | 2,000 | 1.10x | 1.00x | no |" in text
    assert "| 2 | row_wise | fp32 | 30.0 | 15.0 | 0.50x |" in text  # in one process: apart, labelled
    assert "In one process, NOT equal devices" in text
    assert "**On the worst round, 2 of 3 equal-device rows hold" in text
    assert "vs TorchRec's fastest: time ratio 0.75x to 1.00x; 3 of 3 rows meet <= 1.0x on the pooled medians, " in text
    assert "2 of 3 on their worst round (worst rounds 0.80x to 1.10x)." in text
    assert "Counting every batch instead of `reuse_capacities`: 1.20x to 1.20x the reused rows' time." in text
    assert "Load average (1 min) 0.10 before, 0.70 after; other processes' CPU before each session: max 3%" in text
    assert (
        "| jaxscale_mp | 2 | row_wise/fp32 | 15.0 | - | - | 14.0, 16.0 | all-to-all[u8] 1,000 | - | 1 (+2 warm-up) |"
        in text
    )
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    assert suite.main(["--render", str(path)]) == 0
    assert (tmp_path / "r.md").read_text() == text + "\n"
    res["parts"]["equal_devices"]["problems"] = ["load average 3.00 at start > 0.5"]
    assert "**Timings not valid: load average 3.00 at start > 0.5.**" in report.render(res)


def test_render_without_torchrec_leaves_its_columns_empty():
    """An installed wheel without TorchRec runs the jaxscale side alone: no ratio is made up."""
    res = _recorded()
    engines = _engines()
    del engines["torchrec"]
    part = res["parts"]["equal_devices"]
    part["engines"], part["comparisons"] = engines, equal_devices.comparisons(engines, ["2"])
    res["torchrec_installed"] = False
    assert all(r["time_ratio"] is None and r["time_fastest_worst_ratio"] is None for r in part["comparisons"])
    text = report.render(res)
    assert "**TorchRec / FBGEMM are not installed here, so their columns are empty**" in text
    assert "| 2 | row_wise | fp32 | 15.0 | fp32 | - | - | - | - | - | - | - | - | - | - |" in text
    assert "rows hold" not in text


def test_one_device_reports_per_round_speeds_and_the_worst_round():
    engines = {
        "jaxscale": {"median_ms": 4.0, "session_medians_ms": [4.0, 5.0, 3.0]},
        "fbgemm": {"median_ms": 5.0, "session_medians_ms": [4.4, 5.5, 6.0]},
    }
    sp = one_device.speed_vs_fbgemm(engines)["jaxscale"]
    assert sp["speed"] == pytest.approx(1.25) and sp["round_speeds"] == pytest.approx([1.1, 1.1, 2.0])
    assert sp["worst_round"] == pytest.approx(1.1)
    assert one_device.speed_vs_fbgemm({"jaxscale": engines["jaxscale"]}) == {}


def test_python_m_jaxscale_bench_runs_the_library_suite_from_any_directory(tmp_path, monkeypatch):
    assert entry.main is suite.main  # the thin face hands on the suite's own main
    out = subprocess.run(
        [sys.executable, "-m", "jaxscale.bench", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--count-every-batch" in out.stdout and "default 6" in out.stdout
    monkeypatch.chdir(tmp_path)
    assert suite.default_out(quick=True) == Path("bench_suite_quick")  # the cwd
    (tmp_path / "experiments" / "results").mkdir(parents=True)
    assert suite.default_out(quick=False) == Path("bench_suite")  # a checkout's results folder only with --out
    assert stages.FOUNDATION_CONFIG.is_file()  # shipped inside the package (package data), not read from a checkout


def test_nothing_in_the_package_imports_experiments():
    pkg = Path(entry.__file__).resolve().parent
    scripts = {p.stem for d in ("bench", "baselines") for p in (REPO / "experiments" / d).glob("*.py")}
    bench_modules = scripts | {"common", "suite", "one_device", "equal_devices", "stages", "experiments"}
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


def test_importing_the_suite_imports_neither_jax_nor_torch():
    code = (
        "import sys; import jaxscale.bench, jaxscale.benchmarks.suite, jaxscale.benchmarks.torchrec_runner, "
        "jaxscale.benchmarks.train_step, jaxscale.benchmarks.sasrec_torch; "
        "print(sorted(m for m in ('jax', 'torch', 'torchrec') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.slow
def test_one_device_session_end_to_end(tmp_path):
    """Tiny workload, jaxscale and the NumPy reference, one session each: timings and the table check."""
    cfg = dict(rows=2000, dim=8, batch=64, hotness=4, zipf=1.1, warmup=1, steps=2, engines=("jaxscale", "numpy"))
    out = one_device.run(cfg, str(tmp_path), partial(sessions.alternate, rounds=1))
    assert out["check"]["ok"], out
    for name in ("jaxscale", "numpy"):
        e = out["engines"][name]
        assert e["n"] == 2 and e["median_ms"] > 0
        assert e["max_abs_diff_rows"] <= 1e-6
    assert out["engines"]["jaxscale"]["info"]["threads"] == out["threads"]  # the XLA pool as set
    assert out["order"] == ["jaxscale", "numpy"]


def test_collective_latency_runs_checks_every_result_and_renders_its_json(tmp_path):
    """The collective latency script end to end on 2 processes (--quick), run as the script it is: every
    kind's result is checked inside the workers (a wrong sum or gather raises), and the Markdown is computed
    from the JSON (--render rewrites it identically)."""
    script = REPO / "experiments" / "bench" / "collective_latency.py"
    out = tmp_path / "latency"
    run = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    r = json.loads(out.with_suffix(".json").read_text())
    assert r["worlds"] == [2] and r["sizes"] == [2, 24]
    kinds = set(r["results"]["2"]["2"])
    assert {"all_reduce", "all_gather", "all_to_all", "exchange"} <= kinds
    for n in ("2", "24"):
        for kind in kinds:
            assert r["results"]["2"][n][kind]["median_ms"] > 0
    md = out.with_suffix(".md").read_text()
    out.with_suffix(".md").unlink()
    again = subprocess.run(
        [sys.executable, str(script), "--render", str(out.with_suffix(".json"))], capture_output=True
    )
    assert again.returncode == 0 and out.with_suffix(".md").read_text() == md
    m = r["results"]["2"]["2"]
    assert f"| 2 | 2 | {m['all_reduce']['median_ms']:.3f} |" in md


# ------------------------------------------------------------------------------------------ train_step

TINY_STEP = dict(batch=4, events=6, items=9, layers=1, d_model=8, heads=2, inner=16, warmup=1, steps=2)


def test_sasrec_reference_is_causal_and_its_loss_is_cross_entropy_over_every_item():
    torch = pytest.importorskip("torch")
    from jaxscale.benchmarks import sasrec_torch

    cfg = sasrec_torch.SASRecConfig(items=7, max_len=5, d_model=8, num_layers=1, num_heads=2, inner=16, dropout=0.0)
    torch.manual_seed(0)
    model, opt = sasrec_torch.build(cfg)
    model.eval()
    items = torch.tensor([[3, 1, 7, 0, 0], [2, 2, 5, 6, 4]])
    targets = torch.tensor([[1, 7, 2, 0, 0], [2, 5, 6, 4, 0]])  # 0: no target at that position
    with torch.no_grad():
        hidden = model(items).numpy()
        got = float(model.loss(items, targets))
        changed = items.clone()
        changed[1, 3] = 1
        later = model(changed).numpy()
    np.testing.assert_allclose(later[1, :3], hidden[1, :3], atol=1e-6)  # position t sees events <= t only
    assert np.abs(later[1, 3:] - hidden[1, 3:]).max() > 1e-4
    w = model.item_emb.weight.detach().numpy()[1:]  # every item is a candidate, the padding row is not
    nll = []
    for b, t in zip(*np.nonzero(targets.numpy())):
        logits = w @ hidden[b, t]
        nll.append(np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[targets[b, t] - 1])
    assert got == pytest.approx(np.mean(nll), rel=1e-5)
    before = got
    for _ in range(5):
        sasrec_torch.train_step(model, opt, items, targets)
    with torch.no_grad():
        assert float(model.loss(items, targets)) < before  # Adam on the same batch lowers the loss


def test_sasrec_reference_module_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; from jaxscale.benchmarks import sasrec_torch, train_step; "
        "print(sasrec_torch.torch_installed(), 'torch' in sys.modules and sys.modules['torch'] is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False"], out.stdout + out.stderr


def _canned_step_sessions(times_ms: dict):
    """A launch that returns recorded step times per engine and round instead of running anything."""
    calls = {}

    def launch(engine, spec, tmp, timeout_s):
        r = calls.setdefault(engine, 0)
        calls[engine] += 1
        return {
            "warmup_s": [1.0],
            "times_s": [t / 1e3 for t in times_ms[engine][r]],
            "losses": [2.0, 1.9, 1.8],
            "threads_set": spec["threads"],
            "threads": spec["threads"],
        }

    return launch


def test_train_step_part_reports_examples_per_second_and_per_round_speeds(tmp_path, monkeypatch):
    from jaxscale.benchmarks import sasrec_torch, train_step

    monkeypatch.setattr(sasrec_torch, "torch_installed", lambda: True)
    times = {"jaxscale": [[10.0, 30.0], [20.0, 20.0]], "torch": [[40.0, 40.0], [30.0, 50.0]]}
    cfg = dict(TINY_STEP, threads=2, engines=("jaxscale", "torch"))
    out = train_step.run(cfg, str(tmp_path), partial(sessions.alternate, rounds=2), launch=_canned_step_sessions(times))
    j, t = out["engines"]["jaxscale"], out["engines"]["torch"]
    assert j["median_ms"] == pytest.approx(20.0) and j["max_ms"] == pytest.approx(30.0) and j["n"] == 4
    assert j["examples_per_s"] == pytest.approx(4 / 0.020) and j["worst_examples_per_s"] == pytest.approx(4 / 0.030)
    assert t["median_ms"] == pytest.approx(40.0)
    sp = out["speed"]["torch"]
    assert sp["speed"] == pytest.approx(2.0)  # torch's median step time / jaxscale's
    assert sp["round_speeds"] == pytest.approx([40 / 20, 40 / 20]) and sp["worst_round"] == pytest.approx(2.0)
    assert out["order"] == ["jaxscale", "torch", "torch", "jaxscale"] and out["torch_skipped"] is None
    part = dict(out, rounds=2, load_average_before=[0.1], load_average_after=[0.2], background_busy=[], problems=[])
    md = "\n".join(report.render_train_step(part))
    assert "| jaxscale | " in md and "| 20.0 | 30.0 | 200 | 133 |" in md
    assert "| torch | 2.00x | 2.00 / 2.00 | 2.00x |" in md


def test_train_step_part_without_torch_runs_jaxscale_alone_and_says_so(tmp_path, monkeypatch):
    from jaxscale.benchmarks import sasrec_torch, train_step

    monkeypatch.setattr(sasrec_torch, "torch_installed", lambda: False)
    launch = _canned_step_sessions({"jaxscale": [[10.0, 12.0]]})
    out = train_step.run(dict(TINY_STEP), str(tmp_path), partial(sessions.alternate, rounds=1), launch=launch)
    assert list(out["engines"]) == ["jaxscale"] and out["speed"] == {}
    assert out["torch_skipped"] == "torch is not installed: the PyTorch reference was not run"
    part = dict(out, rounds=1, load_average_before=None, load_average_after=None, background_busy=[], problems=[])
    assert "**torch is not installed: the PyTorch reference was not run.**" in report.render_train_step(part)


def test_train_step_part_runs_both_engines_on_tiny_shapes(tmp_path):
    """The real sessions in this process (the Trainer's step on a 1x1 mesh, and SASRec+ when torch is here):
    every step timed, losses finite and near ln(items) at the start, threads as set."""
    from jaxscale.benchmarks import sasrec_torch, train_step

    def launch(engine, spec, tmp, timeout_s):
        return train_step.session(engine)(spec)

    engines = ("jaxscale", "torch") if sasrec_torch.torch_installed() else ("jaxscale",)
    cfg = dict(TINY_STEP, threads=1, engines=engines, mesh="1x2")  # two of the test process's devices
    out = train_step.run(cfg, str(tmp_path), partial(sessions.alternate, rounds=1), launch=launch)
    for name in engines:
        e = out["engines"][name]
        assert "error" not in e, e
        assert e["n"] == TINY_STEP["steps"] and e["median_ms"] > 0
        first = e["losses_first_session"][0]
        assert np.isfinite(e["losses_first_session"]).all() and abs(first - np.log(9)) < 1.5, first
    assert out["engines"]["jaxscale"]["info"]["mesh"] == "1x2" and out["shape"]["mesh"] == "1x2"
    if "torch" in engines:
        assert out["engines"]["torch"]["info"]["threads"] == 1
        assert set(out["speed"]) == {"torch"}
