"""`python -m jaxscale.bench`: its logic is jaxscale/benchmarks/suite.py."""

from jaxscale.benchmarks.suite import main

if __name__ == "__main__":
    raise SystemExit(main())
