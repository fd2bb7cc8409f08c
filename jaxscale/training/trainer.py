"""The trainer: a pure, donated `train_step`, evaluation, metrics, and checkpoints that reshard.

State is one pytree: {'step', 'dense' (nnx params), 'rest' (other nnx state), 'opt' (optax state),
'emb' (EmbeddingCollection state), 'skipped'}. Dense parameters are replicated (data parallel over both
mesh axes; XLA inserts the gradient all-reduce); the tables go through `EmbeddingCollection`.

What the model is comes from the registry (`jaxscale.training.registry.get(cfg.model.kind)`); where the batches come
from is the `data` argument (default: the config's source). Before a batch is dispatched, its engine ids
are computed and checked on the host (`data.invalid_ids`) and its exchanges are sized for it
(`EmbeddingCollection.shard_batch`); `jit` runs the step compiled for those sizes.

With `train.eval_metric` set, every evaluation updates the best value of that metric; the state of the best
evaluation is saved to <workdir>/best/checkpoints (`train.keep_best`; orbax writes a checkpoint under a
temporary name and renames it when complete, so a killed save never looks like a best checkpoint, and the
previous best is deleted only after that) and restored by `Trainer.restore_best()`. With
`train.early_stopping_patience` = P > 0, training stops after P evaluations in a row without improvement.

When `run()` returns, <workdir>/run.json says how it ended (`final_step`, `steps`, `stop_reason`, `best`),
written atomically; a new `run()` removes it first, so a folder whose run was killed has none and a script
can tell a finished run (stop_reason 'steps' or 'early_stopping') from an interrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.engine import comm_inspect
from jaxscale.engine.embedding.collection import EmbeddingCollection
from jaxscale.engine.embedding.ids import ShardedIds, check_ids, pad_invalid
from jaxscale.engine.embedding.settings import AUTO_TOPOLOGY, EmbeddingSettings
from jaxscale.engine.mesh import BATCH_AXES, make_mesh
from jaxscale.engine.plan import ShardingPlan
from jaxscale.infra import atomic
from jaxscale.training import registry
from jaxscale.training.checkpoint import Checkpointer, CheckpointError, shapes
from jaxscale.training.checkpoint import host as _host
from jaxscale.training.config import Config, config_to_dict
from jaxscale.training.data import make_data, to_global

__all__ = [
    "CapacityOverflowError",
    "CheckpointError",
    "Trainer",
    "finished_run",
    "make_eval_step",
    "make_train_step",
]

RUN_RECORD = "run.json"  # <workdir>/run.json: how the last run() ended (absent while one is under way)
FINISHED = ("steps", "early_stopping")  # the stop reasons of a run that is complete (not 'requested')


def finished_run(workdir: str | Path) -> dict | None:
    """The run.json of a run in `workdir` that ended by its steps or by early stopping; None when there is
    none, or when the last run() was stopped on request or killed (its checkpoints resume it)."""
    try:
        record = json.loads((Path(workdir) / RUN_RECORD).read_text())
    except FileNotFoundError:
        return None
    return record if record.get("stop_reason") in FINISHED else None


class CapacityOverflowError(RuntimeError):
    """An all-to-all ran out of capacity under overflow_policy='error'."""


class Batch(NamedTuple):
    """One step's input, ready to dispatch: the model's batch and the engine ids, both global arrays."""

    data: dict  # {key: global jax.Array}
    ids: ShardedIds  # engine ids with their exchange capacities
    invalid_ids: int  # out-of-range ids found on the host (counted and padded under data.invalid_ids=count)
    info: dict  # host-side facts about the batch (e.g. truncated sequences of a Parquet source)


def make_collection(
    cfg: Config, mesh, tables, settings: EmbeddingSettings | None = None, plan: ShardingPlan | None = None
) -> EmbeddingCollection:
    """The collection of the config's `embedding` settings (or `settings`) running `plan` (the planner's,
    `jaxscale.engine.planner.resolve`); without one, the collection runs `plan_file` or `sharding`."""
    settings = cfg.embedding if settings is None else settings
    if settings.topology == AUTO_TOPOLOGY:
        raise ValueError("embedding.topology=auto is resolved by the planner (jaxscale.training.run.plan_run) first")
    return EmbeddingCollection(tables, mesh, settings, plan)


def dense_param_count(cfg: Config) -> int:
    """Dense parameters of the config's model (what its gradient all-reduce carries), from abstract shapes."""
    spec = registry.get(cfg.model.kind)
    model = nnx.eval_shape(lambda: spec.build(cfg.model.params, nnx.Rngs(cfg.train.seed)))
    _, dense, _ = nnx.split(model, nnx.Param, ...)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(dense))


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    t = cfg.train
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, t.learning_rate, max(t.warmup_steps, 1), max(t.steps, t.warmup_steps + 1), t.learning_rate * 0.1
    )
    parts = [optax.clip_by_global_norm(t.grad_clip_norm)] if t.grad_clip_norm else []
    return optax.chain(*parts, optax.adamw(schedule, weight_decay=t.weight_decay))


def _scalars(metrics) -> dict:
    return {k: v for k, v in metrics.items() if jnp.ndim(v) == 0}


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _replicated_params(axes, wire_dtype, params):
    """Identity on replicated params inside a data-parallel `shard_map` whose backward all-reduces the
    per-device gradients itself, in `wire_dtype` on the wire (the dense gradient all-reduce)."""
    return jax.tree.map(lambda p: jax.lax.pcast(p, axes, to="varying"), params)


def _replicated_params_fwd(axes, wire_dtype, params):
    return _replicated_params(axes, wire_dtype, params), None


def _replicated_params_bwd(axes, wire_dtype, _, grads):
    return (jax.tree.map(lambda g: jax.lax.psum(g.astype(wire_dtype), axes).astype(g.dtype), grads),)


_replicated_params.defvjp(_replicated_params_fwd, _replicated_params_bwd)


def _data_parallel_forward(spec: registry.ModelSpec, graphdef, mesh, wire_dtype):
    """(dense, rest, embeddings, batch) -> the model's per-example outputs, computed in `shard_map` over the
    batch axes: each device runs the forward on its slice with the replicated params, and the backward
    all-reduces the dense gradients in `wire_dtype` (bf16: half the bytes of XLA's fp32 all-reduce)."""

    def body(dense, rest, emb, batch):
        model = nnx.merge(graphdef, _replicated_params(BATCH_AXES, wire_dtype, dense), rest)
        return spec.forward(model, emb, batch)

    def forward(dense, rest, emb, batch):
        fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(BATCH_AXES), P(BATCH_AXES)), out_specs=P(BATCH_AXES))
        return fn(dense, rest, emb, batch)

    return forward


def make_train_step(
    spec: registry.ModelSpec, ec: EmbeddingCollection, graphdef, tx, *, model_cfg=None, dense_grad_precision="fp32"
):
    """The pure step: (state, batch, ids) -> (state, metrics). Skips the whole update (dense and sparse) when
    the loss or a gradient is non-finite or an all-to-all overflowed, so bad steps never reach the tables.

    `dense_grad_precision`: 'fp32' lets XLA insert the dense gradient all-reduce (GSPMD); 'bf16' runs the
    model's per-example forward data-parallel in `shard_map` and all-reduces the gradients in bf16 (needs
    the model's `forward` / `objective` split)."""
    if dense_grad_precision == "bf16":
        if spec.forward is None or spec.objective is None:
            raise ValueError(
                f"train.dense_grad_precision=bf16 needs model kind {spec.kind!r} to register forward and objective"
            )
        dp_forward = _data_parallel_forward(spec, graphdef, ec.mesh, jnp.bfloat16)

    def train_step(state, batch, ids):
        emb, lstats = ec.lookup(state["emb"], ids, return_stats=True)

        def loss_fn(dense, emb):
            if dense_grad_precision == "bf16":
                out = dp_forward(dense, state["rest"], emb, batch)
                loss, metrics = spec.objective(model_cfg, out, batch)
                return loss, (_scalars(metrics), state["rest"])
            # fresh variables at this trace level (copy=True): nnx refuses in-place updates of variables
            # created outside the gradient trace, and the model's non-parameter state must advance
            model = nnx.merge(graphdef, dense, state["rest"], copy=True)
            loss, metrics = spec.loss(model, emb, batch)
            # the model's non-parameter state after the call (dropout's RNG counters, a retrieval model's
            # logQ estimator, ...): carried to the next step, so no two steps draw the same dropout masks
            _, _, rest = nnx.split(model, nnx.Param, ...)
            return loss, (_scalars(metrics), rest)

        (loss, (metrics, new_rest)), (g_dense, g_emb) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
            state["dense"], emb
        )
        finite = jnp.isfinite(loss) & _all_finite(g_dense) & _all_finite(g_emb)
        ok = finite & (lstats["overflow"] == 0)
        updates, new_opt = tx.update(g_dense, state["opt"], state["dense"])
        new_dense = optax.apply_updates(state["dense"], updates)

        def keep(new, old):
            return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)

        g_emb = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), g_emb)  # no NaN travels even when skipped
        new_emb = ec.update(state["emb"], ids, g_emb, apply=ok)
        new_state = dict(
            state,
            step=state["step"] + 1,
            dense=keep(new_dense, state["dense"]),
            rest=new_rest,
            opt=keep(new_opt, state["opt"]),
            emb=new_emb,
            skipped=state["skipped"] + (~finite).astype(jnp.int32),
        )
        metrics = dict(
            metrics,
            loss=loss,
            nonfinite=(~finite).astype(jnp.int32),
            overflow=lstats["overflow"],
            invalid_ids=lstats["invalid_ids"],
            grad_norm=optax.tree.norm(g_dense),
        )
        return new_state, metrics

    return train_step


def make_eval_step(spec: registry.ModelSpec, ec: EmbeddingCollection, graphdef):
    def eval_step(state, batch, ids):
        emb = ec.lookup(state["emb"], ids)
        model = nnx.merge(graphdef, state["dense"], state["rest"])
        model.eval()
        _, metrics = spec.loss(model, emb, batch)
        return metrics

    return eval_step


# ------------------------------------------------------------------------------------------------ trainer


class Trainer:
    """Builds everything a config describes on a mesh; `run()` trains with logging and checkpoints.

    `data` / `eval_data`: sources whose `batch(step)` returns this process's rows of a step as NumPy
    arrays (default: the config's `data` section, via `jaxscale.training.data.make_data`). A source with
    `get_state()` / `set_state(state)` has its position saved in checkpoints and restored on resume; one
    with `provenance(step)` gets named in invalid-id errors and has its truncated sequences counted.
    """

    def __init__(
        self,
        cfg: Config,
        mesh=None,
        *,
        plan: ShardingPlan | None = None,
        data=None,
        eval_data=None,
        workdir: str | None = None,
        log: bool | None = None,
        progress: bool = True,
    ):
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else make_mesh(cfg.mesh.nodes, cfg.mesh.local)
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        if self.process_count > 1 and self.process_count != cfg.mesh.nodes:
            raise ValueError(
                f"mesh.nodes={cfg.mesh.nodes} but {self.process_count} processes are running; "
                f"in a multi-process run each process is one node"
            )
        self.workdir = Path(workdir or cfg.train.workdir).absolute()
        self.is_writer = self.process_index == 0 if log is None else log
        self.progress = progress and self.is_writer
        self.spec = registry.get(cfg.model.kind)
        self.model_cfg = cfg.model.params
        self.tables = tuple(self.spec.tables(self.model_cfg))
        where = dict(process_index=self.process_index, process_count=self.process_count)
        self.data = data if data is not None else make_data(cfg, split="train", **where)
        self.eval_data = eval_data if eval_data is not None else make_data(cfg, split="eval", **where)
        model = self.spec.build(self.model_cfg, nnx.Rngs(cfg.train.seed))
        self.graphdef, dense, rest = nnx.split(model, nnx.Param, ...)
        self._dense_host, self._rest_host = _host_tree(dense), _host_tree(rest)  # numpy: see init_state
        if cfg.embedding.topology == AUTO_TOPOLOGY and plan is None:
            raise ValueError(
                "embedding.topology=auto is chosen by the planner before the trainer is built: "
                "cfg, plan = jaxscale.training.run.plan_run(cfg); Trainer(cfg, plan=plan)"
            )
        self.ec = make_collection(cfg, self.mesh, self.tables, plan=plan)
        self.tx = make_optimizer(cfg)
        self.replicated = NamedSharding(self.mesh, P())
        self.checkpointer = Checkpointer(
            self.workdir, cfg.train.keep_checkpoints, self.process_index, self.process_count, self.is_writer
        )
        self.best_checkpointer = Checkpointer(
            self.workdir / "best", 1, self.process_index, self.process_count, self.is_writer
        )
        """The best evaluation's checkpoint (train.eval_metric): <workdir>/best/checkpoints/<step>."""
        self._executables: dict = {}  # capacities -> (compiled step, its comm bytes)
        self.reruns = 0  # steps re-run counted after reused capacities overflowed (embedding.reuse_capacities)
        self._eval = None
        self._ranker = None
        self.comm = None
        self.collectives = None
        self._stop_requested = False

    # -------------------------------------------------------------- state

    def init_state(self):
        # From host (numpy) copies: a device array would be aliased by device_put and deleted when the step
        # donates the state (a second run() then fails), and a multi-process device_put takes host values only.
        dense = _device_tree(self._dense_host, self.replicated)
        rest = _device_tree(self._rest_host, self.replicated)
        opt = jax.jit(self.tx.init, out_shardings=self.replicated)(dense)
        emb = self.ec.init(jax.random.key(self.cfg.train.seed))
        zero = jax.device_put(np.zeros((), np.int32), self.replicated)
        return {
            "step": zero,
            "dense": dense,
            "rest": rest,
            "opt": opt,
            "emb": emb,
            "skipped": jax.device_put(np.zeros((), np.int32), self.replicated),
        }

    def state_shardings(self, state):
        emb = self.ec.state_shardings()
        return {k: (emb if k == "emb" else jax.tree.map(lambda _: self.replicated, v)) for k, v in state.items()}

    # -------------------------------------------------------------- batches

    def batch(self, step: int, split: str = "train", *, recount: bool = False) -> Batch:
        """This process's rows of step `step`, checked and sized on the host, as global arrays."""
        source = self.data if split == "train" else self.eval_data
        return self.prepare(source.batch(step), source=source, step=step, recount=recount)

    def prepare(self, host_batch, *, source=None, step: int | None = None, recount: bool = False) -> Batch:
        """Host batch -> `Batch`: engine ids computed (`ModelSpec.ids`), checked against the tables
        (`data.invalid_ids`: raise naming the feature, table, id and where it came from, or count and pad),
        and sized for the exchanges (`EmbeddingCollection.shard_batch`; `recount`: counted even under
        `embedding.reuse_capacities`)."""
        host_batch = {k: np.asarray(v) for k, v in host_batch.items()}
        raw = self.spec.ids(self.model_cfg, host_batch)
        ids, invalid = check_ids(raw, self.ec.tables, self.ec.feature_table)
        info = dict(source.provenance(step)) if source is not None and hasattr(source, "provenance") else {}
        count = sum(v.count for v in invalid)
        if invalid:
            if self.cfg.data.invalid_ids == "error":
                where = info.get("where") or (f"the batch of step {step}" if step is not None else "")
                raise ValueError(
                    invalid[0].message(where) + ". Fix the data, or set data.invalid_ids=count to count such ids "
                    "and treat them as padding"
                )
            ids = pad_invalid(ids, self.ec.tables, self.ec.feature_table)
        return Batch(to_global(host_batch, self.mesh), self.ec.shard_batch(ids, recount=recount), count, info)

    def _as_batch(self, batch) -> Batch:
        """A `Batch`, or a dict of global arrays (read back to the host and prepared)."""
        if isinstance(batch, Batch):
            return batch
        return self.prepare({k: _host(v) for k, v in batch.items()})

    # -------------------------------------------------------------- steps

    def compile(self, state, batch) -> Any:
        """AOT-compiles the donated train step for this batch's capacities (once per distinct set) and reads
        its collectives from the compiled HLO."""
        batch = self._as_batch(batch)
        key = batch.ids.capacities
        if key not in self._executables:
            step = make_train_step(
                self.spec,
                self.ec,
                self.graphdef,
                self.tx,
                model_cfg=self.model_cfg,
                dense_grad_precision=self.cfg.train.dense_grad_precision,
            )
            shardings = self.state_shardings(state)
            data_sh = jax.tree.map(lambda x: x.sharding, batch.data)
            ids_sh = jax.tree.map(lambda x: x.sharding, batch.ids)
            jitted = jax.jit(
                step,
                in_shardings=(shardings, data_sh, ids_sh),
                out_shardings=(shardings, self.replicated),
                donate_argnums=0,
            )
            with jax.set_mesh(self.mesh):  # models may split per-example work over it (`mesh.batch_mesh`)
                compiled = jitted.lower(state, batch.data, batch.ids).compile()
            cs = comm_inspect.list_collectives(compiled, mesh=self.mesh)
            self._executables[key] = (compiled, comm_inspect.summarize(cs), cs)
        compiled, self.comm, self.collectives = self._executables[key]
        if self._eval is None:
            self._eval = jax.jit(make_eval_step(self.spec, self.ec, self.graphdef))
        return compiled

    def train_step(self, state, batch):
        batch = self._as_batch(batch)
        compiled = self.compile(state, batch)
        return compiled(state, batch.data, batch.ids)

    def evaluate(self, state) -> dict:
        """Held-out metrics: the 0-d metrics averaged over `data.eval_batches` batches, plus whatever the
        model computes over the whole eval set (`ModelSpec.summarize`: AUC, ...)."""
        if self.eval_data is None or self.cfg.data.eval_batches == 0:
            return {}
        if self._eval is None:
            self._eval = jax.jit(make_eval_step(self.spec, self.ec, self.graphdef))
        sums, kept = {}, []
        n = self.cfg.data.eval_batches
        for i in range(n):
            b = self.batch(i, "eval")
            m = self._eval(state, b.data, b.ids)
            for k, v in m.items():
                if jnp.ndim(v) == 0:
                    sums[k] = sums.get(k, 0.0) + float(v)
            kept.append({k: _host(v) for k, v in m.items() if jnp.ndim(v) > 0})
        out = {f"eval_{k}": v / n for k, v in sums.items()}
        out.update({f"eval_{k}": float(v) for k, v in self.spec.summarize(self.model_cfg, kept).items()})
        if self.cfg.train.eval_ranking_ks:
            out.update({f"eval_{k}": v for k, v in self._ranking().evaluate(state, self.eval_data).metrics.items()})
        return out

    def _ranking(self):
        """The full-corpus evaluator of `train.eval_ranking_ks` (built once: it holds the jitted scorer)."""
        if self._ranker is None:
            from jaxscale.training.ranking_eval import RankingEvaluator

            self._ranker = RankingEvaluator(self, self.cfg.train.eval_ranking_ks)
        return self._ranker

    # -------------------------------------------------------------- checkpoints

    def _manager(self, create=True):
        return self.checkpointer.manager(create)

    def _meta(self, state) -> dict:
        return {
            "step": int(_host(state["step"])),
            "model_kind": self.spec.kind,
            "tables": [dataclasses.asdict(t) for t in self.tables],
            "dense_shapes": shapes({"dense": state["dense"], "opt": state["opt"], "rest": state["rest"]}),
            "layout": self.ec.layout_signature(),
            "mesh": [self.cfg.mesh.nodes, self.cfg.mesh.local],
            "optimizer_slots": list(self.ec.settings.optimizer.slots),
            "config": config_to_dict(self.cfg),
        }

    def save(self, mgr, state) -> int:
        """Saves `state` (and the data source's position, when it has one) at its step."""
        position = self.data.get_state() if hasattr(self.data, "get_state") else None
        self.checkpointer.verbose = self.is_writer
        return self.checkpointer.save(mgr, state, self._meta(state), position)

    def restore(self, template_state, step: int | None = None):
        """The saved state at `step` (default: latest complete), resharded onto this mesh and layout."""
        state, meta, position = self.checkpointer.restore(template_state, self._meta(template_state), self.ec, step)
        if position is not None and hasattr(self.data, "set_state"):
            self.data.set_state(position)
        return state, meta["step"]

    def restore_best(self, template_state=None):
        """(state, step) of the best checkpoint (`train.eval_metric`'s best evaluation, <workdir>/best),
        resharded onto this mesh and layout like `restore` (the data source's position is left alone)."""
        template = self.init_state() if template_state is None else template_state
        state, meta, _ = self.best_checkpointer.restore(template, self._meta(template), self.ec)
        return state, meta["step"]

    def best_record(self) -> dict | None:
        """{'step', 'metric', 'value', 'mode'} of the saved best checkpoint, None when there is none."""
        import orbax.checkpoint as ocp

        steps = self.best_checkpointer.steps()
        if not steps:
            return None
        with self.best_checkpointer.reading() as mgr:
            meta = mgr.restore(steps[-1], args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        return meta.get("best") if isinstance(meta, dict) else None

    def _start_best(self, start: int) -> _Best | None:
        """The monitor of train.eval_metric; resumed (start > 0) from the saved best when it is this metric's
        and not from an abandoned later part of the run (evaluations since it count against the patience)."""
        t = self.cfg.train
        if t.eval_metric is None:
            return None
        if self.eval_data is None or self.cfg.data.eval_batches == 0:
            raise ValueError(
                f"train.eval_metric={t.eval_metric!r} is monitored, but there is no evaluation "
                f"(data.eval_batches={self.cfg.data.eval_batches}, eval data: {self.eval_data is not None})"
            )
        best = _Best(t.eval_metric, t.eval_mode, t.early_stopping_patience)
        rec = self.best_record() if start > 0 and t.keep_best else None
        if rec and rec.get("metric") == best.metric and rec.get("mode") == best.mode and rec["step"] <= start:
            best.step, best.value = int(rec["step"]), float(rec["value"])
            best.bad = start // t.eval_every - best.step // t.eval_every
        return best

    def _track_best(self, best: _Best, ev: dict, state, mgr) -> bool:
        """Updates `best` with evaluation `ev` (saving the state when it improved); True when the patience ran
        out. Every process takes the same decisions: the metric is computed identically on every process
        (the eval step's replicated output), and the improvement flag is process 0's, broadcast."""
        if best.metric not in ev:
            raise ValueError(
                f"train.eval_metric={best.metric!r} is not in the evaluation's output; it has "
                f"{sorted(k for k in ev if k != 'step')}"
            )
        value = float(ev[best.metric])
        improved = best.improves(value)
        if self.process_count > 1:
            from jax.experimental import multihost_utils

            improved = bool(multihost_utils.broadcast_one_to_all(np.asarray(improved, np.int32)))
        if improved:
            best.step, best.value, best.bad = int(ev["step"]), value, 0
            if mgr is not None:
                self.best_checkpointer.verbose = self.is_writer
                self.best_checkpointer.save(mgr, state, dict(self._meta(state), best=best.record()))
        else:
            best.bad += 1
        ev["best_step"], ev[f"best_{best.metric}"] = best.step, best.value
        return best.exhausted()

    def request_stop(self, *_):
        self._stop_requested = True

    def _should_stop(self, step: int, stop_at: int | None) -> bool:
        """Stop after this step? In a multi-process run every process must stop at the same step (the save
        is collective), but SIGTERM reaches them at different steps: the flag is OR-ed across processes."""
        stop = self._stop_requested
        if self.process_count > 1:
            from jax.experimental import multihost_utils

            stop = bool(np.max(multihost_utils.process_allgather(np.asarray(stop, np.int32))))
        return stop or (stop_at is not None and step >= stop_at)

    def run(
        self,
        *,
        steps: int | None = None,
        resume: bool = False,
        resume_step: int | None = None,
        stop_at: int | None = None,
    ) -> dict:
        """Trains to `steps` (default config.train.steps); returns the history: 'losses', 'steps', 'eval' (one
        dict per evaluation), 'final_state', 'final_step', 'stopped_early' (before `steps`, for any reason),
        'stop_reason' ('steps', 'early_stopping' or 'requested': SIGTERM or `stop_at`), 'best' ({'step',
        <train.eval_metric>: value} of the best evaluation, None without eval_metric) and 'reruns'.

        `stop_at` ends the run early at that step (saving a checkpoint), as SIGTERM does.
        """
        cfg = self.cfg.train
        total = steps if steps is not None else cfg.steps
        self._stop_requested = False
        state = self.init_state()
        if resume or resume_step is not None:
            if self.checkpointer.steps() or resume_step is not None:
                state, _ = self.restore(state, resume_step)
            elif self.is_writer:
                print(f"--resume: no checkpoint in {self.workdir / 'checkpoints'}; starting from scratch")
        start = int(_host(state["step"]))
        if self.is_writer:  # from here until this run() returns, the folder holds no record of a finished run
            (self.workdir / RUN_RECORD).unlink(missing_ok=True)
        mgr = self._manager()
        writer = _MetricsWriter(self.workdir, enabled=self.is_writer)
        old_handler = signal.signal(signal.SIGTERM, self.request_stop) if _main_thread() else None
        history: dict[str, Any] = {"losses": [], "steps": [], "eval": []}
        bar = _progress(total, start, enabled=self.progress)
        step = start
        last_saved = None
        recount = False
        best = self._start_best(start)
        best_mgr = self.best_checkpointer.manager() if best is not None and cfg.keep_best else None
        early = best is not None and best.exhausted()  # a resumed run whose patience had already run out
        if early and self.is_writer:
            print(f"early stopping: no improvement of {best.metric} since step {best.step}; not training")
        started = time.perf_counter()
        try:
            while step < total and not early:
                batch = self.batch(step, recount=recount)
                self.compile(state, batch)  # outside the timed region: step_time_s is the step alone
                t0 = time.perf_counter()
                new_state, metrics = self.train_step(state, batch)
                metrics = _host_scalars(metrics)
                dt = time.perf_counter() - t0
                recount = False
                if metrics["overflow"] > 0:
                    state = new_state  # the update was skipped: same tables, step counter advanced
                    if self.ec.settings.reuse_capacities and self.ec.settings.capacity_factor is None:
                        state, recount = self._rewind(state), True  # re-run the batch, counted
                        self.reruns += 1
                        continue
                    state = self._handle_overflow(state, metrics, step)
                    continue
                state = new_state
                if metrics["nonfinite"] and self.cfg.train.nonfinite_policy == "raise":
                    raise FloatingPointError(
                        f"non-finite loss or gradient at step {step} (loss={metrics['loss']}); the update was not "
                        f"applied. Set train.nonfinite_policy=skip to skip such steps"
                    )
                step += 1
                metrics.update(
                    step=step,
                    step_time_s=dt,
                    examples_per_s=self.cfg.train.batch_size / dt,
                    comm_bytes_intra_node=self.comm["intra_node"],
                    comm_bytes_cross_node=self.comm["cross_node"],
                    skipped_total=float(_host(state["skipped"])),
                    invalid_ids=metrics["invalid_ids"] + batch.invalid_ids,  # padded on the host + seen on device
                    **{k: float(v) for k, v in batch.info.items() if isinstance(v, (int, float))},
                )
                history["losses"].append(metrics["loss"])
                history["steps"].append(step)
                if step % cfg.log_every == 0 or step == total or step == start + 1:
                    writer.write(metrics)
                bar.update(metrics)
                if cfg.eval_every and step % cfg.eval_every == 0:
                    ev = self.evaluate(state)
                    ev["step"] = step
                    ev["wall_s"] = time.perf_counter() - started  # training + evaluations so far: the curve's clock
                    if best is not None:
                        early = self._track_best(best, ev, state, best_mgr)
                    history["eval"].append(ev)
                    writer.write(ev)
                    bar.note(ev, best.metric if best is not None else None)
                    if early and self.is_writer:
                        print(
                            f"early stopping at step {step}: {best.metric} has not improved in "
                            f"{best.bad} evaluations (best {best.value:.6g} at step {best.step})"
                        )
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < total and not early:
                    last_saved = self.save(mgr, state)
                if self._should_stop(step, stop_at) or early:
                    break
            if (step > start or not mgr.all_steps()) and last_saved != step:
                self.save(mgr, state)
        finally:
            try:
                mgr.wait_until_finished()  # an async save in flight completes before we return (or raise)
            finally:
                mgr.close()
                if best_mgr is not None:
                    try:
                        best_mgr.wait_until_finished()
                    finally:
                        best_mgr.close()
            bar.close()
            writer.close()
            if old_handler is not None:
                signal.signal(signal.SIGTERM, old_handler)
        history["final_state"] = state
        history["stopped_early"] = step < total
        history["stop_reason"] = "early_stopping" if early else ("requested" if step < total else "steps")
        history["best"] = None if best is None or best.step is None else {"step": best.step, best.metric: best.value}
        history["final_step"] = step
        history["reruns"] = self.reruns
        if self.is_writer:
            record = {k: history[k] for k in ("final_step", "stop_reason", "stopped_early", "best")}
            atomic.write_json(self.workdir / RUN_RECORD, record | {"steps": total})
        return history

    def _handle_overflow(self, state, metrics, step):
        policy = self.cfg.train.overflow_policy
        cf = self.ec.settings.capacity_factor
        if policy == "error":
            raise CapacityOverflowError(
                f"step {step}: {int(metrics['overflow'])} looked-up rows did not fit the all-to-all capacity "
                f"(embedding.capacity_factor={cf}); the step was not applied. Raise capacity_factor, set it to "
                f"null (exact, never overflows) or use train.overflow_policy=grow"
            )
        new_cf = None if cf is None or cf * 2 >= self.ec.num_shards else cf * 2
        if self.is_writer:
            print(
                f"step {step}: all-to-all overflow ({int(metrics['overflow'])} rows); growing capacity_factor "
                f"{cf} -> {new_cf} and recompiling; the step is re-run"
            )
        grown = self.ec.settings.replace(capacity_factor=new_cf)
        self.ec = make_collection(self.cfg, self.mesh, self.tables, grown, plan=self.ec.plan)
        self._executables.clear()
        self._eval = None
        return self._rewind(state)

    @staticmethod
    def _rewind(state):
        """The state before a skipped attempt: that attempt advanced both step counters (the engine's
        drives periodic replica sync), so the re-run step is exactly the step an exact-capacity run takes."""
        return dict(state, step=state["step"] - 1, emb=dict(state["emb"], step=state["emb"]["step"] - 1))


# ------------------------------------------------------------------------------------------------ helpers


@dataclasses.dataclass
class _Best:
    """The monitored metric's best evaluation so far and the evaluations since it (train.eval_metric)."""

    metric: str
    mode: str
    patience: int
    step: int | None = None
    value: float | None = None
    bad: int = 0

    def improves(self, value: float) -> bool:
        """A non-finite value never improves; the first finite one always does."""
        if not math.isfinite(value):
            return False
        return self.value is None or (value > self.value if self.mode == "max" else value < self.value)

    def exhausted(self) -> bool:
        return self.patience > 0 and self.bad >= self.patience

    def record(self) -> dict:
        return {"step": self.step, "metric": self.metric, "value": self.value, "mode": self.mode}


class _HostKey:
    """A PRNG key array kept on the host as its key data."""

    def __init__(self, x):
        self.data, self.impl = np.asarray(jax.random.key_data(x)), jax.random.key_impl(x)


def _host_scalars(metrics: Mapping) -> dict:
    """The step's 0-d metrics as Python floats: one read-back of them all (a transfer per metric costs ~0.1 ms
    each) where every array is addressable here, else one per metric (`checkpoint.host`)."""
    if all(isinstance(v, jax.Array) and v.is_fully_addressable for v in metrics.values()):
        return {k: float(v) for k, v in jax.device_get(dict(metrics)).items()}
    return {k: float(_host(v)) for k, v in metrics.items()}


def _host_tree(tree):
    return jax.tree.map(lambda x: _HostKey(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else np.array(x), tree)


def _device_tree(tree, sharding):
    def put(x):
        if isinstance(x, _HostKey):
            return jax.random.wrap_key_data(jax.device_put(x.data, sharding), impl=x.impl)
        return jax.device_put(x, sharding)

    return jax.tree.map(put, tree)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class _MetricsWriter:
    """metrics.jsonl + TensorBoard event files, written by one process only."""

    def __init__(self, workdir: Path, enabled: bool):
        self.enabled = enabled
        self.f = self.tb = None
        if enabled:
            workdir.mkdir(parents=True, exist_ok=True)
            self.f = open(workdir / "metrics.jsonl", "a")
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(workdir / "tensorboard"))
            except ImportError:
                self.tb = None

    def write(self, metrics: Mapping):
        if not self.enabled:
            return
        self.f.write(
            json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()})
            + "\n"
        )
        self.f.flush()
        if self.tb is not None:
            step = int(metrics.get("step", 0))
            for k, v in metrics.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self):
        if self.f:
            self.f.close()
        if self.tb is not None:
            self.tb.close()


class _progress:
    def __init__(self, total, start, enabled):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, m):
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{m['loss']:.4f}", ex_s=f"{m['examples_per_s']:.0f}", refresh=False)
            self.bar.update(1)

    def note(self, ev, metric: str | None = None):
        """Prints an evaluation; with a monitored `metric`, also its best value so far and that step."""
        if self.bar is not None:
            best = {"step", "best_step", f"best_{metric}"}
            text = "eval @ step {step}: ".format(step=ev.get("step")) + ", ".join(
                f"{k}={v:.4f}" for k, v in ev.items() if k not in best
            )
            if metric is not None and ev.get("best_step") is not None:
                text += f" (best {metric}={ev[f'best_{metric}']:.4f} @ step {ev['best_step']})"
            self.bar.write(text)

    def close(self):
        if self.bar is not None:
            self.bar.close()
