"""Differentiable 3-D Gaussian splatting (RLX ``GaussianSplatRender``).

Scene: positions [P, 3] (world), scales [P, 3] (log standard deviations), rotations
[P, 4] (quaternions, x y z w, normalised inside), opacities [P] (logits: alpha is
``sigmoid``), colors [P, 3] (base RGB), sh_coeffs [P, K, 3] (K <= 16 real spherical
harmonic coefficients, 3DGS order and signs), meta [23] as
:func:`gaussian_splat_render_meta` builds it. Output: RGBA image [height * width * 4],
row-major, y growing with the camera's up vector (RLX's screen convention).

Maths (3DGS, Kerbl et al. 2023, with the gsplat conventions for the compositing):

- camera: RLX ``look_at``: forward f = |target - position|, right r = |up x f|,
  up' = f x r; p_cam = [r; up'; f] (p - position); focal fx = fy = 0.5 H / tan(fov/2),
  principal point (W/2, H/2); screen (u, v) = (fx x/z + W/2, fy y/z + H/2). A Gaussian
  is visible when near < z < far.
- covariance: Sigma = R diag(exp(2 s)) R^T, projected with the perspective Jacobian J:
  Sigma2 = J W Sigma W^T J^T + 0.3 I (the 3DGS low-pass), conic = Sigma2^-1.
- colour: colors + sum_k Y_k(d) sh_k with d = |p - camera position| (no clamp, so both
  colour inputs are differentiable everywhere).
- binning: radius = radius_scale * sqrt(largest eigenvalue of Sigma2); the Gaussian
  covers the tiles (tile_size pixels square) its [u +- radius] x [v +- radius] box
  touches. Tile-Gaussian pairs are numbered Gaussian by Gaussian (tiles row-major within
  one Gaussian); pairs numbered >= max_list_entries are dropped.
- per tile the Gaussians are composited front to back in (depth, index) order at pixel
  centres (x + 0.5, y + 0.5): alpha = min(0.99, sigmoid(o) exp(-q/2)); a Gaussian with
  alpha < alpha_cutoff is skipped; at most max_splat_steps Gaussians are composited per
  pixel; compositing stops before a Gaussian that would take the transmittance T below
  transmittance_threshold. RGB = sum c_i alpha_i T_i + T background; A = 1 - T.

The discrete choices (visibility, tiles, order, cut-offs) carry no gradient; the
gradient is the exact derivative of the rendered image elsewhere. Camera and render
parameters in meta[15:] are informational: the keyword arguments are authoritative.

Backward options (``gaussian_splat_render_backward``, the RLX op
GaussianSplatRenderBackward): ``loss_grad_clip`` > 0 clips the image gradient
elementwise to [-clip, clip] first; ``sh_band`` >= 0 keeps the gradient of the SH
coefficients of bands <= sh_band (the first (sh_band + 1)^2) and zeroes the rest;
``max_anisotropy`` > 0 differentiates the render of the scene whose log-scales are raised
to at least max(log-scale) - log(max_anisotropy) (RLX's anisotropy limit on the support
ellipsoid), so a clamped axis gets no scale gradient. Values <= 0 (sh_band < 0) switch
an option off; ``jax.grad`` of :func:`gaussian_splat_render` uses all three off.

Primitives: ``rlx_gaussian_splat_fwd`` (scene -> image), ``rlx_gaussian_splat_tangent``
(the JVP of the reference, linear in the scene tangents) whose transpose is
``rlx_gaussian_splat_bwd`` (the fused backward kernel: it re-runs projection, binning
and sorting, replays each pixel's compositing back to front and reduces per-pair
gradients Gaussian by Gaussian in a fixed order, so it is deterministic).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from rlx_jax._kernels import target as ffi_target
from rlx_jax.vjp_rules._primitive import NOT_MAPPED, FusedPrimitive, instantiate, np_scalar

META_LEN = 23
MAX_SH = 16
LOW_PASS = 0.3
ALPHA_MAX = 0.99

SH_C0 = 0.28209479177387814
SH_C1 = 0.4886025119029199
SH_C2 = (1.0925484305920792, -1.0925484305920792, 0.31539156525252005, -1.0925484305920792, 0.5462742152960396)
SH_C3 = (-0.5900435899266435, 2.890611442640554, -0.4570457994644658, 0.3731763325901154,
         -0.4570457994644658, 1.445305721320277, -0.5900435899266435)

RENDER_DEFAULTS = dict(tile_size=16, radius_scale=3.0, alpha_cutoff=1.0 / 255.0, max_splat_steps=1024,
                       transmittance_threshold=1e-4, max_list_entries=1 << 20)


# ---- pure-JAX reference (the test oracle) ---------------------------------------------


def sh_basis(d, k: int):
    """The first k real SH basis functions (3DGS signs) at unit directions d [..., 3]."""
    x, y, z = d[..., 0], d[..., 1], d[..., 2]
    xx, yy, zz = x * x, y * y, z * z
    one = jnp.ones_like(x)
    b = [SH_C0 * one, -SH_C1 * y, SH_C1 * z, -SH_C1 * x,
         SH_C2[0] * x * y, SH_C2[1] * y * z, SH_C2[2] * (2 * zz - xx - yy), SH_C2[3] * x * z, SH_C2[4] * (xx - yy),
         SH_C3[0] * y * (3 * xx - yy), SH_C3[1] * x * y * z, SH_C3[2] * y * (4 * zz - xx - yy),
         SH_C3[3] * z * (2 * zz - 3 * xx - 3 * yy), SH_C3[4] * x * (4 * zz - xx - yy),
         SH_C3[5] * z * (xx - yy), SH_C3[6] * x * (xx - 3 * yy)]
    return jnp.stack(b[:k], axis=-1) if k else jnp.zeros(d.shape[:-1] + (0,), d.dtype)


def camera_from_meta(meta):
    """(position, basis [3, 3] rows right/up/forward, fov_y degrees, near, far, background)."""
    meta = jax.lax.stop_gradient(meta)

    def unit(v):
        return v / jnp.maximum(jnp.linalg.norm(v), 1e-8)

    pos, target, up = meta[0:3], meta[3:6], unit(meta[6:9])
    fwd = unit(target - pos)
    right = unit(jnp.cross(up, fwd))
    upc = unit(jnp.cross(fwd, right))
    return pos, jnp.stack([right, upc, fwd]), meta[9], meta[10], meta[11], meta[12:15]


def quat_to_rot(q):
    """xyzw quaternions [..., 4] (normalised here) -> rotation matrices [..., 3, 3]."""
    q = q / jnp.sqrt(jnp.sum(q * q, axis=-1, keepdims=True))
    x, y, z, w = q[..., 0], q[..., 1], q[..., 2], q[..., 3]
    r = [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
         2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
         2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]
    return jnp.stack(r, axis=-1).reshape(q.shape[:-1] + (3, 3))


def project(positions, scales, rotations, colors, sh_coeffs, meta, *, width, height):
    """Per-Gaussian projection: (u, v, depth, conic [P, 3] (a, b, c), rgb [P, 3], visible,
    eigenvalue bound [P]). Differentiable in the scene; meta is treated as a constant."""
    cam, basis, fov, near, far, _ = camera_from_meta(meta)
    dt = positions.dtype
    f = (0.5 * height / jnp.tan(0.5 * jnp.deg2rad(fov))).astype(dt)
    pc = (positions - cam) @ basis.T
    x, y, z = pc[:, 0], pc[:, 1], pc[:, 2]
    visible = (z > near) & (z < far)
    zs = jnp.where(visible, z, 1.0)
    u = f * x / zs + 0.5 * width
    v = f * y / zs + 0.5 * height
    rot = quat_to_rot(rotations)
    m = rot * jnp.exp(scales)[:, None, :]          # R S
    sigma = m @ jnp.swapaxes(m, 1, 2)
    sc = basis @ sigma @ basis.T
    zero = jnp.zeros_like(zs)
    jac = jnp.stack([jnp.stack([f / zs, zero, -f * x / (zs * zs)], -1),
                     jnp.stack([zero, f / zs, -f * y / (zs * zs)], -1)], 1)    # [P, 2, 3]
    s2 = jac @ sc @ jnp.swapaxes(jac, 1, 2)
    sa, sb, scc = s2[:, 0, 0] + LOW_PASS, s2[:, 0, 1], s2[:, 1, 1] + LOW_PASS
    det = sa * scc - sb * sb
    visible = visible & (det > 0)
    dets = jnp.where(visible, det, 1.0)
    conic = jnp.stack([scc / dets, -sb / dets, sa / dets], -1)
    mid = 0.5 * (sa + scc)
    lam = mid + jnp.sqrt(jnp.maximum(0.1, mid * mid - det))
    k = sh_coeffs.shape[1]
    d = positions - cam
    d = d / jnp.sqrt(jnp.sum(d * d, -1, keepdims=True))
    rgb = colors + jnp.einsum("pk,pkc->pc", sh_basis(d, k), sh_coeffs)
    return u, v, z, conic, rgb, visible, lam


def _tile_rects(u, v, r, visible, *, width, height, tile_size):
    """Integer tile boxes [x0, x1) x [y0, y1) of radius-r squares and each Gaussian's
    first pair number."""
    tiles_x, tiles_y = -(-width // tile_size), -(-height // tile_size)
    ts = float(tile_size)
    x0 = jnp.clip(jnp.floor((u - r) / ts), 0, tiles_x).astype(jnp.int32)
    x1 = jnp.clip(jnp.floor((u + r) / ts) + 1, 0, tiles_x).astype(jnp.int32)
    y0 = jnp.clip(jnp.floor((v - r) / ts), 0, tiles_y).astype(jnp.int32)
    y1 = jnp.clip(jnp.floor((v + r) / ts) + 1, 0, tiles_y).astype(jnp.int32)
    idt = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
    n = jnp.where(visible, jnp.maximum(x1 - x0, 0) * jnp.maximum(y1 - y0, 0), 0).astype(idt)
    offset = jnp.cumsum(n) - n
    return x0, x1, y0, y1, offset


def composite(u, v, depth, radius, visible, conic, rgb, opac, bg, *, width, height, tile_size, alpha_cutoff,
              max_splat_steps, transmittance_threshold, max_list_entries):
    """Bin, order and composite projected Gaussians (opac = alpha scale in [0, 1],
    radius in pixels): a ``lax.map`` over tiles of dense [tile pixels, P] arrays, each
    tile checkpointed. Returns the flat RGBA image."""
    dt = u.dtype
    tiles_x, tiles_y = -(-width // tile_size), -(-height // tile_size)
    x0, x1, y0, y1, offset = jax.lax.stop_gradient(
        _tile_rects(u, v, radius, visible, width=width, height=height, tile_size=tile_size))
    key = jnp.where(visible, jax.lax.stop_gradient(depth), jnp.inf)
    order = jnp.argsort(key, stable=True)
    u, v, conic, rgb, opac = u[order], v[order], conic[order], rgb[order], opac[order]
    x0, x1, y0, y1, offset = x0[order], x1[order], y0[order], y1[order], offset[order]
    vis = visible[order]
    ts = tile_size
    ly, lx = jnp.divmod(jnp.arange(ts * ts), ts)

    @jax.checkpoint
    def tile(t, u, v, conic, rgb, opac):
        ty, tx = t // tiles_x, t % tiles_x
        inside = vis & (tx >= x0) & (tx < x1) & (ty >= y0) & (ty < y1)
        rank = offset + (ty - y0) * (x1 - x0) + (tx - x0)
        inside = inside & (rank < max_list_entries)
        px = (tx * ts + lx).astype(dt) + 0.5
        py = (ty * ts + ly).astype(dt) + 0.5
        dx = u[None, :] - px[:, None]
        dy = v[None, :] - py[:, None]
        q = conic[None, :, 0] * dx * dx + 2 * conic[None, :, 1] * dx * dy + conic[None, :, 2] * dy * dy
        alpha = jnp.minimum(ALPHA_MAX, opac[None, :] * jnp.exp(-0.5 * q))
        mask = inside[None, :] & (alpha >= alpha_cutoff)
        mask = mask & (jnp.cumsum(mask, axis=1) <= max_splat_steps)
        a = jnp.where(mask, jax.lax.stop_gradient(alpha), 0)
        t_after = jnp.cumprod(1 - a, axis=1)
        incl = jax.lax.stop_gradient(mask & (t_after >= transmittance_threshold))
        a2 = jnp.where(incl, alpha, 0)
        t_incl = jnp.cumprod(1 - a2, axis=1)
        t_before = jnp.concatenate([jnp.ones_like(t_incl[:, :1]), t_incl[:, :-1]], axis=1)
        w = a2 * t_before
        t_final = t_incl[:, -1]
        col = w @ rgb + t_final[:, None] * bg[None, :]
        return jnp.concatenate([col, (1 - t_final)[:, None]], axis=1)

    tiles = jax.lax.map(lambda t: tile(t, u, v, conic, rgb, opac), jnp.arange(tiles_x * tiles_y))
    img = tiles.reshape(tiles_y, tiles_x, ts, ts, 4).transpose(0, 2, 1, 3, 4)
    img = img.reshape(tiles_y * ts, tiles_x * ts, 4)[:height, :width]
    return img.reshape(-1).astype(dt)


def reference_render(positions, scales, rotations, opacities, colors, sh_coeffs, meta, *, width, height,
                     tile_size, radius_scale, alpha_cutoff, max_splat_steps, transmittance_threshold,
                     max_list_entries):
    """Pure-JAX render: ``project`` then ``composite``. Returns (image [H*W*4],)."""
    dt = positions.dtype
    _, _, _, _, _, bg = camera_from_meta(meta)
    bg = bg.astype(dt)
    if positions.shape[0] == 0:
        img = jnp.broadcast_to(jnp.concatenate([bg, jnp.zeros((1,), dt)]), (height * width, 4))
        return (img.reshape(-1),)
    u, v, z, conic, rgb, visible, lam = project(positions, scales, rotations, colors, sh_coeffs, meta,
                                                width=width, height=height)
    radius = radius_scale * jnp.sqrt(jax.lax.stop_gradient(lam))
    img = composite(u, v, z, radius, visible, conic, rgb, jax.nn.sigmoid(opacities), bg, width=width,
                    height=height, tile_size=tile_size, alpha_cutoff=alpha_cutoff, max_splat_steps=max_splat_steps,
                    transmittance_threshold=transmittance_threshold, max_list_entries=max_list_entries)
    return (img,)


def _clamp_anisotropy(scales, max_anisotropy):
    if max_anisotropy is None or max_anisotropy <= 0:
        return scales
    floor = jnp.max(scales, axis=1, keepdims=True) - math.log(max(max_anisotropy, 1.0))
    return jnp.maximum(scales, jax.lax.stop_gradient(floor))


def _render_params(params):
    return {k: params[k] for k in ("width", "height", *RENDER_DEFAULTS)}


def reference_backward(positions, scales, rotations, opacities, colors, sh_coeffs, meta, dy, *,
                       loss_grad_clip, sh_band, max_anisotropy, **params):
    """VJP of the reference render with the backward options applied; returns the six
    scene gradients (positions, scales, rotations, opacities, colors, sh_coeffs)."""
    if loss_grad_clip is not None and loss_grad_clip > 0:
        dy = jnp.clip(dy, -loss_grad_clip, loss_grad_clip)
    if positions.shape[0] == 0:
        return tuple(jnp.zeros_like(a) for a in (positions, scales, rotations, opacities, colors, sh_coeffs))

    def f(pos, sc, rot, op, col, sh):
        return reference_render(pos, _clamp_anisotropy(sc, max_anisotropy), rot, op, col, sh, meta,
                                **_render_params(params))[0]

    _, vjp = jax.vjp(f, positions, scales, rotations, opacities, colors, sh_coeffs)
    grads = list(vjp(dy.astype(positions.dtype)))
    if sh_band is not None and sh_band >= 0:
        keep = jnp.arange(sh_coeffs.shape[1]) < (sh_band + 1) ** 2
        grads[5] = jnp.where(keep[None, :, None], grads[5], 0)
    return tuple(grads)


def reference_tangent(positions, scales, rotations, opacities, colors, sh_coeffs, meta,
                      tp, ts_, tr, to, tc, tsh, **params):
    """d image for scene tangents (linear in the last six operands)."""
    f = partial(lambda *a: reference_render(*a, meta, **params)[0])
    _, t = jax.jvp(f, (positions, scales, rotations, opacities, colors, sh_coeffs), (tp, ts_, tr, to, tc, tsh))
    return (t,)


# ---- kernels -----------------------------------------------------------------------------


def _attrs(params):
    return dict(width=np.int64(params["width"]), height=np.int64(params["height"]),
                tile_size=np.int64(params["tile_size"]), radius_scale=np_scalar(params["radius_scale"]),
                alpha_cutoff=np_scalar(params["alpha_cutoff"]), max_splat_steps=np.int64(params["max_splat_steps"]),
                transmittance_threshold=np_scalar(params["transmittance_threshold"]),
                max_list_entries=np.int64(params["max_list_entries"]))


def _kernel_fwd(positions, scales, rotations, opacities, colors, sh_coeffs, meta, **params):
    out = jax.ShapeDtypeStruct((params["height"] * params["width"] * 4,), positions.dtype)
    return (jax.ffi.ffi_call(ffi_target("rlx_gaussian_splat_fwd"), out)(
        positions, scales, rotations, opacities, colors, sh_coeffs, meta, **_attrs(params)),)


def _bwd_attrs(loss_grad_clip, sh_band, max_anisotropy, params):
    return dict(**_attrs(params), loss_grad_clip=np_scalar(loss_grad_clip or 0.0),
                sh_band=np.int64(-1 if sh_band is None else sh_band),
                max_anisotropy=np_scalar(max_anisotropy or 0.0))


def _kernel_bwd(positions, scales, rotations, opacities, colors, sh_coeffs, meta, dy, *,
                loss_grad_clip, sh_band, max_anisotropy, **params):
    outs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype)
                 for a in (positions, scales, rotations, opacities, colors, sh_coeffs))
    return jax.ffi.ffi_call(ffi_target("rlx_gaussian_splat_bwd"), outs)(
        positions, scales, rotations, opacities, colors, sh_coeffs, meta, dy,
        **_bwd_attrs(loss_grad_clip, sh_band, max_anisotropy, params))


def cuda_scratch_elems(n: int, params, backward: bool = False) -> int:
    """i32 elements of the CUDA kernels' scratch result (XLA allocates it; it must equal
    ``scratch_needed`` in ffi/cuda/gaussian_splat.cu, which checks it on every call).

    32 for the camera; per tile-Gaussian pair (max_list_entries bounds them, so the size
    is static and the kernels never synchronise with the host): two 64-bit sort keys and
    the sorted Gaussian index (5), plus in the backward its pair number and 9 gradient
    floats (10); per Gaussian 20 (projection, tile box, count, offset, limited
    log-scales, flags); per tile 2 (start, cursor); 8 spare."""
    tiles = -(-params["width"] // params["tile_size"]) * -(-params["height"] // params["tile_size"])
    e = int(params["max_list_entries"])
    return 32 + (15 if backward else 5) * e + 20 * n + 2 * tiles + 8


def _kernel_fwd_cuda(positions, scales, rotations, opacities, colors, sh_coeffs, meta, **params):
    if params["tile_size"] > 16:  # the CUDA kernels run one thread per pixel of a tile (<= 256)
        return reference_render(positions, scales, rotations, opacities, colors, sh_coeffs, meta, **params)
    n = positions.shape[0]
    out = (jax.ShapeDtypeStruct((params["height"] * params["width"] * 4,), positions.dtype),
           jax.ShapeDtypeStruct((cuda_scratch_elems(n, params),), jnp.int32))
    img, _ = jax.ffi.ffi_call(ffi_target("rlx_gaussian_splat_fwd"), out)(
        positions, scales, rotations, opacities, colors, sh_coeffs, meta, **_attrs(params))
    return (img,)


def _kernel_bwd_cuda(positions, scales, rotations, opacities, colors, sh_coeffs, meta, dy, *,
                     loss_grad_clip, sh_band, max_anisotropy, **params):
    if params["tile_size"] > 16:
        return reference_backward(positions, scales, rotations, opacities, colors, sh_coeffs, meta, dy,
                                  loss_grad_clip=loss_grad_clip, sh_band=sh_band, max_anisotropy=max_anisotropy,
                                  **params)
    n = positions.shape[0]
    outs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype)
                 for a in (positions, scales, rotations, opacities, colors, sh_coeffs))
    outs += (jax.ShapeDtypeStruct((cuda_scratch_elems(n, params, backward=True),), jnp.int32),)
    res = jax.ffi.ffi_call(ffi_target("rlx_gaussian_splat_bwd"), outs)(
        positions, scales, rotations, opacities, colors, sh_coeffs, meta, dy,
        **_bwd_attrs(loss_grad_clip, sh_band, max_anisotropy, params))
    return tuple(res[:6])


def _kernel_ok(*avals, **params):
    return all(a.dtype == jnp.float32 for a in avals) and avals[0].shape[0] > 0


splat_fwd = FusedPrimitive("rlx_gaussian_splat_fwd", reference_render, target="rlx_gaussian_splat_fwd",
                           kernel={"cpu": _kernel_fwd, "cuda": _kernel_fwd_cuda}, kernel_ok=_kernel_ok)
splat_tangent = FusedPrimitive("rlx_gaussian_splat_tangent", reference_tangent)
splat_bwd = FusedPrimitive("rlx_gaussian_splat_bwd", reference_backward, target="rlx_gaussian_splat_bwd",
                           kernel={"cpu": _kernel_bwd, "cuda": _kernel_bwd_cuda}, kernel_ok=_kernel_ok)


@splat_fwd.def_jvp
def _fwd_jvp(primals, tangents, **params):
    tangents = instantiate(tangents, primals)
    (img,) = splat_fwd(*primals, **params)
    (t,) = splat_tangent(*primals, *tangents[:6], **params)
    return (img,), (t,)


@splat_tangent.def_transpose
def _tangent_transpose(cts, *args, **params):
    primals, tans = args[:7], args[7:]
    for a in primals:
        if ad.is_undefined_primal(a):
            raise ValueError("gaussian_splat tangent is linear in the scene tangents only")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None] * 7 + [ad.Zero(t.aval) if ad.is_undefined_primal(t) else None for t in tans]
    grads = splat_bwd(*primals, ct, loss_grad_clip=0.0, sh_band=-1, max_anisotropy=0.0, **params)
    return [None] * 7 + [g if ad.is_undefined_primal(t) else None for g, t in zip(grads, tans)]


# ---- public functions ----------------------------------------------------------------------


def _prepare(positions, scales, rotations, opacities, colors, sh_coeffs, meta, width, height, tile_size,
             max_splat_steps, max_list_entries):
    positions = jnp.asarray(positions)
    dt = positions.dtype
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"gaussian_splat_render: positions must be floating point, got {dt}")
    for name, val in (("width", width), ("height", height), ("tile_size", tile_size)):
        if int(val) != val or val <= 0:
            raise ValueError(f"gaussian_splat_render: {name} must be a positive integer, got {val}")
    if max_splat_steps < 0 or max_list_entries < 0:
        raise ValueError("gaussian_splat_render: max_splat_steps and max_list_entries must be >= 0")
    if positions.size % 3:
        raise ValueError(f"gaussian_splat_render: positions has {positions.size} values, not a multiple of 3")
    p = positions.size // 3
    out = [positions.reshape(p, 3)]
    for name, a, k in (("scales", scales, 3), ("rotations", rotations, 4), ("opacities", opacities, 1),
                       ("colors", colors, 3)):
        a = jnp.asarray(a, dt)
        if a.size != p * k:
            raise ValueError(f"gaussian_splat_render: {name} has {a.size} values, {p} Gaussians need {p * k}")
        out.append(a.reshape((p, k) if k > 1 else (p,)))
    sh = jnp.asarray(sh_coeffs, dt)
    if p and sh.size % (3 * p):
        raise ValueError(f"gaussian_splat_render: sh_coeffs has {sh.size} values, not a multiple of 3P = {3 * p}")
    k = sh.size // (3 * p) if p else 0
    if k > MAX_SH:
        raise ValueError(f"gaussian_splat_render: at most {MAX_SH} SH coefficients per Gaussian, got {k}")
    out.append(sh.reshape(p, k, 3))
    meta = jnp.asarray(meta, dt)
    if meta.shape != (META_LEN,):
        raise ValueError(f"gaussian_splat_render: meta must have shape ({META_LEN},), got {meta.shape}")
    out.append(meta)
    return out


def gaussian_splat_render(positions, scales, rotations, opacities, colors, sh_coeffs, meta, *, width, height,
                          tile_size=16, radius_scale=3.0, alpha_cutoff=1.0 / 255.0, max_splat_steps=1024,
                          transmittance_threshold=1e-4, max_list_entries=1 << 20):
    """Render P Gaussians to an RGBA image, flattened [height * width * 4] (module doc).

    Inputs may be shaped ([P, 3] ...) or flat (RLX's [3P] ...). Differentiable in the
    scene (not meta) in every mode; reverse mode runs the fused backward kernel (C++ on
    CPU, CUDA on NVIDIA GPUs) for f32 scenes, the pure-JAX reference otherwise."""
    args = _prepare(positions, scales, rotations, opacities, colors, sh_coeffs, meta, width, height, tile_size,
                    max_splat_steps, max_list_entries)
    params = dict(width=int(width), height=int(height), tile_size=int(tile_size), radius_scale=float(radius_scale),
                  alpha_cutoff=float(alpha_cutoff), max_splat_steps=int(max_splat_steps),
                  transmittance_threshold=float(transmittance_threshold), max_list_entries=int(max_list_entries))
    if args[0].shape[0] == 0:
        return reference_render(*args, **params)[0]
    (img,) = splat_fwd(*args, **params)
    return img


def gaussian_splat_render_backward(positions, scales, rotations, opacities, colors, sh_coeffs, meta, dy, *,
                                   width, height, tile_size=16, radius_scale=3.0, alpha_cutoff=1.0 / 255.0,
                                   max_splat_steps=1024, transmittance_threshold=1e-4, max_list_entries=1 << 20,
                                   loss_grad_clip=1.0, sh_band=0, max_anisotropy=10.0, packed=False):
    """RLX's GaussianSplatRenderBackward: the scene gradients for image gradient dy
    [height * width * 4], with the backward options of the module doc (RLX's defaults).
    Returns (d positions, d scales, d rotations, d opacities, d colors, d sh_coeffs)
    shaped like the (reshaped) inputs, or with ``packed=True`` RLX's flat
    [positions | scales | rotations | opacities | colors | sh] vector."""
    args = _prepare(positions, scales, rotations, opacities, colors, sh_coeffs, meta, width, height, tile_size,
                    max_splat_steps, max_list_entries)
    dy = jnp.asarray(dy, args[0].dtype)
    if dy.size != width * height * 4:
        raise ValueError(f"gaussian_splat_render_backward: dy has {dy.size} values, the image has {width * height * 4}")
    params = dict(width=int(width), height=int(height), tile_size=int(tile_size), radius_scale=float(radius_scale),
                  alpha_cutoff=float(alpha_cutoff), max_splat_steps=int(max_splat_steps),
                  transmittance_threshold=float(transmittance_threshold), max_list_entries=int(max_list_entries),
                  loss_grad_clip=float(loss_grad_clip), sh_band=int(sh_band), max_anisotropy=float(max_anisotropy))
    if args[0].shape[0] == 0:
        grads = tuple(jnp.zeros_like(a) for a in args[:6])
    else:
        grads = tuple(splat_bwd(*args, dy.reshape(-1), **params))
    if packed:
        return jnp.concatenate([g.reshape(-1) for g in grads])
    return grads


def gaussian_splat_render_meta(camera_position, camera_target, camera_up, fov_y_degrees, near, far, background,
                               *, width=64, height=64, tile_size=16, radius_scale=3.0, alpha_cutoff=1.0 / 255.0,
                               max_splat_steps=1024, transmittance_threshold=1e-4, max_list_entries=1 << 20,
                               dtype=jnp.float32):
    """The 23-value meta vector (RLX's ``gaussian_splat_render_meta`` layout): camera
    position 3, target 3, up 3, fov_y degrees, near, far, background RGB 3, then width,
    height, tile_size, radius_scale, alpha_cutoff, max_splat_steps,
    transmittance_threshold, max_list_entries."""
    vals = [*np.asarray(camera_position, np.float64).reshape(3), *np.asarray(camera_target, np.float64).reshape(3),
            *np.asarray(camera_up, np.float64).reshape(3), fov_y_degrees, near, far,
            *np.asarray(background, np.float64).reshape(3), width, height, tile_size, radius_scale, alpha_cutoff,
            max_splat_steps, transmittance_threshold, max_list_entries]
    return jnp.asarray(np.asarray(vals, np.float64), dtype)
