"""The Redis Streams broker against a real redis-server: produce -> consume -> store equals a backfill of the
same events; duplicates stored once; two partitions with two consumers; lag; SIGKILL at every point of a
micro-batch and restart: every event stored exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from conftest import ROOT, TESTS, free_port
from redis_helpers import redis_port  # noqa: F401  (the fixture)
from test_sequences_helpers import T0, assert_frames_equal, make_defs, random_log, reference_store, write_defs

from jaxscale.sequences.broker import (
    BrokerError,
    Producer,
    RedisSource,
    StreamConsumer,
    arrival_ids,
    serve_metrics,
    stream_key,
    user_partitions,
)
from jaxscale.sequences.runtime import backfill, stream
from jaxscale.sequences.store import list_partitions, partition_files, read_sequence, read_sequence_meta

DEFS = make_defs()
NAMES = [s.name for s in DEFS.sequences]
BROKER_ONLY = ("arrival", "ingest_ts")
"""Columns a broker defines differently from a file log: arrival order and receive time (the entry id)."""


def stored(store: Path, name: str, drop=BROKER_ONLY) -> pa.Table:
    """A sequence's events with their ids, without the columns that depend on how they were delivered."""
    cols = [*read_sequence_meta(Path(store) / name)["columns"], "event_id"]
    return read_sequence(store, name, cols).drop_columns(list(drop))


def assert_same_events(got: Path, want: Path) -> None:
    for name in NAMES:
        a, b = stored(got, name), stored(want, name)
        assert a.num_rows == b.num_rows and a.num_rows > 0, (name, a.num_rows, b.num_rows)
        assert a.equals(b), name


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), *[p for p in [e.get("PYTHONPATH")] if p]])
    return e


def stream_args(url: str, tmp: Path, items: Path, *extra: str) -> list[str]:
    return [
        "--defs",
        str(write_defs(tmp)),
        "--source",
        url,
        "--group",
        "g",
        "--out",
        str(tmp / "s"),
        "--items",
        str(items),
        "--micro-batch",
        "100",
        "--block-ms",
        "50",
        *extra,
    ]


def run_cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxscale.sequences", *args], env=env(), capture_output=True, text=True, timeout=timeout
    )


# ------------------------------------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    "url, problem",
    [
        ("http://localhost:6379/ev", "must start with redis://"),
        ("redis://localhost:6379", "names no stream"),
        ("redis://localhost:6379/", "names no stream"),
        ("redis://localhost/ev", "has no port"),
        ("redis://localhost:port/ev", "malformed"),
        ("redis://localhost:99999/ev", "not in 1..65535"),
        ("redis://localhost:6379/a/b", "malformed"),
        ("redis://localhost:6379/ev*", "may hold only"),
        (None, "must start with redis://"),
    ],
)
def test_source_url_errors_name_the_problem(url, problem):
    with pytest.raises(BrokerError, match=problem):
        RedisSource.parse(url)


def test_source_url_and_partitions():
    s = RedisSource.parse("redis://127.0.0.1:6380/events.v1")
    assert (s.host, s.port, s.stream, s.url) == ("127.0.0.1", 6380, "events.v1", "redis://127.0.0.1:6380/events.v1")
    assert RedisSource.parse("redis://[::1]:6379/ev").host == "::1"
    assert stream_key("ev", 0, 1) == "ev" and stream_key("ev", 2, 3) == "ev.2"
    with pytest.raises(BrokerError, match="--partition must be in 0..1"):
        stream_key("ev", 2, 2)
    users = pa.array(np.arange(10_000, dtype=np.int64) * 7919)
    parts = user_partitions(users, 4)
    assert set(parts) == {0, 1, 2, 3} and np.bincount(parts).min() > 2_000  # spread over the partitions
    assert np.array_equal(parts, user_partitions(users, 4))  # stable
    assert [a.tolist() for a in arrival_ids(2**62 + 5, [2, 0, 3])] == [
        [2**62 + 5, 2**62 + 6],
        [],
        [2**62 + 7, 2**62 + 8, 2**62 + 9],
    ]


def test_unreachable_broker_is_a_clear_error(tmp_path):
    port = free_port()
    out = run_cli(["produce", "--events", str(tmp_path), "--target", f"redis://127.0.0.1:{port}/ev"])
    assert out.returncode == 2 and f"cannot reach the broker at 127.0.0.1:{port}" in out.stderr, out.stderr


# ---------------------------------------------------------------------------------- produce -> consume


def test_consumed_store_equals_backfill_and_brute_force(tmp_path, redis_port):  # noqa: F811
    raw, items = random_log(7, tmp_path, files=3, rows=300, users=8, days=3, late=0.3)
    backfill(DEFS, tmp_path / "events", tmp_path / "b", sources={"items": items})
    url = f"redis://127.0.0.1:{redis_port}/ev"
    t_before = int(time.time() * 1000)
    produced = Producer(url, batch=37).publish_files(tmp_path / "events")
    t_after = int(time.time() * 1000)
    assert produced["events"] == len(raw) and produced["entries"] > 10
    consumer = StreamConsumer(DEFS, url, "g", tmp_path / "s", micro_batch=100, sources={"items": items}, block_ms=50)
    report = consumer.run(until_idle=0.3)
    assert_same_events(tmp_path / "s", tmp_path / "b")
    want, bad = reference_store(raw, DEFS, pq.read_table(items).to_pandas())
    for name in NAMES:
        got = read_sequence(tmp_path / "s", name).to_pandas().drop(columns=list(BROKER_ONLY))
        assert_frames_equal(got, want[name].drop(columns=list(BROKER_ONLY)))
        ingest = read_sequence(tmp_path / "s", name, ["user_id", "ts", "arrival", "ingest_ts"]).column("ingest_ts")
        assert t_before <= min(ingest.to_pylist()) and max(ingest.to_pylist()) <= t_after  # the entries' times
        for part in list_partitions(tmp_path / "s" / name).values():
            assert len(partition_files(part)) == 1  # merged when the run ends
    totals = report.to_json()["totals"]
    assert totals["rows"] == len(raw)
    assert totals["bad_rows"] == sum(sum(v.values()) for v in bad.values())
    m = report.extra["metrics"]
    assert m["events_consumed"] == m["events_acked"] == len(raw)
    assert m["events_deduplicated"] == 0 and m["lag_entries"] == 0 and m["pending_entries"] == 0
    assert report.extra["micro_batches"] >= len(raw) // 100


def test_stream_report_and_lag_metric(tmp_path, redis_port):  # noqa: F811
    """Lag is the group's undelivered entries: all of them before, 0 after the drain; /metrics exports it."""
    raw, items = random_log(8, tmp_path, files=2, rows=200, days=2, bad=False)
    url = f"redis://127.0.0.1:{redis_port}/ev"
    produced = Producer(url, batch=20).publish_files(tmp_path / "events")
    consumer = StreamConsumer(DEFS, url, "g", tmp_path / "s", micro_batch=50, sources={"items": items}, block_ms=50)
    port = free_port()
    server, _ = serve_metrics(consumer.metrics, port)
    try:
        consumer._setup()
        consumer.update_lag()
        assert consumer.metrics.snapshot()["lag_entries"] == produced["entries"]
        consumer.run(until_idle=0.3)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    labels = '{group="g",stream="ev"}'
    assert f"jaxscale_stream_lag_entries{labels} 0.0" in body
    assert f"jaxscale_stream_pending_entries{labels} 0.0" in body
    assert f"jaxscale_stream_events_acked_total{labels} {float(len(raw))}" in body
    assert "jaxscale_stream_commit_seconds_count" in body


def _events(rng, n: int, id_kind: str | None) -> pa.Table:
    cols = {
        "user_id": pa.array(rng.integers(0, 5, n) * 1000 + 10**12, pa.int64()),
        "ts": pa.array(T0 + np.sort(rng.integers(0, 2 * 86_400_000, n)), pa.int64()),
        "event_type": pa.array(rng.choice(["a", "b", "c"], n)),
        "item_id": pa.array(rng.integers(0, 40, n) * 10**9, pa.int64()),
        "surface": pa.array(rng.choice(["home", "search"], n)),
    }
    if id_kind == "int":
        cols["event_id"] = pa.array(np.arange(n, dtype=np.int64) * 3 + 11)
    elif id_kind == "string":
        cols["event_id"] = pa.array([f"evt-{i:06d}" for i in range(n)])
    return pa.table(cols)


@pytest.mark.parametrize("id_kind", ["int", "string", None])
def test_duplicates_are_stored_once(tmp_path, redis_port, id_kind):  # noqa: F811
    """Events published twice (same event_id; without one, the same row) are stored once, first arrival
    first; a backfill of the log with the duplicates stores the same."""
    rng = np.random.default_rng(3)
    _, items = random_log(1, tmp_path / "items", files=1, rows=10)
    unique = _events(rng, 300, id_kind)
    again = unique.take(rng.choice(300, 120, replace=False))
    if id_kind is not None:  # a re-sent event is the same event even if a field changed on the way
        again = again.set_column(4, "surface", pa.array(["changed"] * again.num_rows))
    (tmp_path / "once").mkdir()
    (tmp_path / "twice").mkdir()
    pq.write_table(unique, tmp_path / "once" / "part-0.parquet")
    pq.write_table(unique, tmp_path / "twice" / "part-0.parquet")
    pq.write_table(again, tmp_path / "twice" / "part-1.parquet")
    sources = {"items": items}
    backfill(DEFS, tmp_path / "once", tmp_path / "b_once", sources=sources)
    backfill(DEFS, tmp_path / "twice", tmp_path / "b_twice", sources=sources)
    stream(DEFS, tmp_path / "twice", tmp_path / "f_twice", sources=sources, micro_batch=64)
    url = f"redis://127.0.0.1:{redis_port}/ev"
    producer = Producer(url, partitions=2, batch=50)
    producer.publish(unique)
    producer.publish(again.slice(0, 60))
    for p in range(2):
        consumer = StreamConsumer(
            DEFS, url, "g", tmp_path / "s", micro_batch=64, partition=p, partitions=2, sources=sources, block_ms=50
        )
        consumer.run(until_idle=0.2)
    producer.publish(again.slice(60))  # after the first commits: dropped against the stored ids
    dedup = 0
    for p in range(2):
        consumer = StreamConsumer(
            DEFS, url, "g", tmp_path / "s", micro_batch=64, partition=p, partitions=2, sources=sources, block_ms=50
        )
        dedup += consumer.run(until_idle=0.2).extra["metrics"]["events_deduplicated"]
    for store in ("b_twice", "f_twice", "s"):
        assert_same_events(tmp_path / store, tmp_path / "b_once")
        for name in NAMES:
            ids = stored(tmp_path / store, name).column("event_id").to_numpy()
            assert len(np.unique(ids)) == len(ids)
    assert dedup > 0
    if id_kind is not None:
        for name in ("s1",):
            assert "changed" not in stored(tmp_path / "s", name).column("surface").to_pylist()


def test_two_partitions_two_consumers_equal_backfill(tmp_path, redis_port):  # noqa: F811
    """Two consumer processes, one per partition, write one store at the same time."""
    raw, items = random_log(12, tmp_path, files=3, rows=400, users=16, days=3, late=0.3)
    backfill(DEFS, tmp_path / "events", tmp_path / "b", sources={"items": items})
    url = f"redis://127.0.0.1:{redis_port}/ev"
    out = run_cli(
        ["produce", "--events", str(tmp_path / "events"), "--target", url, "--partitions", "2", "--batch", "25"]
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["streams"] == ["ev.0", "ev.1"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxscale.sequences", "stream"]
            + stream_args(url, tmp_path, items, "--partition", str(p), "--partitions", "2", "--until-idle", "1"),
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(2)
    ]
    reports = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        reports.append(json.loads(stdout))
    assert_same_events(tmp_path / "s", tmp_path / "b")
    assert sum(r["totals"]["rows"] for r in reports) == len(raw)
    assert all(r["totals"]["rows"] > 0 for r in reports)
    wrong = run_cli(["stream", *stream_args(url, tmp_path, items, "--until-idle", "0.1")])
    assert wrong.returncode == 2 and "published in 2 partitions" in wrong.stderr, wrong.stderr


# ------------------------------------------------------------------------------------- kill and resume


@pytest.mark.parametrize(
    "point",
    [("transform", "2"), ("write", "2", "2"), ("ack", "2")],
    ids=["mid-batch", "mid-commit", "after-commit-before-ack"],
)
def test_sigkill_and_resume_stores_every_event_once(tmp_path, redis_port, point):  # noqa: F811
    raw, items = random_log(5, tmp_path, files=2, rows=300, days=3, late=0.4)
    backfill(DEFS, tmp_path / "events", tmp_path / "b", sources={"items": items})
    url = f"redis://127.0.0.1:{redis_port}/ev"
    Producer(url, batch=30).publish_files(tmp_path / "events")
    killed = subprocess.run(
        [sys.executable, str(TESTS / "stream_kill_driver.py"), *point, "--"] + stream_args(url, tmp_path, items),
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    files = {f.name for name in NAMES for p in list_partitions(tmp_path / "s" / name).values() for f in p.iterdir()}
    batch2 = [f for f in files if f.startswith("part-0000000002-")]
    assert bool(batch2) == (point[0] != "transform")  # mid-commit and after-commit: batch 2 is (partly) stored
    client = redis.Redis(port=redis_port)
    assert client.xpending("ev", "g")["pending"] > 0  # the killed batch is still unacknowledged
    resumed = run_cli(["stream", *stream_args(url, tmp_path, items, "--until-idle", "0.5")])
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    assert_same_events(tmp_path / "s", tmp_path / "b")
    assert report["metrics"]["pending_entries"] == 0 and report["metrics"]["lag_entries"] == 0
    if point[0] != "transform":
        assert report["metrics"]["events_deduplicated"] > 0  # re-delivered events found stored
    for name in NAMES:
        ids = stored(tmp_path / "s", name).column("event_id").to_numpy()
        assert len(np.unique(ids)) == len(ids)


def test_sigterm_finishes_the_batch_and_exits_0(tmp_path, redis_port):  # noqa: F811
    raw, items = random_log(9, tmp_path, files=2, rows=200, days=2)
    backfill(DEFS, tmp_path / "events", tmp_path / "b", sources={"items": items})
    url = f"redis://127.0.0.1:{redis_port}/ev"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxscale.sequences", "stream", *stream_args(url, tmp_path, items)],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = redis.Redis(port=redis_port)
        deadline = time.monotonic() + 60
        while not client.exists("ev") or not client.xinfo_groups("ev"):  # the consumer created its group
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.05)
        Producer(url, batch=20).publish_files(tmp_path / "events")
        while (g := client.xinfo_groups("ev")[0])["lag"] or g["pending"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert json.loads(stdout)["metrics"]["events_acked"] == len(raw)
    assert_same_events(tmp_path / "s", tmp_path / "b")


def test_concurrent_consumers_threads_share_the_lock(tmp_path, redis_port):  # noqa: F811
    """Two consumers in one process (threads, each its own lock file handle) also commit safely."""
    raw, items = random_log(13, tmp_path, files=2, rows=300, users=10, days=2)
    backfill(DEFS, tmp_path / "events", tmp_path / "b", sources={"items": items})
    url = f"redis://127.0.0.1:{redis_port}/ev"
    Producer(url, partitions=2, batch=10).publish_files(tmp_path / "events")
    errors = []

    def consume(p):
        try:
            StreamConsumer(
                DEFS, url, "g", tmp_path / "s", micro_batch=30, partition=p, partitions=2,
                sources={"items": items}, block_ms=20, max_files=3,
            ).run(until_idle=0.3)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert_same_events(tmp_path / "s", tmp_path / "b")


def test_another_consumer_claims_a_dead_consumers_entries(tmp_path, redis_port):  # noqa: F811
    """Consumer A dies after a commit, before its ack; B (another name) claims A's pending entries (XAUTOCLAIM)."""
    raw, items = random_log(6, tmp_path, files=2, rows=200, days=2, late=0.3)
    backfill(DEFS, tmp_path / "events", tmp_path / "b", sources={"items": items})
    url = f"redis://127.0.0.1:{redis_port}/ev"
    Producer(url, batch=30).publish_files(tmp_path / "events")
    killed = subprocess.run(
        [sys.executable, str(TESTS / "stream_kill_driver.py"), "ack", "2", "--"]
        + stream_args(url, tmp_path, items, "--consumer", "A"),
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    client = redis.Redis(port=redis_port)
    assert {c["name"]: c["pending"] for c in client.xinfo_consumers("ev", "g")}[b"A"] > 0
    resumed = run_cli(
        ["stream", *stream_args(url, tmp_path, items, "--consumer", "B", "--claim-idle-ms", "0", "--until-idle", "0.5")]
    )
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["metrics"]["events_deduplicated"] > 0
    assert {c["name"]: c["pending"] for c in client.xinfo_consumers("ev", "g")}[b"A"] == 0
    assert_same_events(tmp_path / "s", tmp_path / "b")


def test_stream_cli_needs_one_source_and_a_group(tmp_path):
    defs = str(write_defs(tmp_path))
    both = run_cli(["stream", "--defs", defs, "--events", "x", "--source", "redis://h:1/s", "--out", "o",
                    "--micro-batch", "5"])  # fmt: skip
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    no_group = run_cli(["stream", "--defs", defs, "--source", "redis://127.0.0.1:1/s", "--out", str(tmp_path / "o"),
                        "--micro-batch", "5"])  # fmt: skip
    assert no_group.returncode == 2 and "needs --group" in no_group.stderr, no_group.stderr


def test_producer_refuses_unusable_columns(redis_port):  # noqa: F811
    producer = Producer(f"redis://127.0.0.1:{redis_port}/ev", partitions=2)
    events = _events(np.random.default_rng(0), 10, None)
    with pytest.raises(BrokerError, match="lack the raw columns \\['surface'\\]"):
        producer.publish(events.drop_columns(["surface"]))
    with pytest.raises(BrokerError, match="column 'event_id' of the events to publish has type double"):
        producer.publish(events.append_column("event_id", pa.array(np.ones(10))))
    with pytest.raises(BrokerError, match="published in 2 partitions"):
        Producer(f"redis://127.0.0.1:{redis_port}/ev", partitions=3)
    assert producer.events == 0


# ----------------------------------------------------------------------------------- a broker that goes away


class _Broker:
    """A redis-server with an append-only file fsynced at every write, killed and restarted on its port."""

    def __init__(self, folder: Path):
        import shutil

        self.binary, self.folder, self.port, self.proc = shutil.which("redis-server"), Path(folder), free_port(), None
        self.folder.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes"]
        args += ["--appendfsync", "always", "--dir", str(self.folder)]
        self.proc = subprocess.Popen([self.binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client, deadline = redis.Redis(port=self.port), time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_a_broker_that_goes_away_is_waited_for_and_nothing_is_lost(tmp_path):
    """redis-server SIGKILLed under a running consumer and back 8 s later (longer than the Redis client's own
    retries): the consumer waits, re-reads its pending entries and stores every event exactly once (it used to
    die with a ConnectionError); with --broker-timeout shorter than the outage it ends with an error naming it."""
    raw, items = random_log(13, tmp_path, files=2, rows=200, days=2)
    backfill(DEFS, tmp_path / "events", tmp_path / "b", sources={"items": items})
    first, second = sorted((tmp_path / "events").glob("*.parquet"))
    broker = _Broker(tmp_path / "redis")
    broker.start()
    try:
        url = f"redis://127.0.0.1:{broker.port}/ev"
        Producer(url, batch=20).publish_files(first)
        consumer = StreamConsumer(DEFS, url, "g", tmp_path / "s", micro_batch=50, sources={"items": items}, block_ms=50)
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(report=consumer.run(until_idle=1.5)))
        thread.start()
        client, deadline = redis.Redis(port=broker.port), time.monotonic() + 60
        # the producer made the stream; the consumer's thread may not have created its group yet
        while not (groups := client.xinfo_groups("ev")) or groups[0]["lag"] or groups[0]["pending"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        broker.kill()
        time.sleep(8)
        assert thread.is_alive()  # waiting for the broker, not dead
        broker.start()
        Producer(url, batch=20).publish_files(second)
        thread.join(timeout=120)
        assert not thread.is_alive()
        report = result["report"]
        assert report.extra["metrics"]["broker_outages"] >= 1
        assert_same_events(tmp_path / "s", tmp_path / "b")
        for name in NAMES:
            ids = stored(tmp_path / "s", name).column("event_id").to_numpy()
            assert len(np.unique(ids)) == len(ids)

        # a broker that does not come back within --broker-timeout: the run ends with an error naming it
        quick = StreamConsumer(DEFS, url, "g2", tmp_path / "s2", micro_batch=50, sources={"items": items},
                               block_ms=50, broker_timeout_s=1.0)  # fmt: skip
        errors: list = []

        def run_quick():
            try:
                quick.run(until_idle=60)
            except BrokerError as e:
                errors.append(e)

        thread = threading.Thread(target=run_quick)
        thread.start()
        time.sleep(1.0)
        broker.kill()
        thread.join(timeout=60)
        assert not thread.is_alive() and len(errors) == 1
        assert f"127.0.0.1:{broker.port} has not answered for" in str(errors[0]) and "--broker-timeout 1" in str(
            errors[0]
        )
    finally:
        if broker.proc.poll() is None:
            broker.kill()
