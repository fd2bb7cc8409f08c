"""Retrieval served: the query side of a two-tower exported as a model version, its ANN index beside it, and
the request path ``user_id + context -> state lookup -> online step -> ANN -> top-K item ids``.

A retrieval model version is an ordinary version of the model store (`jaxscale.serving.store`), so signatures,
the root's trimming and the leaf's request checks work as for every model, plus two things in its directory:

    <store>/<model>/<version>/index/            the ANN index (`jaxscale.serving.ann`), item ids inside
    <store>/<model>/<version>/retrieval.json    manifest: the state feature and key, the output, the index's
                                                sha256, the checkpoint and model version they come from
    <store>/<model>/<version>/model.jaxexport   the online query step (jax.export), written after both
    <store>/<model>/<version>/signature.json    written last: a version with a signature is complete

The exported function reads ``encoder_state`` (``STATE_FEATURE``: filled by the leaf from a state store, by
the request's ``user_id``, ``STATE_KEY``) and the context features, and returns ``{"query": [batch, E]}``; its
signature lists exactly the features it reads (export refuses a declared feature it does not read). A retrieve
request therefore carries ``user_id`` and the signature's features other than the state (`request_signature`).

`RetrievalModel` loads a version, refusing one whose manifest, index or artifact is missing or does not match
(a half-written index is never served); `retrieve(reader, columns, k)` answers a batch of requests with the
time of each stage. `RetrieveEndpoint` is the leaf's ``POST /v1/models/{name}:retrieve``.

    python -m jaxscale.serving build-index --checkpoint DIR --out INDEX [--config C] [--kind hnsw|ivf|flat]
    python -m jaxscale.serving export-retrieval --checkpoint DIR --index INDEX --store STORE --model NAME \\
        --version V [--config C]

This module imports JAX only to export and to run the step (the root uses its request helpers without JAX).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from jaxscale.infra import atomic
from jaxscale.serving import store as store_lib
from jaxscale.serving import wire
from jaxscale.serving.ann import AnnIndex, AnnIndexError, AnnParams
from jaxscale.serving.signature import FeatureError, FeatureSpec, Signature, SignatureError

STATE_FEATURE = "encoder_state"
STATE_KEY = "user_id"
QUERY_OUTPUT = "query"
MANIFEST = "retrieval.json"
MANIFEST_FORMAT = "jaxscale.retrieval/1"
INDEX_DIR = "index"
DEFAULT_K = 10
MAX_K = 1000
TIMINGS_HEADER = "X-Jaxscale-Timings"


class RetrievalError(ValueError):
    """A retrieval model version cannot be served (missing or mismatched manifest, index or artifact)."""


@dataclasses.dataclass(frozen=True)
class RetrievalParts:
    """What serving retrieval needs from a trained model (what `parts_function` returns): every item's id and
    vector (for the index), the online query step (``query_fn(features) -> {"query": [B, E]}``) and the
    `FeatureSpec`s it reads (``STATE_FEATURE`` among them), and optionally real query vectors for the index's
    recall check."""

    item_ids: np.ndarray
    item_vectors: np.ndarray
    query_fn: Callable
    features: tuple[FeatureSpec, ...]
    queries: np.ndarray | None = None
    query_source: str | None = None


def model_version(checkpoint, step: int) -> str:
    """The name of a trained model's version, shared by its index, its exported step and its state store
    (`jaxscale.serving.states` names states the same way): ``<run dir name>/step-<step>``."""
    return f"{Path(checkpoint).resolve().name}/step-{int(step)}"


def request_signature(signature: Signature) -> Signature:
    """What a retrieve request carries: ``user_id`` (int64) and the model's features other than the state."""
    if STATE_FEATURE not in signature.feature_names:
        raise SignatureError(f"model {signature.label}: a retrieval model reads {STATE_FEATURE!r}; it does not")
    features = (FeatureSpec(STATE_KEY, "int64"), *(f for f in signature.features if f.name != STATE_FEATURE))
    unused = tuple(n for n in signature.unused if n != STATE_FEATURE)
    return Signature(signature.model, signature.version, features, unused=unused)


def request_features(signature: Signature | None) -> tuple[str, ...] | None:
    """The feature names the root sends a retrieval leaf (None = everything: the signature is unavailable)."""
    return None if signature is None else request_signature(signature).required


# ---------------------------------------------------------------------------------------------------- export


def export_retrieval(
    parts: RetrievalParts,
    index: AnnIndex,
    *,
    store,
    model: str,
    version: str,
    provenance: Mapping | None = None,
    platforms: Sequence[str] | None = None,
    overwrite: bool = False,
) -> Signature:
    """Writes a retrieval model version: the index, the manifest, then the exported query step and its signature
    (last). Refuses features the step does not read, an index whose dimension differs from the query's, and an
    index built from another model version than ``provenance`` names (the check the CLI makes: the index's
    vectors and the query step must come from one trained model, or the answers are wrong, not errors)."""
    from jaxscale.serving.export import export_model

    names = [f.name for f in parts.features]
    if STATE_FEATURE not in names or STATE_KEY in names:
        raise ValueError(f"the query step must read {STATE_FEATURE!r} and no feature named {STATE_KEY!r}: {names}")
    sig_path = store_lib.signature_path(store, model, version)
    if sig_path.exists() and not overwrite:
        raise FileExistsError(f"{sig_path} exists: model versions are immutable (pass overwrite=True)")
    vdir = store_lib.version_dir(store, model, version)
    built_for = (index.meta.get("provenance") or {}).get("model_version")
    if provenance is not None and built_for != provenance.get("model_version"):
        raise ValueError(
            f"the index was built from model version {built_for!r}, the query step's provenance names "
            f"{provenance.get('model_version')!r}: an index and a query step must come from one model version"
        )
    provenance = dict(provenance if provenance is not None else index.meta.get("provenance", {}))
    index.save(vdir / INDEX_DIR)
    manifest = {
        "format": MANIFEST_FORMAT,
        "state_feature": STATE_FEATURE,
        "state_key": STATE_KEY,
        "query_output": QUERY_OUTPUT,
        "index": INDEX_DIR,
        "index_sha256": index.meta["index_sha256"],
        "index_kind": index.kind,
        "index_recall": index.meta["recall"],
        "dim": index.dim,
        "provenance": provenance,
    }
    atomic.write_json(vdir / MANIFEST, manifest)
    exported = export_model(
        parts.query_fn,
        parts.features,
        model=model,
        version=version,
        store=None,
        on_unused="error",  # the signature lists exactly the features the step reads
        platforms=platforms,
    )
    out = {o.name: o for o in exported.signature.outputs}
    if QUERY_OUTPUT not in out or out[QUERY_OUTPUT].shape != (index.dim,):
        raise ValueError(f"the query step must return {QUERY_OUTPUT!r} [batch, {index.dim}], got {list(out.values())}")
    # written only now that it is checked: the artifact, then the signature (the version's commit point)
    atomic.write_bytes(store_lib.artifact_path(store, model, version), bytes(exported.exported.serialize()))
    exported.signature.save(sig_path)
    return exported.signature


# ---------------------------------------------------------------------------------------------------- serving


NOT_FOUND = -1  # the id faiss gives a result slot it could not fill (fewer than k items reached)


@dataclasses.dataclass
class RetrieveResult:
    """One batch of requests answered: top-k item ids and scores, whether each user had a state, the state
    store's version, and each stage's time in milliseconds.

    An index can find fewer than k items for a query (an IVF probe or an HNSW walk that reaches fewer); faiss
    fills the rest with id -1. Those slots are never answered as ids: ``found`` counts each row's real results,
    and `to_json` / `arrow_columns` hold only those (best first)."""

    item_ids: np.ndarray  # int64 [B, k]
    scores: np.ndarray  # float32 [B, k]
    state_found: np.ndarray  # bool [B]
    state_version: object
    timings_ms: dict

    @property
    def found(self) -> np.ndarray:
        """int32 [B]: the items found for each row (k unless the index reached fewer)."""
        return (self.item_ids != NOT_FOUND).sum(axis=1).astype(np.int32)

    def _rows(self):
        keep = self.item_ids != NOT_FOUND
        return [(ids[m], sc[m]) for ids, sc, m in zip(self.item_ids, self.scores, keep)]

    def to_json(self) -> dict:
        complete = bool((self.item_ids != NOT_FOUND).all())
        rows = None if complete else self._rows()
        return {
            "item_ids": self.item_ids.tolist() if complete else [ids.tolist() for ids, _ in rows],
            "scores": self.scores.tolist() if complete else [sc.tolist() for _, sc in rows],
            "found": self.found.tolist(),
            "state_found": self.state_found.tolist(),
            "state_version": self.state_version,
            "timings_ms": self.timings_ms,
        }

    def arrow_batch(self):
        """The Arrow answer: ``item_ids`` and ``scores`` fixed-size [k] lists when every row found k items, else
        variable-size lists holding each row's found items only; ``state_found``; ``found`` (int32)."""
        import pyarrow as pa

        found = self.found
        if bool((found == self.item_ids.shape[1]).all()):
            columns = {"item_ids": self.item_ids, "scores": self.scores, "state_found": self.state_found}
            batch = wire.to_record_batch(columns)
            return batch.append_column("found", pa.array(found, pa.int32()))
        rows = self._rows()
        offsets = pa.array(np.concatenate([[0], np.cumsum(found)]).astype(np.int32))
        ids = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([i for i, _ in rows]), pa.int64()))
        scores = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([s for _, s in rows]), pa.float32()))
        arrays = [ids, scores, pa.array(self.state_found, pa.bool_()), pa.array(found, pa.int32())]
        return pa.RecordBatch.from_arrays(arrays, names=["item_ids", "scores", "state_found", "found"])


def read_manifest(vdir: Path) -> dict:
    path = vdir / MANIFEST
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise RetrievalError(f"{vdir}: no {MANIFEST}: not a retrieval model version") from None
    except (OSError, ValueError) as e:
        raise RetrievalError(f"{path}: unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise RetrievalError(f"{path}: not a retrieval manifest (format {MANIFEST_FORMAT!r} expected)")
    for key in ("state_feature", "state_key", "query_output", "index", "index_sha256", "dim", "provenance"):
        if key not in manifest:
            raise RetrievalError(f"{path}: missing field {key!r}")
    if manifest["state_feature"] != STATE_FEATURE or manifest["state_key"] != STATE_KEY:
        raise RetrievalError(f"{path}: state feature/key {manifest['state_feature']}/{manifest['state_key']} unknown")
    return manifest


def is_retrieval_version(store, model: str, version: str) -> bool:
    return (store_lib.version_dir(store, model, version) / MANIFEST).exists()


def bucket(n: int) -> int:
    """Batches are padded to a power of two: one compiled program per bucket, not per batch size."""
    return 1 << max(0, (n - 1).bit_length())


class RetrievalModel:
    """A retrieval model version, loaded and checked: the exported step, its signature and its index."""

    def __init__(self, store, model: str, version: str, *, search_threads: int = 1):
        import jax

        from jaxscale.serving.export import load_model

        vdir = store_lib.version_dir(store, model, version)
        self.manifest = read_manifest(vdir)
        self.exported = load_model(store, model, version)  # checks the artifact's sha256 against the signature
        self.signature = self.exported.signature
        try:
            self.index = AnnIndex.load(vdir / self.manifest["index"])
        except AnnIndexError as e:
            raise RetrievalError(f"model {self.signature.label}: its index is not servable: {e}") from None
        if self.index.meta["index_sha256"] != self.manifest["index_sha256"]:
            raise RetrievalError(
                f"model {self.signature.label}: the index in {vdir / self.manifest['index']} is not the one "
                f"exported with it (sha256 {self.index.meta['index_sha256'][:12]}, manifest "
                f"{self.manifest['index_sha256'][:12]})"
            )
        self.request_signature = request_signature(self.signature)
        self.state_dim = self.signature.spec(STATE_FEATURE).shape[0]
        outputs = {o.name: o for o in self.signature.outputs}
        if outputs.get(QUERY_OUTPUT) is None or outputs[QUERY_OUTPUT].shape != (self.index.dim,):
            raise RetrievalError(f"model {self.signature.label}: output {QUERY_OUTPUT!r} does not match the index")
        self.index.threads = search_threads  # set in each searching thread (OpenMP's setting is per thread)
        self._call = jax.jit(self.exported.exported.call)

    @property
    def model_version(self) -> str | None:
        return self.manifest["provenance"].get("model_version")

    def warmup(self, buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> None:
        """Compiles the step for each batch bucket (and runs a search) before serving."""
        for b in buckets:
            self.index.search(self.query(np.zeros((b, self.state_dim), np.float32), self._zeros(b)), 1)

    def _zeros(self, n: int) -> dict[str, np.ndarray]:
        return {s.name: np.zeros((n, *s.shape), s.dtype) for s in self.signature.features if s.name != STATE_FEATURE}

    def query(self, states: np.ndarray, columns: Mapping[str, np.ndarray]) -> np.ndarray:
        """The exported online step: query vectors [B, E] from states [B, d] and the request's features."""
        n = states.shape[0]
        padded = bucket(n)
        inputs = {}
        for spec in self.signature.features:
            x = states if spec.name == STATE_FEATURE else columns.get(spec.name)
            if x is None:  # declared but never read: zeros cannot change the output
                x = np.zeros((n, *spec.shape), spec.dtype)
            x = np.asarray(x, spec.dtype)
            if padded != n:
                x = np.concatenate([x, np.zeros((padded - n, *spec.shape), spec.dtype)])
            inputs[spec.name] = x
        return np.asarray(self._call(inputs)[QUERY_OUTPUT])[:n]

    def retrieve(self, reader, columns: Mapping[str, np.ndarray], k: int = DEFAULT_K) -> RetrieveResult:
        """Top-k items for each request of ``columns`` (``user_id`` and the context; checked by the caller
        against `request_signature`): states from `reader` (a `StateReader`), the step, the index."""
        t0 = time.perf_counter()
        users = np.asarray(columns[STATE_KEY], np.int64).reshape(-1)
        states, found = reader.lookup(users)
        states = np.asarray(states, np.float32)
        if states.shape != (users.shape[0], self.state_dim):
            raise RetrievalError(
                f"the state store gave states of shape {states.shape}; model {self.signature.label} reads "
                f"{STATE_FEATURE} [batch, {self.state_dim}]"
            )
        t1 = time.perf_counter()
        queries = self.query(states, columns)
        t2 = time.perf_counter()
        ids, scores = self.index.search(queries, k)
        t3 = time.perf_counter()
        timings = {
            "state_lookup": (t1 - t0) * 1e3,
            "online_step": (t2 - t1) * 1e3,
            "ann": (t3 - t2) * 1e3,
            "total": (t3 - t0) * 1e3,
        }
        return RetrieveResult(ids, scores, np.asarray(found, bool), getattr(reader, "version", None), timings)


# ---------------------------------------------------------------------------------------------------- HTTP


def parse_k(value, default: int = DEFAULT_K) -> int:
    if value is None or value == "":
        return default
    try:
        k = int(value)
    except (TypeError, ValueError):
        raise FeatureError(f"k must be an integer, got {value!r}", feature="k", reason="k") from None
    if isinstance(value, bool) or not 1 <= k <= MAX_K:
        raise FeatureError(f"k must be in [1, {MAX_K}], got {value!r}", feature="k", reason="k")
    return k


def _parse_json(body: bytes):
    """`jaxscale.infra.http_server.parse_json`: a big body, parsed in a thread, lets the event loop run meanwhile."""
    from jaxscale.infra.http_server import parse_json

    return parse_json(body)


def decode_json_request(body: bytes, signature: Signature) -> tuple[dict[str, np.ndarray], int | None]:
    """``{"k": 10, "inputs": {feature: [value per request]}}`` -> typed columns (the request signature's dtypes;
    undeclared features dropped) and k. Raises `FeatureError` / `wire.PayloadError` naming the problem."""
    try:
        obj = _parse_json(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise wire.PayloadError(f"body is not JSON: {e}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("inputs"), dict):
        raise wire.PayloadError('a JSON retrieve request is {"k": K, "inputs": {feature: [value per request]}}')
    inputs = obj["inputs"]
    columns, rows = {}, None
    for spec in signature.features:
        if spec.name not in inputs:
            continue
        try:
            raw = np.asarray(inputs[spec.name])
            if np.dtype(spec.dtype).kind in "iu" and raw.size and raw.dtype.kind not in "iu":
                raise ValueError(f"got {raw.dtype} values such as {raw.reshape(-1)[0]!r}")  # 3.7 is no id
            x = raw.astype(spec.dtype, casting="unsafe") if raw.size else np.zeros(raw.shape, spec.dtype)
            if np.dtype(spec.dtype).kind in "iu" and raw.size and not np.array_equal(x, raw):
                raise ValueError("values out of range")
        except (TypeError, ValueError, OverflowError) as e:
            raise FeatureError(
                f"feature {spec.name!r}: not {spec.dtype} values: {e}", feature=spec.name, reason="dtype"
            ) from None
        if x.ndim < 1 or x.shape[1:] != spec.shape:
            raise FeatureError(
                f"feature {spec.name!r} has shape {list(x.shape)}, expected [batch, *{list(spec.shape)}]",
                feature=spec.name,
                reason="shape",
            )
        if rows is not None and x.shape[0] != rows:
            raise FeatureError(
                f"feature {spec.name!r} has {x.shape[0]} values, other features {rows}",
                feature=spec.name,
                reason="shape",
            )
        rows = x.shape[0]
        columns[spec.name] = x
    signature.check({name: (x.dtype.name, x.shape[1:]) for name, x in columns.items()})
    if not rows:
        raise wire.PayloadError("a retrieve request needs at least one request row")
    return columns, (parse_k(obj["k"]) if "k" in obj else None)


def decode_arrow_request(body: bytes, signature: Signature) -> dict[str, np.ndarray]:
    batch = wire.decode(body)
    signature.check(wire.describe(batch))
    names = set(batch.schema.names)
    return {s.name: wire.to_numpy(batch, s.name) for s in signature.features if s.name in names}


@dataclasses.dataclass(frozen=True)
class ParsedRetrieve:
    """A retrieve request decoded and checked: its columns, k, and whether it came (and is answered) as JSON."""

    columns: dict
    k: int
    json: bool

    @property
    def rows(self) -> int:
        return int(self.columns[STATE_KEY].shape[0])


class RetrieveEndpoint:
    """``POST /v1/models/{name}:retrieve`` of a leaf: JSON in -> JSON out, or Arrow IPC in -> Arrow IPC out
    (columns ``item_ids`` [k] int64, ``scores`` [k] float32, ``state_found``; the stage timings in the
    ``X-Jaxscale-Timings`` header). ``?k=`` sets k (default 10; a JSON body's ``"k"`` wins).

    Three steps, so an async server can decode inline and run the rest where it likes: `parse` (raises
    `HTTPError` for a bad request), `run` (the state lookup, the step and the search), `respond`."""

    def __init__(self, retrieval: RetrievalModel, reader, metrics=None):
        self.retrieval, self.reader, self.metrics = retrieval, reader, metrics
        sig = retrieval.signature
        self._where = {"model": sig.model, "version": sig.version}

    def _count(self, name: str, value: float = 1, **labels) -> None:
        if self.metrics is not None:
            self.metrics.inc(name, value, **labels)

    def parse(self, request) -> ParsedRetrieve:
        from jaxscale.infra.http_server import HTTPError

        model = self._where["model"]
        if request.params.get("name", model) != model:
            raise HTTPError(404, {"error": f"this leaf serves model {model!r}, not {request.params['name']!r}"})
        ctype = request.headers.get("content-type", wire.MEDIA_TYPE).split(";")[0].strip()
        try:
            k = parse_k(request.query.get("k"))
            if ctype == "application/json":
                columns, body_k = decode_json_request(request.body, self.retrieval.request_signature)
                k = body_k or k
            elif ctype == wire.MEDIA_TYPE:
                columns = decode_arrow_request(request.body, self.retrieval.request_signature)
            else:
                raise HTTPError(415, {"error": f"Content-Type must be application/json or {wire.MEDIA_TYPE}"})
        except wire.PayloadError as e:
            self._count("bad_requests", reason="payload")
            raise HTTPError(400, {"error": str(e), "reason": "payload", **self._where}) from None
        except FeatureError as e:
            self._count("bad_requests", reason=e.reason)
            raise HTTPError(400, {**e.to_json(), **self._where}) from None
        return ParsedRetrieve(columns, min(k, len(self.retrieval.index)), ctype == "application/json")

    def run(self, parsed: ParsedRetrieve) -> RetrieveResult:
        return self.retrieval.retrieve(self.reader, parsed.columns, parsed.k)

    def respond(self, parsed: ParsedRetrieve, result: RetrieveResult):
        from jaxscale.infra.http_server import Response

        self._count("retrieved", result.item_ids.shape[0])
        headers = {TIMINGS_HEADER: json.dumps(result.timings_ms, separators=(",", ":"))}
        if parsed.json:
            return Response.json({**self._where, "k": parsed.k, **result.to_json()}, headers=headers)
        # which model version answered, beside the columns (their names do not change with the version)
        metadata = {
            b"jaxscale.model": self._where["model"].encode(),
            b"jaxscale.version": self._where["version"].encode(),
        }
        batch = result.arrow_batch().replace_schema_metadata(metadata)
        return Response(200, wire.encode(batch), wire.MEDIA_TYPE, headers)

    def __call__(self, request):
        """The three steps on the calling thread (a synchronous handler)."""
        parsed = self.parse(request)
        return self.respond(parsed, self.run(parsed))


@dataclasses.dataclass(frozen=True)
class TrimmedRetrieve:
    """A retrieve request as the root forwards it: the body, and what trimming kept."""

    body: bytes
    features_sent: int
    features_received: int
    fail_open: str | None  # why the leaf gets everything ("missing" / "unreadable"); None when trimmed


def trim_retrieve_request(
    body: bytes, content_type: str, signature: Signature | None, *, trim: bool = True, fail_open=None, compression=None
) -> TrimmedRetrieve:
    """The root's part of a retrieve: check the request against the model's signature (when it has one; a bad
    request fails here, naming the feature) and keep only ``user_id`` and the features the query step reads.
    Without a signature (``fail_open`` says why) or with ``trim=False`` the whole request goes on. NumPy and
    Arrow only: the root does not start JAX."""
    keep = request_features(signature) if (trim and signature is not None) else None
    rsig = request_signature(signature) if signature is not None else None
    if content_type == "application/json":
        try:
            obj = _parse_json(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise wire.PayloadError(f"body is not JSON: {e}") from None
        inputs = obj.get("inputs") if isinstance(obj, dict) else None
        if not isinstance(inputs, dict):
            raise wire.PayloadError('a JSON retrieve request is {"k": K, "inputs": {feature: [value per request]}}')
        if rsig is not None:
            for name in rsig.required:
                if name not in inputs:
                    spec = rsig.spec(name)
                    raise FeatureError(
                        f"model {rsig.label}: required feature {name!r} is missing from the request "
                        f"(expected {spec.dtype}{['batch', *spec.shape]})",
                        feature=name,
                        reason="missing",
                        model=rsig.model,
                        version=rsig.version,
                    )
        if keep is None:
            return TrimmedRetrieve(body, len(inputs), len(inputs), fail_open)
        out = {**obj, "inputs": {n: inputs[n] for n in keep}}
        return TrimmedRetrieve(json.dumps(out, separators=(",", ":")).encode(), len(keep), len(inputs), None)
    if content_type != wire.MEDIA_TYPE:
        raise ValueError(f"Content-Type must be application/json or {wire.MEDIA_TYPE}, got {content_type!r}")
    batch = wire.decode(body)
    if rsig is not None:
        rsig.check(wire.describe(batch))
    if keep is None:
        return TrimmedRetrieve(body, batch.num_columns, batch.num_columns, fail_open)
    trimmed = wire.encode(batch.select(list(keep)), compression)
    return TrimmedRetrieve(trimmed, len(keep), batch.num_columns, None)


# ---------------------------------------------------------------------------------------------------- CLI


ENTRY_POINTS = "jaxscale.retrieval"
"""The entry-point group of retrieval serving: ``<model kind> = "<module>:<function>"``, the function
``(trainer, restored state, held-out source, *, queries, decode) -> RetrievalParts`` (this package declares the
contextual two-tower's, `jaxscale_models.two_tower_serving.retrieval_parts`)."""


def parts_function(kind: str) -> Callable:
    """The retrieval-parts function of a model kind, found by entry point like the model kinds themselves."""
    import importlib.metadata

    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)}
    if kind not in found:
        raise ValueError(f"model kind {kind!r} has no retrieval serving (entry points {ENTRY_POINTS}: {sorted(found)})")
    return found[kind].load()


def saved_config(checkpoints: Path, step=None, overrides=()):
    """The config a run saved with its checkpoint (the latest step unless `step`), with `overrides` applied."""
    import tempfile

    import yaml

    from jaxscale.training.config import load_config

    steps = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit() and p.is_dir())
    chosen = step if step is not None else (steps[-1] if steps else None)
    meta_file = checkpoints / str(chosen) / "meta" / "metadata"
    try:
        tree = json.loads(meta_file.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{meta_file}: no config saved with the checkpoint ({e}); pass --config") from None
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(tree, f)
        f.flush()
        return load_config(f.name, list(overrides))


def load_parts(config_path: str | None, checkpoint: str, overrides=(), *, step=None, queries: int = 1000):
    """(parts, provenance): a run's checkpoint restored and asked for its `RetrievalParts` (`parts_function`),
    over the held-out split of its config's data (the corpus metadata and the sample queries). `config_path`
    None: the config saved with the checkpoint."""
    from jaxscale.infra import distributed
    from jaxscale.training.config import load_config
    from jaxscale.training.data import make_data
    from jaxscale.training.evaluate import _backends_started, find_checkpoints, item_decoder, restore
    from jaxscale.training.trainer import Trainer

    checkpoints = find_checkpoints(checkpoint)
    cfg = load_config(config_path, list(overrides)) if config_path else saved_config(checkpoints, step, overrides)
    if not _backends_started():
        distributed.initialize(None, None, None, local_devices=cfg.mesh.nodes * cfg.mesh.local)
    retrieval_parts = parts_function(cfg.model.kind)
    leave_one_out = cfg.data.source == "sequences" and getattr(cfg.data.sequences, "split", "day") == "leave_one_out"
    source = make_data(cfg, split="valid" if leave_one_out else "eval")
    trainer = Trainer(cfg, workdir=str(checkpoints.parent), progress=False, log=False, data=source, eval_data=source)
    state, restored = restore(trainer, checkpoints, step)
    examples = getattr(source, "source", None)
    decode = item_decoder(examples) if examples is not None and hasattr(examples, "reader") else None
    parts = retrieval_parts(trainer, state, source, queries=queries, decode=decode)
    provenance = {
        "checkpoint": str(checkpoints),
        "step": restored,
        "model_kind": cfg.model.kind,
        "model_version": model_version(checkpoints.parent, restored),
        "item_ids": "raw (the store's vocabulary)" if decode is not None else "item rows",
    }
    return parts, provenance


def _quiet_faiss() -> None:
    """faiss logs at INFO which of its builds it loaded (AVX2, AVX512): noise on a command's output."""
    import logging

    logging.getLogger("faiss.loader").setLevel(logging.WARNING)


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="the run's YAML config (default: the one saved in the checkpoint)")
    p.add_argument("--checkpoint", required=True, help="run directory, or its checkpoints/ or best/ directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest complete one)")
    p.add_argument("overrides", nargs="*", help="config overrides, dotted.key=value")


def build_index_main(argv) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxscale.serving build-index",
        description="Encode a two-tower checkpoint's corpus with its item tower and build an ANN index; report "
        "its recall@10 against exact search and its query latency.",
    )
    _add_model_arguments(p)
    p.add_argument("--out", required=True, help="index directory to write (atomically)")
    p.add_argument("--kind", choices=("hnsw", "ivf", "flat"), default="hnsw")
    p.add_argument("--hnsw-m", type=int, default=AnnParams.hnsw_m)
    p.add_argument("--ef-construction", type=int, default=AnnParams.ef_construction)
    p.add_argument("--ef-search", type=int, default=AnnParams.ef_search)
    p.add_argument("--nlist", type=int, default=None)
    p.add_argument("--nprobe", type=int, default=None)
    p.add_argument("--min-recall", type=float, default=AnnParams.min_recall)
    p.add_argument(
        "--no-tune", action="store_true", help="fail below --min-recall instead of raising the search setting"
    )
    p.add_argument("--queries", type=int, default=1000, help="held-out requests for the recall check")
    p.add_argument("--latency-batch", type=int, default=1, help="queries per search when timing (default 1)")
    args = p.parse_intermixed_args(argv)
    _quiet_faiss()
    try:
        params = AnnParams(
            kind=args.kind,
            hnsw_m=args.hnsw_m,
            ef_construction=args.ef_construction,
            ef_search=args.ef_search,
            nlist=args.nlist,
            nprobe=args.nprobe,
            min_recall=args.min_recall,
            tune=not args.no_tune,
        )
        parts, provenance = load_parts(
            args.config, args.checkpoint, args.overrides, step=args.step, queries=args.queries
        )
        index = AnnIndex.build(
            parts.item_ids,
            parts.item_vectors,
            params=params,
            queries=parts.queries,
            query_source=parts.query_source,
            latency_batch=args.latency_batch,
            provenance=provenance,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    index.save(args.out)
    m = index.meta
    r, lat = m["recall"], m["latency"]
    print(
        f"index {args.out}: {m['params']} over {m['items']} items of dim {m['dim']} "
        f"({provenance['model_version']}), built in {m['build_seconds']} s"
    )
    recall = r[f"recall@{r['k']}"]
    print(f"recall@{r['k']} vs exact search: {recall:.4f} on {r['queries']} queries ({r['query_source']})")
    for name in ("index", "exact"):
        x = lat[name]
        print(
            f"latency {name:5s}: median {x['median_ms']:.3f} ms, p99 {x['p99_ms']:.3f} ms per batch of {x['batch']} "
            f"({x['batches']} batches, {lat['search_threads']} thread)"
        )
    print(json.dumps({"recall": r, "latency": lat}))
    return 0


def export_retrieval_main(argv) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxscale.serving export-retrieval",
        description="Export a two-tower checkpoint's online query step into a model store version, with its index.",
    )
    _add_model_arguments(p)
    p.add_argument("--index", required=True, help="an index built by build-index from the same checkpoint")
    p.add_argument("--store", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_intermixed_args(argv)
    _quiet_faiss()
    try:
        index = AnnIndex.load(args.index)
        parts, provenance = load_parts(args.config, args.checkpoint, args.overrides, step=args.step, queries=0)
        built_for = index.meta["provenance"].get("model_version")
        if built_for != provenance["model_version"]:  # export_retrieval checks it too; this names the flag
            raise ValueError(
                f"--index {args.index} was built from {built_for!r}, the checkpoint is {provenance['model_version']!r}"
            )
        sig = export_retrieval(
            parts,
            index,
            store=args.store,
            model=args.model,
            version=args.version,
            provenance=provenance,
            overwrite=args.overwrite,
        )
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{sig.label}: query step reads {list(sig.required)}; index {index.kind} over {len(index)} items")
    return 0
