"""Draws the house: every module of `jaxscale` and `jaxscale_models` as a room, imports as arrows, each room on
the floor above everything it imports (floor 1: imports nothing of the project).

    python experiments/architecture/house.py        # writes docs/house.png and docs/house.txt

Imports are read from the source (`ast`), function-level ones included: a lazy import is still a dependency.
The picture in docs/architecture.md is this script's output; regenerate it after moving modules.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jaxscale", "jaxscale_models")


def modules(root: Path = ROOT) -> dict[str, Path]:
    """{dotted module name: file} of the project's packages."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports (at any depth of its code), by their dotted names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` depends on the submodule; `from pkg import name` on pkg itself
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module for a in node.names
            ]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: project modules it imports}, package faces (`__init__` that only hands names on) included."""
    mods = modules(root)
    known = set(mods)
    return {m: imports(p, known) - {m} for m, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (import loops), Tarjan's algorithm."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def floors(g: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 1 + the highest floor it imports (1 when it imports nothing of the project)."""
    memo: dict[str, int] = {}

    def floor(m, seen=()):
        if m not in memo:
            below = [floor(d, (*seen, m)) for d in g[m] if d not in seen]
            memo[m] = 1 + max(below, default=0)
        return memo[m]

    return {m: floor(m) for m in g}


def describe(g: dict[str, set[str]]) -> str:
    fl = floors(g)
    lines = [f"{len(g)} modules; import loops: {cycles(g) or 'none'}"]
    for level in sorted(set(fl.values()), reverse=True):
        lines.append(f"floor {level}: " + ", ".join(sorted(m for m in fl if fl[m] == level)))
    return "\n".join(lines)


def draw(g: dict[str, set[str]], out: Path) -> None:
    """Rooms by floor (bottom = floor 1), grouped by package left to right; arrows from importer to imported."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fl = floors(g)
    rows: dict[int, list[str]] = defaultdict(list)
    for m in sorted(fl, key=lambda m: (m.rpartition(".")[0], m)):
        rows[fl[m]].append(m)
    width = max(len(r) for r in rows.values())
    pos = {m: ((i + 0.5) * width / len(r), level) for level, r in rows.items() for i, m in enumerate(r)}
    fig, ax = plt.subplots(figsize=(max(16, width * 1.9), len(rows) * 1.4 + 1))
    for m, deps in g.items():
        for d in deps:
            (x0, y0), (x1, y1) = pos[m], pos[d]
            ax.annotate("", (x1, y1 + 0.18), (x0, y0 - 0.18), arrowprops=dict(arrowstyle="->", color="#99a", lw=0.4))
    colours = {
        "jaxscale_models": "#fde2c8",
        "jaxscale.engine.embedding": "#d6e8fa",
        "jaxscale.engine.planner": "#e4f4d9",
    }
    for m, (x, y) in pos.items():
        package = next((p for p in colours if m == p or m.startswith(p + ".")), None)
        label = m.removeprefix("jaxscale.") if m != "jaxscale" else m
        ax.text(
            x,
            y,
            label,
            ha="center",
            va="center",
            fontsize=6.5,
            bbox=dict(boxstyle="round,pad=0.3", fc=colours.get(package, "#eeeeee"), ec="#555", lw=0.5),
        )
    ax.set_xlim(-0.5, width + 0.5)
    ax.set_ylim(0.4, max(rows) + 0.6)
    ax.set_yticks(sorted(rows), [f"floor {r}" for r in sorted(rows)])
    ax.set_xticks([])
    ax.set_title("jaxscale: modules as rooms, each above what it imports (arrows: imports)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "house.png"))
    args = p.parse_args(argv)
    g = graph()
    text = describe(g)
    draw(g, Path(args.out))
    Path(args.out).with_suffix(".txt").write_text(text + "\n")
    print(text)
    return 1 if cycles(g) else 0


if __name__ == "__main__":
    sys.exit(main())
