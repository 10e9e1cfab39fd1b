"""Gaussian splatting on the GPU: the CUDA kernels (rlx_gaussian_splat_fwd / _bwd on
platform CUDA) against the pure-JAX reference in f32 (full-precision matmuls), the
per-tile depth order read back from the kernel's scratch (long lists that take the
merge path, equal depths ordered by index, truncation by max_list_entries), bitwise
determinism of the backward, edge cases and the scratch-size check. Skipped where JAX
sees no GPU or the CUDA module is not built.

``test_small_scenes_for_sanitizer`` touches no reference (quick under compute-sanitizer):
    compute-sanitizer --tool memcheck python3 -m pytest -q tests/test_gaussian_splat_gpu.py -k sanitizer
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import rlx_jax as rlx
from rlx_jax.ops import gaussian_splat_render, gaussian_splat_render_backward, gaussian_splat_render_meta
from rlx_jax.vjp_rules import gaussian_splat as gs

from gpu_testutil import requires_gpu

pytestmark = requires_gpu

TARGETS = ("rlx_gaussian_splat_fwd_v1", "rlx_gaussian_splat_bwd_v1")
META = gaussian_splat_render_meta([0.3, -0.2, -4], [0, 0, 0], [0, 1, 0], 45.0, 0.1, 100.0, [0.1, 0.2, 0.3])
NAMES = ("positions", "scales", "rotations", "opacities", "colors", "sh")


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
    """XLA's default f32 matmul on GPU rounds to TF32-like precision: the reference oracle
    needs full f32 (the kernels use plain f32 arithmetic)."""
    with jax.default_matmul_precision("highest"):
        yield


def require_cuda_kernel():
    info = rlx.kernel_info().get("cuda", {})
    for t in TARGETS:
        assert t in info.get("targets", []), f"{t} is not compiled for CUDA ({info.get('error')}): it would fall back"


def scene(n, seed=0, k=4, spread=1.0, scale=(0.05, 0.3)):
    r = np.random.default_rng(seed)
    pos = r.uniform(-spread, spread, (n, 3))
    pos[:, 2] *= 0.5
    sc = np.log(r.uniform(scale[0], scale[1], (n, 3)))
    rot = r.normal(size=(n, 4))
    op = r.normal(size=n)
    col = r.uniform(0, 1, (n, 3))
    sh = r.normal(size=(n, k, 3)) * 0.2
    return [np.asarray(a, np.float32) for a in (pos, sc, rot, op, col, sh)]


def params(**kw):
    p = dict(gs.RENDER_DEFAULTS, width=24, height=16, tile_size=8)
    p.update(kw)
    return p


def close(got, want, atol, rtol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=what)


def test_cuda_targets_are_in_the_lowered_hlo():
    require_cuda_kernel()
    s = scene(8)
    p = params()
    fwd = jax.jit(lambda *a: gaussian_splat_render(*a, META, **p))
    assert "rlx_gaussian_splat_fwd_v1" in fwd.lower(*s).as_text()
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(gaussian_splat_render(*a, META, **p)), argnums=(0, 5)))
    assert "rlx_gaussian_splat_bwd_v1" in grad.lower(*s).as_text()


CONFIGS = [
    dict(n=30, k=0, seed=0, p={}),
    dict(n=30, k=16, seed=4, p={}),
    dict(n=40, k=4, seed=5, p=dict(alpha_cutoff=0.2)),
    dict(n=40, k=4, seed=5, p=dict(transmittance_threshold=0.3)),
    dict(n=40, k=4, seed=5, p=dict(max_splat_steps=2)),
    dict(n=40, k=4, seed=5, p=dict(max_list_entries=25)),
    dict(n=40, k=4, seed=5, p=dict(radius_scale=1.5, tile_size=5)),
    dict(n=40, k=9, seed=5, p=dict(tile_size=16, width=33, height=17)),
    dict(n=3000, k=4, seed=21, p=dict(width=128, height=96, tile_size=16), spread=2.0),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"n{c['n']}-k{c['k']}-{'-'.join(c['p']) or 'default'}" for c in CONFIGS])
def test_image_and_gradients_match_reference(cfg):
    require_cuda_kernel()
    s = scene(cfg["n"], seed=cfg["seed"], k=cfg["k"], spread=cfg.get("spread", 1.0))
    p = params(**cfg["p"])
    img = jax.jit(lambda *a: gaussian_splat_render(*a, META, **p))(*s)
    ref = jax.jit(lambda *a: gs.reference_render(*a, META, **p)[0])(*s)
    close(img, ref, 2e-5, 1e-4, "image")
    assert float(np.max(np.asarray(img).reshape(-1, 4)[:, 3])) > 0.3  # the scene is on screen
    dy = np.random.default_rng(cfg["seed"] + 7).normal(size=img.shape).astype(np.float32)
    gk = jax.jit(jax.grad(lambda *a: jnp.sum(gaussian_splat_render(*a, META, **p) * dy), argnums=tuple(range(6))))(*s)
    gr = jax.jit(jax.grad(lambda *a: jnp.sum(gs.reference_render(*a, META, **p)[0] * dy),
                          argnums=tuple(range(6))))(*s)
    for name, a, b in zip(NAMES, gk, gr):
        scale = float(np.max(np.abs(b))) if b.size else 1.0
        close(a, b, 2e-5 * max(scale, 1.0), 1e-3, name)
        if b.size and name != "sh":
            assert scale > 0, f"{name}: the reference gradient is zero, the comparison proves nothing"


def test_backward_options_match_reference():
    require_cuda_kernel()
    s = scene(40, seed=6, k=9)
    s[1][:, 0] = s[1][:, 1] + 3.0  # strongly anisotropic: the anisotropy limit clamps
    p = params()
    dy = 5 * np.random.default_rng(2).normal(size=p["width"] * p["height"] * 4).astype(np.float32)
    opts = dict(loss_grad_clip=0.5, sh_band=1, max_anisotropy=4.0)
    gk = gaussian_splat_render_backward(*s, META, dy, **p, **opts)
    gr = jax.jit(lambda *a: gs.reference_backward(*a, META, dy, **p, **opts))(*s)
    for name, a, b in zip(NAMES, gk, gr):
        close(a, b, 2e-5 * max(float(np.max(np.abs(b))), 1.0), 1e-3, name)
    assert np.all(np.asarray(gk[5])[:, 4:] == 0) and np.any(np.asarray(gk[5])[:, :4] != 0)


def _raw_forward(s, meta, p):
    """(image, scratch) of the CUDA forward called directly."""
    n = s[0].shape[0]
    out = (jax.ShapeDtypeStruct((p["height"] * p["width"] * 4,), jnp.float32),
           jax.ShapeDtypeStruct((gs.cuda_scratch_elems(n, p),), jnp.int32))
    return jax.ffi.ffi_call("rlx_gaussian_splat_fwd_v1", out)(*[jnp.asarray(a) for a in s], jnp.asarray(meta),
                                                          **gs._attrs(p))


def _decode_lists(scratch, n, p):
    """The forward's scratch layout (ffi/cuda/gaussian_splat.cu, carve): camera 32, keys
    4e, sorted Gaussians e, then per Gaussian 10 floats (depth last), tile boxes 4,
    counts, offsets n + 1, totals 2, limited scales 3n, flags ceil(3n/4), tile starts."""
    e = p["max_list_entries"]
    tiles_x, tiles_y = -(-p["width"] // p["tile_size"]), -(-p["height"] // p["tile_size"])
    sc = np.asarray(scratch)
    o = 32 + 4 * e
    sg = sc[o:o + e]; o += e
    gf = sc[o:o + 10 * n].view(np.float32).reshape(n, 10); o += 10 * n
    rect = sc[o:o + 4 * n].reshape(n, 4); o += 4 * n
    cnt = sc[o:o + n]; o += n
    off = sc[o:o + n]; o += n + 1
    total = sc[o:o + 2]; o += 2 + 3 * n + (3 * n + 3) // 4
    tile_start = sc[o:o + tiles_x * tiles_y + 1]
    return sg, gf[:, 9], rect, cnt, off, total, tile_start, tiles_x, tiles_y


@pytest.mark.parametrize("max_list", [1 << 20, 75_001])
def test_long_tile_lists_are_sorted_by_depth_then_index(max_list):
    """10,000 large Gaussians cover all 16 tiles: 10,000 entries per tile (more than the
    4096 the kernel sorts in shared memory, so the merge passes run, with an odd run);
    Gaussians 5000..5999 copy the positions of 0..999, so equal depths occur and must be
    ordered by index as the CPU kernel and the reference order them."""
    require_cuda_kernel()
    n = 10_000
    s = scene(n, seed=3, spread=0.05, scale=(0.3, 0.6))
    s[0][:, 2] = np.random.default_rng(4).uniform(-1.0, 1.0, n)  # depths 3..5: few near-ties
    s[0][5000:6000] = s[0][:1000]
    p = params(width=32, height=32, tile_size=8, max_list_entries=max_list)
    img, scratch = _raw_forward(s, META, p)
    sg, depth, rect, cnt, off, total, tile_start, tiles_x, tiles_y = _decode_lists(scratch, n, p)
    assert np.all(cnt[:] > 0)
    kept = min(int(cnt.astype(np.int64).sum()), max_list)
    assert int(total[1]) == kept and int(tile_start[-1]) == kept
    ties = longest = 0
    for t in range(tiles_x * tiles_y):
        tx, ty = t % tiles_x, t // tiles_x
        inside = (rect[:, 0] <= tx) & (tx < rect[:, 1]) & (rect[:, 2] <= ty) & (ty < rect[:, 3])
        rank = off.astype(np.int64) + (ty - rect[:, 2]) * (rect[:, 1] - rect[:, 0]) + (tx - rect[:, 0])
        want = np.nonzero(inside & (rank < max_list))[0]
        want = want[np.lexsort((want, depth[want]))]
        got = sg[tile_start[t]:tile_start[t + 1]]
        assert np.array_equal(got, want), f"tile {t}: {len(got)} entries, order differs from (depth, index)"
        ties += int(np.sum(np.diff(depth[want]) == 0))
        longest = max(longest, len(want))
    assert ties > 0, "no equal depths: the tie-break was not exercised"
    if max_list == 1 << 20:
        assert longest > 8192  # three sorted chunks in a tile, two merge passes
    ref = jax.jit(lambda *a: gs.reference_render(*a, META, **p)[0])(*s)
    close(img, ref, 2e-5, 1e-4, "image")


def test_equal_depths_composite_in_index_order():
    """Copies of one Gaussian (same position, so the same depth) with different colours:
    the image depends on their order; it must be the reference's (index order)."""
    require_cuda_kernel()
    s = scene(12, seed=1, k=4)
    for a in (s[0], s[1], s[2]):
        a[6:] = a[:6]
    s[3][:] = 2.0  # opaque enough that the order matters
    p = params()
    img = gaussian_splat_render(*s, META, **p)
    ref = jax.jit(lambda *a: gs.reference_render(*a, META, **p)[0])(*s)
    close(img, ref, 2e-5, 1e-4, "image")
    swapped = [a.copy() for a in s]
    swapped[4][:6], swapped[4][6:] = s[4][6:], s[4][:6]
    assert float(np.max(np.abs(np.asarray(gaussian_splat_render(*swapped, META, **p)) - np.asarray(img)))) > 1e-2


def test_backward_is_bitwise_deterministic():
    require_cuda_kernel()
    s = scene(2000, seed=8, spread=1.5)
    p = params(width=64, height=48, tile_size=16)
    dy = np.random.default_rng(0).normal(size=64 * 48 * 4).astype(np.float32)
    f = jax.jit(lambda *a: gaussian_splat_render_backward(*a, META, dy, **p, packed=True))
    g = jax.jit(lambda *a: gaussian_splat_render(*a, META, **p))
    first, img = np.asarray(f(*s)), np.asarray(g(*s))
    assert np.any(first != 0)
    for _ in range(3):
        assert np.array_equal(np.asarray(f(*s)), first)
        assert np.array_equal(np.asarray(g(*s)), img)


def test_no_list_entries_render_the_background():
    require_cuda_kernel()
    s = scene(20, seed=2)
    p = params(max_list_entries=0)
    img = np.asarray(gaussian_splat_render(*s, META, **p)).reshape(-1, 4)
    assert np.allclose(img[:, :3], [0.1, 0.2, 0.3]) and np.all(img[:, 3] == 0)
    g = gaussian_splat_render_backward(*s, META, np.ones(24 * 16 * 4, np.float32), **p, packed=True)
    assert np.all(np.asarray(g) == 0)


def test_scratch_too_small_is_an_error():
    require_cuda_kernel()
    s = scene(5)
    p = params()
    out = (jax.ShapeDtypeStruct((p["height"] * p["width"] * 4,), jnp.float32),
           jax.ShapeDtypeStruct((gs.cuda_scratch_elems(5, p) - 1,), jnp.int32))
    with pytest.raises(Exception, match="scratch"):
        jax.block_until_ready(jax.ffi.ffi_call("rlx_gaussian_splat_fwd_v1", out)(*s, META, **gs._attrs(p)))


@pytest.mark.parametrize("n,w,h,ts", [(300, 24, 16, 8), (50, 13, 7, 5), (4500, 8, 8, 8)])
def test_small_scenes_for_sanitizer(n, w, h, ts):
    """Forward and backward without the reference (cheap under compute-sanitizer); the
    4500-Gaussian single tile takes the shared-memory sort and one merge pass."""
    require_cuda_kernel()
    s = scene(n, seed=n, spread=0.3 if n > 1000 else 1.0)
    p = params(width=w, height=h, tile_size=ts)
    dy = np.random.default_rng(n).normal(size=w * h * 4).astype(np.float32)
    img = np.asarray(gaussian_splat_render(*s, META, **p))
    g = np.asarray(gaussian_splat_render_backward(*s, META, dy, **p, loss_grad_clip=0.0, sh_band=-1,
                                                  max_anisotropy=0.0, packed=True))
    assert np.isfinite(img).all() and np.isfinite(g).all() and np.any(g != 0)
    g2 = np.asarray(gaussian_splat_render_backward(*s, META, dy, **p, loss_grad_clip=0.0, sh_band=-1,
                                                   max_anisotropy=0.0, packed=True))
    assert np.array_equal(g, g2)
