"""`jaxscale.infra.periodic.PeriodicTask`: calls on a schedule, survives a failing call (logged), starts once,
closes promptly, and refuses a non-positive interval."""

import logging
import threading
import time

import pytest

from jaxscale.infra.periodic import PeriodicTask


def test_calls_repeatedly_until_closed():
    calls = []
    task = PeriodicTask(lambda: calls.append(time.monotonic()), "tick")
    task.start(0.01)
    task.start(0.01)  # a second start keeps the first thread
    deadline = time.monotonic() + 10
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(calls) >= 3
    assert sum(t.name == "tick" for t in threading.enumerate()) == 1
    task.close()
    assert not task.running
    n = len(calls)
    time.sleep(0.05)
    assert len(calls) == n  # no call after close returned


def test_a_failing_call_is_logged_and_the_next_tick_retries(caplog):
    results = iter([ValueError("bad publication"), None, None])
    done = threading.Event()

    def fn():
        r = next(results, None)
        if isinstance(r, Exception):
            raise r
        done.set()

    task = PeriodicTask(fn, "reload-x")
    with caplog.at_level(logging.ERROR, logger="jaxscale.infra.periodic"):
        task.start(0.01)
        assert done.wait(10)
        task.close()
    assert any("reload-x failed" in r.getMessage() and "bad publication" in r.exc_text for r in caplog.records)


def test_restart_after_close_and_bad_interval():
    calls = []
    task = PeriodicTask(lambda: calls.append(1), "again")
    task.start(0.01)
    task.close()
    calls.clear()
    task.start(0.01)
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.005)
    task.close()
    assert calls
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="interval must be positive"):
            PeriodicTask(lambda: None, "x").start(bad)
