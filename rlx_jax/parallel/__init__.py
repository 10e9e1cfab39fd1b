"""Multi-device building blocks: context-parallel (ring) attention and mesh helpers.

- ``context_parallel_attention``: attention with the sequence axis sharded over a mesh
  axis (ring attention with zig-zag load balancing, fused kernels per block);
- ``zigzag_permutation`` / ``zigzag_inverse``: the sequence order it shards in;
- ``count_collectives`` / ``collective_lines``: the collectives of a compiled program;
- ``rlx_jax.parallel.mesh``: ``parse_mesh`` and the parameter sharding rules behind
  ``rlx-jax train --mesh``.
"""

from rlx_jax.parallel.collectives import collective_lines, count_collectives
from rlx_jax.parallel.context import context_parallel_attention, zigzag_inverse, zigzag_permutation

__all__ = ["context_parallel_attention", "zigzag_permutation", "zigzag_inverse", "count_collectives",
           "collective_lines"]
