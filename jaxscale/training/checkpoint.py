"""Checkpoints of the train state (orbax): save, refuse what does not fit, and restore onto any layout.

A checkpoint is three items: 'state' (the whole train state pytree), 'meta' (JSON: step, model kind,
tables, dense shapes, the embedding layout signature, config) and 'data' (JSON: the data source's position,
when it has one). A checkpoint of another model, or an unreadable one, raises `CheckpointError` and leaves
every file as it was. Restoring onto the same embedding layout reads each device's blocks directly; onto
another mesh, topology or plan, the saved stacks are read row-chunked over every device and moved to their
new owners on device (`jaxscale.engine.embedding.reshard`): no device or host holds a whole table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

import jax
import numpy as np

from jaxscale.engine.embedding import reshard
from jaxscale.engine.embedding.layout import build_layout
from jaxscale.engine.plan import ShardingPlan
from jaxscale.engine.tables import TableConfig


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, corrupt, incomplete, or from another model."""


@dataclasses.dataclass
class Checkpointer:
    """The checkpoints of one run directory (`<workdir>/checkpoints`)."""

    workdir: Path
    keep: int = 2
    process_index: int = 0
    process_count: int = 1
    verbose: bool = True

    @property
    def directory(self) -> Path:
        return Path(self.workdir) / "checkpoints"

    def manager(self, create: bool = True):
        import orbax.checkpoint as ocp

        opts = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=create, enable_async_checkpointing=True)
        return ocp.CheckpointManager(self.directory, options=opts, item_names=("state", "meta", "data"))

    @contextlib.contextmanager
    def reading(self):
        """A manager for reading, closed on exit: an unclosed manager's async machinery outlives it (its event
        loop is closed under it)."""
        mgr = self.manager(create=False)
        try:
            yield mgr
        finally:
            mgr.close()

    def steps(self) -> list[int]:
        """Complete checkpoints (partial ones from a killed save are ignored)."""
        if not self.directory.exists():
            return []
        with self.reading() as mgr:
            return sorted(mgr.all_steps())

    # ------------------------------------------------------------------------------------ save

    def save(self, mgr, state, meta: dict, data_state: dict | None = None) -> int:
        """Saves `state` at meta['step'] (asynchronously: `mgr.wait_until_finished()` before reading it).

        The trainer decides when to save, so orbax's own save policy is bypassed (`force`). Checkpoints at
        this step or later are from an abandoned run (this one resumed from an earlier step): they are moved
        to <workdir>/abandoned_checkpoints/ first, never deleted, so `latest` is this run again.
        """
        import orbax.checkpoint as ocp

        step = int(meta["step"])
        stale = sorted(s for s in mgr.all_steps() if s >= step)
        if stale:
            self._set_aside(mgr, stale)
        mgr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave(meta),
                data=ocp.args.JsonSave({"position": data_state}),
            ),
            force=True,
        )
        return step

    def _set_aside(self, mgr, steps):
        mgr.wait_until_finished()
        dest = Path(self.workdir) / "abandoned_checkpoints"
        if self.process_index == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for s in steps:
                src = Path(mgr.directory) / str(s)
                if src.exists():
                    dest.mkdir(parents=True, exist_ok=True)
                    target = dest / f"{s}-{stamp}"
                    os.replace(src, target)
                    if self.verbose:
                        print(
                            f"checkpoint step {s} is from an abandoned run (this run resumed from an earlier "
                            f"step): moved to {target}"
                        )
        if self.process_count > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxscale_set_aside_checkpoints")
        mgr.reload()

    # --------------------------------------------------------------------------------- restore

    def restore(self, template, expected_meta: dict, ec, step: int | None = None):
        """(state, meta, data position) of checkpoint `step` (default: latest), on `ec`'s layout.

        `template` is a state of the current run (shapes and shardings); `expected_meta` is what this run
        would save (checked for compatibility).
        """
        if not self.directory.exists():
            raise CheckpointError(f"no checkpoint directory at {self.directory}")
        with self.reading() as mgr:
            return self._restore(mgr, template, expected_meta, ec, step)

    def _restore(self, mgr, template, expected_meta: dict, ec, step: int | None):
        import orbax.checkpoint as ocp

        steps = mgr.all_steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {self.directory} (partial ones are ignored)")
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available: {sorted(steps)}")
        others = sorted(s for s in steps if s != step)
        hint = f"; other checkpoints here: {others} (resume one with --resume-step N)" if others else ""
        where = f"checkpoint step {step} in {self.directory}"
        try:
            meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            if not isinstance(meta, dict) or "layout" not in meta or "step" not in meta:
                raise ValueError(f"metadata is not a jaxscale checkpoint's: {str(meta)[:200]}")
        except Exception as e:  # orbax raises many types for unreadable files
            raise CheckpointError(f"{where} is unreadable (corrupt or incomplete): {_brief(e)}{hint}") from e
        problems = compatibility_problems(meta, expected_meta)
        if problems:
            raise CheckpointError(
                f"{where} is from another model: " + "; ".join(problems) + (f" ({hint[2:]})" if hint else "")
            )
        same_layout = meta["layout"] == expected_meta["layout"]
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), template)
        if not same_layout:
            abstract["emb"] = self._chunked_abstract(meta, ec.mesh)
        try:
            item = ocp.args.StandardRestore(abstract, strict=same_layout)
            restored = mgr.restore(step, args=ocp.args.Composite(state=item))["state"]
            data = _data_position(mgr, step)
        except Exception as e:
            raise CheckpointError(f"{where} is unreadable (corrupt or incomplete): {_brief(e)}{hint}") from e
        if not same_layout:
            saved = build_layout(
                [TableConfig(**t) for t in meta["tables"]], ShardingPlan.from_dict(meta["layout"]["plan"])
            )
            emb = restored["emb"]
            restored["emb"] = reshard.reshard(saved, emb, ec.state_spec, step=int(host(emb["step"])))
        if int(host(restored["step"])) != meta["step"]:
            raise CheckpointError(
                f"{where} is inconsistent: state step {int(host(restored['step']))} != metadata step {meta['step']}"
            )
        return restored, meta, data

    @staticmethod
    def _chunked_abstract(meta, mesh) -> dict:
        """Restore targets of the saved stacks, padded and split row-wise over every device."""
        layout = meta["layout"]
        reps, shards = layout["num_replicas"], layout["plan"]["num_shards"]
        devices = mesh.devices.size

        def chunked(shape):
            full = reshard.chunked_shape(shape, devices)
            return jax.ShapeDtypeStruct(full, np.float32, sharding=reshard.chunk_sharding(mesh, len(full)))

        out = {
            "weights": {k: chunked((reps, shards, r, w)) for k, (r, w) in layout["stacks"].items()},
            "step": jax.ShapeDtypeStruct((), np.int32, sharding=jax.sharding.NamedSharding(mesh, jax.P())),
        }
        for slot in meta.get("optimizer_slots", []):
            out[slot] = {k: chunked((reps, shards, r)) for k, (r, _) in layout["stacks"].items()}
        return out


def compatibility_problems(meta: dict, expected: dict) -> list[str]:
    """Why a saved checkpoint cannot be this run's (empty when it can)."""
    problems = []
    if meta.get("model_kind") != expected["model_kind"]:
        problems.append(f"model kind {meta.get('model_kind')!r} != {expected['model_kind']!r}")
    saved = {t["name"]: t for t in meta.get("tables", [])}
    current = {t["name"]: t for t in expected["tables"]}
    for name in sorted(set(saved) | set(current)):
        a, b = saved.get(name), current.get(name)
        if a is None or b is None:
            problems.append(f"table {name!r} is {'missing from the checkpoint' if a is None else 'not in this model'}")
            continue
        for key in ("rows", "dim", "pooling", "reshape"):
            if a.get(key) != b.get(key):
                problems.append(f"table {name!r}: {key} {a.get(key)!r} in the checkpoint, {b.get(key)!r} now")
    shapes, saved_shapes = expected["dense_shapes"], meta.get("dense_shapes", {})
    diff = [k for k in sorted(set(shapes) | set(saved_shapes)) if shapes.get(k) != saved_shapes.get(k)]
    if diff:
        problems.append(
            f"dense parameters differ at {len(diff)} paths, e.g. {diff[0]}: "
            f"{saved_shapes.get(diff[0])} in the checkpoint, {shapes.get(diff[0])} now"
        )
    if sorted(meta.get("optimizer_slots", [])) != sorted(expected["optimizer_slots"]):
        problems.append(f"embedding optimizer slots {meta.get('optimizer_slots')} != {expected['optimizer_slots']}")
    return problems


def _data_position(mgr, step):
    import orbax.checkpoint as ocp

    try:
        return mgr.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]["position"]
    except (KeyError, FileNotFoundError, ValueError):
        return None  # a checkpoint without a data item (written by an older jaxscale)


def shapes(tree) -> dict:
    """{path: shape} of a pytree (what the compatibility check compares)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): list(np.shape(v)) for p, v in flat}


def host(x) -> np.ndarray:
    """A (possibly multi-process) array as a host NumPy array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding.is_fully_replicated:  # every process holds it all: no collective needed
            return np.asarray(x.addressable_shards[0].data)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _brief(e: BaseException, limit: int = 600) -> str:
    """`Type: message` cut to its first line and `limit` characters (tensorstore appends kilobytes of spec)."""
    text = str(e).split(" [tensorstore_spec", 1)[0].strip().splitlines()
    text = text[0] if text else ""
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"
