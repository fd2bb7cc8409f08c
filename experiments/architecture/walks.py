"""Walks one embedding setting from the YAML to the collective, as the code runs, and checks its way.

    python experiments/architecture/walks.py            # writes docs/walks/topology.txt, docs/walks/replica_sync.txt
    python experiments/architecture/walks.py --out DIR  # elsewhere

A run of the smoke DLRM on 8 simulated CPU devices (2 nodes x 4), from a YAML file that sets
`embedding.topology: 2d_a2a` and `embedding.replica_sync: {mode: periodic, strategy: sparse, every: 2}`:
`load_config`, the planning stage (`jaxscale.training.run.plan_run`), the `Trainer`, and the first step traced and
compiled (that is where the collectives are called). A profiler hook records every call of a project
function (and every `jax.lax` collective) that receives the setting, in one of its forms, as an argument:
the YAML mapping, the `EmbeddingSettings` (or the `Config` whose `embedding` section it is), the value itself
(the topology's name, the `ReplicaSync`), the `Topology` derived from it (`jaxscale.engine.mesh.TOPOLOGY_AXES`), a
`ShardingPlan` made for it, or, at the collective, the mesh axes it chose. Each hand-off is printed once, in
the order of the run, with the floor of the caller's and the callee's module in the house
(`experiments/architecture/house.py`: a module stands above everything it imports).

It checks two things and exits 1 when either fails:
- the way never climbs back: no hand-off goes from a module to one on a higher floor (a callback into a
  module that imports the caller, where the setting would travel against the imports);
- one settings type: the only settings object that carries the setting is `EmbeddingSettings` (alone or as
  the `Config`'s `embedding` section): no second vocabulary (a dict, another config class, a re-spelled
  string) translates it on the way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import house

ROOT = house.ROOT
COLLECTIVES = {"all_to_all", "psum", "pmean", "all_gather", "psum_scatter", "ppermute", "ragged_all_to_all"}
YAML = """\
mesh: {nodes: 2, local: 4}
model:
  kind: dlrm
  dlrm: {num_sparse_features: 4, rows: 1000, emb_dim: 8, ids_per_feature: 2, bottom_mlp: [16, 8], top_mlp: [16]}
embedding:
  topology: 2d_a2a
  sharding: row_wise
  replica_sync: {mode: periodic, strategy: sparse, every: 2}
data: {source: synthetic, eval_batches: 0}
train: {steps: 1, batch_size: 64, eval_every: 0}
"""
TOPOLOGY = "2d_a2a"


SETTINGS_FORMS = ("EmbeddingSettings", "Config (its embedding: EmbeddingSettings)")
"""The forms that are the one settings type; every other carrier is the value itself, data derived from it or
the YAML text, unless it is an object of another type with the setting as a field (a second vocabulary)."""


def forms(setting: str):
    """value -> the name of the form in which it carries `setting`, or None."""
    from jaxscale.engine.embedding.settings import EmbeddingSettings, ReplicaSync
    from jaxscale.engine.mesh import TOPOLOGY_AXES, Topology
    from jaxscale.engine.plan import ShardingPlan
    from jaxscale.training.config import Config

    sync = ReplicaSync("periodic", "sparse", 2)
    value = TOPOLOGY if setting == "topology" else sync
    shard_axes, replica_axes = TOPOLOGY_AXES[TOPOLOGY]
    axes = tuple(shard_axes if setting == "topology" else replica_axes)

    def same(x) -> bool:
        return x == value or (isinstance(x, Mapping) and setting == "replica_sync" and dict(x) == YAML_SYNC)

    def form(x):
        if isinstance(x, Config):
            return SETTINGS_FORMS[1] if same(getattr(x.embedding, setting)) else None
        if isinstance(x, EmbeddingSettings):
            return SETTINGS_FORMS[0] if same(getattr(x, setting)) else None
        if isinstance(x, Topology):
            return "Topology (derived: TOPOLOGY_AXES)" if setting == "topology" and x.name == TOPOLOGY else None
        if isinstance(x, ShardingPlan):
            return "ShardingPlan (the plan made for it)" if setting == "topology" and x.topology == TOPOLOGY else None
        if isinstance(x, ReplicaSync) or isinstance(x, str):
            return f"the value ({type(x).__name__})" if same(x) else None
        if isinstance(x, tuple):
            return f"mesh axes {x}" if x and x == axes else None
        if isinstance(x, Mapping):
            try:
                inner = x.get(setting)
            except TypeError:
                return None
            return "YAML mapping" if isinstance(x, dict) and same(inner) else None
        fields = {f.name for f in dataclasses.fields(x)} if dataclasses.is_dataclass(x) else ()
        if setting in fields and same(getattr(x, setting)):  # a config-like value of another type
            return f"ANOTHER SETTINGS TYPE: {type(x).__module__}.{type(x).__qualname__}"
        return None

    return form


YAML_SYNC = {"mode": "periodic", "strategy": "sparse", "every": 2}


class Walker:
    """A `sys.setprofile` hook: every call that receives the setting, as (caller, callee, form)."""

    def __init__(self, setting: str):
        self.form = forms(setting)
        self.modules = {str(p.resolve()): m for m, p in house.modules().items()}
        self.floor = house.floors(house.graph())
        self.steps: list[tuple] = []
        self._seen: set = set()

    def module(self, frame) -> str | None:
        return self.modules.get(frame.f_code.co_filename)

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        callee = self.module(frame)
        collective = callee is None and code.co_name in COLLECTIVES and "lax" in code.co_filename
        if callee is None and not collective:
            return
        found = self._carried(frame, code)
        if found is None:
            return
        caller = frame.f_back
        while caller is not None and self.module(caller) is None:
            caller = caller.f_back
        where = (self.module(caller), caller.f_code.co_qualname) if caller is not None else ("(the script)", "main")
        there = (callee or f"jax.lax ({code.co_name})", code.co_qualname)
        key = (where, there, found)
        if key not in self._seen:
            self._seen.add(key)
            self.steps.append(key)

    def _carried(self, frame, code):
        n = code.co_argcount + code.co_kwonlyargcount
        names = list(code.co_varnames[:n])
        varargs = code.co_varnames[n] if code.co_flags & 0x04 else None  # *args: each of its values
        local = frame.f_locals
        for name in [*names, varargs] if varargs else names:
            x = local.get(name)
            values = x if name == varargs else (x,)
            for v in values:
                try:
                    f = self.form(v)
                except Exception:  # an object whose comparison is not defined here (a tracer, ...)
                    f = None
                if f is not None:
                    return f"{name}: {f}"
        return None

    def report(self, setting: str) -> tuple[str, bool]:
        lines = [f"# The way of embedding.{setting} from the YAML to the collective (as the code runs)", ""]
        lines.append("step  caller (floor) -> callee (floor)  [argument: the form it travels in]")
        climbs, kinds = [], set()
        for i, ((cm, cf), (tm, tf), found) in enumerate(self.steps, 1):
            up = self.floor.get(tm, 0) > self.floor.get(cm, 0) if tm in self.floor and cm in self.floor else False
            if up:
                climbs.append(i)
            kinds.add(found.split(": ", 1)[1])
            fl = lambda m: f"{self.floor[m]}" if m in self.floor else "-"  # noqa: E731
            mark = "  CLIMBS BACK" if up else ""
            lines.append(f"{i:4d}  {cm}.{cf} ({fl(cm)}) -> {tm}.{tf} ({fl(tm)})  [{found}]{mark}")
        settings_types = sorted(k for k in kinds if k in SETTINGS_FORMS or k.startswith("ANOTHER"))
        reached = any(tm.startswith("jax.lax") for _, (tm, _), _ in self.steps)
        one_type = all(k in SETTINGS_FORMS for k in settings_types)
        ok = not climbs and one_type and reached
        lines += [
            "",
            f"hand-offs: {len(self.steps)}; reaches a collective: {'yes' if reached else 'NO'}",
            f"climbs back (a hand-off to a higher floor): {climbs or 'none'}",
            "forms: " + "; ".join(sorted(kinds)),
            f"settings types that carry it: {', '.join(settings_types)}"
            + (" (one: EmbeddingSettings)" if one_type else "  MORE THAN ONE"),
        ]
        return "\n".join(lines) + "\n", ok


def run_once() -> None:
    """YAML -> config -> planning stage -> Trainer -> the first step traced and compiled."""
    from jaxscale.training.config import load_config
    from jaxscale.training.run import plan_run
    from jaxscale.training.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="walks_") as tmp:
        path = Path(tmp) / "walk.yaml"
        path.write_text(YAML)
        cfg = load_config(str(path))
        cfg, plan = plan_run(cfg, log=None)
        trainer = Trainer(cfg, plan=plan, workdir=str(Path(tmp) / "run"), progress=False)
        state = trainer.init_state()
        trainer.compile(state, trainer.batch(0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "walks"))
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    out, failed = Path(args.out), False
    out.mkdir(parents=True, exist_ok=True)
    for setting in ("topology", "replica_sync"):
        walker = Walker(setting)
        sys.setprofile(walker)
        try:
            run_once()
        finally:
            sys.setprofile(None)
        text, ok = walker.report(setting)
        (out / f"{setting}.txt").write_text(text)
        print(text)
        failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
