"""`python -m jaxscale.train`: train a model from a YAML config with dotted overrides, on one or many hosts.

    python -m jaxscale.train                                   # smoke foundation model, 8 simulated CPU devices
    python -m jaxscale.train --config jaxscale/configs/foundation_smoke.yaml mesh.nodes=2 mesh.local=4 \\
        embedding.topology=2d_a2a --steps 50
    # N hosts (one process per host; 'node' = process):
    python -m jaxscale.train --config cfg.yaml --coordinator HOST0:1234 --num-processes N --process-id I

Kept short on purpose: the work is in `jaxscale.training.trainer`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

# The package's own default configs (jaxscale/configs/): the default run works from any directory after a
# plain `pip install`.
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "foundation_smoke.yaml")


def plan_run(cfg, log=print):
    """(cfg with its embedding settings resolved, the ShardingPlan to run): planning as a stage before the
    trainer (`jaxscale.engine.planner.resolve`). `embedding.topology: auto` draws the planner's data sample (the
    first global batches' engine ids) and counts the model's dense parameters (its all-reduce shares the
    links); any other topology places `embedding.sharding` (or reads `plan_file`)."""
    from jaxscale.engine import planner
    from jaxscale.engine.embedding.settings import AUTO_TOPOLOGY
    from jaxscale.training import registry
    from jaxscale.training.data import planning_sample

    tables = registry.get(cfg.model.kind).tables(cfg.model.params)
    sample, dense = None, 0
    if cfg.embedding.topology == AUTO_TOPOLOGY:
        from jaxscale.training.trainer import dense_param_count

        sample, dense = planning_sample(cfg), dense_param_count(cfg)
    settings, plan = planner.resolve(cfg, tables, sample, dense_params=dense, log=log)
    return dataclasses.replace(cfg, embedding=settings), plan


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m jaxscale.train",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=None, help="YAML config (default: the smoke foundation config)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. embedding.topology=2d_a2a")
    p.add_argument("--steps", type=int, help="train.steps")
    p.add_argument("--batch-size", type=int, help="train.batch_size (global)")
    p.add_argument("--seed", type=int, help="train.seed")
    p.add_argument("--workdir", help="train.workdir: checkpoints and logs")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the workdir")
    p.add_argument("--resume-step", type=int, help="continue from this checkpoint step")
    p.add_argument("--coordinator", help="HOST:PORT of process 0 (multi-host)")
    p.add_argument("--num-processes", type=int, help="number of processes (hosts)")
    p.add_argument("--process-id", type=int, help="this process's index")
    p.add_argument("--stop-at", type=int, help="stop (with a checkpoint) at this step, as SIGTERM would")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # Intermixed: overrides may come before, between or after the options (plain parse_args refuses
    # `--steps 5 mesh.nodes=2` once an option has ended the positional run).
    return p.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxscale.training.config import ConfigError, load_config

    overrides = list(args.overrides)
    for flag, key in (
        ("steps", "train.steps"),
        ("batch_size", "train.batch_size"),
        ("seed", "train.seed"),
        ("workdir", "train.workdir"),
    ):
        if getattr(args, flag) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    try:
        cfg = load_config(args.config or DEFAULT_CONFIG, overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    # Before any JAX computation: distributed start-up and the simulated CPU device count.
    from jaxscale.infra import distributed

    distributed.set_overlap_flags()  # before JAX starts: dense all-reduce overlapped with backward on GPUs
    _, n, _, how = distributed.resolve(args.coordinator, args.num_processes, args.process_id)
    multi = how != "single"
    distributed.initialize(
        args.coordinator,
        args.num_processes,
        args.process_id,
        local_devices=cfg.mesh.local if multi else cfg.mesh.nodes * cfg.mesh.local,
    )

    import jax

    from jaxscale.training.trainer import CheckpointError, Trainer

    try:  # every process plans from the same global sample: the same plan everywhere; process 0 prints it
        cfg, plan = plan_run(cfg, log=print if jax.process_index() == 0 else None)
    except ValueError as e:
        print(f"planning error: {e}", file=sys.stderr)
        return 2
    trainer = Trainer(cfg, plan=plan, progress=not args.no_progress)
    if trainer.is_writer:
        print(trainer.ec.describe())
    try:
        out = trainer.run(resume=args.resume, resume_step=args.resume_step, stop_at=args.stop_at)
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 3
    if trainer.is_writer:
        losses = out["losses"]
        if losses:
            k = max(1, min(10, len(losses) // 5))
            first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
            print(
                f"trained steps {out['final_step'] - len(losses)}..{out['final_step']}: mean loss of the first {k} "
                f"steps {first:.4f} -> last {k} steps {last:.4f}"
            )
        print(
            f"comm bytes per device per step: intra-node {trainer.comm['intra_node']:.0f}, "
            f"cross-node {trainer.comm['cross_node']:.0f}"
            if trainer.comm
            else ""
        )
        print(f"logs and checkpoints: {trainer.workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
