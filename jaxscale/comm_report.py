from jaxscale.training.comm_report import main

if __name__ == "__main__":
    raise SystemExit(main())
