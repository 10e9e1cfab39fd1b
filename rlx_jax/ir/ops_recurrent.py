"""Recurrent scans: Mamba SelectiveScan and GatedDeltaNet (linear attention)."""

from __future__ import annotations

from .errors import OpFault
from .op import Op, need_float, need_rank, need_same_dtype, op_class
from .shape import dims_compatible


def _same(what, a, b, pairs):
    for i, j in pairs:
        if not dims_compatible(a.dims[i], b.dims[j]):
            raise OpFault(f"{what}: {a} and {b} disagree (dim {i} vs {j})")


@op_class
class SelectiveScan(Op):
    """Mamba SSM: ``h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t``, ``y_t = C_t . h_t``
    per channel; inputs ``x [b,s,h]``, ``delta [b,s,h]``, ``A [h,n]``, ``B [b,s,n]``,
    ``C [b,s,n]`` -> ``[b,s,h]`` (n = ``state_size``)."""

    state_size: int

    def arity(self):
        return 5

    def infer(self, ins):
        x, dt, a, b, c = ins
        for nm, s, r in (("x", x, 3), ("delta", dt, 3), ("A", a, 2), ("B", b, 3), ("C", c, 3)):
            need_rank(f"selective_scan {nm}", s, r)
        need_float("selective_scan x", x)
        need_same_dtype("selective_scan", x, dt, a, b, c)
        _same("selective_scan x/delta", x, dt, [(0, 0), (1, 1), (2, 2)])
        _same("selective_scan x/A", x, a, [(2, 0)])
        for nm, s in (("B", b), ("C", c)):
            _same(f"selective_scan x/{nm}", x, s, [(0, 0), (1, 1)])
            if not dims_compatible(s.dims[2], self.state_size):
                raise OpFault(f"selective_scan {nm} state dim {s.dims[2]} != state_size {self.state_size}")
        if not dims_compatible(a.dims[1], self.state_size):
            raise OpFault(f"selective_scan A state dim {a.dims[1]} != state_size {self.state_size}")
        return x


@op_class
class GatedDeltaNet(Op):
    """Gated delta-rule linear attention: per head ``S_t = exp(g_t) S_{t-1} +
    beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T``, ``o_t = S_t^T q_t``; inputs ``q, k, v
    [b,s,h,n]``, ``g, beta [b,s,h]`` (+ ``state [b,h,n,n]`` when ``carry_state``) ->
    ``[b,s,h,n]``."""

    state_size: int
    carry_state: bool

    def arity(self):
        return 6 if self.carry_state else 5

    def infer(self, ins):
        q, k, v, g, beta = ins[:5]
        for nm, s in (("q", q), ("k", k), ("v", v)):
            need_rank(f"gated_delta_net {nm}", s, 4)
            if not dims_compatible(s.dims[3], self.state_size):
                raise OpFault(f"gated_delta_net {nm} last dim {s.dims[3]} != state_size {self.state_size}")
        need_rank("gated_delta_net g", g, 3)
        need_rank("gated_delta_net beta", beta, 3)
        need_float("gated_delta_net q", q)
        _same("gated_delta_net q/k", q, k, [(0, 0), (1, 1)])
        _same("gated_delta_net v/g", v, g, [(0, 0), (1, 1), (2, 2)])
        _same("gated_delta_net v/beta", v, beta, [(0, 0), (1, 1), (2, 2)])
        if self.carry_state:
            st = ins[5]
            need_rank("gated_delta_net state", st, 4)
            want = (v.dims[0], v.dims[2], self.state_size, self.state_size)
            if not all(dims_compatible(a, b) for a, b in zip(st.dims, want)):
                raise OpFault(f"gated_delta_net state must be {list(want)}, got {st}")
        return v
