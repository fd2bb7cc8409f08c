"""One 'node' of the emulated cluster: times the real compiled train step, unlimited and rate-limited.

Run by emulate.sh inside a network namespace, one process per namespace:
    python experiments/scaling/bench_step.py --stage 2d_a2a --nodes 2 --local 2 --process-id I \
        --coordinator 10.200.0.1:23456 --dev vethI --rate 50mbit --steps 8

Phase A removes any qdisc from this namespace's veth (unlimited), phase B installs `tc tbf rate RATE`
on it (each side limits its own egress, so both directions are limited). Both phases time the same
compiled step (median of --steps after 2 warm-up steps); process 0 prints one JSON line with the
measured medians, the compiled inter-node bytes, and the predicted phase-B time for the same rate.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

# A small foundation model with visible all-to-all payloads (sequence lookups of 32 events).
EMU_MODEL = dict(
    item_rows=4096,
    item_dim=32,
    item_vocab=100000,
    num_item_tables=2,
    item_combine="concat",
    num_layers=1,
    d_model=16,
    num_heads=1,
    max_seq_len=32,
    time_encoding="none",
    max_negatives=64,
)


def tc(dev, rate):
    subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    if rate:
        subprocess.run(
            ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "64kb", "latency", "400ms"],
            check=True,
        )


def rate_bytes(rate: str) -> float:
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f
    raise ValueError(rate)


def _globalize_host_state(trainer):
    """Works around Trainer.init_state in multi-process runs: it device_puts the model's host state, whose
    nnx RNG keys are committed single-device jax.Arrays, onto a sharding with non-addressable devices,
    which JAX refuses. Replace every leaf by a replicated global array built from host data."""
    import jax
    import numpy as np

    sh = trainer.replicated

    def glob(x):
        if not isinstance(x, jax.Array):
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(x))
            g = jax.make_array_from_callback(data.shape, sh, lambda idx: data[idx])
            return jax.random.wrap_key_data(g, impl=jax.random.key_impl(x))
        data = np.asarray(x)
        return jax.make_array_from_callback(data.shape, sh, lambda idx: data[idx])

    trainer._dense_host = jax.tree.map(glob, trainer._dense_host)
    trainer._rest_host = jax.tree.map(glob, trainer._rest_host)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", required=True)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--batch-per-device", type=int, default=4)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--coordinator", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--rate", default="50mbit")
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()

    from jaxscale import distributed

    distributed.initialize(a.coordinator, a.nodes, a.process_id, local_devices=a.local)
    import jax
    from jax.experimental import multihost_utils
    from stages import STAGES, overrides

    from jaxscale.comm_report import split_bytes
    from jaxscale.config import load_config
    from jaxscale.trainer import Trainer

    st = dict(STAGES)[a.stage]
    ov = overrides(st, a.nodes, a.local, tiny=EMU_MODEL, batch=a.batch_per_device * a.nodes * a.local)
    cfg = load_config(
        os.path.join(ROOT, "experiments/configs/foundation_smoke.yaml"),
        ov + ["train.overflow_policy=grow", "train.warmup_steps=1"],
    )
    trainer = Trainer(cfg, progress=False, log=False)
    _globalize_host_state(trainer)
    state = trainer.init_state()
    batches = [trainer.batch(i) for i in range(4)]
    trainer.compile(state, batches[0])
    shape = tuple(trainer.mesh.devices.shape)
    inter = sum(split_bytes(c, shape)[1] for c in trainer.collectives)
    intra = sum(split_bytes(c, shape)[0] for c in trainer.collectives)

    def timed(n):
        nonlocal state
        ts = []
        for i in range(n + 2):
            t0 = time.perf_counter()
            state, m = trainer.train_step(state, batches[i % 4])
            jax.block_until_ready(m["loss"])
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[2:])

    out = {}
    for phase, rate in (("unlimited", None), ("limited", a.rate)):
        tc(a.dev, rate)
        multihost_utils.sync_global_devices(f"phase-{phase}")
        out[phase] = timed(a.steps)
        multihost_utils.sync_global_devices(f"done-{phase}")
    tc(a.dev, None)
    if a.process_id == 0:
        per_node_inter = inter * a.local  # the node's devices share its one link
        r = rate_bytes(a.rate)
        print(
            json.dumps(
                {
                    "stage": a.stage,
                    "nodes": a.nodes,
                    "local": a.local,
                    "rate": a.rate,
                    "inter_bytes_per_device": inter,
                    "intra_bytes_per_device": intra,
                    "measured_unlimited_s": out["unlimited"],
                    "measured_limited_s": out["limited"],
                    # alpha-beta with a full-duplex link: t = t_unlimited + per-node inter bytes / rate
                    "predicted_duplex_s": out["unlimited"] + per_node_inter / r,
                    # gloo on this transport does not overlap the two directions (JAX_ON_CPU.md item 10)
                    "predicted_gloo_s": out["unlimited"] + 2 * per_node_inter / r,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
