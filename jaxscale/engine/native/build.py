"""Build-on-first-use of the native kernels: compile the shipped C++ source once per machine, cache it.

The shared library lands in a cache directory under a name keyed by everything that changes the binary:
the source's hash, the jaxlib version (its FFI headers), the compiler and its version, the flags and the
machine architecture. Flags are chosen from what the CPU supports (x86-64-v3 = AVX2/FMA when present, the
baseline otherwise) and are part of the key, so a cache shared with another machine never hands it a
binary its CPU cannot run. Several processes may build at once: each compiles into its own temporary file
and renames it into place atomically (`jaxscale.infra.atomic`; a lock file also lets the others wait instead of
compiling twice).

Environment:
  JAXSCALE_NATIVE_CACHE   cache directory (default: $XDG_CACHE_HOME/jaxscale/native, ~/.cache/...)
  CXX                     the compiler (default: the first of g++, c++, clang++ on PATH)
  JAXSCALE_NATIVE_CXXFLAGS extra compiler flags (appended; part of the key)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path

from jaxscale.infra import atomic

SOURCE = Path(__file__).resolve().parent / "csrc" / "jaxscale_native.cc"
ABI_VERSION = 4  # must match kAbiVersion in the source
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-w")
COMPILE_TIMEOUT_S = 600
_X86_64_V3 = {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}  # abm: lzcnt


class BuildError(RuntimeError):
    """The native library could not be built or loaded (the message says why and what to do)."""


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """What a build would run and where its result is cached."""

    compiler: str
    compiler_version: str
    flags: tuple[str, ...]
    include_dir: str
    key: str
    library: Path


def find_compiler() -> str:
    """The C++ compiler: $CXX, else g++, c++ or clang++ from PATH. Raises BuildError when there is none."""
    cxx = os.environ.get("CXX")
    if cxx:
        path = shutil.which(shlex.split(cxx)[0])
        if path is None:
            raise BuildError(f"CXX={cxx!r} is not an executable on PATH")
        return path
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    raise BuildError(
        "no C++ compiler found (looked for $CXX, g++, c++, clang++ on PATH): install one "
        "(e.g. `apt-get install g++`) or set CXX, or set JAXSCALE_NATIVE=0 to use the pure-JAX kernels"
    )


def _compiler_version(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"cannot run the compiler {compiler}: {e}") from e
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else "unknown"


def cpu_flags() -> set[str]:
    """The CPU feature flags of this machine (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_flags() -> tuple[str, ...]:
    """-march level this CPU supports: x86-64-v3 (AVX2, FMA) when available; nothing (baseline) otherwise."""
    if platform.machine() in ("x86_64", "AMD64") and _X86_64_V3 <= cpu_flags():
        return ("-march=x86-64-v3",)
    return ()


def cache_dir() -> Path:
    env = os.environ.get("JAXSCALE_NATIVE_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxscale" / "native"


def plan_build(isa: tuple[str, ...] | None = None) -> BuildPlan:
    """The compiler, flags and cache path of this machine's build (no compilation)."""
    import jax
    import jaxlib

    compiler = find_compiler()
    version = _compiler_version(compiler)
    extra = tuple(shlex.split(os.environ.get("JAXSCALE_NATIVE_CXXFLAGS", "")))
    flags = BASE_FLAGS + (isa_flags() if isa is None else isa) + extra
    include_dir = jax.ffi.include_dir()
    h = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        f"abi={ABI_VERSION}",
        f"jaxlib={jaxlib.__version__}",
        f"compiler={compiler}|{version}",
        "flags=" + " ".join(flags),
        f"machine={platform.machine()}|{platform.system()}",
    ):
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    key = h.hexdigest()[:20]
    return BuildPlan(compiler, version, flags, include_dir, key, cache_dir() / f"jaxscale_native-{key}.so")


@contextlib.contextmanager
def _build_lock(path: Path):
    """An exclusive lock (fcntl) so concurrent first users wait for one build; a no-op where unsupported."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps the cache consistent
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # e.g. a filesystem without locks: builds may duplicate, results stay consistent
        yield
    finally:
        os.close(fd)


def compile_library(plan: BuildPlan) -> Path:
    """Compiles the source into plan.library (atomic rename), unless it is already there."""
    if plan.library.exists():
        return plan.library
    try:
        plan.library.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(
            f"cannot create the cache directory {plan.library.parent}: {e} (set JAXSCALE_NATIVE_CACHE)"
        ) from e
    with _build_lock(plan.library.with_suffix(".lock")):
        if plan.library.exists():  # another process built it while we waited
            return plan.library
        try:
            # the compiler writes a temporary file that is renamed over the library (`jaxscale.infra.atomic`)
            with atomic.replacing(plan.library) as tmp:
                _compile(plan, tmp)
        except OSError as e:
            raise BuildError(
                f"cannot write to the cache directory {plan.library.parent}: {e} (set JAXSCALE_NATIVE_CACHE)"
            ) from e
    return plan.library


def _compile(plan: BuildPlan, out_path: Path) -> None:
    """Runs the compiler with output `out_path`; BuildError with its last lines when it fails."""
    cmd = [plan.compiler, *plan.flags, "-I", plan.include_dir, str(SOURCE), "-o", str(out_path)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"running the compiler failed: {' '.join(cmd)}: {e}") from e
    if out.returncode != 0:
        tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-25:])
        raise BuildError(f"compiling the native kernels failed ({' '.join(cmd)}):\n{tail}")
    os.chmod(out_path, 0o755)


def build() -> Path:
    """Builds (or finds in the cache) the library for this machine and returns its path.

    If the CPU-specific flags are refused by the compiler (an old compiler without -march=x86-64-v3), the
    baseline build is used instead.
    """
    plan = plan_build()
    try:
        return compile_library(plan)
    except BuildError:
        if not isa_flags():
            raise
        return compile_library(plan_build(isa=()))
