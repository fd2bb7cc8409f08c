"""Full-corpus evaluation end to end on a small MovieLens-layout dataset: import (u.data + u.item written
here, with many ratings sharing a timestamp) -> store with a dense item vocabulary -> the foundation model
and the contextual two-tower trained a few steps -> `python -m jaxscale.evaluate` -> Recall/NDCG recomputed
from the top-k Parquet file and the raw ratings equal the JSON; the sharded scores equal an unsharded
reference; the popularity baseline equals counting by hand; the full-softmax loss equals a brute force."""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import pytest
from movielens_helpers import MOVIES, USERS, loo_targets, write_ml100k

from jaxscale.sequences import compile_definitions
from jaxscale.sequences.movielens import import_movielens
from jaxscale.sequences.query import SequenceReader
from jaxscale.sequences.runtime import backfill
from jaxscale.training import evaluate, ranking, ranking_eval
from jaxscale.training.config import load_config
from jaxscale.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "jaxscale" / "configs"
L = 8
KS = (3, 10)


@pytest.fixture(scope="module")
def movielens(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ml")
    rows = write_ml100k(tmp / "raw")
    import_movielens(tmp / "raw", tmp / "events")
    defs = compile_definitions(ROOT / "experiments/movielens/movielens_defs.py", tmp / "defs.json")
    backfill(defs, tmp / "events" / "events", tmp / "store", sources={"items": str(tmp / "events" / "items.parquet")})
    vocab = SequenceReader(tmp / "store", "ratings").vocabulary("item_id")
    return tmp, rows, vocab


def _foundation_overrides(tmp: Path, rows: int, workdir: Path, mesh=(1, 8), extra=()) -> list[str]:
    m = "model.foundation."
    return [
        f"data.sequences.store={tmp / 'store'}",
        f"data.sequences.defs={tmp / 'defs.json'}",
        f"mesh.nodes={mesh[0]}",
        f"mesh.local={mesh[1]}",
        f"{m}item_rows={rows}",
        f"{m}item_dim=16",
        f"{m}d_model=16",
        f"{m}max_seq_len={L}",
        f"{m}num_layers=1",
        f"{m}dropout=0.0",
        "train.batch_size=16",
        "train.steps=4",
        "train.eval_every=2",
        "train.early_stopping_patience=0",
        "train.warmup_steps=1",
        "train.log_every=1",
        f"train.workdir={workdir}",
        *extra,
    ]


@pytest.fixture(scope="module")
def trained(movielens, tmp_path_factory):
    tmp, rows, vocab = movielens
    work = tmp_path_factory.mktemp("run")
    cfg = load_config(str(CONFIGS / "movielens_foundation.yaml"), _foundation_overrides(tmp, vocab.num_indices, work))
    out = Trainer(cfg, progress=False).run()
    return cfg, work, out


def test_training_evaluates_full_ranking_and_keeps_the_best(trained):
    _, work, out = trained
    evals = [e for e in out["eval"]]
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        assert {"eval_recall@10", "eval_ndcg@10", "eval_mrr@10", "eval_ndcg@20"} <= set(e)
    assert (work / "best" / "checkpoints").is_dir()
    best = max(evals, key=lambda e: e["eval_ndcg@10"])
    assert out["best"]["step"] == best["step"]


def test_cli_topk_file_and_raw_ratings_reproduce_the_json(movielens, trained, tmp_path):
    tmp, rows, vocab = movielens
    cfg, work, _ = trained
    overrides = _foundation_overrides(tmp, vocab.num_indices, work)
    for split in ("valid", "test"):
        out, topk = tmp_path / f"{split}.json", tmp_path / f"top_{split}.parquet"
        argv = ["--config", str(CONFIGS / "movielens_foundation.yaml"), "--checkpoint", str(work / "best")]
        argv += ["--split", split, "--k", "3,10", "--json", str(out), "--topk", str(topk), *overrides]
        assert evaluate.main(argv) == 0
        result = json.loads(out.read_text())
        targets = loo_targets(rows, split)
        assert result["examples"] == len(targets) == USERS
        assert result["candidates"] == vocab.size  # every movie of the store, never padding / OOV
        table = pq.read_table(topk).to_pydict()
        assert set(table) == {"user_id", "rank", "item_id"}
        lists: dict[int, list] = {}
        for u, r, i in zip(table["user_id"], table["rank"], table["item_id"]):
            lists.setdefault(u, []).append((r, i))
        assert sorted(lists) == sorted(targets)
        for k in KS:
            hits, ndcg = [], []
            for u, target in targets.items():
                ranked = [i for _, i in sorted(lists[u])]
                assert len(ranked) == max(KS) and len(set(ranked)) == len(ranked)
                assert all(1 <= i <= MOVIES for i in ranked)  # raw MovieLens ids
                rank = ranked.index(target) + 1 if target in ranked[:k] else 0
                hits.append(rank > 0)
                ndcg.append(1.0 / np.log2(rank + 1) if rank else 0.0)
            assert result["metrics"][f"recall@{k}"] == pytest.approx(np.mean(hits))
            assert result["metrics"][f"ndcg@{k}"] == pytest.approx(np.mean(ndcg))
        # the popularity baseline: train-split counts (every rating but each user's valid and test targets)
        counts = np.zeros(MOVIES + 1)
        held = [loo_targets(rows, s) for s in ("valid", "test")]
        for _, i, _, _ in rows:
            counts[i] += 1
        for h in held:
            for i in h.values():
                counts[i] -= 1
        order = sorted(range(1, MOVIES + 1), key=lambda i: (-counts[i], vocab.encode(np.array([i]))[0]))
        top = order[: max(KS)]
        pop = [1.0 / np.log2(top.index(t) + 2) if t in top[:10] else 0.0 for t in targets.values()]
        assert result["popularity"]["ndcg@10"] == pytest.approx(np.mean(pop))


def test_cli_errors_name_the_problem(movielens, trained, tmp_path, capsys):
    tmp, _, vocab = movielens
    _, work, _ = trained
    base = ["--config", str(CONFIGS / "movielens_foundation.yaml"), "--split", "test", "--json", str(tmp_path / "o")]
    base += _foundation_overrides(tmp, vocab.num_indices, work)
    assert evaluate.main(base + ["--checkpoint", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert evaluate.main(base + ["--checkpoint", str(work), "--k", "0,x"]) == 2
    assert "--k" in capsys.readouterr().err
    assert evaluate.main(base) == 2
    assert "--checkpoint is required" in capsys.readouterr().err


@pytest.mark.parametrize(
    "mesh,topology", [((1, 8), "1d"), ((2, 4), "2d_a2a"), ((4, 2), "2d_ar")], ids=["1x8-1d", "2x4-2d_a2a", "4x2-2d_ar"]
)
def test_sharded_scores_equal_an_unsharded_reference(movielens, trained, mesh, topology, tmp_path):
    """The evaluator's top-K (corpus looked up through the sharded engine, scored and ranked on the mesh)
    equals scoring on the host with the dense table and ranking with `jaxscale.training.ranking`."""
    from flax import nnx

    from jaxscale.training.data import make_data
    from jaxscale_models.foundation import foundation_ids

    tmp, _, vocab = movielens
    _, work, _ = trained
    cfg = load_config(
        str(CONFIGS / "movielens_foundation.yaml"),
        _foundation_overrides(tmp, vocab.num_indices, work, mesh, [f"embedding.topology={topology}"]),
    )
    trainer = Trainer(cfg, workdir=str(work), progress=False, log=False)
    state, _ = evaluate.restore(trainer, work / "best" / "checkpoints")
    source = make_data(cfg, split="test")
    got = ranking_eval.RankingEvaluator(trainer, KS).evaluate(state, source)
    table = np.asarray(trainer.ec.to_dense(state["emb"])["item_h0"])
    model = nnx.merge(trainer.graphdef, state["dense"], state["rest"])
    model.eval()
    ex = ranking_eval.examples_of(source)
    batch = ex.examples(np.arange(len(ex)))
    ids = foundation_ids(trainer.model_cfg, batch)
    emb = {f: jnp.asarray(table[np.maximum(v, 0)] * (v >= 0)[..., None]) for f, v in ids.items()}
    scores, target = trainer.spec.score(model, emb, {k: jnp.asarray(v) for k, v in batch.items()})
    want = ranking.topk_from_scores(np.asarray(scores, np.float64), max(KS))
    np.testing.assert_array_equal(np.asarray(target), got.targets)
    agree = (want == got.topk).mean()
    assert agree > 0.98, agree  # float summation order may swap near-ties
    assert ranking.ranking_metrics(want, got.targets, KS)["ndcg@10"] == pytest.approx(got.metrics["ndcg@10"], abs=0.03)
    # the masked ranking on the mesh (the history mask placed over the batch axes) = the host's with the same exclusion
    masked = ranking_eval.RankingEvaluator(trainer, KS, mask_history=True).evaluate(state, source)
    seen = ex.seen_mask(np.arange(len(ex)), vocab.num_indices)
    want_masked = ranking.topk_from_scores(np.asarray(scores, np.float64), max(KS), exclude=seen)
    assert not np.take_along_axis(seen, np.maximum(masked.topk, 0), axis=1).any()  # no history item, on any mesh
    assert (want_masked == masked.topk).mean() > 0.98
    assert masked.other_metrics == pytest.approx(got.metrics) and got.other_metrics == pytest.approx(masked.metrics)


@pytest.mark.parametrize("last_k,bias", [(0, None), (2, None), (0, 0.7)])
def test_full_softmax_loss_is_cross_entropy_over_every_row(last_k, bias):
    from jaxscale_models.foundation import FoundationConfig, full_softmax

    cfg = FoundationConfig(
        item_rows=12,
        item_dim=4,
        d_model=8,
        max_seq_len=5,
        retrieval_loss="full_softmax",
        similarity="dot",
        temperature=0.5,
        reserved_rows=2,
        loss_last_positions=last_k,
        seen_item_bias=bias is not None,
    )
    rng = np.random.default_rng(0)
    b, l, e = 3, 5, 4
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], bool)
    items = np.where(mask, rng.integers(2, 12, (b, l)), -1).astype(np.int32)
    target = np.array([5, -1, 7], np.int32)
    query = rng.normal(size=(b, l, e)).astype(np.float32)
    corpus = rng.normal(size=(4, 3, e)).astype(np.float32)  # 12 rows laid over a batch of 4
    batch = {"item_ids": items, "mask": mask, "target_item_ids": target}
    out = {"query": jnp.asarray(query), "corpus": jnp.asarray(corpus)}
    if bias is not None:
        out["seen_bias"] = jnp.full((b,), bias, jnp.float32)
    loss, _, count = full_softmax(cfg, out, batch)
    rows = corpus.reshape(-1, e)
    nll = []
    for i in range(b):
        n = int(mask[i].sum())
        nxt = list(items[i, 1:n]) + ([target[i]] if target[i] >= 0 else [])
        first = len(nxt) - last_k if last_k else 0
        for t, y in list(enumerate(nxt))[max(first, 0) :]:
            logits = rows @ query[i, t] / 0.5
            if bias is not None:
                logits[list(set(items[i, : t + 1]))] += bias  # the items of events <= t
            logits[:2] = -np.inf
            nll.append(np.log(np.exp(logits[2:] - logits[2:].max()).sum()) + logits[2:].max() - logits[y])
    assert int(count) == len(nll)
    assert float(loss) == pytest.approx(np.mean(nll), rel=1e-5)


def _two_tower_store(tmp: Path, vocab) -> list[str]:
    """The contextual two-tower config on the test store: its paths, item rows, history length and batch."""
    m = "model.contextual_two_tower."
    return [
        f"data.sequences.store={tmp / 'store'}",
        f"data.sequences.defs={tmp / 'defs.json'}",
        f"{m}item_rows={vocab.num_indices}",
        f"{m}max_seq_len={L}",
        "train.batch_size=16",
    ]


def test_contextual_two_tower_ranks_with_the_label_genre_as_context(movielens, tmp_path):
    tmp, rows, vocab = movielens
    m = "model.contextual_two_tower."
    overrides = [
        *_two_tower_store(tmp, vocab),
        f"{m}item_dim=8",
        f"{m}d_model=16",
        f"{m}embed_dim=8",
        f"{m}num_layers=1",
        "train.steps=2",
        "train.eval_every=2",
        "train.early_stopping_patience=0",
        "train.warmup_steps=1",
        f"train.workdir={tmp_path / 'tt'}",
    ]
    cfg = load_config(str(CONFIGS / "movielens_two_tower.yaml"), overrides)
    trainer = Trainer(cfg, progress=False)
    out = trainer.run()
    assert {"eval_recall@10", "eval_ndcg@10"} <= set(out["eval"][-1])
    ex = ranking_eval.examples_of(trainer.eval_data)
    assert ex.split == "valid" and len(ex) == USERS
    genre_of = {
        int(i): int(c)
        for i, c in zip(
            pq.read_table(tmp / "events" / "items.parquet")["item_id"].to_numpy(),
            pq.read_table(tmp / "events" / "items.parquet")["category"].to_numpy(),
        )
    }
    valid = loo_targets(rows, "valid")
    for j in range(len(ex)):
        e = ex[j]
        user = ex.anchor(j)[0]
        genre = genre_of[valid[user]]
        assert int(vocab.decode(np.array([e["label_item"]]))[0]) == valid[user]
        if genre >= 0:
            assert int(e["context_category"]) == genre and float(e["context_confidence"]) == 1.0
        else:  # a movie without a genre: the missing bucket as label, no context
            assert int(e["label_category"]) == cfg.model.params.num_categories and int(e["context_category"]) == -1
    result = evaluate.evaluate_checkpoint(cfg, tmp_path / "tt", "test", KS, baseline=False)
    assert result["examples"] == USERS and result["candidates"] == vocab.size
    assert 0.0 <= result["metrics"]["recall@10"] <= 1.0
    jax.clear_caches()


# ------------------------------------------------------------------------------ masking and baselines


def _history_items(rows, split: str) -> dict[int, set]:
    """Brute force: per user, every item rated before the split's target in (ts, file order)."""
    by_user: dict[int, list] = {}
    for pos, (u, i, _, t) in enumerate(rows):
        by_user.setdefault(u, []).append((t, pos, i))
    back = 1 if split == "test" else 2
    return {u: {i for _, _, i in sorted(evs)[:-back]} for u, evs in by_user.items() if len(evs) > back}


def _train_counts(rows) -> np.ndarray:
    counts = np.zeros(MOVIES + 1)
    for _, i, _, _ in rows:
        counts[i] += 1
    for split in ("valid", "test"):
        for i in loo_targets(rows, split).values():
            counts[i] -= 1
    return counts


def _lists(topk: Path) -> dict:
    table = pq.read_table(topk).to_pydict()
    lists: dict = {}
    for u, r, i in zip(table["user_id"], table["rank"], table["item_id"]):
        lists.setdefault(u, []).append((r, i))
    return {u: [i for _, i in sorted(v)] for u, v in lists.items()}


def _metrics_of(lists: dict, targets: dict, k: int) -> tuple[float, float]:
    hits, ndcg = [], []
    for u, target in targets.items():
        ranked = lists[u][:k]
        rank = ranked.index(target) + 1 if target in ranked else 0
        hits.append(rank > 0)
        ndcg.append(1.0 / np.log2(rank + 1) if rank else 0.0)
    return float(np.mean(hits)), float(np.mean(ndcg))


def test_seen_mask_is_every_item_before_the_target(movielens, trained):
    tmp, rows, vocab = movielens
    cfg, _, _ = trained
    from jaxscale.training.data import make_data

    for split in ("valid", "test"):
        ex = ranking_eval.examples_of(make_data(cfg, split=split))
        mask = ex.seen_mask(np.arange(len(ex)), vocab.num_indices)
        history = _history_items(rows, split)
        for j in range(len(ex)):
            want = {int(r) for r in vocab.encode(np.array(sorted(history[int(ex.users[j])])))}
            assert set(np.flatnonzero(mask[j]).tolist()) == want


def test_masked_cli_lists_hold_no_history_item_and_both_maskings_are_reported(movielens, trained, tmp_path):
    tmp, rows, vocab = movielens
    cfg, work, _ = trained
    overrides = _foundation_overrides(tmp, vocab.num_indices, work)
    base = ["--config", str(CONFIGS / "movielens_foundation.yaml"), "--checkpoint", str(work / "best")]
    base += ["--split", "test", "--k", "3,10", *overrides]
    results = {}
    for flag in ("--mask-history", "--no-mask-history"):
        out, topk = tmp_path / f"{flag}.json", tmp_path / f"{flag}.parquet"
        assert evaluate.main([*base, flag, "--json", str(out), "--topk", str(topk)]) == 0
        results[flag] = (json.loads(out.read_text()), _lists(topk))
    masked, masked_lists = results["--mask-history"]
    plain, plain_lists = results["--no-mask-history"]
    assert masked["mask_history"] is True and plain["mask_history"] is False
    history, targets = _history_items(rows, "test"), loo_targets(rows, "test")
    assert any(set(plain_lists[u]) & history[u] for u in targets)  # unmasked lists do hold history items
    for u in targets:
        assert not set(masked_lists[u]) & history[u]
    for k in KS:
        for result, lists in ((masked, masked_lists), (plain, plain_lists)):
            recall, ndcg = _metrics_of(lists, targets, k)
            assert result["metrics"][f"recall@{k}"] == pytest.approx(recall)
            assert result["metrics"][f"ndcg@{k}"] == pytest.approx(ndcg)
    # each run reports the other's metrics beside its own: one pass, both protocols
    assert masked["metrics_other_masking"] == pytest.approx(plain["metrics"])
    assert plain["metrics_other_masking"] == pytest.approx(masked["metrics"])
    # the popularity baseline under masking: train counts, every history item removed (brute force)
    counts = _train_counts(rows)
    for k in KS:
        ndcg = []
        for u, target in targets.items():
            order = sorted(
                (i for i in range(1, MOVIES + 1) if i not in history[u]),
                key=lambda i: (-counts[i], vocab.encode(np.array([i]))[0]),
            )[:k]
            ndcg.append(1.0 / np.log2(order.index(target) + 2) if target in order else 0.0)
        assert masked["popularity"][f"ndcg@{k}"] == pytest.approx(np.mean(ndcg))
        assert plain["popularity_other_masking"][f"ndcg@{k}"] == pytest.approx(np.mean(ndcg))


def test_protocol_sets_the_masking_and_refuses_another_history_length(movielens, trained, tmp_path):
    tmp, _, vocab = movielens
    _, work, _ = trained
    from jaxscale.training.config import ConfigError

    overrides = _foundation_overrides(tmp, vocab.num_indices, work)
    with pytest.raises(ConfigError, match=r"max_seq_len.*literature.*200"):
        load_config(str(CONFIGS / "movielens_foundation.yaml"), [*overrides, "data.sequences.protocol=literature"])
    with pytest.raises(ConfigError, match=r"literature.*recbole|ml100k"):
        load_config(str(CONFIGS / "movielens_foundation.yaml"), [*overrides, "data.sequences.protocol=sasrec"])
    cfg = load_config(
        str(CONFIGS / "movielens_foundation.yaml"),
        [*overrides, "data.sequences.protocol=literature", "model.foundation.max_seq_len=200"],
    )
    assert cfg.data.sequences.masks_history and ranking_eval.history_masks(cfg)
    cfg = load_config(
        str(CONFIGS / "movielens_foundation.yaml"),
        [
            *overrides,
            "data.sequences.protocol=literature",
            "model.foundation.max_seq_len=200",
            "data.sequences.mask_history=false",
        ],
    )
    assert not ranking_eval.history_masks(cfg)
    assert not ranking_eval.history_masks(load_config(str(CONFIGS / "movielens_foundation.yaml"), overrides))


def test_the_ml1m_config_is_the_literature_protocols(tmp_path):
    """run.sh --dataset ml-1m trains this file under `literature` (200 events, history masked): it loads there,
    is refused under a protocol of another history length, and trains SASRec's way (one example per user, the
    loss at every position)."""
    from jaxscale.training.config import ConfigError

    path = str(CONFIGS / "movielens1m_foundation.yaml")
    cfg = load_config(path, ["data.sequences.protocol=literature"])
    assert cfg.model.params.max_seq_len == 200 and ranking_eval.history_masks(cfg)
    assert cfg.data.sequences.train_targets == "last" and cfg.model.params.loss_last_positions == 0
    with pytest.raises(ConfigError, match=r"max_seq_len.*recbole.*50"):
        load_config(path, ["data.sequences.protocol=recbole"])
    assert "movielens1m_foundation.yaml" in (ROOT / "experiments" / "movielens" / "run.sh").read_text()


def test_the_ml1m_records_trained_the_steps_run_sh_sets():
    """run.sh trains the ML-1M config's own steps under `recbole` and sets its own under `literature`; the
    recorded runs trained exactly those (a record of other steps is not what run.sh reproduces)."""
    text = (ROOT / "experiments" / "movielens" / "run.sh").read_text()
    (literature,) = re.findall(r'PROTOCOL == literature \]\] && FOUNDATION_STEPS=\("train\.steps=(\d+)"\)', text)
    config = load_config(str(CONFIGS / "movielens1m_foundation.yaml"), ["data.sequences.protocol=literature"])
    results = ROOT / "experiments" / "results"
    for name, steps in (("literature", int(literature)), ("recbole", config.train.steps)):
        record = json.loads((results / f"movielens_ml1m_{name}.json").read_text())
        assert record["models"]["foundation"]["steps"] == steps, name


def test_genre_hint_ranks_the_context_genre_by_train_count(movielens, tmp_path):
    tmp, rows, vocab = movielens
    overrides = _two_tower_store(tmp, vocab)
    cfg = load_config(str(CONFIGS / "movielens_two_tower.yaml"), overrides)
    out = tmp_path / "hint.json"
    argv = ["--config", str(CONFIGS / "movielens_two_tower.yaml"), "--baseline", "genre_hint", "--split", "test"]
    assert (
        evaluate.main([*argv, "--k", "3,10", "--json", str(out), "--topk", str(tmp_path / "h.parquet"), *overrides])
        == 0
    )
    result = json.loads(out.read_text())
    items = pq.read_table(tmp / "events" / "items.parquet").to_pydict()
    genre = dict(zip(items["item_id"], items["category"]))
    counts, targets = _train_counts(rows), loo_targets(rows, "test")
    index = {i: int(vocab.encode(np.array([i]))[0]) for i in range(1, MOVIES + 1)}
    lists = _lists(tmp_path / "h.parquet")
    for u, target in targets.items():
        hint = genre[target]  # the two-tower's test context: the held-out movie's own genre (-1: none)
        candidates = [i for i in range(1, MOVIES + 1) if index[i] >= 2]  # rated movies: the vocabulary
        want = sorted(candidates, key=lambda i: (not (hint >= 0 and genre[i] == hint), -counts[i], index[i]))
        assert lists[u] == want[:10]
    for k in KS:
        recall, ndcg = _metrics_of(lists, targets, k)
        assert result["metrics"][f"ndcg@{k}"] == pytest.approx(ndcg)
        assert result["genre_hint"][f"recall@{k}"] == pytest.approx(recall)
    assert cfg.data.sequences.masks_history is False and result["mask_history"] is False
