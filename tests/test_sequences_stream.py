"""Stream == backfill: any micro-batch size, late and out-of-order events (hypothesis property)."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sequences_helpers import make_defs, random_log

from jaxscale.sequences.query import SequenceReader
from jaxscale.sequences.runtime import backfill, stream
from jaxscale.sequences.store import list_partitions, partition_files, read_sequence


def _same_answers(a, b, users, times):
    """Every query (user x as_of x limit) answered identically by two stores."""
    for name in ("s1", "s2"):
        ra, rb = SequenceReader(a, name), SequenceReader(b, name)
        for u in users:
            for t in [None, *times]:
                for limit in (None, 1, 2):
                    assert ra.events(u, t, limit) == rb.events(u, t, limit), (name, u, t, limit)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    micro_batch=st.one_of(st.integers(1, 7), st.integers(8, 400)),
    late=st.sampled_from([0.0, 0.2, 0.6]),
)
def test_stream_equals_backfill(tmp_path_factory, seed, micro_batch, late):
    tmp = tmp_path_factory.mktemp("s")
    raw, items = random_log(seed, tmp, files=2, rows=60 if micro_batch < 8 else 200, users=6, days=3, late=late)
    defs = make_defs()
    backfill(defs, tmp / "events", tmp / "b", sources={"items": items})
    report = stream(defs, tmp / "events", tmp / "s", sources={"items": items}, micro_batch=micro_batch, max_files=3)
    for name in ("s1", "s2"):
        assert read_sequence(tmp / "s", name).equals(read_sequence(tmp / "b", name))
        for part in list_partitions(tmp / "s" / name).values():
            assert len(partition_files(part)) == 1  # merged at the end
    assert report.extra["micro_batches"] == -(-len(raw) // micro_batch)
    users = sorted({int(u) for u in raw.user_id.dropna()})
    ts = raw.ts.dropna().map(lambda v: int(float(v)) if str(v).lstrip("-").replace(".", "").isdigit() else None)
    times = sorted(set(np.random.default_rng(seed).choice(ts.dropna().astype(np.int64), 6)))
    _same_answers(tmp / "s", tmp / "b", users, [int(t) for t in times] + [int(t) + 1 for t in times])


def test_stream_is_visible_while_it_runs(tmp_path):
    """After each micro-batch the store answers for exactly the events that have arrived so far."""
    raw, items = random_log(21, tmp_path, files=2, rows=120, users=4, days=2, late=0.3, bad=False)
    defs = make_defs()
    seen = []

    def check(i, report):
        reader = SequenceReader(tmp_path / "s", "s1")
        seen.append((report.totals().rows, reader.num_events))

    stream(defs, tmp_path / "events", tmp_path / "s", sources={"items": items}, micro_batch=50, on_commit=check)
    raw_types = raw.event_type.isin(["a", "a2", "b"]).to_numpy()
    for rows, events in seen:
        assert events == int(raw_types[:rows].sum())


def test_file_replay_rerun_adds_nothing(tmp_path):
    """Re-running a replay into the store it filled (a restart after a crash) stores no event twice."""
    raw, items = random_log(4, tmp_path, files=2, rows=150, days=2, late=0.3)
    defs = make_defs()
    backfill(defs, tmp_path / "events", tmp_path / "b", sources={"items": items})
    stream(defs, tmp_path / "events", tmp_path / "s", sources={"items": items}, micro_batch=40)
    again = stream(defs, tmp_path / "events", tmp_path / "s", sources={"items": items}, micro_batch=40)
    assert again.extra["commits"]["events"] == 0
    assert again.extra["commits"]["duplicates"] == sum(again.totals().indexed.values()) > 0
    for name in ("s1", "s2"):
        assert read_sequence(tmp_path / "s", name).equals(read_sequence(tmp_path / "b", name))
