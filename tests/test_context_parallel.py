"""Context-parallel (ring) attention on 8 forced host CPU devices, in a subprocess (the
device count is fixed when JAX starts): values and gradients against single-device
attention for every mask kind, with scale, softcap and grouped kv heads; bitwise
determinism; the 1-device mesh path equal to the plain kernel; a data x context mesh
that rotates K / V by collective-permute and gathers nothing."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

CHECK = pathlib.Path(__file__).with_name("context_parallel_check.py")


def _run(*args, timeout=900):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, f"context_parallel_check printed nothing:\n{proc.stderr[-3000:]}"
    return {r["case"]: r for r in rows}


@pytest.fixture(scope="module")
def results():
    return _run("small")


@pytest.mark.parametrize("case", ["none_gqa", "causal_softcap_gqa", "sliding_partial", "sliding_wide_gqa"])
def test_matches_single_device_attention(results, case):
    r = results[case]
    assert "error" not in r, r.get("error")
    assert r["max_err"] < 1e-5, r
    assert r["deterministic"], "two runs gave different bits"


def test_one_device_mesh_is_the_plain_kernel(results):
    r = results["one_device"]
    assert "error" not in r, r.get("error")
    assert r["bitwise"], r


def test_data_by_context_mesh_rotates_and_gathers_nothing(results):
    r = results["sharded_zigzag"]
    assert "error" not in r, r.get("error")
    assert r["max_err"] < 1e-5, r
    assert r["kernels"] == ["rlx_attention_bwd_v1", "rlx_attention_fwd_v1"], r
    assert r["collectives"]["all-gather"] == 0, r
    assert r["collectives"]["all-to-all"] == 0, r
    assert r["collectives"]["collective-permute"] > 0, r


def test_bad_arguments_name_the_fault(results):
    indivisible, bad_axis = results["errors"]["messages"]
    assert indivisible and "divisible by 2 * 8" in indivisible
    assert bad_axis and "axis_name 'seq'" in bad_axis


@pytest.mark.slow
def test_long_sequence_32k_matches_single_device():
    r = _run("long", timeout=3600)["long"]
    assert "error" not in r, r.get("error")
    assert r["max_err"] < 1e-4, r
