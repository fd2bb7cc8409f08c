"""The training reader: the foundation model's batch format, point-in-time correctness against brute
force, per-process slices, and Grain's iterator state for resuming."""

import json

import numpy as np
import pandas as pd
import pytest
from test_sequences_helpers import by_user, make_defs, random_log, reference_store, write_defs

from jaxscale.sequences.examples import (
    INT32_ID_LIMIT,
    TARGET_KEYS,
    PointInTimeExamples,
    SequenceBatches,
    item_ids_to_int32,
    surface_code,
)
from jaxscale.sequences.runtime import backfill

L = 6


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    defs = make_defs(max_length=50)
    raw, items = random_log(41, tmp, files=3, rows=300, users=10, days=4, late=0.2)
    backfill(defs, tmp / "events", tmp / "store", sources={"items": items})
    want, _ = reference_store(raw, defs, pd.read_parquet(items))
    return tmp / "store", write_defs(tmp, defs), defs, want["s1"]


def _batches(built, **kw):
    store, defs_path, _, _ = built
    args = dict(global_batch_size=8, max_seq_len=L, num_actions=4, num_surfaces=4, seed=3)
    return SequenceBatches(store, "s1", defs_path, **(args | kw))


def _expected(rows_by_user, defs, user, as_of):
    """Brute force: the last L events of `user` with ts < as_of, encoded as the model expects."""
    seq = defs.sequence("s1")
    ev = [r for r in rows_by_user.get(user, []) if r["ts"] < as_of][-L:]
    out = {
        "item_ids": np.full(L, -1, np.int32),
        "timestamps": np.full(L, -1, np.int32),
        "actions": np.full(L, -1, np.int32),
        "surfaces": np.full(L, -1, np.int32),
        "engaged": np.zeros(L, np.float32),
        "mask": np.zeros(L, bool),
    }
    for i, r in enumerate(ev):
        iid = r["item_id"]
        out["item_ids"][i] = iid if 0 <= iid < 2**31 - 1 else item_ids_to_int32(np.array([iid]))[0]
        out["timestamps"][i] = r["ts"] // 1000
        out["actions"][i] = seq.event_types.index(r["event_type"])
        out["surfaces"][i] = {"home": 1, "search": 2, "related": 3}.get(r["surface"], 0)
        out["engaged"][i] = float(r["event_type"] in seq.engaged)
        out["mask"][i] = True
    return out


def test_examples_equal_brute_force_and_never_leak(built):
    store, defs_path, defs, rows = built
    src = PointInTimeExamples(store, "s1", defs_path, max_seq_len=L, num_actions=4, num_surfaces=4)
    grouped = by_user(rows)
    for i in range(len(src)):
        user, as_of = src.anchor(i)
        got = src[i]
        want = _expected(grouped, defs, user, as_of)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{k} of example {i}")
        assert np.all(got["timestamps"][got["mask"]] * 1000 < as_of + 1000)
        assert got["mask"].sum() >= 1  # min_history
    # The Python read API for arbitrary (user, ts) pairs, including users and times with no history.
    users = [int(u) for u in rows.user_id.unique()[:4]] + [42]
    times = [int(t) for t in rows.ts.sample(5, random_state=0)] + [0]
    pairs = [(u, t) for u in users for t in times]
    batch = src.sequences([u for u, _ in pairs], [t for _, t in pairs])
    for j, (u, t) in enumerate(pairs):
        want = _expected(grouped, defs, u, t)
        for k in want:
            np.testing.assert_array_equal(batch[k][j], want[k])


def test_anchors_cover_the_split_days(built):
    store, defs_path, _, rows = built
    kw = dict(max_seq_len=L, num_actions=4, num_surfaces=4)
    train = PointInTimeExamples(store, "s1", defs_path, split="train", **kw)
    ev = PointInTimeExamples(store, "s1", defs_path, split="eval", **kw)
    days = sorted({pd.Timestamp(t, unit="ms", tz="UTC").date().isoformat() for t in rows.ts})
    assert train.days == days[:-1] and ev.days == days[-1:]
    expected = set()
    for u, evs in by_user(rows).items():
        for r in evs:
            if any(e["ts"] < r["ts"] for e in evs):  # min_history=1: at least one earlier event
                expected.add((u, r["ts"]))
    got = {train.anchor(i) for i in range(len(train))} | {ev.anchor(i) for i in range(len(ev))}
    assert got == expected
    assert len(got) == len(train) + len(ev)  # distinct pairs


def test_batch_format_is_the_foundation_models(built):
    b = _batches(built).batch(0)
    assert list(b) == ["item_ids", "timestamps", "actions", "surfaces", "engaged", "mask", *TARGET_KEYS]
    for k, dtype in [
        ("item_ids", np.int32),
        ("timestamps", np.int32),
        ("actions", np.int32),
        ("surfaces", np.int32),
        ("engaged", np.float32),
        ("mask", np.bool_),
    ]:
        assert b[k].dtype == dtype and b[k].shape == (8, L), k
    m = b["mask"]
    assert np.all((b["item_ids"] >= 0) == m) and np.all((b["timestamps"] >= 0) == m)
    assert np.all(b["actions"][m] < 4) and np.all(b["surfaces"][m] < 4) and np.all(b["engaged"][~m] == 0)
    assert np.all(np.diff(m.astype(int), axis=1) <= 0)  # right-padded
    ts = np.where(m, b["timestamps"], np.iinfo(np.int32).max)
    assert np.all(np.diff(ts, axis=1) >= 0)  # oldest first


def test_process_slices_concatenate_to_the_global_batch(built):
    one = _batches(built)
    parts = [_batches(built, process_index=p, process_count=4) for p in range(4)]
    for step in range(3):
        full = one.batch(step)
        got = [p.batch(step) for p in parts]
        for k in full:
            np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), full[k])


def test_resume_from_grain_state(built):
    a = _batches(built)
    for step in range(5):
        a.batch(step)
    state = json.loads(json.dumps(a.get_state()))  # what a checkpoint stores
    cont = [a.batch(s) for s in range(5, 9)]
    b = _batches(built)
    b.set_state(state)
    for s, want in zip(range(5, 9), cont):
        got = b.batch(s)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    c = _batches(built)  # a resume without saved state repositions on the step
    got = c.batch(6)
    for k in cont[1]:
        np.testing.assert_array_equal(got[k], cont[1][k])


def test_epochs_reshuffle_and_cover_every_example(built):
    sb = _batches(built, global_batch_size=4)
    n = len(sb.source)
    steps = n // 4

    def keys(batch):
        return [b"".join(batch[k][i].tobytes() for k in batch) for i in range(len(batch["mask"]))]

    from collections import Counter

    every = Counter(keys({k: np.stack([sb.source[i][k] for i in range(n)]) for k in sb.source[0]}))
    first = Counter(k for s in range(steps) for k in keys(sb.batch(s)))
    assert not first - every  # one epoch: each example at most once
    second_start = keys(sb.batch(steps + 1))
    assert second_start != keys(sb.batch(1)) or steps < 3  # reshuffled


def test_id_mapping_and_errors(built):
    ids = np.array([0, 5, INT32_ID_LIMIT - 1, INT32_ID_LIMIT, 2**40, -7], np.int64)
    out = item_ids_to_int32(ids)
    assert out.dtype == np.int32 and list(out[:3]) == [0, 5, INT32_ID_LIMIT - 1]
    assert np.all((out >= 0) & (out < INT32_ID_LIMIT))
    np.testing.assert_array_equal(item_ids_to_int32(ids), out)  # deterministic
    assert surface_code("search", ("home", "search"), 4) == 2 and surface_code("zzz", ("home",), 4) == 0
    store, defs_path, _, _ = built
    with pytest.raises(ValueError, match="num_actions=1"):
        PointInTimeExamples(store, "s1", defs_path, max_seq_len=L, num_actions=1, num_surfaces=4)
    with pytest.raises(ValueError, match="num_surfaces=2"):
        PointInTimeExamples(store, "s1", defs_path, max_seq_len=L, num_actions=4, num_surfaces=2)
    with pytest.raises(ValueError, match="lacks fields"):
        PointInTimeExamples(store, "s2", defs_path, max_seq_len=L, num_actions=4, num_surfaces=4)
    with pytest.raises(ValueError, match="not divisible"):
        _batches(built, process_count=3)


@pytest.mark.slow  # a CLI training run (~20 s)
def test_the_trainer_reads_the_store_through_the_config(built, tmp_path):
    """`data.source: sequences` (jaxscale/configs/foundation_sequences.yaml's shape): the foundation model
    trains from the store; the checkpoint keeps Grain's data position and a resumed run continues it."""
    from jaxscale.training.config import load_config
    from jaxscale.training.trainer import Trainer

    store, defs_path, _, _ = built
    overrides = [
        f"data.sequences.store={store}",
        "data.sequences.sequence=s1",
        f"data.sequences.defs={defs_path}",
        "data.eval_batches=1",
        f"model.foundation.max_seq_len={L}",
        "model.foundation.item_rows=64",
        "model.foundation.item_vocab=2147483647",
        "model.foundation.d_model=16",
        "model.foundation.num_layers=1",
        "model.foundation.num_heads=2",
        "train.batch_size=8",
        "train.eval_every=0",
        "train.checkpoint_every=2",
        f"train.workdir={tmp_path}",
    ]
    from pathlib import Path

    from jaxscale.training.run import DEFAULT_CONFIG

    config = Path(DEFAULT_CONFIG).with_name("foundation_sequences.yaml")
    cfg = load_config(str(config), overrides + ["train.steps=4"])
    assert cfg.data.source == "sequences" and cfg.data.sequences.sequence == "s1"
    tr = Trainer(cfg, progress=False)
    out = tr.run()
    assert len(out["losses"]) == 4 and all(np.isfinite(out["losses"]))
    assert tr.evaluate(out["final_state"])["eval_loss"] > 0
    saved = json.loads((tmp_path / "checkpoints" / "4" / "data" / "metadata").read_text())
    assert saved["position"] is not None
    # resuming at step 2 repositions the reader: steps 3 and 4 see the batches of the straight run
    straight = [tr.data.batch(s)["item_ids"] for s in (2, 3)]
    again = Trainer(load_config(str(config), overrides + ["train.steps=4"]), progress=False)
    _, step = again.restore(again.init_state(), step=2)
    assert step == 2
    for s, want in zip((2, 3), straight):
        np.testing.assert_array_equal(again.data.batch(s)["item_ids"], want)
