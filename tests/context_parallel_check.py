"""Run in a subprocess with 8 host CPU devices (tests/test_context_parallel.py): context-
parallel (ring) attention against single-device attention, values and gradients. Prints
one JSON line per case. ``python context_parallel_check.py long`` runs the S = 32768 case."""

from __future__ import annotations

import json
import os
import re
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from rlx_jax import ops  # noqa: E402
from rlx_jax.parallel import count_collectives, context_parallel_attention, zigzag_permutation  # noqa: E402
from rlx_jax.vjp_rules.attention import reference_attention  # noqa: E402
from rlx_jax.vjp_rules import attention as _attention  # noqa: E402

# attention lowers to XLA's code on the CPU at small sizes; these checks are about the kernels
_attention.CPU_KERNEL_MIN_SCORE_BYTES = 0

MESH8 = Mesh(np.array(jax.devices()), ("cp",))




def inputs(b, s, h, hkv, d, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    return f(b, s, h, d), f(b, s, hkv, d), f(b, s, hkv, d), f(b, s, h, d)


def plain_reference(q, k, v, *, mask_kind, window, scale, softcap):
    """Pure-JAX attention (the independent oracle), O(S^2) memory."""
    d = q.shape[-1]
    params = dict(kind=mask_kind, window=window or 0, scale=scale if scale is not None else d ** -0.5,
                  softcap=softcap or 0.0, has_mask=False, has_bias=False)
    return reference_attention(q, k, v, **params)[0]


def value_and_grads(attn, q, k, v, w):
    loss = lambda q, k, v: jnp.sum(jnp.sin(attn(q, k, v)) * w)
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)


def max_rel_err(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) / max(float(jnp.max(jnp.abs(y))), 1.0)
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def case_against_reference(name, shape, opts, mesh=MESH8):
    q, k, v, w = inputs(*shape)
    cp = lambda q, k, v: context_parallel_attention(q, k, v, mesh=mesh, axis_name="cp", **opts)
    got = value_and_grads(cp, q, k, v, w)
    want = value_and_grads(lambda q, k, v: plain_reference(q, k, v, **opts), q, k, v, w)
    again = value_and_grads(cp, q, k, v, w)
    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(again)))
    return {"case": name, "max_err": max_rel_err(got, want), "deterministic": same}


def case_one_device():
    """A 1-device mesh runs exactly the plain kernel: bitwise equal values and gradients."""
    q, k, v, w = inputs(2, 24, 4, 2, 8, seed=1)
    mesh1 = Mesh(np.array(jax.devices()[:1]), ("cp",))
    opts = dict(mask_kind="sliding", window=7, softcap=3.0)
    got = value_and_grads(lambda q, k, v: context_parallel_attention(q, k, v, mesh=mesh1, axis_name="cp", **opts),
                          q, k, v, w)
    want = value_and_grads(lambda q, k, v: ops.attention(q, k, v, **opts), q, k, v, w)
    equal = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    return {"case": "one_device", "max_err": max_rel_err(got, want), "bitwise": equal}


def case_sharded_zigzag():
    """Mesh data 2 x cp 4, batch split over data, sequence kept in zig-zag order by the caller:
    the compiled step rotates K / V by collective-permute and gathers nothing."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "cp"))
    b, s, h, hkv, d = 4, 32, 4, 2, 8
    q, k, v, w = inputs(b, s, h, hkv, d, seed=2)
    opts = dict(mask_kind="causal", scale=0.4)
    perm = zigzag_permutation(s, 4)
    zz = lambda x: x[:, perm]
    spec = NamedSharding(mesh, P("data", "cp"))
    placed = [jax.device_put(zz(x), spec) for x in (q, k, v, w)]
    cp = lambda q, k, v: context_parallel_attention(q, k, v, mesh=mesh, axis_name="cp", batch_axis="data",
                                                    zigzag=True, **opts)
    loss = lambda q, k, v, w: jnp.sum(jnp.sin(cp(q, k, v)) * w)
    fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    got_v, got_g = fn(*placed)
    want_v, want_g = value_and_grads(lambda q, k, v: plain_reference(q, k, v, window=None, softcap=None, **opts),
                                     q, k, v, w)
    got_g = [g[:, np.argsort(perm)] for g in got_g]
    hlo = fn.lower(*placed).compile().as_text()
    return {"case": "sharded_zigzag", "max_err": max_rel_err((got_v, got_g), (want_v, want_g)),
            "collectives": count_collectives(hlo),
            "kernels": sorted(set(re.findall(r'custom_call_target="(rlx_[a-z0-9_]+)"', hlo)))}


def case_errors():
    q, k, v, _ = inputs(1, 24, 2, 2, 4)
    msgs = []
    for kw in (dict(axis_name="cp"), dict(axis_name="seq")):
        try:
            context_parallel_attention(q, k, v, mesh=MESH8, **kw)
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return {"case": "errors", "messages": msgs}


def case_long():
    """S = 32768 on 8 devices (chunks of 2048), causal, small heads, against the single-device
    fused kernel (the O(S^2) pure-JAX oracle would need 8 GiB of scores)."""
    b, s, h, hkv, d = 1, 32768, 2, 1, 16
    q, k, v, w = inputs(b, s, h, hkv, d, seed=3)
    opts = dict(mask_kind="causal", softcap=20.0)
    t0 = time.perf_counter()
    got = value_and_grads(lambda q, k, v: context_parallel_attention(q, k, v, mesh=MESH8, axis_name="cp", **opts),
                          q, k, v, w)
    t1 = time.perf_counter()
    want = value_and_grads(lambda q, k, v: ops.attention(q, k, v, **opts), q, k, v, w)
    t2 = time.perf_counter()
    return {"case": "long", "max_err": max_rel_err(got, want), "cp_s": t1 - t0, "single_s": t2 - t1}


SMALL = {
    "none_gqa": ((2, 48, 4, 2, 8), dict(mask_kind="none", window=None, scale=None, softcap=None)),
    "causal_softcap_gqa": ((2, 32, 4, 1, 8), dict(mask_kind="causal", window=None, scale=0.3, softcap=4.0)),
    # chunks of 4 positions, window 5: blocks one chunk apart are partially visible (bias path)
    "sliding_partial": ((1, 64, 2, 2, 8), dict(mask_kind="sliding", window=5, scale=None, softcap=2.0)),
    "sliding_wide_gqa": ((1, 32, 4, 2, 16), dict(mask_kind="sliding", window=13, scale=0.5, softcap=None)),
}


if __name__ == "__main__":
    jax.config.update("jax_default_matmul_precision", "highest")
    which = sys.argv[1:] or ["small"]
    runs = []
    if "small" in which:
        runs = [lambda n=n, c=c: case_against_reference(n, *c) for n, c in SMALL.items()]
        runs += [case_one_device, case_sharded_zigzag, case_errors]
    if "long" in which:
        runs.append(case_long)
    for run in runs:
        try:
            row = run()
        except Exception as e:  # reported, and failed, by the test
            row = {"case": getattr(run, "__name__", "?"), "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(row), flush=True)
