"""Sparse row-wise optimizers for embedding tables (FBGEMM's fused-optimizer semantics).

They are applied only to rows that were looked up, after duplicate ids have been summed, so a step costs
O(touched rows) whatever the table size. The math is that of FBGEMM's TBE (`EXACT_SGD`,
`EXACT_ROWWISE_ADAGRAD`), which is what TorchRec's fused optimizers run; these dataclasses hold the
hyper-parameters, and the fused kernels of `jaxscale.engine.native` (native on CPU, pure JAX elsewhere) run the step.
"""

from __future__ import annotations

import dataclasses


def _check_positive(owner: str, field: str, value, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(
            f"{owner}.{field} must be a {'non-negative' if allow_zero else 'positive'} number, got {value!r}"
        )


@dataclasses.dataclass(frozen=True)
class SGD:
    """w_r -= lr * g_r for every touched row r (g_r: the row's summed gradient)."""

    learning_rate: float

    slots: tuple[str, ...] = dataclasses.field(default=(), init=False, repr=False)

    def __post_init__(self):
        _check_positive("SGD", "learning_rate", self.learning_rate, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class RowWiseAdagrad:
    """Exact row-wise AdaGrad, as FBGEMM defines it.

    Per touched row r with summed gradient g: acc_r += mean(g**2 over the dim);
    w_r -= lr * g / (sqrt(acc_r) + eps). One float of state per row.

    A column-sharded table still keeps ONE accumulator per row, the mean over the full dim (each column
    shard adds up its part of the row's squared gradient with the others'), so a model trains the same
    whatever sharding the planner picks. `per_column_shard=True` instead keeps one accumulator per row
    and column shard, each the mean over its own columns: what TorchRec/FBGEMM do (every column shard
    is its own TBE), for bit-parity with TorchRec column-wise runs.
    """

    learning_rate: float
    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    per_column_shard: bool = False

    slots: tuple[str, ...] = dataclasses.field(default=("accumulator",), init=False, repr=False)

    def __post_init__(self):
        _check_positive("RowWiseAdagrad", "learning_rate", self.learning_rate, allow_zero=True)
        _check_positive("RowWiseAdagrad", "eps", self.eps, allow_zero=True)
        _check_positive("RowWiseAdagrad", "initial_accumulator_value", self.initial_accumulator_value, allow_zero=True)
        if not isinstance(self.per_column_shard, bool):
            raise ValueError(f"RowWiseAdagrad.per_column_shard must be a bool, got {self.per_column_shard!r}")

    def initial_slot(self, name: str) -> float:
        return self.initial_accumulator_value


def slot_initial_value(optimizer, name: str) -> float:
    return optimizer.initial_slot(name) if hasattr(optimizer, "initial_slot") else 0.0


OPTIMIZERS = (SGD, RowWiseAdagrad)
