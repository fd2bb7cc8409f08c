"""Shared scenario of tests/test_multiprocess.py, and its worker entry point.

`python tests/mp_embedding_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz` starts one process of a
multi-process run (4 CPU devices each, 'node' = process) and runs `run_scenario`; process 0 writes the
results. The pytest process imports `run_scenario` and runs it on its own 8 devices.
"""

from __future__ import annotations

import sys
import time

import numpy as np

B, L = 16, 5  # global batch
STEPS = 3
LOCAL_DEVICES = 4
CONFIGS = [(topo, sh) for topo in ("1d", "2d_a2a") for sh in ("row_wise", "table_wise")] + [("1d", "reuse")]
# "reuse": row-wise tables under reuse_capacities (only the first batch and re-runs are counted and exchanged)
LR, EPS = 0.05, 1e-8


def tables():
    import jaxscale

    # one width -> one stack: compile time (XLA:CPU, 2 processes on few cores) dominates this test
    return [
        jaxscale.TableConfig("items", rows=120, dim=8, pooling="sum", features=("a", "b")),
        jaxscale.TableConfig("user", rows=37, dim=8, pooling="mean"),
        jaxscale.TableConfig("seq", rows=50, dim=8, pooling=None),
    ]


def dense_tables():
    rng = np.random.default_rng(123)
    return {t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in tables()}


def global_batches():
    """[(ids, targets)] per step, the same global batch in every process."""
    rng = np.random.default_rng(456)
    out = []
    for _ in range(STEPS):
        ids, targets = {}, {}
        for t in tables():
            for f in t.features:
                x = rng.integers(0, min(t.rows, 20), size=(B, L)).astype(np.int32)  # many duplicates
                x[rng.random((B, L)) < 0.2] = t.rows - 1
                x[rng.random((B, L)) < 0.2] = -1  # padding
                ids[f] = x
                shape = (B, L, t.dim) if t.pooling is None else (B, t.dim)
                targets[f] = rng.normal(size=shape).astype(np.float32)
        out.append((ids, targets))
    return out


def key(topology, sharding):
    return f"{topology}-{sharding}"


def run_scenario(mesh) -> dict[str, np.ndarray]:
    """3 lookup+update steps per config; loss 0.5*sum((emb - target)**2), so grads = emb - target.

    Each process feeds only its half of the global batch through `shard_batch`. Returns flat
    {name: array} of the lookup outputs (every step), final tables and accumulators (on every process:
    the gathers are collectives).
    """
    import jax
    from jax.experimental import multihost_utils

    import jaxscale

    nproc, pid = jax.process_count(), jax.process_index()
    per = B // nproc
    mine = slice(pid * per, (pid + 1) * per)
    grad_fn = jax.jit(lambda emb, tgt: jax.tree.map(lambda e, t: e - t, emb, tgt))
    gather = (lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True))) if nproc > 1 else np.asarray
    results = {}
    t0 = time.monotonic()
    for topology, sharding in CONFIGS:
        k = key(topology, sharding)
        print(f"[process {pid}] {k} start at {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        reuse = sharding == "reuse"
        ec = jaxscale.EmbeddingCollection(
            tables(),
            mesh,
            jaxscale.EmbeddingSettings(
                topology=topology,
                sharding="row_wise" if reuse else sharding,
                optimizer=jaxscale.RowWiseAdagrad(LR, eps=EPS),
                reuse_capacities=reuse,
            ),
        )
        state = ec.from_dense(dense_tables())
        reruns = 0
        for step, (ids, targets) in enumerate(global_batches()):
            local_ids = ec.shard_batch({f: x[mine] for f, x in ids.items()})
            local_tgt = ec.shard_batch({f: x[mine] for f, x in targets.items()})
            assert all(x.shape[0] == B for x in local_ids.values())
            emb, stats = ec.lookup(state, local_ids, return_stats=True)
            if int(np.asarray(stats["overflow"].addressable_data(0))):  # the same total on every process
                reruns += 1
                local_ids = ec.shard_batch({f: x[mine] for f, x in ids.items()}, recount=True)
                emb, stats = ec.lookup(state, local_ids, return_stats=True)
            assert int(np.asarray(stats["overflow"].addressable_data(0))) == 0
            for f in sorted(emb):
                results[f"{k}/out/{step}/{f}"] = gather(emb[f])
            state = ec.update(state, local_ids, grad_fn(emb, local_tgt))
            print(f"[process {pid}] {k} step {step} done at {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        results[f"{k}/reruns"] = np.asarray(reruns)
        for name, w in ec.to_dense(state).items():
            results[f"{k}/table/{name}"] = w
        for name, a in ec.slots_to_dense(state)["accumulator"].items():
            results[f"{k}/acc/{name}"] = a
        for r in range(1, ec.num_replicas):  # replicas stay bit-identical under exact sync
            other = ec.to_dense(state, replica=r)
            for name in other:
                np.testing.assert_array_equal(other[name], results[f"{k}/table/{name}"])
    return results


def main(argv):
    pid, nproc, port, out = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    import jax

    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)  # before the backend starts
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    import jaxscale

    assert jax.process_count() == nproc and jax.process_index() == pid
    assert len(jax.local_devices()) == LOCAL_DEVICES and jax.device_count() == nproc * LOCAL_DEVICES
    mesh = jaxscale.make_mesh(nproc, LOCAL_DEVICES)
    rows_by_process = [sorted({d.process_index for d in row}) for row in mesh.devices]
    assert rows_by_process == [[p] for p in range(nproc)], rows_by_process
    results = run_scenario(mesh)
    if pid == 0:
        results["meta/process_count"] = np.array(jax.process_count())
        results["meta/device_count"] = np.array(jax.device_count())
        np.savez(out, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv)
