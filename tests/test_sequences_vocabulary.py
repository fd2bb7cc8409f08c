"""Dense id vocabularies (`Sequence(..., vocabularies=...)`): the backfill's vocabulary against a brute-force
ranking (frequency, ties by first arrival), append-only growth (a range backfill, a second backfill over a
grown log, the stream commit by commit), versions, the atomic two-file write, the declaration's errors,
the serving API's ids=dense, the training reader's dense item ids, and the two-tower's 'missing' category."""

import dataclasses
import http.client
import json
import subprocess
import sys
import threading
from collections import Counter

import numpy as np
import pytest
from conftest import subprocess_env
from test_sequences_helpers import make_defs, random_log

from jaxscale.sequences import DefinitionError, Definitions, Enrichment, EventType, Sequence
from jaxscale.sequences.definitions import definitions_from_json
from jaxscale.sequences.examples import PointInTimeExamples
from jaxscale.sequences.query import SequenceReader
from jaxscale.sequences.runtime import backfill, stream
from jaxscale.sequences.server import serve_in_thread
from jaxscale.sequences.store import read_sequence
from jaxscale.sequences.vocabulary import (
    OOV,
    PAD,
    Vocabulary,
    load_vocabulary,
    save_vocabulary,
    vocabulary_paths,
)


def vocab_defs() -> Definitions:
    """make_defs() with vocabularies on s1's item_id and its int64 enrichment field `category`."""
    d = make_defs(max_length=50)
    s1 = dataclasses.replace(d.sequences[0], vocabularies=("item_id", "category"))
    return dataclasses.replace(d, sequences=(s1, d.sequences[1]))


def brute_force_order(store, field: str) -> list[int]:
    """Stored ids by events descending, ties by the arrival of their first event (row by row)."""
    t = read_sequence(store, "s1").to_pylist()
    count, first = Counter(), {}
    for r in t:
        count[r[field]] += 1
        first[r[field]] = min(first.get(r[field], r["arrival"]), r["arrival"])
    return sorted(count, key=lambda i: (-count[i], first[i]))


def stored_ids(store, field="item_id") -> np.ndarray:
    return read_sequence(store, "s1").column(field).to_numpy()


# ------------------------------------------------------------------------------------------ the class


def test_encode_decode_and_reserved_indices():
    v = Vocabulary("item_id", np.array([50, 7, 2**40]), version=3)
    assert (v.size, v.num_indices, v.version) == (3, 5, 3)
    assert v.encode(np.array([7, 50, 2**40, 8, -1])).tolist() == [3, 2, 4, OOV, OOV]
    assert v.decode(np.array([2, 3, 4, PAD, OOV, -1])).tolist() == [50, 7, 2**40, -1, -1, -1]
    with pytest.raises(ValueError, match=r"indices \[0, 5\); got 5"):
        v.decode(np.array([5]))
    w = v.extended([9, 1], [4, 2])
    assert w.version == 4 and w.encode(np.array([50, 9, 1])).tolist() == [2, 5, 6]
    with pytest.raises(ValueError, match="id 7 more than once"):
        v.extended([7])
    empty = Vocabulary("item_id", np.zeros(0, np.int64))
    assert empty.encode(np.array([1, 2])).tolist() == [OOV, OOV] and empty.num_indices == 2


def test_a_reader_between_the_two_writes_sees_one_whole_version(tmp_path):
    v1 = Vocabulary("item_id", np.array([10, 20]), 1)
    save_vocabulary(tmp_path, v1)
    v2 = v1.extended([30, 40])
    parquet, meta = vocabulary_paths(tmp_path, "item_id")
    old_meta = meta.read_text()
    save_vocabulary(tmp_path, v2)
    meta.write_text(old_meta)  # as if the writer died after the Parquet file, before the JSON
    got = load_vocabulary(tmp_path, "item_id")
    assert got.version == 1 and got.ids.tolist() == [10, 20]
    save_vocabulary(tmp_path, v2)
    assert load_vocabulary(tmp_path, "item_id").ids.tolist() == [10, 20, 30, 40]
    assert json.loads(meta.read_text()) == {"field": "item_id", "version": 2, "size": 4, "pad": 0, "oov": 1}
    assert load_vocabulary(tmp_path, "category") is None

    # concurrent: a writer appending versions, readers always see a prefix of the final ids of their size
    final = list(range(100, 400))
    stop, seen, errors = threading.Event(), [], []

    def read():
        while not stop.is_set():
            try:
                v = load_vocabulary(tmp_path, "item_id")
                seen.append(v.version)
                if v.ids[4:].tolist() != final[: v.size - 4]:
                    errors.append(v.ids.tolist())
            except Exception as e:  # noqa: BLE001 - any failure is the bug
                errors.append(repr(e))

    t = threading.Thread(target=read)
    t.start()
    v = v2
    for i in range(0, len(final), 10):
        v = v.extended(final[i : i + 10])
        save_vocabulary(tmp_path, v)
    stop.set()
    t.join()
    assert not errors and seen and seen == sorted(seen)


# ------------------------------------------------------------------------------------------ declaration


def test_declaration_errors_and_json():
    base = dict(event_types=("a",), fields=("item_id", "ts", "surface", "category", "score"), max_length=5)
    ets, en = (EventType("a"),), (Enrichment("items", fields={"category": "int64", "score": "float64"}),)

    def defs(vocabularies):
        return Definitions(ets, (Sequence("s", **base, vocabularies=vocabularies),), en)

    for vocabularies, message in (
        (("colour",), r"sequence 's', field 'vocabularies': 'colour' is not among its fields"),
        (("ts",), r"field 'vocabularies': 'ts' is not an id field"),
        (("surface",), r"field 'vocabularies': 'surface' is not an id field"),
        (("score",), r"field 'vocabularies': 'score' is a float64 field of enrichment 'items'"),
        ("item_id", r"field 'vocabularies': must be a tuple of strings"),
        (("item_id", "item_id"), r"field 'vocabularies': lists \['item_id'\] more than once"),
    ):
        with pytest.raises(DefinitionError, match=message):
            defs(vocabularies)
    d = defs(("item_id", "category"))
    data = d.to_json()
    assert data["sequences"][0]["vocabularies"] == ["item_id", "category"]
    assert definitions_from_json(json.loads(d.dumps())) == d
    old = defs(()).to_json()  # JSON from before the key: no 'vocabularies', still schema_version 1
    assert "vocabularies" not in old["sequences"][0] and definitions_from_json(old).sequences[0].vocabularies == ()


# ------------------------------------------------------------------------------------------ backfill, stream


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backfill_builds_the_frequency_order(tmp_path, seed):
    _, items = random_log(seed, tmp_path, files=3, rows=200, items=30)
    backfill(vocab_defs(), tmp_path / "events", tmp_path / "store", sources={"items": items})
    seq_dir = tmp_path / "store" / "s1"
    for field in ("item_id", "category"):
        v = load_vocabulary(seq_dir, field)
        assert v.version == 1 and v.ids.tolist() == brute_force_order(tmp_path / "store", field)
        counts = Counter(stored_ids(tmp_path / "store", field).tolist())
        assert v.counts.tolist() == [counts[i] for i in v.ids.tolist()]
    assert not (seq_dir.parent / "s2" / "_vocab").exists()  # s2 declares none
    # an identical rerun adds nothing: same version, same file
    before = vocabulary_paths(seq_dir, "item_id")[0].read_bytes()
    backfill(vocab_defs(), tmp_path / "events", tmp_path / "store", sources={"items": items})
    assert load_vocabulary(seq_dir, "item_id").version == 1
    assert vocabulary_paths(seq_dir, "item_id")[0].read_bytes() == before


def test_backfills_only_append(tmp_path):
    """A range backfill counts the stored days outside it; a second backfill over a grown log keeps every
    old index and appends the new ids in frequency order over the whole store."""
    _, items = random_log(3, tmp_path / "small", files=2, rows=150, items=20, days=2)
    store = tmp_path / "store"
    backfill(vocab_defs(), tmp_path / "small" / "events", store, sources={"items": items})
    v1 = load_vocabulary(store / "s1", "item_id")
    # grow: a log with more items (ids the first run never saw), then backfill everything again
    _, items = random_log(3, tmp_path / "big", files=4, rows=300, items=40, days=4)
    backfill(vocab_defs(), tmp_path / "big" / "events", store, sources={"items": items})
    v2 = load_vocabulary(store / "s1", "item_id")
    assert v2.version == 2 and v2.ids[: v1.size].tolist() == v1.ids.tolist()
    new = [i for i in brute_force_order(store, "item_id") if i not in set(v1.ids.tolist())]
    assert v2.ids[v1.size :].tolist() == new
    assert (v2.encode(stored_ids(store)) >= 2).all()
    # a backfill of one day keeps the other days' ids (counted from the store) and every index
    backfill(
        vocab_defs(), tmp_path / "big" / "events", store, sources={"items": items}, start="2026-01-06", end="2026-01-06"
    )
    v3 = load_vocabulary(store / "s1", "item_id")
    assert v3.ids[: v2.size].tolist() == v2.ids.tolist() and (v3.encode(stored_ids(store)) >= 2).all()


def test_stream_extends_append_only_before_each_commit(tmp_path):
    _, items = random_log(4, tmp_path, files=3, rows=200, items=30)
    store = tmp_path / "stream"
    history = []

    def on_commit(i, report):
        v = load_vocabulary(store / "s1", "item_id")
        if history:
            assert v.version >= history[-1].version
            assert v.ids[: history[-1].size].tolist() == history[-1].ids.tolist()  # no index ever moves
        assert (v.encode(stored_ids(store)) >= 2).all()  # every committed id is in the vocabulary
        history.append(v)

    stream(vocab_defs(), tmp_path / "events", store, sources={"items": items}, micro_batch=37, on_commit=on_commit)
    final = load_vocabulary(store / "s1", "item_id")
    assert len(history) > 3 and history[0].version >= 1 and final.version > history[0].version
    assert sorted(final.ids.tolist()) == sorted(set(stored_ids(store).tolist()))
    # a backfill over the streamed store keeps the stream's indices (nothing new: same version)
    backfill(vocab_defs(), tmp_path / "events", store, sources={"items": items})
    again = load_vocabulary(store / "s1", "item_id")
    assert again.version == final.version and again.ids.tolist() == final.ids.tolist()


def test_ray_backfill_writes_the_same_vocabulary(tmp_path):
    ray = pytest.importorskip("ray", reason="ray[data] is a test dependency")
    from jaxscale.sequences.distributed import backfill_ray

    _, items = random_log(6, tmp_path, files=2, rows=120, items=20, row_group_size=50)
    backfill(vocab_defs(), tmp_path / "events", tmp_path / "a", sources={"items": items})
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        backfill_ray(vocab_defs(), tmp_path / "events", tmp_path / "b", sources={"items": items})
    finally:
        ray.shutdown()
    for field in ("item_id", "category"):
        a, b = (vocabulary_paths(tmp_path / s / "s1", field) for s in ("a", "b"))
        assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


# ------------------------------------------------------------------------------------------ readers


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vocab")
    _, items = random_log(7, tmp, files=3, rows=250, items=30, bad=False)
    defs = vocab_defs()
    (tmp / "defs.json").write_text(defs.dumps())
    backfill(defs, tmp / "events", tmp / "store", sources={"items": items})
    return tmp / "store", tmp / "defs.json"


def _get(server, path):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_serving_answers_raw_or_dense(built):
    store, _ = built
    reader = SequenceReader(store, "s1")
    vi, vc = reader.vocabulary("item_id"), reader.vocabulary("category")
    user = int(read_sequence(store, "s1").column("user_id")[0].as_py())
    server = serve_in_thread(store)
    try:
        status, raw = _get(server, f"/v1/users/{user}/sequences/s1?limit=10")
        status_d, dense = _get(server, f"/v1/users/{user}/sequences/s1?limit=10&ids=dense")
        assert status == status_d == 200 and raw["events"] and len(raw["events"]) == len(dense["events"])
        assert _get(server, f"/v1/users/{user}/sequences/s1?limit=10&ids=raw")[1] == raw
        for r, d in zip(raw["events"], dense["events"]):
            assert d["item_id"] == vi.encode(r["item_id"]) and d["category"] == vc.encode(r["category"])
            assert {k: v for k, v in r.items() if k not in ("item_id", "category")} == {
                k: v for k, v in d.items() if k not in ("item_id", "category")
            }
        assert raw["events"] == reader.events(user, limit=10)
        assert dense["events"] == reader.events(user, limit=10, ids="dense")
        status, body = _get(server, f"/v1/users/{user}/sequences/s2?ids=dense")
        assert status == 400 and "has no vocabulary" in body["error"]
        status, body = _get(server, f"/v1/users/{user}/sequences/s1?ids=hashed")
        assert status == 400 and "ids must be one of ['raw', 'dense']" in body["error"]
        status, body = _get(server, "/v1/sequences")
        assert body["sequences"]["s1"]["vocabularies"]["item_id"] == {
            "version": 1,
            "size": vi.size,
            "num_indices": vi.num_indices,
        }
        assert "vocabularies" not in body["sequences"]["s2"]
    finally:
        server.shutdown()
        server.server_close()


def test_training_batches_hold_dense_item_ids(built):
    store, defs = built
    src = PointInTimeExamples(store, "s1", defs, max_seq_len=6, num_actions=4, num_surfaces=4)
    vocab = src.reader.vocabulary("item_id")
    users = [src.anchor(i)[0] for i in range(0, len(src), max(1, len(src) // 20))]
    as_of = [src.anchor(i)[1] for i in range(0, len(src), max(1, len(src) // 20))]
    batch = src.sequences(users, as_of)
    for row, (u, t) in enumerate(zip(users, as_of)):
        raw = src.reader.query(u, as_of=t, limit=6)["item_id"]
        want = np.full(6, -1, np.int32)
        want[: len(raw)] = vocab.encode(raw)
        np.testing.assert_array_equal(batch["item_ids"][row], want)
    assert batch["item_ids"][batch["mask"]].min() >= 2 and batch["item_ids"].max() < vocab.num_indices


def test_two_tower_reads_missing_categories_as_a_bucket(tmp_path):
    from jaxscale_models.contextual_two_tower import ContextualTwoTowerConfig, two_tower_tables
    from jaxscale_models.contextual_two_tower_sequences import ContextualExamples, ContextualSequenceBatches

    _, items = random_log(8, tmp_path, files=2, rows=200, items=30, bad=False)  # ids 30..34: category -1
    defs = vocab_defs()
    backfill(defs, tmp_path / "events", tmp_path / "store", sources={"items": items})
    cats = read_sequence(tmp_path / "store", "s1").column("category").to_numpy()
    assert (cats == -1).any()
    args = dict(max_seq_len=6, num_actions=4, num_surfaces=4, num_categories=6)
    with pytest.raises(ValueError, match="has value -1 .*missing_category=true"):
        ContextualExamples(tmp_path / "store", "s1", defs, **args)
    src = ContextualExamples(tmp_path / "store", "s1", defs, **args, missing_category=True)
    seen_missing_label = False
    for i in range(len(src)):
        ex = src[i]
        hist = ex["item_categories"][ex["mask"]]
        assert hist.min() >= 0 and hist.max() <= 6 and (ex["item_categories"][~ex["mask"]] == -1).all()
        if ex["label_category"] == 6:
            seen_missing_label = True
            assert ex["context_category"] == -1 and ex["context_confidence"] == 0.0
    assert seen_missing_label
    cfg = ContextualTwoTowerConfig(num_categories=6, missing_category=True)
    assert cfg.category_rows == 7 and cfg.missing_category_index == 6
    assert [t.rows for t in two_tower_tables(cfg) if t.name == "categories"] == [7]
    data = ContextualSequenceBatches(
        tmp_path / "store", "s1", defs, global_batch_size=8, item_rows=64, split="eval", **args, missing_category=True
    )
    assert set(np.unique(data.item_category)) <= set(range(7)) | {-1} and (data.item_category == 6).any()
    with pytest.raises(ValueError, match=r"item_rows=8, but the store's 'item_id' vocabulary"):
        ContextualSequenceBatches(
            tmp_path / "store", "s1", defs, global_batch_size=8, item_rows=8, **args, missing_category=True
        )


def test_programs_that_load_a_vocabulary_exit_cleanly(tmp_path):
    """A plain Python program that reads a store's vocabulary ends with status 0. Reading the Parquet file
    through a Python file object let a pyarrow I/O thread outlive the read; at interpreter exit it aborted the
    process now and then ("terminate called without an active exception", status 134): about 1 run in 8 with
    two other processes spinning on a 2-core machine, which this test reproduces (48 runs, 4 at a time)."""
    _, items = random_log(0, tmp_path, files=2, rows=4000, items=2000)
    backfill(vocab_defs(), tmp_path / "events", tmp_path / "store", sources={"items": items})
    program = (
        "import sys; from jaxscale.sequences.query import SequenceReader; "
        "print(SequenceReader(sys.argv[1], 's1').vocabulary('item_id').version)"
    )
    env = subprocess_env()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    results = []
    try:
        for _ in range(12):
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", program, str(tmp_path / "store")],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for _ in range(4)
            ]
            results += [(p.returncode, out, err) for p in procs for out, err in [p.communicate(timeout=300)]]
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    failed = [(rc, err[-300:]) for rc, _, err in results if rc != 0]
    assert not failed, f"{len(failed)} of {len(results)} exited non-zero: {failed[:3]}"
    assert all(out.strip() == "1" for _, out, _ in results)


def test_a_refresh_publishes_partitions_and_vocabulary_together(tmp_path, monkeypatch):
    """Issue 35 item 12: a query that runs while a refresh is loading the vocabulary sees the partitions and
    the vocabulary of one refresh: no stored item answered as out-of-vocabulary in ids=dense."""
    import shutil

    import jaxscale.sequences.query as query

    defs = vocab_defs()
    _, items = random_log(6, tmp_path, files=2, rows=200, items=30, bad=False)
    (tmp_path / "later").mkdir()
    shutil.move(tmp_path / "events" / "part-001.parquet", tmp_path / "later" / "part-001.parquet")
    store = tmp_path / "store"
    backfill(defs, tmp_path / "events", store, sources={"items": items})
    reader = SequenceReader(store, "s1")
    before = reader.vocabulary("item_id").size
    users = sorted(set(read_sequence(store, "s1").column("user_id").to_pylist()))
    shutil.move(tmp_path / "later" / "part-001.parquet", tmp_path / "events" / "part-001.parquet")
    stream(defs, tmp_path / "events", store, sources={"items": items}, micro_batch=500)  # the new events
    seen = []
    real = query.load_vocabulary

    def load_while_querying(seq_dir, field):  # another thread's queries, in the middle of the refresh
        seen.extend(e["item_id"] for u in users for e in reader.events(u, ids="dense"))
        return real(seq_dir, field)

    monkeypatch.setattr(query, "load_vocabulary", load_while_querying)
    assert reader.refresh()
    assert reader.vocabulary("item_id").size > before  # the new events brought new items
    assert seen and OOV not in seen, "a query saw new partitions with the old vocabulary"
    after = [e["item_id"] for u in users for e in reader.events(u, ids="dense")]
    assert OOV not in after and PAD not in after
