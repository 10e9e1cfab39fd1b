"""Prototype for the lead: an RMSNorm pullback whose residuals are (x, gamma) only, the
backward kernel recomputing rstd (target rlx_rms_norm_bwd_x). When the forward's y is
not used (the benchmark's `jax.vjp(rms_norm)` then pullback), XLA drops the forward
custom call, so the pullback costs one read of x and dy and one write of dx.

Prints, for 32768 x 4096 f32 and bf16: whether the compiled HLO still runs the forward,
and pipelined / synced times of this pullback, of rlx_jax's current one, of XLA's
autodiff of the reference, and of the harness's copy floor."""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import rlx_jax  # noqa: F401
from benchmarks.harness import copy_floor_fn
from rlx_jax.ops import rms_norm
from rlx_jax.vjp_rules.rms_norm import cuda_bwd_scratch_size, reference_rms_norm

EPS = 1e-6


def sync_ms(fn, args, reps=30):
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def pipelined_ms(fn, args, n=50, rounds=5):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(n)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t0) * 1e3 / n)
        del outs
    return statistics.median(ts)


@jax.custom_vjp
def rms_norm_rc(x, g):
    y, _ = jax.ffi.ffi_call(
        "rlx_rms_norm_fwd",
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)),
    )(x, g, jnp.zeros_like(g), eps=np.float32(EPS))
    return y


def _fwd(x, g):
    return rms_norm_rc(x, g), (x, g)


def _bwd(res, dy):
    x, g = res
    rows = int(np.prod(x.shape[:-1]))
    p = jax.ShapeDtypeStruct(g.shape, g.dtype)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), p, p,
           jax.ShapeDtypeStruct((cuda_bwd_scratch_size(rows, x.shape[-1]),), jnp.float32))
    dx, dg, _, _ = jax.ffi.ffi_call("rlx_rms_norm_bwd_x", out)(x, g, dy, eps=np.float32(EPS))
    return dx, dg


rms_norm_rc.defvjp(_fwd, _bwd)

for dtype in (jnp.float32, jnp.bfloat16):
    n, h = 32768, 4096
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k[0], (n, h), jnp.float32).astype(dtype)
    g = (1.0 + 0.1 * jax.random.normal(k[1], (h,), jnp.float32)).astype(dtype)
    dy = jax.random.normal(k[2], (n, h), jnp.float32).astype(dtype)
    proto = jax.jit(lambda x, g, dy: jax.vjp(rms_norm_rc, x, g)[1](dy))
    ours = jax.jit(lambda x, g, dy: jax.vjp(lambda x, g: rms_norm(x, g, eps=EPS), x, g)[1](dy))
    xla = jax.jit(lambda x, g, dy: jax.vjp(lambda x, g: reference_rms_norm(x, g, jnp.zeros_like(g), eps=EPS)[0], x, g)[1](dy))
    hlo = proto.lower(x, g, dy).compile().as_text()
    got, want = proto(x, g, dy), xla(x, g, dy)
    err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) / max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))), 1.0)
              for a, b in zip(got, want))
    floor_bytes = 3 * n * h * jnp.dtype(dtype).itemsize
    cf, ca = copy_floor_fn(floor_bytes, jax.devices()[0])
    t = {name: (sync_ms(f, a), pipelined_ms(f, a)) for name, f, a in
         (("proto", proto, (x, g, dy)), ("ours_now", ours, (x, g, dy)), ("xla", xla, (x, g, dy)), ("copy", cf, ca))}
    print(f"{jnp.dtype(dtype).name} {n}x{h}: forward in compiled HLO: {'rlx_rms_norm_fwd' in hlo}; "
          f"max rel err vs XLA {err:.2e}")
    for mode, i in (("sync", 0), ("pipelined", 1)):
        print(f"  {mode:9s} proto {t['proto'][i]:.3f} ms  current {t['ours_now'][i]:.3f}  xla {t['xla'][i]:.3f}  "
              f"copy {t['copy'][i]:.3f} | proto/copy {t['proto'][i] / t['copy'][i]:.3f}  "
              f"xla/proto {t['xla'][i] / t['proto'][i]:.2f}  proto {floor_bytes / t['proto'][i] / 1e6:.0f} GB/s", flush=True)
