"""The serving and streaming fault suite (experiments/serving/faults.py, issue 35), run as a script: its renderer
computes every figure of the table from the JSON (and the table in docs/reliability.md is the recorded JSON's),
and, slow, `--quick` end to end against real processes: the JSON's structure and the pass flags that cannot
depend on the machine's speed (every good event stored once, every poison entry dead-lettered with its reason,
the root's 5xx only 503 + Retry-After or 504 naming the deadline, hostile bodies refused with their status, the
state publication of another model version refused)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

SCRIPT = ROOT / "experiments" / "serving" / "faults.py"
RECORD = ROOT / "experiments" / "results" / "serving_faults.json"
DOC = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- faults:begin -->", "<!-- faults:end -->"
CASES = [
    "no_fault",
    "compression_bomb",
    "slow_loris",
    "body_100mb",
    "nested_json",
    "leaf_sigstop",
    "leaf_sigkill",
    "redis_kill",
    "redis_outage",
    "consumer_replaced",
    "poison",
    "state_other_version",
    "rollout",
]


def script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def _phase(n2, n4, n5, p99, failed=0) -> dict:
    model = {"requests": n2 + n4 + n5 + failed, "2xx": n2, "4xx": n4, "5xx": n5, "failed": failed, "p99_ms": p99}
    return {**model, "by_model": {"ctr": model, "save": model}}


def _result() -> dict:
    rss = {"root": {"idle_mib": 90.5, "peak_mib": 97.25, "bound_mib": 282.5, "ok": True}}
    load = {
        "before": _phase(291, 0, 0, 13.21),
        "during": _phase(250, 1, 44, 1011.5, 2),
        "after": _phase(300, 0, 0, 7.9),
    }
    return {
        "command": "python experiments/serving/faults.py",
        "quick": False,
        "rate_rps": 200.0,
        "seconds": 321.5,
        "machine": {"cpus": 2, "loadavg_start": [6.75, 7, 8], "loadavg_end": [9.5, 8, 8], "shared": "shared cores"},
        "cases": [
            {
                "name": "leaf_sigstop", "title": "SIGSTOP one leaf", "available": True, "notes": ["a note"],
                "load": load, "rss": rss, "reference_p99_ms": 14.5, "errors_until_s": {"ctr": 1.5, "save": None},
                "root_5xx": {"total": 44, "well_formed": 43, "reasons": {"503 circuit_open": 40, "502 x": 4}},
                "checks": {"other_model_p99_within_2x": False, "rss_within_limits": True}, "pass": False,
            },
            {
                "name": "poison", "title": "poison entries", "available": True, "notes": [], "load": load,
                "root_5xx": {"total": 0, "well_formed": 0}, "rss": rss,
                "events": {"produced": 100000, "stored": 100000, "distinct_stored": 100000, "producer_retries": 3,
                           "poison": 100, "poison_dead_lettered": 100, "poison_with_reason": 99},
                "checks": {"every_good_event_stored_once": True}, "pass": True,
            },
            {"name": "rollout", "title": "a rollout", "available": False, "reason": "no version config yet",
             "notes": [], "checks": {}, "pass": None},
        ],
        "pass": False,
    }  # fmt: skip


def test_the_renderer_computes_the_table_from_the_json(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result()))
    out = script("--render", str(path))
    assert out.returncode == 0, out.stderr
    table = out.stdout
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    stop = rows["SIGSTOP one leaf"]
    assert "291/0/0 / 250/1/44 (+2 no answer) / 300/0/0" in stop  # 2xx/4xx/5xx per phase from the JSON
    assert "13.21 / 1011.5 / 7.9" in stop and "43 of 44: 4x 502 x, 40x 503 circuit_open" in stop
    assert "p99 1011.5 ms vs 14.5 no-fault; ctr errors until 1.5 s after SIGCONT" in stop
    assert "root 97.25 (282.5)" in stop and "**no**: other_model_p99_within_2x" in stop
    poison = rows["poison entries"]
    assert "100,000 / 100,000 (100,000), 3 publish retries; poison 100: 100 dead-lettered, 99 with reason" in poison
    assert poison.endswith("| yes |")
    assert "| a rollout | not available: no version config yet |" in table
    assert "load average 6.75 at the start and 9.5 at the end: shared cores" in table
    assert "Suite pass: **no**" in table and "- leaf_sigstop: a note" in table
    doc = tmp_path / "doc.md"
    doc.write_text(f"# head\n\n{BEGIN}\nold table\n{END}\n\ntail\n")
    assert script("--render", str(path), "--docs", str(doc)).returncode == 0
    assert doc.read_text() == f"# head\n\n{BEGIN}\n{table}{END}\n\ntail\n"
    doc.write_text("no markers\n")
    bad = script("--render", str(path), "--docs", str(doc))
    assert bad.returncode != 0 and f"{doc} lacks the marker" in bad.stderr


def test_the_docs_table_is_the_recorded_json_rendered():
    out = script("--render", str(RECORD))
    assert out.returncode == 0, out.stderr
    text = DOC.read_text()
    assert text.split(BEGIN, 1)[1].split(END, 1)[0] == "\n" + out.stdout, (
        "docs/reliability.md's fault table is stale: python experiments/serving/faults.py --render "
        "experiments/results/serving_faults.json --docs docs/reliability.md"
    )
    record = json.loads(RECORD.read_text())
    assert [c["name"] for c in record["cases"]] == CASES


@pytest.mark.slow
def test_the_quick_fault_suite_end_to_end(tmp_path):
    out = tmp_path / "faults.json"
    run = script("--quick", "--json", str(out), timeout=1800)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["quick"] and result["rate_rps"] == 200
    cases = {c["name"]: c for c in result["cases"]}
    assert list(cases) == CASES
    for name, c in cases.items():
        assert set(c) >= {"name", "title", "available", "checks", "pass"}, name
        if not c["available"]:
            assert c["reason"] and c["pass"] is None, name
            continue
        assert set(c["load"]) == {"before", "during", "after"}, name
        for phase in c["load"].values():
            assert phase["requests"] == phase["2xx"] + phase["4xx"] + phase["5xx"] + phase["failed"], name
            assert set(phase["by_model"]) == {"ctr", "save"}
        assert {"root", "leaf_ctr_1", "leaf_save_1", "redis", "consumer", "sequences"} <= set(c["rss"]), name
        for proc, r in c["rss"].items():
            assert r["peak_mib"] > 0 and r["ok"] == (r["peak_mib"] <= r["bound_mib"]), (name, proc)
        # status classes: whatever the speed, every 5xx of the root is a 503 + Retry-After or a 504 + deadline
        assert c["checks"]["root_5xx_are_503_retry_after_or_504_deadline"], (name, c["root_5xx"])
        assert c["pass"] == all(c["checks"].values())
    for name in ("compression_bomb", "slow_loris", "body_100mb", "nested_json"):
        assert cases[name]["checks"]["hostile_refused_as_expected"], cases[name]["hostile"]
    assert set(cases["compression_bomb"]["hostile"]["statuses"]) == {"413"}
    assert set(cases["nested_json"]["hostile"]["statuses"]) == {"400"}
    for name in ("redis_kill", "redis_outage", "consumer_replaced", "poison"):
        e = cases[name]["events"]
        assert cases[name]["checks"]["every_good_event_stored_once"], (name, e)
        assert e["produced"] == e["stored"] == e["distinct_stored"] > 0
    for name in ("redis_kill", "consumer_replaced"):  # the fault landed mid-stream
        fault = cases[name]["fault"]
        assert 0 < fault["events_published_before"] < fault["of"], (name, fault)
    poison = cases["poison"]["events"]
    assert poison["poison"] == poison["poison_dead_lettered"] == poison["poison_with_reason"] == 10
    state = cases["state_other_version"]
    if state["available"]:
        checks = state["checks"]
        assert checks["refused_and_counted"] and checks["previous_states_still_served"] and checks["still_ready"]
    rollout = cases["rollout"]
    if rollout["available"]:
        assert rollout["checks"]["reloads_ok"] and rollout["checks"]["all_v2_after"]
