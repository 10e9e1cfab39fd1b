"""3-D Gaussian splatting: GaussianSplatRender (fused kernel), GaussianSplatRenderBackward
(packed scene gradients), and the strict two-stage pair GaussianSplatPrepare ->
GaussianSplatRasterize.

RLX's flat buffers: positions [3N], scales [3N], rotations [4N], opacities [N], colors
[3N], sh_coeffs [N*K*3], meta [23]. Maths and backward options:
``rlx_jax/vjp_rules/gaussian_splat.py``.

The prepare buffer has RLX's length, ``15 max(N, 1) + max_list_entries + 2 tiles + 3
pixels + 11``; rlx_jax fills it as: per Gaussian [u, v, depth, radius] (4N), visible (N),
conic a b c (3N), colour (3N), [alpha scale, 0, 0, 0] (4N); then zeros (the list, tile
and ray sections: Rasterize re-bins from the per-Gaussian section, so its image equals
the fused render's); then width, height, tile_size, radius_scale, alpha_cutoff,
max_splat_steps, transmittance_threshold, max_list_entries, N, 0, 0. Prepare and
Rasterize run as pure JAX (no gradient is taken through them: RLX fuses the pair into
GaussianSplatRender before differentiating).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlx_jax import ir

from .registry import lowering_rule

PREP_TAIL = 11


def _scene(args):
    pos, sc, rot, op, col, sh, meta = args
    n = pos.shape[0] // 3
    k = sh.shape[0] // (3 * n) if n else 0
    return (pos.reshape(n, 3), sc.reshape(n, 3), rot.reshape(n, 4), op.reshape(n), col.reshape(n, 3),
            sh.reshape(n, k, 3), meta)


def _render_kw(op):
    return dict(width=int(op.width), height=int(op.height), tile_size=int(op.tile_size),
                radius_scale=float(op.radius_scale), alpha_cutoff=float(op.alpha_cutoff),
                max_splat_steps=int(op.max_splat_steps), transmittance_threshold=float(op.transmittance_threshold),
                max_list_entries=int(op.max_list_entries))


@lowering_rule(ir.GaussianSplatRender)
def _render(op, args, ctx):
    from rlx_jax.vjp_rules.gaussian_splat import gaussian_splat_render

    return ctx.cast_out(gaussian_splat_render(*_scene(args), **_render_kw(op)))


@lowering_rule(ir.GaussianSplatRenderBackward)
def _render_backward(op, args, ctx):
    from rlx_jax.vjp_rules.gaussian_splat import gaussian_splat_render_backward

    out = gaussian_splat_render_backward(*_scene(args[:7]), args[7], **_render_kw(op),
                                         loss_grad_clip=float(op.loss_grad_clip), sh_band=int(op.sh_band),
                                         max_anisotropy=float(op.max_anisotropy), packed=True)
    return ctx.cast_out(out)


def _tiles(width, height, tile_size):
    return (-(-width // tile_size)) * (-(-height // tile_size))


def prep_len(n: int, width: int, height: int, tile_size: int, max_list_entries: int) -> int:
    """RLX's ``gaussian_splat_prep_packed_len``."""
    return (15 * max(n, 1) + max_list_entries + 2 * _tiles(width, height, tile_size)
            + 3 * max(width * height, 1) + PREP_TAIL)


@lowering_rule(ir.GaussianSplatPrepare)
def _prepare(op, args, ctx):
    from rlx_jax.vjp_rules.gaussian_splat import project

    pos, sc, rot, opac, col, sh, meta = _scene(args)
    kw = _render_kw(op)
    n = pos.shape[0]
    length = prep_len(n, kw["width"], kw["height"], kw["tile_size"], kw["max_list_entries"])
    declared = ctx.out_shape[0] if ctx.out_shape else length
    if declared != length:
        raise ValueError(f"GaussianSplatPrepare: the output must have RLX's packed length {length}, got {declared}")
    dt = pos.dtype
    m = max(n, 1)
    if n:
        u, v, z, conic, rgb, visible, lam = project(pos, sc, rot, col, sh, meta, width=kw["width"],
                                                    height=kw["height"])
        radius = kw["radius_scale"] * jnp.sqrt(lam)
        alpha = jax.nn.sigmoid(opac)
    else:
        u = v = z = radius = alpha = jnp.zeros((1,), dt)
        visible = jnp.zeros((1,), bool)
        conic = rgb = jnp.zeros((1, 3), dt)
    zero = jnp.zeros((m,), dt)
    tail = jnp.asarray([kw["width"], kw["height"], kw["tile_size"], kw["radius_scale"], kw["alpha_cutoff"],
                        kw["max_splat_steps"], kw["transmittance_threshold"], kw["max_list_entries"], n, 0, 0], dt)
    parts = [jnp.stack([u, v, z, radius], 1).reshape(-1), visible.astype(dt), conic.reshape(-1), rgb.reshape(-1),
             jnp.stack([alpha, zero, zero, zero], 1).reshape(-1),
             jnp.zeros((length - 15 * m - PREP_TAIL,), dt), tail]
    return ctx.cast_out(jnp.concatenate(parts))


@lowering_rule(ir.GaussianSplatRasterize)
def _rasterize(op, args, ctx):
    from rlx_jax.vjp_rules.gaussian_splat import camera_from_meta, composite

    prep, meta = args
    width, height, ts = int(op.width), int(op.height), int(op.tile_size)
    rest = prep.shape[0] - int(op.max_list_entries) - 2 * _tiles(width, height, ts) - 3 * max(width * height, 1) - PREP_TAIL
    if rest <= 0 or rest % 15:
        raise ValueError(f"GaussianSplatRasterize: prep length {prep.shape[0]} is not RLX's packed length for "
                         f"{width}x{height}, tile {ts}, max_list_entries {op.max_list_entries}")
    m = rest // 15
    dt = prep.dtype
    a = prep[: 4 * m].reshape(m, 4)
    visible = prep[4 * m: 5 * m] > 0.5
    conic = prep[5 * m: 8 * m].reshape(m, 3)
    rgb = prep[8 * m: 11 * m].reshape(m, 3)
    alpha = prep[11 * m: 15 * m].reshape(m, 4)[:, 0]
    bg = camera_from_meta(meta)[5].astype(dt)
    img = composite(a[:, 0], a[:, 1], a[:, 2], a[:, 3], visible, conic, rgb, alpha, bg, width=width, height=height,
                    tile_size=ts, alpha_cutoff=float(op.alpha_cutoff), max_splat_steps=int(op.max_splat_steps),
                    transmittance_threshold=float(op.transmittance_threshold),
                    max_list_entries=int(op.max_list_entries))
    return ctx.cast_out(img)
