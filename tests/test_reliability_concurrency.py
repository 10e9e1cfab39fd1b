"""Concurrency and leaks: the fused ops called from several Python threads at once give
the single-threaded results bitwise (a bounded stress test, compiling concurrently
too), and 10,000 jitted calls leave the process's resident memory flat.
"""

from __future__ import annotations

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rlx_jax
from rlx_jax import ops

F32 = jnp.float32
THREADS = 4
STRESS_SECONDS = 12.0      # wall-clock bound of the stress loop (after the first round)
LEAK_CALLS = 10_000
LEAK_TOLERANCE_MB = 8.0    # allowed RSS growth over the measured 10,000 calls (measured: 0.05)


def _arr(shape, seed, dtype=F32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _grad_of(fn, argnums):
    def loss(*a):
        y = fn(*a).astype(F32)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=F32)).reshape(y.shape))
    return lambda *a: (fn(*a), jax.grad(loss, argnums=argnums)(*a))


def _workloads():
    """name -> (fn, args): forward + gradients of one fused op on small inputs."""
    labels = jnp.asarray(np.arange(24) % 37, jnp.int32)
    idx = jnp.asarray(np.arange(50) % 13, jnp.int32)
    cs, sn = _arr((8, 8), 30), _arr((8, 8), 31)
    return {
        "rms_norm": (_grad_of(lambda x, g: ops.rms_norm(x, g), (0, 1)), (_arr((24, 64), 1), _arr((64,), 2))),
        "layer_norm": (_grad_of(lambda x, g, b: ops.layer_norm(x, g, b), (0, 1, 2)),
                       (_arr((24, 64), 3), _arr((64,), 4), _arr((64,), 5))),
        "group_norm": (_grad_of(lambda x, g, b: ops.group_norm(x, g, b, num_groups=2), (0, 1, 2)),
                       (_arr((3, 8, 5, 5), 6), _arr((8,), 7), _arr((8,), 8))),
        "softmax": (_grad_of(ops.softmax, 0), (_arr((24, 37), 9),)),
        "cross_entropy": (_grad_of(lambda l: ops.softmax_cross_entropy(l, labels), 0), (_arr((24, 37), 10),)),
        "attention": (_grad_of(lambda q, k, v: ops.attention(q, k, v, mask_kind="causal"), (0, 1, 2)),
                      tuple(_arr((2, 8, 2, 16), s) for s in (11, 12, 13))),
        "cumsum": (_grad_of(lambda x: ops.cumsum(x, axis=-1), 0), (_arr((24, 37), 14),)),
        "rope": (_grad_of(lambda x: ops.rope(x, cs, sn, head_dim=16), 0), (_arr((2, 8, 32), 15),)),
        "gather": (_grad_of(lambda t: ops.gather(t, idx), 0), (_arr((13, 16), 16),)),
        "max_pool2d": (_grad_of(lambda x: ops.max_pool2d(x, kernel_size=(2, 2), stride=(2, 2)), 0),
                       (_arr((2, 3, 8, 8), 17),)),
        "fake_quantize_lsq": (_grad_of(lambda x, s: ops.fake_quantize_lsq(x, s, bits=4, axis=1), (0, 1)),
                              (_arr((6, 4, 5), 18), jnp.full((4,), 0.2, F32))),
    }


def _bytes(tree):
    return [np.asarray(l).tobytes() for l in jax.tree_util.tree_leaves(tree)]


@pytest.fixture(scope="module")
def loaded():
    if not rlx_jax.kernel_info()["cpu"]["loaded"]:
        pytest.skip(f"compiled CPU kernels not loaded: {rlx_jax.kernel_info()['cpu']['error']}")


def test_threads_calling_ops_at_once_get_the_single_threaded_results(loaded):
    work = _workloads()
    expected = {n: _bytes(jax.jit(fn)(*args)) for n, (fn, args) in work.items()}
    names = sorted(work)
    errors, rounds = [], [0] * THREADS
    start = threading.Barrier(THREADS)
    deadline = [None]

    def worker(t):
        try:
            # each thread compiles its own jit of every workload (concurrent compilation)
            mine = {n: jax.jit(work[n][0]) for n in names}
            start.wait()
            i = 0
            while True:
                n = names[(i + 3 * t) % len(names)]
                got = _bytes(mine[n](*work[n][1]))
                if got != expected[n]:
                    errors.append(f"thread {t}, call {i}: {n} differs from the single-threaded result")
                    return
                i += 1
                if i % len(names) == 0:
                    rounds[t] += 1
                    if deadline[0] is None:
                        deadline[0] = time.monotonic() + STRESS_SECONDS
                    if time.monotonic() > deadline[0] or rounds[t] >= 20:
                        return
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"thread {t}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    assert not errors, errors
    assert min(rounds) >= 1, rounds


def test_threads_loading_and_lowering_graphs_at_once(loaded):
    """Graph.from_json + to_jax from several threads (the loader keeps per-thread state)."""
    from rlx_jax import Graph, to_jax

    def make(i):
        g = Graph(f"g{i}")
        x = g.input("x", [4, 8 + i], "f32")
        gam = g.param("gam", [8 + i], "f32")
        g.set_outputs([g.rms_norm(x, gam, gam, 1e-5)])
        return g.to_json()

    texts = [make(i) for i in range(THREADS)]
    errors = []

    def worker(i):
        try:
            for _ in range(10):
                g = Graph.from_json(texts[i])
                assert g.shape_of(0) == ([4, 8 + i], "f32")
                f = to_jax(g)
                x = jnp.ones((4, 8 + i), F32)
                (out,) = f({"gam": jnp.ones((8 + i,), F32)}, {"x": x})
                np.testing.assert_allclose(np.asarray(out), np.ones((4, 8 + i)) * 2, rtol=1e-4)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"thread {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm (Linux)")
def test_ten_thousand_calls_leave_memory_flat(loaded):
    """10,000 jitted calls (forward + backward kernels of four families, small shapes)
    after a warm-up: resident memory grows by less than LEAK_TOLERANCE_MB."""
    work = _workloads()
    picked = [jax.jit(work[n][0]) for n in ("rms_norm", "attention", "cross_entropy", "group_norm")]
    args = [work[n][1] for n in ("rms_norm", "attention", "cross_entropy", "group_norm")]

    def run(n):
        for i in range(n):
            k = i % len(picked)
            out = picked[k](*args[k])
        jax.block_until_ready(out)

    run(1000)  # warm-up: compilation, allocator pools, caches
    before = _rss_mb()
    samples = []
    for _ in range(10):
        run(LEAK_CALLS // 10)
        samples.append(_rss_mb())
    growth = samples[-1] - before
    assert growth < LEAK_TOLERANCE_MB, f"RSS grew {growth:.1f} MB over {LEAK_CALLS} calls: {samples}"
    # and it is not a steady climb: the second half grows less than the tolerance / 2
    assert samples[-1] - samples[4] < LEAK_TOLERANCE_MB / 2, samples
