"""Fused-op families: pure-JAX references, kernel primitives and their differentiation
rules (docs/ARCHITECTURE.md). The public functions are re-exported by ``rlx_jax.ops``."""
