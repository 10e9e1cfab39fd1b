"""Fused ops under SPMD sharding, on 8 forced host CPU devices (in a subprocess, since
the device count is fixed when JAX starts), mesh data 4 x model 2: same values and
gradients as one device, and no all-gather of operands inserted around a fused kernel
(read off the compiled HLO of loss + gradients, and compared with the same function in
plain JAX): data, tensor (heads, grouped kv heads, FFN) and sequence parallelism, and a
small GPT step under data x tensor parallelism.
"""

from __future__ import annotations

import pathlib

import pytest

from testutil import host_device_rows

CHECK = pathlib.Path(__file__).with_name("sharding_check.py")


@pytest.fixture(scope="module")
def results():
    return host_device_rows(CHECK)


OPS = ["rms_norm", "add_rms_norm", "add_rms_norm_mixed_specs", "layer_norm", "group_norm", "softmax", "softmax_cross_entropy", "rope", "rope_heads",
       "rope_merged_heads", "rope_seq", "rope_split", "rope_split_merged", "cumsum", "attention", "attention_gqa", "attention_gqa_causal", "attention_mqa", "gather",
       "max_pool2d", "swiglu", "swiglu_mixed_specs",
       "swiglu_mlp", "swiglu_linear_tp", "swiglu_linear_rows",
       "rms_norm_linear_tp", "add_rms_norm_linear_rows", "train_step", "gpt_step"]


#: shardings the kernels cannot keep (a mesh axis that does not divide the axis they split,
#: or a dim split over part of a mesh axis): their operands are gathered, and the values and
#: gradients must still be right
GATHERED = ["attention_gqa_heads_indivisible", "rope_kv_heads_sub_axes", "attention_kv_heads_sub_axes",
            "rms_norm_sub_axes"]


def _same_values_through_the_kernels(r):
    assert "error" not in r, r.get("error")
    assert r["max_err"] < 1e-4, r
    assert r["kernels"], "no rlx kernel in the compiled program: the test would prove nothing"


@pytest.mark.parametrize("op", GATHERED)
def test_sharding_the_kernel_cannot_keep_still_gives_the_right_values(results, op):
    _same_values_through_the_kernels(results[op])


@pytest.mark.parametrize("op", OPS)
def test_sharded_op_matches_and_gathers_nothing(results, op):
    r = results[op]
    _same_values_through_the_kernels(r)
    # plain JAX gathers nothing in any of these cases: neither may the fused ops
    assert r["plain_all_gathers"] == 0, r
    assert r["all_gathers"] == [], "\n".join(r["all_gathers"])
