"""The NumPy reference of FBGEMM semantics for the tests: `jaxscale.engine.reference`, under its historical name."""

from jaxscale.engine.reference import adagrad_step, lookup, row_gradients, row_grads, sgd_step, train, zero_accumulators

__all__ = ["adagrad_step", "lookup", "row_gradients", "row_grads", "sgd_step", "train", "zero_accumulators"]
