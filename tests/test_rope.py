"""NeoX RoPE: kernels vs a NumPy oracle, n_rot < head_dim, both table widths,
gradients (x, cos, sin) in every mode, vmap, errors; rope_split over fixed and randomly
drawn part layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

import rlx_jax
from rlx_jax.ops import rope, rope_backward, rope_split
from testutil import assert_close, hlo_text, platform

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _oracle(x, cos, sin, head_dim, n_rot, sign=1.0):
    """NumPy NeoX rotation of x [..., S, H*head_dim] by tables [S, >= n_rot/2]."""
    x = np.asarray(x, np.float64)
    cos, sin = np.asarray(cos, np.float64), sign * np.asarray(sin, np.float64)
    *lead, s, w = x.shape
    xh = x.reshape(*lead, s, w // head_dim, head_dim)
    y = xh.copy()
    half = n_rot // 2
    for i in range(half):
        c, t = cos[:, i][:, None], sin[:, i][:, None]  # [S, 1] broadcast over heads
        y[..., i] = xh[..., i] * c - xh[..., half + i] * t
        y[..., half + i] = xh[..., half + i] * c + xh[..., i] * t
    return y.reshape(x.shape)


def _inputs(lead, s, heads, head_dim, table_w, dtype=jnp.float32, seed=0):
    kx, ka = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (*lead, s, heads * head_dim), jnp.float32).astype(dtype)
    ang = 3.0 * jax.random.normal(ka, (s, table_w), jnp.float32)
    return x, jnp.cos(ang), jnp.sin(ang)


def test_kernels_registered_and_used():
    info = rlx_jax.kernel_info()[platform()]
    assert info["loaded"], info["error"]
    assert {"rlx_rope_fwd_v1", "rlx_rope_bwd_v1"} <= set(info["targets"])
    x, c, s = _inputs((2,), 3, 2, 8, 4)
    text = hlo_text(jax.grad(lambda x: jnp.sum(rope(x, c, s, head_dim=8) ** 2)), x)
    assert "rlx_rope_fwd" in text and "rlx_rope_bwd" in text


# (leading axes, S, heads, head_dim, n_rot, table width)
CASES = [
    ((2,), 5, 3, 8, 8, 4),  # full rotation, compact table
    ((2,), 5, 3, 8, 6, 4),  # n_rot < head_dim, RLX-width table (head_dim / 2)
    ((), 7, 2, 64, 32, 16),  # no batch axis, compact table
    ((2, 3), 4, 1, 6, 2, 3),  # two leading axes
    ((1,), 3, 2, 4, 0, 2),  # n_rot = 0: identity
    ((0,), 4, 2, 8, 8, 4),  # zero-sized batch
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_forward_and_backward_match_oracle(case, dtype):
    lead, s, heads, hd, nr, tw = case
    x, c, sn = _inputs(lead, s, heads, hd, tw, dtype)
    y = jax.jit(lambda x, c, s: rope(x, c, s, head_dim=hd, n_rot=nr))(x, c, sn)
    assert y.dtype == dtype and y.shape == x.shape
    cr, sr = c.astype(dtype), sn.astype(dtype)  # the op rounds tables to x's dtype
    assert_close(y, _oracle(x, cr, sr, hd, nr), dtype)
    dx = jax.jit(lambda d, c, s: rope_backward(d, c, s, head_dim=hd, n_rot=nr))(x, c, sn)
    assert_close(dx, _oracle(x, cr, sr, hd, nr, sign=-1.0), dtype)
    # the backward is the transpose of the forward
    _, vjp = jax.vjp(lambda x: rope(x, c, sn, head_dim=hd, n_rot=nr), x)
    assert_close(vjp(x)[0], dx, dtype)


def test_default_n_rot_is_head_dim():
    x, c, s = _inputs((2,), 5, 2, 8, 4)
    assert_close(rope(x, c, s, head_dim=8), rope(x, c, s, head_dim=8, n_rot=8))


def test_inverse_rotation():
    x, c, s = _inputs((2,), 5, 3, 8, 4)
    assert_close(rope_backward(rope(x, c, s, head_dim=8, n_rot=6), c, s, head_dim=8, n_rot=6), x)


def test_check_grads_f64(x64):
    x, c, s = _inputs((2,), 4, 2, 6, 3, jnp.float64)
    c, s = c.astype(jnp.float64), s.astype(jnp.float64)
    assert "rlx_rope_bwd" in hlo_text(jax.grad(lambda x: jnp.sum(rope(x, c, s, head_dim=6) ** 2)), x)
    f = lambda x, c, s: rope(x, c, s, head_dim=6, n_rot=4) ** 2
    check_grads(f, (x, c, s), order=2, modes=("fwd", "rev"))
    b = lambda x, c, s: rope_backward(x, c, s, head_dim=6, n_rot=4) ** 2
    check_grads(b, (x, c, s), order=2, modes=("fwd", "rev"))


def test_vmap():
    x, c, s = _inputs((2,), 5, 2, 8, 4)
    xb = jnp.stack([x, 2 * x], axis=1)  # batch on axis 1
    got = jax.vmap(lambda x: rope(x, c, s, head_dim=8), in_axes=1, out_axes=1)(xb)
    assert_close(got[:, 1], _oracle(2 * x, c, s, 8, 8))
    cb = jnp.stack([c, s])  # batched tables fall back to the reference
    got = jax.vmap(lambda c: rope(x, c, s, head_dim=8))(cb)
    assert_close(got[1], _oracle(x, s, s, 8, 8))
    g = jax.vmap(jax.grad(lambda x: jnp.sum(rope(x, c, s, head_dim=8) ** 3)))(jnp.stack([x, x]))
    assert_close(g[0], jax.grad(lambda x: jnp.sum(rope(x, c, s, head_dim=8) ** 3))(x))


def test_errors():
    x, c, s = _inputs((2,), 5, 2, 8, 4)
    with pytest.raises(ValueError, match="n_rot"):
        rope(x, c, s, head_dim=8, n_rot=3)
    with pytest.raises(ValueError, match="n_rot"):
        rope(x, c, s, head_dim=8, n_rot=10)
    with pytest.raises(ValueError, match="multiple of head_dim"):
        rope(x, c, s, head_dim=6)
    with pytest.raises(ValueError, match="cos must be"):
        rope(x, c[:4], s, head_dim=8)
    with pytest.raises(ValueError, match="cos must be"):
        rope(x, c[:, :2], s, head_dim=8)
    with pytest.raises(ValueError, match="rank >= 2"):
        rope(x[0, 0], c, s, head_dim=8)
    with pytest.raises(TypeError, match="floating"):
        rope(x.astype(jnp.int32), c, s, head_dim=8)


# ---- the heads-split layout [..., S, H, D] (head_dim=None) ------------------------------

# (leading axes, S, heads, head_dim, n_rot, table width)
SPLIT_CASES = [
    ((2,), 5, 3, 8, 8, 4),
    ((2,), 5, 3, 8, 6, 4),  # partial rotation, RLX-width table
    ((), 7, 2, 6, 2, 3),  # no batch axis
    ((2, 3), 4, 1, 6, 4, 3),  # two leading axes
    ((0,), 4, 2, 8, 8, 4),  # zero-sized batch
]


def _split_inputs(lead, s, heads, hd, tw, dtype=jnp.float32, seed=1):
    x, c, sn = _inputs(lead, s, heads, hd, tw, dtype, seed)
    return x.reshape(*lead, s, heads, hd), c, sn


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_layout_matches_oracle(case, dtype):
    lead, s, heads, hd, nr, tw = case
    x, c, sn = _split_inputs(lead, s, heads, hd, tw, dtype)
    merged = lambda a: np.asarray(a, np.float64).reshape(*lead, s, heads * hd)
    cr, sr = c.astype(dtype), sn.astype(dtype)
    y = jax.jit(lambda x, c, s: rope(x, c, s, n_rot=nr))(x, c, sn)
    assert y.shape == x.shape and y.dtype == dtype
    assert_close(merged(y), _oracle(merged(x), cr, sr, hd, nr), dtype)
    dx = jax.jit(lambda d, c, s: rope_backward(d, c, s, n_rot=nr))(x, c, sn)
    assert_close(merged(dx), _oracle(merged(x), cr, sr, hd, nr, sign=-1.0), dtype)
    _, vjp = jax.vjp(lambda x: rope(x, c, sn, n_rot=nr), x)
    assert_close(vjp(x)[0], dx, dtype)


def test_split_layout_equals_merged_and_runs_kernel_without_transpose():
    x, c, s = _split_inputs((2,), 5, 3, 8, 4)
    xm = x.reshape(2, 5, 24)
    assert_close(rope(x, c, s, n_rot=6).reshape(2, 5, 24), rope(xm, c, s, head_dim=8, n_rot=6))
    loss = lambda x: jnp.sum(rope(x, c, s) ** 2)
    text = jax.jit(jax.grad(loss)).lower(x).compile().as_text()
    assert "rlx_rope_fwd" in text and "rlx_rope_bwd" in text
    assert " transpose(" not in text


def test_split_layout_check_grads_f64_and_vmap(x64):
    x, c, s = _split_inputs((2,), 4, 2, 6, 3, jnp.float64)
    c, s = c.astype(jnp.float64), s.astype(jnp.float64)
    check_grads(lambda x, c, s: rope(x, c, s, n_rot=4) ** 2, (x, c, s), order=2, modes=("fwd", "rev"))
    check_grads(lambda x, c, s: rope_backward(x, c, s) ** 2, (x, c, s), order=1, modes=("fwd", "rev"))
    xb = jnp.stack([x, 3 * x], axis=2)  # vmapped axis in the middle
    got = jax.vmap(lambda x: rope(x, c, s, n_rot=4), in_axes=2, out_axes=0)(xb)
    assert_close(got[1], rope(3 * x, c, s, n_rot=4))
    g = jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(rope(x, c, s)))))(jnp.stack([x, -x]))
    assert_close(g[1], jax.grad(lambda x: jnp.sum(jnp.sin(rope(x, c, s))))(-x))


def test_split_layout_errors():
    x, c, s = _split_inputs((2,), 5, 2, 8, 4)
    # a [B, S, H, D] x with head_dim reads as merged [..., S=H, D]: the message says to drop head_dim
    with pytest.raises(ValueError, match="drop head_dim"):
        rope(x, c, s, head_dim=8)
    with pytest.raises(ValueError, match="drop head_dim"):
        rope_backward(x, c, s, head_dim=8)
    with pytest.raises(ValueError, match=r"rank >= 3.*pass head_dim"):
        rope(x[0, :, 0], c, s)
    with pytest.raises(ValueError, match="n_rot"):
        rope(x, c, s, n_rot=10)
    with pytest.raises(ValueError, match=r"cos must be \[S=5"):
        rope(x, c[:3], s)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        rope(x.reshape(2, 5, 16), c, s, head_dim=True)


# ---- rope_split: a packed x split along heads into parts, some rotated ----------------------

# (leading axes, S, heads per part, rotate, head_dim, n_rot, table width)
PACKED_CASES = [
    ((2,), 5, (3, 1, 1), (True, True, False), 8, 8, 4),  # a grouped q / k / v block
    ((2,), 5, (2, 2), (False, True), 8, 6, 4),  # partial rotation, the first part copied
    ((), 7, (1,), (True,), 6, 2, 3),  # one part: rope itself
    ((2, 3), 4, (1, 2, 1, 1), (True, False, False, True), 6, 4, 3),  # two leading axes
    ((1,), 3, (1, 1, 1, 1, 1, 1, 1, 1), (True, False) * 4, 4, 4, 2),  # the most parts
    ((0,), 4, (2, 1), (True, False), 8, 8, 4),  # zero-sized batch
]


def _packed_oracle(x, c, s, heads, rotate, head_dim, n_rot, sign=1.0):
    """NumPy parts of x [..., S, sum(heads) * head_dim], each rotated by ``_oracle`` or copied."""
    out, start = [], 0
    for h, rot in zip(heads, rotate):
        part = np.asarray(x, np.float64)[..., start * head_dim:(start + h) * head_dim]
        out.append(_oracle(part, c, s, head_dim, n_rot, sign) if rot else part)
        start += h
    return out


def _check_rope_split(case, dtype):
    """rope_split of a drawn layout against ``_packed_oracle``: the parts, the same parts
    from the heads-split layout, and the packed gradient of random part cotangents."""
    lead, s, heads, rotate, hd, n_rot, tw = case
    x, c, sn = _inputs(lead, s, sum(heads), hd, tw, dtype, seed=3)
    parts = rope_split(x, c, sn, heads, rotate=rotate, head_dim=hd, n_rot=n_rot)
    want = _packed_oracle(x, c.astype(dtype), sn.astype(dtype), heads, rotate, hd, n_rot)
    assert len(parts) == len(heads)
    for got, w, h in zip(parts, want, heads):
        assert got.shape == (*lead, s, h * hd) and got.dtype == dtype
        assert_close(got, w, dtype)
    # the same parts from the heads-split layout [..., S, H, D]
    split = rope_split(x.reshape(*lead, s, sum(heads), hd), c, sn, heads, rotate=rotate, n_rot=n_rot)
    for got, ref, h in zip(split, parts, heads):
        assert got.shape == (*lead, s, h, hd)
        np.testing.assert_array_equal(np.asarray(got).reshape(ref.shape), np.asarray(ref))
    # reverse mode: the parts' cotangents rotated back (-theta) and packed in place
    cts = [jax.random.normal(jax.random.PRNGKey(10 + i), p.shape, jnp.float32).astype(dtype)
           for i, p in enumerate(parts)]
    _, pullback = jax.vjp(lambda x: rope_split(x, c, sn, heads, rotate=rotate, head_dim=hd, n_rot=n_rot), x)
    (dx,) = pullback(tuple(cts))
    want_dx = np.concatenate(_packed_oracle(np.concatenate([np.asarray(ct, np.float64) for ct in cts], -1), c.astype(dtype),
                                            sn.astype(dtype), heads, rotate, hd, n_rot, sign=-1.0), -1)
    assert dx.shape == x.shape and dx.dtype == dtype
    assert_close(dx, want_dx.reshape(x.shape), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PACKED_CASES)
def test_rope_split_forward_and_backward_match_oracle(case, dtype):
    _check_rope_split(case, dtype)


@st.composite
def _packed_layouts(draw):
    """(case as in PACKED_CASES, dtype): 1-8 parts of 1-3 heads, any rotate flags, even
    head_dim up to 18 with an even n_rot up to it, tables up to 2 columns wider than
    n_rot / 2, up to two leading axes (zero-sized ones included)."""
    parts = draw(st.integers(1, 8))
    heads = tuple(draw(st.integers(1, 3)) for _ in range(parts))
    rotate = tuple(draw(st.booleans()) for _ in range(parts))
    hd = 2 * draw(st.integers(1, 9))
    n_rot = 2 * draw(st.integers(1, hd // 2))
    tw = draw(st.integers(n_rot // 2, n_rot // 2 + 2))
    lead = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    case = (lead, draw(st.integers(1, 6)), heads, rotate, hd, n_rot, tw)
    return case, draw(st.sampled_from(DTYPES))


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(_packed_layouts())
def test_rope_split_random_layouts_match_oracle(drawn):
    _check_rope_split(*drawn)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_packed_layouts())
def test_rope_split_many_random_layouts_match_oracle(drawn):
    _check_rope_split(*drawn)


def test_rope_split_kernels_in_hlo_with_no_concatenate():
    """The forward reads the packed x in one kernel and the backward writes the packed
    gradient in one kernel: no slices of x, no concatenation of the parts' gradients."""
    info = rlx_jax.kernel_info()[platform()]
    assert {"rlx_rope_split_v1", "rlx_rope_merge_v1"} <= set(info["targets"])
    x, c, s = _inputs((2,), 6, 6, 8, 4)
    f = lambda x: sum(jnp.sum(p ** 2) for p in rope_split(x, c, s, (4, 1, 1), rotate=(True, True, False), head_dim=8))
    text = jax.jit(jax.grad(f)).lower(x).compile().as_text()
    assert "rlx_rope_split" in text and "rlx_rope_merge" in text
    assert " concatenate(" not in text and " slice(" not in text


def test_rope_split_composes_with_the_projection_and_matches_plain_jax():
    """q, k, v from one packed product, fed to several consumers (k twice): gradients of the
    input, the packed weight and the tables equal the sliced plain-JAX rope's."""
    kx, kw, ka = jax.random.split(jax.random.PRNGKey(5), 3)
    b, s, width, hd, heads = 2, 6, 16, 8, (4, 2, 2)
    x = jax.random.normal(kx, (b, s, width), jnp.float32)
    w = jax.random.normal(kw, (width, sum(heads) * hd), jnp.float32) / 4
    ang = jax.random.normal(ka, (s, hd // 2), jnp.float32)
    c, sn = jnp.cos(ang), jnp.sin(ang)

    def loss(x, w, c, sn, fused):
        qkv = jnp.matmul(x, w, precision="highest")
        if fused:
            q, k, v = rope_split(qkv, c, sn, heads, rotate=(True, True, False), head_dim=hd)
        else:
            q, k, v = (qkv[..., a * hd:(a + h) * hd] for a, h in ((0, 4), (4, 2), (6, 2)))
            q, k = rope(q, c, sn, head_dim=hd), rope(k, c, sn, head_dim=hd)
        k2 = jnp.concatenate([k, k], -1)
        return jnp.sum(jnp.tanh(q * k2)) + jnp.sum(v * k) + jnp.sum(jnp.sin(v))

    args = (x, w, c, sn)
    got = jax.grad(lambda *a: loss(*a, True), argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(lambda *a: loss(*a, False), argnums=(0, 1, 2, 3))(*args)
    for g, r in zip(got, want):
        assert_close(g, r)


def test_rope_split_check_grads_f64_every_mode(x64):
    x, c, s = _inputs((2,), 4, 4, 6, 3, jnp.float64)
    c, s = c.astype(jnp.float64), s.astype(jnp.float64)
    f = lambda x, c, s: rope_split(x, c, s, (2, 1, 1), rotate=(True, False, True), head_dim=6, n_rot=4)
    check_grads(f, (x, c, s), order=2, modes=("fwd", "rev"))
    # the transpose (merge) differentiated again: the Hessian-vector product of a loss
    loss = lambda x: sum(jnp.sum(jnp.sin(p) * (i + 1)) for i, p in enumerate(f(x, c, s)))
    check_grads(jax.grad(loss), (x,), order=1, modes=("fwd", "rev"))


def test_rope_split_vmap_and_scan():
    x, c, s = _inputs((2,), 5, 3, 8, 4)
    f = lambda x: rope_split(x, c, s, (2, 1), rotate=(True, False), head_dim=8)
    xb = jnp.stack([x, 2 * x], axis=1)  # batch on axis 1
    got = jax.vmap(f, in_axes=1, out_axes=1)(xb)
    want = _packed_oracle(2 * x, c, s, (2, 1), (True, False), 8, 8)
    assert_close(got[0][:, 1], want[0])
    assert_close(got[1][:, 1], want[1])
    cb = jnp.stack([c, s])  # batched tables fall back to the reference
    got = jax.vmap(lambda c: rope_split(x, c, s, (2, 1), head_dim=8))(cb)
    assert_close(got[0][1], _packed_oracle(x, s, s, (2, 1), (True, True), 8, 8)[0])
    loss = lambda x: sum(jnp.sum(p ** 3) for p in f(x))
    g = jax.vmap(jax.grad(loss))(jnp.stack([x, -x]))
    assert_close(g[1], jax.grad(loss)(-x))
    # inside scan, under remat
    def body(carry, x):
        return carry + jax.checkpoint(loss)(x), None
    total = lambda xs: jax.lax.scan(body, 0.0, xs)[0]
    xs = jnp.stack([x, 0.5 * x, -x])
    assert_close(jax.grad(total)(xs), jnp.stack([jax.grad(loss)(a) for a in xs]))


def test_rope_split_errors():
    x, c, s = _inputs((2,), 5, 4, 8, 4)
    with pytest.raises(ValueError, match="sum to 3"):
        rope_split(x, c, s, (2, 1), head_dim=8)
    with pytest.raises(TypeError, match="sequence of head counts"):
        rope_split(x, c, s, 4, head_dim=8)
    with pytest.raises(ValueError, match="positive ints"):
        rope_split(x, c, s, (4, 0), head_dim=8)
    with pytest.raises(ValueError, match="positive ints"):
        rope_split(x, c, s, (1,) * 4 + (0,) * 5, head_dim=8)
    with pytest.raises(ValueError, match="positive ints"):
        rope_split(x, c, s, (1,) * 9, head_dim=2)
    with pytest.raises(ValueError, match="one bool per part"):
        rope_split(x, c, s, (2, 2), rotate=(True,), head_dim=8)
    with pytest.raises(ValueError, match="one bool per part"):
        rope_split(x, c, s, (2, 2), rotate=(1, 0), head_dim=8)
    with pytest.raises(ValueError, match="n_rot"):
        rope_split(x, c, s, (2, 2), head_dim=8, n_rot=3)
    with pytest.raises(ValueError, match="cos must be"):
        rope_split(x, c[:4], s, (2, 2), head_dim=8)
    with pytest.raises(TypeError, match="floating"):
        rope_split(x.astype(jnp.int32), c, s, (2, 2), head_dim=8)
