"""Fresh hybrid states (`jaxscale.serving.states`): the published states equal the offline encoder on a brute-force
(row-by-row) reading of the raw log after new events arrive; only users with new events are recomputed (a
compaction recomputes nobody); the encoder compiles once; a user without events gets the default state; a
builder SIGKILLed inside a publication leaves the previous version served and a restart converges; events
pushed through the Redis stream reach the `StateReader` within 2 s of their acknowledgement."""

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import state_builder_driver as drv
from conftest import ROOT, TESTS, subprocess_env

from jaxscale.sequences.runtime import backfill, stream
from jaxscale.serving.freshness import run_freshness
from jaxscale.serving.states import POINTER, EncoderStateStore, StateReader, open_version, read_pointer, state_parts
from jaxscale_models.two_tower_inference import ENCODER_STATES, OfflineEncoder

T0 = 1_767_571_200_000  # 2026-01-05T00:00:00Z
DAY = 86_400_000
USERS = list(range(100, 124))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A backfilled store of 24 users over two days, and the brute-force reference encoder."""
    tmp = tmp_path_factory.mktemp("states")
    defs = drv.definitions()
    (tmp / "defs.json").write_text(defs.dumps())
    drv.items_table(tmp / "items.parquet")
    log = drv.events(USERS, 9, T0, 2 * DAY, seed=1)
    (tmp / "events").mkdir()
    pq.write_table(pa.Table.from_pylist(log), tmp / "events" / "part-0.parquet")
    backfill(defs, tmp / "events", tmp / "store", sources={"items": str(tmp / "items.parquet")})
    model, ec, emb_state = drv.tiny_model()
    return {
        "tmp": tmp,
        "defs": defs,
        "log": log,
        "parts": (model, ec, emb_state),
        "reference": OfflineEncoder(model, ec, emb_state),  # the brute force's encoder
        "encoder": ENCODER_STATES.encoder(model, ec, emb_state),  # the builders' (shared: one compilation in this file)
    }


def _fresh_store(world, name: str) -> Path:
    store = world["tmp"] / name
    shutil.copytree(world["tmp"] / "store", store)
    return store


def _stream_events(world, store: Path, rows: list[dict], name: str) -> None:
    """Adds `rows` through the file-replay stream (micro-batches of 4: several files, then a final merge)."""
    folder = world["tmp"] / name
    folder.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), folder / "part-0.parquet")
    stream(world["defs"], folder, store, sources={"items": str(world["tmp"] / "items.parquet")}, micro_batch=4)


def _check_against_brute_force(world, reader: StateReader, log: list[dict]) -> None:
    batch, newest = drv.brute_force_histories(log, USERS)
    want = world["reference"](batch)
    got, found = reader.lookup(np.array(USERS))
    assert found.all()
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.abs(want[1:] - want[:1]).max() > 1e-2  # distinct users' states: the comparison has teeth
    np.testing.assert_array_equal(reader.state_time(np.array(USERS)), newest)


def test_states_follow_the_store_recomputing_only_changed_users(world, tmp_path):
    store = _fresh_store(world, "follow")
    builder = drv.builder(store, world["tmp"] / "defs.json", tmp_path / "out", world["encoder"])
    first = builder.update()
    assert (first.version, first.recomputed, first.removed) == (1, len(USERS), 0)
    reader = StateReader(tmp_path / "out")
    assert reader.version == 1 and reader.dim == 16 and len(reader) == len(USERS)
    assert reader.model_version == drv.MODEL_VERSION
    _check_against_brute_force(world, reader, world["log"])
    assert builder.update().version is None  # nothing changed: no publication
    assert not reader.reload_if_changed()

    # new events for three users (a later day and a late event into an old day), through the stream
    changed = [103, 110, 121]
    new = drv.events(changed, 3, T0 + DAY - 5_000, 3 * DAY, seed=2)
    _stream_events(world, store, new, "new1")
    second = builder.update()
    assert (second.version, second.recomputed, second.removed) == (2, 3, 0)
    assert reader.reload_if_changed() and reader.version == 2
    _check_against_brute_force(world, reader, world["log"] + new)
    # the stream merged the partitions' files (new files for every user of those days): nobody else changed
    assert builder.update().version is None

    # five users, then eleven: the micro-batches keep one padded shape, so the encoder compiled once
    more = drv.events(USERS[:5], 1, T0 + 3 * DAY, DAY, seed=3)
    _stream_events(world, store, more, "new2")
    assert builder.update().recomputed == 5
    more2 = drv.events(USERS[5:16], 2, T0 + 4 * DAY, DAY, seed=4)
    _stream_events(world, store, more2, "new3")
    assert builder.update().recomputed == 11
    reader.reload_if_changed()
    _check_against_brute_force(world, reader, world["log"] + new + more + more2)
    assert builder.encoder_traces == 1
    assert builder.stats["users_recomputed"] == len(USERS) + 3 + 5 + 11
    m = builder.metrics.registry
    assert m.get_sample_value("jaxscale_states_users_recomputed_total") == len(USERS) + 19
    assert m.get_sample_value("jaxscale_states_publications_total") == 4
    assert m.get_sample_value("jaxscale_states_staleness_seconds_count") == len(USERS) + 19
    # old versions are removed (keep=3), CURRENT names the newest, and it reads as an encoder-state store too
    files = sorted(p.name for p in (tmp_path / "out").glob("states-*.arrow"))
    assert files == [f"states-{v:012d}.arrow" for v in (2, 3, 4)]
    assert read_pointer(tmp_path / "out")["version"] == 4
    enc = EncoderStateStore.open(tmp_path / "out" / files[-1], version=drv.MODEL_VERSION)
    np.testing.assert_array_equal(enc.get(USERS), reader.lookup(np.array(USERS))[0])
    builder.close()


def test_unknown_user_gets_the_default_state(world, tmp_path):
    builder = drv.builder(
        _fresh_store(world, "default"), world["tmp"] / "defs.json", tmp_path / "out", world["encoder"]
    )
    builder.update()
    reader = StateReader(tmp_path / "out")
    states, found = reader.lookup(np.array([USERS[0], 99_999, -1]))
    assert found.tolist() == [True, False, False]
    empty, _ = drv.brute_force_histories([], [99_999])
    want = world["reference"](empty)[0]
    np.testing.assert_allclose(states[1], want, atol=1e-5)
    np.testing.assert_allclose(states[2], want, atol=1e-5)
    np.testing.assert_allclose(reader.default_state, want, atol=1e-5)
    assert np.abs(states[0] - want).max() > 1e-3
    assert reader.state_time(np.array([99_999]))[0] == -1
    builder.close()


def test_restart_recomputes_only_what_changed_while_down(world, tmp_path):
    store = _fresh_store(world, "restart")
    out = tmp_path / "out"
    b = drv.builder(store, world["tmp"] / "defs.json", out, world["encoder"])
    b.update()
    with pytest.raises(RuntimeError, match="another state builder"):
        drv.builder(store, world["tmp"] / "defs.json", out, world["encoder"])
    b.close()
    new = drv.events([107, 115], 2, T0 + 2 * DAY, DAY, seed=5)
    _stream_events(world, store, new, "down")
    b = drv.builder(store, world["tmp"] / "defs.json", out, world["encoder"])
    u = b.update()
    assert (u.version, u.recomputed) == (2, 2)
    _check_against_brute_force(world, StateReader(out), world["log"] + new)
    b.close()


@pytest.mark.slow  # a builder subprocess (JAX start-up and a compilation, ~15 s)
def test_sigkill_inside_a_publication_keeps_the_previous_version(world, tmp_path):
    store = _fresh_store(world, "kill")
    out = tmp_path / "out"
    defs_path = world["tmp"] / "defs.json"
    cmd = [sys.executable, str(TESTS / "state_builder_driver.py"), str(store), str(defs_path), str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env())
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("UPDATED"):
                new = drv.events([101, 102], 2, T0 + 2 * DAY, DAY, seed=6)
                _stream_events(world, store, new, "killed")
            if line.startswith("PUBLISHING"):
                break
        else:
            pytest.fail("the driver ended without publishing:\n" + "".join(lines))
        reader = StateReader(out)  # opened while the second version is half-way
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    assert reader.version == 1 and read_pointer(out)["version"] == 1
    assert list(out.glob(".states-*.tmp"))  # the killed publication's file, never renamed into place
    assert open_version(out / read_pointer(out)["file"]).version == 1
    _check_against_brute_force(world, reader, world["log"])  # the previous version, whole
    b = drv.builder(store, defs_path, out, world["encoder"])
    u = b.update()
    assert (u.version, u.recomputed) == (2, 2)
    assert not list(out.glob(".states-*.tmp"))
    assert reader.reload_if_changed()
    _check_against_brute_force(world, reader, world["log"] + new)
    b.close()


def test_encoder_is_exact_whatever_the_capacity_factor(world):
    """A fixed capacity factor drops the ids past it (a state would depend on its micro-batch's other users):
    the builder's encoder and every inference runner of `two_tower_inference` size exchanges for the worst
    case instead (`exact_collection`)."""
    import jaxscale
    from jaxscale_models.contextual_two_tower import request_ids, two_tower_tables

    model, ec, emb_state = world["parts"]
    settings = jaxscale.EmbeddingSettings(sharding="row_wise", capacity_factor=1.0)
    fixed = jaxscale.EmbeddingCollection(two_tower_tables(model.cfg), ec.mesh, settings)
    batch, _ = drv.brute_force_histories(world["log"], USERS)
    batch = {k: v[:16] for k, v in batch.items()}
    want = world["reference"](batch)
    np.testing.assert_allclose(ENCODER_STATES.encoder(model, fixed, emb_state)(batch), want, atol=1e-5)
    np.testing.assert_allclose(OfflineEncoder(model, fixed, emb_state)(batch), want, atol=1e-5)
    # What it avoids: the training collection itself drops ids past its capacity at this batch.
    ids = request_ids(model.cfg, batch, context=False)
    assert not np.array_equal(
        np.asarray(fixed.lookup(emb_state, fixed.shard_batch(ids))["item_ids"]),
        np.asarray(ec.lookup(emb_state, ec.shard_batch(ids))["item_ids"]),
    )


def test_a_bad_new_event_is_named_and_the_last_version_stays(world, tmp_path):
    store = _fresh_store(world, "bad")
    builder = drv.builder(store, world["tmp"] / "defs.json", tmp_path / "out", world["encoder"])
    builder.update()
    bad = dict(drv.events([105], 1, T0 + DAY, 1000, seed=7)[0], item_id=70)  # not in the items table: category -1
    _stream_events(world, store, [bad], "bad-events")
    with pytest.raises(ValueError, match=r"field 'category' of sequence 's1': user 105 has an event of category -1"):
        builder.update()
    builder.follow(0.01, _StopAfterErrors(builder, 2))  # a failed update is counted, then retried
    assert (
        builder.stats["errors"] == 2 and builder.metrics.registry.get_sample_value("jaxscale_states_errors_total") == 2
    )
    reader = StateReader(tmp_path / "out")
    assert reader.version == 1
    _check_against_brute_force(world, reader, world["log"])
    builder.close()


class _StopAfterErrors:
    """A stop event for `follow` that is set once the builder counted `n` errors."""

    def __init__(self, builder, n):
        self.builder, self.n = builder, n

    def is_set(self):
        return self.builder.stats["errors"] >= self.n

    def wait(self, timeout):
        return self.is_set()


def test_bad_publications_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no published states"):
        StateReader(tmp_path)
    (tmp_path / POINTER).write_text(json.dumps({"format": "other", "file": "x"}))
    with pytest.raises(ValueError, match="not a state pointer"):
        StateReader(tmp_path)


def test_redis_stream_events_reach_the_reader_within_two_seconds(world, tmp_path):
    from redis_helpers import redis_server

    with redis_server(tmp_path / "redis") as port:
        result = run_freshness(
            tmp_path,
            port,
            world["parts"],
            drv.TINY,
            events_per_second=1000,
            seconds=3.0,
            users=200,
            interval_s=0.1,
        )
    lat = result["latency_s"]
    assert result["events_reflected"] == result["events_acked"] == result["events_published"] == 3000
    assert lat["max"] < 2.0, result
    assert result["states_checked_equal"] and result["encoder_traces"] == 1 and result["builder_errors"] == 0


def test_state_parts_come_from_the_registered_model():
    """The builder asks the kind's `ModelSpec` for its encoder-state parts; a kind without them is refused by name."""
    assert state_parts("contextual_two_tower") is ENCODER_STATES
    with pytest.raises(ValueError, match=r"'dlrm' has no encoder states.*\['contextual_two_tower'\]"):
        state_parts("dlrm")


SMOKE = ROOT / "jaxscale" / "configs" / "two_tower_smoke.yaml"


@pytest.mark.slow  # a short training run, then the CLI in a subprocess (~40 s)
def test_cli_publishes_a_trained_checkpoints_states(world, tmp_path):
    from jaxscale.serving.states import load_model
    from jaxscale.training.config import load_config
    from jaxscale.training.trainer import Trainer

    store = _fresh_store(world, "cli")
    m = "model.contextual_two_tower"
    overrides = [f"{m}.{k}={list(v) if isinstance(v, tuple) else v}".replace(" ", "") for k, v in drv.TINY.items()]
    overrides += [
        "data.source=sequences",
        f"data.sequences.store={store}",
        "data.sequences.sequence=s1",
        f"data.sequences.defs={world['tmp'] / 'defs.json'}",
        "train.batch_size=16",
        "train.steps=3",
        "train.eval_every=0",
        "embedding.capacity_factor=2.0",
    ]
    cfg = load_config(str(SMOKE), overrides)
    Trainer(cfg, workdir=str(tmp_path / "run"), progress=False).run()
    out = tmp_path / "states"
    cmd = [sys.executable, "-m", "jaxscale.serving", "states", "--config", str(SMOKE)]
    cmd += ["--checkpoint", str(tmp_path / "run"), "--store", str(store), "--out", str(out), "--batch-size", "16"]
    run = subprocess.run(cmd + overrides, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    line = json.loads(run.stdout.strip().splitlines()[-1])
    assert (line["version"], line["recomputed"]) == (1, len(USERS))
    reader = StateReader(out)
    model, ec, emb_state, version = load_model(cfg, tmp_path / "run")
    assert reader.model_version == version == "run/step-3"
    batch, newest = drv.brute_force_histories(world["log"], USERS)
    got, found = reader.lookup(np.array(USERS))
    assert found.all()
    np.testing.assert_allclose(got, OfflineEncoder(model, ec, emb_state)(batch), atol=1e-5)
    np.testing.assert_array_equal(reader.state_time(np.array(USERS)), newest)
    synthetic = overrides[: len(drv.TINY)] + ["data.source=synthetic"]
    bad = subprocess.run(cmd + synthetic, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert bad.returncode == 2 and "data.source must be 'sequences'" in bad.stderr


def test_item_ids_are_numbered_by_the_training_stores_vocabulary(tmp_path):
    """A store fed by a stream numbers items in its own arrival order; the builder encodes the histories with the
    vocabulary of the store the model was trained on, so a state equals the training encoding of that history."""
    from jaxscale.sequences import Definitions, Sequence
    from jaxscale.serving.states import training_vocabulary
    from jaxscale_models.contextual_two_tower import ContextualTwoTowerConfig
    from jaxscale_models.contextual_two_tower_sequences import history_source

    base = drv.definitions()
    seq = base.sequences[0]
    defs = Definitions(
        event_types=base.event_types,
        enrichments=base.enrichments,
        sequences=(Sequence(seq.name, seq.event_types, seq.fields, seq.max_length, vocabularies=("item_id",)),),
        surfaces=base.surfaces,
    )
    (tmp_path / "defs.json").write_text(defs.dumps())
    drv.items_table(tmp_path / "items.parquet")
    sources = {"items": str(tmp_path / "items.parquet")}
    log = drv.events(USERS[:8], 6, T0, DAY, seed=5)
    for name, rows in (("train", log), ("served", log[::-1])):
        (tmp_path / name).mkdir()
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / name / "part-0.parquet")
    backfill(defs, tmp_path / "train", tmp_path / "train_store", sources=sources)  # frequency order
    stream(defs, tmp_path / "served", tmp_path / "served_store", sources=sources, micro_batch=4)  # arrival order
    cfg, users = ContextualTwoTowerConfig(**drv.TINY), np.array(USERS[:8])

    def histories(store, vocabulary=None):
        return history_source(store, "s1", tmp_path / "defs.json", cfg, vocabulary=vocabulary).current(users)[0]

    want = histories(tmp_path / "train_store")
    own = histories(tmp_path / "served_store")
    assert not np.array_equal(own["item_ids"], want["item_ids"])  # the two numberings differ: the test has teeth
    vocab = training_vocabulary(tmp_path / "served_store", tmp_path / "train_store", "s1")
    got = histories(tmp_path / "served_store", vocab)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert training_vocabulary(tmp_path / "train_store", tmp_path / "train_store", "s1") is None
    with pytest.raises(ValueError, match="--vocabulary-store"):
        training_vocabulary(tmp_path / "served_store", tmp_path / "gone", "s1")
