"""TorchRec baseline runner: the same tables, ids and gradients through stock TorchRec.

Runs TorchRec ``DistributedModelParallel`` (FBGEMM fused TBE kernels) over ``torch.distributed`` gloo on N
local processes (rendezvous through a file in a private temporary directory; gloo itself connects over
127.0.0.1), or in-process for world size 1. Pooled tables go through ``EmbeddingBagCollection``, sequence
tables (``pooling=None``) through ``EmbeddingCollection``. Tables are ``jaxscale.TableConfig``s.

Returns per-step lookup outputs (global batch, dense numpy), the final tables gathered to dense numpy, the
bytes handed to each torch.distributed collective (per rank and step) and step wall-clock times, so results
can be compared with jaxscale and with `jaxscale.engine.reference`, the NumPy reference of FBGEMM semantics.

Semantics (chosen to match a single-process run over the whole global batch):
  * ids: int [B, L] per feature, ``-1`` = padding (any position); converted to a KeyedJaggedTensor.
  * outputs: pooled [B, dim]; sequence [B, L, dim] with zeros at padding positions.
  * loss per step = sum_f sum(outputs[f] * G[f]); the embedding gradient is therefore G summed over the
    *global* batch. TorchRec divides embedding gradients by the world size by default (``GRADIENT_DIVISION``,
    meant to pair with DDP's averaging); the runner turns that off unless ``gradient_division=True``.
  * optimizers: FBGEMM ``EXACT_SGD`` (w -= lr*g) and ``EXACT_ROWWISE_ADAGRAD`` (per touched row:
    acc += mean(g^2 over the row's columns); w -= lr*g/(sqrt(acc)+eps)); duplicate ids are summed first.

It lives in the library because the benchmark suite (`jaxscale.benchmarks.equal_devices`, run from an
installed wheel too) and the parity tests drive it; importing it imports NumPy and `jaxscale.engine.reference`
only: torch, torchrec and fbgemm_gpu are imported inside the functions that run in its own processes.

Programmatic use::

    from jaxscale.benchmarks.torchrec_runner import run_torchrec             # a process without JAX, or:
    from jaxscale.benchmarks.torchrec_runner import run_torchrec_subprocess  # fresh interpreter (next to JAX)
    res = run_torchrec_subprocess(tables, weights, batches, grads, sharding="row_wise", world_size=2,
                                  optimizer="rowwise_adagrad", lr=0.1, eps=1e-8)
    res["outputs"][step][feature], res["tables"][name], res["comm"], res["step_times"]

From any process, without importing this module: pickle a list of job dicts (the keyword arguments of
`run_torchrec`, tables as dicts of `TableConfig` fields) and run
``python -m jaxscale.benchmarks.torchrec_runner --input jobs.pkl --output results.pkl``.

CLI (synthetic data, compares with the NumPy reference; experiments/baselines/torchrec_runner.py is the same)::

    python -m jaxscale.benchmarks.torchrec_runner --world-size 2 --sharding row_wise --optimizer sgd --check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxscale.engine import reference
from jaxscale.engine.tables import TableConfig
from jaxscale.infra import atomic

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise")
OPTIMIZERS = {
    "sgd": "EXACT_SGD",
    "exact_sgd": "EXACT_SGD",
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
    "exact_rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
    "adagrad": "EXACT_ROWWISE_ADAGRAD",
}
PRECISIONS = ("fp32", "fp16", "bf16", "fp8")


# ----------------------------------------------------------------------------------------------- inputs
def as_table(t: Any) -> TableConfig:
    """A jaxscale.TableConfig from a TableConfig, a dict of its fields or (name, rows, dim, pooling, features)."""
    if isinstance(t, TableConfig):
        return t
    if isinstance(t, Mapping):
        return TableConfig(
            t["name"], int(t["rows"]), int(t["dim"]), t.get("pooling", "sum"), tuple(t.get("features", ()))
        )
    if isinstance(t, (tuple, list)):
        return TableConfig(*t)
    raise TypeError(f"expected a jaxscale.TableConfig, a dict or a tuple, got {type(t).__name__}: {t!r}")


def table_fields(t: TableConfig) -> dict:
    """The fields the runner uses, as plain data (what travels in a pickled job)."""
    if t.reshape is not None:
        raise ValueError(f"table {t.name!r}: reshape={t.reshape!r} has no TorchRec equivalent")
    return {"name": t.name, "rows": t.rows, "dim": t.dim, "pooling": t.pooling, "features": list(t.features)}


def _norm_grads(grads, n_steps):
    if grads is None:
        return [None] * n_steps
    if isinstance(grads, Mapping):
        return [grads] * n_steps
    grads = list(grads)
    if len(grads) != n_steps:
        raise ValueError(f"got {len(grads)} gradient dicts for {n_steps} batches")
    return grads


# ------------------------------------------------------------------------------------ NumPy reference
def numpy_reference(tables, weights, batches, grads=None, optimizer="sgd", lr=0.1, eps=1e-8, col_blocks=1):
    """`jaxscale.engine.reference.train` with the runner's optimizer names; col_blocks=k models TorchRec's
    column_wise row-wise AdaGrad (one accumulator per column shard of k equal shards)."""
    tables = [as_table(t) for t in tables]
    opt = "sgd" if OPTIMIZERS[optimizer.lower()] == "EXACT_SGD" else "rowwise_adagrad"
    return reference.train(
        {t.name: weights[t.name] for t in tables},
        tables,
        batches,
        grads,
        optimizer=opt,
        lr=lr,
        eps=eps,
        col_parts={t.name: col_blocks for t in tables} if col_blocks > 1 else None,
    )


# ------------------------------------------------------------------------------- collective accounting
def _tensor_bytes(x) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


def _tensor_dtype(x) -> str:
    import torch

    if isinstance(x, torch.Tensor):
        return str(x.dtype).replace("torch.", "")
    if isinstance(x, (list, tuple)) and x:
        return _tensor_dtype(x[0])
    return "?"


class CommCounter:
    """Patches torch.distributed collectives (and the functional all_to_all_single TorchRec uses) to tally,
    per (op, dtype), the number of calls and the bytes of the tensor(s) this rank hands to the collective
    (the input; for all_to_all also the part that leaves this rank)."""

    def __init__(self):
        self.calls = defaultdict(int)
        self.bytes = defaultdict(int)
        self.offrank_bytes = defaultdict(int)
        self._orig = []

    def reset(self):
        self.calls.clear(), self.bytes.clear(), self.offrank_bytes.clear()

    def snapshot(self):
        return {
            f"{op}[{dt}]": {
                "calls": self.calls[(op, dt)],
                "bytes": self.bytes[(op, dt)],
                "offrank_bytes": self.offrank_bytes[(op, dt)],
            }
            for (op, dt) in sorted(self.calls)
        }

    def _wrap(self, mod, name, input_pos, input_kw):
        orig = getattr(mod, name, None)
        if orig is None or getattr(orig, "_jaxscale_counted", False):
            return
        counter = self

        def wrapped(*args, **kwargs):
            x = kwargs.get(input_kw) if input_kw in kwargs else (args[input_pos] if len(args) > input_pos else None)
            key = (name, _tensor_dtype(x))
            nbytes = _tensor_bytes(x)
            counter.calls[key] += 1
            counter.bytes[key] += nbytes
            if name == "all_to_all_single":
                counter.offrank_bytes[key] += _a2a_offrank(x, args, kwargs, nbytes)
            return orig(*args, **kwargs)

        wrapped._jaxscale_counted = True
        setattr(mod, name, wrapped)
        self._orig.append((mod, name, orig))

    def install(self):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as fc

        # input position/keyword of the tensor this rank contributes
        spec = {
            "all_to_all_single": (1, "input"),
            "all_to_all": (1, "input_tensor_list"),
            "reduce_scatter_tensor": (1, "input"),
            "reduce_scatter": (1, "input_list"),
            "all_gather_into_tensor": (1, "input_tensor"),
            "all_gather": (1, "tensor"),
            "all_reduce": (0, "tensor"),
            "all_reduce_coalesced": (0, "tensors"),
            "broadcast": (0, "tensor"),
        }
        for name, (pos, kw) in spec.items():
            self._wrap(dist, name, pos, kw)
        self._wrap(fc, "all_to_all_single", 0, "self")
        self._wrap(fc, "reduce_scatter_tensor", 0, "self")
        self._wrap(fc, "all_gather_tensor", 0, "self")
        return self

    def uninstall(self):
        for mod, name, orig in reversed(self._orig):
            setattr(mod, name, orig)
        self._orig.clear()


def _a2a_offrank(x, args, kwargs, nbytes):
    import torch.distributed as dist

    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        # dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group)
        splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
        if not splits:
            return nbytes - nbytes // max(world, 1)
        row = nbytes // max(sum(splits), 1)
        return nbytes - row * splits[rank]
    except Exception:  # functional variant / unusual call: count everything
        return nbytes


# ------------------------------------------------------------------------------------------ the worker
def _comm_type(p: str):
    from torchrec.distributed.fbgemm_qcomm_codec import CommType

    return {"fp32": CommType.FP32, "fp16": CommType.FP16, "bf16": CommType.BF16, "fp8": CommType.FP8}[p]


def _build_model(tables: list[TableConfig]):
    import torch
    from torch import nn
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    pooled = [t for t in tables if t.pooling is not None]
    seq_by_dim: dict[int, list[TableConfig]] = defaultdict(list)
    for t in tables:
        if t.pooling is None:
            seq_by_dim[t.dim].append(t)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = None
            if pooled:
                self.ebc = EmbeddingBagCollection(
                    tables=[
                        EmbeddingBagConfig(
                            name=t.name,
                            embedding_dim=t.dim,
                            num_embeddings=t.rows,
                            feature_names=list(t.features),
                            pooling=PoolingType.SUM if t.pooling == "sum" else PoolingType.MEAN,
                        )
                        for t in pooled
                    ],
                    device=torch.device("cpu"),
                )
            # EmbeddingCollection needs one embedding dim for all its tables: one module per dim.
            self.ecs = nn.ModuleDict(
                {
                    f"d{d}": EmbeddingCollection(
                        tables=[
                            EmbeddingConfig(
                                name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=list(t.features)
                            )
                            for t in ts
                        ],
                        device=torch.device("cpu"),
                    )
                    for d, ts in sorted(seq_by_dim.items())
                }
            )

        def forward(self, inputs):
            out = {}
            if self.ebc is not None:
                out.update(self.ebc(inputs["ebc"]).to_dict())
            for k, ec in self.ecs.items():
                out.update(ec(inputs[f"ecs.{k}"]))
            return out

    return Model(), pooled, dict(seq_by_dim)


def _kjt(features: Sequence[str], ids_by_f, lo: int, hi: int):
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths, values = [], []
    for f in features:
        ids = np.asarray(ids_by_f[f])[lo:hi]
        mask = ids >= 0
        lengths.append(mask.sum(1).astype(np.int64))
        values.append(ids[mask].astype(np.int64))
    return KeyedJaggedTensor(
        keys=list(features),
        values=torch.from_numpy(np.concatenate(values)),
        lengths=torch.from_numpy(np.concatenate(lengths)),
    )


def _plan(model, tables_pooled, seq_by_dim, sharding, world, local_size, sharders):
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    n_hosts = max(world // local_size, 1)

    def gen(i, t):
        if sharding == "table_row_wise" and t.pooling is None:
            # TorchRec's EmbeddingCollection has no table_row_wise ("Sharding not supported table_row_wise").
            return row_wise()
        if sharding == "table_wise":
            return table_wise(rank=i % world)
        if sharding == "row_wise":
            return row_wise()
        if sharding == "column_wise":
            if t.dim % world:
                raise ValueError(f"column_wise: dim {t.dim} of {t.name} not divisible by world size {world}")
            return column_wise(ranks=list(range(world)))
        if sharding == "table_row_wise":
            return table_row_wise(host_index=i % n_hosts)
        raise ValueError(f"unknown sharding {sharding!r}; one of {SHARDING_TYPES}")

    def fused(g):  # every shard uses the fused FBGEMM TBE kernel (optimizer applied in backward)
        def inner(*a, **k):
            ps = g(*a, **k)
            ps.compute_kernel = "fused"
            return ps

        return inner

    plan = {}
    i = 0
    if model.ebc is not None:
        per = {}
        for t in tables_pooled:
            per[t.name] = fused(gen(i, t))
            i += 1
        plan["ebc"] = construct_module_sharding_plan(
            model.ebc, per, sharder=sharders["ebc"], local_size=local_size, world_size=world, device_type="cpu"
        )
    for d, ts in sorted(seq_by_dim.items()):
        per = {}
        for t in ts:
            per[t.name] = fused(gen(i, t))
            i += 1
        plan[f"ecs.d{d}"] = construct_module_sharding_plan(
            model.ecs[f"d{d}"], per, sharder=sharders["ec"], local_size=local_size, world_size=world, device_type="cpu"
        )
    return ShardingPlan(plan)


def _local_shards(v):
    """[(row_off, col_off, tensor)] of one state-dict entry (ShardedTensor, DTensor or plain tensor)."""
    import torch

    if hasattr(v, "local_shards"):
        return [(s.metadata.shard_offsets[0], s.metadata.shard_offsets[1], s.tensor) for s in v.local_shards()]
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # pragma: no cover
        DTensor = ()
    if DTensor and isinstance(v, DTensor):
        raise NotImplementedError("DTensor state dict entries are not handled (TorchRec 1.8 uses ShardedTensor)")
    assert isinstance(v, torch.Tensor)
    return [(0, 0, v)]


def _worker(rank: int, world: int, job: dict, out_dir: str):
    result = {"rank": rank}
    try:
        result.update(_run_rank(rank, world, os.path.join(out_dir, "rendezvous"), job))
    except Exception as e:  # report to the parent instead of hanging it
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)
    if "error" in result and world > 1:
        os._exit(1)  # peers blocked in a collective: do not wait for a clean gloo shutdown


def _run_rank(rank: int, world: int, rendezvous: str, job: dict) -> dict:
    """One rank: join the gloo group (a FileStore rendezvous: no port to pick, none to race for), train."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecated-collective notices
    warnings.filterwarnings("ignore", message=".*is_fx_tracing.*")
    if not job.get("verbose"):
        logging.getLogger().setLevel(logging.ERROR)  # TorchRec's QComms fallback notices (recorded in config)
        logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(job.get("threads", 1)))  # intra-op threads: the suite's thread parity
    local_size = int(job.get("local_size") or world)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % local_size),
        LOCAL_WORLD_SIZE=str(local_size),
    )
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world,
            init_method=f"file://{rendezvous}",
            timeout=__import__("datetime").timedelta(seconds=int(job.get("timeout_s", 300))),
        )
    try:
        return _train(rank, world, local_size, job)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _train(rank, world, local_size, job):
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import comm_ops
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import QCommsConfig, get_qcomm_codecs_registry
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    tables = [as_table(t) for t in job["tables"]]
    batches, grads = job["batches"], _norm_grads(job.get("grads"), len(job["batches"]))
    comm_ops.set_gradient_division(bool(job.get("gradient_division", False)))

    opt = OPTIMIZERS[job.get("optimizer", "sgd").lower()]
    fused_params = {"optimizer": getattr(EmbOptimType, opt), "learning_rate": float(job.get("lr", 0.1))}
    if opt == "EXACT_ROWWISE_ADAGRAD":
        fused_params["eps"] = float(job.get("eps", 1e-8))
    fwd_p = job.get("qcomms", "fp32")
    bwd_p = job.get("qcomms_bwd") or fwd_p
    registry = None
    if world > 1 and (fwd_p, bwd_p) != ("fp32", "fp32"):
        registry = get_qcomm_codecs_registry(
            QCommsConfig(forward_precision=_comm_type(fwd_p), backward_precision=_comm_type(bwd_p)),
            device=torch.device("cpu"),
        )
    sharders = {
        "ebc": EmbeddingBagCollectionSharder(fused_params=dict(fused_params), qcomm_codecs_registry=registry),
        "ec": EmbeddingCollectionSharder(fused_params=dict(fused_params), qcomm_codecs_registry=registry),
    }

    torch.manual_seed(0)
    model, pooled, seq_by_dim = _build_model(tables)
    plan = _plan(model, pooled, seq_by_dim, job.get("sharding", "row_wise"), world, local_size, sharders)
    dmp = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=plan,
        sharders=list(sharders.values()),
        device=torch.device("cpu"),
    )

    # Load the given dense weights into this rank's shards (views into the TBE weights).
    weights = job["weights"]
    table_names = {t.name for t in tables}
    loaded = set()
    with torch.no_grad():
        for key, v in dmp.state_dict().items():
            name = key.split(".")[-2]
            if name not in table_names or not key.endswith(".weight"):
                continue
            w = np.asarray(weights[name], dtype=np.float32)
            for r0, c0, tensor in _local_shards(v):
                r1, c1 = r0 + tensor.shape[0], c0 + tensor.shape[1]
                tensor.copy_(torch.from_numpy(np.ascontiguousarray(w[r0:r1, c0:c1])))
            loaded.add(name)
    if rank == 0 and loaded != table_names and world == 1:
        raise RuntimeError(f"tables not found in the state dict: {sorted(table_names - loaded)}")

    counter = CommCounter().install()
    feats_of = {}
    if model.ebc is not None:
        feats_of["ebc"] = [f for t in pooled for f in t.features]
    for d, ts in sorted(seq_by_dim.items()):
        feats_of[f"ecs.d{d}"] = [f for t in ts for f in t.features]
    seq_feats = {f: t.dim for t in tables if t.pooling is None for f in t.features}

    B = next(iter(np.asarray(b).shape[0] for b in batches[0].values()))
    if B % world:
        raise ValueError(f"global batch {B} not divisible by world size {world}")
    Bl = B // world
    lo, hi = rank * Bl, (rank + 1) * Bl

    outputs, step_times, comm = [], [], []
    for ids_by_f, G in zip(batches, grads):
        inputs = {k: _kjt(fs, ids_by_f, lo, hi) for k, fs in feats_of.items()}
        if world > 1:
            dist.barrier()
        counter.reset()
        t0 = time.perf_counter()
        out = dmp(inputs)
        loss = None
        if G is not None:
            terms = []
            for f, o in out.items():
                g = np.asarray(G[f], np.float32)[lo:hi]
                if f in seq_feats:
                    mask = np.asarray(ids_by_f[f])[lo:hi] >= 0
                    terms.append((o.values() * torch.from_numpy(g[mask])).sum())
                else:
                    terms.append((o * torch.from_numpy(g)).sum())
            loss = torch.stack(terms).sum()
            loss.backward()  # fused TBE optimizer updates the touched rows here
        step_times.append(time.perf_counter() - t0)
        comm.append(counter.snapshot())
        step_out = {}
        for f, o in out.items():
            if f in seq_feats:
                ids = np.asarray(ids_by_f[f])[lo:hi]
                mask = ids >= 0
                dense = np.zeros(ids.shape + (seq_feats[f],), np.float32)
                dense[mask] = o.values().detach().numpy()
                step_out[f] = dense
            else:
                step_out[f] = o.detach().numpy().copy()
        outputs.append(step_out)
    counter.uninstall()

    shards = []
    for key, v in dmp.state_dict().items():
        name = key.split(".")[-2]
        if name in table_names and key.endswith(".weight"):
            for r0, c0, tensor in _local_shards(v):
                shards.append((name, int(r0), int(c0), tensor.detach().numpy().copy()))
    return {
        "outputs": outputs,
        "shards": shards,
        "step_times": step_times,
        "comm": comm,
        "plan": str(plan) if rank == 0 and job.get("return_plan") else None,
        "threads": torch.get_num_threads(),  # as the rank ran (set from job["threads"])
    }


# ------------------------------------------------------------------------------------------ the driver
def run_torchrec(
    tables,
    weights,
    batches,
    grads=None,
    *,
    sharding="row_wise",
    world_size=2,
    local_size=None,
    optimizer="sgd",
    lr=0.1,
    eps=1e-8,
    qcomms="fp32",
    qcomms_bwd=None,
    gradient_division=False,
    threads=1,
    timeout_s=300,
    start_method=None,
    return_plan=False,
    expected_tables=None,
    keep_arrays=True,
) -> dict:
    """Run TorchRec DMP on ``world_size`` gloo ranks (in-process when 1) and gather results to dense numpy.

    tables: jaxscale.TableConfig (or a dict of its fields); weights: {table: float32 [rows, dim]};
    batches: [{feature: int [B, L], -1 padded}] (global batch, split evenly over ranks);
    grads: None (lookup only), one {feature: dL/d output} used every step, or one per batch.
    weights, batches and grads may each be given as the path of a pickle file holding them (large data
    written once for many jobs). expected_tables: the path of an .npz {table: array} to compare the final
    tables with (adds "max_abs_diff": {table: float}); keep_arrays=False leaves outputs and tables out.
    Returns {"outputs": [{feature: array}], "tables": {name: array}, "step_times": [[s] per rank],
             "comm": [[{op[dtype]: {calls, bytes, offrank_bytes}} per step] per rank], "config": {...}}.
    Raises RuntimeError carrying TorchRec's error (e.g. FP8 QComms on CPU)."""
    tables = [as_table(t) for t in tables]
    weights, batches, grads = (_unpickle(x) for x in (weights, batches, grads))
    if qcomms not in PRECISIONS or (qcomms_bwd or qcomms) not in PRECISIONS:
        raise ValueError(f"qcomms precision must be one of {PRECISIONS}")
    if sharding not in SHARDING_TYPES:
        raise ValueError(f"sharding must be one of {SHARDING_TYPES}")
    job = dict(
        tables=[table_fields(t) for t in tables],
        weights={k: np.asarray(v, np.float32) for k, v in weights.items()},
        batches=[{f: np.asarray(x) for f, x in b.items()} for b in batches],
        grads=grads,
        sharding=sharding,
        optimizer=optimizer,
        lr=lr,
        eps=eps,
        qcomms=qcomms,
        qcomms_bwd=qcomms_bwd,
        gradient_division=gradient_division,
        threads=threads,
        timeout_s=timeout_s,
        local_size=local_size,
        return_plan=return_plan,
    )
    with tempfile.TemporaryDirectory(prefix="torchrec_runner_") as out_dir:
        if world_size == 1:
            _worker(0, 1, job, out_dir)
        else:
            import torch.multiprocessing as mp

            # fork is fast, but never fork a process that runs JAX. Spawned children import this module by
            # name with the parent's sys.path (or re-run it when it is the main script).
            if start_method is None:
                start_method = "spawn" if "jax" in sys.modules else "fork"
            ctx = mp.get_context(start_method)
            procs = [
                ctx.Process(target=_worker, args=(r, world_size, job, out_dir), daemon=True) for r in range(world_size)
            ]
            for p in procs:
                p.start()
            deadline = time.time() + timeout_s + 60
            for p in procs:
                p.join(max(deadline - time.time(), 1))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                results.append({"rank": r, "error": "rank produced no result (crashed, killed or timed out)"})
                continue
            with open(path, "rb") as fh:
                results.append(pickle.load(fh))
    errors = [res for res in results if "error" in res]
    if errors:
        first = errors[0]
        if "fp8" in (qcomms, qcomms_bwd):
            first["error"] = (
                "FP8 QComms is not supported by TorchRec/FBGEMM on CPU (a 1-D buffer reaches "
                "fbgemm's FP8 quantize kernel; its row-wise FP8 mode rejects CPU): " + first["error"]
            )
        raise RuntimeError(
            f"TorchRec run failed on rank {first['rank']}: {first['error']}\n{first.get('traceback', '')}"
        )
    outputs = [
        {f: np.concatenate([res["outputs"][s][f] for res in results]) for f in results[0]["outputs"][s]}
        for s in range(len(batches))
    ]
    dense = {t.name: np.full((t.rows, t.dim), np.nan, np.float32) for t in tables}
    for res in results:
        for name, r0, c0, arr in res["shards"]:
            dense[name][r0 : r0 + arr.shape[0], c0 : c0 + arr.shape[1]] = arr
    for name, arr in dense.items():
        if np.isnan(arr).any():
            raise RuntimeError(f"table {name}: some rows/columns were not gathered from any shard")
    notes = []
    if world_size > 1 and "bf16" in (qcomms, qcomms_bwd):
        notes.append("TorchRec maps BF16 QComms to FP16 on gloo/CPU (get_qcomm_codecs_registry)")
    if world_size > 1 and "fp8" in (qcomms, qcomms_bwd) and sharding == "row_wise":
        notes.append("TorchRec runs the reduce-scatter in FP16 forward / BF16->FP16 backward when FP8 is asked")
    if sharding == "table_row_wise" and any(t.pooling is None for t in tables):
        notes.append("sequence tables ran row_wise: TorchRec EmbeddingCollection has no table_row_wise")
    if world_size == 1:
        notes.append("world size 1: no collectives, QComms not applied")
    result = {
        "outputs": outputs,
        "tables": dense,
        "step_times": [res["step_times"] for res in results],
        "comm": [res["comm"] for res in results],
        "plan": results[0].get("plan"),
        "config": {
            k: job[k] for k in ("sharding", "optimizer", "lr", "eps", "qcomms", "qcomms_bwd", "gradient_division")
        }
        | {"world_size": world_size, "notes": notes, "threads": threads},
        "threads_per_rank": [res.get("threads") for res in results],
    }
    if expected_tables is not None:
        with np.load(expected_tables) as want:
            result["max_abs_diff"] = {name: float(np.abs(dense[name] - want[name]).max()) for name in dense}
    if not keep_arrays:
        del result["outputs"], result["tables"]
    return result


def _unpickle(x):
    """x, or the object pickled in the file x names."""
    if isinstance(x, (str, os.PathLike)):
        with open(x, "rb") as fh:
            return pickle.load(fh)
    return x


def run_torchrec_subprocess(*args, jobs: list[dict] | None = None, timeout_s: int = 900, **kwargs):
    """Same as run_torchrec, in a fresh Python interpreter (use this from a process that runs JAX).

    With ``jobs=[{...run_torchrec kwargs incl. tables/weights/batches/grads...}, ...]`` runs several
    configurations in one interpreter (pays the ~4 s torch/torchrec import once) and returns a list whose
    entries are a result dict or {"error": str}."""
    single = jobs is None
    if single:
        names = ("tables", "weights", "batches", "grads")
        jobs = [dict(zip(names, args)) | kwargs]
    with tempfile.TemporaryDirectory(prefix="torchrec_sub_") as d:
        inp, out = os.path.join(d, "in.pkl"), os.path.join(d, "out.pkl")
        with open(inp, "wb") as fh:
            pickle.dump([_plain_job(j) for j in jobs], fh)
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)
        proc = subprocess.run(
            [sys.executable, "-m", "jaxscale.benchmarks.torchrec_runner", "--input", inp, "--output", out],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"torchrec_runner subprocess failed (rc={proc.returncode}):\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
            )
        with open(out, "rb") as fh:
            results = pickle.load(fh)
    if single:
        if "error" in results[0]:
            raise RuntimeError(results[0]["error"])
        return results[0]
    return results


def _plain_job(job: dict) -> dict:
    job = dict(job)
    job["tables"] = [table_fields(as_table(t)) for t in job["tables"]]
    if not isinstance(job["weights"], (str, os.PathLike)):
        job["weights"] = {k: np.asarray(v, np.float32) for k, v in job["weights"].items()}
    if not isinstance(job["batches"], (str, os.PathLike)):
        job["batches"] = [{f: np.asarray(x) for f, x in b.items()} for b in job["batches"]]
    g = job.get("grads")
    if g is not None and not isinstance(g, (str, os.PathLike)):
        job["grads"] = (
            {f: np.asarray(x, np.float32) for f, x in g.items()}
            if isinstance(g, Mapping)
            else [{f: np.asarray(x, np.float32) for f, x in gi.items()} for gi in g]
        )
    return job


# --------------------------------------------------------------------------------------- synthetic data
def synthetic(
    num_tables=3, rows=1000, dim=16, poolings=("sum", "mean", None), batch=64, hotness=8, steps=3, seed=0, zipf=None
):
    """Tables cycling through ``poolings``, random weights, -1 padded ids (ragged), random output grads."""
    rng = np.random.default_rng(seed)
    tables = [TableConfig(f"t{i}", rows, dim, poolings[i % len(poolings)], (f"f{i}",)) for i in range(num_tables)]
    weights = {t.name: rng.normal(size=(t.rows, t.dim)).astype(np.float32) for t in tables}
    batches, grads = [], []
    for _ in range(steps):
        b, g = {}, {}
        for t in tables:
            for f in t.features:
                ids = (
                    (rng.zipf(zipf, size=(batch, hotness)) - 1) % t.rows
                    if zipf
                    else rng.integers(0, t.rows, (batch, hotness))
                )
                lengths = rng.integers(0, hotness + 1, batch)
                ids = np.where(np.arange(hotness)[None] < lengths[:, None], ids, -1).astype(np.int32)
                b[f] = ids
                shape = (batch, t.dim) if t.pooling else (batch, hotness, t.dim)
                g[f] = rng.normal(size=shape).astype(np.float32)
        batches.append(b)
        grads.append(g)
    return tables, weights, batches, grads


def compare(res, ref, rtol=1e-5, atol=1e-6) -> list[str]:
    problems = []
    for s, (o, r) in enumerate(zip(res["outputs"], ref["outputs"])):
        for f in r:
            if not np.allclose(o[f], r[f], rtol=rtol, atol=atol):
                problems.append(f"step {s} output {f}: max abs diff {np.abs(o[f] - r[f]).max():.3g}")
    for name, r in ref["tables"].items():
        if not np.allclose(res["tables"][name], r, rtol=rtol, atol=atol):
            problems.append(f"table {name}: max abs diff {np.abs(res['tables'][name] - r).max():.3g}")
    return problems


def _summarize(res) -> dict:
    times = np.array(res["step_times"])  # [rank, step]
    per_step = [
        {
            k: sum(rank_steps[s].get(k, {}).get("bytes", 0) for rank_steps in res["comm"])
            for k in set().union(*(rank_steps[s].keys() for rank_steps in res["comm"]))
        }
        for s in range(times.shape[1])
    ]
    return {
        "median_step_s": float(np.median(times.max(0))),
        "step_s_max_over_ranks": times.max(0).round(5).tolist(),
        "collective_bytes_all_ranks_step0": per_step[0] if per_step else {},
    }


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks on 127.0.0.1 (1 = in-process)")
    p.add_argument("--local-size", type=int, default=None, help="ranks per simulated host (table_row_wise)")
    p.add_argument("--sharding", choices=SHARDING_TYPES, default="row_wise")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--qcomms", choices=PRECISIONS, default="fp32", help="forward QComms precision")
    p.add_argument("--qcomms-bwd", choices=PRECISIONS, default=None, help="backward precision (default: --qcomms)")
    p.add_argument("--gradient-division", action="store_true", help="keep TorchRec's default 1/world grad scaling")
    p.add_argument("--num-tables", type=int, default=3)
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--poolings", default="sum,mean,none", help="cycled over tables; 'none' = sequence")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--hotness", type=int, default=8, help="max ids per bag (L)")
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent for ids (default uniform)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--start-method",
        choices=("fork", "spawn", "forkserver"),
        default=None,
        help="how ranks start (default: fork, spawn when JAX is imported)",
    )
    p.add_argument("--check", action="store_true", help="compare with the NumPy reference of FBGEMM semantics")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--atol", type=float, default=1e-6)
    p.add_argument("--json", default=None, help="write the summary (timings, collective bytes) here")
    p.add_argument("--input", help=argparse.SUPPRESS)  # pickled job list (run_torchrec_subprocess)
    p.add_argument("--output", help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.input:
        with open(a.input, "rb") as fh:
            jobs = pickle.load(fh)
        results = []
        for job in jobs:
            try:
                results.append(run_torchrec(**job))
            except Exception as e:
                results.append({"error": f"{type(e).__name__}: {e}"})
        with open(a.output, "wb") as fh:
            pickle.dump(results, fh)
        return 0

    poolings = tuple(None if x.strip().lower() == "none" else x.strip() for x in a.poolings.split(","))
    tables, weights, batches, grads = synthetic(
        a.num_tables, a.rows, a.dim, poolings, a.batch, a.hotness, a.steps, a.seed, a.zipf
    )
    try:
        res = run_torchrec(
            tables,
            weights,
            batches,
            grads,
            sharding=a.sharding,
            world_size=a.world_size,
            local_size=a.local_size,
            optimizer=a.optimizer,
            lr=a.lr,
            eps=a.eps,
            qcomms=a.qcomms,
            qcomms_bwd=a.qcomms_bwd,
            gradient_division=a.gradient_division,
            threads=a.threads,
            start_method=a.start_method,
        )
    except RuntimeError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    summary = {"config": res["config"], **_summarize(res)}
    if a.check:
        cb = a.world_size if a.sharding == "column_wise" and OPTIMIZERS[a.optimizer] == "EXACT_ROWWISE_ADAGRAD" else 1
        ref = numpy_reference(tables, weights, batches, grads, optimizer=a.optimizer, lr=a.lr, eps=a.eps, col_blocks=cb)
        summary["reference_mismatches"] = compare(res, ref, a.rtol, a.atol)
    print(json.dumps(summary, indent=1))
    if a.json:
        atomic.write_json(a.json, summary, indent=1)
    return 1 if a.check and summary["reference_mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
