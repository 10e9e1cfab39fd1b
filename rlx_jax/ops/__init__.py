"""Fused, differentiable ops for JAX code (API.md section 4).

Each works under jit, grad, jvp, vmap and higher orders; reverse mode runs the op's
fused backward kernel (C++ on CPU, CUDA on NVIDIA GPUs) where one is compiled.
"""

from rlx_jax.vjp_rules.attention import attention, attention_backward, attention_rlx
from rlx_jax.vjp_rules.rms_norm import rms_norm
from rlx_jax.vjp_rules.layer_norm import layer_norm, layer_norm_backward
from rlx_jax.vjp_rules.group_norm import group_norm, group_norm_backward
from rlx_jax.vjp_rules.batch_norm import batch_norm_inference, batch_norm_inference_backward

__all__ = ["rms_norm"]
__all__ += ["attention", "attention_backward", "attention_rlx"]
__all__ += ["layer_norm", "layer_norm_backward", "group_norm", "group_norm_backward"]
__all__ += ["batch_norm_inference", "batch_norm_inference_backward"]
