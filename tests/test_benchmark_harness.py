"""The benchmark harness's timing and checking (benchmarks/harness.py), on the CPU."""

import pathlib

import jax.numpy as jnp
import pytest
from testutil import load_script

# loaded from its file: benchmarks/ is not an installed package, and putting the repository
# root on sys.path would let it shadow the installed rlx_jax (which carries the kernels)
_harness = load_script(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "harness.py",
                       "rlx_benchmarks_harness")
Case, default_batch, run_case, time_fn = _harness.Case, _harness.default_batch, _harness.run_case, _harness.time_fn


def test_time_fn_dispatches_batch_calls_per_sample():
    calls = []

    def fn(x):
        calls.append(1)
        return x + 1

    host = []
    t = time_fn(fn, (jnp.ones(4),), reps=3, warmup=2, batch=5, host_ms=host)
    assert len(calls) == 2 + 3 * 5
    assert len(host) == 3 and all(0.0 <= h for h in host)
    assert t >= 0.0


def test_time_fn_rejects_empty_batch():
    with pytest.raises(ValueError, match="batch"):
        time_fn(lambda x: x, (jnp.ones(1),), reps=1, batch=0)


class _Device:
    def __init__(self, platform):
        self.platform = platform


def test_default_batch_by_platform():
    assert default_batch(_Device("cpu")) == 1
    assert default_batch(_Device("gpu")) == default_batch(_Device("cuda")) == 10


def _case(ours):
    return Case(name="double", make=lambda key: (jnp.arange(6.0),), ours=ours, xla=lambda x: 2 * x,
                floor_bytes=2 * 6 * 4)


def test_run_case_reports_ratios_and_batch():
    import jax

    row = run_case(_case(lambda x: x + x), jax.devices("cpu")[0], reps=2, batch=3)
    assert row["batch"] == 3 and row["case"] == "double"
    assert 0.0 <= row["ours_host_ms"]
    assert row["xla_over_ours"] == pytest.approx(row["xla_ms"] / row["ours_ms"])
    assert row["ours_over_floor"] == pytest.approx(row["ours_ms"] / row["floor_ms"])


def test_run_case_refuses_a_wrong_kernel():
    import jax

    with pytest.raises(AssertionError, match="differ"):
        run_case(_case(lambda x: x + 1), jax.devices("cpu")[0], reps=1)
