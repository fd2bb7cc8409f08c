"""Every setting of an `EmbeddingCollection`, in one frozen value (no JAX: the config loads it device-free).

`EmbeddingSettings` is at once the collection's argument (`EmbeddingCollection(tables, mesh, settings)`),
the trainer config's `embedding` section (`jaxscale.training.config`), what a technique stage sets
(`jaxscale.engine.techniques.Stage`) and what the planner resolves (`jaxscale.engine.planner.resolve`). Each check is
written here once; a bad value raises `SettingError` ("field: message", a `ValueError` whose `field` the
config loader prefixes with the section's dotted key).

How replicas of a 2D topology stay equal is one `ReplicaSync` value (mode, strategy, cadence): the engine
runs it, and the communication model (`jaxscale.engine.comm_model`) prices the same value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from jaxscale.engine.mesh import TOPOLOGIES, has_replicas
from jaxscale.engine.optimizers import SGD, RowWiseAdagrad
from jaxscale.engine.plan import SHARDING_TYPES
from jaxscale.engine.quantization import CommConfig

AUTO_TOPOLOGY = "auto"
"""`topology: auto` asks the planner (`jaxscale.engine.planner.resolve`) to choose; a collection needs a real one."""
SYNC_MODES = ("exact", "periodic")
SYNC_STRATEGIES = {"exact": ("auto", "owner", "gather"), "periodic": ("dense", "sparse")}
DEFAULT_STRATEGY = {"exact": "auto", "periodic": "dense"}
POOLED_COMM_MODES = ("auto", "rows", "partial_sums")
OUTPUT_DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = {"rowwise_adagrad": RowWiseAdagrad, "sgd": SGD}


class SettingError(ValueError):
    """A setting that cannot be used; `field` is its dotted name inside the settings."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclasses.dataclass(frozen=True)
class ReplicaSync:
    """How the replicas of a 2D topology stay equal (nothing to do where the topology has one replica).

    mode 'exact': every replica applies the same summed update every step; strategy 'owner' (each row's
    gradient goes to one owner replica, which sums it and all-gathers the result), 'gather' (every replica
    all-gathers every replica's touched rows) or 'auto' (the cheaper of the two for each batch, from the
    host's counts). mode 'periodic': replicas update independently and are averaged every `every` steps
    (TorchRec's DMPCollection); strategy 'dense' averages whole shards, 'sparse' only the rows some replica
    touched since the last sync, at most `sparse_rows` rows per shard per sync (None: 1/8 of a shard's
    block; when more were touched, that sync averages every row).

    In YAML: `replica_sync: exact`, `replica_sync: periodic`, or a mapping
    `{mode: periodic, strategy: sparse, every: 4}`.
    """

    mode: str = "exact"
    strategy: str | None = None
    """None: the mode's default ('auto' for exact, 'dense' for periodic)."""
    every: int = 1
    sparse_rows: int | None = None

    def __post_init__(self):
        if self.mode not in SYNC_MODES:
            raise SettingError("mode", f"must be one of {list(SYNC_MODES)}, got {self.mode!r}")
        if self.strategy is None:
            object.__setattr__(self, "strategy", DEFAULT_STRATEGY[self.mode])
        if self.strategy not in SYNC_STRATEGIES[self.mode]:
            raise SettingError(
                "strategy",
                f"for mode {self.mode!r} must be one of {list(SYNC_STRATEGIES[self.mode])}, got {self.strategy!r}",
            )
        if not _positive_int(self.every):
            raise SettingError("every", f"must be a positive integer, got {self.every!r}")
        if self.mode == "exact" and self.every != 1:
            raise SettingError("every", f"the exact sync runs every step (every=1), got {self.every}")
        if self.sparse_rows is not None:
            if not self.sparse:
                raise SettingError(
                    "sparse_rows", "is only used by the periodic sparse sync (mode periodic, strategy sparse)"
                )
            if not _positive_int(self.sparse_rows):
                raise SettingError("sparse_rows", f"must be null or a positive integer, got {self.sparse_rows!r}")

    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    @property
    def sparse(self) -> bool:
        """The periodic sync that averages only the rows touched since the last one."""
        return self.mode == "periodic" and self.strategy == "sparse"

    @property
    def label(self) -> str:
        return f"{self.mode} {self.strategy}" + (f" k={self.every}" if self.mode == "periodic" else "")

    @classmethod
    def parse(cls, value) -> ReplicaSync:
        """A `ReplicaSync`, a mode name, or a mapping of its fields."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise SettingError(unknown[0], "unknown key; ReplicaSync has mode, strategy, every, sparse_rows")
            return cls(**value)
        raise SettingError("", f"must be a mode name {list(SYNC_MODES)} or a mapping, got {value!r}")

    def to_tree(self) -> dict:
        return dataclasses.asdict(self)


def default_optimizer() -> RowWiseAdagrad:
    return RowWiseAdagrad(0.05)


def optimizer_from_tree(value) -> SGD | RowWiseAdagrad:
    """The sparse optimizer from its YAML form `{kind: rowwise_adagrad | sgd, learning_rate: ..., ...}`."""
    if isinstance(value, tuple(OPTIMIZERS.values())):
        return value
    if not isinstance(value, Mapping):
        raise SettingError("", f"must be a mapping with a 'kind' ({list(OPTIMIZERS)}), got {value!r}")
    fields = dict(value)
    kind = fields.pop("kind", "rowwise_adagrad")
    if kind not in OPTIMIZERS:
        raise SettingError("kind", f"must be one of {list(OPTIMIZERS)}, got {kind!r}")
    cls = OPTIMIZERS[kind]
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    for name, v in fields.items():
        if name not in known:
            raise SettingError(name, f"unknown key for kind {kind!r}; it has {sorted(known)}")
        if name != "per_column_shard" and not (isinstance(v, (int, float)) and not isinstance(v, bool)):
            raise SettingError(name, f"must be a number, got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise SettingError(name, f"must be finite, got {v!r}")
    for f in dataclasses.fields(cls):
        required = f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in fields:
            raise SettingError(f.name, f"is required for kind {kind!r}")
    try:
        return cls(**fields)
    except ValueError as e:  # the optimizer names its own field: "RowWiseAdagrad.eps must be ..."
        field = str(e).split(" ", 1)[0].split(".")[-1]
        raise SettingError(field if field in known else "", str(e)) from None


def optimizer_to_tree(optimizer) -> dict:
    kind = next(k for k, cls in OPTIMIZERS.items() if isinstance(optimizer, cls))
    return {"kind": kind, **{f.name: getattr(optimizer, f.name) for f in dataclasses.fields(optimizer) if f.init}}


def _nested(field: str, fn, value):
    """fn(value), with a nested SettingError's field put under `field`."""
    try:
        return fn(value)
    except SettingError as e:
        raise SettingError(f"{field}.{e.field}" if e.field else field, e.message) from None
    except ValueError as e:
        raise SettingError(f"{field}.{e.field}" if getattr(e, "field", None) else field, str(e)) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class EmbeddingSettings:
    """How an `EmbeddingCollection` shards, trains and exchanges its tables.

    topology: '1d' (shard over every device), '2d_ar' (shard over nodes, replicate inside a node) or
      '2d_a2a' (shard inside a node, replicate across nodes: the all-to-all never leaves a node); 'auto'
      in a config: the planner chooses (`jaxscale.engine.planner.resolve`).
    sharding: one sharding type for every table ('table_wise', 'row_wise', 'column_wise',
      'table_row_wise') or {table: type}; a full `ShardingPlan` is passed to the collection as `plan`.
    plan_file: a JSON `ShardingPlan` the trainer runs instead of `sharding`.
    optimizer: `RowWiseAdagrad` or `SGD`, applied sparsely to the looked-up rows (YAML: `{kind: ...}`).
    comm: `CommConfig`: precision of the embedding payloads forward and backward (ids never quantized).
    capacity_factor: None (default): every exchange is sized for the batch it carries, counted on the
      host (exact: nothing can overflow), or for the worst case when the ids are only known inside jit. A
      float f fixes the shape instead: each row-wise piece gets f times its uniform share of a device's
      requests (smaller messages; overflow is then possible, counted and reported).
    reuse_capacities: False (default): `shard_batch` counts every batch. True: it counts the first batch
      of each shape (and any batch it is asked to `recount`) and gives later ones the largest set counted
      for that shape: no host counting and, in multi-process runs, no exchange before the step (not with
      an exact replica sync, whose buffers are counted per batch). A batch that does not fit overflows:
      the rows that did not fit are counted in stats['overflow'], the caller skips the update
      (`update(..., apply=stats['overflow'] == 0)`) and re-runs the step on
      `shard_batch(batch, recount=True)`. The trainer does both.
    replica_sync: a `ReplicaSync` (YAML: a mode name or a mapping).
    pooled_comm: how pooled features come back. 'rows' returns every looked-up row and pools on the
      requester; 'partial_sums' has each owner pool its rows per bag and return one partial sum per bag
      (the output all-to-all carries B x dim instead of B x L x dim). 'auto' uses partial sums for pooled
      features with more than one id per example.
    output_dtype: the dtype of the lookup's outputs, what the dense model reads ('float32', 'bfloat16',
      'float16'; FBGEMM's `output_dtype`). Tables, optimizer state and the gradients the update applies stay
      float32; a bf16 model reads half the activation bytes and needs no cast of its own.
    """

    topology: str = "1d"
    sharding: str | Mapping[str, str] = "row_wise"
    plan_file: str | None = None
    optimizer: SGD | RowWiseAdagrad = dataclasses.field(default_factory=default_optimizer)
    comm: CommConfig = dataclasses.field(default_factory=CommConfig)
    capacity_factor: float | None = None
    reuse_capacities: bool = False
    replica_sync: ReplicaSync = dataclasses.field(default_factory=ReplicaSync)
    pooled_comm: str = "auto"
    output_dtype: str = "float32"

    def __post_init__(self):
        if self.topology not in (*TOPOLOGIES, AUTO_TOPOLOGY):
            raise SettingError("topology", f"must be one of {[*TOPOLOGIES, AUTO_TOPOLOGY]}, got {self.topology!r}")
        self._check_sharding()
        if self.plan_file is not None and not (isinstance(self.plan_file, str) and self.plan_file):
            raise SettingError("plan_file", f"must be null or a path, got {self.plan_file!r}")
        # YAML forms (mappings, mode names) become their types here, so every way in is checked the same
        optimizer, comm = self.optimizer or default_optimizer(), self.comm or CommConfig()  # None: the default
        object.__setattr__(self, "optimizer", _nested("optimizer", optimizer_from_tree, optimizer))
        object.__setattr__(self, "comm", _nested("comm", _comm_from_tree, comm))
        cf = self.capacity_factor
        if cf is not None and not (isinstance(cf, (int, float)) and not isinstance(cf, bool) and cf > 0):
            raise SettingError("capacity_factor", f"must be null or a positive number, got {cf!r}")
        if cf is not None:
            object.__setattr__(self, "capacity_factor", float(cf))
        if not isinstance(self.reuse_capacities, bool):
            raise SettingError("reuse_capacities", f"must be true or false, got {self.reuse_capacities!r}")
        object.__setattr__(self, "replica_sync", _nested("replica_sync", ReplicaSync.parse, self.replica_sync))
        if not self.replica_sync.exact and self.topology != AUTO_TOPOLOGY and not has_replicas(self.topology):
            raise SettingError(
                "replica_sync", f"{self.replica_sync.label!r} needs replicas: topology {self.topology!r} has none"
            )
        if self.pooled_comm not in POOLED_COMM_MODES:
            raise SettingError("pooled_comm", f"must be one of {list(POOLED_COMM_MODES)}, got {self.pooled_comm!r}")
        if self.output_dtype not in OUTPUT_DTYPES:
            raise SettingError("output_dtype", f"must be one of {list(OUTPUT_DTYPES)}, got {self.output_dtype!r}")

    def _check_sharding(self) -> None:
        sharding = self.sharding
        if isinstance(sharding, str):
            if sharding not in SHARDING_TYPES:
                raise SettingError("sharding", f"must be one of {list(SHARDING_TYPES)}, got {sharding!r}")
        elif isinstance(sharding, Mapping):
            for table, kind in sharding.items():
                if not isinstance(table, str):
                    raise SettingError("sharding", f"keys must be table names, got {table!r}")
                if kind not in SHARDING_TYPES:
                    raise SettingError(f"sharding.{table}", f"must be one of {list(SHARDING_TYPES)}, got {kind!r}")
            object.__setattr__(self, "sharding", dict(sharding))
        else:
            raise SettingError("sharding", f"must be a sharding type or {{table: type}}, got {sharding!r}")

    def replace(self, **changes) -> EmbeddingSettings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_tree(cls, data: Mapping) -> EmbeddingSettings:
        """The settings from their YAML form (unknown keys refused by name)."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise SettingError(str(key), f"unknown key; EmbeddingSettings has {sorted(known)}")
        return cls(**data)

    def to_tree(self) -> dict:
        """Plain YAML form; `from_tree` reads it back to equal settings."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["optimizer"] = optimizer_to_tree(self.optimizer)
        out["comm"] = dataclasses.asdict(self.comm)
        out["replica_sync"] = self.replica_sync.to_tree()
        return out


def _comm_from_tree(value) -> CommConfig:
    if isinstance(value, CommConfig):
        return value
    if not isinstance(value, Mapping):
        raise SettingError("", f"must be a mapping of CommConfig fields, got {value!r}")
    known = {f.name for f in dataclasses.fields(CommConfig)}
    for key in value:
        if key not in known:
            raise SettingError(str(key), f"unknown key; CommConfig has {sorted(known)}")
    return CommConfig(**value)
