"""docs/architecture.md stays true: every module it names exists, the house has no import loop, tests import no
experiment module, and a setting walks from the YAML to the collective without climbing back."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
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
    assert "import loops: none" in out.stdout, out.stdout + out.stderr
    wings = re.search(r"wings, bottom to top: ([\w, ]+); imports that climb to a higher wing: (.*)", out.stdout)
    assert wings and wings[1].split(", ") == list(WINGS), "house.py draws the wings this test enforces, in order"
    assert wings[2] == "none" and out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "house.png").stat().st_size > 10_000
    recorded = (ROOT / "docs" / "house.txt").read_text()
    assert recorded == (tmp_path / "house.txt").read_text(), (
        "docs/house.png is stale: run python experiments/architecture/house.py"
    )


# ------------------------------------------------------------------------------------------------ the wings

WINGS = ("infra", "engine", "sequences", "training", "serving", "models", "studies", "benchmarks", "commands")
"""The wings bottom to top (docs/architecture.md): a module imports only from its own wing and the ones below.
`models` is `jaxscale_models`; `commands` the thin faces of `python -m jaxscale.<face>`."""
FACES = {"train", "evaluate", "bench", "comm_report"}


def project_imports() -> dict[str, set[str]]:
    """{module of jaxscale or jaxscale_models: the project modules it imports}, read with `ast` at any depth of
    the code (a function-level import is still a dependency); `from pkg import sub` depends on pkg.sub."""
    files = {}
    for package in ("jaxscale", "jaxscale_models"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    out = {}
    for module, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package, level - 1 packages up
                    parts = module.split(".")
                    package = parts[: len(parts) - (path.name != "__init__.py") - node.level + 1]
                    base = ".".join([*package, *([node.module] if node.module else [])])
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    found.add(name)
        out[module] = found
    return out


def wing(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "jaxscale_models":
        return "models"
    if module == "jaxscale":
        return "engine"  # the package face: it hands on engine names (checked below)
    return "commands" if len(parts) == 2 and parts[1] in FACES else parts[1]


def test_the_wings_import_only_downwards():
    imports = project_imports()
    unknown = sorted(m for m in imports if wing(m) not in WINGS)
    assert not unknown, f"modules outside every wing: {unknown}"
    climbs = sorted(
        f"{m} -> {d}" for m, deps in imports.items() for d in deps if WINGS.index(wing(d)) > WINGS.index(wing(m))
    )
    assert not climbs, f"imports that climb to a higher wing (order {' < '.join(WINGS)}): {climbs}"


def test_nothing_in_the_library_below_the_studies_imports_a_model():
    imports = project_imports()
    below = [m for m in imports if WINGS.index(wing(m)) < WINGS.index("studies") and wing(m) != "models"]
    offenders = sorted(m for m in below if any(wing(d) == "models" for d in imports[m]))
    assert not offenders, f"library modules importing jaxscale_models (reach it through the registry): {offenders}"


def test_the_top_level_holds_only_the_package_face_and_thin_command_faces():
    top = ROOT / "jaxscale"
    assert {p.name for p in top.glob("*.py")} == {"__init__.py"} | {f"{f}.py" for f in FACES}
    folders = {p.name for p in top.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(WINGS) - {"models", "commands"} | {"configs", "presets"}, folders
    for face in sorted(FACES):
        body = ast.parse((top / f"{face}.py").read_text()).body
        body = body[1:] if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body
        assert len(body) == 2, f"jaxscale/{face}.py: only `from ... import main` and the main guard"
        first, guard = body
        assert isinstance(first, ast.ImportFrom) and [a.name for a in first.names] == ["main"], face
        assert isinstance(guard, ast.If) and "__main__" in ast.unparse(guard.test) and len(guard.body) == 1, face
    exports = ast.literal_eval(re.search(r"_EXPORTS = (\{.*?\})", (top / "__init__.py").read_text(), re.S)[1])
    assert {wing(m) for m in exports.values()} == {"engine"}, "the package face hands on engine names only"


# ------------------------------------------------------------------------ tests import no experiment module

EXPERIMENTS = ROOT / "experiments"
IMPORTERS = {"spec_from_file_location", "import_module", "run_path", "run_module", "SourceFileLoader", "__import__"}
"""Calls that import a module by path or by name (importlib, runpy)."""


def _experiment_module_names() -> set[str]:
    """The bare names an experiment module would be imported under (its file's or package's name)."""
    names = {p.stem for p in EXPERIMENTS.rglob("*.py") if p.stem != "__init__"}
    return names | {p.parent.name for p in EXPERIMENTS.rglob("__init__.py")} | {"experiments"}


def _is_experiment_module(name: str, experiment_names: set[str]) -> bool:
    """Whether `import name` in a test reaches a file under experiments/: a helper beside the tests shadows
    everything (pytest puts tests/ first); otherwise the module's origin on this interpreter's path, or, for
    a name that does not resolve here, the name of an experiment module."""
    import importlib.util

    top = name.split(".")[0]
    if (ROOT / "tests" / f"{top}.py").exists() or top == "conftest":
        return False
    if top == "experiments":
        return True
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return top in experiment_names
    origins = [spec.origin] if spec.origin else list(spec.submodule_search_locations or [])
    return any(Path(o).resolve().is_relative_to(EXPERIMENTS) for o in origins if o and o != "namespace")


def _assignments(tree) -> dict[str, list]:
    """name -> the expressions assigned to it anywhere in the file (module constants and locals alike)."""
    out: dict[str, list] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out.setdefault(target.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            out.setdefault(node.target.id, []).append(node.value)
    return out


def _mentions_experiments(expr, assigned: dict, depth: int = 4) -> bool:
    """Whether an expression (a path or a module name) leads into experiments/, following names through
    their assignments in the same file."""
    for node in ast.walk(expr):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "experiments" in node.value:
            return True
        if isinstance(node, ast.Name) and depth and node.id in assigned:
            if any(_mentions_experiments(v, assigned, depth - 1) for v in assigned[node.id]):
                return True
    return False


def experiment_imports(path: Path, experiment_names: set[str]) -> list[str]:
    """'file:line what' for each import of an experiment module in one test file: `import x` / `from x
    import` statements (at any depth, function-level included), importlib / runpy calls and sys.path edits
    whose argument leads into experiments/."""
    tree = ast.parse(path.read_text())
    assigned = _assignments(tree)
    found = []  # (line, what)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module] if node.module and not node.level else []
        elif isinstance(node, ast.Call):
            fn = node.func
            called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            edits_path = called in ("insert", "append") and "sys.path" in ast.unparse(fn)
            if (called in IMPORTERS or edits_path) and any(
                _mentions_experiments(a, assigned) for a in [*node.args, *(k.value for k in node.keywords)]
            ):
                found.append((node.lineno, ast.unparse(node)[:100]))
            continue
        else:
            continue
        bad = [n for n in names if _is_experiment_module(n, experiment_names)]
        if bad:
            found.append((node.lineno, f"imports {', '.join(bad)}"))
    return [f"{path.name}:{line} {what}" for line, what in sorted(found)]


def test_tests_import_no_experiment_module():
    """Experiments are scripts: a test runs one (a subprocess) or tests the library, never imports its
    modules (what a test needs from an experiment belongs in the library or beside the tests)."""
    import tomllib

    pythonpath = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    on_path = [p for p in pythonpath.get("pythonpath", []) if (ROOT / p).resolve().is_relative_to(EXPERIMENTS)]
    names = _experiment_module_names()
    offenders = [hit for path in sorted((ROOT / "tests").glob("*.py")) for hit in experiment_imports(path, names)]
    assert not offenders and not on_path, (
        f"tests import experiment modules: {offenders}; pytest's pythonpath puts experiment folders on the "
        f"import path: {on_path}"
    )


def test_the_experiment_import_check_finds_every_form(tmp_path):
    """The check above is not vacuous: each way of importing an experiment module is named."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import importlib.util, runpy, sys\n"
        "from pathlib import Path\n"
        "import json\n"
        "from jaxscale.infra import atomic\n"
        "import experiments.scaling.model\n"
        "SCRIPT = Path(__file__).parents[1] / 'experiments' / 'serving' / 'bench_trimmer.py'\n"
        "def test_x():\n"
        "    import house as H\n"
        "    spec = importlib.util.spec_from_file_location('bench_trimmer', SCRIPT)\n"
        "    runpy.run_path('experiments/two_tower/results.py')\n"
        "    sys.path.insert(0, str(Path('experiments') / 'bench'))\n"
    )
    hits = experiment_imports(probe, _experiment_module_names())
    assert [h.split()[0] for h in hits] == [f"test_probe.py:{n}" for n in (5, 8, 9, 10, 11)], hits


@pytest.mark.slow
def test_the_settings_walk_from_the_yaml_to_the_collective(tmp_path):
    """`experiments/architecture/walks.py` (docs/walks/): embedding.topology and embedding.replica_sync reach the
    collective from the YAML without climbing back and through one settings type (it exits 1 otherwise)."""
    script = ROOT / "experiments" / "architecture" / "walks.py"
    out = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for setting in ("topology", "replica_sync"):
        text = (tmp_path / f"{setting}.txt").read_text()
        assert "reaches a collective: yes" in text and "climbs back (a hand-off to a higher floor): none" in text
        assert "(one: EmbeddingSettings)" in text and "jax.lax" in text


def test_experiments_import_only_public_names():
    """Experiments are scripts over the installed package: no private name of it, no edit of the import path."""
    offenders = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        text = path.read_text()
        if "sys.path.insert" in text or "sys.path.append" in text:
            offenders.append(f"{path.relative_to(ROOT)}: edits sys.path")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxscale"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private or any(part.startswith("_") for part in node.module.split(".")):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import {private}")
    assert not offenders, offenders
