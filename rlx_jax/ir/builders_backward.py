"""Builders, part 4: one per backward op, RLX's argument order (seed 002); shapes the
op can infer are optional arguments (checked when given)."""

from __future__ import annotations

from typing import Optional

from .builders_core import BuilderBase
from .builders_nn import _pair
from .op import ActivationKind, AttentionBwdWrt, MaskKind, SteKind


class BackwardBuilders(BuilderBase):
    def relu_backward(self, x: int, dy: int) -> int:
        from .ops_backward import ReluBackward

        return self._build(ReluBackward, (x, dy))

    def activation_backward(self, kind, x: int, dy: int) -> int:
        from .ops_backward import ActivationBackward

        return self._build(ActivationBackward, (x, dy), kind=self._enum(ActivationKind, "ActivationBackward", kind))

    def layer_norm_backward_input(self, x: int, gamma: int, dy: int, axis: int = -1, eps: float = 1e-5) -> int:
        from .ops_backward import LayerNormBackwardInput

        return self._build(LayerNormBackwardInput, (x, gamma, dy), axis=axis, eps=eps)

    def layer_norm_backward_gamma(self, x: int, dy: int, gamma_shape=None, axis: int = -1, eps: float = 1e-5) -> int:
        from .ops_backward import LayerNormBackwardGamma

        s = self._opt_shape("LayerNormBackwardGamma", gamma_shape, self._dt(x))
        return self._build(LayerNormBackwardGamma, (x, dy), s, axis=axis, eps=eps)

    def rms_norm_backward_input(self, x: int, gamma: int, beta: int, dy: int, axis: int = -1, eps: float = 1e-5) -> int:
        from .ops_backward import RmsNormBackwardInput

        return self._build(RmsNormBackwardInput, (x, gamma, beta, dy), axis=axis, eps=eps)

    def rms_norm_backward_gamma(self, x: int, gamma: int, beta: int, dy: int, axis: int = -1, eps: float = 1e-5) -> int:
        from .ops_backward import RmsNormBackwardGamma

        return self._build(RmsNormBackwardGamma, (x, gamma, beta, dy), axis=axis, eps=eps)

    def rms_norm_backward_beta(self, x: int, gamma: int, beta: int, dy: int, axis: int = -1, eps: float = 1e-5) -> int:
        from .ops_backward import RmsNormBackwardBeta

        return self._build(RmsNormBackwardBeta, (x, gamma, beta, dy), axis=axis, eps=eps)

    def rope_backward(self, dy: int, cos: int, sin: int, head_dim: int, n_rot: Optional[int] = None) -> int:
        from .ops_backward import RopeBackward

        return self._build(RopeBackward, (dy, cos, sin), head_dim=head_dim, n_rot=head_dim if n_rot is None else n_rot)

    def cumsum_backward(self, dy: int, out_shape=None, axis: int = -1, exclusive: bool = False) -> int:
        from .ops_backward import CumsumBackward

        s = self._opt_shape("CumsumBackward", out_shape, self._dt(dy))
        return self._build(CumsumBackward, (dy,), s, axis=axis, exclusive=exclusive)

    def gather_backward(self, dy: int, indices: int, table_shape, axis: int = 0) -> int:
        """Scatter-add dy into zeros shaped ``table_shape`` (dims, or (dims, dtype))."""
        from .ops_backward import GatherBackward

        s = self._opt_shape("GatherBackward", table_shape, self._dt(dy))
        return self._build(GatherBackward, (dy, indices), s, axis=axis)

    def group_norm_backward_input(self, x: int, gamma: int, beta: int, dy: int, num_groups: int,
                                  eps: float = 1e-5) -> int:
        from .ops_backward import GroupNormBackwardInput

        return self._build(GroupNormBackwardInput, (x, gamma, beta, dy), num_groups=num_groups, eps=eps)

    def group_norm_backward_gamma(self, x: int, dy: int, gamma_shape=None, num_groups: int = 1,
                                  eps: float = 1e-5) -> int:
        from .ops_backward import GroupNormBackwardGamma

        s = self._opt_shape("GroupNormBackwardGamma", gamma_shape, self._dt(x))
        return self._build(GroupNormBackwardGamma, (x, dy), s, num_groups=num_groups, eps=eps)

    def group_norm_backward_beta(self, x: int, dy: int, beta_shape=None, num_groups: int = 1,
                                 eps: float = 1e-5) -> int:
        from .ops_backward import GroupNormBackwardBeta

        s = self._opt_shape("GroupNormBackwardBeta", beta_shape, self._dt(x))
        return self._build(GroupNormBackwardBeta, (x, dy), s, num_groups=num_groups, eps=eps)

    def batch_norm_inference_backward_input(self, x: int, gamma: int, mean: int, var: int, dy: int,
                                            eps: float = 1e-5) -> int:
        from .ops_backward import BatchNormInferenceBackwardInput

        return self._build(BatchNormInferenceBackwardInput, (x, gamma, mean, var, dy), eps=eps)

    def batch_norm_inference_backward_gamma(self, x: int, mean: int, var: int, dy: int, gamma_shape=None,
                                            eps: float = 1e-5) -> int:
        from .ops_backward import BatchNormInferenceBackwardGamma

        s = self._opt_shape("BatchNormInferenceBackwardGamma", gamma_shape, self._dt(x))
        return self._build(BatchNormInferenceBackwardGamma, (x, mean, var, dy), s, eps=eps)

    def batch_norm_inference_backward_beta(self, dy: int, beta_shape=None) -> int:
        from .ops_backward import BatchNormInferenceBackwardBeta

        s = self._opt_shape("BatchNormInferenceBackwardBeta", beta_shape, self._dt(dy))
        return self._build(BatchNormInferenceBackwardBeta, (dy,), s)

    def max_pool2d_backward(self, x: int, dy: int, kernel_size, stride=None, padding=(0, 0)) -> int:
        from .ops_backward import MaxPool2dBackward

        ks = _pair(kernel_size)
        return self._build(MaxPool2dBackward, (x, dy), kernel_size=ks,
                           stride=ks if stride is None else _pair(stride), padding=_pair(padding))

    maxpool2d_backward = max_pool2d_backward

    def conv2d_backward_input(self, dy: int, w: int, x_shape, kernel_size=None, stride=(1, 1), padding=(0, 0),
                              dilation=(1, 1), groups: int = 1) -> int:
        from .ops_backward import Conv2dBackwardInput

        ks = tuple(self.node(w).shape.dims[2:]) if kernel_size is None else _pair(kernel_size)
        s = self._opt_shape("Conv2dBackwardInput", x_shape, self._dt(dy))
        return self._build(Conv2dBackwardInput, (dy, w), s, kernel_size=ks, stride=_pair(stride),
                           padding=_pair(padding), dilation=_pair(dilation), groups=groups)

    def conv2d_backward_weight(self, x: int, dy: int, w_shape=None, kernel_size=None, stride=(1, 1),
                               padding=(0, 0), dilation=(1, 1), groups: int = 1) -> int:
        from .ops_backward import Conv2dBackwardWeight

        s = self._opt_shape("Conv2dBackwardWeight", w_shape, self._dt(x))
        if kernel_size is None:
            if s is None:
                raise self._fault("Conv2dBackwardWeight", "needs kernel_size or w_shape")
            kernel_size = s.dims[2:]
        return self._build(Conv2dBackwardWeight, (x, dy), s, kernel_size=_pair(kernel_size), stride=_pair(stride),
                           padding=_pair(padding), dilation=_pair(dilation), groups=groups)

    def softmax_cross_entropy_backward(self, logits: int, labels: int, d_loss: int) -> int:
        from .ops_backward import SoftmaxCrossEntropyBackward

        return self._build(SoftmaxCrossEntropyBackward, (logits, labels, d_loss))

    def complex_norm_sq_backward(self, z: int, g: int) -> int:
        from .ops_backward import ComplexNormSqBackward

        return self._build(ComplexNormSqBackward, (z, g))

    def attention_backward(self, wrt, q: int, k: int, v: int, dy: int, num_heads: int, head_dim: int,
                           mask_kind="none", mask: Optional[int] = None) -> int:
        """dq / dk / dv (``wrt`` = query | key | value) of Attention."""
        from .ops_backward import AttentionBackward

        mk = self._enum(MaskKind, "AttentionBackward", mask_kind)
        ins = (q, k, v, dy)
        if mk.needs_mask_input:
            if mask is None:
                raise self._fault("AttentionBackward", f"mask kind {mk.kind} needs a mask input")
            ins += (mask,)
        return self._build(AttentionBackward, ins, num_heads=num_heads, head_dim=head_dim, mask_kind=mk,
                           wrt=self._enum(AttentionBwdWrt, "AttentionBackward", wrt))

    def attention_backward_all(self, q: int, k: int, v: int, dy: int, num_heads: int, head_dim: int,
                               mask_kind="none", mask: Optional[int] = None) -> tuple:
        return tuple(self.attention_backward(w, q, k, v, dy, num_heads, head_dim, mask_kind, mask)
                     for w in (AttentionBwdWrt.Query, AttentionBwdWrt.Key, AttentionBwdWrt.Value))

    def fake_quantize_backward(self, x: int, dy: int, bits: int, axis: Optional[int] = None, ste="identity") -> int:
        from .ops_backward import FakeQuantizeBackward

        return self._build(FakeQuantizeBackward, (x, dy), bits=bits, axis=axis,
                           ste=self._enum(SteKind, "FakeQuantizeBackward", ste))

    def fake_quantize_lsq_backward_x(self, x: int, scale: int, dy: int, bits: int, axis: Optional[int] = None) -> int:
        from .ops_backward import FakeQuantizeLSQBackwardX

        return self._build(FakeQuantizeLSQBackwardX, (x, scale, dy), bits=bits, axis=axis)

    def fake_quantize_lsq_backward_scale(self, x: int, scale: int, dy: int, bits: int,
                                         axis: Optional[int] = None) -> int:
        from .ops_backward import FakeQuantizeLSQBackwardScale

        return self._build(FakeQuantizeLSQBackwardScale, (x, scale, dy), bits=bits, axis=axis)

    def gaussian_splat_render_backward(self, inputs, dy: int, width: int, height: int, tile_size: int = 16,
                                       radius_scale: float = 3.0, alpha_cutoff: float = 1.0 / 255.0,
                                       max_splat_steps: int = 1024, transmittance_threshold: float = 1e-4,
                                       max_list_entries: int = 1 << 20, loss_grad_clip: float = 1.0,
                                       sh_band: int = 0, max_anisotropy: float = 10.0) -> int:
        """Packed scene gradients; ``inputs`` are the seven forward scene inputs."""
        from .ops_splat import GaussianSplatRenderBackward

        return self._build(GaussianSplatRenderBackward, tuple(inputs) + (dy,), width=width, height=height,
                           tile_size=tile_size, radius_scale=radius_scale, alpha_cutoff=alpha_cutoff,
                           max_splat_steps=max_splat_steps, transmittance_threshold=transmittance_threshold,
                           max_list_entries=max_list_entries, loss_grad_clip=loss_grad_clip, sh_band=sh_band,
                           max_anisotropy=max_anisotropy)

    def log_mel_backward(self, spectrum: int, filterbank: int, dy: int) -> int:
        from .ops_signal import LogMelBackward

        return self._build(LogMelBackward, (spectrum, filterbank, dy))
