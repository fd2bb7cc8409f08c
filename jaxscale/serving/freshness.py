"""End-to-end state freshness: how long after the stream acknowledges a user's new event the served encoder
state includes it (issue 26's target: within 2 s at 1,000 events/s). Used by tests/test_state_builder.py and
experiments/two_tower/bench_freshness.py.

`run_freshness` runs the real pipeline against a redis-server: a producer publishes `events_per_second`
events (ticks of 50 ms, each event a distinct user's, event time = now) to a Redis stream; the broker
consumer (`jaxscale.sequences.broker.StreamConsumer`, in a thread) commits micro-batches to a sequence store
and acknowledges them; the state builder (`StateBuilder.follow`, in a thread) recomputes the changed users
every `interval_s` and publishes; a `StateReader` is polled every 10 ms. An event is reflected when the
reader's `state_time` of its user reaches the event's time. Latency = reflected minus acknowledged (the
consumer's XACK returned), per event; also publish -> acknowledged and publish -> reflected. At the end every
served state is checked against the encoder on the store's current histories.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from jaxscale.infra import atomic

TARGET_S = 2.0
SURFACES = ("home", "search")


def _definitions():
    from jaxscale.sequences import Definitions, Enrichment, EventType, Sequence

    return Definitions(
        event_types=(EventType("click"), EventType("save")),
        enrichments=(Enrichment("items", fields={"category": "int64"}, defaults={"category": -1}),),
        sequences=(Sequence("s1", ("click", "save"), ("item_id", "ts", "event_type", "surface", "category"), 256),),
        surfaces=SURFACES,
    )


def write_inputs(folder: Path, item_rows: int, num_categories: int):
    """The pipeline's definitions (defs.json) and item enrichment (items.parquet), each written whole through
    `jaxscale.infra.atomic` (a temporary file renamed over the target): a reader never sees a torn file, even
    when the writer dies mid-write. Returns the definitions."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    defs = _definitions()
    atomic.write_text(folder / "defs.json", defs.dumps())
    items = np.arange(item_rows, dtype=np.int64)
    with atomic.replacing(folder / "items.parquet") as tmp:
        pq.write_table(pa.table({"item_id": items, "category": items % num_categories}), tmp)
    return defs


def _quantiles(x) -> dict:
    x = np.asarray(x, np.float64)
    if not len(x):
        return {"n": 0}
    q = np.percentile(x, [50, 90, 99])
    return {"n": int(len(x)), "p50": q[0], "p90": q[1], "p99": q[2], "max": float(x.max()), "mean": float(x.mean())}


def run_freshness(
    folder,
    port: int,
    model_parts,
    model_kwargs: dict,
    *,
    events_per_second: int = 1000,
    seconds: float = 10.0,
    users: int = 1000,
    interval_s: float = 0.2,
    micro_batch: int = 500,
    batch_size: int = 64,
    drain_s: float = 15.0,
    kind: str = "contextual_two_tower",
) -> dict:
    """Runs the pipeline of the module doc against a redis-server on 127.0.0.1:`port`; returns the result.
    `kind`: the model kind whose registered `EncoderStateParts` build the states (`model_parts`, `model_kwargs`)."""
    import pyarrow as pa

    from jaxscale.sequences.broker import Producer, StreamConsumer
    from jaxscale.serving.states import StateBuilder, StateReader, state_parts
    from jaxscale.training import registry

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    parts, cfg = state_parts(kind), registry.get(kind).config(**model_kwargs)
    defs = write_inputs(folder, cfg.item_rows, cfg.num_categories)
    url, store, out = f"redis://127.0.0.1:{port}/events", folder / "store", folder / "states"

    acked: list[tuple[np.ndarray, np.ndarray, float]] = []

    class TimedConsumer(StreamConsumer):
        def process(self, entries):
            self._in_hand = entries
            super().process(entries)

        def _ack(self, ids):
            super()._ack(ids)
            now = time.time()
            for e in self._in_hand:
                if e.table is not None:
                    acked.append((e.table.column("user_id").to_numpy(), e.table.column("ts").to_numpy(), now))

    stop = threading.Event()
    consumer = TimedConsumer(
        defs, url, "states", store, micro_batch=micro_batch, sources={"items": str(folder / "items.parquet")},
        block_ms=20,
    )  # fmt: skip
    threads = [threading.Thread(target=consumer.run, kwargs={"stop": stop}, name="consumer", daemon=True)]
    threads[0].start()
    deadline = time.monotonic() + 30
    while not (store / "s1" / "_sequence.json").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the consumer did not create the store")
        time.sleep(0.02)
    model, ec, emb_state = model_parts
    encoder = parts.encoder(model, ec, emb_state)
    histories = parts.histories(store, "s1", folder / "defs.json", cfg)
    builder = StateBuilder(out, histories, encoder, model_version="bench", batch_size=batch_size)
    builder.update()
    reader = StateReader(out)
    updates = []
    threads.append(
        threading.Thread(
            target=builder.follow, args=(interval_s, stop), kwargs={"on_update": updates.append}, daemon=True
        )
    )
    threads[-1].start()

    published: list[tuple[np.ndarray, np.ndarray, float]] = []
    visible: dict[tuple[int, int], float] = {}
    poll_stop = threading.Event()

    def poll():
        seen = 0
        pend_u, pend_t = np.zeros(0, np.int64), np.zeros(0, np.int64)
        while not poll_stop.is_set():
            reader.reload_if_changed()
            n = len(acked)
            if n > seen:
                pend_u = np.concatenate([pend_u, *(a[0] for a in acked[seen:n])])
                pend_t = np.concatenate([pend_t, *(a[1] for a in acked[seen:n])])
                seen = n
            if len(pend_u):
                hit = reader.state_time(pend_u) >= pend_t
                now = time.time()
                for u, t in zip(pend_u[hit].tolist(), pend_t[hit].tolist()):
                    visible[(u, t)] = now
                pend_u, pend_t = pend_u[~hit], pend_t[~hit]
            time.sleep(0.01)

    poller = threading.Thread(target=poll, name="poller", daemon=True)
    poller.start()

    producer = Producer(url, batch=1024)
    rng = np.random.default_rng(0)
    order = rng.permutation(np.arange(1, users + 1, dtype=np.int64))
    per_tick = max(1, int(round(events_per_second * 0.05)))
    cursor, t_start = 0, time.monotonic()
    total = int(round(events_per_second * seconds))
    sent = 0
    while sent < total:
        n = min(per_tick, total - sent)
        u = order[(cursor + np.arange(n)) % users]
        cursor += n
        now_ms = int(time.time() * 1000)
        table = pa.table(
            {
                "user_id": u,
                "ts": np.full(n, now_ms, np.int64),
                "event_type": rng.choice(["click", "save"], n),
                "item_id": rng.integers(0, cfg.item_rows, n),
                "surface": rng.choice(["home", "search", "other"], n),
            }
        )
        producer.publish(table)
        published.append((u, np.full(n, now_ms, np.int64), time.time()))
        sent += n
        time.sleep(max(0.0, t_start + (sent / events_per_second) - time.monotonic()))
    produce_s = time.monotonic() - t_start
    deadline = time.monotonic() + drain_s
    while len(visible) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    poll_stop.set()
    poller.join(5)
    stop.set()
    for t in threads:
        t.join(30)

    ack_time = {(int(u), int(t)): a for us, ts, a in acked for u, t in zip(us, ts)}
    pub_time = {(int(u), int(t)): p for us, ts, p in published for u, t in zip(us, ts)}
    keys = [k for k in pub_time if k in ack_time and k in visible]
    latency = [visible[k] - ack_time[k] for k in keys]
    # every served state equals the offline encoder on the store's current histories
    builder.update()
    reader.reload_if_changed()
    ids = np.unique(np.concatenate([p[0] for p in published]))
    batch, newest, _ = histories.current(ids)
    want = np.concatenate(
        [builder._encode({k: v[i : i + batch_size] for k, v in batch.items()}) for i in range(0, len(ids), batch_size)]
    )
    got, found = reader.lookup(ids)
    builder.close()
    return {
        "events_per_second": events_per_second,
        "produce_seconds": round(produce_s, 3),
        "achieved_events_per_second": round(total / produce_s, 1),
        "users": users,
        "interval_s": interval_s,
        "micro_batch": micro_batch,
        "batch_size": batch_size,
        "events_published": total,
        "events_acked": len(ack_time),
        "events_reflected": len(visible),
        "latency_s": _quantiles(latency),
        "publish_to_ack_s": _quantiles([ack_time[k] - pub_time[k] for k in keys]),
        "publish_to_reflected_s": _quantiles([visible[k] - pub_time[k] for k in keys]),
        "publications": builder.stats["publications"],
        "users_recomputed": builder.stats["users_recomputed"],
        "update_seconds": _quantiles([u.seconds for u in updates if u.version is not None]),
        "encoder_traces": builder.encoder_traces,
        "builder_errors": builder.stats["errors"],
        "states_checked_equal": bool(
            found.all() and np.allclose(got, want, atol=1e-5) and np.array_equal(reader.state_time(ids), newest)
        ),
        "target_s": TARGET_S,
        "target_met": bool(latency and max(latency) < TARGET_S),
    }
