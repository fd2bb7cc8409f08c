"""Export a model over a feature dict with `jax.export`, find the declared features it never reads, write both.

A served model is a JAX function ``fn(features: dict[str, Array]) -> Array | dict[str, Array]`` whose inputs are
exactly the features its signature declares, each ``[batch, *shape]``. Export does two lowerings:

1. at a concrete batch size, to learn which inputs survive: jit drops unused inputs and
   `Exported.module_kept_var_idx` lists the kept ones. (With a symbolic batch size, JAX keeps every input to
   compute the dimension variable, so this check needs the concrete lowering.)
2. with a symbolic batch dimension, the artifact that is served (one compiled module for every batch size).

A declared feature that the compiled function does not read is recorded in the signature (``unused``) and
reported: ``on_unused='warn'`` (default) issues `UnusedFeatureWarning`, ``'error'`` raises `UnusedFeatureError`,
``'ignore'`` only records it. A feature the function reads that is not declared is always an error
(`UndeclaredFeatureError`): the function sees a mapping holding only the declared features.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax import export as jax_export

from jaxscale.infra import atomic
from jaxscale.serving import store as store_lib
from jaxscale.serving.signature import BATCH, FeatureSpec, Signature, SignatureError, check_name

ON_UNUSED = ("warn", "error", "ignore")
_PROBE_BATCH = 2
_BATCH_SYMBOL = "batch"


class UnusedFeatureWarning(UserWarning):
    """A model declares features its compiled function never reads."""


class UnusedFeatureError(ValueError):
    """Raised by export with ``on_unused='error'``: a model declares features its compiled function never reads."""


class UndeclaredFeatureError(KeyError):
    """A model function reads a feature its signature does not declare."""

    def __str__(self):  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class DeclaredFeatures(Mapping):
    """The feature dict a model function sees while exporting: reading an undeclared name is a clear error."""

    def __init__(self, label: str, features: Mapping):
        self._label, self._features = label, dict(features)

    def __getitem__(self, name):
        try:
            return self._features[name]
        except KeyError:
            raise UndeclaredFeatureError(
                f"model {self._label} reads feature {name!r}, which its signature does not declare "
                f"(declared: {sorted(self._features)})"
            ) from None

    def get(self, name, default=None):  # a .get() of an undeclared feature is still a read of it
        return self[name]

    def __contains__(self, name):
        return name in self._features

    def __iter__(self) -> Iterator[str]:
        return iter(self._features)

    def __len__(self) -> int:
        return len(self._features)


@dataclass(frozen=True)
class ExportedModel:
    """A model version ready to serve: its signature and the deserialized `jax.export.Exported`."""

    signature: Signature
    exported: jax_export.Exported

    def call(self, features: Mapping[str, np.ndarray]):
        """Run the exported module on ``{declared feature: array}`` (all declared features, any batch size)."""
        return self.exported.call({name: features[name] for name in self.signature.feature_names})


def _avals(features: Sequence[FeatureSpec], batch) -> dict[str, jax.ShapeDtypeStruct]:
    return {f.name: jax.ShapeDtypeStruct((batch, *f.shape), np.dtype(f.dtype)) for f in features}


def _unused_features(exported: jax_export.Exported, avals: Mapping[str, jax.ShapeDtypeStruct]) -> list[str]:
    """Map `module_kept_var_idx` (indices into the flattened ``((features,), {})`` inputs) back to names."""
    paths = jax.tree_util.tree_flatten_with_path(((dict(avals),), {}))[0]
    names = [path[-1].key for path, _ in paths]
    kept = set(exported.module_kept_var_idx)
    return [names[i] for i in range(len(names)) if i not in kept]


def _output_specs(label: str, exported: jax_export.Exported) -> tuple[FeatureSpec, ...]:
    """Outputs must be one array (named 'output') or a flat dict of arrays, each with the batch dimension first."""
    probe = jax.tree_util.tree_unflatten(exported.out_tree, list(range(exported.out_tree.num_leaves)))
    if isinstance(probe, int):
        names = ["output"]
    elif isinstance(probe, dict) and probe and all(isinstance(v, int) for v in probe.values()):
        names = [None] * len(probe)
        for name, i in probe.items():
            names[i] = check_name("output", name)
    else:
        raise SignatureError(f"model {label}: outputs must be an array or a flat dict of arrays, got {probe!r}")
    specs = []
    for name, aval in zip(names, exported.out_avals):
        shape = aval.shape
        if not shape or str(shape[0]) != _BATCH_SYMBOL or not all(isinstance(d, int) for d in shape[1:]):
            raise SignatureError(
                f"model {label}: output {name!r} has shape {shape}; outputs need the batch dimension first and "
                "fixed sizes after it"
            )
        specs.append(FeatureSpec(str(name), np.dtype(aval.dtype).name, tuple(int(d) for d in shape[1:])))
    return tuple(specs)


def export_model(
    fn: Callable,
    features: Sequence[FeatureSpec],
    *,
    model: str,
    version: str,
    store: str | Path | None = None,
    on_unused: str = "warn",
    platforms: Sequence[str] | None = None,
    overwrite: bool = False,
    independent_examples: bool = False,
) -> ExportedModel:
    """Export ``fn`` over the declared ``features``; with ``store``, write the artifact then the signature.

    Versions are immutable: writing over an existing ``<store>/<model>/<version>`` needs ``overwrite=True``.
    ``independent_examples=True`` declares that each example is scored on its own (recorded in the signature:
    leaves then pad batches to buckets and compile them all at warm-up).
    """
    if on_unused not in ON_UNUSED:
        raise ValueError(f"on_unused must be one of {ON_UNUSED}, got {on_unused!r}")
    declared = Signature(model, version, tuple(features))  # validates names, dtypes, shapes, duplicates
    label = declared.label

    def call(feats):
        return fn(DeclaredFeatures(label, feats))

    kwargs = {} if platforms is None else {"platforms": tuple(platforms)}
    probe_avals = _avals(declared.features, _PROBE_BATCH)
    probe = jax_export.export(jax.jit(call), **kwargs)(probe_avals)
    unused = _unused_features(probe, probe_avals)

    (batch,) = jax_export.symbolic_shape(_BATCH_SYMBOL)
    exported = jax_export.export(jax.jit(call), **kwargs)(_avals(declared.features, batch))
    _check_matches(declared, exported, f"model {label}")
    artifact = bytes(exported.serialize())
    signature = Signature(
        model,
        version,
        declared.features,
        outputs=_output_specs(label, exported),
        unused=tuple(unused),
        artifact=store_lib.ARTIFACT,
        artifact_sha256=hashlib.sha256(artifact).hexdigest(),
        independent_examples=independent_examples,
    )
    if unused:
        message = (
            f"model {label} declares {len(unused)} feature(s) its compiled function never reads: {unused}; "
            "they are recorded as unused in its signature and not sent to it"
        )
        if on_unused == "error":
            raise UnusedFeatureError(message)
        if on_unused == "warn":
            warnings.warn(message, UnusedFeatureWarning, stacklevel=2)
    if store is not None:
        sig_path = store_lib.signature_path(store, model, version)
        if sig_path.exists() and not overwrite:
            raise FileExistsError(f"{sig_path} exists: model versions are immutable (pass overwrite=True)")
        atomic.write_bytes(store_lib.artifact_path(store, model, version), artifact)
        signature.save(sig_path)
    return ExportedModel(signature, exported)


def load_model(store: str | Path, model: str, version: str) -> ExportedModel:
    """Load a version from the store, checking the artifact against its signature (hash, inputs, outputs)."""
    sig_path = store_lib.signature_path(store, model, version)
    signature = Signature.load(sig_path)
    if signature.key != (model, version):
        raise SignatureError(f"{sig_path}: describes {signature.label}, expected {model}/{version}")
    art_path = sig_path.parent / (signature.artifact or store_lib.ARTIFACT)
    try:
        data = art_path.read_bytes()
    except OSError as e:
        raise SignatureError(f"{art_path}: cannot read the exported model: {e}") from None
    if signature.artifact_sha256 and hashlib.sha256(data).hexdigest() != signature.artifact_sha256:
        raise SignatureError(f"{art_path}: sha256 does not match {sig_path} (artifact and signature disagree)")
    exported = jax_export.deserialize(bytearray(data))
    _check_matches(signature, exported, art_path)
    return ExportedModel(signature, exported)


def _check_matches(signature: Signature, exported: jax_export.Exported, where) -> None:
    """The exported inputs are exactly the declared features (JAX turns 64-bit inputs into 32-bit ones unless
    ``jax_enable_x64`` is on; this catches that too)."""
    paths = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(exported.in_tree, exported.in_avals))[0]
    got = {path[-1].key: aval for path, aval in paths}
    if sorted(got) != sorted(signature.feature_names):
        raise SignatureError(f"{where}: inputs {sorted(got)} differ from the signature's {signature.feature_names}")
    for name, aval in got.items():
        spec = signature.spec(name)
        if np.dtype(aval.dtype).name != spec.dtype or tuple(aval.shape[1:]) != spec.shape:
            raise SignatureError(
                f"{where}: input {name!r} is {aval.dtype}{list(aval.shape)}, the signature declares "
                f"{spec.dtype}{[BATCH, *spec.shape]} (64-bit features need jax_enable_x64)"
            )
