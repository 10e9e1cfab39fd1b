"""Run in a subprocess with 4 host CPU devices (tests/test_shard_map.py): every fused op
inside ``jax.shard_map`` with its default ``check_vma=True``, its data split over the
mesh axis and its parameters replicated, must give the single-device loss and gradients
of the whole batch. A replicated parameter's gradient is the sum of the devices' shares:
JAX forms that sum only when the op's results are typed as varying over the axis.
Prints one JSON line per case."""

from __future__ import annotations

import json
import os
import re

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from rlx_jax import ops  # noqa: E402
from rlx_jax.vjp_rules import attention as _attention  # noqa: E402

# attention lowers to XLA's code on the CPU at small sizes; these checks are about the kernels
_attention.CPU_KERNEL_MIN_SCORE_BYTES = 0

MESH = Mesh(np.array(jax.devices()), ("data",))
D = P("data")
rng = np.random.default_rng(0)
_ANGLES = np.arange(6)[:, None] * 0.1 * np.arange(1, 5)
COS, SIN = np.cos(_ANGLES).astype(np.float32), np.sin(_ANGLES).astype(np.float32)  # [S=6, 4]


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


# name -> (op over the args, args, specs: the data args split over "data", parameters replicated).
# Every op here maps rows (or batch entries) independently, so the op over the whole batch is
# the concatenation of the devices' results: split over "data" on its leading axis, except the
# cases in REPLICATED_OUT.
CASES = {
    "rms_norm": (lambda x, g: ops.rms_norm(x, g), (randn(8, 32), randn(32)), (D, P())),
    "add_rms_norm": (lambda x, r, g: (lambda s, y: 0.5 * s + y)(*ops.add_rms_norm(x, r, g)),
                     (randn(8, 32), randn(8, 32), randn(32)), (D, D, P())),
    "layer_norm": (lambda x, g, b: ops.layer_norm(x, g, b), (randn(8, 32), randn(32), randn(32)), (D, P(), P())),
    "group_norm": (lambda x, g, b: ops.group_norm(x, g, b, num_groups=2), (randn(8, 4, 3, 3), randn(4), randn(4)),
                   (D, P(), P())),
    "softmax": (lambda x: ops.softmax(x, axis=-1), (randn(8, 16),), (D,)),
    "softmax_cross_entropy": (lambda l, y: ops.softmax_cross_entropy(l, y),
                              (randn(8, 10), np.arange(8, dtype=np.int32) % 10), (D, D)),
    "rope": (lambda x, c, s: ops.rope(x, c, s), (randn(8, 6, 2, 8), COS, SIN), (D, P(), P())),
    "rope_split": (lambda x, c, s: jnp.concatenate(ops.rope_split(x, c, s, (2, 1, 1), rotate=(True, True, False)),
                                                   axis=2), (randn(8, 6, 4, 8), COS, SIN), (D, P(), P())),
    "attention": (lambda q, k, v: ops.attention(q, k, v, mask_kind="causal"),
                  (randn(8, 6, 4, 8), randn(8, 6, 2, 8), randn(8, 6, 2, 8)), (D, D, D)),
    # per-head sinks, replicated: their gradient sums over the devices
    "attention_sinks": (lambda q, k, v, s: ops.attention(q, k, v, mask_kind="causal", sinks=s),
                        (randn(8, 6, 2, 8), randn(8, 6, 2, 8), randn(8, 6, 2, 8), randn(2)), (D, D, D, P())),
    "swiglu": (lambda a, b: ops.swiglu(a, b), (randn(8, 32), randn(8, 32)), (D, D)),
    "swiglu_linear": (lambda a, b, w: ops.swiglu_linear(a, b, w), (randn(8, 32), randn(8, 32), randn(32, 8) / 6),
                      (D, D, P())),
    "rms_norm_linear": (lambda x, g, wq, wk: jnp.concatenate(ops.rms_norm_linear(x, g, (wq, wk)), -1),
                        (randn(8, 32), randn(32), randn(32, 16) / 6, randn(32, 8) / 6), (D, P(), P(), P())),
    "add_rms_norm_linear": (lambda x, r, g, w: (lambda s, o: 0.5 * jnp.sum(s, -1, keepdims=True) + o)(
                                *ops.add_rms_norm_linear(x, r, g, w)),
                            (randn(8, 32), randn(8, 32), randn(32), randn(32, 8) / 6), (D, D, P(), P())),
    "gather": (lambda t, i: ops.gather(t, i, axis=0), (randn(20, 16), rng.integers(0, 20, (8, 3)).astype(np.int32)),
               (P(), D)),
    "cumsum": (lambda x: ops.cumsum(x, axis=1), (randn(8, 16),), (D,)),
    "max_pool2d": (lambda x: ops.max_pool2d(x, kernel_size=(2, 2), stride=(2, 2)), (randn(8, 2, 4, 4),), (D,)),
    # reduction "none": per-row losses, the weight replicated
    "fused_linear_cross_entropy": (lambda h, w, y: ops.fused_linear_cross_entropy(h, w, y, chunk_size=2),
                                   (randn(8, 16), randn(16, 24) / 4, rng.integers(0, 24, 8).astype(np.int32)),
                                   (D, P(), D)),
    # reduction "sum": a scalar a device, summed over the devices by the loss's psum
    "fused_linear_cross_entropy_sum": (
        lambda h, w, y: ops.fused_linear_cross_entropy(h, w, y, reduction="sum", chunk_size=2),
        (randn(8, 16), randn(16, 24) / 4, rng.integers(0, 24, 8).astype(np.int32)), (D, P(), D)),
}


#: cases whose result is one value for the whole device (a reduced loss): the loss weights are
#: replicated too
REPLICATED_OUT = {"fused_linear_cross_entropy_sum"}


def _floating(args):
    return tuple(i for i, a in enumerate(args) if np.issubdtype(np.asarray(a).dtype, np.floating))


def check(name, fn, args, specs):
    argnums = _floating(args)
    out_shape = jax.eval_shape(fn, *args)
    weights = jnp.asarray(rng.standard_normal(out_shape.shape).astype(np.float32))
    w_spec = P() if name in REPLICATED_OUT else D

    def whole(*a):
        return jnp.sum(fn(*a) * weights)

    def local(w, *a):
        return jax.lax.psum(jnp.sum(fn(*a) * w), "data")

    sharded = jax.shard_map(local, mesh=MESH, in_specs=(w_spec, *specs), out_specs=P())
    want_loss, want = jax.value_and_grad(whole, argnums)(*args)
    f = jax.jit(jax.value_and_grad(lambda *a: sharded(weights, *a), argnums))
    loss, got = f(*args)
    text = f.lower(*args).compile().as_text()
    kernels = sorted(set(re.findall(r'custom_call_target="(rlx_[a-z0-9_]+)"', text)))
    # grad taken inside the body as well (cotangents typed inside shard_map)
    inner = jax.shard_map(lambda w, *a: jax.grad(lambda *b: jnp.sum(fn(*b) * w), argnums)(*a), mesh=MESH,
                          in_specs=(w_spec, *specs), out_specs=tuple(specs[i] for i in argnums), check_vma=True)
    partial_grads = jax.jit(inner)(weights, *args)
    # with the replicated parameters' shares summed, the in-body gradients give the whole one
    inner_err = 0.0
    for i, g, gw in zip(argnums, partial_grads, want):
        if specs[i] == P():
            continue  # each device returns its own share: out_specs P() takes device 0's
        inner_err = max(inner_err, float(jnp.max(jnp.abs(g - gw))))
    err = max([abs(float(loss) - float(want_loss))] +
              [float(jnp.max(jnp.abs(g - gw))) / max(1.0, float(jnp.max(jnp.abs(gw)))) for g, gw in zip(got, want)])
    return {"op": name, "max_err": err, "inner_err": inner_err, "kernels": kernels}


def main():
    for name, (fn, args, specs) in CASES.items():
        try:
            row = check(name, fn, args, specs)
        except Exception as e:  # one line per case: the test names the failing one
            row = {"op": name, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(json.dumps(row), flush=True)
    # the op's results are varying over "data": shard_map refuses to read them as replicated
    try:
        jax.jit(jax.shard_map(lambda x, g: ops.rms_norm(x, g), mesh=MESH, in_specs=(D, P()), out_specs=P()))(
            randn(8, 32), randn(32))
        print(json.dumps({"op": "replication_check", "error": "out_specs P() of a varying result was accepted"}))
    except ValueError as e:
        print(json.dumps({"op": "replication_check", "max_err": 0.0, "message": str(e)[:200]}))


if __name__ == "__main__":
    main()
