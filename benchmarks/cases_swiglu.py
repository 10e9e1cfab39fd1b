"""SwiGLU (``silu(gate) * up``): ours vs XLA's autodiff of ``jax.nn.silu(gate) * up`` vs
the copy floor.

Two cases per size, [N, F] = a Llama MLP's gate / up activations:

- ``swiglu fwd+bwd``: h from (gate, up), then (dgate, dup) from dh, with dh passing an
  optimisation barrier together with h (it arrives after h). Ours: XLA's forward fusion,
  then the kernel ``rlx_swiglu_bwd``. Floor: the forward reads gate and up and writes h,
  the backward reads gate, up and dh and writes dgate and dup: 8 N F elements. In so small
  a program XLA runs its backward as one fusion (on an H200, all 8 passes in the copy
  floor's time); in a training step's program it runs two (benchmarks/e2e_profile.py), so
  the ``bwd`` case below is the step's.
- ``swiglu bwd``: the backward alone, each side from its own forward's residuals (the
  arguments are the two ``jax.vjp`` closures and dh). Floor: 5 N F elements.

    python -m benchmarks.run --cases swiglu                 # the default device's preset
    python -m benchmarks.run --cases swiglu --device gpu --json out.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.harness import Case
from rlx_jax.ops import swiglu

#: name -> (N rows, F FFN width, dtype)
PRESETS = {
    "cpu": (2048, 1408, jnp.bfloat16),
    "gpu": (16384, 5632, jnp.bfloat16),
}


def _xla(a, b):
    """What a JAX user writes (the plain step of ``benchmarks/e2e_step.py``), differentiated
    by JAX."""
    return jax.nn.silu(a) * b


def _make(n: int, f: int, dtype):
    def make(key):
        ka, kb, kd = jax.random.split(key, 3)
        return tuple((s * jax.random.normal(k, (n, f), jnp.float32)).astype(dtype)
                     for k, s in ((ka, 2.0), (kb, 1.0), (kd, 1.0)))

    return make


def step_case(n: int, f: int, dtype) -> Case:
    def step(fn):
        def run(a, b, dh):
            h, pullback = jax.vjp(fn, a, b)
            h, dh = jax.lax.optimization_barrier((h, dh))  # dh arrives after h, as in a training step
            return (h, *pullback(dh))

        return run

    return Case(
        name=f"swiglu fwd+bwd {jnp.dtype(dtype).name} {n}x{f}",
        make=_make(n, f, dtype),
        ours=step(swiglu),
        xla=step(_xla),
        floor_bytes=8 * n * f * jnp.dtype(dtype).itemsize,
    )


def bwd_case(n: int, f: int, dtype) -> Case:
    def make(key):
        a, b, dh = _make(n, f, dtype)(key)
        _, vjp_ours = jax.jit(lambda a, b: jax.vjp(swiglu, a, b))(a, b)
        _, vjp_xla = jax.jit(lambda a, b: jax.vjp(_xla, a, b))(a, b)
        return vjp_ours, vjp_xla, dh

    return Case(
        name=f"swiglu bwd {jnp.dtype(dtype).name} {n}x{f}",
        make=make,
        ours=lambda vo, vx, dh: vo(dh),
        xla=lambda vo, vx, dh: vx(dh),
        floor_bytes=5 * n * f * jnp.dtype(dtype).itemsize,
    )


def cases(device_kind: str) -> list[Case]:
    n, f, dtype = PRESETS["gpu" if device_kind == "gpu" else "cpu"]
    return [step_case(n, f, dtype), bwd_case(n, f, dtype), step_case(n, f, jnp.float32), bwd_case(n, f, jnp.float32)]

