"""Gaussian splatting: fused kernel vs the pure-JAX reference (image and the six scene
gradients), finite differences on a tiny float64 scene, the cut-offs, backward options,
IR lowering of the four splat ops, zero Gaussians, determinism and errors."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import rlx_jax as rlx
from rlx_jax.ops import gaussian_splat_render, gaussian_splat_render_backward, gaussian_splat_render_meta
from rlx_jax.vjp_rules import gaussian_splat as gs
from testutil import platform


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
    """On GPU XLA's default f32 matmul is TF32-like; the reference oracle needs full f32."""
    with jax.default_matmul_precision("highest"):
        yield


def assert_close(got, want, atol, rtol, err_msg=""):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), atol=atol, rtol=rtol,
                               err_msg=err_msg)

W, H = 24, 16
META = gaussian_splat_render_meta([0.3, -0.2, -4], [0, 0, 0], [0, 1, 0], 45.0, 0.1, 100.0, [0.1, 0.2, 0.3])


def scene(n, seed=0, k=4, dtype=np.float32, spread=1.0):
    r = np.random.default_rng(seed)
    pos = r.uniform(-spread, spread, (n, 3))
    pos[:, 2] *= 0.5
    sc = np.log(r.uniform(0.05, 0.3, (n, 3)))
    rot = r.normal(size=(n, 4))
    op = r.normal(size=n)
    col = r.uniform(0, 1, (n, 3))
    sh = r.normal(size=(n, k, 3)) * 0.2
    return [np.asarray(a, dtype) for a in (pos, sc, rot, op, col, sh)]


def params(**kw):
    p = dict(gs.RENDER_DEFAULTS, width=W, height=H, tile_size=8)
    p.update(kw)
    return p


def ref_image(s, meta=META, **kw):
    return gs.reference_render(*[jnp.asarray(a) for a in s], jnp.asarray(meta, s[0].dtype), **params(**kw))[0]


def kernel_targets():
    return rlx.kernel_info()[platform()]["targets"] if platform() in rlx.kernel_info() else []


def require_kernel():
    targets = kernel_targets()
    for t in ("rlx_gaussian_splat_fwd_v1", "rlx_gaussian_splat_bwd_v1"):
        assert t in targets, f"{t} is not compiled for {platform()}: the op would silently fall back"


_render = jax.jit(lambda *a, **kw: gaussian_splat_render(*a, **kw),
                  static_argnames=("width", "height", "tile_size", "radius_scale", "alpha_cutoff",
                                   "max_splat_steps", "transmittance_threshold", "max_list_entries"))


def test_kernel_is_in_the_jitted_hlo():
    require_kernel()
    s = scene(8)
    fwd = jax.jit(lambda *a: gaussian_splat_render(*a, META, **params()))
    assert "rlx_gaussian_splat_fwd" in fwd.lower(*s).as_text()
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(gaussian_splat_render(*a, META, **params())), argnums=(0, 5)))
    assert "rlx_gaussian_splat_bwd" in grad.lower(*s).as_text()


@pytest.mark.parametrize("k,n,seed", [(0, 30, 0), pytest.param(16, 30, 4, marks=pytest.mark.slow)])
def test_kernel_matches_reference_image_and_gradients(k, n, seed):
    require_kernel()
    s = scene(n, seed=seed, k=k)
    img = gaussian_splat_render(*s, META, **params())
    ref = ref_image(s)
    assert img.shape == (H * W * 4,)
    assert_close(img, ref, atol=2e-5, rtol=1e-4)
    alpha = np.asarray(img).reshape(H, W, 4)[..., 3]
    assert alpha.max() > 0.3 and alpha.min() >= 0  # the scene is really on screen
    dy = np.random.default_rng(seed + 7).normal(size=img.shape).astype(np.float32)
    f_ker = lambda *a: jnp.sum(gaussian_splat_render(*a, META, **params()) * dy)
    f_ref = lambda *a: jnp.sum(gs.reference_render(*a, META, **params())[0] * dy)
    gk = jax.jit(jax.grad(f_ker, argnums=tuple(range(6))))(*s)
    gr = jax.jit(jax.grad(f_ref, argnums=tuple(range(6))))(*s)
    for name, a, b in zip(("positions", "scales", "rotations", "opacities", "colors", "sh"), gk, gr):
        scale = float(np.max(np.abs(b))) if b.size else 1.0
        assert_close(a, b, atol=2e-5 * max(scale, 1.0), rtol=1e-3, err_msg=name)
        if b.size:
            assert scale > 0, name


CUTOFFS = [dict(alpha_cutoff=0.2), dict(transmittance_threshold=0.3), dict(max_splat_steps=2),
           dict(max_list_entries=25), dict(radius_scale=1.5, tile_size=5), dict(tile_size=16, width=33, height=17)]


@pytest.mark.parametrize("kw", CUTOFFS)
def test_cutoffs_change_the_image_and_kernel_follows(kw):
    require_kernel()
    s = scene(40, seed=5)
    p = params(**kw)
    img = gaussian_splat_render(*s, META, **p)
    ref = jax.jit(lambda *a: gs.reference_render(*a, META, **p)[0])(*s)
    assert_close(img, ref, atol=2e-5, rtol=1e-4)
    base = gs.reference_render(*s, META, **params(width=p["width"], height=p["height"]))[0]
    if kw is CUTOFFS[5]:  # the tile size alone does not change the image
        assert_close(ref, base, atol=1e-6, rtol=1e-5)
    else:
        assert float(jnp.max(jnp.abs(ref - base))) > 1e-2, "the option had no effect"
    if kw is not CUTOFFS[1]:
        return  # gradients: one option here (test_backward_options covers more) on this 2-core budget
    dy = np.random.default_rng(3).normal(size=img.shape).astype(np.float32)
    gk = gaussian_splat_render_backward(*s, META, dy, **p, loss_grad_clip=0.0, sh_band=-1, max_anisotropy=0.0)
    gr = jax.jit(lambda *a: gs.reference_backward(*a, META, dy, loss_grad_clip=0.0, sh_band=-1, max_anisotropy=0.0,
                                                  **p))(*s)
    for a, b in zip(gk, gr):
        assert_close(a, b, atol=2e-5 * max(float(np.max(np.abs(b))), 1.0), rtol=1e-3)


def test_reference_gradients_match_finite_differences(x64):
    """Tiny float64 scene, cut-offs off so the image is smooth in the scene."""
    from jax.test_util import check_grads

    s = [jnp.asarray(a) for a in scene(3, seed=11, k=4, dtype=np.float64)]
    meta = jnp.asarray(META, jnp.float64)
    p = params(width=8, height=6, tile_size=4, alpha_cutoff=0.0, transmittance_threshold=0.0, radius_scale=30.0)
    f = jax.jit(lambda *a: jnp.sum(gs.reference_render(*a, meta, **p)[0] ** 2))
    check_grads(f, s, order=1, modes=["rev"], atol=1e-5, rtol=1e-5)


def test_kernel_gradients_match_finite_differences(x64):
    """f32 kernel gradient vs central differences of the float64 reference."""
    require_kernel()
    s = scene(4, seed=12, k=4)
    p = params(width=8, height=8, tile_size=4, alpha_cutoff=0.0, transmittance_threshold=0.0, radius_scale=30.0)
    dy = np.random.default_rng(1).normal(size=8 * 8 * 4)
    g = jax.grad(lambda *a: jnp.sum(gaussian_splat_render(*a, META, **p) * dy.astype(np.float32)),
                 argnums=tuple(range(6)))(*s)
    assert g[0].dtype == jnp.float32
    meta = jnp.asarray(META, jnp.float64)
    loss = jax.jit(lambda *a: jnp.sum(gs.reference_render(*a, meta, **p)[0] * dy))
    eps = 1e-6
    for i in range(6):
        for j in list(np.ndindex(s[i].shape))[:3]:
            hi = [a.astype(np.float64) for a in s]
            lo = [a.astype(np.float64) for a in s]
            hi[i][j] += eps
            lo[i][j] -= eps
            fd = float(loss(*hi) - loss(*lo)) / (2 * eps)
            assert abs(float(g[i][j]) - fd) <= 2e-3 * max(1.0, abs(fd)), (i, j, float(g[i][j]), fd)


def test_backward_options():
    require_kernel()
    s = scene(40, seed=6, k=9)
    s[1][:, 0] = s[1][:, 1] + 3.0  # strongly anisotropic Gaussians
    dy = 5 * np.random.default_rng(2).normal(size=W * H * 4).astype(np.float32)
    opts = dict(loss_grad_clip=0.5, sh_band=1, max_anisotropy=4.0)
    gk = gaussian_splat_render_backward(*s, META, dy, **params(), **opts)
    gr = jax.jit(lambda *a: gs.reference_backward(*a, META, dy, **params(), **opts))(*s)
    for a, b in zip(gk, gr):
        assert_close(a, b, atol=2e-5 * max(float(np.max(np.abs(b))), 1.0), rtol=1e-3)
    assert np.all(np.asarray(gk[5])[:, 4:] == 0) and np.any(np.asarray(gk[5])[:, :4] != 0)
    off = gaussian_splat_render_backward(*s, META, dy, **params(), loss_grad_clip=0.0, sh_band=-1, max_anisotropy=0.0)
    exact = jax.grad(lambda *a: jnp.sum(gaussian_splat_render(*a, META, **params()) * dy), argnums=tuple(range(6)))(*s)
    for a, b, c in zip(off, exact, gk):
        assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert float(np.max(np.abs(np.asarray(off[0]) - np.asarray(gk[0])))) > 1e-3
    packed = gaussian_splat_render_backward(*s, META, dy, **params(), **opts, packed=True)
    assert packed.shape == (14 * 40 + 40 * 9 * 3,)
    assert_close(packed, np.concatenate([np.ravel(g) for g in gk]), atol=0, rtol=0)


def test_deterministic():
    require_kernel()
    s = scene(200, seed=8, spread=1.5)
    dy = np.random.default_rng(0).normal(size=W * H * 4).astype(np.float32)
    f = jax.jit(lambda *a: gaussian_splat_render_backward(*a, META, dy, **params(), packed=True))
    a, b = f(*s), f(*s)
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_zero_gaussians_render_background_and_have_empty_gradients():
    s = scene(0)
    img = np.asarray(gaussian_splat_render(*s, META, **params())).reshape(H, W, 4)
    assert np.allclose(img[..., :3], [0.1, 0.2, 0.3]) and np.all(img[..., 3] == 0)
    g = jax.grad(lambda p, c: jnp.sum(gaussian_splat_render(p, s[1], s[2], s[3], c, s[5], META, **params())),
                 argnums=(0, 1))(s[0], s[4])
    assert g[0].shape == (0, 3) and g[1].shape == (0, 3)
    assert gaussian_splat_render_backward(*s, META, np.ones(W * H * 4, np.float32), **params(), packed=True).shape == (0,)


def test_behind_camera_and_flat_inputs():
    require_kernel()
    s = scene(30, seed=9)
    s[0][:10, 2] = -6.0  # behind the camera (at z = -4)
    img = gaussian_splat_render(*[a.reshape(-1) for a in s], META, **params())
    assert_close(img, ref_image(s), atol=2e-5, rtol=1e-4)
    g = jax.grad(lambda p: jnp.sum(gaussian_splat_render(p, *s[1:], META, **params())))(s[0])
    assert np.all(np.asarray(g)[:10] == 0) and np.any(np.asarray(g)[10:] != 0)


def test_forward_mode_and_f64_reference_fallback(x64):
    s = [a.astype(np.float64) for a in scene(10, seed=4)]
    meta = np.asarray(META, np.float64)
    t = [np.ones_like(a) * 1e-2 for a in s]
    out, tan = jax.jit(lambda s, t: jax.jvp(lambda *a: gaussian_splat_render(*a, meta, **params()), s, t))(
        tuple(s), tuple(t))
    _, tref = jax.jit(lambda s, t: jax.jvp(lambda *a: gs.reference_render(*a, meta, **params())[0], s, t))(
        tuple(s), tuple(t))
    assert out.dtype == jnp.float64
    assert_close(tan, tref, atol=1e-10, rtol=1e-8)


def test_meta_layout():
    m = np.asarray(gaussian_splat_render_meta([1, 2, 3], [4, 5, 6], [0, 0, 1], 50.0, 0.5, 80.0, [0.1, 0.2, 0.3],
                                              width=64, height=32, tile_size=8, max_list_entries=1000))
    assert m.shape == (23,)
    assert_close(m, [1, 2, 3, 4, 5, 6, 0, 0, 1, 50, 0.5, 80, 0.1, 0.2, 0.3, 64, 32, 8, 3.0, 1 / 255, 1024, 1e-4, 1000],
                 atol=0, rtol=1e-6)


def test_errors():
    s = scene(4)
    with pytest.raises(ValueError, match="multiple of 3"):
        gaussian_splat_render(np.zeros(7, np.float32), *s[1:], META, width=8, height=8)
    with pytest.raises(ValueError, match="scales"):
        gaussian_splat_render(s[0], s[1][:3], *s[2:], META, width=8, height=8)
    with pytest.raises(ValueError, match="meta"):
        gaussian_splat_render(*s, META[:20], width=8, height=8)
    with pytest.raises(ValueError, match="at most 16"):
        gaussian_splat_render(*s[:5], np.zeros((4, 17, 3), np.float32), META, width=8, height=8)
    with pytest.raises(ValueError, match="width"):
        gaussian_splat_render(*s, META, width=0, height=8)
    with pytest.raises(TypeError):
        gaussian_splat_render(s[0].astype(np.int32), *s[1:], META, width=8, height=8)
    with pytest.raises(ValueError, match="dy"):
        gaussian_splat_render_backward(*s, META, np.zeros(5, np.float32), width=8, height=8)


# ---- IR lowering ------------------------------------------------------------------------


def _graph(n, k, build):
    g = rlx.Graph("splat")
    ids = [g.input(nm, [d], "f32") for nm, d in (("p", 3 * n), ("s", 3 * n), ("r", 4 * n), ("o", n), ("c", 3 * n),
                                                  ("sh", n * k * 3), ("meta", 23))]
    g.set_outputs([build(g, ids)])
    return rlx.to_jax(g)


def _flat(s):
    names = ("p", "s", "r", "o", "c", "sh")
    return {**{nm: a.reshape(-1) for nm, a in zip(names, s)}, "meta": np.asarray(META)}


def test_lowering_render_prepare_rasterize_and_backward():
    n, k = 30, 4
    s = scene(n, seed=13, k=k)
    kw = dict(width=W, height=H, tile_size=8, max_list_entries=4096)
    want = np.asarray(gaussian_splat_render(*s, META, **params(max_list_entries=4096)))
    fused = _graph(n, k, lambda g, ids: g.gaussian_splat_render(*ids, **kw))({}, _flat(s))[0]
    assert_close(fused, want, atol=2e-5, rtol=1e-4)
    from rlx_jax.lowering.splat import prep_len

    length = prep_len(n, W, H, 8, 4096)

    def two_stage(g, ids):
        prep = g.gaussian_splat_prepare(ids, [length], **kw)
        return g.gaussian_splat_rasterize(prep, ids[6], width=W, height=H, tile_size=8, max_list_entries=4096)

    staged = _graph(n, k, two_stage)({}, _flat(s))[0]
    assert_close(staged, want, atol=2e-5, rtol=1e-4)
    dy = np.random.default_rng(4).normal(size=W * H * 4).astype(np.float32)
    g = rlx.Graph("splat_bwd")
    ids = [g.input(nm, [d], "f32") for nm, d in (("p", 3 * n), ("s", 3 * n), ("r", 4 * n), ("o", n), ("c", 3 * n),
                                                  ("sh", n * k * 3), ("meta", 23), ("dy", W * H * 4))]
    g.set_outputs([g.gaussian_splat_render_backward(ids[:7], ids[7], **kw)])
    packed = rlx.to_jax(g)({}, {**_flat(s), "dy": dy})[0]
    want_b = gaussian_splat_render_backward(*s, META, dy, **params(max_list_entries=4096), packed=True)
    assert packed.shape == (14 * n + n * k * 3,)
    assert_close(packed, want_b, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_larger_scene_kernel_vs_reference():
    require_kernel()
    s = scene(3000, seed=21, spread=2.0)
    p = params(width=128, height=96, tile_size=16)
    img = gaussian_splat_render(*s, META, **p)
    assert_close(img, gs.reference_render(*s, META, **p)[0], atol=1e-4, rtol=1e-3)
