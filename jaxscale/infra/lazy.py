"""Lazy package faces: a package lists the names it exports and their modules, and a module is imported only
when one of its names is first used, so `import jaxscale` (and the device-free layers) loads no JAX."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[list[str], Callable, Callable]:
    """(`__all__`, `__getattr__`, `__dir__`) for `package`, which exports `exports` ({name: module})."""

    def __getattr__(name):  # noqa: N807 - the module-level hook's name
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            setattr(sys.modules[package], name, value)  # resolved once
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():  # noqa: N807
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return sorted(exports), __getattr__, __dir__
