"""Which row part a stored row goes to: the one rule the engine routes by and the planner and the scaling
counts count by. No JAX: `row_part` is % and // only, so NumPy arrays, JAX arrays and Python ints all take it.

'modulo' is the engine: row r -> part r % parts, index r // parts within it (hot ids spread over the parts).
'contiguous' is TorchRec's row-wise layout, ceil(rows / parts) consecutive rows per part, kept to score the
baselines it produces (hot low ids pile onto the first part).
"""

from __future__ import annotations

import numpy as np

ROW_ASSIGNMENTS = ("modulo", "contiguous")


def check_row_assignment(assignment: str) -> None:
    if assignment not in ROW_ASSIGNMENTS:
        raise ValueError(f"row_assignment must be one of {ROW_ASSIGNMENTS}, got {assignment!r}")


def row_part(row, parts: int, assignment: str = "modulo", rows: int | None = None):
    """(part, index within the part) of stored row(s) `row` of a table of `rows` rows cut into `parts` row
    parts. `rows` is needed by 'contiguous' only (its block size)."""
    check_row_assignment(assignment)
    if assignment == "modulo":
        return (row % parts if parts > 1 else row * 0), row // parts
    if rows is None:
        raise ValueError("row_part: the 'contiguous' assignment needs the table's rows")
    block = -(-rows // parts)
    return row // block, row % block


def part_rows(rows: int, parts: int, assignment: str = "modulo"):
    """int64 [parts]: the rows each part holds."""
    check_row_assignment(assignment)
    p = np.arange(parts, dtype=np.int64)
    if assignment == "modulo":
        return (rows - p + parts - 1) // parts
    block = -(-rows // parts)
    return np.clip(rows - p * block, 0, block)
