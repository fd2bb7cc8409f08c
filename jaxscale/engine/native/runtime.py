"""Whether the native kernels are used: JAXSCALE_NATIVE, the one-time build + FFI registration, its outcome.

JAXSCALE_NATIVE=auto (default): build on first use; if that fails, warn once (one line) and use the
pure-JAX kernels. =1: the native kernels are required; a failed build raises `NativeUnavailableError`
with the reason. =0: never build, always the pure-JAX kernels.
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings

from jaxscale.engine.native import build as _build

ENV = "JAXSCALE_NATIVE"
MODES = ("auto", "0", "1")
TARGETS = {
    "jaxscale_gather_rows": "JaxscaleGatherRows",
    "jaxscale_gather_pool": "JaxscaleGatherPool",
    "jaxscale_update_rows": "JaxscaleUpdateRows",
    "jaxscale_update_pooled": "JaxscaleUpdatePooled",
    "jaxscale_gather_segment_sum": "JaxscaleGatherSegmentSum",
    "jaxscale_update_rows_indexed": "JaxscaleUpdateRowsIndexed",
    "jaxscale_rank_within_owner": "JaxscaleRankWithinOwner",
    "jaxscale_slot_bags": "JaxscaleSlotBags",
}


class NativeUnavailableError(RuntimeError):
    """JAXSCALE_NATIVE=1 asked for the native kernels and they could not be built or loaded."""


_lock = threading.Lock()
_loaded: dict = {}  # {'path': Path} on success, {'reason': str} on failure; empty before the first try
_warned = False


def mode() -> str:
    """The JAXSCALE_NATIVE setting ('auto', '0' or '1'); any other value is an error naming the variable."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r}: expected one of 'auto' (default), '0' or '1'")
    return value


def _load() -> dict:
    """Builds (or finds cached), loads and registers the library, once per process; records why not."""
    with _lock:
        if _loaded:
            return _loaded
        try:
            path = _build.build()
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:  # a damaged cache entry: build it again, once
                path.unlink(missing_ok=True)
                path = _build.build()
                lib = ctypes.CDLL(str(path))
            abi = lib.jaxscale_native_abi_version()
            if abi != _build.ABI_VERSION:
                raise _build.BuildError(f"{path} has ABI version {abi}, expected {_build.ABI_VERSION}")
            import jax

            for target, symbol in TARGETS.items():
                jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            _loaded.update(path=path, lib=lib)
        except (_build.BuildError, OSError, AttributeError) as e:
            _loaded.update(reason=f"{type(e).__name__}: {e}")
        return _loaded


def available() -> bool:
    """True when the native kernels are enabled and built (builds them on the first call)."""
    return mode() != "0" and "path" in _load()


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    if mode() == "0":
        return f"disabled by {ENV}=0"
    return _load().get("reason")


def library_path():
    """Path of the loaded shared library, or None."""
    return _load().get("path") if mode() != "0" else None


def use_native() -> bool:
    """Decides, at trace time, whether an op lowers to the native kernel (see the module docstring)."""
    global _warned
    m = mode()
    if m == "0":
        return False
    state = _load()
    if "path" in state:
        return True
    if m == "1":
        raise NativeUnavailableError(f"{ENV}=1 but the native kernels are unavailable: {state['reason']}")
    if not _warned:
        _warned = True
        first = state["reason"].strip().splitlines()[0]
        warnings.warn(
            f"jaxscale.engine.native: native kernels unavailable ({first}); using the pure-JAX kernels "
            f"(set {ENV}=0 to silence, =1 to make this an error)",
            RuntimeWarning,
            stacklevel=3,
        )
    return False
