"""The machine a benchmark ran on, and whether it was quiet enough to time anything.

A CPU step time means little without the CPU: FBGEMM's kernels take several times longer on a host without
the vector extensions they dispatch to, so the description carries the model and its vector flags (AVX2,
AVX-512, AMX). The load gate refuses to record on a loaded machine, or marks the tables it could not trust.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from jaxscale.benchmarks.threads import usable_cores

# /proc/cpuinfo flags that decide the speed of the engines' kernels (exact names, or these prefixes)
VECTOR_FLAGS = ("avx", "avx2", "fma", "f16c")
VECTOR_FLAG_PREFIXES = ("avx512", "avx_vnni", "amx")


def _first_field(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> list[str] | None:
    """The CPU's vector flags (AVX, AVX2, FMA, F16C, AVX-512*, AVX-VNNI, AMX*) from /proc/cpuinfo; None
    where there is no /proc/cpuinfo."""
    line = _first_field("/proc/cpuinfo", "flags")
    if line is None:
        return None
    return sorted(f for f in set(line.split()) if f in VECTOR_FLAGS or f.startswith(VECTOR_FLAG_PREFIXES))


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict:
    """CPU model and vector flags, cores (all and usable), memory, load average now, software: the
    description every recorded result carries (experiment scripts add their own versions)."""
    import numpy as np

    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "cpu_model": _first_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "cpu_flags": cpu_flags(),
        "nproc": os.cpu_count(),
        "usable_cores": usable_cores(),
        "memory": _first_field("/proc/meminfo", "MemTotal"),
        "loadavg_at_start": load,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
    }


def recorded_machine() -> dict:
    """`machine()` plus the keys a recorded benchmark's report reads: cores, load average (1/5/15 min) now."""
    m = machine()
    return m | {"cores": m["nproc"], "load_average": load_average()}


def describe_flags(flags: Sequence[str] | None) -> str:
    if flags is None:
        return "CPU flags unknown"
    wide = [f for f in flags if f.startswith(("avx512", "amx"))]
    return (
        "CPU flags: " + (" ".join(flags) or "none of AVX/AVX2/AVX-512/AMX") + ("" if wide else " (no AVX-512, no AMX)")
    )


def describe_machine(m: Mapping) -> str:
    cores = m.get("cores", m.get("nproc"))
    return (
        f"{m['cpu_model']}, {cores} cores ({m['usable_cores']} usable), {m['memory']} memory; "
        f"{describe_flags(m.get('cpu_flags'))}; {m['platform']}, Python {m['python']}, numpy {m['numpy']}"
    )


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def background_busy(window_s: float = 1.0) -> float | None:
    """Fraction of the machine's CPU time (0..1) spent busy during `window_s`, sampled while this
    process sleeps. Called when no benchmark process of ours runs, it measures everyone else's load,
    unlike the load average, which still carries our own previous sessions for minutes."""
    a = _cpu_jiffies()
    time.sleep(window_s)
    b = _cpu_jiffies()
    if a is None or b is None or b[1] == a[1]:
        return None
    return round((b[0] - a[0]) / (b[1] - a[1]), 3)


def load_line(before, after, busy=None) -> str:
    """'load average 0.12 -> 0.95 (1 min)' [+ the others' CPU share sampled before each session]."""
    fmt = lambda la: "?" if not la else f"{la[0]:.2f}"  # noqa: E731
    text = f"Load average (1 min) {fmt(before)} before, {fmt(after)} after"
    if busy:
        text += f"; other processes' CPU before each session: max {100 * max(busy):.0f}% of the machine"
    return text


class LoadGate:
    """Decides whether timings may be recorded: the 1-min load average before anything of ours ran must
    be <= max_load, and every background sample taken before a session must be <= max_busy. With
    `allow=True` the run goes on and every affected table is marked instead."""

    def __init__(self, max_load: float, max_busy: float, allow: bool):
        self.max_load, self.max_busy, self.allow = max_load, max_busy, allow
        self.start = load_average()
        self.busy: list[float] = []

    @property
    def start_ok(self) -> bool:
        return self.start is None or self.start[0] <= self.max_load

    def sample(self) -> float | None:
        b = background_busy()
        if b is not None:
            self.busy.append(b)
        return b

    def problems(self, busy: Sequence[float] = ()) -> list[str]:
        out = []
        if not self.start_ok:
            out.append(f"load average {self.start[0]:.2f} at start > {self.max_load:g}")
        if busy and max(busy) > self.max_busy:
            out.append(f"other processes used {100 * max(busy):.0f}% of the CPU > {100 * self.max_busy:.0f}%")
        return out


def machine_lines(m: Mapping, load_at_end) -> list[str]:
    """The machine as the two-tower write-ups print it (Markdown bullets): CPU, cores, memory, versions, load."""
    fmt = lambda x: "n/a" if x is None else ", ".join(f"{v:.2f}" for v in x)  # noqa: E731
    return [
        f"- machine: {m['cpu_model']}, {m['nproc']} cores visible, {m['memory']}; {m['platform']}",
        f"- python {m['python']}, jax {m['jax']}, numpy {m['numpy']}",
        f"- load average (1, 5, 15 min) at start: {fmt(m['loadavg_at_start'])}; at end: {fmt(load_at_end)}",
    ]
