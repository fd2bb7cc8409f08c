"""The fair ML-100K comparison: the foundation model against the SASRec reference on one split, both maskings.

Reads the store of a finished `experiments/movielens/run.sh OUT` (ml-100k, protocol ml100k; or ML-1M with
`--config jaxscale/configs/movielens1m_foundation.yaml --protocol literature`) and trains into OUT/fairness/:
- `foundation` (the shipped config) for every seed;
- its ablations, every seed: `foundation_no_seen_offset` (seen_item_bias off: the one mechanism the
  SASRec reference lacks), `foundation_no_rating_time` (no event-type input, no time encoding) and
  `foundation_items_only` (both: SASRec's inputs, item ids and positions);
- `sasrec` (RecBole 1.2.1's SASRec, experiments/baselines/sasrec_recbole.py) and `sasrec_seen_offset` (the
  same with the foundation model's one-scalar seen-item offset, parametrised as the foundation config's:
  `seen_item_bias_scale` times the trained scalar), every seed.
Each variant's test top-20 is written under both maskings (history kept; every history item removed); the
record gives per variant and masking each seed's NDCG@10 and their mean +- standard error, and for each pair
the foundation model is compared with, a paired bootstrap over users of the NDCG@10 difference (per-user NDCG
averaged over seeds, `jaxscale.training.ranking.paired_bootstrap`). It keeps what those are computed from,
every seed's per-user test-target rank in its top-20 (`target_ranks`), so `--keep-recorded` can add seeds
trained in another session or on another machine to the record without the earlier folders. Hours on 2
cores: a recorded run, not CI. A variant's folder whose training finished (its `run.json` says so: an
earlier invocation, or a link to run.sh's own run of that seed, `ln -s OUT/runs/foundation
OUT/fairness/foundation_seed0`) is evaluated, not trained again; one whose training was killed is resumed
from its last checkpoint, never scored half-trained. Each foundation folder it trains carries a stamp of
the config file's version and the overrides (`config.sha256`): a folder stamped with another is refused,
and a record made with another version of the config file (`config_sha256`) keeps only its SASRec seeds.

    python experiments/movielens/fairness.py OUT --json experiments/results/movielens_fairness.json \\
        [--seeds 0 1 2] [--only foundation sasrec ...] [--config YAML --protocol NAME]
    python experiments/movielens/fairness.py OUT --json F --summarize   # the record from finished runs only
    python experiments/movielens/fairness.py OUT --json F --keep-recorded --seeds 2 --only sasrec
        # one more seed, summarised with the seeds F already holds
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from jaxscale.benchmarks.machine import machine
from jaxscale.infra import atomic
from jaxscale.sequences.protocols import get_protocol
from jaxscale.training import ranking
from jaxscale.training.config import load_config
from jaxscale.training.trainer import finished_run

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "jaxscale" / "configs" / "movielens_foundation.yaml"
MASKINGS = {"unmasked": "--no-mask-history", "masked": "--mask-history"}
FOUNDATION = {
    "foundation": [],
    "foundation_no_seen_offset": ["model.foundation.seen_item_bias=false"],
    "foundation_no_rating_time": ["model.foundation.action_inputs=false", "model.foundation.time_encoding=none"],
    "foundation_items_only": [  # both ablations at once: SASRec's inputs (item ids and positions)
        "model.foundation.seen_item_bias=false",
        "model.foundation.action_inputs=false",
        "model.foundation.time_encoding=none",
    ],
}
SASREC = {"sasrec": [], "sasrec_seen_offset": ["--seen-item-offset"]}
PAIRS = (
    ("foundation", "sasrec"),
    ("foundation", "sasrec_seen_offset"),
    ("foundation_no_seen_offset", "sasrec"),
    ("foundation", "foundation_no_seen_offset"),
    ("foundation", "foundation_no_rating_time"),
    ("foundation", "foundation_items_only"),
)


CONFIG_STAMP = "config.sha256"
"""In each foundation seed folder fairness.py trains: `config_digest` of what it was trained with."""


def config_digest(config: Path, overrides=()) -> str:
    """sha256 of the config file's bytes and the overrides: which version of the foundation config a record
    or a seed folder was made with (the path alone names every version of the file)."""
    digest = hashlib.sha256(Path(config).read_bytes())
    digest.update(json.dumps(list(overrides)).encode())
    return digest.hexdigest()


def check_stamp(run: Path, digest: str) -> None:
    """Refuses a foundation seed folder stamped with another config version than `digest` (this invocation's):
    its runs would be scored, or resumed, as if trained with this one."""
    stamp = run / CONFIG_STAMP
    if stamp.exists() and stamp.read_text().strip() != digest:
        raise SystemExit(f"{run} was trained with another version of the config or other overrides: move it away")


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}); see {log}")


def train_foundation(
    out: Path,
    work: Path,
    name: str,
    seed: int,
    rows: int,
    config: Path = CONFIG,
    protocol: str | None = None,
    overrides: tuple[str, ...] = (),
) -> None:
    run = work / f"{name}_seed{seed}"
    data = [f"data.sequences.store={out / 'store'}", f"data.sequences.defs={out / 'defs.json'}"]
    if protocol is not None:  # the protocol's history is every model's (as run.sh sets it)
        history = get_protocol(protocol).history_length
        data += [f"data.sequences.protocol={protocol}", f"model.foundation.max_seq_len={history}"]
    args = [*data, f"model.foundation.item_rows={rows}", f"train.seed={seed}", f"data.seed={seed}", *FOUNDATION[name]]
    args += overrides
    py = sys.executable
    digest, stamp = config_digest(config, overrides), run / CONFIG_STAMP
    check_stamp(run, digest)
    run.mkdir(parents=True, exist_ok=True)
    if not stamp.exists():  # a folder without a stamp: trained here now, or linked (run.sh's own seed)
        stamp.write_text(digest + "\n")
    if finished_run(run) is None:  # not trained, or interrupted: --resume goes on from its last checkpoint
        _run([py, "-m", "jaxscale.train", "--config", str(config), "--no-progress", "--resume",
              f"train.workdir={run}", *args], work / f"{name}_seed{seed}.log")  # fmt: skip
    for masking, flag in MASKINGS.items():
        files = ["--json", str(run / f"test_{masking}.json"), "--topk", str(run / f"topk_{masking}.parquet")]
        cmd = [py, "-m", "jaxscale.evaluate", "--config", str(config), "--checkpoint", str(run / "best")]
        _run(
            [*cmd, "--split", "test", "--k", "10,20", flag, "--no-popularity", *files, *args],
            work / f"{run.name}_{masking}.log",
        )


def train_sasrec(out: Path, work: Path, name: str, seed: int, offset_scale: float = 1.0) -> None:
    run = work / f"{name}_seed{seed}"
    run.mkdir(parents=True, exist_ok=True)
    script = ROOT / "experiments" / "baselines" / "sasrec_recbole.py"
    files = ["--topk", str(run / "topk_unmasked.parquet"), "--topk-other", str(run / "topk_masked.parquet")]
    args = [*SASREC[name], *(["--seen-item-offset-scale", str(offset_scale)] if SASREC[name] else [])]
    _run([sys.executable, str(script), "--store", str(out / "store"), "--defs", str(out / "defs.json"), "--seed",
          str(seed), "--json", str(run / "result.json"), *files, *args], run.with_suffix(".log"))  # fmt: skip


def sasrec_offset(run: Path) -> dict | None:
    """A SASRec variant seed's offset from its result.json: its scale and the value it learned (None for a
    variant without one). A run that predates the scale option had scale 1."""
    r = json.loads((run / "result.json").read_text())
    if not r.get("seen_item_offset"):
        return None
    return {"scale": r.get("seen_offset_scale") or 1.0, "learned": r["seen_offset_value"]}


def target_ranks(topk_file: Path, targets: dict) -> list[int]:
    """The 1-based rank of each user's test target (users of `targets` sorted by id) in a top-k Parquet file
    in raw ids; 0 where it is not in the list."""
    t = pq.read_table(topk_file).to_pydict()
    lists: dict = {}
    for u, r, i in zip(t["user_id"], t["rank"], t["item_id"]):
        lists.setdefault(u, {})[r] = i
    users = sorted(targets)
    missing = [u for u in users if u not in lists]
    if missing:  # a list that lost users would score them as misses: refused, never counted
        raise SystemExit(f"{topk_file} has no list for {len(missing)} test users (first: {missing[0]!r})")
    k = max(r for items in lists.values() for r in items)
    top = np.array([[lists[u].get(r, -1) for r in range(1, k + 1)] for u in users])
    return ranking.target_ranks(top, np.array([targets[u] for u in users])).tolist()


def test_targets(out: Path) -> dict:
    """user -> raw item id of its test target, read from the store's leave-one-out test split."""
    from jaxscale.sequences.examples import PointInTimeExamples

    src = PointInTimeExamples(
        out / "store", "ratings", out / "defs.json", max_seq_len=1, num_actions=16, num_surfaces=16,
        split="test", split_mode="leave_one_out",
    )  # fmt: skip
    decode = src.reader.vocabulary("item_id").decode
    rows = np.array([int(src[i]["target_item_ids"]) for i in range(len(src))])
    return dict(zip(src.users.tolist(), decode(rows).tolist()))


SEED_MACHINE = ("backend", "device", "cpu_model", "usable_cores", "jax")
"""What each seed's entry keeps of the machine it was recorded on (the record's `machine` is this invocation's)."""


def seed_run(work: Path, name: str, seed: int, targets: dict, here: dict) -> dict | None:
    """A finished variant seed as the record keeps it: per masking its users' target ranks, a SASRec variant's
    offset, and the machine it was recorded on (`here`); None when its top-k lists are not in `work`."""
    run = work / f"{name}_seed{seed}"
    if not (run / "topk_masked.parquet").exists():
        return None
    entry: dict = {m: target_ranks(run / f"topk_{m}.parquet", targets) for m in MASKINGS}
    ran = {k: here.get(k) for k in SEED_MACHINE}
    return entry | ({"seen_offset": sasrec_offset(run)} if name in SASREC else {}) | {"machine": ran}


def recorded_runs(record: dict, expect: dict, users: list) -> dict:
    """The variant seeds an earlier record holds ({name: {seed: entry}}), refused unless that record was made
    with the same config, protocol, overrides and offset scale (`expect`) and ranked the same users. A record
    made with another version of the config file (its `config_sha256`; absent: made before it was kept) keeps
    its SASRec seeds, which depend on that file only through the offset scale (compared), and loses its
    foundation seeds, said on stderr: they are trained again."""
    for key, value in expect.items():
        if key == "config_sha256":
            continue
        if record.get(key) != value:
            raise SystemExit(f"--keep-recorded: the record's {key} is {record.get(key)!r}, this run's {value!r}")
    if "target_ranks" not in record:
        raise SystemExit("--keep-recorded: the record holds no per-user target ranks (made before they were kept)")
    if record["target_ranks"]["users"] != users:
        raise SystemExit("--keep-recorded: the record ranked other users than this store's test split")
    runs = record["target_ranks"]["runs"]
    for name, by_seed in runs.items():
        if name not in (*FOUNDATION, *SASREC):
            raise SystemExit(f"--keep-recorded: the record holds an unknown variant {name!r}")
        for seed, entry in by_seed.items():
            needed = ["machine", *(["seen_offset"] if name in SASREC else [])]
            if not seed.isdigit() or any(k not in entry for k in needed):
                raise SystemExit(f"--keep-recorded: {name} seed {seed!r}: not a seed number with {', '.join(needed)}")
            for masking in MASKINGS:
                ranks = entry.get(masking)
                if not isinstance(ranks, list) or len(ranks) != len(users) or not all(type(r) is int for r in ranks):
                    raise SystemExit(f"--keep-recorded: {name} seed {seed}: {masking} ranks are not one int per user")
    if record.get("config_sha256") != expect["config_sha256"]:
        stale = sorted(n for n in runs if n in FOUNDATION)
        if stale:
            print(
                f"--keep-recorded: the record was made with another version of {expect['config']} (sha256 "
                f"{record.get('config_sha256')}): its seeds of {', '.join(stale)} are not kept",
                file=sys.stderr,
            )
        runs = {n: by_seed for n, by_seed in runs.items() if n not in FOUNDATION}
    return runs


def summarize(
    out: Path,
    work: Path,
    seeds: list[int],
    here: dict,
    recorded: dict | None = None,
    rounds: int = 10_000,
    digest: str | None = None,
) -> dict:
    """The record: per variant and masking, per-seed metrics and their mean +- s.e.; paired bootstraps; and
    every seed's per-user target ranks (what the rest is computed from, so a later run can add seeds). A seed
    whose folder is not in `work` is taken from `recorded` ({name: {seed: entry}}) when it holds it, and every
    seed `recorded` holds counts; `here`: the machine this runs on, kept with each seed found in `work`;
    `digest`: this invocation's `config_digest`, which a stamped foundation folder must carry."""
    targets = test_targets(out)
    users = sorted(targets)
    runs: dict = {}
    for name in [*FOUNDATION, *SASREC]:
        kept = (recorded or {}).get(name, {})
        for s in sorted({*seeds, *map(int, kept)}):
            if digest is not None and name in FOUNDATION:
                check_stamp(work / f"{name}_seed{s}", digest)
            entry = seed_run(work, name, s, targets, here) or kept.get(str(s))
            if entry is not None:
                runs.setdefault(name, {})[str(s)] = entry
    variants, per_user = {}, {}
    for name, by_seed in runs.items():
        done = sorted(by_seed, key=int)
        entry = {"seeds": [int(s) for s in done]}
        for masking in MASKINGS:
            ndcg_users = [ranking.ndcg_from_ranks(by_seed[s][masking], 10) for s in done]
            ndcg = np.array([u.mean() for u in ndcg_users])
            entry[masking] = {
                "ndcg@10": [float(x) for x in ndcg],
                "mean": float(ndcg.mean()),
                "se": float(ndcg.std(ddof=1) / np.sqrt(len(ndcg))) if len(ndcg) > 1 else None,
            }
            per_user[name, masking] = np.mean(ndcg_users, axis=0)
        if name in SASREC:
            offsets = [by_seed[s]["seen_offset"] for s in done]
            entry["seen_offset"] = (
                None
                if not any(offsets)
                else {"scale": [o["scale"] for o in offsets], "learned": [o["learned"] for o in offsets]}
            )
        variants[name] = entry
    pairs = []
    for a, b in PAIRS:
        for masking in MASKINGS:
            if (a, masking) in per_user and (b, masking) in per_user:
                boot = ranking.paired_bootstrap(per_user[a, masking], per_user[b, masking], rounds=rounds)
                pairs.append({"a": a, "b": b, "masking": masking, "ndcg@10_difference": boot})
    ranks = {"users": users, "runs": runs}
    return {"users": len(targets), "variants": variants, "paired": pairs, "target_ranks": ranks}


def repo_path(path: Path) -> str:
    """A config's path as the record names it: relative to the repository when it lies inside (the write-up reads
    the record in any clone), else as given."""
    path = Path(path).absolute()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _machine() -> dict:
    """Where the variants ran: the CPU description, and JAX's backend and device (a GPU run says so)."""
    import jax

    device = jax.devices()[0]
    return machine() | {"jax": jax.__version__, "backend": jax.default_backend(), "device": device.device_kind}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="a finished run.sh OUT (ml-100k, protocol ml100k)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="+", choices=[*FOUNDATION, *SASREC], default=None)
    ap.add_argument("--summarize", action="store_true", help="only write the record from the runs already done")
    ap.add_argument(
        "--keep-recorded",
        action="store_true",
        help="seeds the record at --json already holds count where their folders are not here (trained in "
        "another session or on another machine; the record must be of the same config, protocol and overrides)",
    )
    ap.add_argument("--config", type=Path, default=CONFIG, help="the foundation model's config (default: ML-100K's)")
    ap.add_argument("--protocol", default=None, help="the run's protocol (its history length and masking)")
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every foundation run and its evaluation (mesh.local=1 on one GPU)",
    )
    args = ap.parse_args(argv)
    out = Path(args.out).absolute()
    work = out / "fairness"
    work.mkdir(exist_ok=True)
    rows = json.loads((out / "store" / "ratings" / "_vocab" / "item_id.json").read_text())["size"] + 2
    offset_scale = load_config(str(args.config), args.override).model.foundation.seen_item_bias_scale
    for name in [] if args.summarize else args.only or [*FOUNDATION, *SASREC]:
        for seed in args.seeds:
            if (work / f"{name}_seed{seed}" / "topk_masked.parquet").exists():
                continue  # done in an earlier invocation
            print(f"{name} seed {seed}", flush=True)
            if name in FOUNDATION:
                config = args.config.absolute()
                train_foundation(out, work, name, seed, rows, config, args.protocol, tuple(args.override))
            else:
                train_sasrec(out, work, name, seed, offset_scale)
    made_with = {
        "config": repo_path(args.config),
        "config_sha256": hashlib.sha256(args.config.read_bytes()).hexdigest(),  # which version of the file
        "protocol": args.protocol,
        "overrides": args.override,
        "seen_item_bias_scale": offset_scale,  # the foundation model's, given to sasrec_seen_offset
    }
    kept = None
    if args.keep_recorded and Path(args.json).exists():
        kept = recorded_runs(json.loads(Path(args.json).read_text()), made_with, sorted(test_targets(out)))
    here = _machine()
    digest = config_digest(args.config, args.override)
    record = made_with | {"machine": here} | summarize(out, work, args.seeds, here, kept, digest=digest)
    atomic.write_json(args.json, record)
    print(json.dumps({k: {m: v[m]["mean"] for m in MASKINGS} for k, v in record["variants"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
