"""Float64 gradient references for RLX graphs: central finite differences of the
lowered forward graph, ``jax.grad`` of ``to_jax(forward)``, and the graph-level
gradient ``grad_with_loss`` evaluated through ``to_jax``. Used by the graph-autodiff
tests (call them with float64 enabled: the ``x64`` fixture)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import rlx_jax


def forward_loss(graph, params, inputs=None):
    """Output 0 of ``graph`` as a Python float (real part for a complex loss)."""
    out = rlx_jax.to_jax(graph)(params, inputs or {})[0]
    return float(np.real(np.asarray(out)).sum())


def finite_difference(graph, params, wrt, inputs=None, h=1e-6):
    """Central differences ``(L(p + h e_i) - L(p - h e_i)) / 2h`` for every element of
    every parameter named in ``wrt`` (float64 arrays); complex parameters get RLX's
    Wirtinger derivative ``dL/d conj(z) = (dL/dRe + i dL/dIm) / 2`` per element."""
    f = jax.jit(lambda p: jnp.real(rlx_jax.to_jax(graph)(p, inputs or {})[0]).sum())
    grads = {}
    for name in wrt:
        base = np.asarray(params[name])
        g = np.zeros(base.shape, dtype=np.complex128 if np.iscomplexobj(base) else np.float64)
        flat = g.reshape(-1)
        steps = (1.0, 1j) if np.iscomplexobj(base) else (1.0,)
        for i in range(base.size):
            for step in steps:
                hi, lo = base.copy().reshape(-1), base.copy().reshape(-1)
                hi[i] += h * step
                lo[i] -= h * step
                d = (float(f(dict(params, **{name: hi.reshape(base.shape)})))
                     - float(f(dict(params, **{name: lo.reshape(base.shape)})))) / (2 * h)
                flat[i] += d * step * (0.5 if np.iscomplexobj(base) else 1.0)
        grads[name] = g
    return grads


def jax_grad(graph, params, wrt, inputs=None):
    """``jax.grad`` of ``real(to_jax(graph))`` output 0 w.r.t. the named parameters."""
    f = rlx_jax.to_jax(graph)

    def loss(sub):
        return jnp.real(f(dict(params, **sub), inputs or {})[0]).sum()

    g = jax.grad(loss)({n: params[n] for n in wrt})
    return {n: np.asarray(v) for n, v in g.items()}


def graph_grad(graph, params, wrt, inputs=None, options=None):
    """``grad_with_loss(graph, wrt)`` lowered and run with ``d_output = 1``: the
    graph-level reverse mode. Returns name -> gradient."""
    gg = rlx_jax.grad_with_loss(graph, list(wrt), options or rlx_jax.GradWithLossOptions.STRICT)
    dname = [n.op.name for n in gg.nodes
             if type(n.op).__name__ == "Input" and n.op.name.startswith("d_output")][-1]
    loss_shape = tuple(gg.node(gg.outputs[0]).shape.dims)
    loss_dtype = gg.node(gg.outputs[0]).shape.dtype.to_numpy()
    feeds = dict(inputs or {}, **{dname: np.ones(loss_shape, loss_dtype)})
    outs = rlx_jax.to_jax(gg)(params, feeds)
    n_grads = len(wrt)
    return {n: np.asarray(v) for n, v in zip(wrt, outs[len(outs) - n_grads:])}


def assert_grads_close(got, want, rtol=1e-6, what=""):
    """Every array of ``got`` matches ``want`` to ``rtol`` of the larger magnitude."""
    for name in want:
        a, b = np.asarray(got[name]), np.asarray(want[name])
        assert a.shape == b.shape, (what, name, a.shape, b.shape)
        scale = max(float(np.max(np.abs(b))) if b.size else 0.0, 1.0)
        err = float(np.max(np.abs(a - b))) if b.size else 0.0
        assert err <= rtol * scale, f"{what} d/d{name}: max abs err {err:.3g} (scale {scale:.3g})"
