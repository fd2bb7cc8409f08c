"""Embedding table specs: what a table is, independent of where it lives."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

POOLINGS = ("sum", "mean", None)
RESHAPES = (None, "half_dim")


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One embedding table and the features that look it up.

    Attributes:
      name: unique table name.
      rows: number of rows (ids are in [0, rows)).
      dim: embedding dimension (columns).
      pooling: 'sum' or 'mean' pool each example's ids to one [dim] vector; None is a sequence lookup
        that returns [L, dim] per example (padding -> zeros).
      features: names of the input features that look this table up (default: the table's name).
        Several features may share one table.
      reshape: None, or 'half_dim': store the table bandwidth-aware as (2*rows) x (dim/2): the same
        parameter count, half the bytes per all-to-all. Ids then index the doubled row space
        [0, 2*rows) (`stored_rows`): a hashed-id model hashes its raw ids into `stored_rows` buckets, so
        the doubled rows halve hash collisions while each lookup moves half the bytes; a local
        projection after the all-to-all can restore the model dim without communication.
      init_scale: rows are initialised uniform(-init_scale, init_scale); default sqrt(1/rows), as in
        TorchRec.
    """

    name: str
    rows: int
    dim: int
    pooling: str | None = "sum"
    features: tuple[str, ...] = ()
    reshape: str | None = None
    init_scale: float | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableConfig.name must be a non-empty string, got {self.name!r}")
        for field in ("rows", "dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TableConfig({self.name!r}).{field} must be a positive integer, got {value!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"TableConfig({self.name!r}).pooling must be one of {POOLINGS}, got {self.pooling!r}")
        features = self.features
        if isinstance(features, str):
            features = (features,)
        features = tuple(features) or (self.name,)
        if any(not isinstance(f, str) or not f for f in features):
            raise ValueError(f"TableConfig({self.name!r}).features must be non-empty strings, got {features!r}")
        if len(set(features)) != len(features):
            raise ValueError(f"TableConfig({self.name!r}).features has duplicates: {features!r}")
        object.__setattr__(self, "features", features)
        if self.reshape not in RESHAPES:
            raise ValueError(f"TableConfig({self.name!r}).reshape must be one of {RESHAPES}, got {self.reshape!r}")
        if self.reshape == "half_dim" and self.dim % 2:
            raise ValueError(f"TableConfig({self.name!r}).reshape='half_dim' needs an even dim, got dim={self.dim}")
        if self.init_scale is not None and not (isinstance(self.init_scale, (int, float)) and self.init_scale >= 0):
            raise ValueError(
                f"TableConfig({self.name!r}).init_scale must be a non-negative number, got {self.init_scale!r}"
            )

    @property
    def stored_rows(self) -> int:
        """Rows as stored (doubled under reshape='half_dim')."""
        return self.rows * 2 if self.reshape == "half_dim" else self.rows

    @property
    def stored_dim(self) -> int:
        """Columns as stored and communicated (halved under reshape='half_dim')."""
        return self.dim // 2 if self.reshape == "half_dim" else self.dim

    @property
    def scale(self) -> float:
        return float(self.init_scale) if self.init_scale is not None else math.sqrt(1.0 / self.rows)


def check_tables(tables: Sequence[TableConfig]) -> tuple[TableConfig, ...]:
    """Validates a set of tables: unique table names, each feature read by exactly one table."""
    tables = tuple(tables)
    if not tables:
        raise ValueError("at least one TableConfig is required")
    for t in tables:
        if not isinstance(t, TableConfig):
            raise TypeError(f"expected TableConfig, got {type(t).__name__}: {t!r}")
    seen: dict[str, str] = {}
    names = set()
    for t in tables:
        if t.name in names:
            raise ValueError(f"two tables are named {t.name!r}; table names must be unique")
        names.add(t.name)
        for f in t.features:
            if f in seen:
                raise ValueError(f"feature {f!r} is read by two tables ({seen[f]!r} and {t.name!r})")
            seen[f] = t.name
    return tables
