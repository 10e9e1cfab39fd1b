"""Custom ops whose lowering is JAX autodiff of a JAX function: graph-level derivatives
of ops for which RLX has no backward op (the second order of GaussianSplatRender).

``register_jax_function(name, fn, nondiff=())`` registers (idempotently, through
RLX's extension point ``rlx_jax.register_op``) two Custom ops:

* ``name``: ``fn(*args, **params)`` itself (one array out);
* ``name + "_vjp"``: a chain of VJPs of ``fn``. Its attrs (UTF-8 JSON) are
  ``{"params": {...}, "wrt": [W_1, ..., W_k]}`` (each W_j a list of input indices);
  with ``f_0 = fn``, ``f_j(a_0, ..., a_{n+j-2}, ct_j) = (d f_{j-1} / d a_{W_j})^T ct_j``,
  the op computes ``f_k`` (lowered with ``jax.vjp``). Inputs: fn's ``n`` inputs then
  the cotangents ``ct_1 .. ct_k``; output: shaped like input ``W_k[0]`` when W_k has
  one index, else the flattened cotangents of W_k concatenated (unpacked in the graph
  with Narrow / Reshape). The graph rule emits one node for fn's own inputs (one
  linearisation) and one per cotangent input (the previous level's forward mode, so
  ``rlx_jax.jvp`` keeps only that node after pruning).

Both ops have a graph VJP rule emitting ``name_vjp`` one level deeper, so the graphs
they appear in differentiate again to any order. Inputs in ``nondiff`` (indices into
fn's inputs: the splat's camera ``meta``) get zeros, as non-float inputs get none.
``params`` is plain JSON (ints, floats, bools, strings): the static attributes of
the op. Graphs holding these ops print, verify, round-trip through JSON (a Custom node
keeps its name and attrs) and lower with ``to_jax`` once this module is imported
(``import rlx_jax.autodiff`` does it); RLX itself would need the same names
registered to run them.
"""

from __future__ import annotations

import json
from typing import Callable

import numpy as np

from rlx_jax.ir import GraphError, Shape, get_custom_op, register_op
from rlx_jax.ir.ops_control import Custom

from . import emit as E

_FUNCTIONS: dict[str, tuple[Callable, frozenset]] = {}


def encode_attrs(params: dict, wrt=()) -> bytes:
    return json.dumps({"params": params, "wrt": [[int(w) for w in grp] for grp in wrt]}, sort_keys=True).encode()


def decode_attrs(attrs: bytes) -> tuple[dict, list]:
    try:
        d = json.loads(bytes(attrs).decode())
        return dict(d["params"]), [[int(w) for w in grp] for grp in d.get("wrt", [])]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"attrs are not rlx_jax JSON {{'params', 'wrt'}}: {exc}") from None


def _chain(fn: Callable, params: dict, wrt: list) -> Callable:
    """f_k of the module doc as a function of all its inputs."""
    import jax
    import jax.numpy as jnp

    f = lambda *a: fn(*a, **params)  # noqa: E731
    for group in wrt:
        def f(*a, _prev=f, _ws=tuple(group)):
            *args, ct = a

            def part(*xs):
                full = list(args)
                for w, x in zip(_ws, xs):
                    full[w] = x
                return _prev(*full)

            y, pull = jax.vjp(part, *[args[w] for w in _ws])
            cts = pull(ct.astype(y.dtype).reshape(y.shape))
            return cts[0] if len(cts) == 1 else jnp.concatenate([c.reshape(-1) for c in cts])
    return f


def _out_shape(fn, nondiff, params, wrt, in_shapes):
    """Output shape: input w's for a one-input VJP level, the packed length for a
    group, else fn's (eval_shape)."""
    if wrt:
        n_args = len(in_shapes) - len(wrt)
        for j, group in enumerate(wrt):
            if not group:
                raise ValueError(f"wrt[{j}] is empty")
            for w in group:
                if not 0 <= w < n_args + j:
                    raise ValueError(f"wrt[{j}] names input {w}, level {j} has {n_args + j} inputs")
                if w < n_args and w in nondiff:
                    raise ValueError(f"input {w} is not differentiable")
        last = [in_shapes[w] for w in wrt[-1]]
        if len(last) == 1:
            return last[0]
        if len({s.dtype for s in last}) != 1:
            raise ValueError("a packed wrt group needs inputs of one dtype")
        return (sum(int(np.prod(s.dims)) for s in last),), last[0].dtype
    import jax

    specs = [jax.ShapeDtypeStruct(tuple(s.dims), s.dtype.to_numpy()) for s in in_shapes]
    out = jax.eval_shape(lambda *a: fn(*a, **params), *specs)
    return tuple(out.shape), str(out.dtype)


def emit_vjp(g, name: str, params: dict, wrt: list, inputs, dy) -> list:
    """The cotangents of the level ``len(wrt)`` function applied to ``inputs`` for
    upstream ``dy``: one ``name_vjp`` node packing those of fn's own differentiable
    inputs (unpacked with Narrow / Reshape), one node per cotangent input (each linear
    in the level's function: the forward mode of the previous level); zeros for
    ``nondiff`` inputs, None for non-float ones."""
    from rlx_jax.ir.ops_shape import Narrow

    fn, nondiff = _FUNCTIONS[name]
    n_args = len(inputs) - len(wrt)
    out = [None] * len(inputs)

    def node(group):
        op = Custom(name=f"{name}_vjp", num_inputs=len(inputs) + 1,
                    attrs=encode_attrs(params, [list(w) for w in wrt] + [list(group)]))
        return g.add_node(op, tuple(inputs) + (dy,))

    own = []
    for i, x in enumerate(inputs):
        if not E.is_float(E.dtype(g, x)):
            continue
        if i >= n_args:
            out[i] = node([i])
        elif i in nondiff:
            out[i] = E.zeros_like(g, x)
        else:
            own.append(i)
    if len(own) == 1:
        out[own[0]] = node(own)
    elif own:
        packed, start = node(own), 0
        for i in own:
            ds = E.dims(g, inputs[i])
            ln = int(np.prod(ds))
            if not ln:
                out[i] = E.zeros_like(g, inputs[i])
                continue
            part = g.add_node(Narrow(axis=0, start=start, len=ln), (packed,))
            out[i] = part if tuple(ds) == (ln,) else E.reshape(g, part, ds)
            start += ln
    return out


def register_jax_function(name: str, fn: Callable, nondiff=()) -> None:
    """Register the Custom ops ``name`` and ``name_vjp`` for ``fn(*arrays, **params)``
    (module doc). Calling it again with the same name replaces the definitions."""
    nondiff = frozenset(int(i) for i in nondiff)
    _FUNCTIONS[name] = (fn, nondiff)

    def shape_rule(level_vjp):
        def rule(in_shapes, attrs):
            params, wrt = decode_attrs(attrs)
            if level_vjp and not wrt:
                raise ValueError(f"{name}_vjp needs a non-empty wrt")
            if not level_vjp and wrt:
                raise ValueError(f"{name} takes no wrt (use {name}_vjp)")
            return _out_shape(fn, nondiff, params, wrt, in_shapes)
        return rule

    def lowering(args, attrs, ctx):
        params, wrt = decode_attrs(attrs)
        return _chain(fn, params, wrt)(*args)

    def vjp(g, node, dy):
        params, wrt = decode_attrs(node.op.attrs)
        return emit_vjp(g, name, params, wrt, list(node.inputs), dy)

    register_op(name, shape_rule(False), lowering, vjp)
    register_op(f"{name}_vjp", shape_rule(True), lowering, vjp)


def function_node(g, name: str, inputs, params: dict) -> int:
    """A ``name`` Custom node (fn applied to ``inputs``)."""
    if get_custom_op(name) is None:
        raise GraphError(f"custom op {name!r} is not registered (register_jax_function)")
    return g.add_node(Custom(name=name, num_inputs=len(inputs), attrs=encode_attrs(params)), tuple(inputs))


# -- Gaussian splatting -----------------------------------------------------------------------

SPLAT_BACKWARD = "rlx_jax.gaussian_splat_render_backward"
SPLAT_RENDER = "rlx_jax.gaussian_splat_render"


def _scene(pos, sc, rot, opac, col, sh):
    n = pos.shape[0] // 3
    k = sh.shape[0] // (3 * n) if n else 0
    return (pos.reshape(n, 3), sc.reshape(n, 3), rot.reshape(n, 4), opac.reshape(n), col.reshape(n, 3),
            sh.reshape(n, k, 3))


def _splat_render(pos, sc, rot, opac, col, sh, meta, **params):
    """GaussianSplatRender on RLX's flat buffers (flat image out)."""
    from rlx_jax.vjp_rules.gaussian_splat import gaussian_splat_render

    return gaussian_splat_render(*_scene(pos, sc, rot, opac, col, sh), meta, **params)


def _splat_backward(pos, sc, rot, opac, col, sh, meta, dy, **params):
    """GaussianSplatRenderBackward on RLX's flat buffers (packed gradient out)."""
    from rlx_jax.vjp_rules.gaussian_splat import gaussian_splat_render_backward

    return gaussian_splat_render_backward(*_scene(pos, sc, rot, opac, col, sh), meta, dy, packed=True, **params)


def register_builtin() -> None:
    """The splat functions (meta, input 6, is not differentiated: RLX's rule)."""
    register_jax_function(SPLAT_RENDER, _splat_render, nondiff=(6,))
    register_jax_function(SPLAT_BACKWARD, _splat_backward, nondiff=(6,))


register_builtin()
