"""Plain attention's forward through cuDNN on CUDA, the backward ours
(``rlx_jax.vjp_rules.attention._cudnn_forward``): which calls take that route, that the
compiled program then holds cuDNN's forward and our backward (and not cuDNN's backward),
that values and gradients match an f32 XLA reference, that cuDNN's lse is the one our
backward reads, that gradients stay bitwise reproducible, and that the route splits over
GPUs by batch and by heads without gathering. Skipped where JAX sees no GPU, the routed
cases where the GPU is not compute capability 9.0, and the sharded ones on one GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rlx_jax.ops import attention
from rlx_jax.vjp_rules import attention as A

from gpu_testutil import gpu, requires_gpu

pytestmark = requires_gpu

CUDNN_FWD = "__cudnn$fmhaSoftmax\""  # the forward custom call's target, quoted in the HLO text
CUDNN_BWD = "__cudnn$fmhaSoftmaxBackward"
TOL = {jnp.bfloat16: 1e-2, jnp.float16: 5e-3}

# (batch, Sq, Sk, heads, kv heads, head dim, mask kind, dtype): grouped and plain heads, odd
# lengths, Sq != Sk without a mask
SERVED = [
    (2, 256, 256, 8, 2, 128, "causal", jnp.bfloat16),
    (1, 1000, 1000, 4, 4, 64, "none", jnp.float16),
    (2, 200, 333, 8, 1, 128, "none", jnp.bfloat16),
    (1, 517, 517, 16, 4, 64, "causal", jnp.bfloat16),
]


def _needs_hopper():
    if A._hopper() is None:
        pytest.skip("cuDNN's forward is routed on compute capability 9.0 devices only")


def _inputs(b, sq, sk, h, hkv, d, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    shapes = ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d))
    return [jax.device_put(jax.random.normal(kk, s, jnp.float32).astype(dtype), gpu()) for kk, s in zip(ks, shapes)]


def _value_and_grads(opts, q, k, v, dy):
    """attention's output and (dq, dk, dv) for the cotangent dy, compiled; and its HLO."""
    def fn(q, k, v):
        out, vjp = jax.vjp(lambda *a: attention(*a, **opts), q, k, v)
        return out, vjp(dy)

    compiled = jax.jit(fn).lower(q, k, v).compile()
    return compiled(q, k, v), compiled.as_text()


def _reference(kind, q, k, v, dy):
    """XLA's attention in f32 at the highest matmul precision (top-left causal: Sq == Sk)."""
    q, k, v, dy = (x.astype(jnp.float32) for x in (q, k, v, dy))
    with jax.default_matmul_precision("highest"):
        out, vjp = jax.vjp(lambda *a: jax.nn.dot_product_attention(*a, is_causal=kind == "causal",
                                                                   implementation="xla"), q, k, v)
        return out, vjp(dy)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-6))


@pytest.mark.parametrize("case", SERVED, ids=lambda c: "-".join(map(str, c[:7])) + "-" + jnp.dtype(c[7]).name)
def test_served_calls_run_cudnn_forward_and_our_backward(case):
    _needs_hopper()
    b, sq, sk, h, hkv, d, kind, dtype = case
    q, k, v, dy = _inputs(b, sq, sk, h, hkv, d, dtype)
    (out, grads), hlo = _value_and_grads(dict(mask_kind=kind), q, k, v, dy)
    assert CUDNN_FWD in hlo and "rlx_attention_bwd" in hlo
    assert CUDNN_BWD not in hlo and "rlx_attention_fwd" not in hlo
    want_out, want_grads = _reference(kind, q, k, v, dy)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (want_out, *want_grads)):
        assert got.dtype == dtype and got.shape == want.shape, name
        assert _rel(got.astype(jnp.float32), want) <= TOL[dtype], name


@pytest.mark.parametrize("opts, shape", [
    (dict(mask_kind="causal", softcap=5.0), (1, 128, 128, 4, 2, 128)),
    (dict(mask_kind="sliding", window=17), (1, 128, 128, 4, 2, 64)),
    (dict(mask_kind="causal"), (1, 100, 300, 4, 2, 128)),  # causal with Sq != Sk: bottom-right
    (dict(mask_kind="none"), (1, 128, 128, 4, 2, 96)),  # a head dim cuDNN's route is not measured at
    (dict(mask_kind="none", key_mask=True), (1, 128, 128, 4, 2, 64)),
], ids=["softcap", "sliding", "causal-sq-ne-sk", "d96", "key-mask"])
def test_other_calls_keep_our_forward(opts, shape):
    b, sq, sk, h, hkv, d = shape
    q, k, v, dy = _inputs(b, sq, sk, h, hkv, d, jnp.bfloat16)
    opts = dict(opts)
    if opts.pop("key_mask", False):
        opts["mask"] = (jnp.arange(sk)[None, :] % 5 != 2).astype(jnp.float32) * jnp.ones((b, 1))
    _, hlo = _value_and_grads(opts, q, k, v, dy)
    assert "__cudnn$fmha" not in hlo and "rlx_attention_fwd" in hlo


def test_switched_off_keeps_our_forward(monkeypatch):
    monkeypatch.setattr(A, "CUDNN_FORWARD", False)
    q, k, v, dy = _inputs(1, 256, 256, 8, 2, 128, jnp.bfloat16)
    _, hlo = _value_and_grads(dict(mask_kind="causal"), q, k, v, dy)
    assert "__cudnn$fmha" not in hlo and "rlx_attention_fwd" in hlo


@pytest.mark.parametrize("kind", ["none", "causal"])
def test_cudnn_lse_is_our_kernels(kind, monkeypatch):
    """The backward rebuilds the probabilities from lse: cuDNN's statistics must be the
    natural-log lse of the scaled scores, as our forward kernel writes it."""
    _needs_hopper()
    q, k, v, _ = _inputs(2, 384, 384, 8, 2, 128, jnp.bfloat16, seed=3)

    def compiled():  # a new function each time: jit would reuse the first lowering
        return jax.jit(lambda q, k, v: A.attention_fwd(q, k, v, kind=kind, window=0, scale=1 / np.sqrt(128),
                                                       softcap=0.0, has_mask=False, has_bias=False)
                       ).lower(q, k, v).compile()

    got = compiled()
    assert CUDNN_FWD in got.as_text()
    out, lse = got(q, k, v)
    monkeypatch.setattr(A, "CUDNN_FORWARD", False)
    ours = compiled()
    assert "__cudnn$fmha" not in ours.as_text()
    want_out, want_lse = ours(q, k, v)
    assert lse.shape == want_lse.shape == (2, 8, 384) and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=0, atol=1e-4)
    assert _rel(out.astype(jnp.float32), want_out.astype(jnp.float32)) <= TOL[jnp.bfloat16]


def test_gradients_bitwise_reproducible():
    _needs_hopper()
    q, k, v, dy = _inputs(2, 512, 512, 8, 2, 128, jnp.bfloat16, seed=5)
    fn = jax.jit(lambda q, k, v: jax.vjp(lambda *a: attention(*a, mask_kind="causal"), q, k, v)[1](dy))
    first = [np.asarray(g) for g in fn(q, k, v)]
    for _ in range(2):
        again = [np.asarray(g) for g in fn(q, k, v)]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))


@pytest.mark.parametrize("axis", ["batch", "heads"])
def test_sharded_over_gpus(axis):
    """The routed forward and our backward under SPMD over two GPUs, q / k / v / dy split by
    batch or by heads (grouped: 8 query heads on 2 kv heads, a kv head and its 4 query heads
    on each GPU): cuDNN's forward and our backward in the program, no all-gather, the
    outputs split like the inputs, values and gradients as on one GPU and as the reference."""
    _needs_hopper()
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    mesh = Mesh(np.array(gpus[:2]), ("x",))
    sharding = NamedSharding(mesh, P("x") if axis == "batch" else P(None, None, "x"))
    q, k, v, dy = _inputs(4, 256, 256, 8, 2, 128, jnp.bfloat16, seed=7)

    def fn(q, k, v, dy):
        out, vjp = jax.vjp(lambda *a: attention(*a, mask_kind="causal"), q, k, v)
        return out, vjp(dy)

    args = [jax.device_put(x, sharding) for x in (q, k, v, dy)]
    compiled = jax.jit(fn).lower(*args).compile()
    hlo = compiled.as_text()
    assert CUDNN_FWD in hlo and "rlx_attention_bwd" in hlo
    assert CUDNN_BWD not in hlo and "all-gather" not in hlo
    out, grads = compiled(*args)
    assert all(x.sharding.is_equivalent_to(sharding, 4) for x in (out, *grads))
    one_out, one_grads = jax.jit(fn)(q, k, v, dy)
    want_out, want_grads = _reference("causal", q, k, v, dy)
    for name, got, one, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (one_out, *one_grads),
                                    (want_out, *want_grads)):
        got = got.astype(jnp.float32)
        assert _rel(got, one.astype(jnp.float32)) <= 1e-3, name
        assert _rel(got, want) <= TOL[jnp.bfloat16], name
