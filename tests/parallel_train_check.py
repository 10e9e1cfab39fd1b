"""Run in a subprocess with 4 host CPU devices (tests/test_parallel_strategies.py): the
``--mesh`` machinery of ``rlx-jax train``. Prints one JSON line per case."""

from __future__ import annotations

import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rlx_jax.models import TransformerConfig, transformer_lm  # noqa: E402
from rlx_jax.parallel.mesh import param_shardings, param_specs, parse_mesh, state_shardings  # noqa: E402
from rlx_jax.train.loop import TrainConfig, make_optimizer, make_step  # noqa: E402
from rlx_jax.vjp_rules import attention as _attention  # noqa: E402

# attention lowers to XLA's code on the CPU at small sizes; these checks are about the kernels
_attention.CPU_KERNEL_MIN_SCORE_BYTES = 0

CONFIG = TransformerConfig(seq_len=16, layers=1, width=32, heads=2)


def case_specs():
    mesh = parse_mesh("data=2,model=2")
    shapes = {k: s for k, (s, _) in transformer_lm(CONFIG).param_shapes.items()}
    odd_cfg = TransformerConfig(seq_len=16, layers=1, width=48, heads=3)
    odd = {k: s for k, (s, _) in transformer_lm(odd_cfg).param_shapes.items()}
    as_list = lambda specs: {k: list(v) for k, v in specs.items()}
    return {"case": "specs", "mesh": dict(mesh.shape), "specs": as_list(param_specs(shapes, mesh, CONFIG)),
            "odd_heads": as_list(param_specs(odd, mesh, odd_cfg))}


def case_step():
    """Three AdamW steps on mesh data 2 x model 2 against the same steps on one device (the
    first Adam step moves each weight by about +-lr whatever the gradient's size; the later
    ones depend on the gradients' values)."""
    model = transformer_lm(CONFIG)
    batch = 4
    graph = model.build(batch)
    optimizer = make_optimizer(TrainConfig(steps=10))
    params = model.init(jax.random.PRNGKey(0))
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab_size, (batch, CONFIG.seq_len)).astype(np.int32)
    labels = rng.integers(0, CONFIG.vocab_size, (batch * CONFIG.seq_len,)).astype(np.float32)
    inputs = {"tokens": tokens, "labels": labels}
    single = make_step(graph, optimizer, True)
    want_p, want_s, want_loss = params, opt_state, []
    for _ in range(3):
        want_p, want_s, loss = single(want_p, want_s, inputs)
        want_loss.append(float(loss))

    mesh = parse_mesh("data=2,model=2")
    p_sh = param_shardings(params, mesh, CONFIG)
    placed = jax.device_put((params, opt_state), (p_sh, state_shardings(opt_state, params, p_sh, mesh)))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    sharded = make_step(graph, optimizer, True, mesh, CONFIG)
    (got_p, got_s), got_loss = placed, []
    for _ in range(3):
        got_p, got_s, loss = sharded(got_p, got_s, jax.device_put(inputs, split))
        got_loss.append(float(loss))
    q = got_p["layer0.q.w"]
    return {"case": "step", "loss_err": max(abs(a - b) for a, b in zip(got_loss, want_loss)),
            "param_err": max(float(jnp.max(jnp.abs(got_p[k] - want_p[k]))) for k in want_p),
            "q_shape": list(q.shape), "q_shard_shape": list(q.addressable_shards[0].data.shape)}


def case_errors():
    msgs = {}
    for key, spec in (("too_big", "data=4,model=2"), ("bad_axis", "data=2,pipe=2"), ("bad_syntax", "data:2")):
        try:
            parse_mesh(spec, allowed=("data", "model"))
            msgs[key] = ""
        except ValueError as e:
            msgs[key] = str(e)
    return {"case": "errors", "messages": msgs}


if __name__ == "__main__":
    for run in (case_specs, case_step, case_errors):
        try:
            row = run()
        except Exception as e:  # reported, and failed, by the test
            row = {"case": run.__name__[5:], "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(row), flush=True)
