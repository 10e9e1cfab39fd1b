"""Builders, part 2: norms, attention, RoPE, conv/pool, quantisation, recurrent and
fused ops, splatting, random tensors, extension ops (RLX's Rust builder order)."""

from __future__ import annotations

from typing import Optional

from .builders_core import BuilderBase
from .op import ActivationKind, MaskKind, QuantScheme, ReduceOp, ScaleMode, SteKind


def _pair(v, n: int = 2) -> tuple:
    """An int -> (v,)*n; a sequence -> tuple."""
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * n
    return tuple(v)


class NNBuilders(BuilderBase):
    # -- norms -------------------------------------------------------------------
    def layer_norm(self, input: int, gamma: int, beta: int, axis: int = -1, eps: float = 1e-5) -> int:
        """LayerNorm over dims ``axis..`` (pyrlx order)."""
        from .ops_norm import LayerNorm

        return self._build(LayerNorm, (input, gamma, beta), axis=axis, eps=eps)

    def rms_norm(self, input: int, gamma: int, beta: int, eps: float = 1e-5, axis: int = -1) -> int:
        """RmsNorm ``x * rsqrt(mean(x^2) + eps) * gamma + beta`` (pyrlx order; axis last)."""
        from .ops_norm import RmsNorm

        return self._build(RmsNorm, (input, gamma, beta), axis=axis, eps=eps)

    def group_norm(self, x: int, gamma: int, beta: int, num_groups: int, eps: float = 1e-5) -> int:
        from .ops_norm import GroupNorm

        return self._build(GroupNorm, (x, gamma, beta), num_groups=num_groups, eps=eps)

    def batch_norm_inference(self, x: int, gamma: int, beta: int, mean: int, var: int,
                             eps: float = 1e-5) -> int:
        from .ops_norm import BatchNormInference

        return self._build(BatchNormInference, (x, gamma, beta, mean, var), eps=eps)

    def layer_norm2d(self, x: int, gamma: int, beta: int, eps: float = 1e-6) -> int:
        from .ops_norm import LayerNorm2d

        return self._build(LayerNorm2d, (x, gamma, beta), eps=eps)

    # -- attention / position ------------------------------------------------------
    def attention(self, q: int, k: int, v: int, mask: int, num_heads: int, head_dim: int) -> int:
        """pyrlx attention with a Custom ``[batch, key_len]`` mask (1 keep, <0.5 masked)."""
        return self.attention_opts(q, k, v, num_heads, head_dim, MaskKind("Custom"), mask)

    def attention_kind(self, q: int, k: int, v: int, num_heads: int, head_dim: int, mask_kind) -> int:
        """pyrlx attention with a synthesised mask: "none" | "causal" | "sliding:N"."""
        return self.attention_opts(q, k, v, num_heads, head_dim, mask_kind)

    def attention_opts(self, q: int, k: int, v: int, num_heads: int, head_dim: int, mask_kind="none",
                       mask: Optional[int] = None, score_scale: Optional[float] = None,
                       softcap: Optional[float] = None, q_segment_ids: Optional[int] = None,
                       kv_segment_ids: Optional[int] = None, sinks: Optional[int] = None) -> int:
        """Attention with every option (mask kinds custom/bias take ``mask``); packed
        documents through ``q_segment_ids`` [B, Sq] / ``kv_segment_ids`` [B, Sk] (integer,
        given together) and per-head ``sinks`` [num_heads]."""
        from .ops_attention import Attention

        mk = self._enum(MaskKind, "Attention", mask_kind)
        ins = (q, k, v)
        if mk.needs_mask_input:
            if mask is None:
                raise self._fault("Attention", f"mask kind {mk.kind} needs a mask input")
            ins += (mask,)
        elif mask is not None:
            raise self._fault("Attention", f"mask kind {mk.kind} takes no mask input")
        if (q_segment_ids is None) != (kv_segment_ids is None):
            raise self._fault("Attention", "q_segment_ids and kv_segment_ids go together")
        if q_segment_ids is not None:
            ins += (q_segment_ids, kv_segment_ids)
        if sinks is not None:
            ins += (sinks,)
        return self._build(Attention, ins, num_heads=num_heads, head_dim=head_dim, mask_kind=mk,
                           score_scale=score_scale, attn_logit_softcap=softcap,
                           segment_ids=True if q_segment_ids is not None else None,
                           sinks=True if sinks is not None else None)

    def rope(self, x: int, cos: int, sin: int, head_dim: int) -> int:
        """NeoX RoPE over whole heads (pyrlx)."""
        return self.rope_n(x, cos, sin, head_dim, head_dim)

    def rope_n(self, x: int, cos: int, sin: int, head_dim: int, n_rot: int) -> int:
        """Partial NeoX RoPE: the first ``n_rot`` dims of each head rotate."""
        from .ops_attention import Rope

        return self._build(Rope, (x, cos, sin), head_dim=head_dim, n_rot=n_rot)

    def axial_rope2d(self, x: int, end_x: int, end_y: int, head_dim: int, num_heads: int,
                     theta: float = 10000.0, repeat_factor: int = 1) -> int:
        from .ops_attention import AxialRope2d

        return self._build(AxialRope2d, (x,), end_x=end_x, end_y=end_y, head_dim=head_dim,
                           num_heads=num_heads, theta=theta, repeat_factor=repeat_factor)

    # -- conv / pool ---------------------------------------------------------------
    def conv(self, x: int, w: int, kernel_size=None, stride=1, padding=0, dilation=1, groups: int = 1) -> int:
        """N-d convolution (NCHW / OIHW); kernel_size defaults to the weight's."""
        from .ops_conv import Conv

        wd = self.node(w).shape.dims
        ks = tuple(wd[2:]) if kernel_size is None else _pair(kernel_size, max(len(wd) - 2, 1))
        n = len(ks)
        return self._build(Conv, (x, w), kernel_size=ks, stride=_pair(stride, n), padding=_pair(padding, n),
                           dilation=_pair(dilation, n), groups=groups)

    def conv2d(self, x: int, w: int, kernel_size=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1),
               groups: int = 1) -> int:
        """2-D convolution ``[N, C_in, H, W] * [C_out, C_in/groups, kH, kW]``."""
        return self.conv(x, w, kernel_size, stride, padding, dilation, groups)

    def conv_transpose2d(self, x: int, w: int, kernel_size=None, stride=(1, 1), padding=(0, 0),
                         dilation=(1, 1), output_padding=(0, 0), groups: int = 1) -> int:
        from .ops_conv import ConvTranspose2d

        ks = tuple(self.node(w).shape.dims[2:]) if kernel_size is None else _pair(kernel_size)
        return self._build(ConvTranspose2d, (x, w), kernel_size=ks, stride=_pair(stride),
                           padding=_pair(padding), dilation=_pair(dilation),
                           output_padding=_pair(output_padding), groups=groups)

    def pool(self, x: int, kind, kernel_size, stride=None, padding=(0, 0)) -> int:
        """Max / mean pooling over NCHW (stride defaults to kernel_size)."""
        from .ops_conv import Pool

        ks = _pair(kernel_size)
        return self._build(Pool, (x,), kind=self._enum(ReduceOp, "Pool", kind), kernel_size=ks,
                           stride=ks if stride is None else _pair(stride, len(ks)),
                           padding=_pair(padding, len(ks)))

    def max_pool2d(self, x: int, kernel_size, stride=None, padding=(0, 0)) -> int:
        return self.pool(x, ReduceOp.Max, kernel_size, stride, padding)

    def avg_pool2d(self, x: int, kernel_size, stride=None, padding=(0, 0)) -> int:
        return self.pool(x, ReduceOp.Mean, kernel_size, stride, padding)

    def resize_nearest2x(self, x: int) -> int:
        return self.resize_nearest_2x(x)

    # -- quantisation -------------------------------------------------------------
    def quantize(self, x: int, scales, zero_points, axis: Optional[int] = None) -> int:
        from .ops_quant import Quantize

        return self._build(Quantize, (x,), axis=axis, scales=tuple(scales), zero_points=tuple(zero_points))

    def dequantize(self, x: int, scales, zero_points, axis: Optional[int] = None) -> int:
        from .ops_quant import Dequantize

        return self._build(Dequantize, (x,), axis=axis, scales=tuple(scales), zero_points=tuple(zero_points))

    def fake_quantize(self, x: int, bits: int, axis: Optional[int] = None, ste="identity",
                      scale_mode="per_batch", state: Optional[int] = None) -> int:
        """QAT fake quantisation; EMA/Fixed scale modes read ``state``."""
        from .ops_quant import FakeQuantize

        sm = self._enum(ScaleMode, "FakeQuantize", scale_mode)
        ins = (x,) if state is None else (x, state)
        return self._build(FakeQuantize, ins, bits=bits, axis=axis, ste=self._enum(SteKind, "FakeQuantize", ste),
                           scale_mode=sm)

    def fake_quantize_lsq(self, x: int, scale: int, bits: int, axis: Optional[int] = None) -> int:
        from .ops_quant import FakeQuantizeLSQ

        return self._build(FakeQuantizeLSQ, (x, scale), bits=bits, axis=axis)

    def dequant_matmul(self, inputs, scheme, out_shape, dtype="f32") -> int:
        """``x @ dequant(w)``: inputs ``[x, w_q, scale, zp]`` (GGUF: ``[x, packed]``)."""
        from .ops_quant import DequantMatMul

        return self._build(DequantMatMul, tuple(inputs), self._shape("DequantMatMul", out_shape, dtype),
                           scheme=self._enum(QuantScheme, "DequantMatMul", scheme))

    def q_matmul(self, x: int, w: int, bias: int, x_zp: int, w_zp: int, out_zp: int, mult: float) -> int:
        from .ops_quant import QMatMul

        return self._build(QMatMul, (x, w, bias), x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, mult=mult)

    def q_conv2d(self, x: int, w: int, bias: int, kernel_size, stride, padding, dilation, groups: int,
                 x_zp: int, w_zp: int, out_zp: int, mult: float) -> int:
        from .ops_quant import QConv2d

        return self._build(QConv2d, (x, w, bias), kernel_size=_pair(kernel_size), stride=_pair(stride),
                           padding=_pair(padding), dilation=_pair(dilation), groups=groups,
                           x_zp=x_zp, w_zp=w_zp, out_zp=out_zp, mult=mult)

    def dequant_grouped_matmul(self, x: int, packed_w: int, expert_idx: int, scheme, out_shape,
                               dtype="f32") -> int:
        from .ops_quant import DequantGroupedMatMul

        return self._build(DequantGroupedMatMul, (x, packed_w, expert_idx),
                           self._shape("DequantGroupedMatMul", out_shape, dtype),
                           scheme=self._enum(QuantScheme, "DequantGroupedMatMul", scheme))

    def dequant_moe_weights(self, packed_w: int, scheme, out_shape, dtype="f32") -> int:
        from .ops_quant import DequantMoEWeights

        return self._build(DequantMoEWeights, (packed_w,), self._shape("DequantMoEWeights", out_shape, dtype),
                           scheme=self._enum(QuantScheme, "DequantMoEWeights", scheme))

    # -- recurrent -----------------------------------------------------------------
    def selective_scan(self, x: int, delta: int, a: int, b: int, c: int, state_size: Optional[int] = None) -> int:
        """Mamba scan; ``state_size`` defaults to A's second dim."""
        from .ops_recurrent import SelectiveScan

        n = self.node(a).shape.dims[-1] if state_size is None else state_size
        return self._build(SelectiveScan, (x, delta, a, b, c), state_size=n)

    def gated_delta_net(self, q: int, k: int, v: int, g: int, beta: int, state_size: Optional[int] = None,
                        state: Optional[int] = None) -> int:
        """Gated DeltaNet; pass ``state`` to carry the SSM state (carry_state)."""
        from .ops_recurrent import GatedDeltaNet

        n = self.node(v).shape.dims[-1] if state_size is None else state_size
        ins = (q, k, v, g, beta) + (() if state is None else (state,))
        return self._build(GatedDeltaNet, ins, state_size=n, carry_state=state is not None)

    # -- fused -----------------------------------------------------------------------
    def fused_matmul_bias_act(self, input: int, weight: int, bias: int, out_shape=None, dtype=None,
                              activation=None) -> int:
        """``act(input @ weight + bias)`` (pyrlx order; out_shape/dtype are checked)."""
        from .ops_fused import FusedMatMulBiasAct

        act = None if activation is None else self._enum(ActivationKind, "FusedMatMulBiasAct", activation)
        s = None if out_shape is None else self._shape("FusedMatMulBiasAct", out_shape, dtype or self._dt(input))
        return self._build(FusedMatMulBiasAct, (input, weight, bias), s, activation=act)

    def fused_residual_ln(self, x: int, residual: int, gamma: int, beta: int, eps: float = 1e-5,
                          bias: Optional[int] = None) -> int:
        from .ops_fused import FusedResidualLN

        ins = (x, residual) + (() if bias is None else (bias,)) + (gamma, beta)
        return self._build(FusedResidualLN, ins, has_bias=bias is not None, eps=eps)

    def fused_residual_rms_norm(self, x: int, residual: int, gamma: int, beta: int, eps: float = 1e-5,
                                bias: Optional[int] = None) -> int:
        from .ops_fused import FusedResidualRmsNorm

        ins = (x, residual) + (() if bias is None else (bias,)) + (gamma, beta)
        return self._build(FusedResidualRmsNorm, ins, has_bias=bias is not None, eps=eps)

    def fused_swiglu(self, x: int, cast_to=None, gate_first: bool = False) -> int:
        from .ops_fused import FusedSwiGLU

        return self._build(FusedSwiGLU, (x,), cast_to=cast_to, gate_first=gate_first)

    def fused_attention_block(self, inputs, num_heads: int, head_dim: int, has_bias: bool = False,
                              has_rope: bool = False) -> int:
        """inputs: hidden, qkv_w, out_w, mask, [qkv_b, out_b], [rope_cos, rope_sin]."""
        from .ops_fused import FusedAttentionBlock

        return self._build(FusedAttentionBlock, tuple(inputs), num_heads=num_heads, head_dim=head_dim,
                           has_bias=has_bias, has_rope=has_rope)

    def fused_transformer_layer(self, inputs, num_heads: int, head_dim: int, intermediate_size: int,
                                eps1: float = 1e-5, eps2: float = 1e-5, activation="gelu",
                                has_bias: bool = True) -> int:
        from .ops_fused import FusedTransformerLayer

        return self._build(FusedTransformerLayer, tuple(inputs), num_heads=num_heads, head_dim=head_dim,
                           intermediate_size=intermediate_size, eps1=eps1, eps2=eps2,
                           activation=self._enum(ActivationKind, "FusedTransformerLayer", activation),
                           has_bias=has_bias)

    # -- splatting -------------------------------------------------------------------
    def gaussian_splat_render(self, positions: int, scales: int, rotations: int, opacities: int,
                              colors: int, sh_coeffs: int, meta: int, width: int, height: int,
                              tile_size: int = 16, radius_scale: float = 3.0, alpha_cutoff: float = 1.0 / 255.0,
                              max_splat_steps: int = 1024, transmittance_threshold: float = 1e-4,
                              max_list_entries: int = 1 << 20) -> int:
        from .ops_splat import GaussianSplatRender

        return self._build(GaussianSplatRender, (positions, scales, rotations, opacities, colors, sh_coeffs, meta),
                           width=width, height=height, tile_size=tile_size, radius_scale=radius_scale,
                           alpha_cutoff=alpha_cutoff, max_splat_steps=max_splat_steps,
                           transmittance_threshold=transmittance_threshold, max_list_entries=max_list_entries)

    def gaussian_splat_prepare(self, inputs, out_shape, width: int, height: int, tile_size: int = 16,
                               radius_scale: float = 3.0, alpha_cutoff: float = 1.0 / 255.0,
                               max_splat_steps: int = 1024, transmittance_threshold: float = 1e-4,
                               max_list_entries: int = 1 << 20, dtype="f32") -> int:
        from .ops_splat import GaussianSplatPrepare

        return self._build(GaussianSplatPrepare, tuple(inputs), self._shape("GaussianSplatPrepare", out_shape, dtype),
                           width=width, height=height, tile_size=tile_size, radius_scale=radius_scale,
                           alpha_cutoff=alpha_cutoff, max_splat_steps=max_splat_steps,
                           transmittance_threshold=transmittance_threshold, max_list_entries=max_list_entries)

    def gaussian_splat_rasterize(self, prep: int, meta: int, width: int, height: int, tile_size: int = 16,
                                 alpha_cutoff: float = 1.0 / 255.0, max_splat_steps: int = 1024,
                                 transmittance_threshold: float = 1e-4, max_list_entries: int = 1 << 20) -> int:
        from .ops_splat import GaussianSplatRasterize

        return self._build(GaussianSplatRasterize, (prep, meta), width=width, height=height, tile_size=tile_size,
                           alpha_cutoff=alpha_cutoff, max_splat_steps=max_splat_steps,
                           transmittance_threshold=transmittance_threshold, max_list_entries=max_list_entries)

    # -- random -----------------------------------------------------------------------
    def rng_uniform(self, shape, dtype="f32", seed: int = 0, low: float = 0.0, high: float = 1.0) -> int:
        from .ops_rng import RngUniform

        return self._build(RngUniform, (), self._shape("RngUniform", shape, dtype), seed=seed, low=low, high=high)

    def rng_normal(self, shape, dtype="f32", seed: int = 0, mean: float = 0.0, std: float = 1.0) -> int:
        from .ops_rng import RngNormal

        return self._build(RngNormal, (), self._shape("RngNormal", shape, dtype), seed=seed, mean=mean, std=std)

    # -- signal ------------------------------------------------------------------------
    def log_mel(self, spectrum: int, filterbank: int) -> int:
        """``log(max(spectrum @ filterbank, 1e-10))``."""
        from .ops_signal import LogMel

        return self._build(LogMel, (spectrum, filterbank))
