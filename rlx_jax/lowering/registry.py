"""The table of lowering rules and the context a rule sees.

A rule is ``fn(op, args: list[jax.Array], ctx) -> jax.Array``, registered for one or
more RLX op classes (the class objects) with :func:`lowering_rule` and looked up by the
class of the node's op. User ops are ``Custom`` nodes, whose one rule dispatches on the
op's name (:func:`register_custom_lowering`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import numpy as np

from rlx_jax.ir import OP_CLASSES, Op

Rule = Callable[[Any, list, "LoweringContext"], Any]

_RULES: dict[type, Rule] = {}
_CUSTOM: dict[str, Callable] = {}


def _op_class(op_or_cls):
    """The op class of an op, an op class, or an RLX variant name (None for a name no
    op class has)."""
    if isinstance(op_or_cls, str):
        return OP_CLASSES.get(op_or_cls)
    return op_or_cls if isinstance(op_or_cls, type) else type(op_or_cls)


def lowering_rule(*op_classes):
    """Register the decorated function as the lowering of each given op class (a
    subclass of :class:`rlx_jax.ir.Op`). Registering a class twice is an error (one
    source of truth per op)."""
    if not op_classes:
        raise TypeError("lowering_rule needs at least one op class")
    for c in op_classes:
        if not (isinstance(c, type) and issubclass(c, Op)):
            raise TypeError(f"lowering_rule takes rlx_jax.ir.Op classes, got {c!r}")

    def deco(fn: Rule) -> Rule:
        for c in op_classes:
            prev = _RULES.get(c)
            if prev is not None and prev is not fn:
                raise ValueError(f"a lowering rule for {c.__name__} is already registered ({prev.__module__})")
            _RULES[c] = fn
        return fn

    return deco


def has_rule(op_or_cls) -> bool:
    """Whether ``op_or_cls`` (an op, op class or RLX variant name) has a lowering rule."""
    _load_rules()
    return _op_class(op_or_cls) in _RULES


def get_rule(op) -> Rule:
    _load_rules()
    rule = _RULES.get(type(op))
    if rule is None:
        raise NotImplementedError(f"no lowering rule for RLX op {type(op).__name__}")
    return rule


def registered_ops() -> list[str]:
    """Names of the ops that have a lowering rule."""
    _load_rules()
    return sorted(c.__name__ for c in _RULES)


def register_custom_lowering(name: str, fn: Callable) -> None:
    """Lower ``Op::Custom{name}`` with ``fn(args: list[Array], attrs: bytes, ctx) -> Array``."""
    if not isinstance(name, str) or not name:
        raise ValueError("custom op name must be a non-empty string")
    if not callable(fn):
        raise TypeError(f"custom lowering for {name!r} must be callable")
    _CUSTOM[name] = fn


def custom_lowering(name: str):
    return _CUSTOM.get(name)


_loaded = False
_load_lock = threading.Lock()
_loading_thread: int | None = None


def _load_rules() -> None:
    """Import every rule module once (they register themselves).

    Thread-safe: other threads wait until every module is imported (setting the flag
    before the imports let a second thread see a half-filled table and report "no
    lowering rule"); a call made by a rule module while it is being imported (the
    loading thread itself) returns at once, as before."""
    global _loaded, _loading_thread
    if _loaded or _loading_thread == threading.get_ident():
        return
    with _load_lock:
        if _loaded:
            return
        _loading_thread = threading.get_ident()
        try:
            _import_rule_modules()
            _loaded = True
        finally:
            _loading_thread = None


def _import_rule_modules() -> None:
    import importlib

    for mod in (
        "elementwise",
        "linalg",
        "shape_ops",
        "reductions",
        "nn",
        "backward",
        "quant",
        "moe",
        "recurrent",
        "fused",
        "signal",
        "splat",
        "control_flow",
    ):
        importlib.import_module(f"rlx_jax.lowering.{mod}")


# --------------------------------------------------------------------------------------
# helpers shared by rule modules


def enum_name(v) -> str | None:
    """The RLX variant name of an enum-ish attribute (str enum, dataclass with .kind, str)."""
    if v is None:
        return None
    if hasattr(v, "kind") and not isinstance(v, str):
        return enum_name(v.kind)
    if hasattr(v, "value") and isinstance(getattr(v, "value"), str):
        return v.value
    if hasattr(v, "name") and not isinstance(v, str) and isinstance(getattr(v, "name"), str):
        return v.name
    return str(v)


def jnp_dtype(dtype):
    """A numpy dtype for an RLX DType (or anything numpy understands)."""
    if dtype is None:
        return None
    to_np = getattr(dtype, "to_numpy", None)
    if to_np is not None:
        return to_np()
    return np.dtype(dtype)


@dataclasses.dataclass
class LoweringContext:
    """What a rule may look at besides its op and arguments.

    ``node``: the node being lowered; ``out_shape``: its dims with dynamic dims bound
    (``None`` for a dim whose symbol is bound by no input); ``out_dtype``: its numpy
    dtype; ``dims``: the dynamic-symbol bindings; ``cache``: per-call memo shared by
    every node of one lowering (sibling backward nodes put their joint result here);
    ``params``: the parameter dict (sub-graph bodies read it too); ``graph`` and
    ``env`` (node id -> value computed so far) let a backward rule find the inputs of
    its sibling nodes.
    """

    node: Any = None
    out_shape: tuple | None = None
    out_dtype: Any = None
    dims: dict = dataclasses.field(default_factory=dict)
    cache: dict = dataclasses.field(default_factory=dict)
    params: dict = dataclasses.field(default_factory=dict)
    graph: Any = None
    env: dict = dataclasses.field(default_factory=dict)
    dtype_map: Any = None

    def lower_body(self, graph, args, named: dict | None = None, params: dict | None = None):
        """Evaluate a sub-graph: ``Input`` nodes whose name is in ``named`` get that value,
        the others take ``args`` in node order. Returns the list of its outputs."""
        from .core import evaluate_graph

        return evaluate_graph(
            graph,
            self.params if params is None else params,
            list(args),
            named=named or {},
            dtype_map=self.dtype_map,
        )

    def node_input_ids(self) -> tuple:
        return tuple(self.node.inputs) if self.node is not None else ()

    def memo(self, key, compute: Callable):
        """``cache[key]``, computing it once (sibling nodes lowering to one call)."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    def cast_out(self, y):
        """Cast a result to the node's declared dtype (no-op when it matches)."""
        if self.out_dtype is None or y.dtype == self.out_dtype:
            return y
        return y.astype(self.out_dtype)
