"""Multi-host start-up: `jax.distributed.initialize` from flags, environment or cluster auto-detection.

Must run before anything touches a JAX backend. JAX reads JAX_COORDINATOR_ADDRESS itself but not
JAX_NUM_PROCESSES / JAX_PROCESS_ID, so those (and JAXSCALE_* equivalents) are read here and passed on.
"""

from __future__ import annotations

import os

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")

# XLA:GPU flags that overlap the dense gradient all-reduce with the backward pass, as DDP's buckets do:
# the latency-hiding scheduler moves collectives' starts early and their waits late; all-reduces are
# combined into ~25 MB buckets (DDP's default bucket size), so only the last bucket's all-reduce is exposed
# after the backward pass; pipelined all-reduce overlaps a bucket's reduce with the next bucket's compute.
# XLA:CPU parses and ignores them.
GPU_OVERLAP_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=26214400",
    "--xla_gpu_enable_pipelined_all_reduce=true",
)


def set_overlap_flags() -> list[str]:
    """Adds `GPU_OVERLAP_FLAGS` to XLA_FLAGS (before JAX starts), keeping any the user set; returns those
    added. JAXSCALE_XLA_OVERLAP=0 turns this off."""
    if os.environ.get("JAXSCALE_XLA_OVERLAP", "1") == "0":
        return []
    current = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in current}
    added = [f for f in GPU_OVERLAP_FLAGS if f.split("=", 1)[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join(current + added)
    return added


def _env(*names):
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return v
    return None


def resolve(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None):
    """(coordinator, num_processes, process_id, how) with flags taking precedence over the environment.

    `how` is 'single' (no distributed start-up), 'explicit' or 'auto' (a cluster JAX detects itself).
    """
    coordinator = coordinator or _env("JAXSCALE_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS")
    n = num_processes if num_processes is not None else _env("JAXSCALE_NUM_PROCESSES", "JAX_NUM_PROCESSES")
    i = process_id if process_id is not None else _env("JAXSCALE_PROCESS_ID", "JAX_PROCESS_ID")
    n = int(n) if n is not None else None
    i = int(i) if i is not None else None
    if n is not None and n < 1:
        raise ValueError(f"number of processes must be >= 1, got {n}")
    if n is not None and i is not None and not 0 <= i < n:
        raise ValueError(f"process id {i} is outside [0, {n})")
    if n == 1 and not coordinator:
        return None, 1, 0, "single"
    if coordinator or n is not None or i is not None:
        missing = [
            name
            for name, v in (("coordinator address", coordinator), ("number of processes", n), ("process id", i))
            if v is None
        ]
        if missing:
            raise ValueError(
                f"multi-process launch needs {', '.join(missing)}: pass --coordinator HOST:PORT, "
                f"--num-processes N and --process-id I (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                f"JAX_PROCESS_ID)"
            )
        return coordinator, n, i, "explicit"
    if all(v in os.environ for v in SLURM_VARS) and int(os.environ["SLURM_NTASKS"]) > 1:
        return None, None, None, "auto"
    return None, 1, 0, "single"


def initialize(
    coordinator=None,
    num_processes=None,
    process_id=None,
    *,
    local_devices: int | None = None,
    timeout_s: int = 300,
    heartbeat_timeout_s: int | None = None,
) -> tuple[int, int]:
    """Starts JAX (multi-process when asked); returns (process_index, process_count).

    `local_devices` sets the number of simulated CPU devices per process (no effect on GPUs).
    `heartbeat_timeout_s` bounds how long the survivors wait when a process dies: they then exit with
    an error instead of hanging in a collective. Default: $JAXSCALE_HEARTBEAT_TIMEOUT_S, else 30.
    """
    import jax

    if heartbeat_timeout_s is None:
        raw = _env("JAXSCALE_HEARTBEAT_TIMEOUT_S") or "30"
        try:
            heartbeat_timeout_s = int(raw)
        except ValueError:
            raise ValueError(f"JAXSCALE_HEARTBEAT_TIMEOUT_S must be a whole number of seconds, got {raw!r}") from None
    if heartbeat_timeout_s < 1:
        raise ValueError(f"heartbeat timeout must be >= 1 s, got {heartbeat_timeout_s}")

    if local_devices is not None:
        jax.config.update("jax_num_cpu_devices", int(local_devices))
    coordinator, n, i, how = resolve(coordinator, num_processes, process_id)
    if how == "explicit":
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=n,
            process_id=i,
            initialization_timeout=timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
    elif how == "auto":
        jax.distributed.initialize(initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s)
    return jax.process_index(), jax.process_count()
