"""Graph-level autodiff (docs/API.md, "Autodiff on graphs"): every transform returns an ordinary RLX
graph (printable, serialisable, runnable with ``to_jax`` / ``Session``, differentiable
again).

* :func:`grad_with_loss` / :func:`grad`: reverse mode with RLX's backward ops;
* :func:`jvp`: forward mode, outputs ``[primals..., tangents...]``, inputs
  ``tangent_<name>``;
* :func:`hvp`: Hessian-vector products;
* :func:`vmap`: a leading batch axis on chosen inputs;
* :func:`jacfwd`: a full Jacobian from a compiled jvp graph (pyrlx's helper).
"""

from .reverse import GradWithLossOptions, grad, grad_with_loss
from .table import VJP_RULES, has_vjp_rule, vjp_rule

__all__ = ["GradWithLossOptions", "grad", "grad_with_loss", "vjp_rule", "VJP_RULES", "has_vjp_rule"]

from .forward import hvp, jacfwd, jvp  # noqa: E402

__all__ += ["hvp", "jacfwd", "jvp"]

from .batch import vmap  # noqa: E402
from . import jax_custom  # noqa: E402,F401  (registers rlx_jax's Custom ops: second order of the splat)

__all__ += ["vmap"]
