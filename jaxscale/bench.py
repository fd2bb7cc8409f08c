"""`python -m jaxscale.bench`: runs the benchmark suite of a jaxscale source checkout.

The suite (experiments/bench/suite.py) is an application, not library code: it drives FBGEMM and the
TorchRec baseline (experiments/baselines/, installed by its own script), starts worker processes and
writes experiments/results/. So it lives in the source tree, and this entry point only finds it and runs
it in a fresh interpreter with the same arguments; it imports nothing from experiments/.

Where it looks: $JAXSCALE_SOURCE (a checkout), then the checkout this package was imported from (an
editable install or PYTHONPATH), then the current directory and its parents.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SUITE = Path("experiments") / "bench" / "suite.py"


def candidates() -> list[Path]:
    out = []
    if os.environ.get("JAXSCALE_SOURCE"):
        out.append(Path(os.environ["JAXSCALE_SOURCE"]).expanduser())
    out.append(Path(__file__).resolve().parents[1])
    cwd = Path.cwd().resolve()
    out += [cwd, *cwd.parents]
    return out


def find_suite() -> Path | None:
    for root in candidates():
        if (root / SUITE).is_file() and (root / "jaxscale").is_dir():
            return root / SUITE
    return None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    suite = find_suite()
    if suite is None:
        print(
            "python -m jaxscale.bench runs the benchmark suite of a jaxscale source checkout "
            f"({SUITE}), which an installed package does not carry. Run it from a checkout, or set "
            "JAXSCALE_SOURCE=/path/to/jaxscale.",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([sys.executable, str(suite), *argv])


if __name__ == "__main__":
    sys.exit(main())
