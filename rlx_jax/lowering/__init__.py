"""IR -> JAX: one lowering rule per RLX op, ``to_jax`` and the pyrlx-style ``Session``.

``to_jax(graph)`` gives ``fn(params, inputs) -> list[Array]``; rules are registered
with :func:`lowering_rule` (see ``registry.py``) in one module per op family:

- fused-op families (norms, attention, RoPE, conv/pool, loss, cumsum, gather /
  scatter_add, fake quantization, softmax, activations, |z|^2) go through
  ``rlx_jax.ops`` (``nn.py``, ``elementwise.py``) and their backward ops through the
  ``<family>_backward`` wrappers (``backward.py``; sibling nodes share one call);
- everything else is written once, in its rule, with jax.numpy / lax.

Semantics worth knowing:

- Scan with ``0 < num_checkpoints = K < length`` runs K ``jax.checkpoint`` segments, so
  reverse mode keeps O(K + length / K) carries; with ``save_trajectory`` it returns
  RLX's K rows ``floor(t * length / K)``. ScanBackward recomputes checkpointed carries
  with ``forward_body``.
- While with ``max_iterations`` is a scan of that many steps with a done flag
  (reverse-differentiable); without it, ``lax.while_loop`` (forward mode only).
- Integer ops (Quantize, QMatMul, QConv2d) follow RLX's CPU kernels: i32 accumulation,
  halves rounded away from zero, clamp to i8.
- GroupedMatMul sorts tokens by expert and runs one ``lax.ragged_dot``.
- Sample / RNG ops draw from ``PRNGKey(seed)``: deterministic per seed, not RLX's
  Philox stream.
"""

from .core import evaluate_graph, to_jax
from .registry import (
    LoweringContext,
    get_rule,
    has_rule,
    lowering_rule,
    register_custom_lowering,
    registered_ops,
)

__all__ = [
    "LoweringContext",
    "evaluate_graph",
    "get_rule",
    "has_rule",
    "lowering_rule",
    "register_custom_lowering",
    "registered_ops",
    "to_jax",
]
