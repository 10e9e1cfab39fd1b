"""Builders (filled per op family)."""

from __future__ import annotations

from .builders_core import BuilderBase


class BackwardBuilders(BuilderBase):
    pass
