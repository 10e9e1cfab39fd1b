"""rlx_jax: the RLX gradient compiler on JAX/XLA.

RLX graphs (``rlx_jax.Graph``) lower to JAX functions (``rlx_jax.to_jax``); fused ops
(``rlx_jax.ops``) carry closed-form backward kernels registered through XLA FFI.
Public names are resolved lazily so that ``import rlx_jax`` stays cheap and so that a
missing compiled module never breaks the pure-Python parts.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "kernel_info": "rlx_jax._kernels",
    "export_safety_checks": "rlx_jax._kernels",
    "fused_ops": "rlx_jax.vjp_rules._primitive",
    "ops": "rlx_jax.ops",
    # IR (rlx_jax/ir)
    "Graph": "rlx_jax.ir",
    "GraphError": "rlx_jax.ir",
    "DType": "rlx_jax.ir",
    "register_op": "rlx_jax.ir",
    "Shape": "rlx_jax.ir",
    "Dynamic": "rlx_jax.ir",
    "MaskKind": "rlx_jax.ir",
    # lowering (rlx_jax/lowering)
    "to_jax": "rlx_jax.lowering",
    "Session": "rlx_jax.lowering.session",
    "available_devices": "rlx_jax.lowering.session",
    "is_available": "rlx_jax.lowering.session",
    "CompiledGraph": "rlx_jax.lowering.session",
    # pyrlx's grad(graph, wrt): rlx_jax.autodiff.grad under pyrlx's keyword names
    "grad": "rlx_jax.lowering.session",
    # graph autodiff (rlx_jax/autodiff)
    "grad_with_loss": "rlx_jax.autodiff",
    "jvp": "rlx_jax.autodiff",
    "vmap": "rlx_jax.autodiff",
    "hvp": "rlx_jax.autodiff",
    "jacfwd": "rlx_jax.autodiff",
    "GradWithLossOptions": "rlx_jax.autodiff",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'rlx_jax' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.endswith("." + name) else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
