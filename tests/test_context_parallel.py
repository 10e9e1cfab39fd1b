"""Context-parallel (ring) attention on 8 forced host CPU devices, in a subprocess (the
device count is fixed when JAX starts): values and gradients against single-device
attention for every mask kind, with scale, softcap and grouped kv heads; bitwise
determinism; the 1-device mesh path equal to the plain kernel; a data x context mesh
that rotates K / V by collective-permute and gathers nothing; argument checks that name
the parameter at fault, and forward mode refused with an error naming the function."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from rlx_jax.parallel import zigzag_inverse, zigzag_permutation

CHECK = pathlib.Path(__file__).with_name("context_parallel_check.py")


def _run(*args, timeout=900, command=None):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    proc = subprocess.run([sys.executable, *(command or [str(CHECK)]), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, f"{CHECK.name if command is None else 'the inline check'} printed nothing:\n{proc.stderr[-3000:]}"
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


def test_zigzag_permutation_round_trips():
    perm = zigzag_permutation(16, 4)
    assert perm[:4].tolist() == [0, 1, 14, 15]  # shard 0 holds chunks 0 and 2n - 1
    assert (perm[zigzag_inverse(16, 4)] == np.arange(16)).all()
    assert zigzag_permutation(0, 4).shape == (0,)  # an empty sequence: the empty permutation
    assert zigzag_permutation(np.int64(16), np.int32(4)).tolist() == perm.tolist()


@pytest.mark.parametrize("seq_len, n, error, match", [
    (-4, 2, ValueError, "seq_len must be >= 0, got -4"),  # divisible by 2n = 4: only the sign check catches it
    (16, 0, ValueError, "n must be >= 1, got 0"),
    (16, -2, ValueError, "n must be >= 1, got -2"),
    (12, 4, ValueError, "seq_len 12 must be divisible by 2 \\* n = 8"),
    (16.0, 2, TypeError, "seq_len must be an int, got float"),
    (16, 2.0, TypeError, "n must be an int, got float"),
    (16, True, TypeError, "n must be an int, got bool"),
])
def test_zigzag_permutation_rejects_bad_sizes(seq_len, n, error, match):
    with pytest.raises(error, match="zigzag_permutation: " + match):
        zigzag_permutation(seq_len, n)


# Checks on 8 forced host devices of the arguments context_parallel_attention validates
# itself (shard_map's own errors name neither parameter), and of forward mode, which the
# ring's custom_vjp cannot serve. One JSON line per case: the error, or "ok" and a value.
_ARGUMENT_CHECKS = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from rlx_jax.parallel import context_parallel_attention as cpa
from rlx_jax.vjp_rules import attention as _attention
from rlx_jax.vjp_rules.attention import reference_attention

_attention.CPU_KERNEL_MIN_SCORE_BYTES = 0  # the kernels, as the other checks run them
jax.config.update("jax_default_matmul_precision", "highest")

def mesh(shape, names):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)

rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((2, 16, 4, 8)), jnp.float32)
k = jnp.asarray(rng.standard_normal((2, 16, 2, 8)), jnp.float32)  # Hkv = 2
dc, mc, dmc = mesh((2, 4), ("data", "cp")), mesh((4, 2), ("model", "cp")), mesh((2, 2, 2), ("data", "model", "cp"))
f = lambda q, k: cpa(q, k, k, mesh=dc, axis_name="cp", mask_kind="causal")
ref = lambda q, k: reference_attention(q, k, k, kind="causal", window=0, scale=8 ** -0.5, softcap=0.0,
                                       has_mask=False, has_bias=False)[0]
loss = lambda attn: (lambda q, k: jnp.sum(jnp.sin(attn(q, k))))
err = lambda a, b: max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

cases = {
    "batch_axis_is_sequence_axis": lambda: cpa(q, k, k, mesh=dc, axis_name="cp", batch_axis="cp"),
    "batch_axis_not_dividing_b": lambda: jax.jit(lambda q, k: cpa(
        q, k, k, mesh=mesh((4, 2), ("data", "cp")), axis_name="cp", batch_axis="data"))(q, k),
    "head_axis_not_dividing_hkv": lambda: jax.jit(lambda q, k: cpa(
        q, k, k, mesh=mc, axis_name="cp", head_axis="model"))(q, k),  # 4 divides H = 4, not Hkv = 2
    "head_axis_unknown": lambda: cpa(q, k, k, mesh=dc, axis_name="cp", head_axis="nope"),
    "batch_axis_unknown_in_tuple": lambda: cpa(q, k, k, mesh=dc, axis_name="cp", batch_axis=("data", "nope")),
    "axes_shared": lambda: cpa(q, k, k, mesh=dmc, axis_name="cp", batch_axis="data", head_axis=("model", "data")),
    "batch_and_head_split": lambda: err(jax.jit(lambda q, k: cpa(q, k, k, mesh=dmc, axis_name="cp", batch_axis="data",
                                                                 head_axis="model", mask_kind="causal"))(q, k),
                                        ref(q, k)),
    "jvp": lambda: jax.jvp(f, (q, k), (q, k)),
    "jit_of_jvp": lambda: jax.jit(lambda q, k: jax.jvp(f, (q, k), (q, k)))(q, k),
    "jacfwd": lambda: jax.jacfwd(lambda q: f(q, k)[0, :2])(q),
    # reverse mode keeps working, with respect to part of the inputs too
    "grad_q_only": lambda: err(jax.jit(jax.grad(loss(f)))(q, k), jax.grad(loss(ref))(q, k)),
    "grad": lambda: err(jax.grad(loss(f), (0, 1))(q, k), jax.grad(loss(ref), (0, 1))(q, k)),
}
for name, run in cases.items():
    try:
        value = run()
        row = {"case": name, "ok": value if isinstance(value, float) else True}
    except Exception as e:
        row = {"case": name, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(row), flush=True)
"""


@pytest.fixture(scope="module")
def argument_checks():
    return _run(command=["-c", _ARGUMENT_CHECKS], timeout=600)


@pytest.mark.parametrize("case, match", [
    ("batch_axis_is_sequence_axis", "ValueError: context_parallel_attention: batch_axis 'cp' is the sequence axis"),
    ("batch_axis_not_dividing_b",
     "ValueError: context_parallel_attention: batch_axis 'data' spans 4 devices, which must divide the batch B = 2"),
    ("head_axis_not_dividing_hkv",
     "ValueError: context_parallel_attention: head_axis 'model' spans 4 devices, which must divide the kv heads "
     "Hkv = 2"),
    ("head_axis_unknown", "ValueError: context_parallel_attention: head_axis 'nope' is not an axis of the mesh"),
    ("batch_axis_unknown_in_tuple",
     "ValueError: context_parallel_attention: batch_axis 'nope' is not an axis of the mesh"),
    ("axes_shared", "ValueError: context_parallel_attention: batch_axis and head_axis both name mesh axis 'data'"),
])
def test_bad_batch_and_head_axes_name_the_parameter(argument_checks, case, match):
    assert argument_checks[case].get("error", "").startswith(match), argument_checks[case]


def test_batch_and_head_axes_split_with_the_sequence(argument_checks):
    r = argument_checks["batch_and_head_split"]
    assert "error" not in r, r["error"]
    assert r["ok"] < 1e-5, r


@pytest.mark.parametrize("case", ["jvp", "jit_of_jvp", "jacfwd"])
def test_forward_mode_is_refused_by_name(argument_checks, case):
    # eagerly, JAX itself failed with "unhashable type: 'Unhashable'"; compiled, with a
    # message naming no function
    error = argument_checks[case].get("error", "")
    assert error.startswith("TypeError: context_parallel_attention: forward-mode differentiation"), error
    assert "only reverse mode" in error


@pytest.mark.parametrize("case", ["grad", "grad_q_only"])
def test_reverse_mode_unaffected_by_the_forward_mode_guard(argument_checks, case):
    r = argument_checks[case]
    assert "error" not in r, r["error"]
    assert r["ok"] < 1e-5, r
