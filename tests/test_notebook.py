"""The tour notebook runs top to bottom, and its .py (jupytext percent) and .ipynb are in sync."""

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")
pytest.importorskip("ipykernel")

NB_DIR = Path(__file__).resolve().parents[1] / "experiments" / "notebooks"
PY, IPYNB = NB_DIR / "jaxscale_tour.py", NB_DIR / "jaxscale_tour.ipynb"


def _sources(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_py_and_ipynb_in_sync():
    from_py = jupytext.read(PY)
    from_ipynb = nbformat.read(IPYNB, as_version=4)
    assert len(from_ipynb.cells) >= 8
    assert _sources(from_py) == _sources(from_ipynb), (
        "experiments/notebooks/jaxscale_tour.py and .ipynb differ; regenerate with "
        "`jupytext --to ipynb experiments/notebooks/jaxscale_tour.py`"
    )


def _kernel_env():
    """A kernelspec named python3 that runs this interpreter (the venv), in a private directory."""
    import tempfile

    from ipykernel.kernelspec import install

    prefix = tempfile.mkdtemp(prefix="jaxscale_kernel_")
    install(kernel_name="python3", prefix=prefix)
    return prefix


@pytest.mark.slow
def test_notebook_executes(monkeypatch, tmp_path):
    prefix = _kernel_env()
    monkeypatch.setenv("JUPYTER_PATH", os.path.join(prefix, "share", "jupyter"))
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # the notebook sets its own device count
    nb = nbformat.read(IPYNB, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(NB_DIR)}}
    )
    client.execute()  # raises CellExecutionError when any cell fails
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "a code cell did not run"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    text = "\n".join(o.get("text", "") for c in code for o in c.get("outputs", []) if o.get("output_type") == "stream")
    assert "8 devices" in text
    assert "max/mean: lookups" in text  # the planner report
    assert "collectives, intra-node" in text  # the comm_inspect table
    assert "loss per step:" in text
    images = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the loss / bytes plot was not displayed inline"
    assert "recorded by: python -m jaxscale.bench" in text  # the stage bytes come from the suite's JSON
