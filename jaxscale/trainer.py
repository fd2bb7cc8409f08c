"""The trainer: a pure, donated `train_step`, evaluation, metrics, and checkpoints that reshard.

State is one pytree: {'step', 'dense' (nnx params), 'rest' (other nnx state), 'opt' (optax state),
'emb' (EmbeddingCollection state), 'skipped'}. Dense parameters are replicated (data parallel over both
mesh axes; XLA inserts the gradient all-reduce); the tables go through `EmbeddingCollection`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale import comm_inspect
from jaxscale.config import Config, config_to_dict
from jaxscale.data import make_data, to_global
from jaxscale.embedding import EmbeddingCollection
from jaxscale.embedding.layout import build_layout, slots_to_dense, stacks_to_dense
from jaxscale.mesh import make_mesh
from jaxscale.optimizers import SGD, RowWiseAdagrad
from jaxscale.plan import ShardingPlan
from jaxscale.quantization import CommConfig
from jaxscale.tables import TableConfig


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, corrupt, incomplete, or from another model."""


class CapacityOverflowError(RuntimeError):
    """An all-to-all ran out of capacity under overflow_policy='error'."""


# ------------------------------------------------------------------------------------------------ task


@dataclasses.dataclass(frozen=True)
class Task:
    """What differs between models: tables, how a batch becomes ids, the model and its loss."""

    kind: str
    tables: tuple[TableConfig, ...]
    ids: Callable[[Mapping], dict]
    make_model: Callable[[nnx.Rngs], nnx.Module]
    loss: Callable  # (model, embeddings, batch) -> (loss, metrics)


def make_task(cfg: Config) -> Task:
    if cfg.model.kind == "foundation":
        from models.foundation import FoundationModel, foundation_ids, foundation_loss, foundation_tables

        m = cfg.model.foundation
        return Task(
            "foundation",
            tuple(foundation_tables(m)),
            lambda b: foundation_ids(m, b),
            lambda rngs: FoundationModel(m, rngs=rngs),
            foundation_loss,
        )
    from models.dlrm import DLRM, dlrm_ids, dlrm_loss, dlrm_tables

    m = cfg.model.dlrm
    return Task("dlrm", tuple(dlrm_tables(m)), lambda b: dlrm_ids(m, b), lambda rngs: DLRM(m, rngs=rngs), dlrm_loss)


def make_collection(cfg: Config, mesh, tables, capacity_factor="config") -> EmbeddingCollection:
    e = cfg.embedding
    optimizer = RowWiseAdagrad(e.learning_rate, eps=e.eps) if e.optimizer == "rowwise_adagrad" else SGD(e.learning_rate)
    sharding: Any = e.sharding
    if e.plan_file:
        try:
            sharding = ShardingPlan.from_json(Path(e.plan_file).read_text())
        except OSError as err:
            raise ValueError(f"embedding.plan_file: cannot read {e.plan_file!r}: {err}") from err
    return EmbeddingCollection(
        tables,
        mesh,
        topology=e.topology,
        sharding=sharding,
        optimizer=optimizer,
        comm=CommConfig(forward=e.comm_forward, backward=e.comm_backward),
        capacity_factor=e.capacity_factor if capacity_factor == "config" else capacity_factor,
        replica_sync=e.replica_sync,
        sync_every=e.sync_every,
    )


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    t = cfg.train
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, t.learning_rate, max(t.warmup_steps, 1), max(t.steps, t.warmup_steps + 1), t.learning_rate * 0.1
    )
    parts = [optax.clip_by_global_norm(t.grad_clip_norm)] if t.grad_clip_norm else []
    return optax.chain(*parts, optax.adamw(schedule, weight_decay=t.weight_decay))


def _scalars(metrics: Mapping) -> dict:
    return {k: v for k, v in metrics.items() if jnp.ndim(v) == 0}


def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def make_train_step(task: Task, ec: EmbeddingCollection, graphdef, tx):
    """The pure step: (state, batch) -> (state, metrics). Skips the whole update (dense and sparse) when
    the loss or a gradient is non-finite or an all-to-all overflowed, so bad steps never reach the tables."""

    def train_step(state, batch):
        ids = task.ids(batch)
        emb, lstats = ec.lookup(state["emb"], ids, return_stats=True)

        def loss_fn(dense, emb):
            model = nnx.merge(graphdef, dense, state["rest"])
            loss, metrics = task.loss(model, emb, batch)
            return loss, _scalars(metrics)

        (loss, metrics), (g_dense, g_emb) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
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


def make_eval_step(task: Task, ec: EmbeddingCollection, graphdef):
    def eval_step(state, batch):
        emb = ec.lookup(state["emb"], task.ids(batch))
        model = nnx.merge(graphdef, state["dense"], state["rest"])
        model.eval()
        _, metrics = task.loss(model, emb, batch)
        return metrics

    return eval_step


# ------------------------------------------------------------------------------------------------ trainer


class Trainer:
    """Builds everything a config describes on a mesh; `run()` trains with logging and checkpoints."""

    def __init__(
        self, cfg: Config, mesh=None, *, workdir: str | None = None, log: bool | None = None, progress: bool = True
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
        self.task = make_task(cfg)
        self.ec = make_collection(cfg, self.mesh, self.task.tables)
        self.tx = make_optimizer(cfg)
        model = self.task.make_model(nnx.Rngs(cfg.train.seed))
        self.graphdef, dense, rest = nnx.split(model, nnx.Param, ...)
        self._dense_host, self._rest_host = _host_tree(dense), _host_tree(rest)  # numpy: see init_state
        self.replicated = NamedSharding(self.mesh, P())
        self.data = make_data(cfg, split="train", process_index=self.process_index, process_count=self.process_count)
        self.eval_data = make_data(
            cfg, split="eval", process_index=self.process_index, process_count=self.process_count
        )
        self._compiled = None
        self._eval = None
        self.comm = None
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

    # -------------------------------------------------------------- steps

    def batch(self, step: int, split: str = "train"):
        source = self.data if split == "train" else self.eval_data
        return to_global(source.batch(step), self.mesh)

    def compile(self, state, batch):
        """AOT-compiles the donated train step once and reads its collectives from the compiled HLO."""
        step = make_train_step(self.task, self.ec, self.graphdef, self.tx)
        shardings = self.state_shardings(state)
        batch_sh = jax.tree.map(lambda x: x.sharding, batch)
        jitted = jax.jit(
            step, in_shardings=(shardings, batch_sh), out_shardings=(shardings, self.replicated), donate_argnums=0
        )
        self._compiled = jitted.lower(state, batch).compile()
        cs = comm_inspect.list_collectives(self._compiled, mesh=self.mesh)
        self.comm = comm_inspect.summarize(cs)
        self.collectives = cs
        eval_step = make_eval_step(self.task, self.ec, self.graphdef)
        self._eval = jax.jit(eval_step)
        return self._compiled

    def train_step(self, state, batch):
        if self._compiled is None:
            self.compile(state, batch)
        return self._compiled(state, batch)

    def evaluate(self, state) -> dict:
        """Held-out metrics: loss (+ recall@K for next-item), AUC for ranking/engagement."""
        if self.eval_data is None or self.cfg.data.eval_batches == 0:
            return {}
        from models.dlrm import auc

        sums, n, labels, scores, weights = {}, 0, [], [], []
        for i in range(self.cfg.data.eval_batches):
            m = self._eval(state, self.batch(i, "eval"))
            for k, v in m.items():
                if jnp.ndim(v) == 0:
                    sums[k] = sums.get(k, 0.0) + float(v)
            if self.task.kind == "dlrm":
                labels.append(_host(m["labels"])), scores.append(_host(m["probs"]))
            else:
                labels.append(_host(m["engage_labels"])), scores.append(_host(m["engage_probs"]))
                weights.append(_host(m["engage_weights"]))
            n += 1
        out = {f"eval_{k}": v / n for k, v in sums.items()}
        y, s = np.concatenate([a.reshape(-1) for a in labels]), np.concatenate([a.reshape(-1) for a in scores])
        if weights:
            w = np.concatenate([a.reshape(-1) for a in weights]) > 0
            y, s = y[w], s[w]
        out["eval_auc"] = float(auc(y, s))
        return out

    # -------------------------------------------------------------- checkpoints

    def _manager(self, create=True):
        import orbax.checkpoint as ocp

        path = self.workdir / "checkpoints"
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=self.cfg.train.keep_checkpoints, create=create, enable_async_checkpointing=True
        )
        return ocp.CheckpointManager(path, options=opts, item_names=("state", "meta"))

    def _meta(self, state) -> dict:
        return {
            "step": int(_host(state["step"])),
            "model_kind": self.task.kind,
            "tables": [dataclasses.asdict(t) for t in self.task.tables],
            "dense_shapes": _shapes({"dense": state["dense"], "opt": state["opt"], "rest": state["rest"]}),
            "layout": self.ec.layout_signature(),
            "mesh": [self.cfg.mesh.nodes, self.cfg.mesh.local],
            "optimizer_slots": list(self.ec.optimizer.slots),
            "config": config_to_dict(self.cfg),
        }

    def save(self, mgr, state, *, force=True) -> int:
        """Saves `state` at its step (asynchronously: `mgr.wait_until_finished()` before reading it).

        The trainer decides when to save, so orbax's own save policy is bypassed (`force`). Checkpoints at
        this step or later are from an abandoned run (this one resumed from an earlier step): they are
        moved to <workdir>/abandoned_checkpoints/ first, never deleted, so `latest` is this run again.
        """
        import orbax.checkpoint as ocp

        step = int(_host(state["step"]))
        stale = sorted(s for s in mgr.all_steps() if s >= step)
        if stale:
            self._set_aside(mgr, stale)
        mgr.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(self._meta(state))),
            force=force,
        )
        return step

    def _set_aside(self, mgr, steps):
        mgr.wait_until_finished()
        dest = self.workdir / "abandoned_checkpoints"
        if self.is_writer or self.process_index == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for s in steps:
                src = Path(mgr.directory) / str(s)
                if src.exists():
                    dest.mkdir(parents=True, exist_ok=True)
                    target = dest / f"{s}-{stamp}"
                    os.replace(src, target)
                    if self.is_writer:
                        print(
                            f"checkpoint step {s} is from an abandoned run (this run resumed from an earlier "
                            f"step): moved to {target}"
                        )
        if self.process_count > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxscale_set_aside_checkpoints")
        mgr.reload()

    def restore(self, template_state, step: int | None = None):
        """The saved state at `step` (default: latest complete), resharded onto this mesh and layout."""
        import orbax.checkpoint as ocp

        path = self.workdir / "checkpoints"
        if not path.exists():
            raise CheckpointError(f"no checkpoint directory at {path}")
        mgr = self._manager(create=False)
        steps = mgr.all_steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {path} (partial ones are ignored)")
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {path}; available: {sorted(steps)}")
        others = sorted(s for s in steps if s != step)
        hint = f"; other checkpoints here: {others} (resume one with --resume-step N)" if others else ""
        try:
            meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            if not isinstance(meta, dict) or "layout" not in meta or "step" not in meta:
                raise ValueError(f"metadata is not a jaxscale checkpoint's: {str(meta)[:200]}")
        except Exception as e:  # orbax raises many types for unreadable files
            raise CheckpointError(
                f"checkpoint step {step} in {path} is unreadable (corrupt or incomplete): {_brief(e)}{hint}"
            ) from e
        self._check_compatible(meta, template_state, step, path, hint)
        same_layout = meta["layout"] == self.ec.layout_signature()
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), template_state)
        if not same_layout:
            abstract["emb"] = _saved_emb_abstract(meta, self.replicated)
        try:
            restored = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as e:
            raise CheckpointError(
                f"checkpoint step {step} in {path} is unreadable (corrupt or incomplete): {_brief(e)}{hint}"
            ) from e
        if not same_layout:
            restored["emb"] = self._convert_emb(meta, restored["emb"])
        if int(_host(restored["step"])) != meta["step"]:
            raise CheckpointError(
                f"checkpoint step {step} in {path} is inconsistent: state step "
                f"{int(_host(restored['step']))} != metadata step {meta['step']}"
            )
        return restored, step

    def _check_compatible(self, meta, template_state, step, path, hint=""):
        problems = []
        if meta.get("model_kind") != self.task.kind:
            problems.append(f"model kind {meta.get('model_kind')!r} != {self.task.kind!r}")
        saved = {t["name"]: t for t in meta.get("tables", [])}
        current = {t.name: dataclasses.asdict(t) for t in self.task.tables}
        for name in sorted(set(saved) | set(current)):
            a, b = saved.get(name), current.get(name)
            if a is None or b is None:
                problems.append(
                    f"table {name!r} is {'missing from the checkpoint' if a is None else 'not in this model'}"
                )
                continue
            for key in ("rows", "dim", "pooling", "reshape"):
                if a.get(key) != b.get(key):
                    problems.append(f"table {name!r}: {key} {a.get(key)!r} in the checkpoint, {b.get(key)!r} now")
        shapes = _shapes(
            {"dense": template_state["dense"], "opt": template_state["opt"], "rest": template_state["rest"]}
        )
        saved_shapes = meta.get("dense_shapes", {})
        diff = [k for k in sorted(set(shapes) | set(saved_shapes)) if shapes.get(k) != saved_shapes.get(k)]
        if diff:
            problems.append(
                f"dense parameters differ at {len(diff)} paths, e.g. {diff[0]}: "
                f"{saved_shapes.get(diff[0])} in the checkpoint, {shapes.get(diff[0])} now"
            )
        if sorted(meta.get("optimizer_slots", [])) != sorted(self.ec.optimizer.slots):
            problems.append(
                f"embedding optimizer slots {meta.get('optimizer_slots')} != {list(self.ec.optimizer.slots)}"
            )
        if problems:
            raise CheckpointError(
                f"checkpoint step {step} in {path} is from another model: "
                + "; ".join(problems)
                + (f" (other checkpoints here: {hint.split(': ', 1)[1]})" if hint else "")
            )

    def _convert_emb(self, meta, saved_emb):
        """Saved stacks (another mesh/topology/plan) -> dense tables -> this collection's layout."""
        plan = ShardingPlan.from_dict(meta["layout"]["plan"])
        tables = self.task.tables
        layout = build_layout(tables, plan)
        weights = stacks_to_dense(layout, {k: _host(v)[0] for k, v in saved_emb["weights"].items()})
        slots = {
            s: slots_to_dense(layout, {k: _host(v)[0] for k, v in saved_emb[s].items()}, per_column_shard=True)
            for s in self.ec.optimizer.slots
            if s in saved_emb
        }
        return self.ec.load_dense(weights, slots, step=int(_host(saved_emb["step"])))

    # -------------------------------------------------------------- loop

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
        """Trains to `steps` (default config.train.steps); returns {'losses': [...], 'final': metrics}.

        `stop_at` ends the run early at that step (saving a checkpoint), as SIGTERM does.
        """
        cfg = self.cfg.train
        total = steps if steps is not None else cfg.steps
        self._stop_requested = False
        state = self.init_state()
        if resume or resume_step is not None:
            has_any = (self.workdir / "checkpoints").exists() and self._manager(create=False).all_steps()
            if has_any or resume_step is not None:
                state, _ = self.restore(state, resume_step)
            elif self.is_writer:
                print(f"--resume: no checkpoint in {self.workdir / 'checkpoints'}; starting from scratch")
        start = int(_host(state["step"]))
        mgr = self._manager()
        writer = _MetricsWriter(self.workdir, enabled=self.is_writer)
        old_handler = signal.signal(signal.SIGTERM, self.request_stop) if _main_thread() else None
        history: dict[str, Any] = {"losses": [], "steps": [], "eval": []}
        bar = _progress(total, start, enabled=self.progress)
        step = start
        last_saved = None
        try:
            while step < total:
                batch = self.batch(step)
                if self._compiled is None:  # compile outside the timed region: step_time_s is the step alone
                    self.compile(state, batch)
                t0 = time.perf_counter()
                new_state, metrics = self.train_step(state, batch)
                metrics = {k: float(_host(v)) for k, v in metrics.items()}
                dt = time.perf_counter() - t0
                if metrics["overflow"] > 0:
                    state = new_state  # the update was skipped: same tables, step counter advanced
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
                )
                history["losses"].append(metrics["loss"])
                history["steps"].append(step)
                if step % cfg.log_every == 0 or step == total or step == start + 1:
                    writer.write(metrics)
                bar.update(metrics)
                if cfg.eval_every and step % cfg.eval_every == 0:
                    ev = self.evaluate(state)
                    ev["step"] = step
                    history["eval"].append(ev)
                    writer.write(ev)
                    bar.note(ev)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < total:
                    last_saved = self.save(mgr, state)
                if self._should_stop(step, stop_at):
                    break
            if (step > start or not mgr.all_steps()) and last_saved != step:
                self.save(mgr, state)
        finally:
            try:
                mgr.wait_until_finished()  # an async save in flight completes before we return (or raise)
            finally:
                mgr.close()
            bar.close()
            writer.close()
            if old_handler is not None:
                signal.signal(signal.SIGTERM, old_handler)
        history["final_state"] = state
        history["stopped_early"] = step < total
        history["final_step"] = step
        return history

    def _handle_overflow(self, state, metrics, step):
        policy = self.cfg.train.overflow_policy
        cf = self.ec.capacity_factor
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
        self.ec = make_collection(self.cfg, self.mesh, self.task.tables, capacity_factor=new_cf)
        self._compiled = None
        # the skipped attempt advanced both step counters (the engine's drives periodic replica sync):
        # rewind both, so the re-run step is exactly the step an exact-capacity run takes
        return dict(state, step=state["step"] - 1, emb=dict(state["emb"], step=state["emb"]["step"] - 1))


# ------------------------------------------------------------------------------------------------ helpers


def _saved_emb_abstract(meta, replicated):
    layout = meta["layout"]
    reps = layout["num_replicas"]
    shards = layout["plan"]["num_shards"]
    out = {
        "weights": {
            k: jax.ShapeDtypeStruct((reps, shards, r, w), jnp.float32, sharding=replicated)
            for k, (r, w) in layout["stacks"].items()
        },
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
    }
    for slot in meta.get("optimizer_slots", []):
        out[slot] = {
            k: jax.ShapeDtypeStruct((reps, shards, r), jnp.float32, sharding=replicated)
            for k, (r, w) in layout["stacks"].items()
        }
    return out


def _brief(e: BaseException, limit: int = 600) -> str:
    """`Type: message` cut to its first line and `limit` characters (tensorstore appends kilobytes of spec)."""
    text = str(e).split(" [tensorstore_spec", 1)[0].strip().splitlines()
    text = text[0] if text else ""
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _shapes(tree) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): list(np.shape(v)) for p, v in flat}


def _host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding.is_fully_replicated:  # every process holds it all: no collective needed
            return np.asarray(x.addressable_shards[0].data)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


class _HostKey:
    """A PRNG key array kept on the host as its key data."""

    def __init__(self, x):
        self.data, self.impl = np.asarray(jax.random.key_data(x)), jax.random.key_impl(x)


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

    def note(self, ev):
        if self.bar is not None:
            self.bar.write(
                "eval @ step {step}: ".format(step=ev.get("step"))
                + ", ".join(f"{k}={v:.4f}" for k, v in ev.items() if k != "step")
            )

    def close(self):
        if self.bar is not None:
            self.bar.close()
