"""The wheel ships every package of the tree under its folder name, the default configs and the named meshes."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setuptools():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed_under_its_folder_name():
    cfg = _setuptools()
    assert "package-dir" not in cfg  # a package is its folder: grep and the import graph can follow it
    found = {
        ".".join(i.parent.relative_to(ROOT).parts)
        for p in ("jaxscale", "jaxscale_models")
        for i in ROOT.glob(f"{p}/**/__init__.py")
    }
    assert found == set(cfg["packages"]), found ^ set(cfg["packages"])
    assert "models" not in found


def test_the_built_in_model_kinds_are_entry_points_of_their_modules():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"]["jaxscale.models"]
    assert declared == {k: f"jaxscale_models.{k}:SPEC" for k in ("foundation", "dlrm", "contextual_two_tower")}
    from jaxscale.training import registry

    assert set(declared) <= set(registry.kinds())
    assert all(registry.get(k).kind == k for k in declared)


def test_the_default_configs_ship_inside_the_package_and_meshes_link_to_the_repo():
    configs = ROOT / "jaxscale" / "configs"
    assert configs.is_dir() and not configs.is_symlink() and any(configs.glob("*.yaml"))
    assert "configs/*.yaml" in _setuptools()["package-data"]["jaxscale"]
    link = ROOT / "jaxscale" / "presets" / "meshes"
    assert link.is_symlink() and link.resolve() == (ROOT / "meshes").resolve() and any(link.glob("*.yaml"))
    from jaxscale.training.run import DEFAULT_CONFIG

    assert Path(DEFAULT_CONFIG) == configs / "foundation_smoke.yaml" and Path(DEFAULT_CONFIG).exists()
