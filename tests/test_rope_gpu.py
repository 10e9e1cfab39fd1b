"""RoPE on the GPU: the CUDA kernels (rlx_rope_fwd / rlx_rope_bwd on platform CUDA)
against the pure-JAX reference in f32 on random data. Skipped where JAX sees no GPU.

Shapes cover every vector width of ffi/cuda/rope.cu (16-byte vectors when half = n_rot/2,
head_dim and the table width allow, narrower otherwise, scalars for odd halves),
n_rot < head_dim (pass-through items), n_rot = 0 (a copy), compact and wide tables,
several batch entries (the position is row % seq), zero-sized inputs, vmap, f64 and
operand errors raised by the CUDA handler itself."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from gpu_testutil import assert_close, gpu, requires_gpu
from rlx_jax.ops import rope, rope_backward, rope_split
from rlx_jax.vjp_rules.rope import reference_rope, rope_bwd, rope_fwd

pytestmark = requires_gpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _inputs(lead, s, heads, head_dim, table_w, dtype, seed=0):
    kx, ka, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (*lead, s, heads * head_dim), jnp.float32).astype(dtype)
    dy = jax.random.normal(kd, x.shape, jnp.float32).astype(dtype)
    ang = 3.0 * jax.random.normal(ka, (s, table_w), jnp.float32)
    c, t = jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)
    return [jax.device_put(a, gpu()) for a in (x, c, t, dy)]


def _merged_ref(x, c, t, head_dim, n_rot):
    """The reference on the merged layout x [..., S, H * head_dim] (it takes [B, S, H, D])."""
    s, w = x.shape[-2:]
    y = reference_rope(x.reshape(-1, s, w // head_dim, head_dim), c, t, n_rot=n_rot)[0]
    return y.reshape(x.shape)


def _ref(x, c, t, head_dim, n_rot):
    """The f32 reference on f32 copies of the (rounded) inputs."""
    f = lambda a: a.astype(jnp.float32)  # noqa: E731
    return _merged_ref(f(x), f(c), f(t), head_dim, n_rot)


def _close(got, want, dtype, what):
    assert_close(got, want, TOL[jnp.dtype(dtype).type], what)


def test_cuda_kernels_loaded_and_in_hlo():
    info = rlx_jax.kernel_info()["cuda"]
    assert info["loaded"], info["error"]
    assert {"rlx_rope_fwd_v1", "rlx_rope_bwd_v1"} <= set(info["targets"])
    x, c, t, dy = _inputs((2,), 8, 4, 32, 16, jnp.float32)
    def fwd_bwd(x, dy):  # y is returned: a pullback alone drops the (linear) forward
        y, pullback = jax.vjp(lambda x: rope(x, c, t, head_dim=32), x)
        return y, pullback(dy)

    text = jax.jit(fwd_bwd).lower(x, dy).as_text()
    assert "rlx_rope_fwd" in text and "rlx_rope_bwd" in text


# (lead, seq, heads, head_dim, n_rot, table_w)
CASES = [
    ((2,), 7, 3, 64, 64, 32),  # 16-byte vectors
    ((3,), 5, 2, 64, 32, 32),  # n_rot < head_dim, wide table
    ((1,), 9, 5, 128, 96, 48),  # compact table, pass-through of 32
    ((2, 2), 11, 3, 12, 12, 6),  # half 6: 2-element vectors
    ((1,), 13, 3, 10, 6, 3),  # half 3, odd: scalar path, odd table width
    ((4,), 3, 1, 8, 0, 1),  # n_rot = 0: a copy
    ((1,), 33, 7, 96, 64, 48),  # several row groups per block
    ((), 257, 16, 64, 64, 32),  # no batch axis; many rows
    ((1,), 9, 4, 128, 64, 32),  # half rotary hd 128: 4 pair + 4 two-vector copy items a head
    ((2,), 5, 3, 20, 16, 8),  # one pass-through vector a head: a copy item without its second vector
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, (*c[0], *c[1:]))))
def test_forward_and_backward_match_f32_reference(case, dtype):
    lead, s, heads, hd, n_rot, tw = case
    x, c, t, dy = _inputs(lead, s, heads, hd, tw, dtype)
    y = jax.jit(lambda x: rope(x, c, t, head_dim=hd, n_rot=n_rot))(x)
    _close(y, _ref(x, c, t, hd, n_rot), dtype, "y")
    # gradient through the public op (rlx_rope_bwd) and the RLX backward op's wrapper
    dx = jax.jit(lambda x, dy: jax.vjp(lambda x: rope(x, c, t, head_dim=hd, n_rot=n_rot), x)[1](dy)[0])(x, dy)
    want = jax.vjp(lambda x: _ref(x, c, t, hd, n_rot), x.astype(jnp.float32))[1](dy.astype(jnp.float32))[0]
    _close(dx, want, dtype, "dx")
    dx2 = jax.jit(lambda dy: rope_backward(dy, c, t, head_dim=hd, n_rot=n_rot))(dy)
    _close(dx2, want, dtype, "rope_backward")
    assert y.dtype == x.dtype and dx.dtype == x.dtype


def test_pass_through_is_exact_and_rotation_inverts():
    x, c, t, _ = _inputs((2,), 6, 3, 16, 4, jnp.float32)
    y = rope(x, c, t, head_dim=16, n_rot=8)
    xh, yh = np.asarray(x).reshape(2, 6, 3, 16), np.asarray(y).reshape(2, 6, 3, 16)
    np.testing.assert_array_equal(yh[..., 8:], xh[..., 8:])
    # cos^2 + sin^2 = 1 up to rounding: the backward undoes the forward
    back = rope_backward(y, c, t, head_dim=16, n_rot=8)
    assert_close(back, x, 1e-5, "inverse")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_pass_through_copies_inf_and_nan_exactly(dtype):
    """The pass-through part is stored as loaded (no arithmetic): inf and NaN stay, in the
    forward and the backward, for an even and an odd number of pass-through vectors."""
    for hd, n_rot in ((32, 16), (20, 16)):
        x, c, t, _ = _inputs((2,), 4, 3, hd, 8, dtype, seed=7)
        xh = np.array(x.astype(jnp.float32)).reshape(2, 4, 3, hd)
        xh[0, 1, 2, n_rot:] = np.inf
        xh[1, 3, 0, n_rot] = np.nan
        xh[1, 0, 1, hd - 1] = -np.inf
        x = jax.device_put(jnp.asarray(xh.reshape(2, 4, 3 * hd)).astype(dtype), gpu())
        for y in (rope(x, c, t, head_dim=hd, n_rot=n_rot), rope_backward(x, c, t, head_dim=hd, n_rot=n_rot)):
            got = np.asarray(y.astype(jnp.float32)).reshape(2, 4, 3, hd)[..., n_rot:]
            np.testing.assert_array_equal(got, xh[..., n_rot:])


def test_grads_in_tables_and_x():
    """jax.grad in x, cos and sin (the table tangent is the reference's; x's the kernel's)."""
    x, c, t, dy = _inputs((2,), 5, 2, 32, 16, jnp.float32)
    loss = lambda f: lambda x, c, t: jnp.sum(f(x, c, t) * dy)  # noqa: E731
    ours = jax.jit(jax.grad(loss(lambda x, c, t: rope(x, c, t, head_dim=32, n_rot=24)), argnums=(0, 1, 2)))(x, c, t)
    want = jax.grad(loss(lambda x, c, t: _ref(x, c, t, 32, 24)), argnums=(0, 1, 2))(x, c, t)
    for g, w, n in zip(ours, want, ("dx", "dcos", "dsin")):
        assert_close(g, w, 1e-5, n)


def test_vmap_keeps_kernel():
    x, c, t, dy = _inputs((3,), 6, 2, 16, 8, jnp.float32)
    f = jax.jit(jax.vmap(lambda x, dy: jax.vjp(lambda x: rope(x, c, t, head_dim=16), x)[1](dy)[0]))
    assert "rlx_rope_bwd" in f.lower(x, dy).as_text()
    want = jax.vmap(lambda x, dy: jax.vjp(lambda x: _ref(x, c, t, 16, 16), x)[1](dy)[0])(x, dy)
    assert_close(f(x, dy), want, 1e-5, "vmap dx")


@pytest.mark.parametrize("shape", [(0, 4, 2, 16), (2, 0, 2, 16), (2, 4, 0, 16)])
def test_zero_sized(shape):
    s = shape[1]
    x = jax.device_put(jnp.zeros(shape, jnp.float32), gpu())
    c = jnp.ones((s, 8), jnp.float32)
    (y,) = rope_fwd(x, c, c, n_rot=16)
    (dx,) = rope_bwd(x, c, c, n_rot=16)
    assert y.shape == shape and dx.shape == shape


def test_f64(x64):
    x, c, t, dy = _inputs((2,), 5, 3, 12, 6, jnp.float64)
    text = jax.jit(lambda x: rope(x, c, t, head_dim=12, n_rot=8)).lower(x).as_text()
    assert "rlx_rope_fwd" in text
    y = rope(x, c, t, head_dim=12, n_rot=8)
    assert y.dtype == jnp.float64
    want = _merged_ref(x, c, t, 12, 8)
    assert_close(y, want, 1e-12, "f64 y")
    dx = rope_backward(dy, c, t, head_dim=12, n_rot=8)
    want = jax.vjp(lambda x: _merged_ref(x, c, t, 12, 8), x)[1](dy)[0]
    assert_close(dx, want, 1e-12, "f64 dx")


def test_handler_rejects_bad_operands():
    """The CUDA handler's own checks (the Python wrappers check first; a direct call
    reaches the handler)."""
    dev = gpu()
    x = jax.device_put(jnp.zeros((1, 4, 32), jnp.float32), dev)
    c = jax.device_put(jnp.zeros((4, 16), jnp.float32), dev)

    def call(x, c, s, head_dim, n_rot):
        out = (jax.ShapeDtypeStruct(x.shape, x.dtype),)
        return jax.ffi.ffi_call("rlx_rope_fwd_v1", out)(x, c, s, head_dim=np.int64(head_dim), n_rot=np.int64(n_rot))

    with pytest.raises(Exception, match="even n_rot"):
        jax.block_until_ready(jax.jit(call, static_argnums=(3, 4))(x, c, c, 32, 3))
    with pytest.raises(Exception, match="multiple of head_dim"):
        jax.block_until_ready(jax.jit(call, static_argnums=(3, 4))(x, c, c, 24, 8))
    with pytest.raises(Exception, match="cos must be"):
        jax.block_until_ready(jax.jit(call, static_argnums=(3, 4))(x, c[:3], c[:3], 32, 32))
    with pytest.raises(Exception, match="dtype"):
        jax.block_until_ready(jax.jit(call, static_argnums=(3, 4))(x, c.astype(jnp.bfloat16), c, 32, 32))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_rope_sanitizer_small(dtype):
    """Small cases for compute-sanitizer (-k sanitizer): vector and scalar paths."""
    for lead, s, heads, hd, n_rot, tw in (((2,), 3, 2, 16, 12, 8), ((1,), 3, 3, 10, 6, 3), ((1,), 2, 3, 20, 16, 8)):
        x, c, t, dy = _inputs(lead, s, heads, hd, tw, dtype, seed=3)
        y = rope(x, c, t, head_dim=hd, n_rot=n_rot)
        _close(y, _ref(x, c, t, hd, n_rot), dtype, "y")
        dx = rope_backward(dy, c, t, head_dim=hd, n_rot=n_rot)
        want = jax.vjp(lambda x: _ref(x, c, t, hd, n_rot), x.astype(jnp.float32))[1](dy.astype(jnp.float32))[0]
        _close(dx, want, dtype, "dx")


# ---- rope_split / its transpose rlx_rope_merge -------------------------------------------------

# (lead, seq, heads per part, rotate, head_dim, n_rot, table_w)
SPLIT_CASES = [
    ((2,), 9, (16, 4, 4), (True, True, False), 128, 128, 64),  # a Llama q / k / v block, 16-byte vectors
    ((1,), 7, (3, 2), (False, True), 64, 32, 32),  # partial rotation, the first part copied
    ((2,), 5, (2, 1, 1), (True, True, False), 12, 12, 6),  # half 6: 2-element vectors
    ((1,), 13, (1, 2, 1), (True, False, True), 10, 6, 3),  # odd half: the scalar path
    ((1,), 33, (1,) * 8, (True, False) * 4, 32, 32, 16),  # the most parts; many row groups
    ((0,), 4, (2, 1), (True, False), 64, 64, 32),  # zero-sized batch
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "x".join(map(str, (*c[0], c[1], *c[2], *c[4:]))))
def test_rope_split_and_merge_match_f32_reference(case, dtype):
    """The kernels' parts and packed gradient equal the reference's, exactly for the copied
    parts (no arithmetic); both kernels are in the compiled program."""
    lead, s, heads, rotate, hd, n_rot, tw = case
    x, c, t, _ = _inputs(lead, s, sum(heads), hd, tw, dtype)
    f = lambda x: rope_split(x, c, t, heads, rotate=rotate, head_dim=hd, n_rot=n_rot)  # noqa: E731
    parts = jax.jit(f)(x)
    start = 0
    cts = []
    for i, (p, h, rot) in enumerate(zip(parts, heads, rotate)):
        piece = x[..., start * hd:(start + h) * hd]
        if rot:
            _close(p, _ref(piece, c, t, hd, n_rot), dtype, f"part {i}")
        else:
            np.testing.assert_array_equal(np.asarray(p.astype(jnp.float32)), np.asarray(piece.astype(jnp.float32)))
        cts.append(jax.random.normal(jax.random.PRNGKey(20 + i), p.shape, jnp.float32).astype(dtype))
        start += h
    grad = jax.jit(lambda x, cts: jax.vjp(f, x)[1](cts)[0])
    dx = grad(x, tuple(cts))
    want = jax.vjp(lambda x: [(_ref(x[..., a * hd:(a + h) * hd], c, t, hd, n_rot) if rot else x[..., a * hd:(a + h) * hd])
                              for a, h, rot in zip(np.cumsum((0,) + heads[:-1]), heads, rotate)],
                   x.astype(jnp.float32))[1]([ct.astype(jnp.float32) for ct in cts])[0]
    _close(dx, want, dtype, "dx")
    assert dx.dtype == x.dtype and dx.shape == x.shape
    if x.size:
        text = grad.lower(x, tuple(cts)).as_text()
        assert "rlx_rope_merge" in text and "rlx_rope_split" not in text
        assert "rlx_rope_split" in jax.jit(f).lower(x).as_text()


def test_rope_split_misaligned_parts_take_narrow_vectors():
    """A part starting at an offset that is not 16-byte aligned (head_dim 4 in f32: 16 bytes,
    head_dim 2: 8) still matches: the launch picks the widest vector every pointer allows."""
    for hd in (2, 4, 6):
        x, c, t, _ = _inputs((2,), 5, 5, hd, hd // 2, jnp.float32, seed=3)
        parts = rope_split(x, c, t, (1, 3, 1), rotate=(True, True, False), head_dim=hd)
        _close(parts[1], _ref(x[..., hd:4 * hd], c, t, hd, hd), jnp.float32, f"hd {hd}")
        np.testing.assert_array_equal(np.asarray(parts[2]), np.asarray(x[..., 4 * hd:]))
