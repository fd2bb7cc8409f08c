"""The trainer's data path: ids checked on the host before dispatch (data.invalid_ids=error|count), Parquet
truncation counted, and a data source handed to the Trainer directly."""

import json
from pathlib import Path

import numpy as np
import pytest

import jaxscale
from jaxscale.training.config import load_config
from jaxscale.training.data import ParquetData, write_parquet_sample
from jaxscale.training.trainer import Trainer
from jaxscale_models.dlrm_data import SyntheticDLRMData
from jaxscale_models.foundation_data import SyntheticFoundationData

DLRM = [
    "model.kind=dlrm",
    "model.dlrm.num_sparse_features=2",
    "model.dlrm.rows=512",
    "model.dlrm.emb_dim=8",
    "model.dlrm.bottom_mlp=[8]",
    "model.dlrm.top_mlp=[8]",
    "model.dlrm.num_dense=4",
    "train.batch_size=32",
    "train.eval_every=0",
    "train.log_every=1",
    "train.warmup_steps=1",
    "data.eval_batches=0",
    "mesh.nodes=1",
    "mesh.local=8",
]


def _dlrm_parquet(tmp_path, bad_at=None):
    cfg = load_config(None, DLRM)
    data = SyntheticDLRMData(cfg.model.dlrm, 32, seed=3)
    path = write_parquet_sample(tmp_path / "clicks.parquet", data, 96, row_group_size=32)
    if bad_at is not None:  # rewrite one id out of range
        import pyarrow.parquet as pq

        table = pq.read_table(path).to_pydict()
        row, pos, value = bad_at
        table["sparse_1"][row][pos] = value
        import pyarrow as pa

        pq.write_table(pa.Table.from_pydict(table, schema=pq.read_schema(path)), path, row_group_size=32)
    return path


def _trainer(tmp_path, path, *overrides):
    cfg = load_config(None, DLRM + ["data.source=parquet", f"data.path={path}", *overrides])
    return Trainer(cfg, workdir=str(tmp_path / "run"), progress=False)


def test_invalid_id_error_names_feature_table_id_and_row_group(tmp_path):
    path = _dlrm_parquet(tmp_path, bad_at=(40, 0, 9999))  # row 40: row group 1, the batch of step 1
    tr = _trainer(tmp_path, path)
    tr.batch(0)  # a clean batch passes
    with pytest.raises(ValueError) as e:
        tr.batch(1)
    msg = str(e.value)
    for word in ("sparse_1", "table 'sparse_1'", "9999", "512 rows", str(path), "row groups [1]", "invalid_ids=count"):
        assert word in msg, (word, msg)
    # negative ids other than the padding id are out of range too
    path2 = _dlrm_parquet(tmp_path / "neg", bad_at=(3, 0, -5))
    with pytest.raises(ValueError, match="id -5"):
        _trainer(tmp_path / "neg", path2).batch(0)


def test_invalid_ids_count_pads_them_and_logs_the_count(tmp_path):
    bad = _dlrm_parquet(tmp_path / "bad", bad_at=(5, 0, 70000))
    tr = _trainer(tmp_path / "bad", bad, "data.invalid_ids=count")
    b = tr.batch(0)
    assert b.invalid_ids == 1
    counted = tr.run(steps=2)
    log = [json.loads(ln) for ln in (tmp_path / "bad" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["invalid_ids"] for m in log if "loss" in m] == [1.0, 0.0]
    # the same data with the bad id written as padding trains identically
    clean = _dlrm_parquet(tmp_path / "pad", bad_at=(5, 0, -1))
    padded = _trainer(tmp_path / "pad", clean).run(steps=2)
    assert counted["losses"] == padded["losses"]


def test_parquet_truncation_is_counted(tmp_path):
    cfg = load_config(None, ["model.foundation.max_seq_len=32", "train.batch_size=16"])
    path = write_parquet_sample(tmp_path / "seq.parquet", SyntheticFoundationData(cfg.model.foundation, 16), 32)
    short = ParquetData(path, ["item_ids", "mask"], batch_size=16, seq_len=6)
    full = ParquetData(path, ["item_ids"], batch_size=16, seq_len=32).batch(1)["item_ids"]
    lengths = (full >= 0).sum(1)
    p = short.provenance(1)
    assert p["truncated_sequences"] == int((lengths > 6).sum()) > 0
    assert p["truncated_events"] == int(np.maximum(lengths - 6, 0).sum())
    assert "row groups" in p["where"]
    tcfg = load_config(
        None,
        [
            "model.foundation.max_seq_len=6",
            "train.batch_size=16",
            "data.source=parquet",
            f"data.path={path}",
            "data.eval_batches=0",
            "train.eval_every=0",
        ],
    )
    tr = Trainer(tcfg, workdir=str(tmp_path / "run"), progress=False)
    assert tr.batch(1).info["truncated_sequences"] == p["truncated_sequences"]


def test_trainer_takes_its_data_source(tmp_path):
    cfg = load_config(None, DLRM)

    class Fixed:
        def __init__(self):
            self.calls = []

        def batch(self, step):
            self.calls.append(step)
            return SyntheticDLRMData(cfg.model.dlrm, 32, seed=9).batch(0)

    src = Fixed()
    tr = Trainer(cfg, jaxscale.make_mesh(1, 8), data=src, workdir=str(tmp_path), progress=False)
    assert tr.data is src
    tr.batch(4)
    assert src.calls == [4]
    assert Path(tmp_path).exists()


def test_topology_auto_follows_the_cluster_and_the_trainer_runs_the_scored_plan(tmp_path, capsys):
    """embedding.topology=auto: the planner's choice for the cluster's links and a data sample, made before the
    trainer is built. Over a slow inter-node link (1 Gbit/s) an all-to-all that crosses nodes (1d, 2d_ar)
    never wins: 2d_a2a does; the trainer then runs exactly the plan that was scored for it."""
    from jaxscale.engine import planner
    from jaxscale.training import registry
    from jaxscale.training.comm_report import comm_report
    from jaxscale.training.data import planning_sample
    from jaxscale.training.run import plan_run

    slow = tmp_path / "slow.yaml"
    slow.write_text(
        "nodes: 2\ndevices_per_node: 4\ndevice_memory_gb: 80\nintra_node_bandwidth_gbytes_per_s: 450\n"
        "inter_node_bandwidth_gbit_per_s: 1\nintra_node_latency_us: 3\ninter_node_latency_us: 10\nefficiency: 1.0\n"
    )
    base = [o for o in DLRM if not o.startswith("mesh.")] + ["mesh.nodes=2", "mesh.local=4"]
    cfg = load_config(None, base + ["embedding.topology=auto", f"mesh.cluster={slow}"])
    with pytest.raises(ValueError, match="chosen by the planner before the trainer is built"):
        Trainer(cfg, progress=False)
    resolved, plan = plan_run(cfg)
    assert "recommended" in capsys.readouterr().out
    assert resolved.embedding.topology == "2d_a2a" and plan.topology == "2d_a2a"
    tables = registry.get(cfg.model.kind).tables(cfg.model.params)
    choice = planner.choose_topology(cfg, tables, planning_sample(cfg))
    assert {c.topology for c in choice.candidates} == {"1d", "2d_ar", "2d_a2a"} and choice.plan == plan
    tr = Trainer(resolved, plan=plan, workdir=str(tmp_path / "run"), progress=False)
    assert tr.ec.topology.name == "2d_a2a" and tr.ec.plan == plan
    for t in tables:  # what the collection describes is the scored plan, table by table
        ts = plan.tables[t.name]
        assert f"table {t.name}: {t.rows}x{t.dim} {ts.sharding} shards={list(ts.shards)}" in tr.ec.describe()
    assert comm_report(cfg)["config"]["plan"] == plan.to_dict()  # the comm report measures the same plan
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(slow.read_text().replace("nodes: 2", "nodes: 4"))
    with pytest.raises(ValueError, match="describes a 4x4 cluster"):
        plan_run(load_config(None, base + ["embedding.topology=auto", f"mesh.cluster={wrong}"]))
