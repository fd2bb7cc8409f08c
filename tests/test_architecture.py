"""docs/architecture.md stays true: every module it names exists, and the house has no import loop."""

import re
import subprocess
import sys

from conftest import ROOT

DOC = ROOT / "docs" / "architecture.md"


def named_paths() -> set[str]:
    """Every `path.py` or `folder/` the document names in backticks, under the project's packages."""
    names = set(re.findall(r"`((?:jaxscale|jaxscale_models|experiments|tests|docs)/[\w/.]*)`", DOC.read_text()))
    assert len(names) > 40, "the architecture document names the modules it describes"
    return names


def test_every_module_the_architecture_names_exists():
    missing = sorted(p for p in named_paths() if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_library_module_is_in_the_architecture():
    named = named_paths()
    folders = {p.rstrip("/") for p in named if p.endswith("/")}
    modules = [
        str(p.relative_to(ROOT))
        for package in ("jaxscale", "jaxscale_models")
        for p in (ROOT / package).rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    ]
    unnamed = sorted(m for m in modules if m not in named and str((ROOT / m).parent.relative_to(ROOT)) not in folders)
    assert not unnamed, f"modules docs/architecture.md does not describe: {unnamed}"


def test_the_house_has_no_import_loop_and_its_picture_is_regenerated(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "architecture" / "house.py"), "--out", str(tmp_path / "house.png")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "import loops: none" in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "house.png").stat().st_size > 10_000
    recorded = (ROOT / "docs" / "house.txt").read_text()
    assert recorded == (tmp_path / "house.txt").read_text(), (
        "docs/house.png is stale: run python experiments/architecture/house.py"
    )
