"""Point-in-time queries against brute force, and the HTTP API with a real client on 127.0.0.1."""

import http.client
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_sequences_helpers import by_user, make_defs, random_log, reference_query, reference_store

from jaxscale.sequences.query import SequenceReader
from jaxscale.sequences.runtime import backfill
from jaxscale.sequences.server import serve_in_thread

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    defs = make_defs(max_length=6)
    raw, items = random_log(31, tmp, files=3, rows=300, users=8, days=3, late=0.3)
    backfill(defs, tmp / "events", tmp / "store", sources={"items": items})
    want, _ = reference_store(raw, defs, pd.read_parquet(items))
    return tmp / "store", defs, want


def test_queries_equal_brute_force_and_never_leak(built):
    store, defs, want = built
    rng = np.random.default_rng(0)
    for s in defs.sequences:
        reader = SequenceReader(store, s.name)
        rows = want[s.name]
        grouped = by_user(rows)
        users = sorted(grouped) + [12345]
        times = list(rows.ts.sample(20, random_state=1)) + [int(rows.ts.min()), int(rows.ts.max()) + 1]
        for u in users:
            for t in [None, *times, *(int(x) for x in rng.integers(rows.ts.min() - 10, rows.ts.max() + 10, 5))]:
                for limit in (None, 0, 1, 3, 100):
                    got = reader.events(u, t, limit)
                    assert got == reference_query(grouped, s.fields, s.max_length, u, t, limit), (s.name, u, t, limit)
                    assert json.loads(reader.events_json(u, t, limit)) == got  # the server's renderer
                    if t is not None and "ts" in s.fields:
                        assert all(e["ts"] < t for e in got)  # nothing at or after as_of, ever


def test_ties_in_ts_come_in_arrival_order(built):
    store, defs, want = built
    rows = want["s1"]
    dup = rows[rows.duplicated(["user_id", "ts"], keep=False)]
    assert len(dup), "the random log must contain ties"
    reader = SequenceReader(store, "s1")
    u, t = int(dup.user_id.iloc[0]), int(dup.ts.iloc[0])
    got = reader.query(u, t + 1, 100)
    tied = got["arrival"][got["ts"] == t]
    assert len(tied) >= 2 and np.all(np.diff(tied) > 0)


def _get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    return resp.status, body


@pytest.fixture(scope="module")
def server(built):
    srv = serve_in_thread(built[0], refresh_seconds=0.2)
    yield srv, built
    srv.shutdown()
    srv.server_close()


def test_http_status_codes(server):
    srv, (store, defs, want) = server
    port = srv.server_address[1]
    rows = want["s1"]
    u = int(rows.user_id.iloc[0])
    t = int(rows.ts.iloc[len(rows) // 2])
    status, body = _get(port, f"/v1/users/{u}/sequences/s1?as_of={t}&limit=4")
    assert status == 200 and body["user_id"] == u and body["sequence"] == "s1"
    assert body["events"] == reference_query(rows, defs.sequences[0].fields, 6, u, t, 4)
    assert list(body["events"][0]) == list(defs.sequences[0].fields) if body["events"] else True
    status, body = _get(port, f"/v1/users/{u}/sequences/s1")
    assert status == 200 and body["events"] == reference_query(rows, defs.sequences[0].fields, 6, u)
    assert _get(port, "/v1/users/999999/sequences/s1") == (200, {"user_id": 999999, "sequence": "s1", "events": []})
    status, body = _get(port, f"/v1/users/{u}/sequences/nope")
    assert status == 404 and "nope" in body["error"]
    for bad in (
        "as_of=abc",
        "as_of=1.5",
        "as_of=",
        "as_of=99999999999999999999",
        "limit=-1",
        "limit=x",
        "limit=2&limit=3",
        "asof=5",
        "limit=1e3",
    ):
        status, body = _get(port, f"/v1/users/{u}/sequences/s1?{bad}")
        assert status == 400 and isinstance(body["error"], str) and body["error"], bad
    assert _get(port, "/v1/users/abc/sequences/s1")[0] == 400
    assert _get(port, "/v1/nothing")[0] == 404
    status, body = _get(port, "/v1/sequences")
    assert status == 200 and set(body["sequences"]) == {"s1", "s2"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", f"/v1/users/{u}/sequences/s1", body=b"{}")
    assert conn.getresponse().status == 405


def test_cli_serve_on_a_free_port(built):
    store = built[0]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxscale.sequences", "serve", "--store", str(store), "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        port = int(re.search(r"http://127\.0\.0\.1:(\d+)", line).group(1))
        status, body = _get(port, "/healthz")
        assert status == 200 and body == {"status": "ok"}
        assert _get(port, "/v1/users/1/sequences/s2")[0] == 200
        proc.terminate()  # SIGTERM: a graceful stop, exit status 0
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_server_sees_a_new_backfill_without_restart(tmp_path):
    import time

    defs = make_defs()
    random_log(32, tmp_path / "a", files=1, rows=100, users=3, days=1, late=0.0, bad=False)
    random_log(33, tmp_path / "b", files=2, rows=100, users=3, days=3, late=0.0, bad=False)
    store = tmp_path / "store"
    backfill(defs, tmp_path / "a" / "events", store, sources={"items": tmp_path / "a" / "items.parquet"})
    srv = serve_in_thread(store, refresh_seconds=0.05)
    try:
        port = srv.server_address[1]
        before = _get(port, "/v1/sequences")[1]["sequences"]["s1"]
        backfill(defs, tmp_path / "b" / "events", store, sources={"items": tmp_path / "b" / "items.parquet"})
        after = SequenceReader(store, "s1")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            got = _get(port, "/v1/sequences")[1]["sequences"]["s1"]
            if got["days"] == [p.day for p in after.partitions] and got["events"] == after.num_events:
                break
            time.sleep(0.05)
        assert got != before and got["events"] == after.num_events
    finally:
        srv.shutdown()
        srv.server_close()


# ----------------------------------------------------------------- a bounded window, refresh isolation


def _last_events(grouped, user: int, hold: int) -> set:
    """The (ts, arrival) of the user's last `hold` stored events (brute force)."""
    rows = sorted(grouped.get(int(user), []), key=lambda r: (r["ts"], r["arrival"]))
    return {(r["ts"], r["arrival"]) for r in rows[max(len(rows) - hold, 0) :]}


def test_held_window_answers_exactly_or_refuses(built):
    """Issue 35 item 12: a reader holding each user's last `hold` events answers like the full reader, or
    refuses (OutsideWindow) exactly when the answer needs an event outside the window; memory is bounded."""
    from jaxscale.sequences.query import OutsideWindow

    store, defs, want = built
    rng = np.random.default_rng(5)
    answered = refused = 0
    for s in defs.sequences:
        grouped = by_user(want[s.name])
        full = SequenceReader(store, s.name)
        for hold in (s.max_length, s.max_length + 4):
            reader = SequenceReader(store, s.name, hold=hold)
            assert reader.num_events == sum(min(len(v), hold) for v in grouped.values()) < full.num_events
            assert reader.memory_bytes < full.memory_bytes and reader.days == full.days
            for u in [*grouped, 12345]:
                assert reader.events(u) == full.events(u)  # the latest window is always held
                own = sorted(r["ts"] for r in grouped.get(u, []))[-(hold + 2) :] or [0]
                for t in [*rng.choice(want[s.name].ts, 6), *rng.choice(own, 6)]:
                    limit = [None, 1, 3][int(rng.integers(3))]
                    ref = reference_query(grouped, [*s.fields, "arrival"], s.max_length, u, int(t), limit)
                    outside = {(e["ts"], e["arrival"]) for e in ref} - _last_events(grouped, u, hold)
                    try:
                        got = reader.events(u, int(t), limit)
                    except OutsideWindow as e:
                        assert outside or len(ref) < (s.max_length if limit is None else limit), (u, t, limit)
                        assert f"the {hold} this server holds per user" in str(e)
                        refused += 1
                        continue
                    assert not outside and got == full.events(u, int(t), limit), (u, t, limit)
                    answered += 1
    assert answered > 50 and refused > 20, (answered, refused)
    with pytest.raises(ValueError, match="hold must be an integer >= the sequence's max_length"):
        SequenceReader(store, "s1", hold=2)


def test_held_window_while_streaming(tmp_path):
    """A held reader refreshed after every commit of a stream (new files, merges) answers like a full reader
    or refuses, and never holds more than `hold` events per user."""
    from jaxscale.sequences.query import OutsideWindow
    from jaxscale.sequences.runtime import stream

    defs = make_defs(max_length=4)
    raw, items = random_log(37, tmp_path, files=2, rows=200, users=4, days=3, late=0.4, bad=False)
    readers, checks = {}, []

    def check(i, report):
        for s in defs.sequences:
            if not (tmp_path / "store" / s.name / "_sequence.json").exists():
                continue
            held = readers.setdefault(s.name, SequenceReader(tmp_path / "store", s.name, hold=6))
            held.refresh()
            full = SequenceReader(tmp_path / "store", s.name)
            users = {int(u) for p in full.partitions for u in p.users}
            if held.partitions:
                assert np.diff(held.partitions[0].segments[0].starts).max() <= 6  # at most `hold` per user
            for u in users:
                assert held.events(u) == full.events(u)
                for t in full.query(u, limit=10**6)["ts"][::3]:
                    try:
                        assert held.events(u, int(t), 2) == full.events(u, int(t), 2)
                    except OutsideWindow:
                        pass
                    checks.append(1)

    stream(
        defs,
        tmp_path / "events",
        tmp_path / "store",
        sources={"items": items},
        micro_batch=25,
        max_files=2,
        on_commit=check,
    )
    assert len(checks) > 50
    assert readers["s1"].stats["files_dropped"] > 0  # merges were followed


def test_one_sequence_failing_to_refresh_does_not_stop_the_others(built, tmp_path, caplog):
    import shutil
    import urllib.request

    from jaxscale.sequences.store import list_partitions, partition_files

    store = tmp_path / "store"
    shutil.copytree(built[0], store)
    server = serve_in_thread(store, refresh_seconds=0)
    try:
        s2 = SequenceReader(store, "s2").num_events
        day1 = next(iter(list_partitions(store / "s1").values()))
        (day1 / "part-zzzz.parquet").write_bytes(b"not parquet")  # s1 (refreshed first) now fails
        day2 = next(iter(list_partitions(store / "s2").values()))
        shutil.copy(partition_files(day2)[0], day2 / "part-zzzz.parquet")  # s2 gains a file
        with caplog.at_level("WARNING", "jaxscale.sequences.server"):
            server.store.refresh()
        assert server.store.readers["s2"].num_events > s2, "s2 was not refreshed after s1 failed"
        assert any("refresh of sequence 's1' failed" in r.getMessage() for r in caplog.records)
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
            text = r.read().decode()
        assert 'jaxscale_sequences_refresh_failures_total{sequence="s1"} 1.0' in text
        assert 'jaxscale_sequences_refresh_failures_total{sequence="s2"} 0.0' in text
        assert 'jaxscale_sequences_refresh_ok{sequence="s1"} 0.0' in text
        assert 'jaxscale_sequences_refresh_ok{sequence="s2"} 1.0' in text
    finally:
        server.shutdown()
        server.server_close()


def test_server_window_refuses_with_422(built):
    store, defs, want = built
    server = serve_in_thread(store, refresh_seconds=0, hold_events=6)
    try:
        grouped = by_user(want["s1"])
        user = max(grouped, key=lambda u: len(grouped[u]))
        rows = sorted(grouped[user], key=lambda r: (r["ts"], r["arrival"]))
        early = int(rows[len(rows) // 3]["ts"])  # far before the user's last 6 events
        conn = http.client.HTTPConnection(*server.server_address, timeout=30)
        conn.request("GET", f"/v1/users/{user}/sequences/s1?as_of={early}")
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 422 and "the 6 this server holds per user (--hold-events)" in body["error"]
        conn.request("GET", f"/v1/users/{user}/sequences/s1")
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["events"] == SequenceReader(store, "s1").events(user)
        conn.close()
    finally:
        server.shutdown()
        server.server_close()
