"""Per-message latency of JAX's grouped all-to-all against the number of peers, on the emulated cluster.

Run by `MODE=latency emulate.sh NODES` (one process per node, LOCAL devices each; DELAY ms one-way):
    python experiments/scaling/a2a_latency.py --nodes 4 --local 1 --process-id I \
        --coordinator 10.200.0.1:23456 --dev jtunI --repeats 40

Times, on tiny payloads (--bytes per peer), so that only latency counts:
  permute     a one-message shift: every device sends one message to the next device and receives one;
  all_to_all  one grouped all-to-all over every device: G-1 messages out and G-1 in per device;
  all_reduce, all_gather  over every device, for comparison (the model: 2(k-1) and k-1 ring steps);
  all_reduce_8_operands   one all-reduce of a tuple of 8 arrays (XLA combines a step's all-reduces so):
                          one ring, or one per operand?
The alpha-beta model (`jaxscale.engine.comm_model`) charges a grouped all-to-all (G-1) x alpha: its messages'
latencies add up. If the transport posts every message at once, the all-to-all costs about one message's
latency whatever G, and the model's latency term is wrong by a factor G-1. Process 0 prints one JSON
line with the medians and every repeat's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--local", type=int, default=1)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--bytes", type=int, default=64, help="payload per peer (float32)")
    p.add_argument("--delay-ms", type=float, default=None, help="recorded only: the link's one-way delay")
    a = p.parse_args(argv)

    from jaxscale.infra import distributed

    distributed.initialize(a.coordinator, a.nodes, a.process_id, local_devices=a.local)
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices())
    g = devices.size
    mesh = jax.sharding.Mesh(devices, ("x",))
    per_peer = max(1, a.bytes // 4)
    x = jax.make_array_from_callback(
        (g * g * per_peer,),
        NamedSharding(mesh, P("x")),
        lambda idx: np.ones(g * per_peer, np.float32),
    )
    shift = [(i, (i + 1) % g) for i in range(g)]
    ops = {
        "permute": lambda v: jax.lax.ppermute(v, "x", shift),
        "all_to_all": lambda v: jax.lax.all_to_all(v.reshape(g, per_peer), "x", 0, 0, tiled=True).reshape(-1),
        "all_reduce": lambda v: jax.lax.psum(v, "x"),
        "all_reduce_8_operands": lambda v: sum(jax.lax.psum(tuple(v * i for i in range(1, 9)), "x")),
        "all_gather": lambda v: jax.lax.all_gather(v[:per_peer], "x", tiled=True).reshape(-1)[: g * per_peer],
    }
    out = {
        "run": "a2a_latency",
        "nodes": a.nodes,
        "local": a.local,
        "devices": g,
        "peers": g - 1,
        "inter_node_peers": g - a.local,
        "delay_ms": a.delay_ms,
        "bytes_per_peer": per_peer * 4,
        "repeats": a.repeats,
    }
    for name, op in ops.items():
        fn = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        for _ in range(3):
            jax.block_until_ready(fn(x))
        multihost_utils.sync_global_devices(f"start-{name}")
        times = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - t)
        multihost_utils.sync_global_devices(f"done-{name}")
        out[f"{name}_median_s"] = statistics.median(times)
        out[f"{name}_s"] = times
    if a.process_id == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
