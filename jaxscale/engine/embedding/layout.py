"""Where every row lives: pieces, per-width stacks and per-table routes (pure host code, no devices).

A table is cut into `row_parts x col_parts` pieces by its `TableShards` (see `jaxscale.engine.plan`). Pieces of
the same column width `w` are stacked: on every shard, the pieces of width `w` that the shard holds are laid
out back to back in one `[R_w, w]` block (R_w = the largest fill over shards). Row `r` of a table lives in
row part `r % row_parts`, at `offset + r // row_parts` of its shard's block.

Everything here is NumPy: the layout is decided once, on the host, and shared by the state conversion,
the routing of requests inside `shard_map`, and checkpoint resharding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jaxscale.engine.plan import ShardingPlan, resolve_plan
from jaxscale.engine.tables import TableConfig


@dataclasses.dataclass(frozen=True)
class Piece:
    """One (row part, column part) piece of a table, as placed in a shard's block."""

    table: int  # index into the collection's tables
    row_part: int
    row_parts: int
    col_part: int
    rows: int  # rows of the table held by this piece
    offset: int  # first row of the piece in its shard's block


@dataclasses.dataclass(frozen=True)
class Stack:
    """All pieces of column width `width`: per shard, the pieces laid out back to back."""

    key: str
    width: int
    rows: int  # R_w: rows per shard block (max over shards, >= 1)
    pieces: tuple[tuple[Piece, ...], ...]  # per shard

    @property
    def has_column_pieces(self) -> bool:
        return any(pc.col_part > 0 for shard in self.pieces for pc in shard)


@dataclasses.dataclass(frozen=True, eq=False)
class TableRoute:
    """Static routing of one table: stack, and shard / block offset of each piece (row_part, col_part)."""

    stack: str
    row_parts: int
    col_parts: int
    shard: np.ndarray  # int32 [row_parts, col_parts]
    offset: np.ndarray  # int32 [row_parts, col_parts]


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """The stacks and routes of a set of tables under a plan."""

    tables: tuple[TableConfig, ...]
    plan: ShardingPlan
    stacks: Mapping[str, Stack]
    routes: tuple[TableRoute, ...]

    @property
    def num_shards(self) -> int:
        return self.plan.num_shards


def plan_layout(
    tables: Sequence[TableConfig], topology: str, nodes: int, local: int, sharding, plan_file: str | None = None
) -> tuple[ShardingPlan, Layout]:
    """What a collection stores where: the plan of `sharding` (a type, a {table: type} dict or a plan; see
    `jaxscale.engine.plan.resolve_plan`), or of the JSON `plan_file` when there is one, checked against the topology
    and the mesh, and the layout built from it."""
    if plan_file:
        sharding = ShardingPlan.from_file(plan_file)
    plan = resolve_plan(tables, topology, nodes, local, sharding)
    return plan, build_layout(tables, plan)


def build_layout(tables: Sequence[TableConfig], plan: ShardingPlan) -> Layout:
    """Per-width stacks and per-table routes, from the plan."""
    tables = tuple(tables)
    S = plan.num_shards
    per_width: dict[int, list[list[Piece]]] = {}
    fill: dict[int, list[int]] = {}
    routes = []
    for i, t in enumerate(tables):
        ts = plan.tables[t.name]
        width = t.stored_dim // ts.col_parts
        shards = per_width.setdefault(width, [[] for _ in range(S)])
        used = fill.setdefault(width, [0] * S)
        shard = np.zeros((ts.row_parts, ts.col_parts), np.int32)
        offset = np.zeros((ts.row_parts, ts.col_parts), np.int32)
        for p in range(ts.row_parts):
            for c in range(ts.col_parts):
                s = ts.shard_of(p, c)
                n = ts.piece_rows(t.stored_rows, p)
                shards[s].append(Piece(i, p, ts.row_parts, c, n, used[s]))
                shard[p, c], offset[p, c] = s, used[s]
                used[s] += n
        routes.append(TableRoute(f"w{width}", ts.row_parts, ts.col_parts, shard, offset))
    stacks = {}
    for width, shards in sorted(per_width.items()):
        rows = max(1, max(fill[width]))
        if rows * (S + 1) >= 2**31:
            raise ValueError(
                f"stack of width {width} holds {rows} rows on each of {S} shards; (shards + 1) * rows "
                f"must stay below 2**31 (packed int32 routing keys)"
            )
        stacks[f"w{width}"] = Stack(f"w{width}", width, rows, tuple(tuple(p) for p in shards))
    return Layout(tables, plan, stacks, tuple(routes))


def piece_meta(stack: Stack, num_shards: int) -> dict[str, np.ndarray]:
    """Per-shard arrays (padded to the max piece count) describing the pieces of a stack.

    Device code finds the piece of block row i with `searchsorted(start[shard], i, 'right') - 1`;
    padding pieces start past the end of the block.
    """
    npieces = max(1, max(len(p) for p in stack.pieces))
    keys = ("start", "rows", "table", "row_part", "row_parts", "col_part")
    meta = {k: np.zeros((num_shards, npieces), np.int32) for k in keys}
    meta["start"][:] = stack.rows
    meta["row_parts"][:] = 1
    for s, pieces in enumerate(stack.pieces):
        for j, pc in enumerate(pieces):
            meta["start"][s, j], meta["rows"][s, j], meta["table"][s, j] = pc.offset, pc.rows, pc.table
            meta["row_part"][s, j], meta["row_parts"][s, j] = pc.row_part, pc.row_parts
            meta["col_part"][s, j] = pc.col_part
    return meta


def _columns(pc: Piece, width: int) -> slice:
    return slice(pc.col_part * width, (pc.col_part + 1) * width)


def dense_to_stacks(layout: Layout, dense: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Dense tables {name: [rows, dim]} -> host stacks {key: [shards, R, w]} (zeros past each fill)."""
    out = {k: np.zeros((layout.num_shards, st.rows, st.width), np.float32) for k, st in layout.stacks.items()}
    for k, st in layout.stacks.items():
        for s, pieces in enumerate(st.pieces):
            for pc in pieces:
                src = dense[layout.tables[pc.table].name][pc.row_part :: pc.row_parts, _columns(pc, st.width)]
                out[k][s, pc.offset : pc.offset + pc.rows] = src
    return out


def stacks_to_dense(layout: Layout, stacks: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Host stacks {key: [shards, R, w]} of one replica -> dense tables {name: [rows, dim]}."""
    out = {t.name: np.zeros((t.stored_rows, t.stored_dim), np.float32) for t in layout.tables}
    for k, st in layout.stacks.items():
        for s, pieces in enumerate(st.pieces):
            for pc in pieces:
                block = stacks[k][s, pc.offset : pc.offset + pc.rows]
                out[layout.tables[pc.table].name][pc.row_part :: pc.row_parts, _columns(pc, st.width)] = block
    return out


def slot_shape(layout: Layout, table: TableConfig, per_column_shard: bool) -> tuple[int, ...]:
    """Dense shape of a table's per-row optimizer slot: [rows], or [rows, col_parts] when every column
    shard keeps its own state (TorchRec's column-wise semantics)."""
    cp = layout.plan.tables[table.name].col_parts
    return (table.stored_rows, cp) if per_column_shard and cp > 1 else (table.stored_rows,)


def slots_to_dense(
    layout: Layout, stacks: Mapping[str, np.ndarray], per_column_shard: bool = False
) -> dict[str, np.ndarray]:
    """Host slot stacks {key: [shards, R]} -> {name: [rows]} ([rows, col_parts] per column shard).

    With one state per row (the default) every column piece of a row holds the same value; the first
    column piece's is returned.
    """
    out = {t.name: np.zeros(slot_shape(layout, t, per_column_shard), np.float32) for t in layout.tables}
    for k, st in layout.stacks.items():
        for s, pieces in enumerate(st.pieces):
            for pc in pieces:
                dst = out[layout.tables[pc.table].name]
                vals = stacks[k][s, pc.offset : pc.offset + pc.rows]
                if dst.ndim == 2:
                    dst[pc.row_part :: pc.row_parts, pc.col_part] = vals
                elif pc.col_part == 0:
                    dst[pc.row_part :: pc.row_parts] = vals
    return out


def dense_slots_to_stacks(layout: Layout, slots: Mapping[str, np.ndarray], fill: float = 0.0) -> dict[str, np.ndarray]:
    """{name: [rows] | [rows, k]} -> slot stacks {key: [shards, R]}.

    A [rows] slot is copied to every column piece of the row. A [rows, k] slot (per column shard) is
    read per column piece when k equals the table's column parts, else averaged over its k columns
    (a layout change that merges or splits column shards).
    """
    out = {k: np.full((layout.num_shards, st.rows), fill, np.float32) for k, st in layout.stacks.items()}
    for k, st in layout.stacks.items():
        for s, pieces in enumerate(st.pieces):
            for pc in pieces:
                t = layout.tables[pc.table]
                if t.name not in slots:
                    continue
                v = np.asarray(slots[t.name], np.float32)
                if v.ndim == 2:
                    cp = layout.plan.tables[t.name].col_parts
                    v = v[:, pc.col_part] if v.shape[1] == cp else v.mean(axis=1)
                out[k][s, pc.offset : pc.offset + pc.rows] = v[pc.row_part :: pc.row_parts]
    return out
