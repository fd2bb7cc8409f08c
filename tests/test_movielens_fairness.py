"""experiments/movielens/fairness.py --summarize (run as the script it is) on top-k files written here: per
variant and masking, each seed's NDCG@10 and their mean +- s.e. equal a brute force over the raw ratings, and
each paired bootstrap is centred on the difference of the two variants' per-user NDCG@10."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from movielens_helpers import MOVIES, loo_targets, write_ml100k

from jaxscale.sequences import compile_definitions
from jaxscale.sequences.movielens import import_movielens
from jaxscale.sequences.runtime import backfill
from jaxscale.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "jaxscale" / "configs" / "movielens_foundation.yaml"


def _write_topk(path: Path, lists: dict) -> None:
    users = [u for u, items in lists.items() for _ in items]
    ranks = [r for items in lists.values() for r in range(1, len(items) + 1)]
    items = [i for items in lists.values() for i in items]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"user_id": users, "rank": pa.array(ranks, pa.int32()), "item_id": items}), path)


NAMES = ("foundation", "sasrec", "sasrec_seen_offset")


def _finished_runs(tmp_path) -> tuple[dict, dict]:
    """A store of a small ML-100K layout and, for each variant of NAMES and seeds 0 and 1, the folder a finished
    run leaves (random top-20 lists under both maskings, SASRec's result.json). Returns (user -> test target,
    {(name, seed, masking): each user's 1-based target rank, 0 where it is not listed})."""
    rows = write_ml100k(tmp_path / "raw")
    import_movielens(tmp_path / "raw", tmp_path / "events")
    defs = compile_definitions(ROOT / "experiments/movielens/movielens_defs.py", tmp_path / "defs.json")
    backfill(
        defs,
        tmp_path / "events" / "events",
        tmp_path / "store",
        sources={"items": str(tmp_path / "events" / "items.parquet")},
    )
    targets = loo_targets(rows, "test")
    rng = np.random.default_rng(0)
    ranks: dict = {}
    for name in NAMES:
        for seed in (0, 1):
            if name.startswith("sasrec"):  # what the SASRec script records beside its lists
                offset = {"seen_item_offset": True, "seen_offset_scale": 10.0, "seen_offset_value": -5.0 - seed}
                result = offset if name == "sasrec_seen_offset" else {"seen_item_offset": False}
                (tmp_path / "fairness" / f"{name}_seed{seed}").mkdir(parents=True)
                (tmp_path / "fairness" / f"{name}_seed{seed}" / "result.json").write_text(json.dumps(result))
            for masking in ("masked", "unmasked"):
                lists = {}
                for u, t in targets.items():  # random lists, the target placed at a random rank or left out
                    items = [int(i) for i in rng.permutation(np.arange(1, MOVIES + 1)) if i != t][:20]
                    at = int(rng.integers(0, 30))
                    if at < 20:
                        items[at] = t
                    lists[u] = items
                _write_topk(tmp_path / "fairness" / f"{name}_seed{seed}" / f"topk_{masking}.parquet", lists)
                ranks[name, seed, masking] = [
                    lists[u].index(t) + 1 if t in lists[u] else 0 for u, t in sorted(targets.items())
                ]
    return targets, ranks


def _summarize(tmp_path, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "experiments/movielens/fairness.py"), str(tmp_path), "--json", str(out)]
    return subprocess.run([*cmd, "--summarize", *args], capture_output=True, text=True, timeout=300)


def _ndcg(ranks) -> np.ndarray:
    r = np.array(ranks)
    return np.where((r > 0) & (r <= 10), 1 / np.log2(np.maximum(r, 1) + 1), 0.0)


def test_summarize_equals_brute_force(tmp_path):
    targets, ranks = _finished_runs(tmp_path)
    want = {key: _ndcg(r) for key, r in ranks.items()}
    names = NAMES
    out = tmp_path / "fair.json"
    proc = _summarize(tmp_path, out, "--seeds", "0", "1", "--override", "mesh.local=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    kept = record["target_ranks"]  # what every figure is computed from, kept per seed
    assert kept["users"] == sorted(targets)
    for (name, seed, masking), r in ranks.items():
        assert kept["runs"][name][str(seed)][masking] == r
        ran = kept["runs"][name][str(seed)]["machine"]
        assert ran == {k: record["machine"][k] for k in ("backend", "device", "cpu_model", "usable_cores", "jax")}
    assert record["overrides"] == ["mesh.local=1"]  # what the runs were trained with is recorded
    assert record["config"] == "jaxscale/configs/movielens_foundation.yaml"  # readable from any clone
    assert record["users"] == len(targets) and set(record["variants"]) == set(names)
    assert record["seen_item_bias_scale"] == load_config(str(CONFIG)).model.foundation.seen_item_bias_scale
    assert record["variants"]["sasrec"]["seen_offset"] is None
    assert record["variants"]["sasrec_seen_offset"]["seen_offset"] == {"scale": [10.0, 10.0], "learned": [-5.0, -6.0]}
    for name in names:
        for masking in ("masked", "unmasked"):
            got = record["variants"][name][masking]
            seeds = [want[name, s, masking].mean() for s in (0, 1)]
            assert got["ndcg@10"] == pytest.approx(seeds)
            assert got["mean"] == pytest.approx(np.mean(seeds))
            assert got["se"] == pytest.approx(np.std(seeds, ddof=1) / np.sqrt(2))
    pairs = {(p["a"], p["b"], p["masking"]): p["ndcg@10_difference"] for p in record["paired"]}
    assert set(pairs) == {("foundation", b, m) for b in names[1:] for m in ("masked", "unmasked")}
    for m in ("masked", "unmasked"):
        diff = np.mean([want["foundation", s, m] for s in (0, 1)], axis=0) - np.mean(
            [want["sasrec", s, m] for s in (0, 1)], axis=0
        )
        p = pairs["foundation", "sasrec", m]
        assert p["mean"] == pytest.approx(diff.mean()) and p["low"] <= p["mean"] <= p["high"]


def test_keep_recorded_adds_seeds_to_a_record_without_the_earlier_folders(tmp_path):
    """Seeds summarised in an earlier invocation (another session, another machine: their folders gone here)
    count with --keep-recorded: the record equals the one made with every folder present. A record made with
    other overrides, or one without target ranks, is refused with a message that names why."""
    _finished_runs(tmp_path)
    full, part = tmp_path / "full.json", tmp_path / "part.json"
    assert _summarize(tmp_path, full, "--seeds", "0", "1").returncode == 0
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for name in NAMES:  # seed 1 recorded first, its folders then gone; seed 0 added by a later invocation
        (tmp_path / "fairness" / f"{name}_seed0").rename(moved / f"{name}_seed0")
    assert _summarize(tmp_path, part, "--seeds", "0", "1").returncode == 0
    for name in NAMES:
        (tmp_path / "fairness" / f"{name}_seed1").rename(moved / f"{name}_seed1")
        (moved / f"{name}_seed0").rename(tmp_path / "fairness" / f"{name}_seed0")
    alone = _summarize(tmp_path, tmp_path / "alone.json", "--seeds", "0")  # without the flag: seed 0 alone
    assert alone.returncode == 0 and json.loads((tmp_path / "alone.json").read_text())["variants"]["sasrec"][
        "seeds"
    ] == [0]
    proc = _summarize(tmp_path, part, "--seeds", "0", "--keep-recorded")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = json.loads(part.read_text()), json.loads(full.read_text())
    for key in ("variants", "paired", "target_ranks", "users"):
        assert got[key] == want[key], key

    refused = _summarize(tmp_path, part, "--seeds", "0", "--keep-recorded", "--override", "mesh.local=2")
    assert refused.returncode != 0 and "overrides" in refused.stderr
    short = tmp_path / "fairness" / "foundation_seed0" / "topk_masked.parquet"  # a list file that lost a user
    table = pq.read_table(short)
    pq.write_table(table.filter(pc.not_equal(table["user_id"], table["user_id"][0])), short)
    refused = _summarize(tmp_path, part, "--seeds", "0")
    assert refused.returncode != 0 and "no list for 1 test users" in refused.stderr
    bad = tmp_path / "bad.json"  # an edited record: one seed's ranks a user short
    cut = json.loads(full.read_text())
    cut["target_ranks"]["runs"]["sasrec"]["1"]["masked"].pop()
    bad.write_text(json.dumps(cut))
    refused = _summarize(tmp_path, bad, "--seeds", "0", "--keep-recorded")
    assert refused.returncode != 0 and "sasrec seed 1: masked ranks are not one int per user" in refused.stderr
    del cut["target_ranks"]["runs"]["sasrec"]["1"]["masked"]  # ... and without SASRec's offset entry
    cut["target_ranks"]["runs"]["sasrec"]["0"].pop("seen_offset")
    bad.write_text(json.dumps(cut))
    refused = _summarize(tmp_path, bad, "--seeds", "0", "--keep-recorded")
    assert refused.returncode != 0 and "sasrec seed '0': not a seed number with machine, seen_offset" in refused.stderr
    old = tmp_path / "old.json"
    old.write_text(json.dumps({k: v for k, v in want.items() if k != "target_ranks"}))
    refused = _summarize(tmp_path, old, "--seeds", "0", "--keep-recorded")
    assert refused.returncode != 0 and "target ranks" in refused.stderr


def test_a_record_of_another_config_version_keeps_only_its_sasrec_seeds(tmp_path):
    """The record names the config file's sha256; with --keep-recorded, a record made with another version of
    that file keeps its SASRec seeds (they depend on it only through the offset scale, which must match) and
    loses its foundation seeds, said on stderr. A foundation folder stamped with another version is refused."""
    _finished_runs(tmp_path)
    full = tmp_path / "full.json"
    assert _summarize(tmp_path, full, "--seeds", "0", "1").returncode == 0
    record = json.loads(full.read_text())
    assert record["config_sha256"] == hashlib.sha256(CONFIG.read_bytes()).hexdigest()
    for name in NAMES:  # seed 1 only in the record from here on
        (tmp_path / "fairness" / f"{name}_seed1").rename(tmp_path / f"{name}_seed1")
    (tmp_path / "same.json").write_text(full.read_text())
    same = _summarize(tmp_path, tmp_path / "same.json", "--seeds", "0", "--keep-recorded")
    full.write_text(json.dumps(record | {"config_sha256": "0" * 64}))
    other = _summarize(tmp_path, full, "--seeds", "0", "--keep-recorded")
    assert same.returncode == 0 and other.returncode == 0, other.stderr[-3000:]
    assert "another version" not in same.stderr
    assert "another version of jaxscale/configs/movielens_foundation.yaml" in other.stderr
    assert "its seeds of foundation are not kept" in other.stderr
    got = json.loads(full.read_text())["variants"]
    assert got["foundation"]["seeds"] == [0] and got["sasrec"]["seeds"] == got["sasrec_seen_offset"]["seeds"] == [0, 1]
    assert json.loads((tmp_path / "same.json").read_text())["variants"]["foundation"]["seeds"] == [0, 1]

    (tmp_path / "fairness" / "foundation_seed0" / "config.sha256").write_text("f" * 64 + "\n")
    refused = _summarize(tmp_path, tmp_path / "stamped.json", "--seeds", "0")
    assert refused.returncode != 0 and "foundation_seed0 was trained with another version" in refused.stderr


# In a process of its own (the script is run, never imported by the tests): train_foundation with _run recorded.
_SHIM = """
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("fairness_script", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
calls = []
module._run = lambda cmd, log: calls.append(cmd)
out = Path(sys.argv[2])
if sys.argv[3] == "foundation":
    module.train_foundation(out, out / "fairness", "foundation", 1, 100)
else:
    module.train_sasrec(out, out / "fairness", sys.argv[3], 0, 10.0)
print(json.dumps(calls))
"""


def _train_calls(out: Path, name: str = "foundation") -> list:
    script = str(ROOT / "experiments/movielens/fairness.py")
    cmd = [sys.executable, "-c", _SHIM, script, str(out), name]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("record", [None, {"stop_reason": "requested", "final_step": 40}])
def test_an_interrupted_variant_is_resumed_never_scored_half_trained(tmp_path, record):
    """A variant folder holding a `best` checkpoint but no finished run.json (a run killed or stopped midway)
    is trained on with --resume before it is scored; a finished one is scored as it is."""
    run = tmp_path / "fairness" / "foundation_seed1"
    (run / "best").mkdir(parents=True)
    if record is not None:
        (run / "run.json").write_text(json.dumps(record))
    calls = _train_calls(tmp_path)
    stamp = (run / "config.sha256").read_text().strip()  # what it is trained with, beside its checkpoints
    assert stamp == hashlib.sha256(CONFIG.read_bytes() + b"[]").hexdigest()
    trains = [c for c in calls if "jaxscale.train" in c]
    assert len(trains) == 1 and "--resume" in trains[0] and f"train.workdir={run}" in trains[0]
    assert [c[2] for c in calls[1:]] == ["jaxscale.evaluate"] * 2  # then scored under both maskings

    (run / "run.json").write_text(json.dumps({"stop_reason": "early_stopping", "final_step": 60}))
    assert [c[2] for c in _train_calls(tmp_path)] == ["jaxscale.evaluate"] * 2
    (run / "config.sha256").write_text("0" * 64)  # trained with another version: neither resumed nor scored
    with pytest.raises(subprocess.CalledProcessError) as refused:
        _train_calls(tmp_path)
    assert "was trained with another version" in refused.value.stderr


def test_sasrec_gets_the_foundation_models_offset_parametrisation(tmp_path):
    """sasrec_seen_offset is trained with the scale it is given (the foundation config's); plain SASRec has no
    offset and no scale."""
    (offset,) = _train_calls(tmp_path, "sasrec_seen_offset")
    assert "--seen-item-offset" in offset and offset[offset.index("--seen-item-offset-scale") + 1] == "10.0"
    (plain,) = _train_calls(tmp_path, "sasrec")
    assert not any(a.startswith("--seen-item-offset") for a in plain)
