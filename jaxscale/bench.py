"""`python -m jaxscale.bench`: the benchmark suite (`jaxscale.benchmarks.suite`), from a checkout or a wheel.

The suite is library code (`jaxscale/benchmarks/`), so an installed package runs the same benchmark as a
source checkout; only the baselines need more (TorchRec and FBGEMM: without them their columns stay empty
and the report says so). `machine` is the machine description the experiment reports print too.
"""

from __future__ import annotations

import sys

from jaxscale.benchmarks.machine import machine

__all__ = ["machine", "main"]


def main(argv=None) -> int:
    from jaxscale.benchmarks import suite

    return suite.main(argv)


if __name__ == "__main__":
    sys.exit(main())
