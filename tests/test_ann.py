"""The ANN index (jaxscale.serving.ann): recall against brute force, the build-time recall check that a bad
configuration fails, and saves that a crash cannot half-write (a killed save leaves the previous index)."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxscale.serving.ann import (
    META_FILE,
    AnnIndex,
    AnnIndexError,
    AnnParams,
    AnnRecallError,
    exact_search,
    recall_vs_exact,
)

N, D = 2000, 16


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng(0)
    ids = rng.permutation(10 * N)[:N].astype(np.int64) + 100  # sparse, unordered ids: positions are not ids
    vectors = rng.normal(size=(N, D)).astype(np.float32)
    queries = rng.normal(size=(300, D)).astype(np.float32)
    return ids, vectors, queries


def brute_force(queries, ids, vectors, k):
    """Independent of the library: normalise, score every item, sort (stable: earlier item first on ties)."""
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    order = np.argsort(-(queries @ unit.T), axis=1, kind="stable")[:, :k]
    return ids[order]


def test_exact_search_is_brute_force(corpus):
    ids, vectors, queries = corpus
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    found, scores = exact_search(queries, ids, unit, 10)
    np.testing.assert_array_equal(found, brute_force(queries, ids, vectors, 10))
    assert np.all(np.diff(scores, axis=1) <= 0)


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_index_recall_against_brute_force(corpus, kind):
    ids, vectors, queries = corpus
    index = AnnIndex.build(ids, vectors, kind=kind, queries=queries)
    found, scores = index.search(queries, 10)
    want = brute_force(queries, ids, vectors, 10)
    recall = recall_vs_exact(found, want)
    assert recall >= 0.95, (kind, recall)
    assert index.meta["recall"]["recall@10"] == pytest.approx(recall)  # the stored figure is this measurement
    assert index.meta["recall"]["queries"] == 300 and index.meta["recall"]["query_source"] == "given"
    if kind == "flat":
        np.testing.assert_array_equal(found, want)
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    pos = {int(i): p for p, i in enumerate(ids)}
    rows = np.vectorize(pos.__getitem__)(found)  # the scores are inner products with the normalised items
    np.testing.assert_allclose(scores, np.einsum("bd,bkd->bk", queries, unit[rows]), rtol=1e-4, atol=1e-5)
    lat = index.meta["latency"]
    assert lat["index"]["batches"] > 0 and lat["index"]["p99_ms"] >= lat["index"]["median_ms"] > 0


def test_a_bad_configuration_fails_the_recall_check(corpus):
    ids, vectors, queries = corpus
    bad = AnnParams(kind="hnsw", hnsw_m=2, ef_construction=4, ef_search=1, tune=False)
    with pytest.raises(AnnRecallError, match=r"recall@10 against exact search is 0\.\d+ .* below min_recall=0\.95"):
        AnnIndex.build(ids, vectors, params=bad, queries=queries)
    # the same build without the check: its recall really is low, measured against brute force
    index = AnnIndex.build(ids, vectors, params=AnnParams(**{**bad.to_json(), "min_recall": 0.0}), queries=queries)
    low = recall_vs_exact(index.search(queries, 10)[0], brute_force(queries, ids, vectors, 10))
    assert low < 0.95 and index.meta["recall"]["recall@10"] == pytest.approx(low)
    with pytest.raises(AnnRecallError, match="ivf"):
        AnnIndex.build(ids, vectors, params=AnnParams(kind="ivf", nlist=40, nprobe=1, tune=False), queries=queries)


@pytest.mark.parametrize("kind, start", [("hnsw", {"ef_search": 10}), ("ivf", {"nlist": 40, "nprobe": 1})])
def test_tuning_raises_the_search_setting_until_the_target(corpus, kind, start):
    ids, vectors, queries = corpus
    index = AnnIndex.build(ids, vectors, params=AnnParams(kind=kind, **start), queries=queries)
    tried = index.meta["recall"]["tuning"]
    assert tried[0] == {**AnnParams(kind=kind, **start).to_json(), "recall@10": tried[0]["recall@10"]}
    assert all(t["recall@10"] < 0.95 for t in tried) and index.meta["recall"]["recall@10"] >= 0.95
    name = next(iter(start.keys() - {"nlist"}))
    assert index.meta["params"][name] == getattr(index.params, name) > start[name]  # the setting saved
    recall = recall_vs_exact(index.search(queries, 10)[0], brute_force(queries, ids, vectors, 10))
    assert recall == pytest.approx(index.meta["recall"]["recall@10"])


def test_save_load_round_trip_and_provenance(corpus, tmp_path):
    ids, vectors, queries = corpus
    index = AnnIndex.build(ids, vectors, kind="hnsw", queries=queries, provenance={"model_version": "run/step-7"})
    index.save(tmp_path / "idx")
    loaded = AnnIndex.load(tmp_path / "idx", expect={"model_version": "run/step-7"})
    for a, b in zip(index.search(queries, 10), loaded.search(queries, 10)):
        np.testing.assert_array_equal(a, b)
    assert loaded.params.ef_search == AnnParams().ef_search  # search settings travel with the index
    meta = json.loads((tmp_path / "idx" / META_FILE).read_text())
    assert meta["provenance"] == {"model_version": "run/step-7"} and meta["params"]["kind"] == "hnsw"
    with pytest.raises(AnnIndexError, match="model_version='run/step-7', expected 'run/step-8'"):
        AnnIndex.load(tmp_path / "idx", expect={"model_version": "run/step-8"})
    loaded_ids, loaded_vectors = loaded.vectors()
    np.testing.assert_array_equal(loaded_ids, ids)
    np.testing.assert_allclose(np.linalg.norm(loaded_vectors, axis=1), 1.0, atol=1e-5)


def test_load_refuses_incomplete_or_mismatched_indexes(corpus, tmp_path):
    ids, vectors, queries = corpus
    small = AnnIndex.build(ids[:200], vectors[:200], kind="flat", queries=queries[:20])
    with pytest.raises(AnnIndexError, match="no such index directory"):
        AnnIndex.load(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AnnIndexError, match="no index.json"):
        AnnIndex.load(tmp_path / "empty")
    path = small.save(tmp_path / "idx")
    faiss_file = path / json.loads((path / META_FILE).read_text())["index_file"]
    data = faiss_file.read_bytes()
    faiss_file.write_bytes(data[: len(data) // 2])  # a torn write
    with pytest.raises(AnnIndexError, match="half-written or replaced"):
        AnnIndex.load(path)
    faiss_file.unlink()
    with pytest.raises(AnnIndexError, match="unreadable"):
        AnnIndex.load(path)
    (path / META_FILE).write_text('{"format": "something/else"}')
    with pytest.raises(AnnIndexError, match="format 'something/else'"):
        AnnIndex.load(path)


KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from jaxscale.infra import atomic
    from jaxscale.serving.ann import AnnIndex

    path = sys.argv[1]
    rng = np.random.default_rng(1)
    new = AnnIndex.build(np.arange(500), rng.normal(size=(500, 8)).astype(np.float32), kind="flat")
    def die(*args, **kwargs):  # the faiss file is written; the process dies before the metadata is replaced
        os.kill(os.getpid(), signal.SIGKILL)
    atomic.write_json = die
    new.save(path)
    """
)


def test_a_save_killed_midway_leaves_the_previous_index(tmp_path):
    rng = np.random.default_rng(2)
    old = AnnIndex.build(np.arange(300) + 10_000, rng.normal(size=(300, 8)).astype(np.float32), kind="flat")
    path = old.save(tmp_path / "idx")
    queries = rng.normal(size=(5, 8)).astype(np.float32)
    before = old.search(queries, 10)
    proc = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert len(list(path.glob("index-*.faiss"))) == 2  # the dead save's file is there, but not committed
    served = AnnIndex.load(path)
    assert len(served) == 300
    for a, b in zip(before, served.search(queries, 10)):
        np.testing.assert_array_equal(a, b)
    old.save(path)  # the next save removes the orphan
    assert len(list(path.glob("index-*.faiss"))) == 1


def test_bad_inputs_are_named(corpus):
    ids, vectors, _ = corpus
    with pytest.raises(ValueError, match="duplicates"):
        AnnIndex.build(np.zeros(N, np.int64), vectors, kind="flat")
    with pytest.raises(ValueError, match=r"vectors must be \[2000, dim\]"):
        AnnIndex.build(ids, vectors[:-1], kind="flat")
    with pytest.raises(ValueError, match="kind must be one of"):
        AnnIndex.build(ids, vectors, kind="lsh")
    with pytest.raises(ValueError, match="is zero"):
        AnnIndex.build(ids[:3], np.zeros((3, D), np.float32), kind="flat")
    index = AnnIndex.build(ids[:50], vectors[:50], kind="flat", recall_queries=10)
    with pytest.raises(ValueError, match=r"queries must be \[batch, 16\]"):
        index.search(np.zeros((2, 8), np.float32), 3)
    with pytest.raises(ValueError, match=r"k must be in \[1, 50\]"):
        index.search(np.zeros((2, D), np.float32), 51)
