#!/usr/bin/env python
"""TorchRec baseline runner, from the command line: `jaxscale.benchmarks.torchrec_runner`'s CLI.

The runner is library code because the benchmark suite (run from an installed wheel too) and the parity
tests drive it; this script keeps the documented command working from a checkout:

    python experiments/baselines/torchrec_runner.py --world-size 2 --sharding row_wise --optimizer sgd --check

(the same as `python -m jaxscale.benchmarks.torchrec_runner ...`; README.md here describes the runner).
"""

import sys

from jaxscale.benchmarks.torchrec_runner import main

if __name__ == "__main__":
    sys.exit(main())
