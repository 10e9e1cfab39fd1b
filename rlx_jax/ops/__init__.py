"""Fused, differentiable ops for JAX code (docs/API.md, "rlx_jax.ops").

Each works under jit, grad, jvp, vmap and higher orders; reverse mode runs the op's
fused backward kernel (C++ on CPU, CUDA on NVIDIA GPUs) where one is compiled.
Each family adds its import line and its ``__all__ +=`` line below.
"""

__all__: list[str] = ["rms_norm", "add_rms_norm", "rms_norm_linear", "add_rms_norm_linear"]

from rlx_jax.vjp_rules.attention import attention, attention_backward, attention_rlx
from rlx_jax.vjp_rules.rms_norm import add_rms_norm, rms_norm
from rlx_jax.vjp_rules.rms_norm_linear import add_rms_norm_linear, rms_norm_linear
from rlx_jax.vjp_rules.layer_norm import layer_norm, layer_norm_backward
from rlx_jax.vjp_rules.group_norm import group_norm, group_norm_backward
from rlx_jax.vjp_rules.batch_norm import batch_norm_inference, batch_norm_inference_backward
from rlx_jax.vjp_rules.conv import conv2d, conv2d_backward, conv2d_backward_input, conv2d_backward_weight
from rlx_jax.vjp_rules.pool import avg_pool2d, avg_pool2d_backward, max_pool2d, max_pool2d_backward
from rlx_jax.vjp_rules.gather import gather, gather_backward, scatter_add
from rlx_jax.vjp_rules.quantize import (
    fake_quantize, fake_quantize_backward, fake_quantize_lsq, fake_quantize_lsq_backward,
)

from rlx_jax.vjp_rules.softmax import softmax, softmax_backward
from rlx_jax.vjp_rules.cross_entropy import (
    fused_linear_cross_entropy, softmax_cross_entropy, softmax_cross_entropy_backward,
)
from rlx_jax.vjp_rules.rope import rope, rope_backward, rope_split
from rlx_jax.vjp_rules.cumsum import cumsum, cumsum_backward
from rlx_jax.vjp_rules.activations import activation, activation_backward, relu_backward
from rlx_jax.vjp_rules.swiglu import swiglu, swiglu_backward
from rlx_jax.vjp_rules.swiglu_linear import swiglu_linear
from rlx_jax.vjp_rules.complex import complex_norm_sq, complex_norm_sq_backward
from rlx_jax.vjp_rules.gaussian_splat import (
    gaussian_splat_render, gaussian_splat_render_backward, gaussian_splat_render_meta,
)

__all__ += ["softmax", "softmax_backward", "softmax_cross_entropy", "softmax_cross_entropy_backward"]
__all__ += ["fused_linear_cross_entropy", "rope", "rope_backward", "rope_split", "cumsum", "cumsum_backward"]
__all__ += ["activation", "activation_backward", "relu_backward", "complex_norm_sq", "complex_norm_sq_backward"]
__all__ += ["swiglu", "swiglu_backward", "swiglu_linear"]
__all__ += ["attention", "attention_backward", "attention_rlx"]
__all__ += ["layer_norm", "layer_norm_backward", "group_norm", "group_norm_backward"]
__all__ += ["batch_norm_inference", "batch_norm_inference_backward"]
__all__ += ["conv2d", "conv2d_backward", "conv2d_backward_input", "conv2d_backward_weight"]
__all__ += ["max_pool2d", "max_pool2d_backward", "avg_pool2d", "avg_pool2d_backward"]
__all__ += ["gather", "gather_backward", "scatter_add"]
__all__ += ["fake_quantize", "fake_quantize_backward", "fake_quantize_lsq", "fake_quantize_lsq_backward"]
__all__ += ["gaussian_splat_render", "gaussian_splat_render_backward", "gaussian_splat_render_meta"]
