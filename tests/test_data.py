"""Synthetic data (determinism, process slices, Zipf skew, padding), to_global, and the Parquet reader."""

import time

import jax
import numpy as np
import pyarrow.parquet as pq
import pytest

from jaxscale.training.data import (
    ParquetData,
    ZipfSampler,
    to_global,
    uniform,
    write_parquet_sample,
)
from jaxscale_models.dlrm import DLRMConfig
from jaxscale_models.dlrm_data import SyntheticDLRMData
from jaxscale_models.foundation import FoundationConfig
from jaxscale_models.foundation_data import SyntheticFoundationData

FCFG = FoundationConfig(item_rows=20_000, max_seq_len=24)
DCFG = DLRMConfig(num_sparse_features=3, rows=(100, 1000, 10_000), ids_per_feature=(1, 3, 5))


def equal(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "make",
    [lambda: SyntheticFoundationData(FCFG, 16, seed=1), lambda: SyntheticDLRMData(DCFG, 16, seed=1)],
    ids=["foundation", "dlrm"],
)
def test_deterministic_and_process_slices(make):
    data = make()
    assert equal(data.batch(3), make().batch(3))
    assert not equal(data.batch(3), data.batch(4))
    assert not equal(data.batch(3), data.held_out().batch(3))
    other = (
        SyntheticFoundationData(FCFG, 16, seed=2)
        if isinstance(data, SyntheticFoundationData)
        else SyntheticDLRMData(DCFG, 16, seed=2)
    )
    assert not equal(data.batch(3), other.batch(3))
    full = data.batch(5)
    for count in (2, 4):
        parts = [data.batch(5, p, count) for p in range(count)]
        assert all(len(next(iter(p.values()))) == 16 // count for p in parts)
        assert equal({k: np.concatenate([p[k] for p in parts]) for k in full}, full)
    with pytest.raises(ValueError, match="divisible"):
        data.batch(0, 0, 3)


def test_zipf_sampler_is_bounded_skewed_and_fast():
    t = time.perf_counter()
    z = ZipfSampler(100_000_000, 1.1)
    k = z(uniform(0, np.arange(400_000)))
    assert time.perf_counter() - t < 2.0
    assert k.min() >= 0 and k.max() < 100_000_000
    counts = np.bincount(k[k < 8], minlength=8) / k.size
    np.testing.assert_allclose(counts, z.pmf(np.arange(8)), rtol=0.05)  # the exact head
    tail = np.mean((k >= 1_000_000) & (k < 10_000_000))
    ref = np.sum(z.pmf(np.arange(1_000_000, 10_000_000, dtype=np.float64)))
    np.testing.assert_allclose(tail, ref, rtol=0.05)  # the continuous tail
    assert ZipfSampler(1000, 0.0)(uniform(1, np.arange(50_000))).std() > 250  # exponent 0 is uniform


def test_foundation_data_padding_and_signal():
    data = SyntheticFoundationData(FCFG, 64, seed=0, num_clusters=16)
    b = data.batch(0)
    L = FCFG.max_seq_len
    assert {k: v.shape for k, v in b.items()} == {k: (64, L) for k in b}
    assert b["item_ids"].dtype == np.int32 and b["mask"].dtype == bool and b["engaged"].dtype == np.float32
    mask = b["mask"]
    np.testing.assert_array_equal(mask, b["item_ids"] >= 0)
    assert np.all(mask[:, :-1] >= mask[:, 1:])  # right-padded
    lengths = mask.sum(1)
    assert lengths.min() >= 2 and lengths.max() <= L and len(np.unique(lengths)) > 5
    for k in ("item_ids", "timestamps", "actions", "surfaces"):
        assert np.all(b[k][~mask] == -1) and np.all(b[k][mask] >= 0)
    assert np.all(b["engaged"][~mask] == 0)
    assert np.all(np.diff(b["timestamps"], axis=1)[mask[:, 1:]] >= 0)  # chronological
    np.testing.assert_array_equal(b["actions"][mask] > 0, b["engaged"][mask] > 0)
    assert b["item_ids"].max() < FCFG.item_rows and b["surfaces"].max() < FCFG.num_surfaces
    # the hidden signal: consecutive items mostly share a cluster (id % clusters without scrambling)
    c = b["item_ids"] % 16
    same = (c[:, 1:] == c[:, :-1])[mask[:, 1:]]
    assert same.mean() > 0.6
    # Zipf skew: the hottest 1% of ids carry a large share of events
    ids = np.concatenate([data.batch(s)["item_ids"] for s in range(10)])
    counts = np.sort(np.bincount(ids[ids >= 0]))[::-1]
    assert counts[: FCFG.item_rows // 100].sum() / counts.sum() > 0.25
    scrambled = SyntheticFoundationData(FCFG, 64, seed=0, scramble=True).batch(0)["item_ids"]
    assert scrambled[mask].max() < FCFG.item_rows and not np.array_equal(scrambled, b["item_ids"])


def test_dlrm_data():
    b = SyntheticDLRMData(DCFG, 256, seed=0).batch(0)
    assert b["dense"].shape == (256, 13) and b["dense"].dtype == np.float32 and b["dense"].min() >= 0
    for i, (rows, hot) in enumerate(zip(DCFG.rows, DCFG.ids_per_feature)):
        x = b[f"sparse_{i}"]
        assert x.shape == (256, hot) and x.dtype == np.int32 and x.max() < rows
        valid = x >= 0
        assert valid[:, 0].all() and np.all(valid[:, :-1] >= valid[:, 1:])
    assert 0.2 < b["label"].mean() < 0.8 and set(np.unique(b["label"])) == {0.0, 1.0}


def test_to_global(mesh):
    local = SyntheticFoundationData(FCFG, 16, seed=0).batch(0)
    g = to_global(local, mesh)
    for k, v in local.items():
        assert g[k].shape == v.shape
        assert g[k].sharding.spec == jax.sharding.PartitionSpec(("node", "local"))
        assert len(g[k].addressable_shards) == 8 and g[k].addressable_shards[0].data.shape[0] == 2
        np.testing.assert_array_equal(np.asarray(g[k]), v)
    with pytest.raises(ValueError, match="divisible"):
        to_global({"x": np.zeros((12, 2))}, mesh)


class _Recorder:
    """Wraps a ParquetFile to record which row groups and columns are read."""

    def __init__(self, f):
        self.f, self.calls = f, []

    def read_row_group(self, i, columns=None):
        self.calls.append((i, tuple(columns)))
        return self.f.read_row_group(i, columns=columns)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_parquet_foundation_round_trip(tmp_path):
    data = SyntheticFoundationData(FCFG, 16, seed=0)
    path = write_parquet_sample(tmp_path / "f.parquet", data, 100, row_group_size=16)
    meta = pq.ParquetFile(path).metadata
    assert meta.num_rows == 100 and meta.num_row_groups == 7
    assert "mask" not in pq.ParquetFile(path).schema_arrow.names
    expect = {k: np.concatenate([data.batch(s)[k] for s in range(7)])[:100] for k in data.columns}
    L = FCFG.max_seq_len

    reader = ParquetData(path, ["item_ids", "engaged", "mask"], batch_size=16, seq_len=L)
    reader.file = _Recorder(reader.file)
    b = reader.batch(0)
    assert set(b) == {"item_ids", "engaged", "mask"}
    assert {c for _, cols in reader.file.calls for c in cols} == {"item_ids", "engaged"}
    for k in b:
        np.testing.assert_array_equal(b[k], expect[k][:16])
    wrapped = reader.batch(6)  # rows 96..111 wrap to 96..99, 0..11
    np.testing.assert_array_equal(wrapped["item_ids"], expect["item_ids"][np.r_[96:100, 0:12]])
    assert len(reader) == 6 and sum(1 for _ in reader) == 6

    # process 1 of 3 reads row groups 1 and 4 only (rows 16..31 and 64..79)
    p1 = ParquetData(path, ["item_ids", "timestamps"], batch_size=8, seq_len=L, process_index=1, process_count=3)
    p1.file = _Recorder(p1.file)
    assert p1.row_groups == [1, 4] and p1.num_rows == 32
    got = np.concatenate([p1.batch(s)["timestamps"] for s in range(4)])
    np.testing.assert_array_equal(got, expect["timestamps"][np.r_[16:32, 64:80]])
    assert {i for i, _ in p1.file.calls} == {1, 4}

    # truncation keeps the most recent events, right-padded
    short = ParquetData(path, ["item_ids"], batch_size=16, seq_len=4).batch(0)["item_ids"]
    for row, full in zip(short, expect["item_ids"][:16]):
        np.testing.assert_array_equal(row, full[full >= 0][-4:])
    with pytest.raises(ValueError, match="not in"):
        ParquetData(path, ["nope"], batch_size=4, seq_len=L)


def test_parquet_dlrm_round_trip(tmp_path):
    data = SyntheticDLRMData(DCFG, 32, seed=4)
    path = write_parquet_sample(tmp_path / "d.parquet", data, 64, row_group_size=32)
    expect = data.batch(0)
    keys = ["dense", "label", "sparse_0", "sparse_1", "sparse_2"]
    b = ParquetData(path, keys, batch_size=32, seq_len={"sparse_0": 1, "sparse_1": 3, "sparse_2": 5}).batch(0)
    for k in keys:
        assert b[k].dtype == expect[k].dtype
        np.testing.assert_array_equal(b[k], expect[k])


def test_make_data_follows_the_config(tmp_path):
    from jaxscale.training.config import load_config
    from jaxscale.training.data import make_data

    cfg = load_config(None, ["train.batch_size=16", "model.foundation.max_seq_len=8"])
    src = make_data(cfg, process_index=1, process_count=2)
    direct = SyntheticFoundationData(cfg.model.foundation, 16, seed=0).batch(2, 1, 2)
    assert equal(src.batch(2), direct)
    assert not equal(make_data(cfg, split="eval", process_index=1, process_count=2).batch(2), direct)
    path = write_parquet_sample(
        tmp_path / "t.parquet", SyntheticFoundationData(cfg.model.foundation, 16), 64, row_group_size=16
    )
    pcfg = load_config(
        None, ["train.batch_size=16", "model.foundation.max_seq_len=8", "data.source=parquet", f"data.path={path}"]
    )
    reader = make_data(pcfg, process_index=1, process_count=2)
    assert reader.row_groups == [1, 3] and reader.batch_size == 8
    assert set(reader.batch(0)) == set(direct) and make_data(pcfg, split="eval") is None
