"""One process of the multi-process test (tests/test_multihost.py): joins a 2-process
JAX cluster on this machine (CPU devices, gloo collectives), runs a sharded fused-op
gradient over all 4 devices of the cluster and prints the result as JSON."""

import json
import sys

import jax

process_id, port = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_num_cpu_devices", 2)
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from rlx_jax import ops  # noqa: E402

mesh = Mesh(np.array(jax.devices()), ("data",))
x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
g = np.linspace(0.5, 1.5, 16).astype(np.float32)
xs = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("data")), lambda idx: x[idx])
step = jax.jit(jax.value_and_grad(lambda x, g: jnp.sum(jnp.sin(ops.rms_norm(x, g))), (0, 1)))
loss, (dx, dg) = step(xs, g)
print(json.dumps({"process": process_id, "devices": len(jax.devices()), "local": len(jax.local_devices()),
                  "loss": float(loss), "dgamma": np.asarray(dg).tolist()}), flush=True)
jax.distributed.shutdown()
