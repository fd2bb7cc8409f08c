"""Which version of a model answers a client that names none: the root's config file and its version policies.

TF Serving's model config names the versions served and labels one "stable"; a rollout shifts traffic between
two by weight (Envoy's weighted clusters). The root's config file says the same in one place, and `/admin/reload`
re-reads it without a restart:

    leaves:                                  # every leaf, as --leaf says it
      - {model: ctr, version: "1", url: "http://127.0.0.1:8001"}
      - {model: ctr, version: "2", url: "http://127.0.0.1:8002", timeout_s: 0.5, max_in_flight: 16}
    models:
      ctr:
        default: "1"                         # a client naming no version gets this one
        split: {"1": 90, "2": 10}            # ... or the split's pick (weights), deterministic per request id

YAML or JSON (JSON is YAML). A client naming a version (``models=ctr/2``, ``?version=2``) gets it. A model with
neither a default nor a split keeps the old rule: `/predict` without ``models`` asks every version of it, and
``:retrieve`` needs ``?version=`` once it has two. The pick hashes the request id (``X-Request-Id``), so a client
that retries with the same id gets the same version, and the shares match the weights over many ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from jaxscale.serving.signature import check_name


class ConfigFileError(ValueError):
    """The root's config file is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class VersionPolicy:
    """How the root picks a version of ``model`` for a client that names none: the ``split``'s weighted pick
    (when it has one), else ``default``."""

    model: str
    default: str | None = None
    split: tuple[tuple[str, float], ...] = ()  # (version, weight), weights >= 0, sum > 0

    def versions(self) -> set[str]:
        return {v for v, _ in self.split} | ({self.default} if self.default else set())

    def pick(self, request_id: str) -> str | None:
        """The version for a request (None: the policy names none). Deterministic per request id."""
        if not self.split:
            return self.default
        total = sum(w for _, w in self.split)
        digest = hashlib.sha256(f"{self.model}\0{request_id}".encode()).digest()
        point = int.from_bytes(digest[:8], "big") / 2.0**64 * total
        for version, weight in self.split:
            if point < weight:
                return version
            point -= weight
        return next(v for v, w in reversed(self.split) if w > 0)  # rounding at the very top

    def to_json(self) -> dict:
        return {"default": self.default, "split": dict(self.split)}


LEAF_KEYS = {"model": str, "version": str, "url": str, "timeout_s": (int, float), "max_in_flight": int}


@dataclass(frozen=True)
class RootFile:
    """A config file, read and checked: the leaves (keyword arguments of `root.LeafAddress`) and the policies."""

    leaves: tuple[dict, ...]
    policies: Mapping[str, VersionPolicy]


def read_root_file(path: str | Path) -> RootFile:
    """The config file at ``path`` (YAML or JSON), checked; `ConfigFileError` naming the key otherwise."""
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigFileError(f"{path}: cannot read the root config: {e}") from None
    return parse_root_file(doc, str(path))


def parse_root_file(doc, where: str) -> RootFile:
    def fail(key: str, what: str):
        raise ConfigFileError(f"{where}: {key}: {what}")

    if not isinstance(doc, dict):
        fail("(top)", f"must be a mapping with 'leaves' and 'models', got {type(doc).__name__}")
    unknown = sorted(set(doc) - {"leaves", "models"})
    if unknown:
        fail(unknown[0], "unknown key (known: leaves, models)")
    leaves = doc.get("leaves")
    if not isinstance(leaves, list) or not leaves:
        fail("leaves", "must be a non-empty list of {model, version, url[, timeout_s][, max_in_flight]}")
    out, served = [], {}
    for i, leaf in enumerate(leaves):
        key = f"leaves[{i}]"
        if not isinstance(leaf, dict):
            fail(key, f"must be a mapping, got {type(leaf).__name__}")
        for name in ("model", "version", "url"):
            if name not in leaf:
                fail(f"{key}.{name}", "missing")
        for name, value in leaf.items():
            if name not in LEAF_KEYS:
                fail(f"{key}.{name}", f"unknown key (known: {', '.join(LEAF_KEYS)})")
            if name == "version" and isinstance(value, int) and not isinstance(value, bool):
                value = leaf[name] = str(value)  # version: 2 (YAML reads a number) is version "2"
            if isinstance(value, bool) or not isinstance(value, LEAF_KEYS[name]):
                fail(f"{key}.{name}", f"wrong type {type(value).__name__}")
        try:
            check_name("model", leaf["model"])
            check_name("version", leaf["version"])
        except ValueError as e:
            fail(key, str(e))
        label = (leaf["model"], leaf["version"])
        if label in served:
            fail(key, f"{label[0]}/{label[1]} is already served by leaves[{served[label]}]")
        served[label] = i
        out.append(dict(leaf))
    models = doc.get("models") or {}
    if not isinstance(models, dict):
        fail("models", f"must be a mapping model -> {{default, split}}, got {type(models).__name__}")
    policies = {}
    for model, spec in models.items():
        key = f"models.{model}"
        versions = sorted(v for m, v in served if m == model)
        if not versions:
            fail(key, "no leaf serves this model")
        if not isinstance(spec, dict):
            fail(key, "must be a mapping with 'default' and/or 'split'")
        unknown = sorted(set(spec) - {"default", "split"})
        if unknown:
            fail(f"{key}.{unknown[0]}", "unknown key (known: default, split)")
        default = spec.get("default")
        if isinstance(default, int) and not isinstance(default, bool):
            default = str(default)
        if default is not None and default not in versions:
            fail(f"{key}.default", f"version {default!r} has no leaf (served: {versions})")
        split = spec.get("split") or {}
        if not isinstance(split, dict):
            fail(f"{key}.split", "must be a mapping version -> weight")
        pairs = []
        for version, weight in split.items():
            version = str(version)
            if version not in versions:
                fail(f"{key}.split.{version}", f"version has no leaf (served: {versions})")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
                fail(f"{key}.split.{version}", f"weight must be a number >= 0, got {weight!r}")
            pairs.append((version, float(weight)))
        if split and not sum(w for _, w in pairs) > 0:
            fail(f"{key}.split", "weights must not all be 0")
        if default is None and not split:
            fail(key, "needs a default or a split")
        policies[model] = VersionPolicy(model, default, tuple(pairs))
    return RootFile(tuple(out), policies)
