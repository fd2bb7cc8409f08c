"""A leaf server: serves one exported model version over HTTP.

    POST /predict     Arrow IPC features -> Arrow IPC outputs (one column per output)
    GET  /signature   the model's signature (JSON)
    POST /v1/models/{name}:retrieve   a retrieval model version (`jaxscale.serving.retrieval`) with a state store:
                      user_id + context -> top-K item ids (JSON or Arrow IPC)
    GET  /metrics     Prometheus text (the HTTP layer's metrics and the leaf's own)
    GET  /healthz

Served by the shared HTTP layer (`jaxscale.infra.http_server`); with a tokens file, /predict and /signature need a
token granting the model's name.

The fast path: /predict is an ``async def`` handler on the server's event loop. Decoding, the signature check
and the column conversion run inline (tens of microseconds); the model call goes through ``self._offload``
(`jaxscale.infra.http_server.Offload`), which runs it on the loop while its measured time per batch bucket is under
``LeafConfig.inline_budget_s`` and in a thread otherwise (a first call, a big batch). No request crosses a thread
when the model is fast, so no thread wake-ups or GIL hand-offs are paid per request. A body laid out like one
already read (`wire.LayoutCache`: the root sends the same schema and batch size every time) is not decoded: each
input is a NumPy view of the body's bytes at the offset the full path found.

Adding a route (e.g. ``POST /v1/models/{name}:retrieve``) the same way:
  1. ``async def _retrieve(self, request: Request) -> Response``: decode and check the body inline; raise
     `HTTPError` (or let `FeatureError`/`wire.PayloadError` become one, as `_predict` does) for a bad request;
  2. every call that can take long (the model, an index search) goes through
     ``await self._offload.run(("retrieve", self._bucket(rows)), fn, *args)``: one cost key per kind of call and
     batch bucket, so a slow call never runs on the loop;
  3. list it in `routes` with ``resources=self._model_resource`` (bearer tokens) and count it in
     ``self.metrics`` (declare new names in `LEAF_METRICS`).

Bodies are bounded by the server's `ServerConfig` limits: bytes on the wire and the time to send them (the HTTP
layer: 413, 408), and what an Arrow body decodes to (``max_decoded_bytes``, ``max_rows``: `wire.DecodeLimits`,
413 naming the limit, checked from the IPC metadata before anything is decompressed, on the learned-layout path
too); bodies of at least ``parse_offload_bytes`` are decoded in a thread, off the event loop.

A request must carry every feature the model uses, with the declared dtype and shape (else 400 naming the
feature). Declared features the compiled function never reads may be absent: the leaf passes zeros for them,
which cannot change the outputs (the compiled module does not read them). Undeclared features are ignored and
counted (``ignored_features``): that is what a fail-open or untrimmed root costs the leaf.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import logging
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa

from jaxscale.infra.http_server import (
    BackgroundServer,
    HTTPError,
    Offload,
    Request,
    Response,
    Route,
    ServerConfig,
    Service,
    add_server_arguments,
    serve_until_signal,
    server_options,
)
from jaxscale.serving import retrieval as retrieval_lib
from jaxscale.serving import wire
from jaxscale.serving.export import ExportedModel, load_model
from jaxscale.serving.metrics import MetricDef, Metrics
from jaxscale.serving.resilience import TIMEOUT_HEADER, budget_s
from jaxscale.serving.signature import FeatureError

log = logging.getLogger(__name__)

LEAF_METRICS = (
    MetricDef("requests", "counter", "predict requests answered, by HTTP status", ("status",)),
    MetricDef("bad_requests", "counter", "predict requests refused (400), by reason", ("reason",)),
    MetricDef("examples", "counter", "examples (rows) scored"),
    MetricDef("request_bytes", "counter", "bytes of predict request bodies received"),
    MetricDef("features_received", "counter", "feature columns received over all requests"),
    MetricDef("ignored_features", "counter", "received feature columns the model does not declare (ignored)"),
    MetricDef("filled_unused_features", "counter", "declared-but-unused features absent and passed as zeros"),
    MetricDef("retrieved", "counter", "retrieve requests (rows) answered"),
    MetricDef("deadlines", "counter", "requests answered 504: their X-Request-Timeout-Ms ran out", ("route",)),
    MetricDef(
        "state_publications_refused",
        "counter",
        "state publications refused: made for another model version (the previous states stay served)",
        ("model_version",),
    ),
    MetricDef("states_ready", "gauge", "1 while states of the loaded model version are served (retrieval leaves)"),
)


_MAX_SCHEMAS = 16  # request schemas whose input plan a leaf remembers


@dataclass(frozen=True)
class _InputPlan:
    """How one request schema becomes the model's inputs, checked against the signature once."""

    reads: tuple[tuple[str, int | None, str, tuple[int, ...]], ...]  # (feature, column or None = zeros, dtype, shape)
    received: int  # feature columns in the request
    ignored: int  # of which the signature does not declare
    filled: int  # declared features absent from the request (passed as zeros)

    @classmethod
    def build(cls, signature, schema: pa.Schema) -> _InputPlan:
        columns = {f.name: wire.column_type(f.name, f.type) for f in schema}
        signature.check(columns)
        position = {name: i for i, name in enumerate(columns)}
        reads = []
        for spec in signature.features:
            if spec.name in columns:
                dtype, shape = columns[spec.name]
                reads.append((spec.name, position[spec.name], dtype, shape))
            else:
                reads.append((spec.name, None, spec.dtype, spec.shape))
        declared = sum(1 for r in reads if r[1] is not None)
        return cls(tuple(reads), len(columns), len(columns) - declared, len(reads) - declared)


@dataclass(frozen=True)
class LeafConfig:
    """``batch_buckets``: pad each batch up to the smallest bucket that holds it (larger ones run as they are), so
    the leaf compiles one program per bucket instead of one per batch size. Only for models that score each
    example independently (the padding rows are dropped from the outputs). Empty = no padding."""

    store: str | Path
    model: str
    version: str
    batch_buckets: tuple[int, ...] = ()
    warmup: bool = False  # compile every bucket at start-up (at least batch 1): a model that cannot run fails start-up
    server: ServerConfig = field(default_factory=ServerConfig)  # host, port, in-flight bound, tokens, TLS, ...
    states: str | Path | None = None  # retrieval: the state directory (`jaxscale.serving.states`) to read
    states_watch_s: float = 1.0  # retrieval: how often to look for a new state publication
    inline_budget_s: float = 0.002  # model calls measured shorter than this run on the event loop (0 = never)
    max_batch: int = 1024  # default buckets (no batch_buckets, examples scored independently): powers of two up to it
    # retrieval: /readyz says 503 while the served state publication is older than this (None = no bound). The
    # builder publishes only when some user changed: set it above the stream's longest quiet period.
    max_state_age_s: float | None = None

    def __post_init__(self):
        buckets = tuple(self.batch_buckets)
        if any(not isinstance(b, int) or b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"batch_buckets must be increasing positive integers, got {buckets!r}")
        if not isinstance(self.max_batch, int) or isinstance(self.max_batch, bool) or self.max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {self.max_batch!r}")
        if self.max_state_age_s is not None and not (
            isinstance(self.max_state_age_s, (int, float)) and self.max_state_age_s > 0
        ):
            raise ValueError(f"max_state_age_s must be None or a number > 0, got {self.max_state_age_s!r}")
        if not isinstance(self.inline_budget_s, (int, float)) or self.inline_budget_s < 0:
            raise ValueError(f"inline_budget_s must be a number >= 0, got {self.inline_budget_s!r}")
        object.__setattr__(self, "batch_buckets", buckets)


class LeafStartupError(RuntimeError):
    """The leaf cannot serve its model on this machine (found at warm-up)."""


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``max_batch`` (included when it is not a power of two)."""
    out = tuple(1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch)
    return out if out[-1] == max_batch else (*out, max_batch)


_FULL_PATH = object()  # a layout learned as one whose inputs are not views of the body: always decoded


class Leaf:
    """One model version: checks requests against its signature and runs `jax.export.deserialize(...).call`."""

    def __init__(self, config: LeafConfig, *, states=None):
        """``states``: the state reader of a retrieval version (default: a `StateReader` of ``config.states``)."""
        self.config = config
        self.model: ExportedModel = load_model(config.store, config.model, config.version)
        self.signature = self.model.signature
        self._call = jax.jit(self.model.exported.call)
        # the batch sizes compiled: the configured buckets, else powers of two up to max_batch when the signature
        # says examples are scored independently (padding rows cannot change the others), else none (every new
        # batch size compiles a program on its first request)
        self.buckets = config.batch_buckets
        if not self.buckets and self.signature.independent_examples:
            self.buckets = default_buckets(config.max_batch)
        self.metrics = Metrics("jaxscale_leaf", LEAF_METRICS)
        self._server: BackgroundServer | None = None
        self._plans: list[tuple[pa.Schema, _InputPlan]] = []
        self._plans_lock = threading.Lock()
        self._layouts = wire.LayoutCache()  # request layouts seen: their inputs are read without decoding
        self._limits = wire.DecodeLimits(config.server.max_decoded_bytes, config.server.max_rows)
        # the model call: on the loop while it is short, else in threads (`jaxscale.infra.http_server.Offload`)
        self._offload = Offload(config.server.workers, config.inline_budget_s, name="leaf-model")
        self.retrieval, self.states, self._own_states = None, states, False
        if retrieval_lib.is_retrieval_version(config.store, config.model, config.version):
            self.retrieval = retrieval_lib.RetrievalModel(config.store, config.model, config.version)
            if self.retrieval.model_version is None:
                log.warning("leaf %s: its manifest names no model version: state publications cannot be checked "
                            "against it (re-export it with provenance)", self.signature.label)  # fmt: skip
            if self.states is None and config.states is not None:
                from jaxscale.serving.states import StateReader

                # only publications of this model's version: another model's states (same width or not) would
                # be served as wrong answers; until one matches, the leaf is not ready (/readyz 503)
                self.states = StateReader(
                    config.states, model_version=self.retrieval.model_version, on_refused=self._refused_states
                )
                self._own_states = True
                if not self.states.ready:
                    log.warning("leaf %s: not ready: no states of model version %r in %s yet",
                                self.signature.label, self.retrieval.model_version, config.states)  # fmt: skip
                self.states.watch(config.states_watch_s)
            if self.states is None:
                log.warning("leaf %s: a retrieval model without a state store: no retrieve route", self.signature.label)
            else:
                self._retrieve_endpoint = retrieval_lib.RetrieveEndpoint(self.retrieval, self.states, self.metrics)
                if config.warmup:
                    self.retrieval.warmup()
        if config.warmup:
            self._warmup()

    def _warmup(self) -> None:
        """Compile every batch size this leaf serves (each bucket; batch 1 when it has none) and load what decoding
        a request imports (pyarrow -> pandas). A model that cannot run here (exported for another platform, a
        kernel this backend lacks, outputs not of the signature) fails the start-up with `LeafStartupError`, not
        every request after a healthy-looking start."""
        for b in self.buckets or (1,):
            try:
                batch = wire.to_record_batch(self._zeros(b))
                inputs = {s.name: wire.to_numpy(batch, s.name) for s in self.signature.features}
                outputs = self._run(inputs)  # compiles
                self._offload.measure(("predict", b), self._run, inputs)  # a warm call: its cost picks inline or not
            except Exception as e:
                raise LeafStartupError(
                    f"leaf {self.signature.label}: the model cannot run on this machine ({jax.default_backend()}): "
                    f"warm-up at batch {b} failed: {type(e).__name__}: {str(e)[:500]}"
                ) from e
            wrong = [n for n, a in outputs.items() if a.shape[:1] != (b,)]
            if wrong:
                raise LeafStartupError(
                    f"leaf {self.signature.label}: warm-up at batch {b}: outputs {wrong} are not one row per example"
                )

    # ------------------------------------------------------------------------------------------ model versions

    def _refused_states(self, snapshot) -> None:
        """A state publication of another model version: refused (the reader keeps serving the previous one)."""
        self.metrics.inc("state_publications_refused", model_version=snapshot.model_version)
        log.warning(
            "leaf %s: refused state publication %s of %s: it is for model version %r, this leaf serves %r "
            "(the previous states stay served)",
            self.signature.label, snapshot.version, self.config.states, snapshot.model_version,
            self.retrieval.model_version,
        )  # fmt: skip

    def _states_problem(self) -> str | None:
        """Why the states cannot be served now (None: they can): none of this model version yet, or a reader
        (any, e.g. one passed in) holding another model version's states."""
        if self.states is None or self.retrieval is None:
            return None
        if getattr(self.states, "ready", True) is False:
            want = self.retrieval.model_version
            return f"no state publication of model version {want!r} yet (states of other versions are refused)"
        have, want = getattr(self.states, "model_version", None), self.retrieval.model_version
        if have is not None and want is not None and have != want:
            return f"the states are of model version {have!r}, the model is {want!r}"
        return None

    def not_ready(self) -> list[str]:
        """Why this leaf should get no traffic (empty: ready): its states (retrieval): none of its model version,
        or older than ``max_state_age_s``. (The model is warm: warm-up runs before the leaf listens.)"""
        problem = self._states_problem()
        if problem is None and self.config.max_state_age_s is not None and self.states is not None:
            published = getattr(getattr(self.states, "snapshot", None), "published_at_ms", None)
            if published is not None:
                age = time.time() - published / 1e3
                if age > self.config.max_state_age_s:
                    problem = (
                        f"the states served (publication {self.states.version}) are {age:.0f} s old, over "
                        f"max_state_age_s={self.config.max_state_age_s:g}"
                    )
        if self.retrieval is not None and self.states is not None:
            self.metrics.set("states_ready", float(problem is None))
        return [problem] if problem else []

    # ------------------------------------------------------------------------------------------- predicting

    def _zeros(self, batch: int) -> dict[str, np.ndarray]:
        return {s.name: np.zeros((batch, *s.shape), s.dtype) for s in self.signature.features}

    def _bucket(self, batch: int) -> int:
        buckets = self.buckets
        i = bisect.bisect_left(buckets, batch)
        return buckets[i] if i < len(buckets) else batch

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        batch = next(iter(inputs.values())).shape[0]
        padded = self._bucket(batch)
        if padded != batch:
            inputs = {
                k: np.concatenate([v, np.zeros((padded - batch, *v.shape[1:]), v.dtype)]) for k, v in inputs.items()
            }
        out = self._call(inputs)
        names = [s.name for s in self.signature.outputs]
        arrays = [out] if not isinstance(out, dict) else [out[n] for n in names]
        return {n: np.asarray(a)[:batch] for n, a in zip(names, arrays)}

    def _input_plan(self, schema: pa.Schema) -> _InputPlan:
        """The checked plan for a request schema, memoized: every request of a client carries the same schema, and
        re-reading and re-checking it costs more than the columns' conversion."""
        with self._plans_lock:
            for seen, plan in self._plans:
                if seen.equals(schema):
                    return plan
        plan = _InputPlan.build(self.signature, schema)  # raises FeatureError on a bad request
        with self._plans_lock:
            self._plans = [(schema, plan), *self._plans[: _MAX_SCHEMAS - 1]]
        return plan

    def predict_batch(self, batch: pa.RecordBatch) -> dict[str, np.ndarray]:
        """Score an Arrow record batch of features; raises `FeatureError` naming a missing or mismatched one."""
        return self._run(self._inputs(batch))

    def _inputs(self, batch: pa.RecordBatch) -> dict[str, np.ndarray]:
        """The model's inputs from a request batch (checked against the signature, counted in the metrics)."""
        plan = self._input_plan(batch.schema)
        rows = batch.num_rows
        inputs = {}
        for name, index, dtype, shape in plan.reads:
            if index is None:  # declared but never read by the compiled function (Signature.check enforced that)
                inputs[name] = np.zeros((rows, *shape), dtype)
            else:
                inputs[name] = wire.column_to_numpy(batch.column(index), name, dtype, shape)
        self._count(plan, rows)
        return inputs

    def _count(self, plan: _InputPlan, rows: int) -> None:
        self.metrics.inc("features_received", plan.received)
        self.metrics.inc("ignored_features", plan.ignored)
        self.metrics.inc("filled_unused_features", plan.filled)
        self.metrics.inc("examples", rows)

    def _body_inputs(self, body: bytes) -> tuple[dict[str, np.ndarray], int]:
        """(the model's inputs, rows) from a request body. A body laid out like one already read (same schema,
        rows, buffer offsets: `wire.LayoutCache`) is not parsed again: each input is a NumPy view of its bytes at
        the offset the full path found, the array the full path would return."""
        known = self._layouts.find(body, self._limits)  # bounded like decoding: DecodeLimitError
        if known is not None and known is not _FULL_PATH:
            plan, rows, reads = known
            inputs = {}
            for name, offset, dtype, shape, count in reads:
                if offset is None:
                    inputs[name] = np.zeros(shape, dtype)
                else:
                    inputs[name] = np.frombuffer(body, dtype, count, offset).reshape(shape)
            self._count(plan, rows)
            return inputs, rows
        batch = wire.decode(body, self._limits)
        inputs = self._inputs(batch)
        if known is None:
            self._learn_layout(body, batch, inputs)
        return inputs, batch.num_rows

    def _learn_layout(self, body: bytes, batch: pa.RecordBatch, inputs: dict[str, np.ndarray]) -> None:
        """Remember where each input lies in ``body`` when every one the request carries is a view of it (else
        that the layout takes the full path, so it is not examined again)."""
        plan = self._input_plan(batch.schema)
        reads = []
        for name, index, dtype, shape in plan.reads:
            offset = None
            if index is not None:
                offset = wire.view_offset(inputs[name], body)
                if offset is None or inputs[name].dtype != np.dtype(dtype):
                    self._layouts.learn(body, _FULL_PATH, batch)  # a copied or converted column
                    return
            full = (batch.num_rows, *shape)
            reads.append((name, offset, np.dtype(dtype), full, int(np.prod(full))))
        self._layouts.learn(body, (plan, batch.num_rows, tuple(reads)), batch)

    def predict(self, features: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Score ``{feature: array [batch, ...]}`` (same checks as the HTTP path)."""
        return self.predict_batch(wire.to_record_batch(features))

    # ------------------------------------------------------------------------------------------------- HTTP

    def _bad(self, reason: str, payload: dict) -> HTTPError:
        self.metrics.inc("bad_requests", reason=reason)
        payload.setdefault("model", self.signature.model)
        payload.setdefault("version", self.signature.version)
        return HTTPError(400, payload)

    async def _within_deadline(self, request: Request, route: str, handler) -> Response:
        """``handler(request)`` within the sender's ``X-Request-Timeout-Ms`` (the root sends what is left of its
        deadline): past it the answer is 504 at once (nobody reads a later one; a model call already running in a
        thread finishes there), and a request that arrives with nothing left is not run at all."""
        budget = budget_s(request.headers)
        try:
            if budget is not None and budget <= 0:
                raise TimeoutError
            async with asyncio.timeout(budget):
                return await handler(request)
        except TimeoutError:
            self.metrics.inc("deadlines", route=route)
            ms = request.headers.get(TIMEOUT_HEADER.lower())
            message = f"the request's deadline of {ms} ms ({TIMEOUT_HEADER}) ran out before the answer"
            return Response.json(
                {"error": message, "reason": "deadline", "deadline": TIMEOUT_HEADER, **self._label}, 504
            )

    @property
    def _label(self) -> dict:
        return {"model": self.signature.model, "version": self.signature.version}

    async def _predict(self, request: Request) -> Response:
        return await self._within_deadline(request, "predict", self._predict_now)

    async def _predict_now(self, request: Request) -> Response:
        self.metrics.inc("request_bytes", len(request.body))
        status = 200
        try:
            ctype = request.headers.get("content-type", wire.MEDIA_TYPE).split(";")[0].strip()
            if ctype != wire.MEDIA_TYPE:
                status = 415
                raise HTTPError(415, {"error": f"Content-Type must be {wire.MEDIA_TYPE}, got {ctype!r}"})
            try:
                parse = functools.partial(self._body_inputs, request.body)
                big = len(request.body) >= self.config.server.parse_offload_bytes  # parsed off the event loop
                inputs, rows = await asyncio.to_thread(parse) if big else parse()
                outputs = await self._offload.run(("predict", self._bucket(rows)), self._run, inputs)
            except wire.DecodeLimitError as e:
                status = 413
                raise self._too_large(e) from None
            except wire.PayloadError as e:
                status = 400
                raise self._bad("payload", {"error": str(e), "reason": "payload"}) from None
            except FeatureError as e:
                status = 400
                raise self._bad(e.reason, e.to_json()) from None
            return Response(200, wire.encode(outputs), wire.MEDIA_TYPE)
        finally:
            self.metrics.inc("requests", status=status)

    def _too_large(self, e: wire.DecodeLimitError) -> HTTPError:
        self.metrics.inc("bad_requests", reason="decode_limit")
        return HTTPError(413, {**e.to_json(), "model": self.signature.model, "version": self.signature.version})

    def _model_resource(self, request: Request) -> tuple[str]:
        """What a bearer token must grant to call this leaf: its model's name."""
        return (self.signature.model,)

    def routes(self) -> list[Route]:
        label = {"model": self.signature.model, "version": self.signature.version}
        model = self._model_resource
        return [
            Route("POST", "/predict", self._predict, resources=model),
            Route("GET", "/signature", lambda r: Response.json(self.signature.to_json()), resources=model),
            *self._retrieve_routes(),
            Route("GET", "/healthz", lambda r: Response.json({"status": "ok", **label}), public=True, inline=True),
        ]

    async def _retrieve(self, request: Request) -> Response:
        return await self._within_deadline(request, "retrieve", self._retrieve_now)

    async def _retrieve_now(self, request: Request) -> Response:
        """``POST /v1/models/{name}:retrieve``: decoded and checked inline; the state lookup, the query step and
        the index search go through ``self._offload`` (one cost key per batch bucket). 503 while the states are
        not of the loaded model version."""
        problem = self._states_problem()
        if problem is not None:
            retry = {"Retry-After": str(self.config.server.retry_after_s)}
            return Response.json({"error": problem, "reason": "states_not_ready", **self._label}, 503, retry)
        ctype = request.headers.get("content-type", wire.MEDIA_TYPE).split(";")[0].strip()
        try:
            if ctype == wire.MEDIA_TYPE:  # refused from the metadata, before anything is decompressed
                wire.check_limits(request.body, self._limits)
            parse = functools.partial(self._retrieve_endpoint.parse, request)
            big = len(request.body) >= self.config.server.parse_offload_bytes  # parsed off the event loop
            parsed = await asyncio.to_thread(parse) if big else parse()
            decoded = sum(np.asarray(c).nbytes for c in parsed.columns.values())
            self._limits.check(parsed.rows, decoded, "decoded to")  # a JSON body's rows, too
        except wire.DecodeLimitError as e:
            raise self._too_large(e) from None
        key = ("retrieve", retrieval_lib.bucket(parsed.rows))
        result = await self._offload.run(key, self._retrieve_endpoint.run, parsed)
        return self._retrieve_endpoint.respond(parsed, result)

    def _retrieve_routes(self) -> list[Route]:
        if self.retrieval is None or self.states is None:
            return []
        return [Route("POST", "/v1/models/{name}:retrieve", self._retrieve, resources=self._model_resource)]

    def service(self) -> Service:
        return Service(
            self.routes(), self.config.server, name="jaxscale-leaf", metrics_prefix="jaxscale_leaf",
            collectors=[self.metrics], ready=self.not_ready,
        )  # fmt: skip

    def start(self) -> Leaf:
        """Serve in a background thread; ``url`` tells where."""
        self._server = BackgroundServer(self.service()).start()
        log.info("leaf %s serving on %s", self.signature.label, self._server.url)
        return self

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("leaf not started")
        return self._server.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._own_states:
            self.states.close()
        self._offload.shutdown()

    def __enter__(self) -> Leaf:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def parse_config(argv=None) -> LeafConfig:
    """The `LeafConfig` of ``python -m jaxscale.serving leaf`` arguments."""
    p = argparse.ArgumentParser(prog="python -m jaxscale.serving leaf", description="Serve one model version.")
    p.add_argument("--store", required=True, help="model store directory (<store>/<model>/<version>/)")
    p.add_argument("--model", required=True)
    p.add_argument("--version", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--batch-buckets", default="", help="comma-separated batch sizes to pad to, e.g. 1,8,64,512")
    p.add_argument(
        "--warmup",
        action="store_true",
        help="compile every bucket (batch 1 without buckets) before serving; exit non-zero if the model cannot run",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=LeafConfig.max_batch,
        help="default buckets (no --batch-buckets, a signature with independent_examples): powers of two up to it",
    )
    p.add_argument("--states", default=None, help="retrieval: the state directory (python -m jaxscale.serving states)")
    p.add_argument(
        "--max-state-age",
        type=float,
        default=None,
        help="retrieval: /readyz is 503 while the served state publication is older than this many seconds",
    )
    add_server_arguments(p)
    args = p.parse_args(argv)
    buckets = tuple(int(b) for b in args.batch_buckets.split(",") if b)
    server = ServerConfig(host=args.host, port=args.port, **server_options(args))
    return LeafConfig(
        args.store, args.model, args.version, buckets, args.warmup, server, states=args.states,
        max_batch=args.max_batch, max_state_age_s=args.max_state_age,
    )  # fmt: skip


def main(argv=None) -> None:
    try:
        leaf = Leaf(parse_config(argv))
    except LeafStartupError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(3) from None
    serve_until_signal(
        leaf.service(), lambda url: print(f"leaf {leaf.signature.label} serving on {url}", flush=True)
    )  # until SIGTERM/SIGINT; in-flight requests finish first
