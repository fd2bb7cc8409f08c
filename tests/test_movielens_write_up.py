"""experiments/movielens/write_up.py (run as the script it is): docs/movielens.md is exactly what it renders from
the recorded JSON today, so a figure in the write-up cannot drift from its record (nor be typed in by hand); and
its ML-1M verdicts follow the numbers."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from movielens_helpers import render_write_up

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def seed_entry(unmasked: list, masked: list, **extra) -> dict:
    """A fairness record's variant from its per-seed NDCG@10 under each masking (mean, standard error)."""

    def side(xs):
        mean = sum(xs) / len(xs)
        se = (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 / len(xs) ** 0.5 if len(xs) > 1 else None
        return {"ndcg@10": xs, "mean": mean, "se": se}

    return {"seeds": list(range(len(unmasked))), "unmasked": side(unmasked), "masked": side(masked), **extra}


def test_the_docs_are_what_write_up_renders_from_the_records(tmp_path):
    assert render_write_up(tmp_path, RESULTS) == (ROOT / "docs" / "movielens.md").read_text()


def test_the_ml1m_verdicts_follow_the_numbers(tmp_path):
    """The target sentences say 'met' exactly when the recorded figure reaches its target."""
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / "movielens_metrics.json", results)
    record = {
        "protocol_detail": "x", "counts": {"users": 2, "items": 3, "interactions": 4}, "evaluated_users": 2,
        "candidates": 3, "mask_history": True, "run": {"seconds": 3601},
        "models": {"foundation": {"test": {"ndcg@10": 0.1820, "recall@10": 0.3}}},
    }  # fmt: skip
    (results / "movielens_ml1m_literature.json").write_text(json.dumps(record))
    text = render_write_up(tmp_path, results)
    assert "the target is missed" in text and "over the 60-minute budget" in text
    record["models"]["foundation"]["test"]["ndcg@10"] = 0.1821
    record["run"]["seconds"] = 3600
    (results / "movielens_ml1m_literature.json").write_text(json.dumps(record))
    text = render_write_up(tmp_path, results)
    assert "the target is met" in text and "within the 60-minute budget" in text
    # the strongest published row (SASRec+ with 3,000 negatives, 0.1857 / 0.3159) is read on both figures
    assert "SASRec+ with 3,000 negatives (0.1857 / 0.3159): NDCG@10 0.98x, HR@10 0.95x, not above it on either" in text
    record["models"]["foundation"]["test"] = {"ndcg@10": 0.1858, "recall@10": 0.3}
    (results / "movielens_ml1m_literature.json").write_text(json.dumps(record))
    assert "1.00x, HR@10 0.95x, above it on NDCG@10 only." in render_write_up(tmp_path, results)
    record["models"]["foundation"]["test"] = {"ndcg@10": 0.1858, "recall@10": 0.316}
    (results / "movielens_ml1m_literature.json").write_text(json.dumps(record))
    assert "1.00x, HR@10 1.00x, above it on both." in render_write_up(tmp_path, results)


def test_the_two_tower_verdicts_follow_the_numbers(tmp_path):
    """The two-tower sentence says each target (1.3x genre_hint, 2x no context) is met exactly when it is."""
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / "movielens_metrics.json", results)

    def record(context: float, no_context: float) -> dict:
        models = {
            "foundation": {"test": {"ndcg@10": 0.2, "recall@10": 0.3}},
            "two_tower_context": {"test": {"ndcg@10": 0.1, "recall@10": context}},
            "two_tower_no_context": {"test": {"ndcg@10": 0.05, "recall@10": no_context}},
            "genre_hint": {"test": {"ndcg@10": 0.1, "recall@10": 0.2}},
        }
        return {
            "protocol_detail": "x", "counts": {"users": 2, "items": 3, "interactions": 4}, "evaluated_users": 2,
            "candidates": 3, "mask_history": True, "models": models,
        }  # fmt: skip

    for context, no_context, hint, alone in [(0.2601, 0.13, "met", "met"), (0.2599, 0.1301, "missed", "missed")]:
        (results / "movielens_ml1m_literature.json").write_text(json.dumps(record(context, no_context)))
        text = render_write_up(tmp_path, results)
        assert f"the targets: 1.3x the hint {hint}, 2x no context {alone}." in text


def test_an_unmasked_protocols_ablation_reads_its_own_masking_and_its_peer(tmp_path):
    """Under `recbole` (history not masked) the ablation table leads with the unmasked column, the seen-item
    offset is named as a mechanism the published SASRec row lacks, and the verdict comes from the variant with
    SASRec's inputs only, against that protocol's target."""
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / "movielens_metrics.json", results)
    record = {
        "protocol_detail": "x", "counts": {"users": 2, "items": 3, "interactions": 4}, "evaluated_users": 2,
        "candidates": 3, "mask_history": False,
        "models": {"foundation": {"test": {"ndcg@10": 0.14, "recall@10": 0.25}}},
    }  # fmt: skip
    (results / "movielens_ml1m_recbole.json").write_text(json.dumps(record))

    def entry(unmasked: float, masked: float) -> dict:  # one seed
        return seed_entry([unmasked], [masked])

    for items_only, verdict in [
        (0.1285, "the lead comes from what SASRec does not have"),
        (0.1287, "with SASRec's inputs only (foundation_items_only) the model leads too"),
    ]:
        ablation = {
            "config": "jaxscale/configs/movielens1m_foundation.yaml", "protocol": "recbole", "machine": {},
            "variants": {"foundation": entry(0.14, 0.15), "foundation_items_only": entry(items_only, 0.2)},
            "paired": [],
        }  # fmt: skip
        (results / "movielens_ml1m_recbole_fairness.json").write_text(json.dumps(ablation))
        text = render_write_up(tmp_path, results)
        assert "| variant | test NDCG@10, history not masked | per seed | history masked |" in text
        assert f"| foundation_items_only | {items_only:.4f} | {items_only:.4f} | 0.2000 |" in text
        assert "which this protocol does not mask: a mechanism SASRec does not have" in text
        assert f"the model reaches {items_only:.4f}, " in text and verdict in text


def test_the_ml100k_seed_target_follows_the_seeds_and_the_means(tmp_path):
    """ML-100K's seed target is 'met' only with 3 seeds on every side and the foundation model's mean at or
    above both SASRec variants under both maskings; 'not met' once a SASRec variant with 3 seeds is above the
    foundation model's 3 (a side still short cannot undo it, and is named); otherwise fewer seeds are said as
    such, never read as met. With SASRec in the record, the ablation's verdict compares against its mean, not
    the separate reference run."""
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / "movielens_metrics.json", results)

    def render(sasrec_masked: list, offset_seeds: int, offset_masked: float = 0.09) -> str:
        variants = {
            "foundation": seed_entry([0.08, 0.082, 0.078], [0.094, 0.095, 0.093]),
            "foundation_no_seen_offset": seed_entry([0.06, 0.061, 0.062], [0.09, 0.091, 0.092]),
            "sasrec": seed_entry([0.055, 0.056, 0.054][: len(sasrec_masked)], sasrec_masked),
            "sasrec_seen_offset": seed_entry([0.07] * offset_seeds, [offset_masked] * offset_seeds),
        }
        record = {"config": "jaxscale/configs/movielens_foundation.yaml", "machine": {}, "variants": variants}
        (results / "movielens_fairness.json").write_text(json.dumps(record | {"paired": []}))
        return render_write_up(tmp_path, results)

    text = render([0.09], 3)
    assert "no variant with SASRec's inputs only is in this record" in text  # unmasked: the offset is one
    assert "not established: it needs 3 seeds of each side, and this record has sasrec 1 seed" in text
    assert "sasrec 0.0550 (1 seed)" in text and "foundation 0.0800 +- 0.0012 (3 seeds)" in text
    assert "0.0610, 1.11x SASRec's mean over its 1 seed in this record 0.0550" in text
    text = render([0.09, 0.091, 0.092], 3)
    assert "under each masking): met (the foundation model's mean is at or above both" in text
    text = render([0.09, 0.1, 0.1], 3)
    assert (
        "under each masking): not met (with 3 seeds on both sides the foundation model's mean is below sasrec with "
        "history masked)." in text
    )
    text = render([0.09, 0.1, 0.1], 2)
    assert (
        "under each masking): not met (with 3 seeds on both sides the foundation model's mean is below sasrec with "
        "history masked; this record also has sasrec_seen_offset 2 seeds, which cannot change that)." in text
    )
    text = render([0.09, 0.1, 0.1], 2, offset_masked=0.2)
    assert "sasrec_seen_offset 2 seeds, which cannot change that; below sasrec_seen_offset with history masked " in text
    text = render([0.1], 3)  # only a side still short is above: undecided
    assert (
        "not established: it needs 3 seeds of each side, and this record has sasrec 1 seed (the foundation model's "
        "mean is below sasrec with history masked)." in text
    )
    text = render([0.09, 0.091, 0.092], 3, offset_masked=0.2)
    assert "not met (with 3 seeds on both sides the foundation model's mean is below sasrec_seen_offset with " in text
    assert "which cannot change that" not in text


def test_the_offsets_parametrisation_is_said_for_both_sides(tmp_path):
    """The seed section says the scale each side's offset was trained with and what SASRec learned; a SASRec
    seed with another scale than the record's foundation runs is named as such, a record made before the
    option is read as unit-scaled, and a config whose scale is not the record's is said to differ."""
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / "movielens_metrics.json", results)
    side = {"ndcg@10": [0.1], "mean": 0.1, "se": None}
    base = {"seeds": [0], "unmasked": side, "masked": side}
    config = "jaxscale/configs/movielens_foundation.yaml"
    shipped = yaml.safe_load((ROOT / config).read_text())["model"]["foundation"]["seen_item_bias_scale"]

    sha = hashlib.sha256((ROOT / config).read_bytes()).hexdigest()

    def render(scales: list | None, record_scale: float | None, config_sha256: str | None = sha) -> str:
        offset = {"scale": scales, "learned": [-6.04, -5.5][: len(scales)]} if scales else None
        variants = {"foundation": base, "sasrec": base | {"seen_offset": None}}
        variants["sasrec_seen_offset"] = base | ({"seen_offset": offset} if scales else {})
        record = {"config": config, "machine": {}, "variants": variants, "paired": []}
        if config_sha256 is not None:
            record["config_sha256"] = config_sha256
        if record_scale is not None:
            record["seen_item_bias_scale"] = record_scale
        (results / "movielens_fairness.json").write_text(json.dumps(record))
        return render_write_up(tmp_path, results)

    both = f"{shipped:g} in this record's foundation runs, the same for sasrec_seen_offset, whose learned offset per"
    text = render([float(shipped)], shipped)
    assert both + " seed is -6.04." in text
    assert "The foundation config now sets" not in text  # the record is the shipped config's
    assert "trained with another version of" not in text
    other = f"- This record's foundation rows were trained with another version of {config} than the shipped one"
    for config_sha256 in ("0" * 64, None):  # another version of the file, or a record made before the field
        assert other in render([float(shipped)], shipped, config_sha256)
    text = render([1.0, float(shipped)], shipped)
    assert f"not the foundation model's (1, {shipped:g}) for sasrec_seen_offset, whose learned offset per seed is " \
        "-6.04, -5.50" in text  # fmt: skip
    text = render(None, None)  # made before the option: both sides unit-scaled, nothing learned recorded
    assert "1 in this record's foundation runs, the same for sasrec_seen_offset, whose learned offset this record " \
        "does not hold." in text  # fmt: skip
    assert (f"The foundation config now sets `seen_item_bias_scale: {shipped:g}`" in text) == (shipped != 1)


def test_a_re_recording_at_the_configs_scale_is_rendered_beside_the_seed_record(tmp_path):
    """The seed comparison re-recorded with the shipped config's offset scale (movielens_fairness_config_scale.json)
    gets its own seeds, paired bootstraps and verdict after the earlier record's, which then says that it follows;
    without it the earlier record says it has not been re-recorded."""
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / "movielens_metrics.json", results)
    config = "jaxscale/configs/movielens_foundation.yaml"
    old = {"config": config, "machine": {}, "paired": [], "variants": {
        "foundation": seed_entry([0.08, 0.082, 0.078], [0.094, 0.095, 0.093]),
        "sasrec": seed_entry([0.055, 0.056], [0.1, 0.11]),
    }}  # fmt: skip
    (results / "movielens_fairness.json").write_text(json.dumps(old))
    assert "and it has not been re-recorded with it." in render_write_up(tmp_path, results)
    boot = {"mean": -0.0201, "low": -0.03, "high": -0.01, "level": 0.95, "rounds": 10, "users": 943}
    new = {
        "config": config, "machine": {}, "overrides": ["mesh.local=2", "train.steps=4000"],
        "seen_item_bias_scale": 10.0,
        "variants": {
            "foundation": seed_entry([0.09, 0.095, 0.1], [0.1, 0.1, 0.103]),
            "sasrec_seen_offset": seed_entry([0.12], [0.13], seen_offset={"scale": [10.0], "learned": [-0.6]}),
        },
        "paired": [{"a": "foundation", "b": "sasrec_seen_offset", "masking": "masked", "ndcg@10_difference": boot}],
    }  # fmt: skip
    (results / "movielens_fairness_config_scale.json").write_text(json.dumps(new))
    text = render_write_up(tmp_path, results)
    earlier, rescaled = text.split("- Re-recorded at the config's offset scale")
    assert "; its re-recording at that scale follows." in earlier and "0.0800 +- 0.0012 (3 seeds)" in earlier
    assert rescaled.startswith(f" (`movielens_fairness_config_scale.json`: fairness.py with {config}, 4,000 steps, "
                               "overrides mesh.local=2, train.steps=4000; the runs finished so far):")  # fmt: skip
    assert "- foundation minus sasrec_seen_offset, NDCG@10 with history masked: -0.0201 (paired bootstrap over 943 " \
        "users, 95% interval -0.0300 to -0.0100)." in rescaled  # fmt: skip
    assert "history masked: foundation 0.1010 +- 0.0010 (3 seeds); sasrec_seen_offset 0.1300 (1 seed)." in rescaled
    assert "10 in this record's foundation runs, the same for sasrec_seen_offset, whose learned offset per seed is " \
        "-0.60." in rescaled  # fmt: skip
    assert "this record has sasrec 0 seeds, sasrec_seen_offset 1 seed (the foundation model's mean is below " \
        "sasrec_seen_offset with history not masked, sasrec_seen_offset with history masked)." in rescaled  # fmt: skip


def test_a_record_whose_seeds_ran_on_two_machines_names_both(tmp_path):
    """Seeds added to a fairness record from another machine (fairness.py --keep-recorded) keep their own
    machine, and the ablation's sentence names every machine the record's seeds ran on, once each."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    record = json.loads((results / "movielens_fairness.json").read_text())
    cpu = {"backend": "cpu", "device": "cpu", "cpu_model": "Xeon X", "usable_cores": 2, "jax": "0.10.2"}
    gpu = {"backend": "gpu", "device": "NVIDIA H200", "cpu_model": "EPYC", "usable_cores": 16, "jax": "0.11.2"}
    runs = {
        name: {str(s): {"machine": gpu if s == 2 else cpu} for s in v["seeds"]}
        for name, v in record["variants"].items()
    }
    record["target_ranks"] = {"users": [], "runs": runs}
    (results / "movielens_fairness.json").write_text(json.dumps(record))
    text = render_write_up(tmp_path, results)
    assert "run on cpu (Xeon X, 2 cores, jax 0.10.2) and gpu (NVIDIA H200, jax 0.11.2);" in text


def test_the_tied_item_space_claim_follows_the_tuning_record():
    """docs/movielens.md ("The item space"): the runs with `item_space=tied` (J, K, L) are above run F at every
    evaluation step both have, and each one's best is above runs F and G's; run J changes nothing else."""
    runs = {r["name"]: r for r in json.loads((RESULTS / "movielens_tuning.json").read_text())["runs"]}
    tied = [r for r in runs.values() if "model.foundation.item_space=tied" in r["overrides"]]
    assert [r["name"] for r in tied] == ["J", "K", "L"]
    f = dict(runs["F"]["curve"])
    for r in tied:
        assert all(v > f[step] for step, v in r["curve"] if step in f), r["name"]
        assert r["best"] > max(runs["F"]["best"], runs["G"]["best"]), r["name"]
    assert runs["J"]["overrides"] == ["mesh.local=2", "model.foundation.item_space=tied"]
    config = yaml.safe_load((ROOT / "jaxscale/configs/movielens_foundation.yaml").read_text())
    assert config["model"]["foundation"]["item_space"] == "tied" and config["mesh"]["local"] == 8
    doc = " ".join((ROOT / "docs/movielens.md").read_text().split())
    claim = "was above run F at every evaluation step both runs have, and each run's best was above runs F and G's"
    assert claim in doc


def test_the_item_space_lines_are_the_two_records_per_user_difference(tmp_path):
    """The tied-space record beside its projected-space recording: each side's mean as recorded and the paired
    difference computed from both records' per-user ranks (NDCG@10 averaged over seeds, then over users)."""
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / "movielens_metrics.json", results)
    users = list(range(1, 7))
    config = "jaxscale/configs/movielens_foundation.yaml"

    def record(ranks: dict) -> dict:
        runs = {str(s): {"unmasked": r, "masked": [min(x, 3) for x in r], "machine": {}} for s, r in ranks.items()}
        ndcg = {m: [sum(1 / math.log2(x + 1) for x in run[m] if 0 < x <= 10) / 6 for run in runs.values()]
                for m in ("unmasked", "masked")}  # fmt: skip
        foundation = seed_entry(ndcg["unmasked"], ndcg["masked"])
        return {"config": config, "machine": {}, "overrides": ["mesh.local=2"], "seen_item_bias_scale": 10.0,
                "variants": {"foundation": foundation}, "paired": [],
                "target_ranks": {"users": users, "runs": {"foundation": runs}}}  # fmt: skip

    tied = record({0: [1, 2, 0, 4, 11, 1], 1: [1, 1, 5, 0, 2, 3]})
    projected = record({0: [3, 0, 0, 9, 1, 2], 1: [2, 8, 0, 0, 12, 1]})
    (results / "movielens_fairness_config_scale.json").write_text(json.dumps(tied))
    (results / "movielens_fairness_config_scale_projected.json").write_text(json.dumps(projected))
    text = render_write_up(tmp_path, results)

    def per_user(rec, masking):
        runs = rec["target_ranks"]["runs"]["foundation"].values()
        return [sum(1 / math.log2(r[masking][u] + 1) if 0 < r[masking][u] <= 10 else 0 for r in runs) / 2
                for u in range(6)]  # fmt: skip

    for masking, label in (("unmasked", "history not masked"), ("masked", "history masked")):
        t, p = tied["variants"]["foundation"][masking]["mean"], projected["variants"]["foundation"][masking]["mean"]
        diff = sum(a - b for a, b in zip(per_user(tied, masking), per_user(projected, masking))) / 6
        assert f"  {label}: tied {t:.4f} (2 seeds), projected {p:.4f} (2 seeds); tied minus projected, NDCG@10 " \
            f"with {label}: {diff:+.4f} (paired bootstrap over 6 users" in text  # fmt: skip

    (results / "movielens_fairness_config_scale_projected.json").write_text(
        json.dumps(projected | {"overrides": ["mesh.local=8"]})
    )
    with pytest.raises(subprocess.CalledProcessError) as refused:
        render_write_up(tmp_path, results)
    assert "the projected-space record has other overrides" in refused.value.stderr.decode()
