from jaxscale.training.run import main

if __name__ == "__main__":
    raise SystemExit(main())
