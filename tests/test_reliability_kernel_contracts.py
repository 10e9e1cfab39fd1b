"""Kernel contracts: every registered CPU FFI target refuses malformed buffers with a
Python exception (never a crash), runs its valid call, and returns at once on
zero-sized inputs.

How: the public ops are lowered once (batch 2 and batch 0) with ``jax.ffi.ffi_call``
wrapped, which records each target's real operand / result shapes, dtypes and
attributes (so no signature is copied by hand). From each recorded call this file
derives malformed calls and runs them directly through ``jax.ffi.ffi_call``:

- rank: one operand loses its last axis;
- dims: every dim of one operand becomes ``2 d + 3`` (inconsistent with the others);
- dtype: one operand gets an integer dtype (a float one when it was an integer);
- result: the first result's dims or dtype disagree with the operands;
- attributes: per-target out-of-range values (num_groups not dividing the channels,
  head_dim not dividing the width, zero strides, unknown mask / STE codes, ...);
- index values: integer operands filled with out-of-range indices (must not write
  outside the buffers: clamped, skipped, or refused).

All of this runs in a worker subprocess (this file run as a script), one line per case
before and after, so a segfault is reported as the case that caused it and the worker
restarts after it instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------------------
# worker side (imports jax lazily: the pytest process only parses the output)
# ---------------------------------------------------------------------------

# per-target attribute mutations: (case name, attrs to override)
BAD_ATTRS = {
    "rlx_group_norm_fwd_v2": [("num_groups_not_dividing", {"num_groups": 3}), ("num_groups_zero", {"num_groups": 0}),
                           ("num_groups_negative", {"num_groups": -2})],
    "rlx_group_norm_bwd_v1": [("num_groups_not_dividing", {"num_groups": 3}), ("num_groups_zero", {"num_groups": 0})],
    "rlx_rope_fwd_v1": [("head_dim_not_dividing", {"head_dim": 5}), ("head_dim_zero", {"head_dim": 0}),
                     ("n_rot_odd", {"n_rot": 3}), ("n_rot_above_head_dim", {"n_rot": 64}),
                     ("n_rot_negative", {"n_rot": -2})],
    "rlx_rope_bwd_v1": [("head_dim_not_dividing", {"head_dim": 5}), ("n_rot_above_head_dim", {"n_rot": 64})],
    "rlx_rope_split_v1": [("head_dim_not_dividing", {"head_dim": 5}), ("n_rot_odd", {"n_rot": 3}),
                          ("rotate_mask_beyond_parts", {"rotate_mask": 4}), ("rotate_mask_negative", {"rotate_mask": -1})],
    "rlx_rope_merge_v1": [("head_dim_not_dividing", {"head_dim": 5}), ("n_rot_above_head_dim", {"n_rot": 64}),
                          ("rotate_mask_beyond_parts", {"rotate_mask": 4})],
    "rlx_max_pool2d_fwd_v1": [("kernel_zero", {"kh": 0}), ("stride_zero", {"sw": 0}), ("padding_negative", {"ph": -1}),
                           ("kernel_larger_than_input", {"kh": 99, "kw": 99})],
    "rlx_avg_pool2d_bwd_v1": [("kernel_zero", {"kw": 0}), ("stride_zero", {"sh": 0}), ("padding_negative", {"pw": -3})],
    "rlx_attention_fwd_v1": [("mask_kind_unknown", {"mask_kind": 7}), ("window_negative", {"mask_kind": 2, "window": -1}),
                          ("softcap_negative", {"softcap": -1.0}), ("scale_nan", {"scale": float("nan")})],
    "rlx_attention_bwd_v1": [("mask_kind_unknown", {"mask_kind": -1}), ("softcap_negative", {"softcap": -2.0})],
    "rlx_fake_quantize_bwd_v1": [("ste_unknown", {"ste": 99}), ("q_max_zero", {"q_max": 0.0}),
                              ("q_max_negative", {"q_max": -1.0})],
    "rlx_fake_quantize_lsq_bwd_v1": [("q_max_zero", {"q_max": 0.0})],
    "rlx_gaussian_splat_fwd_v1": [("tile_size_zero", {"tile_size": 0}), ("width_mismatch", {"width": 7}),
                               ("height_negative", {"height": -16})],
    "rlx_gaussian_splat_bwd_v1": [("tile_size_zero", {"tile_size": 0}), ("width_mismatch", {"width": 7})],
}


def _drivers():
    """name -> fn(n): lowers forward and gradient of one public op family with batch n."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rlx_jax import ops

    f32 = jnp.float32

    def sds(*shape, dtype=f32):
        return jax.ShapeDtypeStruct(shape, dtype)

    def lower(fn, *args, argnums=0):
        jax.jit(fn).lower(*args)
        loss = lambda *a: jnp.sum(fn(*a).astype(f32))
        jax.jit(jax.grad(loss, argnums=argnums)).lower(*args)

    def norms(n):
        lower(lambda x, g, b: ops.rms_norm(x, g, b), sds(n, 3, 8), sds(8), sds(8), argnums=(0, 1, 2))
        lower(lambda x, r, g: sum(ops.add_rms_norm(x, r, g)), sds(n, 3, 8), sds(n, 3, 8), sds(8),
              argnums=(0, 1, 2))
        lower(lambda x, g, b: ops.layer_norm(x, g, b), sds(n, 3, 8), sds(8), sds(8), argnums=(0, 1, 2))
        lower(lambda x, g, b: ops.group_norm(x, g, b, num_groups=2), sds(n, 4, 3, 5), sds(4), sds(4),
              argnums=(0, 1, 2))
        lower(lambda x, g, b, m, v: ops.batch_norm_inference(x, g, b, m, v), sds(n, 4, 3), sds(4), sds(4), sds(4),
              sds(4), argnums=(0, 1))

    def rowwise(n):
        lower(lambda x: ops.softmax(x), sds(n, 5, 7))
        lower(lambda y, d: ops.softmax_backward(y, d), sds(n, 5, 7), sds(n, 5, 7), argnums=(0, 1))
        lower(lambda x, y: ops.softmax_cross_entropy(x, y), sds(n, 11), sds(n, dtype=jnp.int32))
        lower(lambda h, w, y: ops.fused_linear_cross_entropy(h, w, y, reduction="mean"), sds(n, 8), sds(8, 11),
              sds(n, dtype=jnp.int32), argnums=(0, 1))
        lower(lambda x: ops.cumsum(x, axis=-1), sds(n, 5, 6))
        cs = sds(5, 4)
        lower(lambda x, c, s: ops.rope(x, c, s, head_dim=8), sds(n, 5, 16), cs, cs)
        lower(lambda x, c, s: jnp.concatenate(ops.rope_split(x, c, s, (1, 1), rotate=(True, False), head_dim=8), -1),
              sds(n, 5, 16), cs, cs)

    def elementwise(n):
        lower(lambda a, b: ops.swiglu(a, b), sds(n, 3, 8), sds(n, 3, 8), argnums=(0, 1))
        lower(lambda a, b, w: ops.swiglu_linear(a, b, w), sds(n, 3, 8), sds(n, 3, 8), sds(8, 5),
              argnums=(0, 1, 2))

    def indexing(n):
        lower(lambda t, i: ops.gather(t, i), sds(7, 3), sds(n, dtype=jnp.int32))
        lower(lambda x: ops.max_pool2d(x, kernel_size=(2, 2), stride=(2, 2)), sds(n, 3, 6, 6))
        lower(lambda x: ops.avg_pool2d(x, kernel_size=(2, 2), stride=(2, 2)), sds(n, 3, 6, 6))

    def quant(n):
        lower(lambda x: ops.fake_quantize(x, bits=8, scale=0.05, ste="clipped_identity"), sds(n, 4, 6))
        lower(lambda x, s: ops.fake_quantize_lsq(x, s, bits=4, axis=1), sds(n, 4, 6), sds(4), argnums=(0, 1))

    def attention(n):
        q = sds(n, 4, 2, 8)
        lower(lambda q, k, v: ops.attention(q, k, v, mask_kind="causal"), q, q, q, argnums=(0, 1, 2))
        ids = sds(n, 4, dtype=jnp.int32)
        lower(lambda q, k, v, i: ops.attention(q, k, v, mask_kind="causal", q_segment_ids=i, kv_segment_ids=i),
              q, q, q, ids, argnums=(0, 1, 2))

    def splat(n):
        meta = ops.gaussian_splat_render_meta([0.3, -0.2, -4], [0, 0, 0], [0, 1, 0], 45.0, 0.1, 100.0,
                                              [0.1, 0.2, 0.3], width=16, height=8, tile_size=8)
        fn = lambda *a: ops.gaussian_splat_render(*a, meta, width=16, height=8, tile_size=8)
        args = (sds(n, 3), sds(n, 3), sds(n, 4), sds(n), sds(n, 3), sds(n, 4, 3))
        lower(fn, *args, argnums=(0, 1, 2, 3, 4, 5))

    return dict(norms=norms, rowwise=rowwise, elementwise=elementwise, indexing=indexing, quant=quant,
                attention=attention, splat=splat)


def _record():
    """{"valid": {target: call}, "zero": {target: call}}; call = (operand avals, result avals, attrs)."""
    import jax

    import numpy as np
    orig = jax.ffi.ffi_call
    seen = {"valid": {}, "zero": {}}
    phase = ["valid"]

    def recording(target, result_shape_dtypes, *a, **k):
        inner = orig(target, result_shape_dtypes, *a, **k)

        def call(*args, **attrs):
            res = result_shape_dtypes if isinstance(result_shape_dtypes, (tuple, list)) else (result_shape_dtypes,)
            seen[phase[0]].setdefault(target, (
                [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args],
                [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in res],
                dict(attrs),
            ))
            return inner(*args, **attrs)

        return call

    jax.ffi.ffi_call = recording
    try:
        for n, ph in ((2, "valid"), (0, "zero")):
            phase[0] = ph
            for drive in _drivers().values():
                drive(n)
    finally:
        jax.ffi.ffi_call = orig
    # superseded ABI versions (registered for serialized functions) take the current call
    # with its f64 attributes as f32: version 2 of the norms made eps f64
    for calls in seen.values():
        for t, (ops_, res, attrs) in list(calls.items()):
            base, version = t.rsplit("_v", 1)
            old_attrs = {k: np.float32(v) if isinstance(v, np.float64) else v for k, v in attrs.items()}
            for old in range(1, int(version)):
                calls.setdefault(f"{base}_v{old}", (ops_, res, old_attrs))
    return seen


def _cases(targets, seen, full):
    """Deterministic list of (case id, target, operands, results, attrs, expect).

    The default set puts every kind of fault on operand 0, wrong dims on the last
    operand, wrong dtypes and out-of-range values on integer operands, a smaller buffer on
    every result; ``full`` (``-m slow``) puts every fault on every operand and result."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    out = []
    for t in targets:
        if t not in seen["valid"]:
            out.append((f"{t}:unrecorded", t, None, None, None, "unrecorded"))
            continue
        ops_, res, attrs = seen["valid"][t]
        out.append((f"{t}:valid", t, ops_, res, attrs, "ok"))
        if t in seen["zero"]:
            z_ops, z_res, z_attrs = seen["zero"][t]
            out.append((f"{t}:zero_sized", t, z_ops, z_res, z_attrs, "ok"))
        last = max(i for i, o in enumerate(ops_) if o.size)
        for i, o in enumerate(ops_):
            if o.size == 0:  # a dummy operand (absent mask / bias)
                continue
            integer = jnp.issubdtype(o.dtype, jnp.integer)
            # default set: every kind of fault on operand 0, dims on the last operand,
            # dtype and index values on integer operands; full: everything everywhere
            kinds = {"rank", "dims", "dtype"} if full or i == 0 else set()
            if i == last:
                kinds.add("dims")
            if integer:
                kinds.add("dtype")
            if o.ndim >= 1 and "rank" in kinds:
                bad = list(ops_)
                bad[i] = jax.ShapeDtypeStruct(o.shape[:-1], o.dtype)
                out.append((f"{t}:operand{i}_rank", t, bad, res, attrs, "error"))
            if o.ndim >= 1 and "dims" in kinds:
                bad = list(ops_)
                bad[i] = jax.ShapeDtypeStruct(tuple(2 * d + 3 for d in o.shape), o.dtype)
                out.append((f"{t}:operand{i}_dims", t, bad, res, attrs, "error"))
            if "dtype" in kinds:
                bad = list(ops_)
                bad[i] = jax.ShapeDtypeStruct(o.shape, jnp.float32 if integer else jnp.int32)
                out.append((f"{t}:operand{i}_dtype", t, bad, res, attrs, "error"))
            if integer:
                out.append((f"{t}:operand{i}_index_values", t, ops_, res, attrs, "no_crash:" + str(i)))
        for i, r in enumerate(res):
            if r.size == 0 or r.ndim == 0:
                continue
            # a smaller result (rank) is the dangerous direction: every result gets it
            for kind, shape in (("rank", r.shape[:-1]), ("dims", tuple(2 * d + 3 for d in r.shape))):
                if kind == "dims" and i > 0 and not full:
                    continue
                bad = list(res)
                bad[i] = jax.ShapeDtypeStruct(shape, r.dtype)
                out.append((f"{t}:result{i}_{kind}", t, ops_, bad, attrs, "error"))
        r0 = res[0]
        integer = jnp.issubdtype(r0.dtype, jnp.integer)
        bad = [jax.ShapeDtypeStruct(r0.shape, jnp.float32 if integer else jnp.int32)] + list(res[1:])
        out.append((f"{t}:result0_dtype", t, ops_, bad, attrs, "error"))
        for name, over in BAD_ATTRS.get(t, []):
            a = dict(attrs)
            for k, v in over.items():
                a[k] = type(attrs[k])(v)
            out.append((f"{t}:attr_{name}", t, ops_, res, a, "error"))
    return out


def _operands(avals, index_fill=None, seed=0):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    arrs = []
    for j, a in enumerate(avals):
        if jnp.issubdtype(a.dtype, jnp.integer):
            v = np.zeros(a.shape, a.dtype)
            if index_fill is not None and j == index_fill:
                v = np.resize(np.array([2**31 - 1, -(2**31), -1, 10**6], np.int64), a.shape).astype(a.dtype)
            arrs.append(jnp.asarray(v))
        else:
            arrs.append(jnp.asarray(rng.uniform(0.1, 1.0, a.shape), a.dtype))
    return arrs


def _worker(start: int, full: bool) -> None:
    import jax

    import rlx_jax
    from rlx_jax.vjp_rules import attention

    # attention lowers to XLA's code on the CPU at small sizes: the drivers need the kernel
    attention.CPU_KERNEL_MIN_SCORE_BYTES = 0
    attention.CPU_SEGMENT_KERNEL_MIN_SCORE_BYTES = 0
    targets = sorted(rlx_jax.kernel_info()["cpu"]["targets"])
    cases = _cases(targets, _record(), full)
    print(json.dumps({"total": len(cases), "targets": targets}), flush=True)
    for idx in range(start, len(cases)):
        cid, t, ops_, res, attrs, expect = cases[idx]
        print(json.dumps({"start": idx, "case": cid}), flush=True)
        if expect == "unrecorded":
            print(json.dumps({"done": idx, "case": cid, "outcome": "unrecorded", "msg": ""}), flush=True)
            continue
        fill = int(expect.split(":")[1]) if expect.startswith("no_crash") else None
        args = _operands(ops_, fill)
        t0 = time.perf_counter()
        try:
            outs = jax.ffi.ffi_call(t, tuple(res))(*args, **attrs)
            jax.block_until_ready(outs)
            outcome, msg = "ok", ""
            shapes_ok = [tuple(o.shape) for o in outs] == [tuple(r.shape) for r in res]
            if not shapes_ok:
                outcome, msg = "wrong_shapes", str([o.shape for o in outs])
        except Exception as exc:  # noqa: BLE001 - any Python exception is the contract
            outcome, msg = "error", f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps({"done": idx, "case": cid, "outcome": outcome, "msg": msg,
                          "seconds": time.perf_counter() - t0}), flush=True)


# ---------------------------------------------------------------------------
# pytest side
# ---------------------------------------------------------------------------

def _run_all(full=False):
    """Runs the worker (restarting past a crashing case); case id -> result dict."""
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    results, start, total, targets, crashes = {}, 0, None, None, []
    while True:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker-full" if full else "--worker", str(start)],
                              capture_output=True, text=True, env=env, timeout=600)
        last_start = None
        for line in proc.stdout.splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if "total" in d:
                total, targets = d["total"], d["targets"]
            elif "start" in d:
                last_start = d
            elif "done" in d:
                results[d["case"]] = d
                last_start = None
        if proc.returncode == 0 or total is None:
            if total is None:
                raise RuntimeError(f"kernel contract worker failed to start:\n{proc.stderr[-3000:]}")
            break
        if last_start is None:
            raise RuntimeError(f"kernel contract worker died outside a case (rc {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        results[last_start["case"]] = {"case": last_start["case"], "outcome": "crash",
                                       "msg": f"process died with rc {proc.returncode}: {proc.stderr[-500:]}"}
        crashes.append(last_start["case"])
        start = last_start["start"] + 1
        if start >= total:
            break
    return results, targets, crashes


def _report(request, label, out):
    results, targets, crashes = out
    outcomes = {}
    for r in results.values():
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    line = (f"kernel contracts ({label}): {len(results)} calls over {len(targets)} CPU targets: "
            + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) + f"; crashes {len(crashes)}")
    rep = request.config.pluginmanager.get_plugin("terminalreporter")
    if rep is not None:
        rep.write_line(line)


@pytest.fixture(scope="module")
def contract_results(request):
    import rlx_jax

    if not rlx_jax.kernel_info()["cpu"]["loaded"]:
        pytest.skip(f"compiled CPU kernels not loaded: {rlx_jax.kernel_info()['cpu']['error']}")
    out = _run_all()
    _report(request, "default", out)
    return out


def _accepted(results):
    """Malformed cases that did not raise."""
    out = []
    for cid, r in sorted(results.items()):
        kind = cid.split(":", 1)[1]
        if kind in ("valid", "zero_sized", "unrecorded") or kind.endswith("index_values"):
            continue
        if r["outcome"] != "error":
            out.append(f"{cid} -> {r['outcome']} {r['msg']}")
    return out


def test_every_target_is_exercised(contract_results):
    results, targets, _ = contract_results
    assert len(targets) >= 20
    unrecorded = sorted(c.split(":")[0] for c, r in results.items() if r["outcome"] == "unrecorded")
    assert not unrecorded, f"no driver reaches these CPU targets (add one to _drivers): {unrecorded}"
    for t in targets:
        assert results[f"{t}:valid"]["outcome"] == "ok", results[f"{t}:valid"]


def test_no_malformed_call_crashes(contract_results):
    _, _, crashes = contract_results
    assert not crashes, f"these malformed calls crashed the process: {crashes}"


def test_malformed_calls_raise(contract_results):
    results, _, _ = contract_results
    n_bad = sum(1 for c in results if not c.endswith((":valid", ":zero_sized")))
    assert n_bad > 100
    accepted = _accepted(results)
    assert not accepted, "malformed calls accepted:\n" + "\n".join(accepted)


def test_handler_errors_name_the_fault(contract_results):
    """Errors come back as Python exceptions carrying the handler's message."""
    results, _, _ = contract_results
    errs = [r for c, r in results.items() if r["outcome"] == "error"]
    assert errs and all(r["msg"] for r in errs)
    attr = [r for c, r in results.items() if ":attr_" in c]
    assert attr and all("INVALID_ARGUMENT" in r["msg"] or "invalid" in r["msg"].lower() for r in attr), attr


def test_out_of_range_index_values_do_not_crash(contract_results):
    results, _, _ = contract_results
    idx = {c: r for c, r in results.items() if c.endswith("index_values")}
    assert len(idx) >= 3  # labels, gather indices, argmax
    assert all(r["outcome"] in ("ok", "error") for r in idx.values()), idx


def test_zero_sized_inputs_return_at_once(contract_results):
    results, targets, _ = contract_results
    zero = {c: r for c, r in results.items() if c.endswith(":zero_sized")}
    assert len(zero) >= len(targets) // 2, sorted(zero)
    for c, r in zero.items():
        assert r["outcome"] == "ok", r
        assert r["seconds"] < 2.0, r  # includes the compile of one custom call


@pytest.mark.slow
def test_full_matrix_every_operand_and_result(request):
    """Every operand and every result mutated (about twice the default cases)."""
    import rlx_jax

    if not rlx_jax.kernel_info()["cpu"]["loaded"]:
        pytest.skip("compiled CPU kernels not loaded")
    out = _run_all(full=True)
    _report(request, "full", out)
    results, targets, crashes = out
    assert not crashes, crashes
    accepted = _accepted(results)
    assert not accepted, "malformed calls accepted:\n" + "\n".join(accepted)
    assert all(results[f"{t}:valid"]["outcome"] == "ok" for t in targets)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), full=False)
    elif len(sys.argv) == 3 and sys.argv[1] == "--worker-full":
        _worker(int(sys.argv[2]), full=True)
