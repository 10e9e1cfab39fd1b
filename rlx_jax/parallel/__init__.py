"""Multi-device building blocks: context-parallel (ring) attention and mesh helpers.

- ``context_parallel_attention``: attention with the sequence axis sharded over a mesh
  axis (ring attention with zig-zag load balancing, fused kernels per block);
- ``zigzag_permutation`` / ``zigzag_inverse``: the sequence order it shards in;
- ``parse_mesh`` / ``transformer_param_specs``: the ``--mesh`` option of ``rlx-jax train``.
"""

from rlx_jax.parallel.context import context_parallel_attention, zigzag_inverse, zigzag_permutation

__all__ = ["context_parallel_attention", "zigzag_permutation", "zigzag_inverse"]
