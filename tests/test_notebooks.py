"""Each notebook runs top to bottom in quick mode; its cells assert their results."""

from __future__ import annotations

import os
import pathlib

import pytest
from testutil import load_script

nbformat = pytest.importorskip("nbformat", reason="notebook tests need nbformat (pip install 'rlx_jax[test]')")
nbclient = pytest.importorskip("nbclient", reason="notebook tests need nbclient (pip install 'rlx_jax[test]')")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_executes(name, monkeypatch):
    monkeypatch.setenv("RLX_JAX_QUICK", "1")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any(o.get("output_type") == "stream" for o in outputs)


def test_notebooks_match_their_generator(tmp_path):
    """The committed .ipynb files are what notebooks/make_notebooks.py writes."""
    module = load_script(NOTEBOOKS / "make_notebooks.py", "make_notebooks")
    for name, cells in module.NOTEBOOKS.items():
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        assert [c.source for c in nb.cells] == [src for _, src in cells], name
