"""Approximate nearest-neighbour retrieval over item vectors (faiss): HNSW or IVF, and exact search beside it.

A retrieval model scores items by the inner product of an L2-normalised query and L2-normalised item vectors
(cosine). Exact search (`exact_search`: one matmul and a top-k over every item) is the reference and the right
choice for small corpora (``kind="flat"``); over a large corpus an HNSW graph or an IVF index answers in a
fraction of the time. How much it loses is measured when the index is built: recall@10 of the index against
exact search on a sample of queries, stored in the index's metadata, and a build below ``min_recall`` fails.

    index = AnnIndex.build(item_ids, vectors, kind="hnsw", queries=sample, provenance={...})
    index.save("INDEX")                      # atomic: a crash mid-save leaves the previous index served
    ids, scores = AnnIndex.load("INDEX").search(queries, k=10)

On disk (a directory):

    INDEX/index-<sha12>.faiss   # faiss.serialize_index of the index (item ids inside, IndexIDMap2)
    INDEX/index.json            # the metadata, written last: it names the faiss file and its sha256

`index.json` is the commit point. A save writes the new faiss file under a new name, then replaces
`index.json` atomically, then removes the old faiss file; a crash before the replace leaves the old
`index.json` naming the old, intact file. `load` refuses a directory without `index.json`, a faiss file whose
sha256 or size differs from the metadata, and an index whose item count or dimension differs from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from jaxscale.infra import atomic

FORMAT = "jaxscale.ann_index/1"
META_FILE = "index.json"
KINDS = ("flat", "hnsw", "ivf")
RECALL_K = 10
MAX_EF_SEARCH = 4096


class AnnIndexError(ValueError):
    """An index directory cannot be served: incomplete, half-written, mismatched or not an index."""


class AnnRecallError(ValueError):
    """A built index misses the recall target against exact search (raise `ef_search` / `nprobe`)."""


def _faiss():
    try:
        import faiss
    except ImportError as e:  # pragma: no cover - faiss-cpu is a dependency
        raise ImportError("jaxscale.serving.ann needs faiss-cpu (pip install faiss-cpu)") from e
    return faiss


def set_search_threads(threads: int) -> None:
    """faiss's OpenMP threads for searches made by the calling thread (OpenMP keeps the setting per thread).
    A server answering one query per request wants 1: spinning up a thread team per query costs more than the
    search (p99 of milliseconds on a busy host)."""
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    _faiss().omp_set_num_threads(threads)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnnParams:
    """How an index is built and searched. The defaults reach recall@10 >= 0.95 of exact search on the
    two-tower's vectors (and on random unit vectors of 32 dims, a harder case) with sub-millisecond queries."""

    kind: str = "hnsw"
    """'hnsw' (graph, no training), 'ivf' (inverted lists over k-means cells) or 'flat' (exact)."""
    hnsw_m: int = 32
    """HNSW: neighbours per node (memory and build time grow with it, so does recall)."""
    ef_construction: int = 100
    """HNSW: candidate list while building."""
    ef_search: int = 128
    """HNSW: candidate list while searching (>= k; recall and latency grow with it)."""
    nlist: int | None = None
    """IVF: k-means cells; None = 4 * sqrt(items), at most items / 39 (faiss's points per centroid)."""
    nprobe: int | None = None
    """IVF: cells searched per query; None = half of nlist (at least 8)."""
    min_recall: float = 0.95
    """A build whose recall@10 against exact search is below this fails (`AnnRecallError`); 0 = no check."""
    tune: bool = True
    """Below `min_recall`, double the search setting (`ef_search` up to `MAX_EF_SEARCH`, `nprobe` up to `nlist`)
    until the index reaches it; the setting found is the one saved. False: fail at once."""
    seed: int = 0
    """IVF's k-means and the query sample drawn when none is given."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("hnsw_m", "ef_construction", "ef_search"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("nlist", "nprobe"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not isinstance(self.tune, bool):
            raise ValueError(f"tune must be a bool, got {self.tune!r}")
        if not 0.0 <= float(self.min_recall) <= 1.0:
            raise ValueError(f"min_recall must be in [0, 1], got {self.min_recall!r}")

    def resolved(self, items: int) -> AnnParams:
        """The IVF sizes filled in for a corpus of `items`."""
        if self.kind != "ivf":
            return self
        nlist = self.nlist or max(1, min(int(4 * np.sqrt(items)), items // 39))
        if nlist > items:
            raise ValueError(f"nlist={nlist} is more cells than the {items} items")
        nprobe = self.nprobe or min(nlist, max(8, nlist // 2))
        return dataclasses.replace(self, nlist=nlist, nprobe=min(nprobe, nlist))

    def to_json(self) -> dict:
        keys = {"flat": (), "hnsw": ("hnsw_m", "ef_construction", "ef_search"), "ivf": ("nlist", "nprobe")}
        settings = {k: getattr(self, k) for k in keys[self.kind]}
        return {"kind": self.kind, **settings, "min_recall": self.min_recall, "tune": self.tune}

    def raised(self, items: int) -> AnnParams | None:
        """The next search setting to try while tuning (None: nothing left to raise)."""
        if self.kind == "hnsw" and self.ef_search < min(MAX_EF_SEARCH, items):
            return dataclasses.replace(self, ef_search=min(2 * self.ef_search, MAX_EF_SEARCH, items))
        if self.kind == "ivf" and self.nprobe < self.nlist:
            return dataclasses.replace(self, nprobe=min(2 * self.nprobe, self.nlist))
        return None


def normalize(vectors) -> np.ndarray:
    """Rows scaled to unit L2 norm (float32); zero rows are refused (they have no direction to rank by)."""
    v = np.asarray(vectors, np.float32)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    if v.size and not np.all(norms > 0):
        raise ValueError(f"vector row {int(np.flatnonzero(norms[:, 0] <= 0)[0])} is zero: it cannot be normalised")
    return np.ascontiguousarray(v / norms)


def _check_vectors(item_ids, vectors) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(item_ids)
    v = np.asarray(vectors)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"item_ids must be a 1-D integer array, got shape {ids.shape} dtype {ids.dtype}")
    if v.ndim != 2 or v.shape[0] != ids.shape[0]:
        raise ValueError(f"vectors must be [{ids.shape[0]}, dim] (one per item id), got shape {v.shape}")
    if ids.shape[0] == 0:
        raise ValueError("an index needs at least one item")
    if not np.all(np.isfinite(v)):
        raise ValueError(f"the vector of item {int(ids[np.argwhere(~np.isfinite(v))[0, 0]])} is not finite")
    ids = ids.astype(np.int64)
    if np.unique(ids).shape[0] != ids.shape[0]:
        raise ValueError("item_ids has duplicates: each item is indexed once")
    return ids, normalize(v)


def _check_queries(queries, dim: int) -> np.ndarray:
    q = np.ascontiguousarray(np.asarray(queries, np.float32))
    if q.ndim != 2 or q.shape[1] != dim:
        raise ValueError(f"queries must be [batch, {dim}], got shape {q.shape}")
    if not np.all(np.isfinite(q)):
        raise ValueError("queries must be finite")
    return q


def exact_search(queries, item_ids, vectors, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference: inner product of each query with EVERY item, top k (ties: the earlier item first).
    -> (item ids int64 [B, k], scores float32 [B, k]). `vectors` are used as given (normalise them first)."""
    from jaxscale.training.ranking import topk_from_scores

    ids = np.asarray(item_ids, np.int64)
    v = np.asarray(vectors, np.float32)
    q = _check_queries(queries, v.shape[1])
    if not isinstance(k, (int, np.integer)) or not 1 <= k <= ids.shape[0]:
        raise ValueError(f"k must be in [1, {ids.shape[0]}] (the corpus size), got {k!r}")
    scores = q @ v.T
    top = topk_from_scores(scores, int(k))
    return ids[top], np.take_along_axis(scores, top, axis=1).astype(np.float32)


def recall_vs_exact(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean over queries of |found ∩ exact| / k: the share of the exact top k the index returned."""
    found, exact = np.asarray(found), np.asarray(exact)
    if found.shape != exact.shape or found.ndim != 2:
        raise ValueError(f"found {found.shape} and exact {exact.shape} must be the same [queries, k]")
    hits = (found[:, :, None] == exact[:, None, :]).any(axis=2)
    return float(hits.mean())


def sample_queries(vectors: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Queries for the recall check when none are given: random items' vectors moved by Gaussian noise of the
    same norm (so a query is near, not on, an item), normalised."""
    rng = np.random.default_rng(seed)
    base = vectors[rng.integers(0, vectors.shape[0], n)]
    noise = rng.normal(size=base.shape).astype(np.float32)
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    return normalize(base + noise)


def _latency_ms(search, queries: np.ndarray, batch: int, rounds: int) -> dict:
    times = []
    for i in range(min(rounds, max(1, queries.shape[0] // batch))):
        q = queries[i * batch : (i + 1) * batch]
        t0 = time.perf_counter()
        search(q)
        times.append((time.perf_counter() - t0) * 1e3)
    t = np.asarray(times)
    return {
        "batch": batch,
        "batches": len(times),
        "median_ms": float(np.median(t)),
        "p99_ms": float(np.quantile(t, 0.99)),
    }


class AnnIndex:
    """An index over (item id, unit vector) pairs, searched by inner product; see the module docstring."""

    def __init__(self, index, meta: dict):
        self._index, self.meta = index, meta
        self.threads: int | None = None  # faiss threads per search (set in the searching thread); None = as is
        self.params = AnnParams(**meta["params"])

    @property
    def kind(self) -> str:
        return self.meta["params"]["kind"]

    @property
    def dim(self) -> int:
        return int(self.meta["dim"])

    def __len__(self) -> int:
        return int(self.meta["items"])

    # ------------------------------------------------------------------------------------------- building

    @staticmethod
    def _new_index(params: AnnParams, vectors: np.ndarray):
        faiss = _faiss()
        d = vectors.shape[1]
        if params.kind == "flat":
            base = faiss.IndexFlatIP(d)
        elif params.kind == "hnsw":
            base = faiss.IndexHNSWFlat(d, params.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            base.hnsw.efConstruction = params.ef_construction
        else:
            quantizer = faiss.IndexFlatIP(d)
            base = faiss.IndexIVFFlat(quantizer, d, params.nlist, faiss.METRIC_INNER_PRODUCT)
            base.cp.seed = params.seed
            base.cp.min_points_per_centroid = 1  # small corpora train too; nlist is sized for the corpus
            base.train(vectors)  # (faiss's Python wrapper keeps `quantizer` alive with `base`)
        return base

    @staticmethod
    def _apply_search_params(index, params: AnnParams) -> None:
        faiss = _faiss()
        inner = faiss.downcast_index(index.index)
        if params.kind == "hnsw":
            inner.hnsw.efSearch = params.ef_search
        elif params.kind == "ivf":
            inner.nprobe = params.nprobe

    @classmethod
    def build(
        cls,
        item_ids,
        vectors,
        *,
        kind: str | None = None,
        params: AnnParams | None = None,
        queries=None,
        query_source: str | None = None,
        recall_queries: int = 1000,
        latency_batch: int = 1,
        search_threads: int = 1,
        provenance: Mapping | None = None,
    ) -> AnnIndex:
        """Builds an index (`kind`, or every setting in `params`; default HNSW) over `item_ids` [N] and
        `vectors` [N, E] (normalised here), then measures recall@10 against exact search on `queries` (default:
        `sample_queries` of `recall_queries`) and the query latency of both (batches of `latency_batch` queries
        on `search_threads` faiss threads). `provenance`: JSON-able facts about where the vectors come from
        (the checkpoint directory and step, the model version), stored in the metadata. Raises
        `AnnRecallError` below `params.min_recall`."""
        if params is None:
            params = AnnParams(kind=kind or "hnsw")
        elif kind is not None and kind != params.kind:
            raise ValueError(f"kind={kind!r} and params.kind={params.kind!r} disagree")
        ids, v = _check_vectors(item_ids, vectors)
        params = params.resolved(ids.shape[0])
        faiss = _faiss()
        t0 = time.perf_counter()
        index = faiss.IndexIDMap2(cls._new_index(params, v))
        index.add_with_ids(v, ids)
        cls._apply_search_params(index, params)
        build_s = time.perf_counter() - t0
        if queries is None:
            q = sample_queries(v, recall_queries, params.seed)
            query_source = query_source or "sample: item vectors plus noise"
        else:
            q = _check_queries(queries, v.shape[1])
            query_source = query_source or "given"
        if q.shape[0] == 0:
            raise ValueError("the recall check needs at least one query")
        k = min(RECALL_K, ids.shape[0])
        meta = {
            "format": FORMAT,
            "metric": "inner_product",
            "normalized": True,
            "params": params.to_json(),
            "dim": int(v.shape[1]),
            "items": int(ids.shape[0]),
            "build_seconds": round(build_s, 3),
            "provenance": dict(provenance or {}),
        }
        built = cls(index, meta)
        exact, _ = exact_search(q, ids, v, k)
        recall = recall_vs_exact(built.search(q, k)[0], exact)
        tuning = []
        while recall < params.min_recall and params.tune and (more := params.raised(ids.shape[0])) is not None:
            tuning.append({**params.to_json(), f"recall@{k}": recall})
            params = more
            cls._apply_search_params(index, params)
            recall = recall_vs_exact(built.search(q, k)[0], exact)
        built.params, meta["params"] = params, params.to_json()
        meta["recall"] = {"k": k, "queries": int(q.shape[0]), "query_source": query_source, f"recall@{k}": recall}
        if tuning:
            meta["recall"]["tuning"] = tuning  # the settings tried before, and their recall
        threads = faiss.omp_get_max_threads()
        set_search_threads(search_threads)  # as a server searches (one query per request)
        try:
            meta["latency"] = {
                "search_threads": search_threads,
                "index": _latency_ms(lambda x: built.search(x, k), q, latency_batch, 200),
                "exact": _latency_ms(lambda x: exact_search(x, ids, v, k), q, latency_batch, 200),
            }
        finally:
            set_search_threads(threads)
        if recall < params.min_recall:
            raise AnnRecallError(
                f"{params.kind} index {params.to_json()}: recall@{k} against exact search is {recall:.4f} on "
                f"{q.shape[0]} queries, below min_recall={params.min_recall} (raise hnsw_m / ef_construction for "
                "hnsw, nlist for ivf, or use kind='flat')"
            )
        return built

    # ------------------------------------------------------------------------------------------- searching

    def search(self, queries, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(item ids int64 [B, k], inner-product scores float32 [B, k]), best first. A query for which the index
        reaches fewer than k items (an IVF probe of sparse cells, a short HNSW walk) has id -1 in the slots it could
        not fill (faiss's convention, at the end of the row): servers answer only the found ones
        (`jaxscale.serving.retrieval.RetrieveResult.found`)."""
        q = _check_queries(queries, self.dim)
        if not isinstance(k, (int, np.integer)) or not 1 <= k <= len(self):
            raise ValueError(f"k must be in [1, {len(self)}] (the indexed items), got {k!r}")
        if self.threads is not None:
            set_search_threads(self.threads)
        scores, ids = self._index.search(q, int(k))
        return ids.astype(np.int64), scores.astype(np.float32)

    def vectors(self) -> tuple[np.ndarray, np.ndarray]:
        """(item ids [N], the indexed unit vectors [N, E]): what exact search over this index's items reads."""
        ids = _faiss().vector_to_array(self._index.id_map).astype(np.int64)
        return ids, self._index.index.reconstruct_n(0, len(self))

    # ------------------------------------------------------------------------------------------- files

    def save(self, path) -> Path:
        """Writes the index into directory `path` (see the module docstring: a crash leaves the old one)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        data = _faiss().serialize_index(self._index).tobytes()
        digest = hashlib.sha256(data).hexdigest()
        name = f"index-{digest[:12]}.faiss"
        atomic.write_bytes(path / name, data)
        meta = {**self.meta, "index_file": name, "index_bytes": len(data), "index_sha256": digest}
        atomic.write_json(path / META_FILE, meta)  # the commit point
        self.meta = meta
        for stale in path.glob("index-*.faiss"):  # the replaced file, and any a crashed save left behind
            if stale.name != name:
                stale.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path, *, expect: Mapping | None = None) -> AnnIndex:
        """Opens a saved index, refusing an incomplete or mismatched one (`AnnIndexError` naming the problem).
        `expect`: provenance fields that must match (e.g. {"model_version": ...})."""
        path = Path(path)
        meta = _read_meta(path)
        file = path / meta["index_file"]
        try:
            data = file.read_bytes()
        except OSError as e:
            raise AnnIndexError(f"{path}: {meta['index_file']}, named by {META_FILE}, is unreadable: {e}") from None
        if len(data) != meta["index_bytes"] or hashlib.sha256(data).hexdigest() != meta["index_sha256"]:
            raise AnnIndexError(
                f"{file}: {len(data)} bytes whose sha256 differs from {META_FILE}'s ({meta['index_bytes']} bytes): "
                "a half-written or replaced index file; it is not served"
            )
        index = _faiss().deserialize_index(np.frombuffer(data, np.uint8))
        if index.ntotal != meta["items"] or index.d != meta["dim"]:
            raise AnnIndexError(
                f"{file}: holds {index.ntotal} vectors of dim {index.d}, {META_FILE} says {meta['items']} of "
                f"dim {meta['dim']}"
            )
        for key, want in (expect or {}).items():
            got = meta["provenance"].get(key)
            if got != want:
                raise AnnIndexError(f"{path}: index built for {key}={got!r}, expected {want!r}")
        out = cls(index, meta)
        cls._apply_search_params(index, out.params)
        return out


_META_KEYS = ("format", "params", "dim", "items", "recall", "provenance", "index_file", "index_bytes", "index_sha256")


def _read_meta(path: Path) -> dict:
    meta_path = path / META_FILE
    if not path.is_dir():
        raise AnnIndexError(f"{path}: no such index directory")
    try:
        meta = json.loads(meta_path.read_bytes())
    except FileNotFoundError:
        raise AnnIndexError(f"{path}: no {META_FILE}: not an index, or its first save did not finish") from None
    except (OSError, ValueError) as e:
        raise AnnIndexError(f"{meta_path}: unreadable index metadata: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise AnnIndexError(f"{meta_path}: format {fmt!r}, expected {FORMAT!r}")
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise AnnIndexError(f"{meta_path}: missing field(s) {missing}")
    name = meta["index_file"]
    if not isinstance(name, str) or "/" in name or not name.startswith("index-"):
        raise AnnIndexError(f"{meta_path}: field 'index_file' is {name!r}, expected index-<sha>.faiss")
    return meta
