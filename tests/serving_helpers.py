"""Shared by the serving tests: the demo model store, exported once per test process."""

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from jaxscale.serving import demo


@functools.cache
def demo_store() -> tuple[Path, list]:
    """(store directory, signatures) of the six demo model versions; removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix="jaxscale-serving-store-"))
    atexit.register(shutil.rmtree, path, True)
    return path, demo.export_demo(path)
