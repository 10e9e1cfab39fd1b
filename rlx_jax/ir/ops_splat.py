"""3-D Gaussian splatting (flat f32 buffers).

Scene inputs: positions ``[3N]``, scales ``[3N]`` (log), rotations ``[4N]`` (xyzw),
opacities ``[N]`` (logit), colors ``[3N]``, sh_coeffs ``[N*c*3]``, meta ``[23]``.
"""

from __future__ import annotations

from .errors import OpFault
from .op import Op, need_float, need_rank, op_class
from .shape import Shape

META_LEN = 23


def check_scene(ins) -> tuple:
    """Check the seven scene inputs; return (N, sh_len)."""
    names = ("positions", "scales", "rotations", "opacities", "colors", "sh_coeffs", "meta")
    for nm, s in zip(names, ins):
        need_rank(f"splat {nm}", s, 1)
        need_float(f"splat {nm}", s)
        if not isinstance(s.dims[0], int):
            raise OpFault(f"splat {nm} needs a static length")
    pos, sc, rot, op, col, sh, meta = (s.dims[0] for s in ins)
    if pos % 3:
        raise OpFault(f"positions length {pos} is not a multiple of 3")
    n = pos // 3
    for nm, got, want in (("scales", sc, 3 * n), ("rotations", rot, 4 * n), ("opacities", op, n),
                          ("colors", col, 3 * n)):
        if got != want:
            raise OpFault(f"{nm} has {got} values, {n} splats need {want}")
    if n and sh % (3 * n):
        raise OpFault(f"sh_coeffs length {sh} is not a multiple of 3N = {3 * n}")
    if meta != META_LEN:
        raise OpFault(f"meta must have {META_LEN} values, got {meta}")
    return n, sh


@op_class
class GaussianSplatRender(Op):
    """Project, bin, sort and rasterise N Gaussians -> ``[height*width*4]`` RGBA."""

    width: int
    height: int
    tile_size: int
    radius_scale: float
    alpha_cutoff: float
    max_splat_steps: int
    transmittance_threshold: float
    max_list_entries: int

    def validate(self):
        if self.width == 0 or self.height == 0 or self.tile_size == 0:
            raise OpFault("width, height and tile_size must be positive")

    def arity(self):
        return 7

    def infer(self, ins):
        check_scene(ins)
        return Shape((self.width * self.height * 4,), ins[0].dtype)


@op_class
class GaussianSplatRenderBackward(Op):
    """Gradient of GaussianSplatRender w.r.t. the scene, packed as
    ``[positions 3N | scales 3N | rotations 4N | opacities N | colors 3N | sh]``; inputs
    the seven scene inputs then ``dy [height*width*4]``."""

    width: int
    height: int
    tile_size: int
    radius_scale: float
    alpha_cutoff: float
    max_splat_steps: int
    transmittance_threshold: float
    max_list_entries: int
    loss_grad_clip: float
    sh_band: int
    max_anisotropy: float
    is_backward = True

    def arity(self):
        return 8

    def infer(self, ins):
        n, sh = check_scene(ins[:7])
        dy = ins[7]
        need_rank("splat dy", dy, 1)
        if dy.dims[0] != self.width * self.height * 4:
            raise OpFault(f"dy has {dy.dims[0]} values, the image has {self.width * self.height * 4}")
        return Shape((14 * n + sh,), ins[0].dtype)


@op_class
class GaussianSplatPrepare(Op):
    """Stage 1 of the strict splat pipeline: packed prepare buffer (shape declared)."""

    width: int
    height: int
    tile_size: int
    radius_scale: float
    alpha_cutoff: float
    max_splat_steps: int
    transmittance_threshold: float
    max_list_entries: int

    def arity(self):
        return 7

    def check_declared(self, ins, out):
        check_scene(ins)
        need_rank("splat prepare output", out, 1)


@op_class
class GaussianSplatRasterize(Op):
    """Stage 2: ``[prep, meta [23]] -> [height*width*4]`` RGBA."""

    width: int
    height: int
    tile_size: int
    alpha_cutoff: float
    max_splat_steps: int
    transmittance_threshold: float
    max_list_entries: int

    def arity(self):
        return 2

    def infer(self, ins):
        prep, meta = ins
        need_rank("splat prep", prep, 1)
        need_rank("splat meta", meta, 1)
        if meta.dims[0] != META_LEN:
            raise OpFault(f"meta must have {META_LEN} values, got {meta.dims[0]}")
        return Shape((self.width * self.height * 4,), meta.dtype)
