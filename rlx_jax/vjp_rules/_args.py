"""Validation of the static arguments the ops share."""

from __future__ import annotations

import numpy as np


def is_int(v) -> bool:
    """A Python or NumPy integer, not a bool (True is not a stride)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def int_pair(fn: str, name: str, value, minimum: int) -> tuple[int, int]:
    """``value`` (an int, or a sequence of two) as two Python ints >= ``minimum``; a float
    (1.5, or 2.0) or a bool raises TypeError rather than being truncated into a window
    geometry."""
    pair = (value, value) if is_int(value) else value
    try:
        pair = tuple(pair)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an int or a pair of ints, got {value!r}") from None
    if not all(is_int(v) for v in pair):
        raise TypeError(f"{fn}: {name} must be an int or a pair of ints, got {value!r}")
    pair = tuple(int(v) for v in pair)
    if len(pair) != 2 or any(v < minimum for v in pair):
        raise ValueError(f"{fn}: {name} must be two ints >= {minimum}, got {pair}")
    return pair
