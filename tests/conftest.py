"""Shared fixtures (helpers live in testutil.py)."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture
def x64():
    """Enables float64 for one test and restores the previous setting."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)



@pytest.fixture(autouse=True, scope="session")
def attention_cpu_kernel():
    """On the CPU, attention lowers to XLA's code below a score-size threshold (it is faster
    there); the tests run the kernel at every size so that it stays covered (session scope:
    module-scoped fixtures that compile attention see it too). Tests of the routing itself
    restore the threshold with ``monkeypatch.setattr``."""
    from rlx_jax.vjp_rules import attention

    patch = pytest.MonkeyPatch()
    patch.setattr(attention, "CPU_KERNEL_MIN_SCORE_BYTES", 0)
    yield
    patch.undo()
