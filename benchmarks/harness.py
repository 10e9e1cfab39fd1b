"""What every benchmark case shares: the Case record, timing, and the copy floor.

A case times three jitted functions on the same inputs in one run:
- ``ours``: the rlx_jax op (its fused kernel where one is compiled);
- ``xla``: XLA's autodiff of the op's pure-JAX reference (what JAX users get today);
- the floor: a copy of the fewest bytes the op must move (each input read once, each
  output written once), i.e. an elementwise pass reading and writing ``floor_bytes / 2``.
Ratios from one run are what we report; absolute times on shared machines mean little.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class Case:
    """One benchmark: ``make(key) -> args``; ``ours(*args)`` and ``xla(*args)`` compute
    the same thing; ``floor_bytes``: the op's minimal memory traffic in bytes."""

    name: str
    make: Callable
    ours: Callable
    xla: Callable
    floor_bytes: int
    extra: dict = dataclasses.field(default_factory=dict)


def time_fn(fn: Callable, args: tuple, reps: int, warmup: int = 3, batch: int = 1,
            host_ms: list | None = None) -> float:
    """Median time in ms of one ``fn(*args)``: ``reps`` samples after ``warmup``; each
    sample dispatches ``batch`` calls back to back, waits for the last (one device stream:
    the last done means all done) and divides by ``batch``. ``batch > 1`` measures the
    throughput a training loop sees, without the host's wait-and-relaunch gap between
    calls (on a GPU about 0.1-0.2 ms a call, the size of a 0.8 GB kernel). ``host_ms``,
    if given, receives each sample's time per call spent dispatching (before the wait):
    when it is close to the result, the host, not the device, set the pace."""
    if batch < 1:
        raise ValueError(f"time_fn: batch must be >= 1, got {batch}")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(batch):
            out = fn(*args)  # earlier results are released as soon as they are replaced
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3 / batch)
        if host_ms is not None:
            host_ms.append((t1 - t0) * 1e3 / batch)
    return statistics.median(times)


def default_batch(device) -> int:
    """Calls per timing sample: 10 on a GPU (asynchronous dispatch hides the host there),
    1 on the CPU (the call runs on the host's own threads: nothing to hide)."""
    return 10 if device.platform in ("gpu", "cuda", "rocm") else 1


def copy_floor_fn(floor_bytes: int, device) -> tuple[Callable, tuple]:
    """A jitted elementwise pass that reads floor_bytes/2 and writes floor_bytes/2."""
    n = max(1, floor_bytes // 2 // 4)
    buf = jax.device_put(jnp.arange(n, dtype=jnp.float32), device)
    return jax.jit(lambda a: a + 1.0), (buf,)


def run_case(case: Case, device, reps: int, batch: int | None = None) -> dict:
    """Times ours, XLA and the copy floor alike (``batch`` calls a sample, see
    ``time_fn``; None: ``default_batch(device)``) after checking that ours and XLA agree."""
    batch = default_batch(device) if batch is None else batch
    key = jax.random.PRNGKey(0)
    with jax.default_device(device):
        args = jax.device_put(case.make(key), device)
        ours = jax.jit(case.ours)
        xla = jax.jit(case.xla)
        # same results first: a benchmark of a wrong kernel is worthless
        got, want = ours(*args), xla(*args)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            scale = float(jnp.max(jnp.abs(w.astype(jnp.float32)))) or 1.0
            err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))) / scale
            tol = 2e-2 if g.dtype in (jnp.bfloat16, jnp.float16) else 1e-3
            if not err <= tol:
                raise AssertionError(f"{case.name}: ours and XLA differ (max rel err {err:.3g})")
        floor_fn, floor_args = copy_floor_fn(case.floor_bytes, device)
        # interleave the three so drift on a shared machine hits all of them alike
        t_ours, t_xla, t_floor, host_ours = [], [], [], []
        rounds = 3
        for _ in range(rounds):
            t_ours.append(time_fn(ours, args, reps, batch=batch, host_ms=host_ours))
            t_xla.append(time_fn(xla, args, reps, batch=batch))
            t_floor.append(time_fn(floor_fn, floor_args, reps, batch=batch))
    ours_ms, xla_ms, floor_ms = (statistics.median(t) for t in (t_ours, t_xla, t_floor))
    return {
        "case": case.name,
        "device": str(device),
        "ours_ms": ours_ms,
        "xla_ms": xla_ms,
        "floor_ms": floor_ms,
        "xla_over_ours": xla_ms / ours_ms,
        "ours_over_floor": ours_ms / floor_ms,
        "ours_GBps": case.floor_bytes / ours_ms / 1e6,
        "floor_GBps": case.floor_bytes / floor_ms / 1e6,
        "batch": batch,
        "ours_host_ms": statistics.median(host_ours),  # dispatch time a call (see time_fn)
        **case.extra,
    }
