"""How JAX's CPU transport (gloo over TCP) spends a rate-limited link, per collective. One process per node.

Run by `MODE=duplex emulate.sh NODES RATE` inside the emulated cluster's namespaces:
    python experiments/scaling/gloo_duplex.py --nodes 2 --local 2 --process-id I \
        --coordinator 10.200.0.1:23456 --dev vethI --rate 4mbit --mbytes 0.5

Times each collective on --mbytes MB per device, unlimited and with every node's egress limited to
--rate (tc tbf), median of --repeats, over two kinds of device group: '@node' (one device per node, as
a 2d_a2a replica sync or a 2d_ar all-to-all) and '@all' (every device, as a 1d all-to-all or the dense
all-reduce):
  one_way@node     collective-permute node 0 -> node 1 only (the others idle);
  exchange@node    collective-permute 0 <-> 1: each sends and receives the same bytes at once;
  all_to_all, all_reduce, all_gather @node and @all.
For each it reports `factor` = (limited - unlimited) / (cross-node bytes a node sends / rate), with the
bytes of the compiled HLO split as `jaxscale.training.comm_report.split_bytes` splits them (what the scaling model
counts), and `wire_ratio` = bytes the node's veth really sent / those bytes. The egress limit caps only what
a node sends, so a transport that overlaps the two directions gives factor ~1 on an exchange; one that
sends, then receives, gives ~2. bench_step.py's predicted deltas use these factors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench_step import tc, wire_bytes_counters

from jaxscale.studies.link_emulation import rate_bytes

KINDS = (
    "one_way@node",
    "exchange@node",
    "all_to_all@node",
    "all_to_all@all",
    "all_reduce@node",
    "all_reduce@all",
    "all_gather@node",
    "all_gather@all",
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--rate", default="4mbit")
    p.add_argument("--mbytes", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)

    from jaxscale.infra import distributed

    distributed.initialize(a.coordinator, a.nodes, a.process_id, local_devices=a.local)
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxscale.engine import comm_inspect
    from jaxscale.engine.mesh import AXES, NODE, make_mesh
    from jaxscale.training.comm_report import split_bytes

    mesh = make_mesh(a.nodes, a.local)
    G = a.nodes * a.local
    n = max(G, int(a.mbytes * 1e6 / 4) // G * G)  # fp32 elements per device, divisible by the group size
    spec = P(AXES)
    x = jax.make_array_from_callback((G * n,), NamedSharding(mesh, spec), lambda idx: np.ones(n, np.float32))

    def body_of(kind):
        name, group = kind.split("@")
        axes = NODE if group == "node" else AXES
        size = a.nodes if group == "node" else G

        def body(v):
            if name == "one_way":
                return jax.lax.ppermute(v, NODE, perm=[(0, 1)])
            if name == "exchange":
                return jax.lax.ppermute(v, NODE, perm=[(0, 1), (1, 0)])
            if name == "all_reduce":
                return jax.lax.psum(v, axes)
            if name == "all_gather":  # every gathered chunk is used, so XLA cannot drop any of them
                return jax.lax.all_gather(v, axes, tiled=True).reshape(size, -1).sum(0)
            return jax.lax.all_to_all(v.reshape(size, -1), axes, 0, 0, tiled=True).reshape(-1)

        return body

    fns, sent = {}, {}
    for kind in KINDS:
        fn = jax.jit(jax.shard_map(body_of(kind), mesh=mesh, in_specs=spec, out_specs=spec))
        compiled = fn.lower(x).compile()
        cs = comm_inspect.list_collectives(compiled, mesh=mesh)
        sent[kind] = a.local * sum(split_bytes(c, (a.nodes, a.local))[1] for c in cs)
        fns[kind] = compiled
        jax.block_until_ready(compiled(x))

    def measure(f):
        ts, before = [], wire_bytes_counters(a.dev)
        for _ in range(a.repeats):
            t = time.perf_counter()
            jax.block_until_ready(f(x))
            ts.append(time.perf_counter() - t)
        after = wire_bytes_counters(a.dev)
        return statistics.median(ts), (after[0] - before[0]) / a.repeats

    res = {}
    for phase, rate in (("unlimited", None), ("limited", a.rate)):
        tc(a.dev, rate)
        multihost_utils.sync_global_devices(f"duplex-{phase}")
        res[phase] = {k: measure(f) for k, f in fns.items()}
        multihost_utils.sync_global_devices(f"duplex-done-{phase}")
    tc(a.dev, None)
    if a.process_id == 0:
        r = rate_bytes(a.rate)
        out = {"nodes": a.nodes, "local": a.local, "rate": a.rate, "bytes_per_device": 4 * n, "repeats": a.repeats}
        for k in KINDS:
            (t0, wire), (t1, _) = res["unlimited"][k], res["limited"][k]
            out[k] = {
                "sent_per_node": sent[k],
                "unlimited_s": t0,
                "limited_s": t1,
                "factor": (t1 - t0) / (sent[k] / r) if sent[k] else None,
                "wire_ratio": wire / sent[k] if sent[k] else None,
            }
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
