"""The scripts in examples/ run to their end in quick mode (RLX_JAX_QUICK=1), each in a
fresh process as a user runs it; each asserts its own result (the Llama example: held-out
loss below the unigram baseline; the splatting example: PSNR above its target)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def launch(name: str, *args: str) -> subprocess.CompletedProcess:
    """examples/NAME run in quick mode on the CPU, in a fresh process."""
    env = dict(os.environ, RLX_JAX_QUICK="1", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def run_example(name: str, *args: str) -> str:
    proc = launch(name, *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _final(out: str) -> tuple[float, float]:
    """(the last printed training loss, the held-out loss) of train_llama.py's output."""
    train = [float(v) for v in re.findall(r"^step +\d+ +loss ([0-9.]+)", out, re.M)]
    heldout = re.search(r"^held-out loss ([0-9.]+) nats/char \(unigram baseline ([0-9.]+)\)", out, re.M)
    assert train and heldout, out
    assert float(heldout.group(1)) < float(heldout.group(2))
    return train[-1], float(heldout.group(1))


def test_train_llama_learns_and_lean_ops_train_alike():
    """Both op sets train below the unigram baseline, and to the same losses: the lean ops
    compute the same maths (their backward writes the norm outputs and the SwiGLU products
    again instead of keeping them)."""
    default, lean = _final(run_example("train_llama.py")), _final(run_example("train_llama.py", "--lean"))
    assert default == pytest.approx(lean, rel=1e-4), (default, lean)


def test_train_llama_bf16_compute():
    """bf16 compute from the f32 master weights (the GPU default), lean ops: still learns."""
    _final(run_example("train_llama.py", "--dtype", "bfloat16", "--lean"))


def test_train_llama_rejects_bad_steps():
    proc = launch("train_llama.py", "--steps", "0")
    assert proc.returncode != 0 and "--steps must be positive" in proc.stderr


def test_fit_gaussians_reaches_its_psnr():
    out = run_example("fit_gaussians.py")
    assert re.search(r"PSNR [0-9.]+ dB -> [0-9.]+ dB", out), out
