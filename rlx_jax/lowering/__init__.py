"""IR -> JAX: one lowering rule per RLX op, ``to_jax`` and the pyrlx-style ``Session``.

``to_jax(graph)`` gives ``fn(params, inputs) -> list[Array]``; rules are registered
with :func:`lowering_rule` (see ``registry.py``) in one module per op family.
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
