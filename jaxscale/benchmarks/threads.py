"""Thread parity: both engines run the same number of intra-op threads per process, set and read back.

TorchRec's ranks set theirs with `torch.set_num_threads` (and report `torch.get_num_threads`). XLA:CPU sizes
its intra-op pool, on which jaxscale's native kernels run too, from the `PJRT_NPROC` environment variable
(else the usable cores), read when its client starts, so it is set in a worker's environment; the worker
reads it back by counting its threads named `tf_XLAEigen` after a step. A process of several simulated
devices ran at least one pool thread per device (4 at 4 devices with PJRT_NPROC=2): the in-process rows,
which are not compared with TorchRec, show what they ran.
"""

from __future__ import annotations

import os
from pathlib import Path

XLA_THREADS_ENV = "PJRT_NPROC"
XLA_POOL_THREAD = "tf_XLAEigen"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def per_process(processes: int, cores: int | None = None) -> int:
    """Intra-op threads for each of `processes` processes sharing the cores: max(1, cores // processes)."""
    return max(1, (usable_cores() if cores is None else cores) // max(1, processes))


def xla_env(threads: int) -> dict[str, str]:
    """The environment entry that sizes XLA:CPU's intra-op pool of a process started with it."""
    return {XLA_THREADS_ENV: str(int(threads))}


def xla_intra_op_threads() -> int | None:
    """How many XLA:CPU intra-op pool threads this process runs (after its first computation); None off Linux."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    count = 0
    for task in tasks.iterdir():
        try:
            count += (task / "comm").read_text().strip() == XLA_POOL_THREAD
        except OSError:  # a thread that ended meanwhile
            pass
    return count
