"""Sharding plans as data: which pieces of which table live on which shard.

A plan is pure data (JSON round trip), independent of devices. The cost-model planner
(`jaxscale.engine.planner`) produces one; `EmbeddingCollection` also accepts a sharding-type string or a
per-table dict and resolves it here with a simple size-balancing placement.

Vocabulary (TorchRec's names):
  table_wise      the whole table on one shard.
  row_wise        rows split over every shard of the topology's shard group.
  column_wise     columns split into blocks, each block placed table-wise.
  table_row_wise  rows split over the devices of one node, tables placed across nodes ('1d' only).

A table is cut into `row_parts x col_parts` pieces. Row `r` belongs to row part `r % row_parts`
(hashed by modulo, so hot ids spread over shards instead of piling onto one contiguous block as with
TorchRec's `ceil(rows / world)` ranges) at local index `r // row_parts`. Piece (p, c) lives on shard
`shards[p * col_parts + c]`. Shards are numbered within the topology's shard group: the flat mesh
position for '1d', the node for '2d_ar', the local device for '2d_a2a'.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from jaxscale.engine.mesh import AXES, TOPOLOGIES, Topology, shard_axes
from jaxscale.engine.tables import TableConfig, check_tables

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise")


@dataclasses.dataclass(frozen=True)
class TableShards:
    """Where the pieces of one table live."""

    sharding: str
    row_parts: int
    col_parts: int
    shards: tuple[int, ...]

    def __post_init__(self):
        if self.sharding not in SHARDING_TYPES:
            raise ValueError(f"sharding must be one of {SHARDING_TYPES}, got {self.sharding!r}")
        if self.row_parts < 1 or self.col_parts < 1:
            raise ValueError(f"row_parts and col_parts must be >= 1, got {self.row_parts}, {self.col_parts}")
        object.__setattr__(self, "shards", tuple(int(s) for s in self.shards))
        if len(self.shards) != self.row_parts * self.col_parts:
            raise ValueError(
                f"shards has {len(self.shards)} entries, expected row_parts * col_parts = "
                f"{self.row_parts * self.col_parts}"
            )

    def shard_of(self, row_part: int, col_part: int) -> int:
        return self.shards[row_part * self.col_parts + col_part]

    def piece_rows(self, rows: int, row_part: int) -> int:
        """Rows of table held by row part `row_part` (rows r with r % row_parts == row_part)."""
        return len(range(row_part, rows, self.row_parts))


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """A complete placement for a set of tables on `num_shards` shards of one topology."""

    topology: str
    num_shards: int
    tables: Mapping[str, TableShards]

    def __post_init__(self):
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        for name, ts in self.tables.items():
            bad = [s for s in ts.shards if not 0 <= s < self.num_shards]
            if bad:
                raise ValueError(f"table {name!r}: shard indices {bad} are outside [0, {self.num_shards})")

    def to_dict(self) -> dict:
        return {
            "topology": self.topology,
            "num_shards": self.num_shards,
            "tables": {n: dataclasses.asdict(ts) | {"shards": list(ts.shards)} for n, ts in self.tables.items()},
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: Mapping) -> ShardingPlan:
        try:
            tables = {n: TableShards(**ts) for n, ts in d["tables"].items()}
            return cls(topology=d["topology"], num_shards=int(d["num_shards"]), tables=tables)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a ShardingPlan: {e}") from e

    @classmethod
    def from_json(cls, s: str) -> ShardingPlan:
        return cls.from_dict(json.loads(s))

    @classmethod
    def from_file(cls, path: str) -> ShardingPlan:
        """The plan a JSON file holds (`EmbeddingSettings.plan_file`); an unreadable file names the setting."""
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ValueError(f"embedding.plan_file: cannot read {path!r}: {err}") from err
        return cls.from_json(text)

    def check(self, tables: Sequence[TableConfig], nodes: int, local: int) -> None:
        """Raises ValueError if this plan cannot serve `tables` on a (nodes, local) mesh."""
        expected = num_shards(self.topology, nodes, local)
        if self.num_shards != expected:
            raise ValueError(
                f"plan was made for {self.num_shards} shards but topology {self.topology!r} on a "
                f"{nodes}x{local} mesh has {expected}"
            )
        names = {t.name for t in tables}
        missing, extra = names - set(self.tables), set(self.tables) - names
        if missing or extra:
            raise ValueError(f"plan does not match the tables: missing {sorted(missing)}, unknown {sorted(extra)}")
        for t in tables:
            ts = self.tables[t.name]
            if t.stored_dim % ts.col_parts:
                raise ValueError(
                    f"table {t.name!r}: dim {t.stored_dim} is not divisible into {ts.col_parts} column shards"
                )
            if ts.row_parts > t.stored_rows:
                raise ValueError(
                    f"table {t.name!r}: {t.stored_rows} rows cannot be split into {ts.row_parts} row shards"
                )


def num_shards(topology: str, nodes: int, local: int) -> int:
    """Size of the shard group (the all-to-all group) of a topology on a (nodes, local) mesh."""
    return Topology(topology, nodes, local).num_shards


def resolve_plan(
    tables: Sequence[TableConfig],
    topology: str,
    nodes: int,
    local: int,
    sharding: str | Mapping[str, str] | ShardingPlan | Mapping = "row_wise",
) -> ShardingPlan:
    """Turns a sharding-type string, a {table: type} dict or a plan (object or dict) into a plan.

    Table- and column-wise pieces are placed greedily on the shard with the fewest stored bytes so far
    (largest pieces first), which balances memory; the cost-model planner balances lookups and bytes sent.
    """
    tables = check_tables(tables)
    if isinstance(sharding, ShardingPlan):
        plan = sharding
    elif isinstance(sharding, Mapping) and "tables" in sharding and "topology" in sharding:
        plan = ShardingPlan.from_dict(sharding)
    else:
        if isinstance(sharding, str):
            types = {t.name: sharding for t in tables}
        elif isinstance(sharding, Mapping):
            unknown = set(sharding) - {t.name for t in tables}
            if unknown:
                raise ValueError(f"sharding names unknown tables {sorted(unknown)}")
            types = {t.name: sharding.get(t.name, "row_wise") for t in tables}
        else:
            raise TypeError(
                f"sharding must be a string, a {{table: type}} dict or a ShardingPlan, got {type(sharding).__name__}"
            )
        plan = _place(tables, topology, nodes, local, types)
    if plan.topology != topology:
        raise ValueError(f"plan is for topology {plan.topology!r}, the collection uses {topology!r}")
    plan.check(tables, nodes, local)
    return plan


def _place(tables, topology, nodes, local, types) -> ShardingPlan:
    s = num_shards(topology, nodes, local)
    load = [0] * s  # stored elements per shard
    placed: dict[str, TableShards] = {}
    for t in tables:
        kind = types[t.name]
        if kind not in SHARDING_TYPES:
            raise ValueError(f"table {t.name!r}: sharding must be one of {SHARDING_TYPES}, got {kind!r}")
        if kind == "table_row_wise" and shard_axes(topology) != AXES:
            raise ValueError(
                f"table {t.name!r}: table_row_wise needs topology '1d' (rows over a node's devices, tables "
                f"across nodes); under {topology!r} the shard group spans one axis only: use row_wise"
            )
        if kind == "column_wise":
            cols = min(s, t.stored_dim)
            if t.stored_dim % cols:
                raise ValueError(
                    f"table {t.name!r}: column_wise splits dim {t.stored_dim} over {cols} shards, which does "
                    f"not divide it; pick a dim divisible by {cols} or pass a ShardingPlan with col_parts"
                )
        if kind == "row_wise" and t.stored_rows < s:
            raise ValueError(f"table {t.name!r}: row_wise over {s} shards needs at least {s} rows, has {t.stored_rows}")

    def order(t):  # biggest first for greedy placement
        return -t.stored_rows * t.stored_dim

    for t in sorted(tables, key=order):
        kind = types[t.name]
        size = t.stored_rows * t.stored_dim
        if kind == "row_wise":
            ts = TableShards(kind, s, 1, tuple(range(s)))
            for i in range(s):
                load[i] += size // s
        elif kind == "table_wise":
            i = min(range(s), key=lambda j: (load[j], j))
            load[i] += size
            ts = TableShards(kind, 1, 1, (i,))
        elif kind == "column_wise":
            cols = min(s, t.stored_dim)
            chosen = []
            for _ in range(cols):
                i = min((j for j in range(s) if j not in chosen), key=lambda j: (load[j], j))
                chosen.append(i)
                load[i] += size // cols
            ts = TableShards(kind, 1, cols, tuple(chosen))
        else:  # table_row_wise: rows over the local devices of the least-loaded node
            node = min(range(nodes), key=lambda n: (sum(load[n * local : (n + 1) * local]), n))
            shards = tuple(node * local + l for l in range(local))
            for i in shards:
                load[i] += size // local
            if t.stored_rows < local:
                raise ValueError(f"table {t.name!r}: table_row_wise over {local} devices needs at least {local} rows")
            ts = TableShards(kind, local, 1, shards)
        placed[t.name] = ts
    return ShardingPlan(topology, s, {t.name: placed[t.name] for t in tables})
