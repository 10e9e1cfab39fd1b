"""Run in a subprocess with 8 host CPU devices (tests/test_sharding.py): every fused op
under a sharded ``jit`` must (1) give the single-device values and gradients and
(2) compile without an all-gather of its operands. Prints one JSON line per case."""

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


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


# name -> (function of the differentiable args, args, partition specs for the args, diff argnums)
CASES = {
    "rms_norm": (lambda x, g: ops.rms_norm(x, g), (randn(8, 6, 32), randn(32)), (P("data", "model"), P()), (0, 1)),
    "layer_norm": (lambda x, g, b: ops.layer_norm(x, g, b), (randn(8, 6, 32), randn(32), randn(32)),
                   (P("data", "model"), P(), P()), (0, 1, 2)),
    "group_norm": (lambda x, g, b: ops.group_norm(x, g, b, num_groups=4), (randn(8, 8, 5, 5), randn(8), randn(8)),
                   (P("data"), P(), P()), (0, 1, 2)),
    "softmax": (lambda x: ops.softmax(x, axis=-1), (randn(8, 6, 16),), (P("data", "model"),), (0,)),
    "softmax_cross_entropy": (lambda l: ops.softmax_cross_entropy(l, jnp.arange(16) % 10),
                              (randn(16, 10),), (P("data"),), (0,)),
    "rope": (lambda x: ops.rope(x, jnp.asarray(np.cos(np.arange(12)[:, None] * 0.1 * np.arange(1, 5))),
                                jnp.asarray(np.sin(np.arange(12)[:, None] * 0.1 * np.arange(1, 5))), head_dim=8),
             (randn(8, 12, 16),), (P("data", "model"),), (0,)),
    # cumsum flattens the axes before the scanned one into one: split only the first of them
    # (two split leading axes do not flatten without communication)
    "cumsum": (lambda x: ops.cumsum(x, axis=1), (randn(8, 6, 16),), (P("data", None, "model"),), (0,)),
    # batch and heads split
    "attention": (lambda q, k, v: ops.attention(q, k, v, mask_kind="causal"),
                  (randn(8, 12, 4, 8), randn(8, 12, 4, 8), randn(8, 12, 4, 8)),
                  (P("data", None, "model"), P("data", None, "model"), P("data", None, "model")), (0, 1, 2)),
    # grouped kv heads: a shard of query heads needs its groups' kv heads, so only the batch splits
    "attention_gqa": (lambda q, k, v, bias: ops.attention(q, k, v, bias=bias, softcap=5.0),
                      (randn(8, 12, 4, 8), randn(8, 12, 2, 8), randn(8, 12, 2, 8), randn(8, 4, 12, 12)),
                      (P("data"), P("data"), P("data"), P("data")), (0, 1, 2, 3)),
    "gather": (lambda t, idx: ops.gather(t, idx, axis=0),
               (randn(20, 16), rng.integers(0, 20, (8, 6)).astype(np.int32)), (P(), P("data")), (0,)),
    "max_pool2d": (lambda x: ops.max_pool2d(x, kernel_size=(2, 2), stride=(2, 2)), (randn(8, 4, 6, 6),),
                   (P("data", "model"),), (0,)),
}


def check(name):
    fn, args, specs, argnums = CASES[name]
    loss = lambda *a: jnp.sum(jnp.sin(fn(*a)))
    grad = jax.value_and_grad(loss, argnums)
    want_v, want_g = jax.jit(grad)(*args)
    placed = [jax.device_put(a, NamedSharding(MESH, s)) for a, s in zip(args, specs)]
    jitted = jax.jit(grad)
    got_v, got_g = jitted(*placed)
    # relative to the largest magnitude of each result: the shards' partial sums are added
    # in another order than one device adds them
    pairs = [(got_v, want_v)] + list(zip(got_g, want_g))
    err = max(float(jnp.max(jnp.abs(a - b))) / max(float(jnp.max(jnp.abs(b))), 1.0) for a, b in pairs)
    hlo = jitted.lower(*placed).compile().as_text()
    gathers = [line.strip()[:160] for line in hlo.splitlines() if re.search(r"= \S+ all-gather\(", line)]
    kernels = sorted(set(re.findall(r'custom_call_target="(rlx_[a-z0-9_]+)"', hlo)))
    return {"op": name, "max_err": err, "all_gathers": gathers, "kernels": kernels}


def check_train_step():
    """The data-parallel transformer step: batch split over 8 devices."""
    from rlx_jax.models import TransformerConfig, transformer_lm
    from rlx_jax.train.loop import TrainConfig, data_mesh, make_optimizer, make_step

    model = transformer_lm(TransformerConfig(seq_len=16, layers=1, width=32, heads=2))
    step = make_step(model.build(16), make_optimizer(TrainConfig(steps=10)), True, data_mesh(8))
    hlo = step.as_text()
    gathers = [line.strip()[:160] for line in hlo.splitlines() if re.search(r"= \S+ all-gather\(", line)]
    kernels = sorted(set(re.findall(r'custom_call_target="(rlx_[a-z0-9_]+)"', hlo)))
    return {"op": "train_step", "max_err": 0.0, "all_gathers": gathers, "kernels": kernels}


if __name__ == "__main__":
    CASES["train_step"] = None
    for name in (sys.argv[1:] or CASES):
        try:
            print(json.dumps(check_train_step() if name == "train_step" else check(name)), flush=True)
        except Exception as exc:  # reported, the test fails on it
            print(json.dumps({"op": name, "error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)
