"""The contextual two-tower model on a sequence store (`data.source: sequences`): examples against a brute-force
(row-by-row Python) reference of the raw log (history before ts, label = the anchor event, the anchor's surface
and hour, pseudo-context on train, missing subject on eval), the corpus catalogue, errors naming the category
field and value, per-process slices and Grain state, and a few Trainer steps on 8 simulated devices."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxscale.sequences import Definitions, Enrichment, EventType, Sequence
from jaxscale.sequences.runtime import backfill
from jaxscale.training.config import load_config
from jaxscale.training.trainer import Trainer
from jaxscale_models.contextual_two_tower_data import derive_pseudo_context
from jaxscale_models.contextual_two_tower_sequences import (
    BATCH_KEYS,
    ContextualExamples,
    ContextualSequenceBatches,
    pseudo_context_draws,
)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "jaxscale" / "configs" / "two_tower_smoke.yaml"

MS_PER_DAY = 86_400_000
T0 = 1_767_571_200_000  # 2026-01-05T00:00:00Z
L, C, ITEMS, ITEM_ROWS, USERS, DAYS = 6, 8, 60, 64, 32, 4
SURFACES = {"home": 1, "search": 2}  # definitions' surfaces -> code; any other surface is 0
SEED = 5


def _defs() -> Definitions:
    return Definitions(
        event_types=(EventType("click", raw=("click", "tap")), EventType("save")),
        enrichments=(Enrichment("items", fields={"category": "int64", "genre": "int64"}, defaults={"category": -1}),),
        sequences=(
            Sequence(
                "s1", ("click", "save"), ("item_id", "ts", "event_type", "surface", "category"), 50, engaged=("save",)
            ),
            Sequence("nocat", ("click", "save"), ("item_id", "ts", "event_type", "surface"), 50),
            Sequence("wide", ("click", "save"), ("item_id", "ts", "event_type", "surface", "genre"), 50),
        ),
        surfaces=tuple(SURFACES),
    )


def _log(seed: int = 0) -> list[dict]:
    """Raw events in arrival order: each user mostly engages with items of its home category (a signal the
    history carries), over DAYS days, with ties in ts (same user, same ts, different items)."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(USERS):
        n = int(rng.integers(40, 80))
        ts = np.sort(T0 + rng.integers(0, DAYS * MS_PER_DAY, n))
        ts[3] = ts[2]  # a tie
        home = u % C
        for t in ts:
            item = home + C * int(rng.integers(0, 7)) if rng.random() < 0.85 else int(rng.integers(0, ITEMS))
            rows.append(
                {
                    "user_id": 1000 + u,
                    "ts": int(t),
                    "event_type": str(rng.choice(["click", "tap", "save"])),
                    "item_id": item,
                    "surface": str(rng.choice(["home", "search", "elsewhere"])),
                }
            )
    order = rng.permutation(len(rows))  # arrival order differs from ts order
    return [rows[i] for i in order]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tts")
    defs = _defs()
    log = _log()
    (tmp / "events").mkdir()
    pq.write_table(pa.Table.from_pylist(log), tmp / "events" / "part-000.parquet")
    items = np.arange(ITEMS, dtype=np.int64)
    pq.write_table(pa.table({"item_id": items, "category": items % C, "genre": 100 + items % C}), tmp / "items.parquet")
    backfill(defs, tmp / "events", tmp / "store", sources={"items": str(tmp / "items.parquet")})
    defs_path = tmp / "defs.json"
    defs_path.write_text(defs.dumps())
    # Brute force: every user's events in store order (ts, then arrival), as the model encodes them.
    by_user: dict[int, list[dict]] = {}
    for arrival, r in enumerate(log):
        e = dict(r, arrival=arrival, category=r["item_id"] % C)
        e["action"] = 1 if r["event_type"] == "save" else 0
        by_user.setdefault(r["user_id"], []).append(e)
    for evs in by_user.values():
        evs.sort(key=lambda e: (e["ts"], e["arrival"]))
    return tmp / "store", defs_path, by_user


def _source(built, **kw) -> ContextualExamples:
    store, defs_path, _ = built
    args = dict(max_seq_len=L, num_actions=4, num_surfaces=4, num_categories=C, seed=SEED)
    return ContextualExamples(store, "s1", defs_path, **(args | kw))


def _batches(built, **kw) -> ContextualSequenceBatches:
    store, defs_path, _ = built
    args = dict(
        global_batch_size=8, max_seq_len=L, num_actions=4, num_surfaces=4, num_categories=C, item_rows=ITEM_ROWS
    )
    return ContextualSequenceBatches(store, "s1", defs_path, **(args | {"seed": SEED} | kw))


def _expected(by_user, user: int, ts: int) -> dict:
    """History (the last L events strictly before ts), label (the first stored event at ts), surface and hour."""
    evs = by_user[user]
    history = [e for e in evs if e["ts"] < ts][-L:]
    anchor = next(e for e in evs if e["ts"] == ts)
    pad = [-1] * (L - len(history))
    return {
        "item_ids": [e["item_id"] for e in history] + pad,
        "item_categories": [e["category"] for e in history] + pad,
        "timestamps": [e["ts"] // 1000 for e in history] + pad,
        "actions": [e["action"] for e in history] + pad,
        "surfaces": [SURFACES.get(e["surface"], 0) for e in history] + pad,
        "mask": [True] * len(history) + [False] * (L - len(history)),
        "label_item": anchor["item_id"],
        "label_category": anchor["category"],
        "context_surface": SURFACES.get(anchor["surface"], 0),
        "context_hour": (ts // 3_600_000) % 24,
    }


@pytest.mark.parametrize("split", ["train", "eval"])
def test_examples_equal_brute_force(built, split):
    _, _, by_user = built
    src = _source(built, split=split)
    assert len(src) > 100
    for i in range(len(src)):
        user, ts = src.anchor(i)
        got, want = src[i], _expected(by_user, user, ts)
        assert set(got) == set(BATCH_KEYS)
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], np.asarray(v), err_msg=f"{k} of {split} example {i}")
        assert np.all(got["timestamps"][got["mask"]] * 1000 < ts)  # point in time: nothing at or after ts
        if split == "eval":  # no subject item in the store: the context-missing mode, real surface and hour
            assert got["context_category"] == -1 and got["context_confidence"] == 0.0
        else:  # pseudo-context from the label, derive_pseudo_context's semantics
            conf, right, wrong = pseudo_context_draws(SEED, user, ts, C)
            cat, c = derive_pseudo_context(want["label_category"], conf, right, wrong)
            assert got["context_category"] == cat and got["context_confidence"] == c
            assert 0.5 <= got["context_confidence"] <= 1.0
        for k in ("context_category", "context_surface", "context_hour", "label_item", "label_category"):
            assert got[k].dtype == np.int32 and got[k].shape == (), k
        assert got["context_confidence"].dtype == np.float32
    # a tie (two events of a user at one ts): the anchor's label is the first stored, the other is in no history
    tied = [(u, e["ts"]) for u, evs in by_user.items() for e, f in zip(evs, evs[1:]) if e["ts"] == f["ts"]]
    assert tied


def test_pseudo_context_is_right_about_as_often_as_its_confidence(built):
    src = _source(built, split="train")
    rows = [src[i] for i in range(len(src))]
    conf = np.array([r["context_confidence"] for r in rows])
    hit = np.array([r["context_category"] == r["label_category"] for r in rows])
    # right with probability = confidence, else a random category (1 / C of which is the label's)
    expected = np.mean(conf + (1 - conf) / C)
    assert abs(hit.mean() - expected) < 4 * np.sqrt(expected * (1 - expected) / len(rows))
    assert _source(built, split="train", pseudo_context=False)[0]["context_category"] == -1


def test_batches_carry_the_corpus_on_eval(built):
    _, _, by_user = built
    train, ev = _batches(built), _batches(built, split="eval")
    b = train.batch(0)
    assert list(b) == list(BATCH_KEYS)  # the synthetic batch's keys, no corpus on train
    for k in ("item_ids", "item_categories", "timestamps", "actions", "surfaces", "mask"):
        assert b[k].shape == (8, L), k
    for k in ("context_category", "context_confidence", "context_surface", "context_hour", "label_item"):
        assert b[k].shape == (8,), k
    e = ev.batch(0)
    assert list(e) == [*BATCH_KEYS, "corpus_items", "corpus_categories"]
    ids = e["corpus_items"].reshape(-1)
    np.testing.assert_array_equal(np.sort(ids[ids >= 0]), np.arange(ITEM_ROWS))  # every item id once
    # catalogue: the category of the item's latest event in the whole store; -1 for items never seen
    latest: dict[int, tuple] = {}
    for evs in by_user.values():
        for x in evs:
            if x["item_id"] not in latest or x["ts"] >= latest[x["item_id"]][0]:
                latest[x["item_id"]] = (x["ts"], x["category"])
    want = np.array([latest[i][1] if i in latest else -1 for i in range(ITEM_ROWS)])
    cats = np.full(ITEM_ROWS, -2)
    cats[e["corpus_items"][e["corpus_items"] >= 0]] = e["corpus_categories"][e["corpus_items"] >= 0]
    np.testing.assert_array_equal(cats, want)
    assert (want[ITEMS:] == -1).all()  # items 60..63 never occur
    # store ids >= item_rows: out of the corpus, with a warning; left in the batches for data.invalid_ids
    with pytest.warns(RuntimeWarning, match="item_rows=50"):
        small = _batches(built, split="eval", item_rows=50)
    assert small.batch(0)["corpus_items"].max() == 49
    seen = np.concatenate([small.batch(s)["label_item"] for s in range(6)])
    assert seen.max() >= 50


def test_process_slices_concatenate_and_grain_state_resumes(built):
    for split in ("train", "eval"):
        one = _batches(built, split=split)
        parts = [_batches(built, split=split, process_index=p, process_count=4) for p in range(4)]
        for step in range(3):
            full = one.batch(step)
            got = [p.batch(step) for p in parts]
            for k in full:
                np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), full[k], err_msg=k)
    a = _batches(built)
    for step in range(4):
        a.batch(step)
    state = json.loads(json.dumps(a.get_state()))
    cont = [a.batch(s) for s in range(4, 7)]
    b = _batches(built)
    b.set_state(state)
    for s, want in zip(range(4, 7), cont):
        got = b.batch(s)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_category_field_errors_name_it(built):
    with pytest.raises(ValueError, match=r"no field 'category'.*category_field"):
        ContextualExamples(built[0], "nocat", built[1], max_seq_len=L, num_actions=4, num_surfaces=4, num_categories=C)
    with pytest.raises(ValueError, match=r"no field 'genre'"):
        _source(built, category_field="genre")
    with pytest.raises(ValueError, match=r"field 'genre' of sequence 'wide' has value 10\d .*num_categories=8"):
        ContextualExamples(
            built[0],
            "wide",
            built[1],
            max_seq_len=L,
            num_actions=4,
            num_surfaces=4,
            num_categories=C,
            category_field="genre",
        )
    with pytest.raises(ValueError, match=r"field 'category' of sequence 's1' has value [4-7] .*num_categories=4"):
        _source(built, num_categories=4)
    with pytest.raises(ValueError, match="category_field"):
        load_config(str(SMOKE), ["model.contextual_two_tower.category_field=''"])


# The smoke config, shrunk (see tests/test_two_tower_trainer.py) onto the store's 64 item ids.
TINY = [
    f"model.contextual_two_tower.item_rows={ITEM_ROWS}",
    "model.contextual_two_tower.num_categories=16",
    "model.contextual_two_tower.item_dim=8",
    "model.contextual_two_tower.d_model=16",
    "model.contextual_two_tower.num_layers=1",
    "model.contextual_two_tower.num_heads=2",
    "model.contextual_two_tower.mlp_ratio=2",
    f"model.contextual_two_tower.max_seq_len={L}",
    "model.contextual_two_tower.context_dim=8",
    "model.contextual_two_tower.head_hidden=[16]",
    "model.contextual_two_tower.item_hidden=[16]",
    "model.contextual_two_tower.embed_dim=8",
    "model.contextual_two_tower.recall_ks=[5,10,20]",
    "train.batch_size=64",
    "train.steps=30",
    "train.warmup_steps=2",
    "train.learning_rate=0.01",
    "train.eval_every=30",
    "train.log_every=10",
    "data.eval_batches=2",
    "embedding.capacity_factor=2.0",
]


@pytest.mark.slow  # a training run through the trainer (~20 s)
def test_trains_from_the_store_through_the_trainer(built, tmp_path):
    store, defs_path, _ = built
    cfg = load_config(
        str(SMOKE),
        TINY
        + [
            "data.source=sequences",
            f"data.sequences.store={store}",
            "data.sequences.sequence=s1",
            f"data.sequences.defs={defs_path}",
        ],
    )
    trainer = Trainer(cfg, workdir=str(tmp_path / "run"), progress=False)
    assert isinstance(trainer.data, ContextualSequenceBatches) and trainer.data.split == "train"
    assert trainer.eval_data.corpus and not trainer.data.corpus
    out = trainer.run()
    losses = np.asarray(out["losses"])
    assert np.all(np.isfinite(losses)) and len(losses) == 30
    assert losses[-5:].mean() < losses[:5].mean() - 0.2, losses
    ev = out["eval"][-1]
    for k in (5, 10, 20):
        assert 0.0 <= ev[f"eval_recall@{k}"] <= 1.0
    assert ev["eval_recall@5"] <= ev["eval_recall@10"] <= ev["eval_recall@20"]
    assert ev["eval_recall@20"] > 0.5  # chance is 20 / 64: the history's home category carries over
    # an out-of-range id meets data.invalid_ids=error, naming the feature, the id and this source's batch
    bad = trainer.data.batch(0)
    bad["label_item"][0] = ITEM_ROWS
    with pytest.raises(
        ValueError, match=rf"'label_item'.*sequence 's1' of store .*train split, step 0.*id {ITEM_ROWS}"
    ):
        trainer.prepare(bad, source=trainer.data, step=0)
