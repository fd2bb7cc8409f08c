"""A synthetic serving workload: 200 shared features, 3 models x 2 versions each reading 20-60 of them.

Used by the tests, the trimmer benchmark (`experiments/serving/bench_trimmer.py`) and the docs. Features mimic a
ranking request (one row per candidate):

- dense floats: counters (``log1p`` of Poisson counts, few distinct values), ratios in [0, 1], binary flags and
  pretrained embeddings (16-64 dims, incompressible), all float32;
- id lists: int32 ``[L]`` with ``L`` in 5..100, Zipf-distributed ids, ``-1`` padding after a random length;
- single ids: int32 ``[]`` (one id per example, e.g. the candidate's creator).

Each model is a small JAX function over its feature dict: dense features concatenated, id features hashed into one
embedding table and mean-pooled (padding ignored), a ReLU layer and a head. ``ctr/1`` declares three features it
never reads, so signature extraction has something to find. `DemoModel.reference` is the same computation in
NumPy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxscale.serving.signature import FeatureSpec

UNIVERSE_SIZE = 200
TABLE_ROWS, EMBED_DIM, HIDDEN = 512, 8, 32
_HASH = np.uint32(2654435761)

# (model, version): (number of features read, extra declared-but-unused features, outputs, seed offset)
MODEL_SPECS = {
    ("ctr", "1"): (37, 3, "score"),
    ("ctr", "2"): (55, 0, "score"),
    ("save", "1"): (24, 0, "two_heads"),
    ("save", "2"): (30, 0, "two_heads"),
    ("hide", "1"): (20, 0, "array"),
    ("hide", "2"): (60, 0, "array"),
}


def _kind(spec: FeatureSpec) -> str:
    return spec.name.split("_", 1)[0]


def feature_universe(n: int = UNIVERSE_SIZE, seed: int = 0) -> tuple[FeatureSpec, ...]:
    """``n`` features: ~20% counters, 15% ratios, 10% flags, 10% embeddings, 35% id lists, 10% single ids."""
    rng = np.random.default_rng(seed)
    kinds = rng.choice(["count", "ratio", "flag", "emb", "ids", "id"], size=n, p=[0.2, 0.15, 0.1, 0.1, 0.35, 0.1])
    out = []
    for i, kind in enumerate(kinds):
        name = f"{kind}_{i:03d}"
        if kind == "count":
            out.append(FeatureSpec(name, "float32", (int(rng.choice([1, 2, 4, 8])),)))
        elif kind == "ratio":
            out.append(FeatureSpec(name, "float32", (int(rng.choice([1, 2, 4])),)))
        elif kind == "flag":
            out.append(FeatureSpec(name, "float32", (1,)))
        elif kind == "emb":
            out.append(FeatureSpec(name, "float32", (int(rng.choice([16, 32, 64])),)))
        elif kind == "ids":
            out.append(FeatureSpec(name, "int32", (int(rng.choice([5, 10, 20, 50, 100])),)))
        else:
            out.append(FeatureSpec(name, "int32", ()))
    return tuple(out)


def make_request(universe, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One request: every feature of the universe for ``batch`` candidates."""
    out = {}
    for spec in universe:
        shape, kind = (batch, *spec.shape), _kind(spec)
        if kind == "count":
            v = np.log1p(rng.poisson(rng.uniform(0.2, 20.0), shape))
        elif kind == "ratio":
            v = rng.beta(1.0, 8.0, shape)
        elif kind == "flag":
            v = rng.random(shape) < 0.3
        elif kind == "emb":
            v = rng.standard_normal(shape) * 0.1
        elif kind == "ids":
            v = np.minimum(rng.zipf(1.3, shape), 1_000_000) - 1
            v[np.arange(shape[1])[None, :] >= rng.integers(0, shape[1] + 1, (batch, 1))] = -1
        else:
            v = np.minimum(rng.zipf(1.2, shape), 10_000_000) - 1
        out[spec.name] = np.asarray(v).astype(spec.dtype)
    return out


def batch_sizes(n: int, rng: np.random.Generator, median: int = 64, high: int = 512) -> np.ndarray:
    """Candidates per request: log-normal around ``median`` (sigma 0.9), clipped to [1, high]."""
    return np.clip(np.round(rng.lognormal(np.log(median), 0.9, n)), 1, high).astype(int)


@dataclass(frozen=True)
class DemoModel:
    model: str
    version: str
    declared: tuple[FeatureSpec, ...]
    reads: tuple[str, ...]  # the features the function actually uses (declared order)
    head: str  # "score" -> {"score": [B]}; "two_heads" -> {"save": [B], "repin": [B]}; "array" -> [B, 2]
    params: Mapping[str, np.ndarray]

    @property
    def unused(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.declared if s.name not in set(self.reads))

    def _specs(self):
        by_name = {s.name: s for s in self.declared}
        return [by_name[n] for n in self.reads]

    def fn(self, features):
        """The JAX model (export this)."""
        import jax
        import jax.numpy as jnp

        p = {k: jnp.asarray(v) for k, v in self.params.items()}
        parts = []
        for salt, spec in enumerate(self._specs()):
            x = features[spec.name]
            if spec.dtype == "float32":
                parts.append(x.reshape(x.shape[0], -1))
                continue
            ids = x if x.ndim == 2 else x[:, None]
            valid = ids >= 0
            rows = (ids.astype(jnp.uint32) * _HASH + jnp.uint32(salt)) % TABLE_ROWS
            emb = p["table"][rows.astype(jnp.int32)] * valid[..., None]
            parts.append(emb.sum(1) / jnp.maximum(valid.sum(1, keepdims=True), 1))
        h = jax.nn.relu(jnp.concatenate(parts, -1) @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        return self._head(logits, jax.nn.sigmoid, jax.nn.softmax)

    def reference(self, features: Mapping[str, np.ndarray]):
        """The same model in NumPy (float64 internally), for tests."""
        p = {k: np.asarray(v, np.float64) for k, v in self.params.items()}
        parts = []
        for salt, spec in enumerate(self._specs()):
            x = np.asarray(features[spec.name])
            if spec.dtype == "float32":
                parts.append(x.reshape(x.shape[0], -1).astype(np.float64))
                continue
            ids = x if x.ndim == 2 else x[:, None]
            valid = ids >= 0
            rows = (ids.astype(np.uint32) * _HASH + np.uint32(salt)) % TABLE_ROWS
            emb = p["table"][rows.astype(np.int64)] * valid[..., None]
            parts.append(emb.sum(1) / np.maximum(valid.sum(1, keepdims=True), 1))
        h = np.maximum(np.concatenate(parts, -1) @ p["w1"] + p["b1"], 0)
        logits = h @ p["w2"] + p["b2"]

        def softmax(z, axis=-1):
            e = np.exp(z - z.max(axis, keepdims=True))
            return e / e.sum(axis, keepdims=True)

        return self._head(logits, lambda z: 1 / (1 + np.exp(-z)), softmax)

    def _head(self, logits, sigmoid, softmax):
        if self.head == "score":
            return {"score": sigmoid(logits[:, 0])}
        if self.head == "two_heads":
            return {"save": sigmoid(logits[:, 0]), "repin": sigmoid(logits[:, 1])}
        return softmax(logits, axis=-1)


def _input_dim(specs) -> int:
    return sum(int(np.prod(s.shape)) if s.dtype == "float32" else EMBED_DIM for s in specs)


def demo_models(universe=None, seed: int = 0) -> list[DemoModel]:
    """The six model versions of `MODEL_SPECS`; each reads a mix of dense and id features of ``universe``."""
    universe = feature_universe() if universe is None else tuple(universe)
    models = []
    for i, ((model, version), (n_read, n_unused, head)) in enumerate(MODEL_SPECS.items()):
        rng = np.random.default_rng(seed * 1000 + i)
        picked = rng.choice(len(universe), size=n_read + n_unused, replace=False)
        declared = tuple(universe[j] for j in sorted(picked))
        unused = {universe[j].name for j in rng.choice(picked, size=n_unused, replace=False)}
        reads = tuple(s.name for s in declared if s.name not in unused)
        specs = [s for s in declared if s.name in set(reads)]
        d = _input_dim(specs)
        n_out = 1 if head == "score" else 2
        params = {
            "table": (rng.standard_normal((TABLE_ROWS, EMBED_DIM)) * 0.5).astype(np.float32),
            "w1": (rng.standard_normal((d, HIDDEN)) / np.sqrt(d)).astype(np.float32),
            "b1": (rng.standard_normal(HIDDEN) * 0.1).astype(np.float32),
            "w2": (rng.standard_normal((HIDDEN, n_out)) / np.sqrt(HIDDEN)).astype(np.float32),
            "b2": np.zeros(n_out, np.float32),
        }
        models.append(DemoModel(model, version, declared, reads, head, params))
    return models


def export_demo(store: str | Path, seed: int = 0, *, overwrite: bool = False):
    """Export the six demo model versions into ``store``; returns their signatures (ctr/1 reports 3 unused)."""
    import warnings

    from jaxscale.serving.export import UnusedFeatureWarning, export_model

    signatures = []
    for m in demo_models(feature_universe(seed=seed), seed=seed):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnusedFeatureWarning)  # expected for ctr/1; recorded in its signature
            exported = export_model(
                m.fn, m.declared, model=m.model, version=m.version, store=store, overwrite=overwrite
            )
        signatures.append(exported.signature)
    return signatures
