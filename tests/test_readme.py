"""The README's API example runs as written, and its step donates the state (no copy of every table a step)."""

import jax
import numpy as np
from conftest import ROOT


def readme_api_example() -> str:
    text = (ROOT / "README.md").read_text()
    return text.split("## The API", 1)[1].split("```python", 1)[1].split("```", 1)[0]


def test_readme_api_example_runs_and_donates_its_state(capsys):
    ns: dict = {}
    exec(compile(readme_api_example(), "README.md:The API", "exec"), ns)
    losses = [float(line.split()[1]) for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert len(losses) == 3 and all(np.isfinite(losses))
    step, state, ids = ns["train_step"], ns["state"], ns["ids"]
    weights = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state["weights"]))
    donated = step.lower(state, ids).compile().memory_analysis()
    assert donated.alias_size_in_bytes >= weights, "the README's step must donate the state (donate_argnums=0)"
    copying = jax.jit(step.__wrapped__).lower(state, ids).compile().memory_analysis()
    assert copying.alias_size_in_bytes == 0  # the same step without donation aliases nothing: the check can fail
