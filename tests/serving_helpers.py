"""Shared by the serving tests: the demo model store, exported once per test process, and its leaves."""

import atexit
import contextlib
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


@contextlib.contextmanager
def running_leaves(store: Path, keys, batch: int):
    """One started, warmed-up `Leaf` per (model, version) in `keys`, serving `store` at batch `batch`;
    stopped on exit."""
    from jaxscale.serving.leaf import Leaf, LeafConfig

    started = {key: Leaf(LeafConfig(store, *key, batch_buckets=(batch,), warmup=True)).start() for key in keys}
    try:
        yield started
    finally:
        for leaf in started.values():
            leaf.stop()
