"""The Ray Data backfill (local mode) writes exactly what the embedded engine writes."""

import pytest
from test_sequences_helpers import make_defs, random_log

from jaxscale.sequences.runtime import backfill
from jaxscale.sequences.store import list_partitions

ray = pytest.importorskip("ray", reason="ray[data] is a test dependency (pip install -e '.[test]')")


def test_ray_backfill_equals_embedded(tmp_path):
    from jaxscale.sequences.distributed import backfill_ray

    defs = make_defs()
    random_log(51, tmp_path, files=3, rows=200, days=3, late=0.3, row_group_size=50)
    items = {"items": tmp_path / "items.parquet"}
    embedded = backfill(defs, tmp_path / "events", tmp_path / "a", sources=items)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        distributed = backfill_ray(defs, tmp_path / "events", tmp_path / "b", sources=items)
    finally:
        ray.shutdown()
    for s in defs.sequences:
        a, b = list_partitions(tmp_path / "a" / s.name), list_partitions(tmp_path / "b" / s.name)
        assert a.keys() == b.keys() and a
        for day in a:
            files_a, files_b = sorted(a[day].glob("*.parquet")), sorted(b[day].glob("*.parquet"))
            assert [f.read_bytes() for f in files_a] == [f.read_bytes() for f in files_b], (s.name, day)
    assert embedded.totals().to_json() == distributed.totals().to_json()
    assert embedded.partitions == distributed.partitions
    assert {k: v.to_json() for k, v in embedded.files.items()} == {k: v.to_json() for k, v in distributed.files.items()}
