"""Model signatures: the features a served model declares, the ones it actually reads, and its outputs.

A signature is the source of truth of the feature trimmer. It is written next to the exported model at export
time (`jaxscale.serving.export`), read by the leaf that serves the model (to check requests) and by the root
(to send each leaf only the features its model uses). Shapes are per example; every feature and output also
has a leading batch dimension, written ``"batch"`` in the JSON file.

This module needs NumPy only (no JAX), so a root process can use it without starting JAX.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from jaxscale.infra import atomic

SIGNATURE_FORMAT = "jaxscale.signature/1"
BATCH = "batch"
# Dtypes that travel losslessly through the wire format (Arrow) and that jax.export accepts.
DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"}
)
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$")


def _dumps(obj: dict) -> str:
    """JSON with one line per top-level field and per feature/output: easy to read and to diff."""
    lines = []
    for key, value in obj.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            items = ",\n".join(f"  {json.dumps(v)}" for v in value)
            lines.append(f" {json.dumps(key)}: [\n{items}\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


class FeatureError(ValueError):
    """A request's features do not match a model's signature. Names the feature, and the model when known."""

    def __init__(self, message: str, *, feature: str, reason: str, model: str | None = None, version=None):
        super().__init__(message)
        self.feature, self.reason, self.model, self.version = feature, reason, model, version

    def to_json(self) -> dict:
        out = {"error": str(self), "feature": self.feature, "reason": self.reason}
        if self.model is not None:
            out.update(model=self.model, version=self.version)
        return out


class SignatureError(ValueError):
    """A signature (file or object) is invalid. The message names the file or field."""


def check_name(kind: str, name) -> str:
    """Names become JSON keys, Arrow column names and (for models/versions) directory names: keep them plain."""
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise SignatureError(f"invalid {kind} name {name!r}: use letters, digits and _ . : - (not starting with . : -)")
    return name


@dataclass(frozen=True)
class FeatureSpec:
    """One named array per example: ``dtype`` and per-example ``shape`` (the batch dimension is implicit)."""

    name: str
    dtype: str
    shape: tuple[int, ...] = ()

    def __post_init__(self):
        check_name("feature", self.name)
        dtype = str(self.dtype)
        if dtype not in DTYPES:
            raise SignatureError(f"feature {self.name!r}: unsupported dtype {dtype!r} (supported: {sorted(DTYPES)})")
        shape = tuple(self.shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
            raise SignatureError(f"feature {self.name!r}: per-example shape {shape!r} must be positive integers")
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", shape)

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": [BATCH, *self.shape]}

    @classmethod
    def from_json(cls, obj, where: str) -> FeatureSpec:
        if not isinstance(obj, dict) or set(obj) != {"name", "dtype", "shape"}:
            raise SignatureError(f"{where}: expected an object with keys name, dtype, shape; got {obj!r}")
        shape = obj["shape"]
        if not isinstance(shape, list) or not shape or shape[0] != BATCH:
            raise SignatureError(f"{where}: shape must be a list starting with {BATCH!r}, got {shape!r}")
        try:
            return cls(obj["name"], obj["dtype"], tuple(shape[1:]))
        except SignatureError as e:
            raise SignatureError(f"{where}: {e}") from None


def _specs(kind: str, specs: Iterable[FeatureSpec]) -> tuple[FeatureSpec, ...]:
    specs = tuple(specs)
    seen = set()
    for s in specs:
        if not isinstance(s, FeatureSpec):
            raise SignatureError(f"{kind} must be FeatureSpec objects, got {s!r}")
        if s.name in seen:
            raise SignatureError(f"{kind}: {s.name!r} is declared twice")
        seen.add(s.name)
    return specs


@dataclass(frozen=True)
class Signature:
    """What a model version declares (``features``), which of them its compiled function never reads (``unused``,
    found by `jax.export` at export time) and what it returns (``outputs``).

    ``required`` (declared minus unused, in declared order) is what a leaf needs in a request and what the root
    sends it. ``artifact`` / ``artifact_sha256`` pin the serialized `jax.export.Exported` this signature describes.
    ``independent_examples``: the exporter declares that each example's outputs depend on that example alone (no
    batch statistics, no attention across the batch), so a leaf may pad a batch with zero rows and drop their
    outputs: it then serves batch buckets by default (one compiled program per bucket, all compiled at warm-up).
    """

    model: str
    version: str
    features: tuple[FeatureSpec, ...]
    outputs: tuple[FeatureSpec, ...] = ()
    unused: tuple[str, ...] = ()
    artifact: str | None = None
    artifact_sha256: str | None = None
    independent_examples: bool = False
    _by_name: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_name("model", self.model)
        check_name("version", self.version)
        if not isinstance(self.independent_examples, bool):
            raise SignatureError(
                f"model {self.model}/{self.version}: independent_examples must be true or false, "
                f"got {self.independent_examples!r}"
            )
        features = _specs("features", self.features)
        if not features:
            raise SignatureError(f"model {self.model}/{self.version}: a signature declares at least one feature")
        object.__setattr__(self, "features", features)
        object.__setattr__(self, "outputs", _specs("outputs", self.outputs))
        by_name = {s.name: s for s in features}
        unknown = [n for n in self.unused if n not in by_name]
        if unknown:
            raise SignatureError(f"model {self.model}/{self.version}: unused features {unknown} are not declared")
        object.__setattr__(self, "unused", tuple(n for n in by_name if n in set(self.unused)))
        object.__setattr__(self, "_by_name", by_name)

    @property
    def key(self) -> tuple[str, str]:
        return (self.model, self.version)

    @property
    def label(self) -> str:
        return f"{self.model}/{self.version}"

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    @property
    def required(self) -> tuple[str, ...]:
        """The features the compiled model reads: the only ones a request must carry and the root sends."""
        unused = set(self.unused)
        return tuple(n for n in self._by_name if n not in unused)

    def spec(self, name: str) -> FeatureSpec:
        return self._by_name[name]

    def check(self, columns: Mapping[str, tuple[str, tuple[int, ...]]], *, required_only: bool = True) -> None:
        """Check a request's ``{feature: (dtype, per-example shape)}`` against this signature.

        Every required feature must be present with the declared dtype and shape; a declared-but-unused feature
        may be absent (the leaf fills it: its compiled function never reads it) but, when present, must match too.
        Features the signature does not declare are allowed (the root may send more when it fails open) and
        ignored. Raises `FeatureError` naming the first offending feature (in declared order).
        """
        required = set(self.required) if required_only else set(self._by_name)
        for name, spec in self._by_name.items():
            got = columns.get(name)
            if got is None:
                if name in required:
                    raise FeatureError(
                        f"model {self.label}: required feature {name!r} is missing from the request "
                        f"(expected {spec.dtype}{[BATCH, *spec.shape]})",
                        feature=name,
                        reason="missing",
                        model=self.model,
                        version=self.version,
                    )
                continue
            dtype, shape = got
            if dtype != spec.dtype:
                raise FeatureError(
                    f"model {self.label}: feature {name!r} has dtype {dtype}, the signature declares {spec.dtype}",
                    feature=name,
                    reason="dtype",
                    model=self.model,
                    version=self.version,
                )
            if tuple(shape) != spec.shape:
                raise FeatureError(
                    f"model {self.label}: feature {name!r} has shape {[BATCH, *shape]}, "
                    f"the signature declares {[BATCH, *spec.shape]}",
                    feature=name,
                    reason="shape",
                    model=self.model,
                    version=self.version,
                )

    def to_json(self) -> dict:
        out = {
            "format": SIGNATURE_FORMAT,
            "model": self.model,
            "version": self.version,
            "features": [s.to_json() for s in self.features],
            "unused_features": list(self.unused),
            "outputs": [s.to_json() for s in self.outputs],
            "artifact": self.artifact,
            "artifact_sha256": self.artifact_sha256,
        }
        if self.independent_examples:  # written only when declared: older readers read the others unchanged
            out["independent_examples"] = True
        return out

    @classmethod
    def from_json(cls, obj, where: str = "signature") -> Signature:
        if not isinstance(obj, dict):
            raise SignatureError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if obj.get("format") != SIGNATURE_FORMAT:
            raise SignatureError(f"{where}: field 'format' is {obj.get('format')!r}, expected {SIGNATURE_FORMAT!r}")
        expected = {"format", "model", "version", "features", "unused_features", "outputs", "artifact"}
        missing = sorted(expected - set(obj))
        if missing:
            raise SignatureError(f"{where}: missing field(s) {missing}")
        extra = sorted(set(obj) - expected - {"artifact_sha256", "independent_examples"})
        if extra:
            raise SignatureError(f"{where}: unknown field(s) {extra}")
        for key in ("features", "outputs", "unused_features"):
            if not isinstance(obj[key], list):
                raise SignatureError(f"{where}: field {key!r} must be a list")
        try:
            return cls(
                model=obj["model"],
                version=obj["version"],
                features=tuple(
                    FeatureSpec.from_json(f, f"{where}: features[{i}]") for i, f in enumerate(obj["features"])
                ),
                outputs=tuple(FeatureSpec.from_json(f, f"{where}: outputs[{i}]") for i, f in enumerate(obj["outputs"])),
                unused=tuple(obj["unused_features"]),
                artifact=obj["artifact"],
                artifact_sha256=obj.get("artifact_sha256"),
                independent_examples=obj.get("independent_examples", False),
            )
        except SignatureError as e:
            msg = str(e)
            raise SignatureError(msg if msg.startswith(where) else f"{where}: {msg}") from None

    def save(self, path: str | Path) -> Path:
        """Write the JSON file atomically (a reader sees the old file or the new one, never a partial one)."""
        path = Path(path)
        atomic.write_bytes(path, _dumps(self.to_json()).encode())
        return path

    @classmethod
    def load(cls, path: str | Path) -> Signature:
        path = Path(path)
        try:
            obj = json.loads(path.read_bytes())
        except OSError as e:
            raise SignatureError(f"{path}: cannot read: {e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SignatureError(f"{path}: not valid JSON: {e}") from None
        return cls.from_json(obj, where=str(path))
