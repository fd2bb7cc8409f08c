"""The trimmer benchmark's figures are computed from its recorded numbers: check that arithmetic on a small
synthetic record against a NumPy reference, and that the verdicts follow the targets."""

import numpy as np
import pytest

from jaxscale.benchmarks import machine as machine_lib
from jaxscale.benchmarks import trimmer_report


@pytest.fixture(scope="module")
def bench():
    return trimmer_report


def synthetic(rng, bench, requests=5, leaves=("a/1", "b/2")):
    http = []
    counters = {f"{c}/{m}": {} for c in bench.COMPRESSIONS for m in ("full", "trim")}
    for _ in range(requests):
        rec = {"batch": int(rng.integers(1, 100)), "request_bytes": int(rng.integers(1000, 5000)), "roots": {}}
        for cfg in counters:
            per_leaf = {leaf: int(rng.integers(10, 1000)) for leaf in leaves}
            rec["roots"][cfg] = {"wall_s": float(rng.random()), "bytes": per_leaf}
            for leaf, n in per_leaf.items():
                m, ver = leaf.split("/")
                key = f"model={m},version={ver}"
                counters[cfg][key] = counters[cfg].get(key, 0) + n
        http.append(rec)
    cpu = []
    for _ in range(requests):
        cpu.append(
            {
                "batch": 8,
                "trim_ns": float(rng.integers(10, 100)),
                "trim_cold_ns": float(rng.integers(100, 1000)),
                **{
                    key: {c: float(rng.integers(500, 5000)) for c in bench.COMPRESSIONS}
                    for key in ("serialize_arrays_ns", "serialize_ns", "serialize_trimmed_fanout_ns")
                },
            }
        )
    return {
        "http": http,
        "cpu": cpu,
        "root_byte_counters": counters,
        "output_mismatches": 0,
        "feature_count_errors": 0,
        "models": {leaf: {"declared": 4, "used": 3, "unused": ["x"]} for leaf in leaves},
        "universe": {"features": 10, "kinds": {"ids": 4, "count": 6}},
        "machine": {"cpu_model": "test", "nproc": 2, "memory": "1 kB", "platform": "p", "python": "3", "jax": "j",
                    "pyarrow": "a", "loadavg_at_start": [1.0, 1.0, 1.0]},
        "loadavg_at_end": [1.0, 1.0, 1.0],
        "command": "python experiments/serving/bench_trimmer.py",
        "wall_s": 1.0,
    }  # fmt: skip


def test_summary_matches_a_numpy_reference(bench):
    rng = np.random.default_rng(0)
    result = synthetic(rng, bench)
    s = bench.summarize(result)
    http = result["http"]
    for comp in bench.COMPRESSIONS:
        sums = {
            mode: np.array([sum(r["roots"][f"{comp}/{mode}"]["bytes"].values()) for r in http])
            for mode in ("full", "trim")
        }
        f = s["fanout"][comp]
        assert f["mean_full"] == pytest.approx(sums["full"].mean())
        assert f["reduction"] == pytest.approx(1 - sums["trim"].sum() / sums["full"].sum())
        assert f["median_reduction"] == pytest.approx(np.median(1 - sums["trim"] / sums["full"]))
        for leaf in ("a/1", "b/2"):
            ref = np.mean([r["roots"][f"{comp}/trim"]["bytes"][leaf] for r in http])
            assert s["per_leaf"][leaf][f"{comp}/trim"] == pytest.approx(ref)
        trim = np.array([r["trim_ns"] for r in result["cpu"]])
        ser = np.array([r["serialize_ns"][comp] for r in result["cpu"]])
        c = s["cpu"][comp]["batch"]
        assert c["ratio_median"] == pytest.approx(np.median(trim / ser))
        assert c["ratio_of_sums"] == pytest.approx(trim.sum() / ser.sum())
        assert c["ratio_max"] == pytest.approx((trim / ser).max())
        assert c["us_median"] == pytest.approx(np.median(ser) / 1e3)
    assert s["counters_agree"]
    result["root_byte_counters"]["zstd/trim"]["model=a,version=1"] += 1
    assert not bench.summarize(result)["counters_agree"]


def test_render_states_the_verdicts(bench):
    rng = np.random.default_rng(1)
    result = synthetic(rng, bench)
    for rec in result["http"]:  # trimmed = a tenth of untrimmed: 90% fewer bytes
        for comp in bench.COMPRESSIONS:
            for leaf in rec["roots"][f"{comp}/trim"]["bytes"]:
                rec["roots"][f"{comp}/trim"]["bytes"][leaf] = rec["roots"][f"{comp}/full"]["bytes"][leaf] // 10
    fanout_rows = [line for line in bench.render(result).splitlines() if line.startswith(("| none |", "| lz4 |"))]
    assert fanout_rows and all(row.endswith("| met |") for row in fanout_rows[:2])

    def verdicts(trim_of):
        for rec in result["cpu"]:
            rec["trim_ns"] = trim_of(rec)
        text = bench.render(result)
        return [line.rsplit("|", 2)[1].strip() for line in text.splitlines() if line.startswith("| zstd |")][-1]

    assert verdicts(lambda r: 1.0) == "met against both"
    assert verdicts(lambda r: 0.10 * r["serialize_arrays_ns"]["zstd"]) == "MISSED"
    for rec in result["cpu"]:
        rec["serialize_ns"]["zstd"] = rec["serialize_arrays_ns"]["zstd"] / 10
    assert verdicts(lambda r: 0.01 * r["serialize_arrays_ns"]["zstd"]) == "met from arrays, missed against re-encoding"


def test_machine_description_has_what_the_reports_print(bench):
    """The trimmer and two-tower reports describe the machine through `jaxscale.benchmarks.machine.machine`."""
    m = bench.machine()
    for key in ("cpu_model", "nproc", "memory", "loadavg_at_start", "python", "platform", "numpy", "jax", "pyarrow"):
        assert key in m, key
    assert m["nproc"] >= 1 and len(m["loadavg_at_start"]) == 3
    lines = machine_lib.machine_lines(m, [0.1, 0.2, 0.3])
    assert any("cores visible" in line for line in lines)
