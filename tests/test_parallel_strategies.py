"""Sharding strategies on 8 forced host CPU devices (subprocesses: the device count is
fixed when JAX starts).

- A GPT step (RMSNorm, RoPE, causal GQA attention, SwiGLU, logits + cross-entropy), with
  rlx_jax.ops and in plain JAX, under DP, DP x TP, DP x SP, FSDP and CP: loss and
  gradients equal the single-device ones, and the compiled step has no more all-gathers
  than plain JAX's (none at all where plain JAX has none; under CP none of K / V, which
  the ring rotates by collective-permute).
- ``rlx-jax train --mesh``: the mesh parses (a size in anything but ASCII digits is an
  error naming the entry), the transformer's parameters split as the rules say, a step on
  data 2 x model 2 equals the single-device step, the CLI trains, and a mesh larger than
  the devices is a clear error.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from rlx_jax.parallel.mesh import mesh_size, parse_mesh

HERE = pathlib.Path(__file__).parent
STRATEGIES = ["dp", "dp_tp", "dp_sp", "fsdp", "cp"]


def _env(devices=8):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    return env


def _rows(proc, key):
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, f"{proc.args} printed nothing:\n{proc.stderr[-3000:]}"
    return {r[key]: r for r in rows}


@pytest.fixture(scope="module")
def strategies():
    proc = subprocess.run([sys.executable, str(HERE / "parallel_strategies_check.py")], capture_output=True,
                          text=True, env=_env(), timeout=1200)
    return _rows(proc, "strategy")


def test_the_two_single_device_steps_agree(strategies):
    # the plain-JAX step is an independent oracle for the rlx_jax.ops step
    assert strategies["single_device"]["rlx_vs_plain"] < 1e-4


@pytest.mark.parametrize("name", STRATEGIES)
def test_strategy_matches_single_device(strategies, name):
    for key in ("rlx", "plain"):
        r = strategies[name][key]
        assert "error" not in r, f"{key}: {r.get('error')}"
        assert r["max_err"] < 1e-4, (key, r["max_err"])
    kernels = strategies[name]["rlx"]["kernels"]
    for k in ("rlx_rms_norm_fwd_v2", "rlx_rope_fwd_v1", "rlx_attention_fwd_v1", "rlx_attention_bwd_v1"):
        assert k in kernels, f"{k} not in the compiled step: {kernels}"


# Under sequence parallelism the fused attention kernel cannot take a query block at an
# offset (its causal mask is aligned to the whole key axis), so with q's sequence split it
# gathers q and its lse as well as K and V, where plain JAX gathers K and V only: a known
# limit (docs/MULTI_DEVICE.md); for attention over a split sequence use
# rlx_jax.parallel.context_parallel_attention. strict: the day it passes, this must go.
_GATHER_LIMITS = {"dp_sp": pytest.mark.xfail(strict=True, reason="attention with q's sequence split gathers q")}


@pytest.mark.parametrize("name", [pytest.param(n, marks=_GATHER_LIMITS.get(n, ())) for n in STRATEGIES])
def test_strategy_gathers_no_more_than_plain_jax(strategies, name):
    rlx, plain = strategies[name]["rlx"], strategies[name]["plain"]
    assert "error" not in rlx and "error" not in plain
    assert rlx["collectives"]["all-gather"] <= plain["collectives"]["all-gather"], "\n".join(rlx["all_gathers"])
    if plain["collectives"]["all-gather"] == 0:
        assert rlx["all_gathers"] == [], "\n".join(rlx["all_gathers"])


def test_context_parallel_step_rings_instead_of_gathering(strategies):
    # plain JAX gathers K and V along the sequence (rank 4: [B, S, Hkv, D]); the ring moves
    # them by collective-permute instead. (Both steps gather the logits [B, S, V] and labels
    # [B, S] when flattening them into cross-entropy rows: with B and S split over two mesh
    # axes, a device's rows are not one contiguous block of B * S.)
    rlx, plain = strategies["cp"]["rlx"], strategies["cp"]["plain"]
    rank4 = lambda lines: [x for x in lines if re.search(r"= f32\[\d+,\d+,\d+,\d+\]", x)]
    assert rank4(plain["all_gathers"]), "the plain step should gather K / V: the check would prove nothing"
    assert rank4(rlx["all_gathers"]) == [], "\n".join(rlx["all_gathers"])
    assert rlx["collectives"]["all-gather"] < plain["collectives"]["all-gather"]
    assert rlx["collectives"]["collective-permute"] > 0


def test_fsdp_gathers_parameters_only(strategies):
    # FSDP's all-gathers are the parameters' (as in plain JAX), so there are some
    assert strategies["fsdp"]["rlx"]["collectives"]["all-gather"] > 0
    assert strategies["fsdp"]["plain"]["collectives"]["all-gather"] > 0


@pytest.fixture(scope="module")
def train_mesh():
    proc = subprocess.run([sys.executable, str(HERE / "parallel_train_check.py")], capture_output=True, text=True,
                          env=_env(4), timeout=900)
    return _rows(proc, "case")


def test_train_mesh_parses_and_splits_parameters(train_mesh):
    r = train_mesh["specs"]
    assert "error" not in r, r.get("error")
    assert r["mesh"] == {"data": 2, "model": 2}
    specs = r["specs"]
    for name in ("layer0.q.w", "layer0.k.w", "layer0.v.w", "layer0.gate.w", "layer0.up.w", "head.w"):
        assert specs[name] == [None, "model"], (name, specs[name])
    for name in ("layer0.o.w", "layer0.down.w", "embed"):
        assert specs[name] == ["model", None], (name, specs[name])
    assert specs["layer0.attn_norm.gamma"] == []
    # 3 heads do not split over 2 devices: attention weights stay whole, FFN still splits
    odd = r["odd_heads"]
    assert odd["layer0.q.w"] == [] and odd["layer0.o.w"] == [] and odd["layer0.gate.w"] == [None, "model"]


def test_train_mesh_step_matches_single_device(train_mesh):
    r = train_mesh["step"]
    assert "error" not in r, r.get("error")
    assert r["loss_err"] < 1e-5 and r["param_err"] < 1e-5, r
    assert r["q_shard_shape"] == r["q_shape"][:1] + [r["q_shape"][1] // 2], r


def test_train_mesh_errors_name_the_fault(train_mesh):
    msgs = train_mesh["errors"]["messages"]
    assert "needs 8 devices, but only 4" in msgs["too_big"]
    assert "unknown axis 'pipe'" in msgs["bad_axis"]
    assert "name=size" in msgs["bad_syntax"]


# str.isdigit accepts superscripts, which int() rejects ("invalid literal for int()"), and
# int() reads other scripts' digits: a size is ASCII digits only, and anything else is the
# spec's own error, naming the entry
@pytest.mark.parametrize("spec, entry", [
    pytest.param("data=\u00b2", "data=\u00b2", id="superscript-two"),
    pytest.param("data=2,model=\u0662", "model=\u0662", id="arabic-indic-two"),
    pytest.param("data=\u00b9\u2070", "data=\u00b9\u2070", id="superscript-ten"),
    pytest.param("data=-2", "data=-2", id="negative"),
    pytest.param("data=2.0", "data=2.0", id="float"),
    pytest.param("data=", "data=", id="empty"),
])
def test_mesh_sizes_are_ascii_digits(spec, entry):
    match = re.escape(f"each entry must be name=size (e.g. data=2), got {entry!r}")
    with pytest.raises(ValueError, match=match):
        mesh_size(spec)
    with pytest.raises(ValueError, match=match):
        parse_mesh(spec)


def test_mesh_size_counts_devices():
    assert mesh_size(" data = 2 , model = 3 ") == 6


def test_cli_train_with_mesh(tmp_path):
    args = [sys.executable, "-m", "rlx_jax", "train", "--mesh", "data=2,model=2", "--steps", "2", "--batch-size", "4",
            "--seq-len", "16", "--layers", "1", "--width", "32", "--heads", "2", "--no-progress", "--out", str(tmp_path)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = json.loads((tmp_path / "transformer_lm.json").read_text())
    assert log["mesh"] == "data=2,model=2" and log["steps_done"] == 2
    assert all(h["loss"] > 0 for h in log["history"])


def test_cli_mesh_larger_than_devices_is_an_error(tmp_path):
    args = [sys.executable, "-m", "rlx_jax", "train", "--devices", "2", "--mesh", "data=2,model=2", "--steps", "1",
            "--no-progress", "--out", str(tmp_path)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2
    assert "needs 4 devices, but only 2 cpu device(s)" in proc.stderr, proc.stderr[-2000:]
