"""The model registry: what the trainer needs to know about each model kind, in one value.

A model module (e.g. `jaxscale_models.foundation`) defines a `ModelSpec` named `SPEC` and declares it as an
entry point of the group "jaxscale.models". The trainer, the config loader, the data factory and the comm
report ask the registry for the spec of `model.kind`; none of them branches on the kind. A kind's module is
imported when the kind is first asked for, so importing jaxscale imports no model; `register` adds a kind
at run time (a notebook, a test).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxscale.engine.tables import TableConfig

ENTRY_POINTS = "jaxscale.models"
"""The entry-point group of model kinds: each entry is `<kind> = "<module>:SPEC"` (this package's own kinds,
`jaxscale_models`, are declared in its pyproject.toml the same way)."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model kind, as the trainer uses it.

    Attributes:
      kind: the name in `model.kind`.
      config: frozen dataclass of the model's config section (`model.<kind>`); its defaults are the smoke size.
      tables: (model config) -> the sharded `TableConfig`s.
      ids: (model config, batch) -> {feature: int32 [B, L]} engine ids; NumPy in, NumPy out (the host checks
        and counts them before dispatch).
      build: (model config, nnx.Rngs) -> the dense nnx.Module.
      loss: (model, embeddings, batch) -> (scalar loss, metrics); 0-d metrics are averaged and logged,
        others are handed to `summarize`.
      forward / objective (optional): the loss split into its per-example part, (model, embeddings, batch)
        -> {name: batch-major array}, and the rest, (model config, outputs, batch) -> (loss, metrics), with
        `loss == objective(cfg, forward(...), batch)`. With them the trainer can run the forward data-parallel
        in `shard_map` and all-reduce the dense gradients itself (`train.dense_grad_precision=bf16`).
      summarize: (model config, [per-batch metrics as NumPy]) -> {name: float}: held-out metrics that need
        the whole eval set (AUC, full-corpus recall); {} when the averages are enough.
      synthetic: (model config, global batch, data config, split) -> a source whose
        `batch(step, process_index, process_count)` returns that process's rows of step `step`.
      parquet_columns: (model config) -> (columns, seq_len) for `jaxscale.training.data.ParquetData`.
      data_sources: extra `data.source` kinds this model can read: {name: (model cfg, config, split,
        process_index, process_count) -> source}.
      score (optional): full-corpus ranking, (model, embeddings, batch) -> (scores [B, N] over every candidate
        item, -inf for rows that are not candidates; target [B] int, the column of each example's held-out
        item, -1 when it has none). Column j is item row j of the model's item table (a dense vocabulary
        index when the data come from a store with a vocabulary). Used by `jaxscale.evaluate` and by the
        trainer's evaluation on a held-out split.
      encoder_states (optional): ``"<module>:<name>"`` of the kind's `jaxscale.serving.states.EncoderStateParts`
        (what the state builder needs: current histories, the offline encoder), loaded when first asked for.
    """

    kind: str
    config: type
    tables: Callable[[Any], Sequence[TableConfig]]
    ids: Callable[[Any, Mapping], dict]
    build: Callable[..., Any]
    loss: Callable[..., tuple]
    synthetic: Callable[..., Any]
    parquet_columns: Callable[[Any], tuple]
    summarize: Callable[[Any, list], dict] = lambda cfg, batches: {}
    forward: Callable[..., dict] | None = None
    objective: Callable[..., tuple] | None = None
    data_sources: Mapping[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    score: Callable[..., tuple] | None = None
    encoder_states: str | None = None


_SPECS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Adds (or replaces) a model kind."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"register expects a ModelSpec, got {type(spec).__name__}")
    _SPECS[spec.kind] = spec
    return spec


def _entry_points() -> dict:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)}


def kinds() -> list[str]:
    return sorted(set(_entry_points()) | set(_SPECS))


def get(kind: str) -> ModelSpec:
    """The spec of `kind` (registered, or loaded from its entry point); ValueError listing the kinds otherwise."""
    if kind in _SPECS:
        return _SPECS[kind]
    ep = _entry_points().get(kind)
    if ep is None:
        raise ValueError(f"unknown model kind {kind!r}; known kinds: {kinds()}")
    spec = ep.load()
    if not isinstance(spec, ModelSpec) or spec.kind != kind:
        raise RuntimeError(f"entry point {kind} = {ep.value!r} is not the ModelSpec of kind {kind!r}")
    _SPECS[kind] = spec
    return spec
