"""The scripts in examples/ run to their end in quick mode (RLX_JAX_QUICK=1), each in a
fresh process as a user runs it; each asserts its own result (the Llama example: held-out
loss below the unigram baseline; the splatting example: PSNR above its target), and their
command lines handle edge cases (one training step, --help, bad arguments)."""

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


def test_train_llama_runs_a_single_step():
    """--steps 1 trains and evaluates (the schedule's decay used to get zero steps and optax
    refused it); one step cannot beat the unigram baseline, which the script reports in one line."""
    proc = launch("train_llama.py", "--steps", "1")
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert re.search(r"^step +0 +loss [0-9.]+", proc.stdout, re.M), proc.stdout
    assert re.search(r"^held-out loss [0-9.]+ nats/char", proc.stdout, re.M), proc.stdout
    assert proc.returncode == 1 and "did not fall below the unigram baseline" in proc.stderr


def test_fit_gaussians_cli():
    """--help prints the usage without fitting; bad arguments exit with status 2 before any step;
    --steps, --log-every and --psnr-target take effect."""
    proc = launch("fit_gaussians.py", "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stdout + proc.stderr
    assert "--steps" in proc.stdout and "fitting" not in proc.stdout and not re.search(r"^step ", proc.stdout, re.M)
    for args in (("--steps", "0"), ("--steps", "x"), ("--seed", "-1"), ("--log-every", "-1"), ("--bogus",)):
        proc = launch("fit_gaussians.py", *args)
        assert proc.returncode == 2 and "usage:" in proc.stderr and "fitting" not in proc.stdout, (args, proc.stderr)
    out = run_example("fit_gaussians.py", "--steps", "2", "--log-every", "1", "--psnr-target", "0")
    assert "2 steps" in out and len(re.findall(r"^step +\d+ +mse", out, re.M)) == 2, out


def test_fit_gaussians_reaches_its_psnr():
    out = run_example("fit_gaussians.py")
    assert re.search(r"PSNR [0-9.]+ dB -> [0-9.]+ dB", out), out
