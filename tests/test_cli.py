"""The ``rlx-jax`` command line: ``--version``; ``train`` without the ``[train]`` extra
(one line naming the extra, non-zero exit, no traceback); a run without tqdm and
matplotlib (no bar, no PNG, a one-line note each, then its summary).

Missing packages are simulated in a subprocess by a ``sys.meta_path`` finder that
refuses to import them, so the tests run where the packages are installed."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

import rlx_jax


def _run_cli(args, blocked=(), cwd=None, timeout=300):
    """Runs ``rlx_jax.__main__.main(args)`` in a fresh interpreter where importing any
    module in ``blocked`` (or a submodule of one) raises ImportError."""
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        BLOCKED = {tuple(blocked)!r}
        for name in list(sys.modules):
            if name.split(".")[0] in BLOCKED:
                del sys.modules[name]

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"No module named {{name!r}}")
                return None

        sys.meta_path.insert(0, Block())
        from rlx_jax.__main__ import main
        sys.exit(main({list(args)!r}))
    """)
    # cwd defaults to tests/: from the repository root `python -c` would import the source
    # tree instead of the installed package (whose compiled kernels the source tree lacks).
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=cwd or pathlib.Path(__file__).parent, timeout=timeout)


def test_version_prints_rlx_and_jax_versions():
    proc = subprocess.run([sys.executable, "-m", "rlx_jax", "--version"], capture_output=True, text=True, timeout=120,
                          cwd=pathlib.Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"rlx-jax {rlx_jax.__version__} (jax {metadata.version('jax')})"


@pytest.mark.parametrize("model,blocked,named", [
    ("transformer", ("optax",), "optax"),
    ("mlp", ("sklearn",), "scikit-learn"),
    ("cnn", ("optax", "sklearn"), "optax, scikit-learn"),
])
def test_train_without_the_extra_says_which_extra_and_exits_nonzero(model, blocked, named, tmp_path):
    proc = _run_cli(["train", "--model", model, "--steps", "1", "--out", str(tmp_path)], blocked=blocked)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"needs {named}" in lines[0] and "pip install 'rlx_jax[train]'" in lines[0]
    assert not list(tmp_path.iterdir()), "nothing may be written before the check"


def test_train_without_tqdm_and_matplotlib_runs_to_its_summary(tmp_path):
    proc = _run_cli(["train", "--model", "mlp", "--steps", "2", "--batch-size", "8", "--out", str(tmp_path)],
                    blocked=("tqdm", "matplotlib"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    assert "tqdm is not installed, so no progress bar" in proc.stdout
    assert "no loss-curve PNG: matplotlib is not installed" in proc.stdout
    assert "test accuracy" in proc.stdout  # the summary
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["mlp.json"], files
    log = json.loads((tmp_path / "mlp.json").read_text())
    assert len(log["history"]) == 2


def test_interrupted_run_says_which_step_its_summary_is_from(tmp_path, monkeypatch, capsys):
    """A run stopped by Ctrl-C prints the step its summary's evaluation ran at (an earlier
    one than the interrupt), and exits 130."""
    import rlx_jax.train.tasks as tasks
    from rlx_jax.__main__ import main

    def interrupted(cfg, model):
        return {"model": model, "interrupted": True, "history": [{"step": i, "loss": 1.0} for i in range(57)],
                "evals": [{"step": 50, "test_accuracy": 0.5, "test_loss": 1.2}]}

    monkeypatch.setattr(tasks, "train_classifier", interrupted)
    code = main(["train", "--model", "mlp", "--steps", "80", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 130
    assert "interrupted after 57 of 80 steps: the last evaluation, at step 50" in out
    assert "test accuracy 50.00%" in out
