"""Draws the house: every module of `jaxscale` and `jaxscale_models` as a room, imports as arrows, each room on
the floor above everything it imports (floor 1: imports nothing of the project), the rooms grouped in their
wings, one band per wing, the wings stacked in their order (`WINGS`, bottom first).

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
WINGS = {  # wing -> its package, bottom to top: a wing imports only wings below it
    "infra": "jaxscale.infra",
    "engine": "jaxscale.engine",
    "sequences": "jaxscale.sequences",
    "training": "jaxscale.training",
    "serving": "jaxscale.serving",
    "models": "jaxscale_models",
    "studies": "jaxscale.studies",
    "benchmarks": "jaxscale.benchmarks",
    "commands": "jaxscale",  # the thin faces of `python -m jaxscale.train|evaluate|bench|comm_report`
}


def wing(module: str) -> str:
    """The wing a module stands in; the package face `jaxscale` (it hands on engine names) in the engine."""
    if module == "jaxscale":
        return "engine"
    return next(w for w, p in WINGS.items() if module == p or module.startswith(p + "."))


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


def climbs(g: dict[str, set[str]]) -> list[str]:
    """Imports from a wing to a higher one ('importer -> imported')."""
    order = list(WINGS)
    return sorted(f"{m} -> {d}" for m in g for d in g[m] if order.index(wing(d)) > order.index(wing(m)))


def wing_floors(g: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor inside its wing (1 + the highest it imports from its own wing)."""
    return floors({m: {d for d in deps if wing(d) == wing(m)} for m, deps in g.items()})


def describe(g: dict[str, set[str]]) -> str:
    fl = wing_floors(g)
    lines = [
        f"{len(g)} modules; import loops: {cycles(g) or 'none'}",
        f"wings, bottom to top: {', '.join(WINGS)}; imports that climb to a higher wing: {climbs(g) or 'none'}",
    ]
    for w in reversed(WINGS):
        rooms = [m for m in fl if wing(m) == w]
        for level in sorted({fl[m] for m in rooms}, reverse=True):
            lines.append(f"{w} floor {level}: " + ", ".join(sorted(m for m in rooms if fl[m] == level)))
    return "\n".join(lines)


def draw(g: dict[str, set[str]], out: Path) -> None:
    """Wings as bands (bottom = the first of `WINGS`), the rooms of a wing on its own floors; arrows from importer
    to imported, red where one climbs to a higher wing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fl, order = wing_floors(g), list(WINGS)
    base, y = {}, 0
    for w in order:  # each wing's band starts above the one below it
        base[w] = y
        y += max((fl[m] for m in fl if wing(m) == w), default=0) + 0.6
    rows: dict[float, list[str]] = defaultdict(list)
    for m in sorted(fl):
        rows[base[wing(m)] + fl[m]].append(m)
    width = max(len(r) for r in rows.values())
    pos = {m: ((i + 0.5) * width / len(r), level) for level, r in rows.items() for i, m in enumerate(r)}
    fig, ax = plt.subplots(figsize=(max(16, width * 1.9), y * 1.1 + 1))
    palette = ["#eeeeee", "#d6e8fa", "#e4f4d9", "#fdf3c8", "#f6dcec", "#fde2c8", "#e2dcf6", "#d9f2f0", "#ffffff"]
    for i, w in enumerate(order):
        top = (base[order[i + 1]] if i + 1 < len(order) else y) + 0.4
        ax.axhspan(base[w] + 0.4, top, color=palette[i], alpha=0.5, lw=0)
        ax.text(-0.4, base[w] + 0.55, w, fontsize=11, weight="bold", va="bottom")
    for m, deps in g.items():
        for d in deps:
            (x0, y0), (x1, y1) = pos[m], pos[d]
            up = order.index(wing(d)) > order.index(wing(m))
            style = dict(arrowstyle="->", color="#d22" if up else "#99a", lw=1.2 if up else 0.4)
            ax.annotate("", (x1, y1 + 0.18), (x0, y0 - 0.18), arrowprops=style)
    for m, (x, yy) in pos.items():
        label = "__init__" if m == WINGS[wing(m)] else m.removeprefix(WINGS[wing(m)] + ".")
        label = "jaxscale (package face)" if m == "jaxscale" else label
        ax.text(x, yy, label, ha="center", va="center", fontsize=6.5,
                bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="#555", lw=0.5))  # fmt: skip
    ax.set_xlim(-0.5, width + 0.5)
    ax.set_ylim(0.4, y + 0.4)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title("jaxscale: its wings bottom to top, modules as rooms above what they import (arrows: imports)")
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
    return 1 if cycles(g) or climbs(g) else 0


if __name__ == "__main__":
    sys.exit(main())
