"""Command line: ``python -m jaxscale.serving {export-demo,leaf,root,build-index,export-retrieval,states} ...``"""

from __future__ import annotations

import argparse
import logging
import sys


def export_demo_main(argv) -> None:
    p = argparse.ArgumentParser(
        prog="python -m jaxscale.serving export-demo",
        description="Export the six demo model versions (3 models x 2) into a store.",
    )
    p.add_argument("--store", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    from jaxscale.serving.demo import export_demo

    for sig in export_demo(args.store, args.seed, overwrite=args.overwrite):
        print(f"{sig.label}: {len(sig.features)} declared, {len(sig.required)} used, unused {list(sig.unused)}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = {
        "export-demo": export_demo_main,
        "leaf": None,
        "root": None,
        "build-index": None,
        "export-retrieval": None,
        "states": None,
    }
    if not argv or argv[0] not in commands:
        print(f"usage: python -m jaxscale.serving {{{','.join(commands)}}} [options]", file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    command, rest = argv[0], argv[1:]
    if command in ("build-index", "export-retrieval"):
        from jaxscale.serving import retrieval

        run = retrieval.build_index_main if command == "build-index" else retrieval.export_retrieval_main
        raise SystemExit(run(rest))
    if command == "states":
        from jaxscale.serving.states import main as states_main

        raise SystemExit(states_main(rest))
    if command == "leaf":
        from jaxscale.serving.leaf import main as leaf_main

        leaf_main(rest)
    elif command == "root":
        from jaxscale.serving.root import main as root_main

        root_main(rest)
    else:
        export_demo_main(rest)


if __name__ == "__main__":
    main()
