"""Two processes on this machine form one JAX cluster (jax.distributed.initialize over
loopback, CPU devices, gloo collectives) and run a sharded fused-op gradient: the same
script a multi-host GPU job runs (docs/MULTI_DEVICE.md). Both must agree with one device."""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from rlx_jax import ops

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_cluster_matches_one_device():
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        finally:
            p.kill()
        assert p.returncode == 0, err[-3000:]
        outs.append(next(json.loads(line) for line in out.splitlines() if line.startswith("{")))
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    g = np.linspace(0.5, 1.5, 16).astype(np.float32)
    loss, (_, dg) = jax.value_and_grad(lambda x, g: jnp.sum(jnp.sin(ops.rms_norm(x, g))), (0, 1))(x, g)
    for o in outs:
        assert o["devices"] == 4 and o["local"] == 2
        np.testing.assert_allclose(o["loss"], float(loss), rtol=1e-5)
        np.testing.assert_allclose(o["dgamma"], np.asarray(dg), rtol=1e-4, atol=1e-5)
