"""`python -m jaxscale.comm_report`: its logic is jaxscale/training/comm_report.py."""

from jaxscale.training.comm_report import main

if __name__ == "__main__":
    raise SystemExit(main())
