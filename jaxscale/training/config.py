"""The trainer's configuration: a tree of frozen, typed dataclasses loaded from YAML plus dotted overrides.

    cfg = load_config("jaxscale/configs/foundation_smoke.yaml", ["train.steps=50", "mesh.nodes=2"])

Values are type-checked against the field annotations (int, float, str, bool, Literal choices, Optional,
unions, tuples/lists, dicts, nested dataclasses). Every error is a `ConfigError` naming the full dotted
key. YAML is parsed with a safe loader only (tags such as `!!python/object` are refused) that reads YAML 1.2
floats: `1e-8` is a number, as users write it, not the string PyYAML's YAML 1.1 would make of it.
The defaults are the smoke foundation run on 8 simulated CPU devices.

The sections mirror the API: `embedding` IS `jaxscale.EmbeddingSettings`, the collection's one argument
(its checks, its YAML forms), and `model.<kind>` is the config dataclass the model kind registers
(`jaxscale.training.registry`). Loading a config imports no JAX.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import yaml

from jaxscale.engine.embedding.settings import EmbeddingSettings, SettingError
from jaxscale.training import registry

# Renamed keys: a config that uses the old name gets an error that says the new one.
RENAMED = {
    "embedding.comm_forward": "embedding.comm.forward",
    "embedding.comm_backward": "embedding.comm.backward",
    "embedding.learning_rate": "embedding.optimizer.learning_rate",
    "embedding.eps": "embedding.optimizer.eps",
}


class ConfigError(ValueError):
    """An invalid configuration; the message starts with the offending dotted key."""


def _err(key: str, message: str) -> ConfigError:
    err = ConfigError(f"{key}: {message}")
    err.key = key
    return err


def field_error(owner: str, field: str, message: str) -> ValueError:
    """A ValueError that names `owner.field` and carries `.field`, so config loading can report the full key."""
    err = ValueError(f"{owner}.{field} {message}")
    err.field = field
    return err


def check_int(owner: str, obj, field: str, minimum: int = 1) -> None:
    """The checks of a model config's `__post_init__`: `obj.field` is valid, else a `field_error`."""
    value = getattr(obj, field)
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise field_error(owner, field, f"must be an integer >= {minimum}, got {value!r}")


def check_float(owner: str, obj, field: str, low: float, high: float = math.inf, low_open: bool = False) -> None:
    value = getattr(obj, field)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"{'(' if low_open else '['}{low}, {high}]"
        raise field_error(owner, field, f"must be a number in {bound}, got {value!r}")


def check_choice(owner: str, obj, field: str, choices) -> None:
    value = getattr(obj, field)
    if value not in choices:
        raise field_error(owner, field, f"must be one of {choices}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    nodes: int = 1
    """Size of the 'node' axis (one process per node in a multi-process run)."""
    local: int = 8
    """Devices per node (the 'local' axis)."""
    cluster: str | None = None
    """The cluster's link figures for the planner (`embedding.topology=auto`): a preset of meshes/ (e.g.
    '8x8') or a YAML path; None: the preset named '<nodes>x<local>' when there is one, else the defaults of
    `jaxscale.engine.cluster.ClusterSpec`."""

    def __post_init__(self):
        for f in ("nodes", "local"):
            if getattr(self, f) < 1:
                raise _err(f, f"must be >= 1, got {getattr(self, f)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """`kind` names a registered model (`jaxscale.training.registry`); `model.<kind>` is that model's config dataclass.

    In YAML: `model: {kind: dlrm, dlrm: {emb_dim: 32}}`. Sections of other registered kinds may be given too
    (a config file that switches kind by override); each is validated by its own class.
    """

    kind: str = "foundation"
    sections: dict = dataclasses.field(default_factory=dict)
    """{kind: that model's config}; kinds not given take their defaults."""

    def __post_init__(self):
        for kind, section in self.sections.items():
            spec = registry.get(kind)
            if not isinstance(section, spec.config):
                raise _err(kind, f"must be a {spec.config.__name__}, got {type(section).__name__}")
        if self.kind not in self.sections:  # the active section is always explicit (equal configs compare equal)
            object.__setattr__(self, "sections", {**self.sections, self.kind: registry.get(self.kind).config()})

    @property
    def params(self):
        """The active model's config."""
        return self.section(self.kind)

    def section(self, kind: str):
        return self.sections[kind] if kind in self.sections else registry.get(kind).config()

    def __getattr__(self, name):
        """`cfg.model.<kind>` reads that model's section, as in the YAML."""
        if name in registry.kinds():
            return self.section(name)
        raise AttributeError(f"ModelConfig has no attribute or model section {name!r}")

    @classmethod
    def from_tree(cls, data: Mapping) -> ModelConfig:
        """The YAML form {kind: k, k: {...}, ...} -> ModelConfig (errors name the key inside the section)."""
        kind = data.get("kind", "foundation")
        if not isinstance(kind, str) or kind not in registry.kinds():
            hint = (
                "" if registry.kinds() else ": none is registered, install the package (`pip install --no-deps -e .`)"
            )
            raise _err("kind", f"must be one of {registry.kinds()}, got {kind!r}{hint}")
        sections = {}
        for key, value in data.items():
            if key == "kind":
                continue
            if key not in registry.kinds():
                close = difflib.get_close_matches(str(key), registry.kinds(), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise _err(str(key), f"unknown key{hint}; the model section has 'kind' and {registry.kinds()}")
            sections[key] = _build(registry.get(key).config, {} if value is None else value, key)
        return cls(kind=kind, sections=sections)

    def to_tree(self) -> dict:
        return {"kind": self.kind, **{k: _plain(v) for k, v in self.sections.items()}}


def _protocol(name: str):
    """The named protocol (`jaxscale.sequences.protocols`, pure data: no JAX); a ConfigError naming the known ones."""
    from jaxscale.sequences.protocols import PROTOCOLS

    if name not in PROTOCOLS:
        raise _err("data.sequences.protocol", f"must be one of {sorted(PROTOCOLS)}, got {name!r}")
    return PROTOCOLS[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequencesConfig:
    """A sequence store as a data source (`jaxscale.sequences.examples.SequenceBatches`, field for field).

    `split: day`: examples are (user, ts) anchors whose history is the user's point-in-time sequence (no
    event at or after ts); the store's last `eval_days` days are the held-out split. `split: leave_one_out`:
    each user's last event is the test target, the one before it the validation target (the trainer's
    'eval' split), every earlier one a train target whose history is what precedes it in (ts, arrival) order.
    """

    store: str | None = None
    """The store directory (the output of `python -m jaxscale.sequences backfill` or `stream`)."""
    sequence: str | None = None
    """The sequence's name in the compiled definitions."""
    defs: str | None = None
    """The compiled definitions JSON (`python -m jaxscale.sequences compile`)."""
    eval_days: int = 1
    min_history: int = 1
    """An anchor needs at least this many earlier events."""
    split: Literal["day", "leave_one_out"] = "day"
    """How examples split into train / held-out: 'day' (the last `eval_days` days are held out) or
    'leave_one_out' (per user: last event = test, the one before = validation, the rest = train)."""
    as_of_mode: Literal["event", "ingest", "visible"] = "event"
    """Which events a day-split history at ts holds: 'event' (event time < ts), 'ingest' (also received by
    the platform before ts) or 'visible' (also committed to the store before ts: what a server could have
    answered then; see jaxscale.sequences.examples)."""
    train_targets: Literal["every", "last"] = "every"
    """Leave-one-out train examples: every train target of each user, or only its last (one example per user:
    with the loss at every position, the user's whole train sequence once per epoch, as SASRec trains)."""
    protocol: str | None = None
    """The evaluation protocol the store was imported under (`jaxscale.sequences.protocols`: `literature`,
    `recbole`, `ml100k`): data-side settings every model and baseline of a run shares. It fixes the history
    length (a model whose `max_seq_len` differs is refused) and whether full ranking masks the user's history
    (`mask_history`, unless set here)."""
    mask_history: bool | None = None
    """Full ranking removes every item of the user's history from its candidates (the trainer's validation
    ranking and `python -m jaxscale.evaluate` alike). None: the protocol's choice (no protocol: False)."""

    @property
    def masks_history(self) -> bool:
        """Whether rankings of this data mask the user's history (the explicit setting, else the protocol's)."""
        if self.mask_history is not None:
            return self.mask_history
        return self.protocol is not None and _protocol(self.protocol).mask_history

    def __post_init__(self):
        if self.split not in ("day", "leave_one_out"):
            raise _err("split", f"must be one of ['day', 'leave_one_out'], got {self.split!r}")
        if self.as_of_mode not in ("event", "ingest", "visible"):
            raise _err("as_of_mode", f"must be one of ['event', 'ingest', 'visible'], got {self.as_of_mode!r}")
        if self.eval_days < 0:
            raise _err("eval_days", f"must be >= 0, got {self.eval_days}")
        if self.min_history < 1:
            raise _err("min_history", f"must be >= 1, got {self.min_history}")
        if self.protocol is not None:
            _protocol(self.protocol)
        if self.train_targets not in ("every", "last"):
            raise _err("train_targets", f"must be one of ['every', 'last'], got {self.train_targets!r}")
        if self.train_targets != "every" and self.split != "leave_one_out":
            raise _err("train_targets", f"{self.train_targets!r} needs split: leave_one_out")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = "synthetic"
    """'synthetic' (the model's generator), 'parquet' (`path`), or a source the model registers."""
    path: str | None = None
    """Parquet file of training examples (source='parquet')."""
    eval_path: str | None = None
    """Parquet file of held-out examples; None = no parquet eval."""
    zipf_exponent: float = 1.1
    scramble_ids: bool = False
    """Synthetic ids: False keeps hot ids at low ids (the worst case for contiguous row sharding)."""
    num_clusters: int = 32
    """Synthetic foundation data: hidden item clusters that drive next-item transitions."""
    seed: int = 0
    eval_batches: int = 4
    """Batches of the held-out split per evaluation."""
    invalid_ids: Literal["error", "count"] = "error"
    """An out-of-range id in a batch (checked on the host before dispatch): raise, naming the feature, table,
    id and where it came from; or count it (logged per step as `invalid_ids`) and treat it as padding."""
    sequences: SequencesConfig = dataclasses.field(default_factory=lambda: SequencesConfig())
    """`source: sequences`: the sequence store the examples are read from (`jaxscale.sequences`)."""

    def __post_init__(self):
        if self.source == "parquet" and not self.path:
            raise _err("path", "is required when source='parquet'")
        if not (self.zipf_exponent >= 0 and math.isfinite(self.zipf_exponent)):
            raise _err("zipf_exponent", f"must be a finite number >= 0, got {self.zipf_exponent}")
        if self.num_clusters < 1:
            raise _err("num_clusters", f"must be >= 1, got {self.num_clusters}")
        if self.eval_batches < 0:
            raise _err("eval_batches", f"must be >= 0, got {self.eval_batches}")
        if self.source == "sequences":
            for f in ("store", "sequence", "defs"):
                if not getattr(self.sequences, f):
                    raise _err(f"sequences.{f}", "is required when source='sequences'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 64
    """Global batch (all processes together); must divide evenly over the mesh."""
    learning_rate: float = 3e-3
    """Dense (optax adamw) peak learning rate."""
    weight_decay: float = 0.01
    warmup_steps: int = 10
    grad_clip_norm: float | None = 1.0
    eval_every: int = 50
    checkpoint_every: int = 0
    """0 = no checkpoints."""
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0
    workdir: str = "runs/foundation_smoke"
    nonfinite_policy: Literal["skip", "raise"] = "skip"
    """A non-finite loss/gradient: skip the update (and count it) or raise."""
    dense_grad_precision: Literal["fp32", "bf16"] = "fp32"
    """Wire precision of the dense gradient all-reduce. 'bf16' halves its bytes: the model's per-example
    forward runs data-parallel in shard_map and the trainer all-reduces the gradients itself (GPU runs also
    overlap it with the backward pass through XLA's latency-hiding scheduler, see jaxscale.infra.distributed)."""
    overflow_policy: Literal["error", "grow"] = "error"
    """An all-to-all capacity overflow (capacity_factor set): raise, or grow the capacity and recompile."""
    eval_metric: str | None = None
    """The key of the evaluation's output to monitor (e.g. 'eval_ndcg@10', 'eval_loss'): its best value so far
    is tracked at every evaluation (`eval_every`), the state at that step saved to <workdir>/best
    (`keep_best`) and early stopping watches it. None: nothing is monitored."""
    eval_mode: Literal["max", "min"] = "max"
    """Whether a larger ('max') or smaller ('min') `eval_metric` is better."""
    early_stopping_patience: int = 0
    """Evaluations in a row without improvement of `eval_metric` after which training stops; 0 = never."""
    keep_best: bool = True
    """Save the state of the best evaluation so far to <workdir>/best (`Trainer.restore_best`)."""
    eval_ranking_ks: tuple[int, ...] = ()
    """Full-corpus ranking at each evaluation: every example of the eval split (a leave-one-out split's
    validation users) scored against the whole item table (`jaxscale.training.ranking_eval.RankingEvaluator`), reported
    as eval_recall@K / eval_ndcg@K / eval_mrr@K for these K. Empty: off. Needs a model with `score`."""

    def __post_init__(self):
        for f in ("steps", "batch_size", "log_every", "keep_checkpoints"):
            if getattr(self, f) < 1:
                raise _err(f, f"must be >= 1, got {getattr(self, f)}")
        for f in ("warmup_steps", "eval_every", "checkpoint_every", "early_stopping_patience"):
            if getattr(self, f) < 0:
                raise _err(f, f"must be >= 0, got {getattr(self, f)}")
        if self.eval_mode not in ("max", "min"):
            raise _err("eval_mode", f"must be one of ['max', 'min'], got {self.eval_mode!r}")
        ks = self.eval_ranking_ks
        if isinstance(ks, (list, tuple)) and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in ks):
            object.__setattr__(self, "eval_ranking_ks", tuple(sorted(set(ks))))
        else:
            raise _err("eval_ranking_ks", f"must be a list of positive integers, got {ks!r}")
        if self.early_stopping_patience > 0 and self.eval_metric is None:
            raise _err(
                "eval_metric",
                f"is required when early_stopping_patience > 0 (got {self.early_stopping_patience}): name the key "
                f"of the evaluation's output to monitor, e.g. eval_loss (with eval_mode=min)",
            )
        if self.eval_metric is not None:
            if not self.eval_metric:
                raise _err("eval_metric", "must be null or a metric name, got ''")
            if self.eval_every == 0:
                raise _err("eval_metric", f"{self.eval_metric!r} is monitored, but eval_every=0 never evaluates")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise _err("learning_rate", f"must be a finite number > 0, got {self.learning_rate}")
        if not self.weight_decay >= 0:
            raise _err("weight_decay", f"must be >= 0, got {self.weight_decay}")
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise _err("grad_clip_norm", f"must be null or > 0, got {self.grad_clip_norm}")
        if not self.workdir:
            raise _err("workdir", "must be a non-empty path")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    embedding: EmbeddingSettings = dataclasses.field(default_factory=EmbeddingSettings)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self):
        devices = self.mesh.nodes * self.mesh.local
        if self.train.batch_size % devices:
            raise _err(
                "train.batch_size",
                f"{self.train.batch_size} is not divisible by the "
                f"{devices} devices of the {self.mesh.nodes}x{self.mesh.local} mesh",
            )
        self._check_protocol()
        if self.data.source not in ("synthetic", "parquet", *registry.get(self.model.kind).data_sources):
            known = ["synthetic", "parquet", *registry.get(self.model.kind).data_sources]
            raise _err(
                "data.source", f"must be one of {known} for model kind {self.model.kind!r}, got {self.data.source!r}"
            )

    def _check_protocol(self) -> None:
        """A protocol's history length is what every model of the run sees: a model that disagrees is refused."""
        seq = self.data.sequences
        if self.data.source != "sequences" or seq.protocol is None:
            return
        length = _protocol(seq.protocol).history_length
        have = getattr(self.model.params, "max_seq_len", None)
        if have is not None and have != length:
            raise _err(
                f"model.{self.model.kind}.max_seq_len",
                f"is {have} but data.sequences.protocol={seq.protocol!r} gives every model histories of {length} "
                f"events; set model.{self.model.kind}.max_seq_len={length}",
            )

    @property
    def local_batch_size(self) -> int:
        """Rows each process (node) feeds per step."""
        return self.train.batch_size // self.mesh.nodes


# --------------------------------------------------------------------------------------------- loading


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp, value, key: str):
    """Checks `value` against annotation `tp` and returns it in canonical form (tuples, floats)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, {} if value is None else value, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        raise _err(key, f"must be one of {list(choices)}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _err(key, f"is required (expected {_type_name(tp)}), got null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(e)
        deeper = [e for e in errors if e.key != key]  # the arm whose shape matched failed inside: report it
        if len(deeper) == 1:
            raise deeper[0]
        raise _err(key, " or ".join(str(e).split(": ", 1)[1] for e in errors))
    if tp is type(None):
        if value is None:
            return None
        raise _err(key, f"must be null, got {value!r}")
    if value is None:
        raise _err(key, f"is required (expected {_type_name(tp)}), got null")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '1e-3' (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin in (tuple, list, Sequence):
        if isinstance(value, (list, tuple)):
            args = typing.get_args(tp)
            if origin is tuple and args and args[-1] is not Ellipsis:
                if len(value) != len(args):
                    raise _err(key, f"must have {len(args)} entries, got {len(value)}")
                items = [_coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value))]
            else:
                elem = args[0] if args else Any
                items = [_coerce(elem, v, f"{key}[{i}]") for i, v in enumerate(value)]
            return list(items) if origin is list else tuple(items)
        raise _err(key, f"must be a list, got {type(value).__name__} {value!r}")
    elif origin in (dict, Mapping):
        if isinstance(value, dict):
            kt, vt = typing.get_args(tp) or (Any, Any)
            return {_coerce(kt, k, f"{key}.{k}"): _coerce(vt, v, f"{key}.{k}") for k, v in value.items()}
        raise _err(key, f"must be a mapping, got {type(value).__name__} {value!r}")
    else:
        raise _err(key, f"unsupported annotation {tp!r}")
    raise _err(key, f"must be {_type_name(tp)}, got {type(value).__name__} {value!r}")


def _build(cls, data, prefix: str):
    """Builds dataclass `cls` from a mapping; `prefix` is its dotted key ('' at the root)."""
    where = prefix or "<root>"
    if not isinstance(data, Mapping):
        raise _err(where, f"must be a mapping of {cls.__name__} fields, got {type(data).__name__} {data!r}")
    dotted = (lambda k: f"{prefix}.{k}") if prefix else (lambda k: str(k))
    for k in data:
        if dotted(k) in RENAMED:
            raise _err(dotted(k), f"was renamed to {RENAMED[dotted(k)]}")
    if hasattr(cls, "from_tree"):  # a section that reads its own YAML form; its errors name keys inside it
        try:
            return cls.from_tree(data)
        except ConfigError as e:
            raise _err(dotted(e.key), str(e).split(": ", 1)[1]) from None
        except SettingError as e:
            raise _err(dotted(e.field) if e.field else where, e.message) from None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for k in data:
        if k not in fields:
            close = difflib.get_close_matches(str(k), list(fields), n=1)
            hint = f" (did you mean {dotted(close[0])!r}?)" if close else ""
            raise _err(dotted(k), f"unknown key{hint}; {cls.__name__} has {sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], dotted(name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise _err(dotted(name), "is required")
    try:
        return cls(**kwargs)
    except ConfigError as e:  # raised by __post_init__ with the key relative to `cls`
        key = getattr(e, "key", None)
        raise _err(dotted(key) if key else where, str(e).split(": ", 1)[1] if key else str(e)) from None
    except SettingError as e:
        raise _err(dotted(e.field) if e.field else where, e.message) from None
    except ValueError as e:
        field = getattr(e, "field", None)
        raise _err(dotted(field) if field else where, str(e)) from None


class _SafeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` reading YAML 1.2 floats: PyYAML follows YAML 1.1, where ``1e-8`` (no dot) is a string,
    so ``eps: 1e-8`` or ``train.learning_rate=3e-4`` would be refused as "not a number"."""


_SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml(text_or_file):
    return yaml.load(text_or_file, Loader=_SafeLoader)  # noqa: S506 -- a SafeLoader: no !!python tags


def _apply_override(tree: dict, item: str) -> None:
    if "=" not in item:
        raise _err(item, "override must look like dotted.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise _err(key or item, "override key must be a dotted path like train.steps")
    try:
        value = _yaml(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise _err(key, f"cannot parse override value {raw!r}: {e}") from None
    node = tree
    for i, p in enumerate(parts[:-1]):
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise _err(".".join(parts[: i + 1]), f"is {child!r}, not a section; cannot set {key}")
        node = child
    node[parts[-1]] = value


def load_config(path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Config from a YAML file (None: defaults) and `dotted.key=value` overrides (values parsed as YAML)."""
    tree: Any = {}
    if path is not None:
        try:
            with open(path) as f:
                tree = _yaml(f)
        except yaml.YAMLError as e:  # includes ConstructorError for !!python/* tags
            raise ConfigError(f"{path}: not a valid (safe) YAML config: {e}") from None
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise _err("<root>", f"{path} must hold a mapping, got {type(tree).__name__}")
    if isinstance(overrides, str):
        overrides = [overrides]
    for item in overrides:
        _apply_override(tree, item)
    return _build(Config, tree, "")


def config_from_dict(tree: Mapping) -> Config:
    """A Config from a plain nested dict (the inverse of `config_to_dict`)."""
    return _build(Config, dict(tree), "")


def _plain(x):
    if hasattr(x, "to_tree"):
        return x.to_tree()
    if dataclasses.is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    return x


def config_to_dict(cfg) -> dict:
    """Plain nested dict (lists for tuples) that `load_config` reads back to an equal Config."""
    return _plain(cfg)


def dump_config(cfg) -> str:
    """YAML text of a Config (safe_dump: plain types only)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None)
