"""Experiments are scripts (issue 36): every folder of experiments/ (results/ aside) has a README.md that names
each of its scripts, one line per entry script (its command, what it shows, where it records) and one per
helper (which entry uses it), and every command a folder README names exists. Reads files only; runs nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
NOT_EXPERIMENTS = {"results"}  # recorded files only, written by the scripts of the other folders


def _folders() -> list[Path]:
    return sorted(p for p in EXPERIMENTS.iterdir() if p.is_dir() and p.name not in NOT_EXPERIMENTS)


def _scripts(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts)


def test_every_experiment_folder_has_a_readme():
    missing = [f.name for f in _folders() if not (f / "README.md").is_file()]
    assert not missing, f"experiments/<folder>/README.md missing for {missing}"


def test_every_script_is_named_in_its_folder_readme():
    unnamed = []
    for folder in _folders():
        readme = folder / "README.md"
        text = readme.read_text() if readme.is_file() else ""
        unnamed += [str(s.relative_to(ROOT)) for s in _scripts(folder) if s.name not in text]
    assert not unnamed, f"scripts not named in their folder's README.md: {unnamed}"


def _commands(text: str) -> tuple[set[str], set[str]]:
    """The experiments/ paths and the `python -m` modules a README names in code spans."""
    spans = re.findall(r"`([^`]+)`", text)
    paths = {p for s in spans for p in re.findall(r"(experiments/[\w./-]+\.(?:py|sh|ipynb))", s)}
    modules = {m for s in spans for m in re.findall(r"python -m ([\w.]+)", s)}
    return paths, modules


def _module_exists(name: str) -> bool:
    base = ROOT / name.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()


def test_every_command_a_folder_readme_names_exists():
    wrong = []
    for folder in _folders():
        readme = folder / "README.md"
        if not readme.is_file():
            continue
        paths, modules = _commands(readme.read_text())
        wrong += [f"{folder.name}: {p}" for p in sorted(paths) if not (ROOT / p).is_file()]
        wrong += [f"{folder.name}: python -m {m}" for m in sorted(modules) if not _module_exists(m)]
    assert not wrong, f"commands named in experiments/*/README.md that do not exist: {wrong}"


def test_every_entry_script_has_a_row_in_docs_experiments():
    """docs/experiments.md's table has a row for each entry script (a README line that is not a helper's)."""
    table = (ROOT / "docs" / "experiments.md").read_text()
    missing = []
    for folder in _folders():
        readme = folder / "README.md"
        if not readme.is_file():
            continue
        for line in readme.read_text().splitlines():
            if not line.startswith("- `"):
                continue
            entry = re.match(r"- `[^`]*?(experiments/[\w./-]+\.(?:py|sh))", line)
            if entry and entry.group(1) not in table:
                missing.append(entry.group(1))
    assert not missing, f"entry scripts without a row in docs/experiments.md: {missing}"
