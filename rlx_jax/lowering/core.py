"""Graph -> JAX function.

``to_jax(graph)`` returns ``fn(params: dict, inputs: dict) -> list[Array]``: a pure
function of its two dicts (no hidden state), so it can be jitted, differentiated,
vmapped and sharded. Nodes are evaluated in order, each through the lowering rule
registered for its op class; dynamic dims are bound from the arrays at call time.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp

from .registry import LoweringContext, enum_name, get_rule, jnp_dtype

_LEAVES = ("Input", "Param", "Constant")


def _op_name(op) -> str:
    return type(op).__name__


def _describe(node) -> str:
    text = f"node %{node.id} {_op_name(node.op)}"
    name = getattr(node, "name", None)
    if name:
        text += f" {name!r}"
    return text


def _fmt_dims(dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def _is_dynamic(d) -> bool:
    return not isinstance(d, (int, np.integer))


def resolve_dims(dims, bound: dict) -> tuple:
    """Dims with each dynamic dim replaced by its bound size (``None`` if unbound)."""
    out = []
    for d in dims:
        if _is_dynamic(d):
            out.append(bound.get(getattr(d, "symbol", d)))
        else:
            out.append(int(d))
    return tuple(out)


def _bind(node, what: str, value, bound: dict, dtype_map=None):
    """Check one Input/Param value against the node's shape; bind its dynamic dims.

    Returns the value as a JAX array of the declared dtype (through ``dtype_map``).
    """
    shape = node.shape
    want = jnp_dtype(shape.dtype)
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        try:
            value = np.asarray(value)
        except Exception as exc:  # noqa: BLE001 - report what was given
            raise TypeError(f"{what}: expected an array, got {type(value).__name__}") from exc
        if value.dtype == object:
            raise TypeError(f"{what}: expected a numeric array, got {type(value).__name__}")
    got = np.dtype(value.dtype)
    if got != want:
        if got.kind == "c" and want.kind != "c":
            raise TypeError(f"{what}: expected {want}, got complex {got}")
        if got.kind == "f" and want.kind in "iub":
            raise TypeError(
                f"{what}: expected {want} (declared {shape.dtype}), got floating {got}"
            )
        if got.kind not in "biufcV" and got != want:
            raise TypeError(f"{what}: expected {want}, got {got}")
    dims = tuple(shape.dims)
    vshape = tuple(value.shape)
    if len(vshape) != len(dims):
        raise ValueError(
            f"{what}: expected rank {len(dims)} {_fmt_dims(dims)}, got shape {list(vshape)}"
        )
    for axis, (d, n) in enumerate(zip(dims, vshape)):
        if _is_dynamic(d):
            sym = getattr(d, "symbol", d)
            prev = bound.get(sym)
            if prev is None:
                bound[sym] = int(n)
            elif prev != n:
                raise ValueError(
                    f"{what}: dynamic dim {getattr(d, 'name', d)!r} (axis {axis}) is {n} here "
                    f"but {prev} in an earlier input"
                )
        elif int(d) != n:
            raise ValueError(
                f"{what}: expected shape {_fmt_dims(dims)}, got {list(vshape)} (axis {axis})"
            )
    if dtype_map is not None:
        want = dtype_map(want)
    arr = jnp.asarray(value)
    if arr.dtype != want:
        arr = arr.astype(want)
    return arr


def _constant(node):
    """``Constant{data}``: little-endian bytes of the node's dtype and (static) shape."""
    dt = np.dtype(jnp_dtype(node.shape.dtype)).newbyteorder("<")
    data = bytes(node.op.data)
    flat = np.frombuffer(data, dtype=dt) if data else np.zeros((0,), dt)
    dims = tuple(node.shape.dims)
    if any(_is_dynamic(d) for d in dims):
        raise ValueError(f"{_describe(node)}: a Constant cannot have a dynamic shape")
    n = int(np.prod(dims)) if dims else 1
    if flat.size == n:
        arr = flat.reshape(dims)
    elif flat.size == 1:
        arr = np.broadcast_to(flat.reshape(()), dims)
    else:
        raise ValueError(
            f"{_describe(node)}: {len(data)} bytes of data do not fill shape {list(dims)} "
            f"{node.shape.dtype}"
        )
    return jnp.asarray(arr.astype(dt.newbyteorder("=")))


def _accumulated_outputs(graph) -> set:
    """Ids of the nodes a ``dtype_map`` leaves at their declared dtype: Sum and Mean
    reductions that are graph outputs and that no other node reads (a loss). They
    accumulate and return in the declared dtype (f32), so a bf16 graph's loss is the f32
    mean of its rows' bf16 values instead of that mean rounded to bf16 (steps of 1/64
    near 3). No node of the graph reads them, so no other node's dtype changes; in a
    sub-graph (a Scan, If or While body) the op running it casts its outputs to the
    mapped dtype it carries, so there they only accumulate in f32."""
    unread_outputs = set(graph.outputs) - {i for node in graph.nodes for i in node.inputs}
    return {node.id for node in graph.nodes
            if node.id in unread_outputs
            and _op_name(node.op) == "Reduce" and enum_name(node.op.op) in ("Sum", "Mean")}


def evaluate_graph(graph, params: dict, args: list, *, named: dict | None = None,
                   cache: dict | None = None, bound: dict | None = None,
                   dtype_map=None) -> list:
    """Evaluate ``graph`` on JAX values.

    ``Input`` nodes take ``named[name]`` when present, else the next of ``args``
    (node order, as RLX binds sub-graph inputs); ``Param`` nodes read ``params``.
    ``dtype_map`` (numpy dtype -> numpy dtype) changes the compute dtype of leaves and
    node results (the Session's f16/bf16 precision), except for Sum and Mean reductions
    that are outputs read by no other node (``_accumulated_outputs``).
    """
    named = named or {}
    bound = {} if bound is None else bound
    cache = {} if cache is None else cache
    env: dict[int, Any] = {}
    pos = 0
    kept = _accumulated_outputs(graph) if dtype_map is not None else set()
    for node in graph.nodes:
        op = node.op
        kind = _op_name(op)
        if kind == "Input":
            name = op.name
            what = f"input {name!r} ({_describe(node)})"
            if name in named:
                value = named[name]
            elif pos < len(args):
                value = args[pos]
                pos += 1
            else:
                raise ValueError(f"missing {what}")
            env[node.id] = _bind(node, what, value, bound, dtype_map)
        elif kind == "Param":
            name = op.name
            what = f"param {name!r} ({_describe(node)})"
            if name not in params:
                raise ValueError(f"missing {what}")
            env[node.id] = _bind(node, what, params[name], bound, dtype_map)
        elif kind == "Constant":
            c = _constant(node)
            env[node.id] = c if dtype_map is None else c.astype(dtype_map(c.dtype))
        else:
            rule = get_rule(op)
            out_dtype = jnp_dtype(node.shape.dtype)
            ctx = LoweringContext(
                node=node,
                out_shape=resolve_dims(node.shape.dims, bound),
                out_dtype=out_dtype if dtype_map is None or node.id in kept else dtype_map(out_dtype),
                dims=bound,
                cache=cache,
                params=params,
                graph=graph,
                env=env,
                dtype_map=dtype_map,
            )
            try:
                value = rule(op, [env[i] for i in node.inputs], ctx)
            except (NotImplementedError, TypeError, ValueError) as exc:
                msg = str(exc)
                if f"%{node.id} " in msg:
                    raise
                raise type(exc)(f"{_describe(node)}: {msg}") from exc
            env[node.id] = one_element_as_declared(value, ctx.out_shape)
    return [env[o] for o in graph.outputs]


def one_element_as_declared(value, shape):
    """``value`` reshaped to the declared ``shape`` where both hold one element and their
    ranks differ: the IR lets a node declare [1] or [1, 1] for a scalar result and the
    reverse ("both hold exactly one element"), so its consumers see the declared rank."""
    if shape is None or None in shape or not hasattr(value, "shape"):
        return value
    shape = tuple(int(d) for d in shape)
    if value.shape != shape and value.size == 1 and math.prod(shape) == 1:
        return jnp.reshape(value, shape)
    return value


def check_lowerable(graph) -> None:
    """Raise ``NotImplementedError`` naming the first node no rule can lower."""
    for node in graph.nodes:
        kind = _op_name(node.op)
        if kind in _LEAVES:
            continue
        try:
            get_rule(node.op)
        except NotImplementedError as exc:
            raise NotImplementedError(f"{_describe(node)}: {exc}") from None
        for attr in ("body", "then_branch", "else_branch", "cond", "fwd_body", "vjp_body",
                     "jvp_body", "body_vjp", "forward_body"):
            sub = getattr(node.op, attr, None)
            if sub is not None and hasattr(sub, "nodes"):
                check_lowerable(sub)


def graph_inputs(graph) -> dict:
    """name -> node of the graph's ``Input`` nodes."""
    return {n.op.name: n for n in graph.nodes if _op_name(n.op) == "Input"}


def graph_params(graph) -> dict:
    """name -> node of the graph's ``Param`` nodes."""
    return {n.op.name: n for n in graph.nodes if _op_name(n.op) == "Param"}


def to_jax(graph, *, dtype_map=None):
    """Lower an RLX graph to ``fn(params: dict, inputs: dict) -> list[Array]``.

    ``fn`` is pure: jit, grad, vjp/jvp, hessian, vmap and sharding apply as to any JAX
    function. Inputs and params are matched by name; a missing or unexpected name, a
    wrong rank/static dim or an inconsistent dynamic dim raises ``ValueError``; a
    non-numeric value or a float given for an integer input raises ``TypeError``.
    Outputs follow ``graph.outputs``.
    """
    if not hasattr(graph, "nodes") or not hasattr(graph, "outputs"):
        raise TypeError(f"to_jax expects an rlx_jax.Graph, got {type(graph).__name__}")
    check_lowerable(graph)
    input_names = set(graph_inputs(graph))
    param_names = set(graph_params(graph))
    gname = getattr(graph, "name", "") or "graph"

    def fn(params: dict | None = None, inputs: dict | None = None) -> list:
        params = {} if params is None else params
        inputs = {} if inputs is None else inputs
        if not isinstance(params, dict):
            raise TypeError(f"params must be a dict name -> array, got {type(params).__name__}")
        if not isinstance(inputs, dict):
            raise TypeError(f"inputs must be a dict name -> array, got {type(inputs).__name__}")
        extra = sorted(set(inputs) - input_names)
        if extra:
            raise ValueError(
                f"unexpected input(s) {extra} for {gname!r}; its inputs are {sorted(input_names)}"
            )
        extra_p = sorted(set(params) - param_names)
        if extra_p:
            raise ValueError(
                f"unexpected param(s) {extra_p} for {gname!r}; its params are {sorted(param_names)}"
            )
        missing = sorted(input_names - set(inputs))
        if missing:
            raise ValueError(f"missing input(s) {missing} for {gname!r}")
        missing_p = sorted(param_names - set(params))
        if missing_p:
            raise ValueError(f"missing param(s) {missing_p} for {gname!r}")
        return evaluate_graph(graph, params, [], named=inputs, dtype_map=dtype_map)

    fn.__name__ = f"rlx_{gname}".replace(" ", "_")
    fn.__doc__ = f"JAX lowering of RLX graph {gname!r}: fn(params, inputs) -> list of outputs"
    return fn


def tree_zeros_like(x):
    return jax.tree_util.tree_map(jnp.zeros_like, x)
