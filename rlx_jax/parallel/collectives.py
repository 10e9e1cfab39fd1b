"""Collectives of a compiled program, read off its HLO text."""

from __future__ import annotations

import re

__all__ = ["COLLECTIVES", "count_collectives", "collective_lines"]

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


def _pattern(name: str):
    # an instruction "%x = <shape> all-gather(...)" or its async "all-gather-start(...)"
    return re.compile(rf" {name}(-start)?\(")


def collective_lines(hlo: str, name: str) -> list[str]:
    """The HLO instructions (stripped lines) that run collective ``name`` (e.g. "all-gather")."""
    if name not in COLLECTIVES:
        raise ValueError(f"collective_lines: name must be one of {COLLECTIVES}, got {name!r}")
    pat = _pattern(name)
    return [line.strip() for line in hlo.splitlines() if pat.search(line)]


def count_collectives(hlo: str) -> dict:
    """{collective: count} of a compiled HLO text (``jitted.lower(...).compile().as_text()``);
    an async start / done pair counts once, a combined all-reduce of several arrays once."""
    return {name: len(collective_lines(hlo, name)) for name in COLLECTIVES}
