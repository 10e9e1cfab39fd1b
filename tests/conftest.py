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

