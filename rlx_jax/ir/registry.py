"""Registry of user-defined ``Custom`` ops: ``register_op(name, shape_rule, lowering=None,
vjp=None, jvp=None)``.

* ``shape_rule(in_shapes: list[Shape], attrs: bytes) -> Shape`` (or ``(dims, dtype)``)
  infers the output; it may raise ValueError to reject the inputs.
* ``lowering(args: list[jax.Array], attrs: bytes, ctx) -> jax.Array`` (called by the
  lowering stage; ``CustomOpDef.lower`` is the same callable).
* ``vjp(graph, node, d_output: int) -> list[int | None]`` and ``jvp(graph, node,
  tangents: list[int | None]) -> int`` emit graph nodes (called by the autodiff stage).

The IR stores the callables; it only calls ``shape_rule``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class CustomOpDef:
    name: str
    shape_rule: Callable
    lowering: Optional[Callable] = None
    vjp: Optional[Callable] = None
    jvp: Optional[Callable] = None

    @property
    def lower(self) -> Optional[Callable]:
        """Alias of ``lowering`` (the name the lowering stage looks up)."""
        return self.lowering


_lock = threading.Lock()
_REGISTRY: dict[str, CustomOpDef] = {}


def register_op(name: str, shape_rule: Callable, lowering: Optional[Callable] = None,
                vjp: Optional[Callable] = None, jvp: Optional[Callable] = None) -> CustomOpDef:
    """Register (or replace) the custom op ``name``; returns its definition."""
    if not isinstance(name, str) or not name:
        raise ValueError("custom op name must be a non-empty string")
    for label, fn in (("shape_rule", shape_rule), ("lowering", lowering), ("vjp", vjp), ("jvp", jvp)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{label} of custom op {name!r} must be callable")
    if shape_rule is None:
        raise TypeError(f"custom op {name!r} needs a shape_rule")
    d = CustomOpDef(name, shape_rule, lowering, vjp, jvp)
    with _lock:
        _REGISTRY[name] = d
    return d


def get_custom_op(name: str) -> Optional[CustomOpDef]:
    """The registered definition of ``name`` (None when unknown)."""
    with _lock:
        return _REGISTRY.get(name)


def unregister_op(name: str) -> None:
    with _lock:
        _REGISTRY.pop(name, None)
