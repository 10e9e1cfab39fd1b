"""Run in a subprocess with 8 host CPU devices (tests/test_cross_entropy.py): the
cross-entropy ops with the class / vocabulary axis sharded (and rows sharded too) must
give the single-device loss and gradients, and their compiled loss + gradient must hold
no all-gather (the vocabulary-parallel combine needs all-reduces of row statistics only).
Prints one JSON line per case."""

from __future__ import annotations

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from rlx_jax import ops  # noqa: E402

MESH = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
rng = np.random.default_rng(0)
N, D, V = 16, 8, 40


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


LABELS = rng.integers(0, V, N).astype(np.int32)
LABELS[[1, 6]] = -100  # ignored rows
LABELS[3] = V - 1  # the last column, on the last shard
LABELS3 = LABELS.reshape(4, 4)
W = np.linspace(0.5, 1.5, N).astype(np.float32)


def weighted(x):
    return jnp.sum(x * W.reshape(x.shape)) if x.ndim else x


# name -> (function of the differentiable args, args, partition specs, diff argnums)
CASES = {
    "softmax_ce_vocab_and_rows": (lambda z: weighted(ops.softmax_cross_entropy(z, LABELS)), (randn(N, V),),
                                  (P("data", "model"),), (0,)),
    "softmax_ce_vocab_8": (lambda z: weighted(ops.softmax_cross_entropy(z, LABELS)), (randn(N, V),),
                           (P(None, ("data", "model")),), (0,)),
    "softmax_ce_rank3": (lambda z: weighted(ops.softmax_cross_entropy(z, LABELS3)), (randn(4, 4, V),),
                         (P("data", None, "model"),), (0,)),
    "softmax_ce_backward_op": (lambda z: jnp.sum(jnp.sin(ops.softmax_cross_entropy_backward(z, LABELS, W))),
                               (randn(N, V),), (P("data", "model"),), (0,)),
    "linear_ce_none": (lambda h, w: weighted(ops.fused_linear_cross_entropy(h, w, LABELS, chunk_size=3)),
                       (randn(N, D), randn(D, V)), (P("data"), P(None, "model")), (0, 1)),
    "linear_ce_mean": (lambda h, w: ops.fused_linear_cross_entropy(h, w, LABELS, reduction="mean", chunk_size=3),
                       (randn(N, D), randn(D, V)), (P("data"), P(None, "model")), (0, 1)),
    "linear_ce_mean_bf16_logits": (
        lambda h, w: ops.fused_linear_cross_entropy(h, w, LABELS, reduction="mean", chunk_size=3,
                                                    logits_dtype=jnp.bfloat16),
        (randn(N, D), randn(D, V)), (P("data"), P(None, "model")), (0, 1)),
    "linear_ce_sum_vocab_8": (lambda h, w: ops.fused_linear_cross_entropy(h, w, LABELS, reduction="sum"),
                              (randn(N, D), randn(D, V)), (P(), P(None, ("data", "model"))), (0, 1)),
    "linear_ce_mean_rank3": (lambda h, w: ops.fused_linear_cross_entropy(h.reshape(4, 4, D), w, LABELS3,
                                                                        reduction="mean", chunk_size=2),
                             (randn(N, D), randn(D, V)), (P("data"), P(None, "model")), (0, 1)),
    # rows and vocabulary over the same mesh axis (sequence parallelism): the rows are
    # gathered ([N, D] hidden, as plain JAX does), the vocabulary stays split
    "linear_ce_rows_and_vocab_same_axis": (
        lambda h, w: ops.fused_linear_cross_entropy(h, w, LABELS, reduction="mean", chunk_size=4),
        (randn(N, D), randn(D, V)), (P("model"), P(None, "model")), (0, 1)),
}


def vocab_sized(line):
    """An all-gather whose result has a vocabulary-sized axis (V or a shard of it)."""
    shape = re.search(r"= \w+\[([0-9,]*)\]", line)
    dims = [int(x) for x in shape.group(1).split(",") if x] if shape else []
    return any(d in (V, V // 2, V // 4, V // 8) for d in dims)


def check(name):
    fn, args, specs, argnums = CASES[name]
    grad = jax.value_and_grad(fn, argnums)
    want_v, want_g = jax.jit(grad)(*args)
    placed = [jax.device_put(a, NamedSharding(MESH, s)) for a, s in zip(args, specs)]
    jitted = jax.jit(grad)
    got_v, got_g = jitted(*placed)
    pairs = [(got_v, want_v)] + list(zip(got_g, want_g))
    err = max(float(jnp.max(jnp.abs(a - b))) / max(float(jnp.max(jnp.abs(b))), 1.0) for a, b in pairs)
    hlo = jitted.lower(*placed).compile().as_text()
    gathers = [line.strip()[:200] for line in hlo.splitlines() if re.search(r"= \S+ all-gather\(", line)]
    reduces = [line.strip()[:200] for line in hlo.splitlines() if re.search(r"= \S+ all-reduce(-start)?\(", line)]
    return {"op": name, "max_err": err, "all_gathers": gathers, "all_reduces": len(reduces),
            "vocab_gathers": [g for g in gathers if vocab_sized(g)],
            "finite": bool(np.isfinite(float(got_v)))}


if __name__ == "__main__":
    for name in (sys.argv[1:] or CASES):
        try:
            print(json.dumps(check(name)), flush=True)
        except Exception as exc:  # reported, the test fails on it
            print(json.dumps({"op": name, "error": f"{type(exc).__name__}: {exc}"[:3000]}), flush=True)
