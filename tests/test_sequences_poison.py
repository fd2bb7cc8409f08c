"""The broker consumer under hostile input and departed consumers, against a real redis-server: poison
entries go to the dead-letter stream (at once when they cannot be decoded, after --max-deliveries when they
fail later) and never block the good entries around them; any valid entry id is accepted (more than 1,024
entries in one millisecond, a sequence part up to 2**64 - 1); the entries of a consumer SIGKILLed before its
ack are claimed by a replacement under another name that started within a second, while it runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from conftest import TESTS
from redis_helpers import redis_port  # noqa: F401  (the fixture)
from test_sequences_broker import DEFS, NAMES, _events, assert_same_events, env, run_cli, stored, stream_args
from test_sequences_helpers import random_log

from jaxscale.sequences.broker import ARRIVAL_BASE, BrokerError, Producer, StreamConsumer, encode_entry
from jaxscale.sequences.runtime import backfill
from jaxscale.sequences.store import read_sequence


def _good_and_backfill(tmp_path: Path, seed: int = 4, rows: int = 200):
    """A random log, its items table and a backfill of it (the store every test's consumer must equal)."""
    raw, items = random_log(seed, tmp_path, files=2, rows=rows, days=2, bad=False)
    backfill(DEFS, tmp_path / "events", tmp_path / "b", sources={"items": items})
    return raw, items


def _poison(client: redis.Redis, key: str) -> dict[bytes, str]:
    """XADDs one entry of each poison kind; {entry id: what its dead-letter reason must say}."""
    events = _events(np.random.default_rng(1), 4, None)
    no_item = encode_entry(events.drop_columns(["item_id"]))
    listed = encode_entry(events.set_column(3, "item_id", pa.array([[1]] * 4)))
    wrong_n = {**encode_entry(events), b"n": b"5"}
    kinds = {
        "not a jaxscale events entry": {b"foo": b"bar"},
        "not a readable Arrow IPC stream": {b"format": b"jaxscale-events/1", b"n": b"1", b"data": b"\x00garbage"},
        "lack the raw columns ['item_id']": no_item,
        "column 'item_id' has type list<item: int64>": listed,
        "n='5' but its data holds 4 events": wrong_n,
    }
    return {client.xadd(key, fields): reason for reason, fields in kinds.items()}


def test_poison_entries_are_dead_lettered_and_never_block_the_good_ones(tmp_path, redis_port):  # noqa: F811
    raw, items = _good_and_backfill(tmp_path)
    url = f"redis://127.0.0.1:{redis_port}/ev"
    client = redis.Redis(port=redis_port)
    producer = Producer(url, batch=25)
    files = sorted((tmp_path / "events").glob("*.parquet"))
    poison = _poison(client, "ev")  # first in the stream: today's consumer dies on them before anything else
    producer.publish(pq.read_table(files[0]))
    poison.update(_poison(client, "ev"))  # and mixed among the good entries of one micro-batch
    producer.publish(pq.read_table(files[1]))
    consumer = StreamConsumer(DEFS, url, "g", tmp_path / "s", micro_batch=10_000, sources={"items": items}, block_ms=50)
    report = consumer.run(until_idle=0.3).to_json()
    assert_same_events(tmp_path / "s", tmp_path / "b")  # every good event, once
    for name in NAMES:
        ids = stored(tmp_path / "s", name).column("event_id").to_numpy()
        assert len(np.unique(ids)) == len(ids)
    dead = client.xrange("ev:dead")
    assert {f[b"dead-entry-id"] for _, f in dead} == set(poison)
    for _, fields in dead:
        entry_id = fields[b"dead-entry-id"]
        assert poison[entry_id] in fields[b"dead-reason"].decode(), fields[b"dead-reason"]
        assert fields[b"dead-stream"] == b"ev" and fields[b"dead-group"] == b"g" and fields[b"dead-deliveries"] == b"1"
        original = client.xrange("ev", entry_id, entry_id)  # the original fields travel with it
        assert original == [] or {k: v for k, v in fields.items() if not k.startswith(b"dead-")} == original[0][1]
    assert client.xpending("ev", "g")["pending"] == 0
    m = report["metrics"]
    assert m["entries_dead_lettered"] == report["dead_lettered"] == len(poison) == 10
    assert m["events_consumed"] == m["events_acked"] == len(raw)


def test_a_poison_entry_no_longer_kills_every_restart(tmp_path, redis_port):  # noqa: F811
    """`XADD ev * foo bar` before the events: the CLI consumer logs it to the dead-letter stream and goes on."""
    raw, items = _good_and_backfill(tmp_path, seed=5, rows=120)
    url = f"redis://127.0.0.1:{redis_port}/ev"
    client = redis.Redis(port=redis_port)
    bad = client.xadd("ev", {"foo": "bar"})
    Producer(url, batch=30).publish_files(tmp_path / "events")
    zero = run_cli(["stream", *stream_args(url, tmp_path, items, "--until-idle", "0.5", "--max-deliveries", "0")])
    assert zero.returncode == 2 and "--max-deliveries must be a positive integer, got 0" in zero.stderr, zero.stderr
    out = run_cli(["stream", *stream_args(url, tmp_path, items, "--until-idle", "0.5", "--max-deliveries", "2")])
    assert out.returncode == 0, out.stderr
    assert f"entry {bad.decode()} (0 events, delivery 1) moved to ev:dead" in out.stderr
    assert json.loads(out.stdout)["metrics"]["entries_dead_lettered"] == 1
    assert_same_events(tmp_path / "s", tmp_path / "b")
    again = run_cli(["stream", *stream_args(url, tmp_path, items, "--until-idle", "0.2")])
    assert again.returncode == 0 and json.loads(again.stdout)["metrics"]["events_consumed"] == 0, again.stderr
    assert len(client.xrange("ev:dead")) == 1


def test_an_entry_failing_its_transform_is_retried_then_dead_lettered(tmp_path, redis_port, monkeypatch):  # noqa: F811
    """An entry that decodes but fails later stays pending, is retried by the claim sweeps and moves to the
    dead-letter stream on its --max-deliveries-th failure; the entries beside it are stored once."""
    from jaxscale.sequences import engine

    raw, items = _good_and_backfill(tmp_path, seed=6, rows=120)
    url = f"redis://127.0.0.1:{redis_port}/ev"
    client = redis.Redis(port=redis_port)
    Producer(url, batch=30).publish_files(tmp_path / "events")
    marked = _events(np.random.default_rng(2), 3, None).set_column(0, "user_id", pa.array([-666] * 3))
    bad = client.xadd("ev", encode_entry(marked))
    transform = engine.Engine.transform

    def failing(self, table, *args, **kwargs):
        if -666 in table.column("user_id").to_pylist():
            raise ValueError("user -666 cannot be transformed")
        return transform(self, table, *args, **kwargs)

    monkeypatch.setattr(engine.Engine, "transform", failing)
    consumer = StreamConsumer(
        DEFS, url, "g", tmp_path / "s", micro_batch=10_000, sources={"items": items}, block_ms=20,
        claim_idle_ms=0, max_deliveries=3,
    )  # fmt: skip
    report = consumer.run(until_idle=0.5).to_json()
    assert_same_events(tmp_path / "s", tmp_path / "b")
    [(_, dead)] = client.xrange("ev:dead")
    assert dead[b"dead-entry-id"] == bad and dead[b"dead-deliveries"] == b"3"
    assert b"ValueError: user -666 cannot be transformed (delivery 3 of at most 3)" in dead[b"dead-reason"]
    assert dead[b"data"] == encode_entry(marked)[b"data"]
    m = report["metrics"]
    assert m["entries_failed"] == 3 and m["entries_dead_lettered"] == 1 and m["events_dead_lettered"] == 3
    assert client.xpending("ev", "g")["pending"] == 0


def test_an_entry_delivered_too_often_is_dead_lettered_unprocessed(tmp_path, redis_port):  # noqa: F811
    """A consumer that died holding an entry max-deliveries times (it crashed the process each time): the
    next read moves it to the dead-letter stream instead of processing it once more."""
    raw, items = _good_and_backfill(tmp_path, seed=7, rows=80)
    url = f"redis://127.0.0.1:{redis_port}/ev"
    client = redis.Redis(port=redis_port)
    client.xgroup_create("ev", "g", id="0", mkstream=True)
    killer = client.xadd("ev", encode_entry(_events(np.random.default_rng(3), 2, None)))
    for cursor in (">", "0", "0"):  # three deliveries to consumer-0, never acknowledged
        assert client.xreadgroup("g", "consumer-0", {"ev": cursor}, count=1)[0][1][0][0] == killer
    Producer(url, batch=30).publish_files(tmp_path / "events")
    consumer = StreamConsumer(
        DEFS, url, "g", tmp_path / "s", micro_batch=50, sources={"items": items}, block_ms=20, max_deliveries=3
    )
    consumer.run(until_idle=0.3)
    [(_, dead)] = client.xrange("ev:dead")
    assert dead[b"dead-entry-id"] == killer and dead[b"dead-deliveries"] == b"4"
    assert b"delivered 4 times without being committed (--max-deliveries 3)" in dead[b"dead-reason"]
    assert_same_events(tmp_path / "s", tmp_path / "b")


# ---------------------------------------------------------------------------------------- arrival ids


def test_every_valid_entry_id_is_accepted_in_arrival_order(tmp_path, redis_port):  # noqa: F811
    """1,500 entries in one millisecond (today's encoding holds 1,024) and one whose sequence part is
    2**64 - 1: all stored, their arrival ids increasing in entry order, above every id written before."""
    _, items = random_log(1, tmp_path / "items", files=1, rows=10)
    url = f"redis://127.0.0.1:{redis_port}/ev"
    client = redis.Redis(port=redis_port)
    client.set("ev:partitions", 1)
    ms = int(time.time() * 1000) - 10_000
    base = _events(np.random.default_rng(4), 1, "int")
    pipe = client.pipeline(transaction=False)
    ids = [f"{ms}-{seq}" for seq in range(1500)] + [f"{ms}-{2**64 - 1}", f"{ms + 1}-0"]
    for i, entry_id in enumerate(ids):
        one = base.set_column(5, "event_id", pa.array([i], pa.int64()))
        one = one.set_column(1, "ts", pa.array([base.column("ts")[0].as_py()], pa.int64()))  # one ts: arrival decides
        pipe.xadd("ev", encode_entry(one), id=entry_id)
    pipe.execute()
    consumer = StreamConsumer(DEFS, url, "g", tmp_path / "s", micro_batch=400, sources={"items": items}, block_ms=20)
    consumer.run(until_idle=0.3)
    name = next(s.name for s in DEFS.sequences if base.column("event_type")[0].as_py() in s.event_types)
    got = read_sequence(tmp_path / "s", name, ["user_id", "ts", "arrival", "ingest_ts", "event_id"])
    assert got.num_rows == len(ids)
    assert got.column("event_id").to_pylist() == list(range(len(ids)))  # (user, ts) tie: arrival = entry order
    arrival = np.array(got.column("arrival").to_pylist())
    assert (np.diff(arrival) > 0).all() and arrival.min() >= ARRIVAL_BASE
    assert set(got.column("ingest_ts").to_pylist()) == {ms, ms + 1}


def test_arrival_counter_of_another_format_is_refused(tmp_path, redis_port):  # noqa: F811
    _, items = random_log(1, tmp_path / "items", files=1, rows=10)
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "_arrivals.json").write_text('{"format": "something-else", "next": 3}')
    consumer = StreamConsumer(
        DEFS, f"redis://127.0.0.1:{redis_port}/ev", "g", tmp_path / "s", micro_batch=10, sources={"items": items}
    )
    with pytest.raises(BrokerError, match="not a jaxscale-arrivals/1 counter: the store was written by another"):
        consumer.run(until_idle=0.1)


# ------------------------------------------------------------------------------------ departed consumers


def test_replacement_consumer_claims_a_killed_consumers_entries_while_running(tmp_path, redis_port):  # noqa: F811
    """Consumer A reads a micro-batch and is SIGKILLed before acknowledging it; B (another name) starts at
    once with a 1.5 s min-idle: at its start A's entries are not idle enough, so only the claim sweeps of
    its running loop can store them. Every event ends up stored exactly once."""
    raw, items = random_log(5, tmp_path, files=2, rows=300, days=3, late=0.4)
    backfill(DEFS, tmp_path / "events", tmp_path / "b", sources={"items": items})
    url = f"redis://127.0.0.1:{redis_port}/ev"
    Producer(url, batch=30).publish_files(tmp_path / "events")
    killed = subprocess.run(
        [sys.executable, str(TESTS / "stream_kill_driver.py"), "transform", "2", "--"]
        + stream_args(url, tmp_path, items, "--consumer", "A"),
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    client = redis.Redis(port=redis_port)
    left = {c["name"]: c["pending"] for c in client.xinfo_consumers("ev", "g")}[b"A"]
    assert left > 0
    idle = min(r["time_since_delivered"] for r in client.xpending_range("ev", "g", "-", "+", 100, consumername="A"))
    assert idle < 1000, idle  # B starts well within the min-idle
    consumer = StreamConsumer(
        DEFS, url, "g", tmp_path / "s", micro_batch=100, consumer="B", sources={"items": items}, block_ms=50,
        claim_idle_ms=1500,
    )  # fmt: skip
    report = consumer.run(until_idle=2.5)
    assert {c["name"]: c["pending"] for c in client.xinfo_consumers("ev", "g")}[b"A"] == 0
    assert client.xpending("ev", "g")["pending"] == 0
    assert_same_events(tmp_path / "s", tmp_path / "b")
    for name in NAMES:
        ids = stored(tmp_path / "s", name).column("event_id").to_numpy()
        assert len(np.unique(ids)) == len(ids)
    assert report.extra["metrics"]["entries_claimed"] == left
