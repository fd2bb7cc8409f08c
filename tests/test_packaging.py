"""The wheel ships every package of the tree under a namespaced name, and the presets the defaults need."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setuptools():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed_and_models_are_namespaced():
    cfg = _setuptools()
    listed = set(cfg["packages"])
    dirs = {v: k for k, v in cfg.get("package-dir", {}).items()}
    found = set()
    for init in ROOT.glob("jaxscale/**/__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    found |= {dirs["models"]}
    assert found == listed, found ^ listed
    assert "models" not in listed and dirs["models"] == "jaxscale_models"


def test_presets_link_to_the_user_facing_files():
    presets = ROOT / "jaxscale" / "presets"
    for name, target in (("configs", ROOT / "experiments" / "configs"), ("meshes", ROOT / "meshes")):
        link = presets / name
        assert link.is_symlink() and link.resolve() == target.resolve()
        assert any(link.glob("*.yaml"))
    from jaxscale.train import DEFAULT_CONFIG

    assert Path(DEFAULT_CONFIG).exists() and Path(DEFAULT_CONFIG).name == "foundation_smoke.yaml"
