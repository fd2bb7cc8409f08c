"""RESULTS.md of the two-tower experiments: each script owns one section (between its markers) and rewrites
only that section, atomically; the machine description goes with every section."""

from __future__ import annotations

from pathlib import Path

from jaxscale.benchmarks.machine import machine_lines  # noqa: F401 -- the scripts import it from here
from jaxscale.infra import atomic

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
TITLE = (
    "# Contextual two-tower: recorded results\n\n"
    "Every section is written by the script it names; nothing here is typed by hand.\n"
)


def machine() -> dict:
    import jax

    from jaxscale.benchmarks.machine import machine as suite_machine

    return {**suite_machine(), "jax": jax.__version__, "devices": [str(d) for d in jax.devices()][:1]}


def write_section(name: str, markdown: str, path: Path = RESULTS) -> Path:
    """Replaces section `name` of `path` (created if absent) with `markdown`; other sections are kept."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else TITLE
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    atomic.write_text(path, text)
    return path
