"""Determinism: every fused CPU kernel gives bitwise-identical forward values and
gradients (parameter-gradient reductions included) on repeated runs with the same
inputs, across fresh compilations, and in a fresh process.

The shapes are large enough that the kernels split rows and parameter reductions
across XLA's intra-op thread pool, which is where a racy or claim-order-dependent
reduction would show. ``CASES`` covers every forward/backward target registered on
the CPU (``test_cases_cover_every_target`` fails when a new kernel is not listed).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from rlx_jax import ops

from testutil import current_targets

F32 = jnp.float32


def _rng(seed):
    return np.random.default_rng(seed)


def _arr(shape, seed, dtype=F32, lo=None, hi=None):
    r = _rng(seed)
    v = r.uniform(lo, hi, shape) if lo is not None else r.normal(size=shape)
    return jnp.asarray(v, dtype)


def _splat_case():
    meta = ops.gaussian_splat_render_meta([0.3, -0.2, -4], [0, 0, 0], [0, 1, 0], 45.0, 0.1, 100.0,
                                          [0.1, 0.2, 0.3], width=32, height=24, tile_size=8)
    r = _rng(11)
    n = 300
    pos = r.uniform(-1, 1, (n, 3))
    pos[:, 2] *= 0.5
    scene = [pos, np.log(r.uniform(0.05, 0.3, (n, 3))), r.normal(size=(n, 4)), r.normal(size=n),
             r.uniform(0, 1, (n, 3)), r.normal(size=(n, 4, 3)) * 0.2]
    fn = lambda *a: ops.gaussian_splat_render(*a, meta, width=32, height=24, tile_size=8)
    return fn, [jnp.asarray(a, F32) for a in scene], tuple(range(6))


def _cases():
    """name -> (targets, fn, args, argnums to differentiate)."""
    c = {}
    x = _arr((300, 128), 0)
    g, b = _arr((128,), 1), _arr((128,), 2)
    c["rms_norm"] = (("rlx_rms_norm_fwd_v2", "rlx_rms_norm_bwd_v1"), lambda x, g, b: ops.rms_norm(x, g, b), (x, g, b),
                     (0, 1, 2))
    c["rms_norm_bf16"] = (("rlx_rms_norm_fwd_v2", "rlx_rms_norm_bwd_v1"), lambda x, g, b: ops.rms_norm(x, g, b),
                          tuple(a.astype(jnp.bfloat16) for a in (x, g, b)), (0, 1, 2))
    c["add_rms_norm"] = (("rlx_rms_norm_fwd_v2", "rlx_add_rms_norm_bwd_v1"),
                         lambda x, r, g: sum(ops.add_rms_norm(x, r, g)), (x, _arr((300, 128), 7), g), (0, 1, 2))
    w = 0.1 * _arr((128, 64), 31)
    c["rms_norm_linear"] = (("rlx_rms_norm_fwd_v2", "rlx_rms_norm_bwd_v1"), lambda x, g, w: ops.rms_norm_linear(x, g, w),
                            (x, g, w), (0, 1, 2))
    c["add_rms_norm_linear"] = (("rlx_rms_norm_fwd_v2", "rlx_add_rms_norm_bwd_v1"),
                                lambda x, r, g, w: jnp.concatenate(ops.add_rms_norm_linear(x, r, g, w), axis=-1),
                                (x, _arr((300, 128), 32), g, w), (0, 1, 2, 3))
    c["layer_norm"] = (("rlx_layer_norm_fwd_v2", "rlx_layer_norm_bwd_v1"), lambda x, g, b: ops.layer_norm(x, g, b),
                       (x, g, b), (0, 1, 2))
    xg = _arr((8, 32, 10, 10), 3)
    c["group_norm"] = (("rlx_group_norm_fwd_v2", "rlx_group_norm_bwd_v1"),
                       lambda x, g, b: ops.group_norm(x, g, b, num_groups=4), (xg, _arr((32,), 4), _arr((32,), 5)),
                       (0, 1, 2))
    xb = _arr((16, 32, 8), 6)
    c["batch_norm_inference"] = (("rlx_batch_norm_inference_bwd_v2",),
                                 lambda x, g, b, m, v: ops.batch_norm_inference(x, g, b, m, v),
                                 (xb, _arr((32,), 7), _arr((32,), 8), _arr((32,), 9), _arr((32,), 10, lo=0.5, hi=2)),
                                 (0, 1, 2))
    c["softmax"] = (("rlx_softmax_fwd_v1", "rlx_softmax_bwd_x_v1"), lambda x: ops.softmax(x), (x,), (0,))
    c["softmax_backward"] = (("rlx_softmax_bwd_v1",), lambda y, d: ops.softmax_backward(y, d),
                             (ops.softmax(x), _arr((300, 128), 30)), (0, 1))
    logits = _arr((300, 500), 12)
    labels = jnp.asarray(_rng(13).integers(0, 500, 300), jnp.int32)
    c["softmax_cross_entropy"] = (("rlx_softmax_ce_fwd_v1", "rlx_softmax_ce_bwd_v1"),
                                  lambda l: ops.softmax_cross_entropy(l, labels), (logits,), (0,))
    lab2 = jnp.asarray(_rng(14).integers(0, 1000, 64), jnp.int32)
    c["fused_linear_cross_entropy"] = ((), lambda h, w: ops.fused_linear_cross_entropy(h, w, lab2, chunk_size=256),
                                       (_arr((64, 32), 15), _arr((32, 1000), 16)), (0, 1))
    c["fused_linear_cross_entropy_mean"] = (("rlx_softmax_ce_loss_grad_v1",),
                                            lambda h, w: ops.fused_linear_cross_entropy(h, w, lab2, reduction="mean",
                                                                                        chunk_size=16),
                                            (_arr((64, 32), 15), _arr((32, 1000), 16)), (0, 1))
    c["cumsum"] = (("rlx_cumsum_fwd_v1", "rlx_cumsum_bwd_v1"), lambda x: ops.cumsum(x, axis=-1), (x,), (0,))
    cs, sn = _arr((16, 16), 17), _arr((16, 16), 18)
    c["rope"] = (("rlx_rope_fwd_v1", "rlx_rope_bwd_v1"), lambda x: ops.rope(x, cs, sn, head_dim=32), (_arr((4, 16, 64), 19),),
                 (0,))
    c["rope_split"] = (("rlx_rope_split_v1", "rlx_rope_merge_v1"),
                       lambda x: jnp.concatenate(ops.rope_split(x, cs, sn, (2, 1), rotate=(True, False), head_dim=32),
                                                 axis=-1),
                       (_arr((4, 16, 96), 25),), (0,))
    q, k, v = (_arr((2, 64, 4, 32), s) for s in (20, 21, 22))
    c["attention_causal"] = (("rlx_attention_fwd_v1", "rlx_attention_bwd_v1"),
                             lambda q, k, v: ops.attention(q, k, v, mask_kind="causal"), (q, k, v), (0, 1, 2))
    bias = _arr((2, 4, 64, 64), 23)
    mask = jnp.asarray(_rng(24).integers(0, 2, (2, 64)), F32)
    c["attention_bias_mask"] = (("rlx_attention_fwd_v1", "rlx_attention_bwd_v1"),
                                lambda q, k, v, bb: ops.attention(q, k, v, mask=mask, bias=bb), (q, k, v, bias),
                                (0, 1, 2, 3))
    # packed documents: sorted segment ids, documents of 1-24 tokens (the segment-id targets)
    ids = jnp.asarray(np.cumsum(_rng(27).random((2, 64)) < 0.12, axis=1), jnp.int32)
    c["attention_segments"] = (("rlx_attention_segments_fwd_v1", "rlx_attention_segments_bwd_v1"),
                               lambda q, k, v: ops.attention(q, k, v, mask_kind="causal", q_segment_ids=ids,
                                                             kv_segment_ids=ids), (q, k, v), (0, 1, 2))
    # the same at bf16, head dim 64 and 300 tokens (documents of 1-40): the form the CUDA segment
    # kernels serve (their tile order, skipped tiles and the fused backward's ordered dQ adds)
    ids300 = jnp.asarray(np.cumsum(_rng(33).random((2, 300)) < 0.05, axis=1), jnp.int32)
    c["attention_segments_bf16"] = (
        ("rlx_attention_segments_fwd_v1", "rlx_attention_segments_bwd_v1"),
        lambda q, k, v: ops.attention(q, k, v, mask_kind="causal", q_segment_ids=ids300, kv_segment_ids=ids300),
        tuple(_arr((2, 300, 4, 64), s, jnp.bfloat16) for s in (34, 35, 36)), (0, 1, 2))
    # 300300 elements: the CPU kernel splits them into 10 tasks of 2^15, the last with a tail
    gate, up = _arr((300, 1001), 31), _arr((300, 1001), 32)
    c["swiglu"] = (("rlx_swiglu_bwd_v1",), lambda a, b: ops.swiglu(a, b), (gate, up), (0, 1))
    c["swiglu_bf16"] = (("rlx_swiglu_bwd_v1",), lambda a, b: ops.swiglu(a, b),
                        (gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16)), (0, 1))
    c["swiglu_linear"] = (("rlx_swiglu_bwd_product_v1",), lambda a, b, w: ops.swiglu_linear(a, b, w),
                          (gate, up, _arr((1001, 24), 37)), (0, 1, 2))
    idx = jnp.asarray(_rng(25).integers(0, 500, 4000), jnp.int32)  # many repeats per row
    c["gather"] = (("rlx_gather_bwd_v1",), lambda t: ops.gather(t, idx), (_arr((500, 64), 26),), (0,))
    xp = _arr((8, 16, 32, 32), 27)
    c["max_pool2d"] = (("rlx_max_pool2d_fwd_v1", "rlx_max_pool2d_bwd_v1"),
                       lambda x: ops.max_pool2d(x, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1)), (xp,), (0,))
    c["avg_pool2d"] = (("rlx_avg_pool2d_bwd_v1",),
                       lambda x: ops.avg_pool2d(x, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1)), (xp,), (0,))
    xq = _arr((128, 32, 9), 28)
    c["fake_quantize"] = (("rlx_fake_quantize_bwd_v1",),
                          lambda x: ops.fake_quantize(x, bits=4, scale=0.2, ste="clipped_identity"), (xq,), (0,))
    c["fake_quantize_lsq"] = (("rlx_fake_quantize_lsq_bwd_v1",),
                              lambda x, s: ops.fake_quantize_lsq(x, s, bits=4, axis=1),
                              (xq, _arr((32,), 29, lo=0.05, hi=0.3)), (0, 1))
    fn, scene, argnums = _splat_case()
    c["gaussian_splat"] = (("rlx_gaussian_splat_fwd_v1", "rlx_gaussian_splat_bwd_v1"), fn, tuple(scene), argnums)
    return c


def _runner(fn, argnums):
    """One jitted function returning the forward value and the gradients of a weighted sum."""
    def loss(*a):
        y = fn(*a).astype(F32)
        w = jnp.sin(jnp.arange(y.size, dtype=F32) * 0.37).reshape(y.shape)
        return jnp.sum(y * w)

    def both(*a):
        return fn(*a), jax.grad(loss, argnums=argnums)(*a)

    return jax.jit(both)


def _digest(tree) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        a = np.asarray(leaf)
        h.update(str((a.shape, a.dtype)).encode())
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.hexdigest()


def digests(names=None) -> dict:
    out = {}
    for name, (_, fn, args, argnums) in _cases().items():
        if names is None or name in names:
            out[name] = _digest(_runner(fn, argnums)(*args))
    return out


@pytest.fixture(autouse=True, scope="module")
def segment_kernel_at_every_size():
    """Segment-id attention on the CPU takes the kernel only above a score-size threshold;
    here it runs at the cases' small sizes so its targets are covered."""
    from rlx_jax.vjp_rules import attention

    patch = pytest.MonkeyPatch()
    patch.setattr(attention, "CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES", 0)
    yield
    patch.undo()


@pytest.fixture(scope="module")
def cases():
    if not rlx_jax.kernel_info()["cpu"]["loaded"]:
        pytest.skip(f"compiled CPU kernels not loaded: {rlx_jax.kernel_info()['cpu']['error']}")
    return _cases()


def test_cases_cover_every_target(cases):
    covered = {t for targets, *_ in cases.values() for t in targets}
    missing = current_targets(rlx_jax.kernel_info()["cpu"]["targets"]) - covered
    assert not missing, f"targets without a determinism case: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(_cases()))
def test_bitwise_identical_on_repeated_runs(cases, name):
    targets, fn, args, argnums = cases[name]
    run = _runner(fn, argnums)
    text = run.lower(*args).as_text()
    for t in targets:
        assert t in text, f"{t} not in the lowered HLO of {name} (silent fallback)"
    first = _digest(run(*args))
    for _ in range(3):
        assert _digest(run(*args)) == first, f"{name}: results differ between runs"
    # a fresh compilation of the same computation agrees too
    assert _digest(_runner(fn, argnums)(*args)) == first, f"{name}: results differ after recompiling"


#: the fresh-process check in the default run (every case under -m slow)
PROCESS_SUBSET = ("rms_norm", "group_norm", "attention_bias_mask", "attention_segments", "gather",
                  "fake_quantize_lsq", "gaussian_splat")


def _fresh_process(names):
    here = dict(digests(names))
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    code = ("import json, sys; sys.path.insert(0, %r); import test_reliability_determinism as t; "
            "import rlx_jax.vjp_rules.attention as a; a.CPU_KERNEL_MIN_SCORE_BYTES = 0; "
            "a.CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES = 0; "
            "print('DIGESTS' + json.dumps(t.digests(%r)))" % (os.path.dirname(os.path.abspath(__file__)), names))
    # run from tests/ (not the repository root, whose rlx_jax/ has no compiled kernels and
    # would shadow the installed package through `python -c`'s sys.path[0])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("DIGESTS")][-1]
    there = json.loads(line[len("DIGESTS"):])
    differ = sorted(n for n in here if here[n] != there.get(n))
    assert not differ, f"results differ between processes: {differ}"
    return here


def test_bitwise_identical_in_a_fresh_process(cases):
    assert len(_fresh_process(list(PROCESS_SUBSET))) == len(PROCESS_SUBSET)


@pytest.mark.slow
def test_bitwise_identical_in_a_fresh_process_all_cases(cases):
    assert len(_fresh_process(None)) == len(cases)
