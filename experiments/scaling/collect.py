"""Compiles each distinct technique stage on the 2x4 and 4x2 CPU meshes and caches what one step sends.

    python experiments/scaling/collect.py             # (re)compiles what is missing or stale
    python experiments/scaling/collect.py --force     # recompiles everything

Writes experiments/scaling/compiled_bytes.json: {key: {"overrides": [...], "report": comm_report output}}
with key "<nodes>x<local>|<topology>|<fwd>|<bwd>|<half_dim>". An entry is stale when the overrides that
produced it differ from the current ones (`jaxscale.studies.scaling_model.compiled_overrides`). run_ablation.py and
tests/test_scaling_model.py compare these compiled bytes with the model's formulas (`scaling_model.cross_check`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jaxscale.infra import atomic

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(HERE, "compiled_bytes.json")


def load(path: str = OUT) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def save(results: dict, path: str = OUT) -> None:
    """Atomic write: a crash never leaves a truncated cache."""
    atomic.write_json(path, results, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--force", action="store_true", help="recompile every entry")
    args = p.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from jaxscale.studies import scaling_model as M
    from jaxscale.training.comm_report import comm_report
    from jaxscale.training.config import load_config

    results = {} if args.force else load()
    for nodes, local in M.COMPILED_MESHES:
        for stage in M.distinct_compiled_stages():
            key = M.compiled_entry_key(nodes, local, stage)
            ov = M.compiled_overrides(stage, nodes, local)
            if results.get(key, {}).get("overrides") == ov:
                continue
            t0 = time.perf_counter()
            rep = comm_report(load_config(M.CONFIG, ov))
            results[key] = {"overrides": ov, "report": rep}
            save(results)
            s = rep["per_step"]
            print(
                f"{key}: {time.perf_counter() - t0:.0f} s, intra {s['intra_node_bytes_per_device']:,.0f} B, "
                f"inter {s['inter_node_bytes_per_device']:,.0f} B per device",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
