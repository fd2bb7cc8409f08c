"""The freshness pipeline's input files are written whole (jaxscale.serving.freshness.write_inputs)."""

import os

import pyarrow.parquet as pq
import pytest

from jaxscale.infra import atomic
from jaxscale.serving import freshness


def test_inputs_go_through_a_temporary_file_and_a_rename(tmp_path, monkeypatch):
    renames = []
    real = os.replace

    def recording(src, dst):
        renames.append((os.path.basename(src), os.path.basename(dst)))
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", recording)
    freshness.write_inputs(tmp_path, item_rows=10, num_categories=3)
    assert [dst for _, dst in renames] == ["defs.json", "items.parquet"]
    assert all(src.startswith(f".{dst}.") and src.endswith(".tmp") for src, dst in renames)
    assert pq.read_table(tmp_path / "items.parquet").column("category").to_pylist() == [i % 3 for i in range(10)]
    assert sorted(os.listdir(tmp_path)) == ["defs.json", "items.parquet"]  # no temporary file left


def test_a_writer_dying_mid_write_leaves_the_old_files_whole(tmp_path, monkeypatch):
    freshness.write_inputs(tmp_path, item_rows=10, num_categories=3)
    before = {p: (tmp_path / p).read_bytes() for p in ("defs.json", "items.parquet")}

    def dies(src, dst):  # the process is killed after writing the new bytes, before the rename
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(atomic.os, "replace", dies)
    with pytest.raises(KeyboardInterrupt):
        freshness.write_inputs(tmp_path, item_rows=20, num_categories=5)
    assert {p: (tmp_path / p).read_bytes() for p in before} == before  # the reader sees the old file, whole
    assert sorted(os.listdir(tmp_path)) == ["defs.json", "items.parquet"]
