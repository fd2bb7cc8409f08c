"""The leave-one-out split and the example targets, against a plain-Python reference that sorts each user's
stored events by (ts, arrival), on random small logs with many ties in ts, several days, and users with 1, 2
and 3 events, through a real store."""

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_sequences_helpers import MS_PER_DAY, T0, by_user, make_defs, reference_store, write_defs

from jaxscale.sequences.examples import (
    BATCH_KEYS,
    HISTORY_KEYS,
    TARGET_KEYS,
    PointInTimeExamples,
    SequenceBatches,
)
from jaxscale.sequences.runtime import backfill
from jaxscale.training.config import ConfigError, load_config

KW = dict(num_actions=4, num_surfaces=4)
ONE, TWO, THREE = 10**12 + 1, 10**12 + 2, 10**12 + 3  # users with 1, 2 and 3 events of s1


def _log(seed: int, folder, *, users=7, files=3, rows=90, days=3):
    """Raw files in arrival order whose ts are independent of arrival (late events) and take few distinct
    values (many exact ties), plus the users ONE, TWO, THREE; returns (raw rows, items path)."""
    rng = np.random.default_rng(seed)
    (folder / "events").mkdir(parents=True)
    frames = []
    for f in range(files):
        n = rows
        df = pd.DataFrame(
            {
                "user_id": 10**12 + 100 + rng.integers(0, users, n),
                "ts": T0 + rng.integers(0, days, n) * MS_PER_DAY + rng.integers(0, 3, n) * 1000,
                "event_type": rng.choice(["a", "a2", "b", "c"], n),  # 'c' is not in s1
                "item_id": rng.integers(0, 12, n) * 10**9,
                "surface": rng.choice(["home", "search", "related", "x"], n),
            }
        )
        special = {  # file f holds these rows of the small users: ties in ts across files and days
            0: [(ONE, 1, "a"), (TWO, 1, "b"), (THREE, 0, "a")],
            1: [(TWO, 1, "a"), (THREE, 0, "b")],
            2: [(THREE, 0, "a")],
        }[f % 3]
        for u, day, et in special:  # the item differs per file: identical rows would be one event (event ids)
            df.loc[len(df)] = [u, T0 + day * MS_PER_DAY + 5000, et, 10**9 * (f % 3 + 1), "home"]
        df = df.sample(frac=1.0, random_state=int(rng.integers(1 << 30))).reset_index(drop=True)
        table = pa.table(
            {
                "user_id": pa.array(df.user_id.astype(np.int64)),
                "ts": pa.array(df.ts.astype(np.int64)),
                "event_type": pa.array(df.event_type.astype(str)),
                "item_id": pa.array(df.item_id.astype(np.int64)),
                "surface": pa.array(df.surface.astype(str)),
            }
        )
        pq.write_table(table, folder / "events" / f"part-{f:03d}.parquet")
        raw = table.to_pandas()
        raw["file_rank"], raw["row"], raw["file"] = f, np.arange(len(raw)), f"part-{f:03d}.parquet"
        frames.append(raw)
    items = pa.table(
        {"item_id": np.arange(12, dtype=np.int64) * 10**9, "category": np.arange(12) % 5, "score": np.ones(12)}
    )
    pq.write_table(items, folder / "items.parquet")
    return pd.concat(frames, ignore_index=True), folder / "items.parquet"


@pytest.fixture(scope="module", params=[0, 1, 2])
def built(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"split{request.param}")
    defs = make_defs(max_length=50)
    raw, items = _log(request.param, tmp)
    backfill(defs, tmp / "events", tmp / "store", sources={"items": items})
    want, _ = reference_store(raw, defs, pd.read_parquet(items))
    return tmp / "store", write_defs(tmp, defs), by_user(want["s1"])


def _ordered(events):
    return sorted(events, key=lambda r: (r["ts"], r["arrival"]))


def _reference(grouped, split, min_history, L):
    """[(user, target event, history events)] of a leave-one-out split, by (user, position)."""
    out = []
    for u in sorted(grouped):
        ev = _ordered(grouped[u])
        n = len(ev)
        for i in range(min_history, n):
            if {"train": i <= n - 3, "valid": i == n - 2, "test": i == n - 1}[split]:
                out.append((u, ev[i], ev[max(0, i - L) : i]))
    return out


def _encoded_events(src):
    """{(user, ts, arrival): {key: value}}: every stored event in the source's own model encoding (so the
    reference checks which events an example holds, whatever the item id encoding is)."""
    out = {}
    for part in src.reader.partitions:
        cols = src._model_columns(part)
        users = np.repeat(part.users, np.diff(part.starts))
        for r in range(part.rows):
            key = (int(users[r]), int(part.ts[r]), int(part.values["arrival"][r]))
            out[key] = {k: cols[k][r] for k in HISTORY_KEYS if k != "mask"}
    return out


def _check_example(got, target, history, enc, L, defs_seq):
    key = lambda r: (int(r["user_id"]), int(r["ts"]), int(r["arrival"]))  # noqa: E731
    n = len(history)
    assert got["mask"].tolist() == [True] * n + [False] * (L - n)
    for k in ("item_ids", "timestamps", "actions", "surfaces", "engaged"):
        want = [enc[key(r)][k] for r in history]
        np.testing.assert_array_equal(got[k][:n], np.asarray(want, got[k].dtype).reshape(n), err_msg=k)
        pad = 0 if k == "engaged" else -1
        assert np.all(got[k][n:] == pad), k
        t = got[f"target_{k}"]
        assert t.shape == () and t.dtype == got[k].dtype and t == enc[key(target)][k], k
    # the encoding-independent fields, straight from the raw events
    assert got["timestamps"][:n].tolist() == [r["ts"] // 1000 for r in history]
    assert got["actions"][:n].tolist() == [defs_seq.event_types.index(r["event_type"]) for r in history]
    assert int(got["target_timestamps"]) == target["ts"] // 1000


@pytest.mark.parametrize("L,min_history", [(50, 1), (3, 1), (2, 2), (4, 0)])
def test_leave_one_out_equals_brute_force(built, L, min_history):
    store, defs_path, grouped = built
    seq = make_defs().sequence("s1")
    enc = None
    for split in ("train", "valid", "test"):
        src = PointInTimeExamples(
            store,
            "s1",
            defs_path,
            max_seq_len=L,
            split=split,
            split_mode="leave_one_out",
            min_history=min_history,
            **KW,
        )
        enc = enc or _encoded_events(src)
        want = _reference(grouped, split, min_history, L)
        assert len(src) == len(want), split
        for i, (u, target, history) in enumerate(want):
            assert src.anchor(i) == (u, target["ts"]), (split, i)
            part, row = src.anchor_event(i)
            assert int(part.values["arrival"][row]) == target["arrival"]
            _check_example(src[i], target, history, enc, L, seq)
        np.testing.assert_array_equal(src.users, [u for u, _, _ in want])
        if split != "train":  # one example per user, by increasing user id
            np.testing.assert_array_equal(src.users_of_split(), src.users)


def test_no_example_sees_its_target_or_later_and_test_history_holds_valid(built):
    store, defs_path, grouped = built
    kw = dict(max_seq_len=50, split_mode="leave_one_out", **KW)
    splits = {s: PointInTimeExamples(store, "s1", defs_path, split=s, **kw) for s in ("train", "valid", "test")}
    for name, src in splits.items():
        for i in range(len(src)):
            part, row = src.anchor_event(i)
            target = (int(part.ts[row]), int(part.values["arrival"][row]))
            for hp, lo, hi in src._slices_before(i):
                for r in range(lo, hi):
                    assert (int(hp.ts[r]), int(hp.values["arrival"][r])) < target, name
            ex = src[i]
            assert np.all(ex["timestamps"][ex["mask"]] <= ex["target_timestamps"])
    valid, test = splits["valid"], splits["test"]
    vu = {int(u): i for i, u in enumerate(valid.users)}
    both = 0
    for j, u in enumerate(test.users):
        if int(u) in vu:
            v = valid[vu[int(u)]]
            h = test[j]
            last = int(h["mask"].sum()) - 1
            for k in ("item_ids", "timestamps", "actions", "surfaces", "engaged"):
                assert h[k][last] == v[f"target_{k}"], k  # the test history ends with the valid target
            both += 1
    assert both >= 5
    # the small users: 1 event -> nothing; 2 -> test only; 3 -> test and valid, no train (min_history=1)
    assert ONE not in set(np.concatenate([s.users for s in splits.values()]).tolist())
    assert TWO in set(test.users.tolist()) and TWO not in set(valid.users.tolist())
    assert THREE in set(test.users.tolist()) and THREE in set(valid.users.tolist())
    assert THREE not in set(splits["train"].users.tolist()) and TWO not in set(splits["train"].users.tolist())
    # TWO's two events tie in ts: the later arrival is the test target, its history the earlier one
    t = test[int(np.flatnonzero(test.users == TWO)[0])]
    assert t["mask"].sum() == 1 and t["timestamps"][0] == t["target_timestamps"]
    # every event of a user with n >= 2 is the target of exactly one example of one split (min_history=1)
    targets = [(n, s.anchor_event(i)) for n, s in splits.items() for i in range(len(s))]
    keys = [(p.day, r) for _, (p, r) in targets]
    assert len(keys) == len(set(keys))
    assert len(keys) == sum(len(ev) - 1 for ev in grouped.values() if len(ev) >= 2)


def test_day_split_targets_are_the_anchor_events(built):
    store, defs_path, grouped = built
    for split in ("train", "eval"):
        src = PointInTimeExamples(store, "s1", defs_path, max_seq_len=5, split=split, **KW)
        enc = _encoded_events(src)
        for i in range(len(src)):
            u, ts = src.anchor(i)
            ex = src[i]
            assert set(ex) == set(BATCH_KEYS)
            first = min((r for r in grouped[u] if r["ts"] == ts), key=lambda r: r["arrival"])
            want = enc[(u, ts, first["arrival"])]
            for k in ("item_ids", "timestamps", "actions", "surfaces", "engaged"):
                assert ex[f"target_{k}"] == want[k]
            history = [r for r in _ordered(grouped[u]) if r["ts"] < ts][-5:]  # ts-strict in the day split
            assert int(ex["mask"].sum()) == len(history)


def test_split_arguments_batches_and_config(built, tmp_path):
    store, defs_path, _ = built
    kw = dict(max_seq_len=4, **KW)
    ev = PointInTimeExamples(store, "s1", defs_path, split="eval", split_mode="leave_one_out", **kw)
    assert ev.split == "valid" and len(ev.days) >= 2
    with pytest.raises(ValueError, match="split must be one of"):
        PointInTimeExamples(store, "s1", defs_path, split="test", **kw)  # no test split in the day mode
    with pytest.raises(ValueError, match="split must be one of"):
        PointInTimeExamples(store, "s1", defs_path, split="bogus", split_mode="leave_one_out", **kw)
    with pytest.raises(ValueError, match="split_mode"):
        PointInTimeExamples(store, "s1", defs_path, split_mode="random", **kw)
    with pytest.raises(ValueError, match="no example"):
        PointInTimeExamples(store, "s1", defs_path, split="train", split_mode="leave_one_out", min_history=500, **kw)
    # the batches: every key, targets [batch]; from_config passes data.sequences.split through
    s = SimpleNamespace(
        store=str(store), sequence="s1", defs=str(defs_path), eval_days=1, min_history=1, split="leave_one_out"
    )
    config = SimpleNamespace(data=SimpleNamespace(sequences=s, seed=0), train=SimpleNamespace(batch_size=4))
    mcfg = SimpleNamespace(max_seq_len=4, num_actions=4, num_surfaces=4)
    data = SequenceBatches.from_config(mcfg, config, "eval", 0, 1)
    assert data.source.split_mode == "leave_one_out" and data.source.split == "valid"
    b = data.batch(0)
    assert list(b) == list(BATCH_KEYS)
    for k in TARGET_KEYS:
        assert b[k].shape == (4,) and b[k].dtype == (np.float32 if k == "target_engaged" else np.int32)
    stacked = data.source.examples([0, 1, 2])
    assert stacked["item_ids"].shape == (3, 4) and stacked["target_item_ids"].shape == (3,)

    class DayOnly(SequenceBatches):  # a subclass written before split_mode (explicit arguments only)
        def __init__(
            self,
            store,
            sequence,
            defs,
            *,
            global_batch_size,
            max_seq_len,
            num_actions,
            num_surfaces,
            seed=0,
            process_index=0,
            process_count=1,
            split="train",
            eval_days=1,
            min_history=1,
        ):
            raise AssertionError("not reached")

    with pytest.raises(ValueError, match="supports only the day split"):
        DayOnly.from_config(mcfg, config, "eval", 0, 1)

    # the config field
    cfg = load_config(None, ["data.sequences.split=leave_one_out"])
    assert cfg.data.sequences.split == "leave_one_out"
    assert load_config(None).data.sequences.split == "day"
    with pytest.raises(ConfigError, match="data.sequences.split"):
        load_config(None, ["data.sequences.split=random"])


@pytest.mark.parametrize("L,min_history", [(50, 1), (3, 2)])
def test_last_train_target_is_one_example_per_user(built, L, min_history):
    """train_targets='last': each user's last train target (position n-3) only, with its history (brute force)."""
    store, defs_path, grouped = built
    seq = make_defs().sequence("s1")
    src = PointInTimeExamples(
        store, "s1", defs_path, max_seq_len=L, split="train", split_mode="leave_one_out", min_history=min_history,
        train_targets="last", **KW,
    )  # fmt: skip
    want = []
    for u in sorted(grouped):
        ev = _ordered(grouped[u])
        i = len(ev) - 3
        if i >= min_history:
            want.append((u, ev[i], ev[max(0, i - L) : i]))
    assert len(src) == len(want) and len(set(src.users.tolist())) == len(src)
    enc = _encoded_events(src)
    for i, (u, target, history) in enumerate(want):
        assert src.anchor(i) == (u, target["ts"])
        _check_example(src[i], target, history, enc, L, seq)
    with pytest.raises(ValueError, match="train_targets"):
        PointInTimeExamples(store, "s1", defs_path, max_seq_len=L, train_targets="last", **KW)  # day split
    with pytest.raises(ValueError, match="train_targets"):
        PointInTimeExamples(store, "s1", defs_path, max_seq_len=L, split_mode="leave_one_out", train_targets="x", **KW)
    from jaxscale.training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train_targets.*leave_one_out"):
        load_config(None, ["data.sequences.train_targets=last"])
    cfg = load_config(None, ["data.sequences.split=leave_one_out", "data.sequences.train_targets=last"])
    assert cfg.data.sequences.train_targets == "last"
    # from_config passes it to the source
    s = SimpleNamespace(store=str(store), sequence="s1", defs=str(defs_path), eval_days=1, min_history=min_history,
                        split="leave_one_out", train_targets="last")  # fmt: skip
    config = SimpleNamespace(data=SimpleNamespace(sequences=s, seed=0), train=SimpleNamespace(batch_size=2))
    data = SequenceBatches.from_config(
        SimpleNamespace(max_seq_len=L, num_actions=4, num_surfaces=4), config, "train", 0, 1
    )
    np.testing.assert_array_equal(data.source.users, src.users)
