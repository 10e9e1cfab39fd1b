"""jax.export of functions using rlx_jax ops: the FFI targets carry an ABI version in
their names and are declared stable, so a jitted train step (embedding gather, RMSNorm,
RoPE, attention, cross-entropy, their fused backward kernels) exports with a symbolic
batch dimension and no extra arguments, serializes, and runs after deserialization in a
fresh process with the results of the direct call; ops whose Python side reads the row
count (the fused head's blocks, the max pool's planes) export with it symbolic."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from rlx_jax import ops
from rlx_jax._kernels import ABI_VERSIONS, export_safety_checks, registered_targets, target
from rlx_jax.vjp_rules.attention import CUDA_KERNEL_DTYPES

pytest.importorskip("flatbuffers")  # jax.export's serialization format

V, S, D, H, HD = 19, 8, 16, 2, 8  # vocabulary, sequence, width, heads, head dim


def _loaded():
    info = rlx_jax.kernel_info()["cpu"]
    if not info["loaded"]:
        pytest.skip(f"compiled CPU kernels not loaded: {info['error']}")
    return info


def _params(seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return {
        "embed": 0.5 * jax.random.normal(k[0], (V, D)),
        "gamma": 1.0 + 0.1 * jax.random.normal(k[1], (D,)),
        "wqkv": jax.random.normal(k[2], (D, 3 * D)) / np.sqrt(D),
        "wout": jax.random.normal(k[3], (D, V)) / np.sqrt(D),
    }


def _rope_tables():
    inv = 1.0 / (10000.0 ** (np.arange(0, HD, 2) / HD))
    ang = np.arange(S)[:, None] * inv[None, :]
    return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def _loss(params, tokens, labels):
    """One causal attention block over token embeddings; mean next-token cross-entropy."""
    cos, sin = _rope_tables()
    b = tokens.shape[0]
    x = ops.gather(params["embed"], tokens, axis=0)  # [B, S, D]
    h = ops.rms_norm(x, params["gamma"])
    q, k, v = jnp.split(h @ params["wqkv"], 3, axis=-1)  # [B, S, H * HD] each
    q = ops.rope(q, cos, sin, head_dim=HD)
    k = ops.rope(k, cos, sin, head_dim=HD)
    heads = lambda t: t.reshape(b, S, H, HD)
    a = ops.attention(heads(q), heads(k), heads(v), mask_kind="causal").reshape(b, S, D)
    logits = ((x + a) @ params["wout"]).reshape(b * S, V)
    return jnp.mean(ops.softmax_cross_entropy(logits, labels.reshape(b * S)))


def train_step(params, tokens, labels):
    loss, grads = jax.value_and_grad(_loss)(params, tokens, labels)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _batch(b, seed):
    r = np.random.default_rng(seed)
    return jnp.asarray(r.integers(0, V, (b, S)), jnp.int32), jnp.asarray(r.integers(0, V, (b, S)), jnp.int32)


@pytest.fixture(scope="module")
def exported_step():
    """(params, the train step exported with a symbolic batch dimension "b")."""
    _loaded()
    params = _params()
    (bdim,) = jax.export.symbolic_shape("b")
    specs = (
        jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params),
        jax.ShapeDtypeStruct((bdim, S), jnp.int32),
        jax.ShapeDtypeStruct((bdim, S), jnp.int32),
    )
    return params, jax.export.export(jax.jit(train_step))(*specs)


def test_targets_are_versioned_and_declared_stable():
    info = _loaded()
    assert info["targets"] and info["export_stable"]
    assert all(re.fullmatch(r"rlx_[a-z0-9_]+_v[0-9]+", t) for t in info["targets"]), info["targets"]
    assert target("rlx_rms_norm_fwd") == "rlx_rms_norm_fwd_v2"  # its eps became an f64 attribute
    assert target("rlx_rms_norm_fwd_v1") == "rlx_rms_norm_fwd_v1"
    assert set(info["targets"]) <= set(registered_targets())


def test_bumping_one_kernel_version_leaves_the_others(monkeypatch):
    monkeypatch.setitem(ABI_VERSIONS, "rlx_rope_fwd", 2)
    assert target("rlx_rope_fwd") == "rlx_rope_fwd_v2"
    assert target("rlx_rope_bwd") == "rlx_rope_bwd_v1"


def test_export_round_trip_in_a_fresh_process(exported_step, tmp_path):
    params, exported = exported_step
    text = exported.mlir_module()
    kernels = ["rlx_rms_norm_fwd", "rlx_rms_norm_bwd", "rlx_rope_fwd", "rlx_rope_bwd", "rlx_attention_fwd",
               "rlx_attention_bwd", "rlx_softmax_ce_fwd", "rlx_softmax_ce_bwd", "rlx_gather_bwd"]
    if jax.default_backend() == "gpu" and jnp.float32 not in CUDA_KERNEL_DTYPES:
        kernels = [k for k in kernels if not k.startswith("rlx_attention")]  # f32 attention: XLA's, by design
    for kernel in kernels:
        assert f"custom_call @{target(kernel)}(" in text, f"{kernel} is not called by the exported step (silent fallback)"
    assert str(exported.in_avals[-1].shape[0]) == "b"  # the batch dimension stayed symbolic

    blob = tmp_path / "step.bin"
    blob.write_bytes(exported.serialize())
    np.savez(tmp_path / "params.npz", **{k: np.asarray(v) for k, v in params.items()})
    batches = {b: _batch(b, seed=b) for b in (1, 5)}
    np.savez(tmp_path / "batches.npz", **{f"{n}_{b}": np.asarray(a) for b, ab in batches.items()
                                          for n, a in zip(("tokens", "labels"), ab)})
    code = textwrap.dedent(f"""
        import jax, numpy as np
        import rlx_jax.ops  # registers the FFI targets the deserialized module calls
        d = pathlib.Path({str(tmp_path)!r})
        exp = jax.export.deserialize(bytearray((d / "step.bin").read_bytes()))
        params = dict(np.load(d / "params.npz"))
        bt = np.load(d / "batches.npz")
        out = {{}}
        for b in (1, 5):
            loss, new = exp.call(params, bt[f"tokens_{{b}}"], bt[f"labels_{{b}}"])
            out[f"loss_{{b}}"] = np.asarray(loss)
            out.update({{f"{{k}}_{{b}}": np.asarray(v) for k, v in new.items()}})
        np.savez(d / "out.npz", **out)
    """)
    proc = subprocess.run([sys.executable, "-c", "import pathlib\n" + code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)  # not the repository root: the installed package must load
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = np.load(tmp_path / "out.npz")
    step = jax.jit(train_step)
    for b, (tokens, labels) in batches.items():
        loss, new = step(params, tokens, labels)
        np.testing.assert_allclose(got[f"loss_{b}"], loss, rtol=1e-5, atol=1e-6)
        for k, v in new.items():
            np.testing.assert_allclose(got[f"{k}_{b}"], v, rtol=1e-5, atol=1e-6)
        assert not np.allclose(got[f"wqkv_{b}"], params["wqkv"])  # the step did update


def test_export_matches_pure_jax_reference_gradients(exported_step):
    params, exported = exported_step
    tokens, labels = _batch(4, seed=7)
    loss, new = exported.call(params, tokens, labels)
    with rlx_jax.fused_ops(False):  # the pure-JAX references, differentiated by XLA
        ref_loss, ref_new = jax.jit(train_step)(params, tokens, labels)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(new[k], ref_new[k], rtol=1e-4, atol=1e-5)


def test_public_helper_allows_export_without_the_stable_registry(monkeypatch):
    """``rlx_jax.export_safety_checks()``: the public-API path (DisabledSafetyCheck)."""
    _loaded()
    from jax._src.export import _export

    stable = _export._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE
    monkeypatch.setattr(_export, "_CUSTOM_CALL_TARGETS_GUARANTEED_STABLE",
                        {t for t in stable if not t.startswith("rlx_")})
    f = jax.jit(lambda x, g: ops.rms_norm(x, g))
    args = (jnp.ones((3, 8)), jnp.ones((8,)))
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees"):
        jax.export.export(f)(*args)
    exported = jax.export.export(f, disabled_checks=rlx_jax.export_safety_checks())(*args)
    np.testing.assert_allclose(exported.call(*args), f(*args), rtol=1e-6)


# ---- ops whose row count is symbolic ---------------------------------------------------

#: name -> (loss of the differentiable args, their shapes with symbolic "b" (, "s", "t"), concrete
#: shapes, dtype): ops whose Python side reads a row count (the fused head's row blocks, the
#: max pool's planes, the CUDA kernels' scratch sizes), exported with it symbolic, then
#: called at sizes the blocks do not divide
SYMBOLIC_ROWS = {
    "fused_linear_cross_entropy": (
        lambda h, w: jnp.sum(jnp.sin(ops.fused_linear_cross_entropy(h, w, jnp.arange(h.shape[0]) % 11 - 1))),
        (("b", 8), (8, 11)), ((9, 8), (8, 11)), jnp.float32),
    "fused_linear_cross_entropy_mean": (
        lambda h, w: ops.fused_linear_cross_entropy(h, w, jnp.arange(h.shape[0]) % 11, reduction="mean",
                                                    chunk_size=4),
        (("b", 8), (8, 11)), ((9, 8), (8, 11)), jnp.float32),
    "max_pool2d": (lambda x: jnp.sum(jnp.sin(ops.max_pool2d(x, kernel_size=(2, 2), stride=(2, 2)))),
                   (("b", 2, 4, 4),), ((3, 2, 4, 4),), jnp.float32),
    "layer_norm": (lambda x, g: jnp.sum(jnp.sin(ops.layer_norm(x, g, g))), (("b", 5, 8), (8,)), ((3, 5, 8), (8,)),
                   jnp.float32),
    "batch_norm_inference": (
        lambda x, g: jnp.sum(jnp.sin(ops.batch_norm_inference(x, g, g, g, 1 + g * g))),
        (("b", 3, 2, 2), (3,)), ((5, 3, 2, 2), (3,)), jnp.float32),
    "cumsum": (lambda x: jnp.sum(jnp.sin(ops.cumsum(x, axis=1))), (("b", 6, 3),), ((5, 6, 3),), jnp.float32),
    # query and key lengths two independent symbols: the causal mask's bottom-right offset
    # max(Sk - Sq, 0) is computed in the program
    "attention_causal_cross_lengths": (
        lambda q, k: jnp.sum(jnp.sin(ops.attention(q, k, k, mask_kind="causal"))),
        (("b", "s", 4, 8), ("b", "t", 2, 8)), ((2, 5, 4, 8), (2, 7, 2, 8)), jnp.float32),
    "attention_bf16": (
        lambda q, k: jnp.sum(jnp.sin(ops.attention(q, k, k, mask_kind="causal").astype(jnp.float32))),
        (("b", 16, 4, 64), ("b", 16, 2, 64)), ((3, 16, 4, 64), (3, 16, 2, 64)), jnp.bfloat16),
}


@pytest.mark.parametrize("name", sorted(SYMBOLIC_ROWS))
def test_export_with_a_symbolic_row_count(name):
    _loaded()
    fn, sym, real, dtype = SYMBOLIC_ROWS[name]
    symbols = dict(zip("bst", jax.export.symbolic_shape("b, s, t")))
    specs = [jax.ShapeDtypeStruct(tuple(symbols.get(d, d) for d in shape), dtype) for shape in sym]
    r = np.random.default_rng(3)
    args = [jnp.asarray(r.standard_normal(shape), dtype) for shape in real]
    f = jax.value_and_grad(fn, tuple(range(len(args))))
    exported = jax.export.deserialize(jax.export.export(jax.jit(f))(*specs).serialize())
    got, want = exported.call(*args), jax.jit(f)(*args)
    with rlx_jax.fused_ops(False):
        ref = jax.jit(f)(*args)
    # against the static-shape call: the same kernels, or (where a symbolic dim cannot size
    # a CUDA kernel's scratch, or picks our attention forward over cuDNN's) the reference
    near = 1e-5 if dtype == jnp.float32 else 3e-2
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    for a, b, c in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(ref)):
        a, b, c = (np.asarray(t, np.float64) for t in (a, b, c))
        np.testing.assert_allclose(a, b, rtol=near, atol=near)
        np.testing.assert_allclose(a, c, rtol=tol, atol=tol)
