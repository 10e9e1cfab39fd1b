"""Row-wise fused ops: softmax cross-entropy, softmax, RoPE, cumsum, fused linear CE.

Each case: ours (the rlx_jax op, its kernels) vs XLA's autodiff of the pure-JAX
reference vs a copy of the op's minimal traffic. Floors:

- softmax cross-entropy forward + backward [N, C]: logits read, dlogits written (2 N C);
- softmax forward + backward [N, W]: x and dy read, dx written (3 N W); the backward
  alone (given y): y and dy read, dx written (3 N W);
- RoPE backward [N, W]: dy read, dx written (2 N W; the tables are O(S * n_rot));
- cumsum backward [N, W]: dy read, dx written (2 N W);
- fused linear cross-entropy (``benchmarks.cases_cross_entropy``): compute bound (three
  [N, D] x [D, V] matmuls); its floor is reading hidden and weight and writing their
  gradients, so ours/copy is large by nature. Its point is memory: the compiled temp
  size of ours vs the unfused version is stored in the row (``temp_MB_ours`` /
  ``temp_MB_unfused``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.harness import Case
from benchmarks.cases_cross_entropy import fused_linear_case, fused_linear_memory  # noqa: F401  (re-export)
from rlx_jax.ops import cumsum, rope, softmax, softmax_cross_entropy
from rlx_jax.vjp_rules.cross_entropy import reference_softmax_cross_entropy
from rlx_jax.vjp_rules.cumsum import reference_cumsum
from rlx_jax.vjp_rules.rope import reference_rope
from rlx_jax.vjp_rules.softmax import reference_softmax, reference_softmax_bwd, softmax_bwd


def _name(dtype) -> str:
    return jnp.dtype(dtype).name


def cross_entropy_case(n: int, c: int, dtype) -> Case:
    def make(key):
        kx, kl = jax.random.split(key)
        logits = (2.0 * jax.random.normal(kx, (n, c), jnp.float32)).astype(dtype)
        return logits, jax.random.randint(kl, (n,), 0, c, jnp.int32)

    def grad_of(loss_fn):
        return lambda x, y: jax.grad(lambda x: jnp.sum(loss_fn(x, y).astype(jnp.float32)) / n)(x)

    return Case(
        name=f"softmax_ce fwd+bwd {_name(dtype)} {n}x{c}",
        make=make,
        ours=grad_of(softmax_cross_entropy),
        xla=grad_of(lambda x, y: reference_softmax_cross_entropy(x, y)[0]),
        floor_bytes=2 * n * c * jnp.dtype(dtype).itemsize,
    )


def cross_entropy_bwd_case(n: int, c: int, dtype) -> Case:
    """The backward alone, each side from its own forward's residuals: the arguments are
    the two ``jax.vjp`` closures (ours holds logits and the saved lse; XLA's whatever its
    linearisation of the reference kept) and dloss. Floor: logits read, dlogits written
    (2 N C; the per-row lse, labels and dloss are O(N))."""

    def make(key):
        kx, kl, kd = jax.random.split(key, 3)
        logits = (2.0 * jax.random.normal(kx, (n, c), jnp.float32)).astype(dtype)
        labels = jax.random.randint(kl, (n,), 0, c, jnp.int32)
        dloss = jax.random.normal(kd, (n,), jnp.float32).astype(dtype)
        _, vjp_ours = jax.jit(lambda x: jax.vjp(lambda x: softmax_cross_entropy(x, labels), x))(logits)
        _, vjp_ref = jax.jit(lambda x: jax.vjp(lambda x: reference_softmax_cross_entropy(x, labels)[0], x))(logits)
        return vjp_ours, vjp_ref, dloss

    return Case(
        name=f"softmax_ce bwd {_name(dtype)} {n}x{c}",
        make=make,
        ours=lambda vo, vr, dl: vo(dl)[0],
        xla=lambda vo, vr, dl: vr(dl)[0],
        floor_bytes=2 * n * c * jnp.dtype(dtype).itemsize,
    )


def softmax_case(n: int, w: int, dtype) -> Case:
    def make(key):
        kx, kd = jax.random.split(key)
        return (jax.random.normal(kx, (n, w), jnp.float32).astype(dtype), jax.random.normal(kd, (n, w), jnp.float32).astype(dtype))

    def vjp_of(fn):
        return lambda x, dy: jax.vjp(fn, x)[1](dy)[0]

    return Case(
        name=f"softmax fwd+bwd {_name(dtype)} {n}x{w}",
        make=make,
        ours=vjp_of(softmax),
        xla=vjp_of(lambda x: reference_softmax(x)[0]),
        floor_bytes=3 * n * w * jnp.dtype(dtype).itemsize,
    )


def softmax_bwd_case(n: int, w: int, dtype) -> Case:
    def make(key):
        kx, kd = jax.random.split(key)
        y = reference_softmax(jax.random.normal(kx, (n, w), jnp.float32).astype(dtype))[0]
        return y, jax.random.normal(kd, (n, w), jnp.float32).astype(dtype)

    return Case(
        name=f"softmax bwd_only {_name(dtype)} {n}x{w}",
        make=make,
        ours=lambda y, dy: softmax_bwd(y, dy)[0],
        xla=lambda y, dy: reference_softmax_bwd(y, dy)[0],
        floor_bytes=3 * n * w * jnp.dtype(dtype).itemsize,
    )


def rope_case(seq: int, heads: int, head_dim: int, n_rot: int, dtype) -> Case:
    w = heads * head_dim

    def make(key):
        kx, ka = jax.random.split(key)
        ang = jax.random.uniform(ka, (seq, n_rot // 2), jnp.float32, 0, 6.3)
        dy = jax.random.normal(kx, (1, seq, w), jnp.float32).astype(dtype)
        return dy, jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype)

    def ours(dy, c, s):
        return jax.vjp(lambda x: rope(x, c, s, head_dim=head_dim, n_rot=n_rot), dy)[1](dy)[0]

    def xla(dy, c, s):
        # the reference takes [B, S, H, D]: the same memory as the merged [B, S, H * D] layout
        def ref(x):
            return reference_rope(x.reshape(1, seq, heads, head_dim), c, s, n_rot=n_rot)[0].reshape(x.shape)

        return jax.vjp(ref, dy)[1](dy)[0]

    return Case(
        name=f"rope bwd {_name(dtype)} {seq}x{w} hd{head_dim} rot{n_rot}",
        make=make,
        ours=ours,
        xla=xla,
        floor_bytes=2 * seq * w * jnp.dtype(dtype).itemsize,
    )


def cumsum_case(n: int, w: int, axis: int, exclusive: bool, dtype) -> Case:
    def make(key):
        return (jax.random.normal(key, (n, w), jnp.float32).astype(dtype),)

    def ours(dy):
        return jax.vjp(lambda x: cumsum(x, axis=axis, exclusive=exclusive), dy)[1](dy)[0]

    def xla(dy):
        # XLA's autodiff of jnp.cumsum (what JAX users get today)
        def f(x):
            y = jnp.cumsum(x.astype(jnp.float32), axis=axis)
            return (y - x if exclusive else y).astype(x.dtype)

        return jax.vjp(f, dy)[1](dy)[0]

    ex = " excl" if exclusive else ""
    return Case(
        name=f"cumsum bwd{ex} {_name(dtype)} {n}x{w} axis{axis}",
        make=make,
        ours=ours,
        xla=xla,
        floor_bytes=2 * n * w * jnp.dtype(dtype).itemsize,
    )


def rope_cumsum_gpu_cases() -> list[Case]:
    """RoPE and cumsum backward at GPU sizes (the CUDA kernels of ffi/cuda/rope.cu and
    cumsum.cu): 32768 positions x 32 heads x 128 (full and half rotary), cumsum over
    rows of 32768 x 4096 (one pass), down the 32768 axis (columns: the chained column
    scan, f32 and bf16) and along 64 rows of 2^20 (long rows: the chained row scan, f32
    and bf16)."""
    return [
        rope_case(32768, 32, 128, 128, jnp.float32),
        rope_case(32768, 32, 128, 128, jnp.bfloat16),
        rope_case(32768, 32, 128, 64, jnp.bfloat16),
        cumsum_case(32768, 4096, 1, False, jnp.float32),
        cumsum_case(32768, 4096, 1, True, jnp.bfloat16),
        cumsum_case(32768, 4096, 0, False, jnp.float32),
        cumsum_case(32768, 4096, 0, False, jnp.bfloat16),
        cumsum_case(64, 1 << 20, 1, False, jnp.float32),
        cumsum_case(64, 1 << 20, 1, False, jnp.bfloat16),
    ]


def cases(device_kind: str) -> list[Case]:
    if device_kind == "gpu":  # cross-entropy, softmax, RoPE, cumsum: the CUDA kernels
        return [
            cross_entropy_case(8192, 32000, jnp.float32),
            cross_entropy_case(8192, 32000, jnp.bfloat16),
            cross_entropy_bwd_case(8192, 32000, jnp.float32),
            cross_entropy_bwd_case(8192, 32000, jnp.bfloat16),
            softmax_case(32768, 4096, jnp.float32),
            softmax_case(32768, 4096, jnp.bfloat16),
            softmax_bwd_case(32768, 4096, jnp.float32),
            softmax_bwd_case(32768, 4096, jnp.bfloat16),
            *rope_cumsum_gpu_cases(),
        ]
    return [
        cross_entropy_case(4096, 32000, jnp.float32),
        cross_entropy_case(4096, 32000, jnp.bfloat16),
        softmax_case(8192, 1024, jnp.float32),
        softmax_bwd_case(8192, 1024, jnp.float32),
        softmax_case(8192, 1024, jnp.bfloat16),
        rope_case(8192, 16, 64, 64, jnp.float32),
        rope_case(8192, 16, 64, 32, jnp.float32),
        rope_case(8192, 16, 64, 64, jnp.bfloat16),
        cumsum_case(8192, 1024, 1, False, jnp.float32),
        cumsum_case(8192, 1024, 1, True, jnp.float32),
        cumsum_case(8192, 1024, 0, False, jnp.float32),
        fused_linear_case(1024, 256, 32000, jnp.float32),
    ]
