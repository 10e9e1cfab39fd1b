"""Fused ops inside ``jax.shard_map`` with its default ``check_vma=True``, on 4 forced host
CPU devices (in a subprocess: the device count is fixed when JAX starts): data split over
the mesh axis, parameters replicated. The loss and every gradient (the replicated
parameters' summed over the devices by JAX) match one device on the whole batch, the
gradients taken inside the body too; the kernels run; and shard_map still refuses to read
a fused op's varying result as replicated."""

from __future__ import annotations

import pathlib

import pytest

from testutil import host_device_rows

CHECK = pathlib.Path(__file__).with_name("shard_map_check.py")


@pytest.fixture(scope="module")
def results():
    return host_device_rows(CHECK, devices=4)


OPS = ["rms_norm", "add_rms_norm", "layer_norm", "group_norm", "softmax", "softmax_cross_entropy", "rope",
       "rope_split", "attention", "attention_sinks", "swiglu", "swiglu_linear", "rms_norm_linear",
       "add_rms_norm_linear", "gather", "cumsum", "max_pool2d", "fused_linear_cross_entropy",
       "fused_linear_cross_entropy_sum"]


@pytest.mark.parametrize("op", OPS)
def test_op_in_shard_map_gives_the_whole_batch_gradients(results, op):
    r = results[op]
    assert "error" not in r, r["error"]
    assert r["max_err"] < 1e-4, r
    assert r["inner_err"] < 1e-4, r
    assert r["kernels"], "no rlx kernel in the compiled program: the test would prove nothing"


def test_varying_results_are_not_read_as_replicated(results):
    r = results["replication_check"]
    assert "error" not in r, r["error"]
    assert "replication" in r["message"]
