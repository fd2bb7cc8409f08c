"""The one rule for which row part a stored row goes to (jaxscale.engine.embedding.row_owner)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.engine.embedding.row_owner import ROW_ASSIGNMENTS, part_rows, row_part


@pytest.mark.parametrize("assignment", ROW_ASSIGNMENTS)
@pytest.mark.parametrize("rows,parts", [(10, 3), (12, 4), (7, 1), (5, 8)])
def test_row_part_is_a_bijection_and_part_rows_counts_it(assignment, rows, parts):
    r = np.arange(rows, dtype=np.int64)
    part, local = row_part(r, parts, assignment, rows)
    assert ((0 <= part) & (part < parts)).all() and len(set(zip(part.tolist(), local.tolist()))) == rows
    assert part_rows(rows, parts, assignment).tolist() == np.bincount(part, minlength=parts).tolist()
    for p in range(parts):  # local indices of a part are 0 .. held - 1
        assert sorted(local[part == p].tolist()) == list(range(int((part == p).sum())))
    jp, jl = row_part(jnp.asarray(r, jnp.int32), parts, assignment, rows)  # JAX callers share it
    assert np.asarray(jp).tolist() == part.tolist() and np.asarray(jl).tolist() == local.tolist()
    assert row_part(rows - 1, parts, assignment, rows) == (part[-1], local[-1])  # and Python ints


def test_the_two_layouts():
    assert [row_part(r, 3)[0] for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]  # the engine: r % parts
    assert [row_part(r, 3, "contiguous", 7)[0] for r in range(7)] == [0, 0, 0, 1, 1, 1, 2]  # ceil(7/3) blocks
    assert part_rows(7, 3).tolist() == [3, 2, 2] and part_rows(7, 3, "contiguous").tolist() == [3, 3, 1]
    with pytest.raises(ValueError, match="row_assignment must be one of"):
        row_part(1, 2, "hashed")
    with pytest.raises(ValueError, match="needs the table's rows"):
        row_part(1, 2, "contiguous")
