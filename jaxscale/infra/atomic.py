"""Atomic file writes: a reader sees the old file or the whole new one, never half of either.

Every file jaxscale (and its experiments) writes whole goes through here: stores' metadata, vocabularies,
serving signatures, encoder states, benchmark results. The bytes go to a temporary file beside the target,
are fsynced, renamed over the target, and the directory is fsynced, so the rename itself survives a crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    """Makes a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path beside `path` to write; on success it is fsynced and renamed over `path`.

    For writers that need a path of their own (Parquet, Arrow IPC); on an error the temporary file goes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with replacing(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text)


def replace_between(path: str | os.PathLike, start: str, end: str, body: str) -> None:
    """The text strictly between the first marker `start` and the next `end` in `path` becomes "\n" + body + "\n"."""
    text = Path(path).read_bytes().decode() if Path(path).exists() else ""  # keeps \r\n
    b = text.find(end, a + len(start)) if (a := text.find(start)) >= 0 else -1
    if b < 0:
        raise ValueError(f"{path} lacks the marker {end if a >= 0 else start!r}")
    write_text(path, f"{text[: a + len(start)]}\n{body}\n{text[b:]}")


def write_json(path: str | os.PathLike, obj, **kwargs) -> None:
    """`obj` as JSON (indent 2 unless told otherwise), with a final newline."""
    write_text(path, json.dumps(obj, **({"indent": 2} | kwargs)) + "\n")
