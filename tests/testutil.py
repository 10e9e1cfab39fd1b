"""Shared test helpers: the platform under test, tolerances per dtype, closeness, loading a
repository script by its path."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np


def platform() -> str:
    """'cpu' or 'cuda': the platform the tests' default device runs on."""
    p = jax.devices()[0].platform
    return "cuda" if p == "gpu" else p


def tolerance(dtype) -> float:
    return {jnp.bfloat16: 3e-2, jnp.float16: 5e-3, jnp.float32: 2e-5, jnp.float64: 1e-12}[jnp.dtype(dtype).type]


def assert_close(got, want, dtype=None, scale_by_max=True):
    """Max abs error, relative to max |want| (1 if want is zero), within the dtype's tolerance."""
    got = np.asarray(jnp.asarray(got, jnp.float64) if jax.config.jax_enable_x64 else jnp.asarray(got, jnp.float32))
    want = np.asarray(jnp.asarray(want, got.dtype))
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.size == 0:
        return
    tol = tolerance(dtype or got.dtype)
    scale = max(float(np.max(np.abs(want))), 1.0) if scale_by_max else 1.0
    err = float(np.max(np.abs(got - want)))
    assert np.isfinite(got).all() == np.isfinite(want).all()
    assert err <= tol * scale, f"max abs err {err:.3g} > {tol:.1g} * {scale:.3g}"


def current_targets(names) -> set:
    """The FFI target names among ``names`` at the ABI version the lowerings emit. A
    superseded version stays registered for serialized functions; it runs the same
    handler body with an older attribute type (tests/test_norm_eps.py calls it)."""
    from rlx_jax._kernels import target

    return {t for t in names if target(t.rsplit("_v", 1)[0]) == t}


def hlo_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def numpy_cumsum(x, axis, exclusive=False, reverse=False):
    """f64 NumPy oracle of cumsum along `axis` (exclusive: the sum before each element;
    reverse: scan from the end), for any float input (bf16 / f16 / f32 / f64)."""
    x = np.asarray(x).astype(np.float64)
    if reverse:
        x = np.flip(x, axis)
    y = np.cumsum(x, axis=axis)
    if exclusive:
        y = y - x
    return np.flip(y, axis) if reverse else y


def assert_same_bits_on_one_core_without_avx512(digest_fn):
    """digest_fn (a module-level function of a test module returning a digest string of
    kernel outputs) gives the same digest in a fresh process pinned to one core (XLA's
    intra-op pool then has one thread) and forced onto the AVX2 / baseline row clones
    (RLX_JAX_CPU_NO_AVX512=1) as in this process (several threads; the AVX-512 body where
    the CPU has it)."""
    import os
    import subprocess
    import sys

    here = digest_fn()
    # the test module by its file name: pytest's importlib mode may name it "tests.test_x"
    module = digest_fn.__module__.rsplit(".", 1)[-1]
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, RLX_JAX_CPU_NO_AVX512="1", JAX_PLATFORMS="cpu")
    one_core = {min(os.sched_getaffinity(0))}
    # pinned before jax starts, so XLA sizes its intra-op pool to one thread
    code = (f"import os, sys; os.sched_setaffinity(0, {one_core!r}); sys.path.insert(0, {tests_dir!r}); "
            f"import {module} as t; print('DIGEST' + t.{digest_fn.__name__}())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          cwd=tests_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    there = [line for line in proc.stdout.splitlines() if line.startswith("DIGEST")][-1][len("DIGEST"):]
    assert there == here


def load_script(path: pathlib.Path, name: str):
    """The module at ``path`` (a file of the repository outside the installed package: benchmarks/,
    notebooks/), imported as ``name`` and registered in sys.modules (dataclasses look their module
    up there). The repository root stays off sys.path, so it cannot shadow the installed rlx_jax."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def numpy_swiglu(a, b, dh=None):
    """NumPy float64 oracle of SwiGLU, for the CPU and GPU tests (any input dtype, device
    arrays too): h = a s b, or with dh (h, da, db), da = dh b s (1 + a (1 - s)), db = dh a s."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    s = 1.0 / (1.0 + np.exp(-a))
    h = a * s * b
    if dh is None:
        return h
    dh = np.asarray(dh, np.float64)
    return h, dh * b * s * (1.0 + a * (1.0 - s)), dh * a * s


def as_f64(a):
    """An array as float64 NumPy (16-bit dtypes through f32, which NumPy lacks; f64 as is)."""
    a = jnp.asarray(a)
    return np.asarray(a if a.dtype == jnp.float64 else a.astype(jnp.float32), np.float64)


def check_relative_close(got, want, dtype, rtol, what=""):
    """A result that sums over an axis (a matmul's output or a weight gradient) against its
    f64 oracle: got in ``dtype`` with want's shape and a relative Frobenius error
    ||got - want|| / ||want|| <= rtol (elementwise bounds do not fit values that cancel)."""
    assert got.dtype == dtype, (what, got.dtype, dtype)
    got, want = as_f64(got), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if want.size == 0:
        return
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err <= rtol, (what, err)


def check_swiglu_close(got, want, dtype, rtol, what="", finite=False):
    """SwiGLU results against the f64 oracle: got in ``dtype`` with want's shape, and
    elementwise |got - want| <= rtol (|want| + max |want|) (the error of the inputs' rounding
    is relative to the row's scale, not each value). ``finite``: got holds no NaN or inf
    either (an unwritten output shows as one). Shared by the CPU and GPU SwiGLU tests."""
    assert got.dtype == dtype, (what, got.dtype, dtype)
    got, want = as_f64(got), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if want.size == 0:
        return
    bound = rtol * (np.abs(want) + np.max(np.abs(want)))
    err = np.abs(got - want)
    if finite:
        assert np.isfinite(got).all(), f"{what}: non-finite values (unwritten output?)"
    assert (err <= bound).all(), f"{what}: max err {err.max():.3g}, worst excess {(err - bound).max():.3g}"


def check_swiglu_bwd_over_every_bit_pattern(dtype, put):
    """swiglu_backward at gate = 30 (s = 1, a s (1 - s) below half an ulp of 1 in f32), so
    da = dh * up and db = 30 dh are exact f32 products rounded once to the 16-bit ``dtype``:
    over all 2^16 bit patterns of dh (and 7 more: a tail block), the kernel's result must be
    NumPy's round to nearest even of the same products, bit for bit (NaN as NaN; bf16
    subnormals, which a kernel may flush, left out). ``put`` places an array on the device
    under test. Shared by the CPU and GPU SwiGLU tests."""
    from rlx_jax.ops import swiglu_backward
    np_dtype = np.dtype(dtype)
    up = np_dtype.type(1.0 + float(jnp.finfo(dtype).eps))
    bits = np.concatenate([np.arange(65536), np.arange(7)]).astype(np.uint16)
    dh = bits.view(np_dtype)
    a, b = np.full(dh.shape, 30.0, np_dtype), np.full(dh.shape, up, np_dtype)
    da, db = jax.jit(swiglu_backward)(put(a), put(b), put(dh))
    f32 = dh.astype(np.float32)
    keep = ~((f32 != 0) & (np.abs(f32) < np.finfo(np.float32).tiny))
    with np.errstate(all="ignore"):  # inf * 0 -> NaN, overflow to inf: both expected
        wants = (f32 * np.float32(up)).astype(np_dtype), (f32 * np.float32(30.0)).astype(np_dtype)
    for got, want, name in zip((da, db), wants, ("da", "db")):
        got, want = np.asarray(got)[keep], want[keep]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=name)
        fin = ~np.isnan(want)
        np.testing.assert_array_equal(got[fin].view(np.uint16), want[fin].view(np.uint16), err_msg=name)



def host_device_rows(script, *args, devices=8, key="op", timeout=900, platform=None):
    """Runs the check ``script`` (a path) with ``args`` in a fresh interpreter on ``devices``
    forced host CPU devices (the device count is fixed when JAX starts, so a subprocess)
    and returns its JSON lines (the stdout lines starting with "{") keyed by ``key``;
    ``platform`` sets JAX_PLATFORMS there."""
    import json
    import os
    import subprocess

    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    if platform is not None:
        env["JAX_PLATFORMS"] = platform
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, f"{pathlib.Path(script).name} printed nothing:\n{proc.stderr[-3000:]}"
    return {r[key]: r for r in rows}
