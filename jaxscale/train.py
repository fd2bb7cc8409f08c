"""`python -m jaxscale.train`: its logic is jaxscale/training/run.py."""

from jaxscale.training.run import main

if __name__ == "__main__":
    raise SystemExit(main())
