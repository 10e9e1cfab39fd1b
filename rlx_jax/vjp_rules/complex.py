"""``complex_norm_sq(z) = |z|^2 = re(z)^2 + im(z)^2`` (RLX ``ComplexNormSq``, C64 -> F32).

Gradient conventions. RLX's ``ComplexNormSqBackward`` returns the Wirtinger form
``dz = g * z``: for a real loss L with upstream g = dL/d|z|^2, ``g * z = dL/d conj(z)``
(since |z|^2 = z conj(z)). JAX's reverse mode instead returns, for a real loss, the
cotangent ``dL/dre - i dL/dim = 2 * conj(dL/d conj(z))`` (``jax.grad(lambda z:
jnp.abs(z)**2)(z) == 2 * conj(z)``). So

    JAX cotangent = 2 * conj(complex_norm_sq_backward(z, g)) = 2 * g * conj(z),

and the steepest-descent direction in both conventions is -conj(JAX cotangent) =
-2 * (RLX dz). ``complex_norm_sq`` is a primitive triple whose tangent
``t = 2 * Re(conj(z) * tz)`` transposes through ``complex_norm_sq_backward`` with that
conversion, so ``jax.grad`` through it equals JAX's own autodiff of ``jnp.abs(z)**2``
and forward mode / second order work too.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.interpreters import ad

from rlx_jax.vjp_rules._primitive import FusedPrimitive, instantiate


def reference_complex_norm_sq(z):
    """|z|^2 in z's real dtype; returns (y,)."""
    return (jnp.real(z) ** 2 + jnp.imag(z) ** 2,)


def reference_complex_norm_sq_tangent(z, tz):
    """d|z|^2 = 2 (re z re tz + im z im tz) = 2 Re(conj(z) tz); returns (t,)."""
    return (2 * (jnp.real(z) * jnp.real(tz) + jnp.imag(z) * jnp.imag(tz)),)


cns_fwd = FusedPrimitive("rlx_complex_norm_sq", reference_complex_norm_sq)
cns_tangent = FusedPrimitive("rlx_complex_norm_sq_tangent", reference_complex_norm_sq_tangent)


@cns_fwd.def_jvp
def _fwd_jvp(primals, tangents):
    (z,) = primals
    (tz,) = instantiate(tangents, primals)
    return cns_fwd(z), cns_tangent(z, tz)


@cns_tangent.def_transpose
def _tangent_transpose(cts, z, tz):
    if ad.is_undefined_primal(z):
        raise ValueError("complex_norm_sq tangent is linear in tz only")
    (ct,) = cts
    if type(ct) is ad.Zero:
        return [None, ad.Zero(tz.aval)]
    # JAX's complex cotangent from RLX's Wirtinger gradient (module docstring)
    return [None, 2 * jnp.conj(complex_norm_sq_backward(z, ct))]


def _check_z(z, who):
    z = jnp.asarray(z)
    if not jnp.issubdtype(z.dtype, jnp.complexfloating):
        raise TypeError(f"{who}: z must be complex (c64), got {z.dtype}")
    return z


def complex_norm_sq(z):
    """|z|^2 elementwise: complex64 -> float32 (complex128 -> float64), same shape."""
    (y,) = cns_fwd(_check_z(z, "complex_norm_sq"))
    return y


def complex_norm_sq_backward(z, g):
    """RLX ``ComplexNormSqBackward``: the Wirtinger gradient ``dz = g * z`` (complex, shaped
    like z) for a real upstream gradient g shaped like |z|^2."""
    z = _check_z(z, "complex_norm_sq_backward")
    g = jnp.asarray(g)
    if g.shape != z.shape:
        raise ValueError(f"complex_norm_sq_backward: g shape {g.shape} differs from z shape {z.shape}")
    return jnp.real(g).astype(jnp.real(z).dtype) * z
