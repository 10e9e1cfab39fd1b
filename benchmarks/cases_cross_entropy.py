"""Fused linear + cross-entropy vs the unfused plain-JAX path (logits = hidden @ weight,
log-softmax, pick the label; ``jax.value_and_grad``), loss and gradients under ``jit``.

Variants, timed in interleaved rounds (each round runs every variant once, so a slow
patch of a shared machine hits all of them):

- ``unfused``: what a JAX user writes (optax-style), the baseline;
- ``ours mean``: ``fused_linear_cross_entropy(..., reduction="mean")``: gradients
  computed in the forward pass, three vocabulary-sized matmuls;
- ``ours none``: ``reduction="none"`` then ``jnp.mean``: per-row cotangents, the
  backward recomputes the logits (four).

Printed per variant: median ms, speed relative to ``unfused`` (>1 is faster), compiled
temp memory and its ratio to ``unfused``, max abs difference of loss and gradients.

    python -m benchmarks.cases_cross_entropy --preset cpu
    python -m benchmarks.cases_cross_entropy --preset gpu-32k --json out.json
    python -m benchmarks.cases_cross_entropy --preset gpu-128k

``fused_linear_case`` / ``fused_linear_memory`` give the same comparison as a harness
``Case`` (for ``benchmarks.run``) and as compiled memory only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.harness import Case
from rlx_jax.ops import fused_linear_cross_entropy

#: name -> (N rows, D hidden, V vocabulary, dtype)
PRESETS = {
    "cpu": (2048, 256, 8192, jnp.float32),
    "gpu-32k": (16384, 2048, 32000, jnp.bfloat16),
    "gpu-128k": (16384, 2048, 128256, jnp.bfloat16),
}


def unfused_mean_loss(h, wt, y):
    """Plain JAX: mean over rows of -log_softmax(h @ wt)[label] (f32 softmax)."""
    logp = jax.nn.log_softmax((h @ wt).astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))


def variants(chunk: int | None = None, narrow_logits: bool = False) -> dict:
    """name -> mean loss function of (hidden, weight, labels). ``narrow_logits``: our
    logits blocks in hidden's dtype (``logits_dtype=hidden.dtype``, the rounding of the
    unfused path's ``h @ wt``) instead of the op's default f32."""
    def kw(h):
        return {"chunk_size": chunk, **({"logits_dtype": h.dtype} if narrow_logits else {})}

    return {
        "unfused": unfused_mean_loss,
        "ours mean": lambda h, wt, y: fused_linear_cross_entropy(h, wt, y, reduction="mean", **kw(h)),
        "ours none": lambda h, wt, y: jnp.mean(fused_linear_cross_entropy(h, wt, y, **kw(h)).astype(jnp.float32)),
    }


def make_inputs(n: int, d: int, v: int, dtype, key=None):
    kh, kw, kl = jax.random.split(jax.random.PRNGKey(0) if key is None else key, 3)
    h = jax.random.normal(kh, (n, d), jnp.float32).astype(dtype)
    wt = (jax.random.normal(kw, (d, v), jnp.float32) / d**0.5).astype(dtype)
    return h, wt, jax.random.randint(kl, (n,), 0, v, jnp.int32)


def _grad_fn(loss):
    return jax.jit(jax.value_and_grad(lambda h, wt, y: loss(h, wt, y).astype(jnp.float32), (0, 1)))


def temp_mb(fn, *args) -> float:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def compare(n: int, d: int, v: int, dtype, rounds: int = 5, chunk: int | None = None,
            narrow_logits: bool = False) -> list[dict]:
    """Interleaved timing of every variant; one dict per variant."""
    args = make_inputs(n, d, v, dtype)
    fns = {name: _grad_fn(f) for name, f in variants(chunk, narrow_logits).items()}
    want = jax.block_until_ready(fns["unfused"](*args))
    rows = {}
    for name, fn in fns.items():
        got = jax.block_until_ready(fn(*args))  # also the warm-up
        err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        rows[name] = {"variant": name, "temp_MB": temp_mb(fn, *args), "max_abs_diff": err, "times": []}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            rows[name]["times"].append((time.perf_counter() - t0) * 1e3)
    base = rows["unfused"]
    base_ms = statistics.median(base["times"])
    out = []
    for r in rows.values():
        ms = statistics.median(r.pop("times"))
        out.append({**r, "N": n, "D": d, "V": v, "dtype": jnp.dtype(dtype).name, "ms": ms,
                    "speed_vs_unfused": base_ms / ms, "temp_vs_unfused": r["temp_MB"] / max(base["temp_MB"], 1e-9)})
    return out


def fused_linear_memory(n: int, d: int, v: int, dtype, chunk: int | None = None) -> dict:
    """Compiled temp memory (MB) of loss + gradients, ours (mean) vs unfused; nothing runs."""
    specs = (jax.ShapeDtypeStruct((n, d), dtype), jax.ShapeDtypeStruct((d, v), dtype),
             jax.ShapeDtypeStruct((n,), jnp.int32))
    fs = variants(chunk)
    return {"temp_MB_ours": temp_mb(_grad_fn(fs["ours mean"]), *specs),
            "temp_MB_unfused": temp_mb(_grad_fn(fs["unfused"]), *specs)}


def fused_linear_case(n: int, d: int, v: int, dtype, chunk: int | None = None) -> Case:
    """The harness case: gradients (d hidden, d weight) of the mean loss, ours vs unfused;
    the floor is reading hidden and weight and writing their gradients (the op is compute
    bound: its point is memory, in ``extra``)."""
    fs = variants(chunk)
    grad = lambda loss: (lambda h, wt, y: jax.grad(loss, (0, 1))(h, wt, y))  # noqa: E731
    item = jnp.dtype(dtype).itemsize
    return Case(
        name=f"fused_linear_ce mean fwd+bwd {jnp.dtype(dtype).name} {n}x{d}x{v}",
        make=lambda key: make_inputs(n, d, v, dtype, key),
        ours=grad(fs["ours mean"]),
        xla=grad(fs["unfused"]),
        floor_bytes=2 * (n * d + d * v) * item,
        extra=fused_linear_memory(n, d, v, dtype, chunk),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=None, help="rows per block (default: the op's choice)")
    ap.add_argument("--narrow-logits", action="store_true",
                    help="our logits blocks in the inputs' dtype (logits_dtype=hidden.dtype), as the unfused h @ wt")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    a = ap.parse_args(argv)
    if a.rounds < 1 or (a.chunk is not None and a.chunk < 1):
        ap.error("--rounds and --chunk must be >= 1")
    n, d, v, dtype = PRESETS[a.preset]
    print(f"# fused linear cross-entropy, loss + grads, N {n} D {d} V {v} {jnp.dtype(dtype).name}, "
          f"{jax.devices()[0].device_kind}, {a.rounds} interleaved rounds, median; our blocks: "
          f"{a.chunk or 'default'} rows, logits in {jnp.dtype(dtype).name if a.narrow_logits else 'f32'}", flush=True)
    rows = compare(n, d, v, dtype, a.rounds, a.chunk, a.narrow_logits)
    for r in rows:
        print(f"{r['variant']:10s} {r['ms']:9.2f} ms  speed {r['speed_vs_unfused']:.2f}x  "
              f"temp {r['temp_MB']:9.1f} MB ({r['temp_vs_unfused']:.3f}x)  max|diff| {r['max_abs_diff']:.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
