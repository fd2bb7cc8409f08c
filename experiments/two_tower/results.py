"""RESULTS.md of the two-tower experiments: each script owns one section (between its markers) and rewrites
only that section, atomically; the machine description goes with every section."""

from __future__ import annotations

from pathlib import Path

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
    if begin not in text or end not in text:
        atomic.write_text(path, f"{text.rstrip()}\n\n{begin}\n{end}\n")
    atomic.replace_between(path, begin, end, markdown.rstrip())
    return path
