"""Compiles each distinct stage on the 2x4 and 4x2 CPU meshes and caches comm_report's output.

python experiments/scaling/collect.py            # writes experiments/scaling/compiled_bytes.json
"""

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compiled_bytes.json")
MESHES = [(2, 4), (4, 2)]


def main():
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from stages import CONFIG, STAGES, compile_key, overrides

    from jaxscale.comm_report import comm_report
    from jaxscale.config import load_config

    results = json.load(open(OUT)) if os.path.exists(OUT) else {}
    for nodes, local in MESHES:
        for _name, st in STAGES:
            key = f"{nodes}x{local}|" + "|".join(map(str, compile_key(st)))
            if key in results:
                continue
            t0 = time.time()
            rep = comm_report(load_config(os.path.join(ROOT, CONFIG), overrides(st, nodes, local)))
            results[key] = rep
            json.dump(results, open(OUT, "w"), indent=1)
            print(
                f"{key}: {time.time() - t0:.0f} s, intra {rep['per_step']['intra_node_bytes_per_device']:.0f} "
                f"inter {rep['per_step']['inter_node_bytes_per_device']:.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
