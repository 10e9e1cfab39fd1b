"""CPU checks of the GPU benchmark scripts' host-side helpers (their GPU paths run on the device machine)."""

import pathlib

import pytest
from testutil import load_script


def _load(name: str):
    """A benchmark script loaded from its file, as tests/test_benchmark_harness.py loads the harness:
    benchmarks/ is not an installed package."""
    return load_script(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py",
                       f"rlx_benchmarks_{name}")


_power = _load("gpu_power")
_kernels = _load("attention_kernels")
_profile = _load("e2e_profile")


def test_power_samples_parse_and_skip_bad_lines():
    lines = [
        "2026/11/27 23:40:01.100, 698.20, 1612, Active",
        "[N/A], [N/A], [N/A], [N/A]",
        "2026/11/27 23:40:01.200, 690.00, 1600, Not Active",
    ]
    samples = _power.parse_samples(lines)
    assert [s[1:] for s in samples] == [(698.2, 1612.0, True), (690.0, 1600.0, False)]
    assert abs((samples[1][0] - samples[0][0]) - 0.1) < 1e-6  # timestamps parsed to seconds


def test_power_summary_leaves_out_the_first_second_and_weights_samples_alike():
    samples = [(10.0, 100.0, 1000.0, False), (11.5, 600.0, 1500.0, True), (12.0, 700.0, 1400.0, False),
               (13.5, 50.0, 1980.0, False)]
    got = _power.summarize(samples, 10.0, 12.0)
    assert got == {"watts": 650.0, "mhz": 1450.0, "cap_share": 0.5, "samples": 2}
    assert _power.summarize(samples, 10.0, 11.0) is None  # nothing after the first second


def test_smi_index_follows_cuda_visible_devices(monkeypatch):
    class Dev:
        local_hardware_id = 1

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _power.smi_index(Dev()) == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abc")
    assert _power.smi_index(Dev()) == "GPU-abc"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert _power.smi_index(Dev()) is None  # not a device this process sees
    assert _power.smi_index(object()) is None


def test_kernel_names_lose_return_type_arguments_and_namespaces():
    name = ("void rlx::cuda::attn::wgmma_fused_bwd_ws_kernel<__nv_bfloat16, 128, false, 0>"
            "(rlx::cuda::attn::AttnArgs, __nv_bfloat16 const*, float*)")
    assert _kernels.short_kernel_name(name) == "wgmma_fused_bwd_ws_kernel<bf16, 128, false, 0>"
    # a '(' inside template brackets is not the argument list
    assert _kernels.short_kernel_name("k<(int)3>(int)") == "k<(int)3>"
    assert _kernels.short_kernel_name("memset") == "memset"
    anon = "void rlx::cuda::(anonymous namespace)::ce_fwd_k<float, 4, 4>(float const*, int const*)"
    assert _kernels.short_kernel_name(anon) == "ce_fwd_k<float, 4, 4>"
    assert len(_kernels.short_kernel_name("x" * 100)) == 72


def test_kernel_table_sums_per_step_and_measures_the_span():
    # two steps: kernel a 10 us and b 30 us each, 5 us idle between them and between the steps
    events = [("a", 0, 10_000), ("void ns::b(int)", 15_000, 30_000),
              ("a", 50_000, 10_000), ("void ns::b(int)", 65_000, 30_000)]
    rows, busy, span = _kernels.kernel_table(events, steps=2)
    assert rows == [("b", 1.0, 30.0), ("a", 1.0, 10.0)]
    assert busy == 40.0
    assert span == 47.5  # (95 - 0) us over 2 steps
    with pytest.raises(ValueError, match="no GPU events"):
        _kernels.kernel_table([], steps=2)
    with pytest.raises(ValueError, match="steps"):
        _kernels.kernel_table(events, steps=0)


def test_e2e_profile_sorts_kernels_into_kinds():
    assert _profile.kernel_kind("nvjet_sm90_tst_128x160_64x5_1x2_h_bz_NNT") == "matmul"
    assert _profile.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention (cuDNN)"
    assert _profile.kernel_kind("void rlx::cuda::attn::wgmma_fwd_ws_kernel<bf16>(x)") == "rlx_jax kernels"
    assert _profile.kernel_kind("input_reduce_fusion_1") == "XLA reductions"
    assert _profile.kernel_kind("loop_convert_fusion") == "XLA fusions"
    assert _profile.kernel_kind("Memcpy DtoD") == "copies"
    assert _profile.kernel_kind("something_else") == "other"
    events = [("gemm_a", 0, 4_000), ("loop_add_fusion", 5_000, 1_000), ("gemm_b", 7_000, 2_000),
              ("gemm_a", 10_000, 4_000), ("loop_add_fusion", 15_000, 1_000), ("gemm_b", 17_000, 2_000)]
    assert _profile.kind_table(events, steps=2) == [("matmul", 2.0, 6.0), ("XLA fusions", 1.0, 1.0)]
    with pytest.raises(ValueError, match="steps"):
        _profile.kind_table(events, steps=0)


def test_e2e_profile_rounds_average_each_rounds_own_span():
    """Two rounds of 2 steps profiled a second apart: kernel time and kinds over all 4
    steps; the span of each round (19 us, then 60 us, over its 2 steps), not across the gap."""
    first = [("gemm_a", 0, 4_000), ("loop_add_fusion", 5_000, 1_000), ("gemm_a", 10_000, 4_000),
             ("loop_add_fusion", 17_000, 2_000)]
    second = [("gemm_a", 10**9, 6_000), ("gemm_a", 10**9 + 50_000, 6_000), ("loop_add_fusion", 10**9 + 59_000, 1_000)]
    rows, kinds, busy, span, per_round = _profile.round_tables([first, second], steps=2)
    assert busy == 6.0  # (11 + 13) us over 4 steps
    assert kinds == [("matmul", 1.0, 5.0), ("XLA fusions", 0.75, 1.0)]
    assert span == (9.5 + 30.0) / 2
    assert rows[0] == ("gemm_a", 1.0, 5.0)
    assert per_round == [{"matmul": 4.0, "XLA fusions": 1.5}, {"matmul": 6.0, "XLA fusions": 0.5}]


def test_e2e_profile_waits_each_step_or_once():
    """profile_events dispatches ``steps`` steps; waited for one by one, or back to back
    with one wait at the end (a training loop's regime)."""
    log = []

    class Out:
        def __init__(self, n):
            self.n = n

        def block_until_ready(self):
            log.append(("wait", self.n))
            return self

    def launch():
        n = sum(1 for e in log if e[0] == "launch")
        log.append(("launch", n))
        return Out(n)

    events = _profile.profile_events(launch, 3, lambda d: ["read"])
    assert events == ["read"]
    assert log == [("launch", 0), ("wait", 0), ("launch", 1), ("wait", 1), ("launch", 2), ("wait", 2)]
    log.clear()
    _profile.profile_events(launch, 3, lambda d: [], wait_each=False)
    assert [e for e in log if e[0] == "launch"] == [("launch", 0), ("launch", 1), ("launch", 2)]
    assert log[:3] == [("launch", 0), ("launch", 1), ("launch", 2)]  # no wait before the last dispatch
    assert sorted(e for e in log if e[0] == "wait") == [("wait", 0), ("wait", 1), ("wait", 2)]


def test_e2e_profile_op_table_sums_each_operation_over_steps():
    """Kernels grouped by the XLA operation that launched them, per step, with the op's
    longest kernel; records without an operation keep their kernel's name."""
    events = [("nvjet_a", 0, 4_000, "custom-call.3"), ("void rlx::k<float>(int)", 5_000, 1_000, "ffi_call.1"),
              ("void rlx::k2<float>(int)", 6_000, 3_000, "ffi_call.1"), ("Memset", 9_000, 500, ""),
              ("nvjet_a", 10_000, 6_000, "custom-call.3")]
    assert _profile.op_table(events, steps=2) == [
        ("custom-call.3", 1.0, 5.0, "nvjet_a"), ("ffi_call.1", 1.0, 2.0, "k2<float>"),
        ("(no hlo_op) Memset", 0.5, 0.25, "Memset")]


def test_e2e_profile_describes_operations_from_the_optimized_hlo():
    text = """HloModule jit_loss
  %bitcast.7 = bf16[16384,5632]{1,0} bitcast(%fusion.2)
  %bitcast.8 = bf16[16384,5632]{1,0} bitcast(%bitcast.7)
  %custom-call.3 = (bf16[16384,2048]{1,0}, s8[33554432]{0}) custom-call(%bitcast.8, %params__w_down__.1), custom_call_target="__cublas$lt$matmul", backend_config={"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}}
  ROOT %ffi_call.1 = (f32[4]{0}, bf16[4,8]{1,0}) custom-call(%custom-call.3#0), custom_call_target="rlx_x"
"""
    ops = _profile.hlo_ops(text)
    assert ops["custom-call.3"] == ("(bf16[16384,2048]) = __cublas$lt$matmul(%fusion.2, %params__w_down__.1) "
                                    "c(1,0)")
    assert ops["ffi_call.1"] == "(f32[4], bf16[4,8]) = rlx_x(%custom-call.3#0)"
    assert ops["bitcast.8"] == "bf16[16384,5632] = bitcast(%fusion.2)"


def test_attention_scripts_share_validated_shape_options():
    import argparse

    cli = _load("attention_cli")
    parser = argparse.ArgumentParser()
    cli.add_shape_args(parser, head_dims="128,64")
    args = parser.parse_args(["--kinds", "causal", "--batch", "2"])
    assert cli.shape_args(parser, args) == (["causal"], [128, 64])
    assert (args.batch, args.seq, args.heads, args.kv_heads) == (2, 4096, 16, 16)  # kv heads: --heads
    assert cli.heads_label(args) == "16"
    args = parser.parse_args(["--heads", "16", "--kv-heads", "4"])
    cli.shape_args(parser, args)
    assert args.kv_heads == 4 and cli.heads_label(args) == "16/4"
    for bad in (["--kinds", "none,sliding"], ["--head-dims", "64,x"], ["--heads", "0"], ["--kv-heads", "3"],
                ["--kv-heads", "0"]):
        with pytest.raises(SystemExit):
            cli.shape_args(parser, parser.parse_args(bad))


_packed = _load("attention_packed")


@pytest.mark.parametrize("layout", ["lognormal", "one", "tokens"])
def test_packed_documents_ids_and_visible_pairs(layout):
    """The packed-attention benchmark's ids: non-decreasing documents of every token, and its
    visible-pair count against a brute-force count of same-document causal pairs."""
    import numpy as np

    ids = _packed.packed_segment_ids(3, 300, 40.0, seed=1, layout=layout)
    assert ids.shape == (3, 300) and ids.dtype == np.int32
    assert (np.diff(ids, axis=1) >= 0).all()
    brute = sum(int(((row[:, None] == row[None, :]) & np.tri(300, dtype=bool)).sum()) for row in ids)
    assert _packed.visible_pairs(ids) == brute
    if layout == "one":
        assert brute == 3 * 300 * 301 // 2
    if layout == "tokens":
        assert brute == 3 * 300
    if layout == "lognormal":
        lengths = np.concatenate([np.unique(r, return_counts=True)[1] for r in ids])
        assert lengths.min() >= 1 and 1 < lengths.mean() < 300


@pytest.mark.parametrize("rows,keys", [(128, 128), (64, 128), (32, 16)])
def test_packed_tile_ceiling_counts_the_tiles_holding_a_visible_pair(rows, keys):
    """The tiles the segment kernels compute (those holding a visible pair) against a brute-force
    count over the dense visibility matrix, on odd lengths; the ceiling of one document a row is
    1, and the log-normal layout's lies below it."""
    import numpy as np

    for layout, mean, s in (("lognormal", 40.0, 300), ("lognormal", 150.0, 517), ("one", 1.0, 257),
                            ("tokens", 1.0, 130)):
        ids = _packed.packed_segment_ids(2, s, mean, seed=2, layout=layout)
        brute = 0
        for row in ids:
            vis = (row[:, None] == row[None, :]) & np.tri(s, dtype=bool)
            for q0 in range(0, s, rows):
                for k0 in range(0, s, keys):
                    brute += bool(vis[q0:q0 + rows, k0:k0 + keys].any())
        assert _packed.tiles_with_visible_pairs(ids, rows, keys) == brute, (layout, s)
    one = _packed.packed_segment_ids(2, 300, 1.0, layout="one")
    assert _packed.tile_ceiling(one, rows, keys) == 1.0
    assert 0 < _packed.tile_ceiling(_packed.packed_segment_ids(2, 1000, 100.0, seed=1), rows, keys) < 1


_cost = _load("attention_packed_cost")


def test_packed_cost_counts_the_forward_tiles_as_the_kernels_take_them():
    """The key tiles the causal forward computes inside each query tile's id hull (from the
    kernels' granule table) and those a document boundary crosses, against hand counts."""
    import numpy as np
    from rlx_jax.vjp_rules.attention_segments import SEGMENT_GRANULE, segment_tile_info

    def count(ids):
        return _cost.forward_tiles(ids, np.asarray(segment_tile_info(ids, ids)[0]), SEGMENT_GRANULE)

    one = np.zeros((2, 512), np.int32)
    assert count(one) == (2 * 4 * 5 // 2, 0)  # the causal tiles, none crossed
    assert count(np.broadcast_to(np.arange(512, dtype=np.int32), (1, 512)).copy()) == (4, 4)  # the diagonal
    assert count(_cost.regular(1, 512, 256)) == (6, 0)  # tiles [0], [0, 1], [2], [2, 3]
    # documents [0, 192), [192, 448), [448, 512): query tiles see key tiles [0], [0, 1], [1, 2],
    # [1, 2, 3]; crossed: tile 1 (two ids among its keys) everywhere, and the tiles whose rows
    # hold a later document than their keys
    assert count(_cost.regular(1, 512, 256, 64)) == (8, 6)
    ids = _packed.packed_segment_ids(2, 1000, 150.0, seed=3)
    snap = _cost.snapped(ids)
    assert snap.shape == ids.shape and (np.diff(snap, axis=1) >= 0).all()
    assert (snap.reshape(2, -1)[:, ::128] == ids[:, ::128]).all()
    assert all((np.unique(r[i:i + 128]).size == 1) for r in snap for i in range(0, 1000, 128))
    assert count(snap)[1] == 0  # no boundary inside a tile: no tile crossed
    # sliding windows: the diagonal tile only (window 0), one more for each query tile but the first
    assert _cost.window_tiles(2, 512, 0) == 8
    assert _cost.window_tiles(1, 512, 127) == 7 and _cost.window_tiles(1, 512, 1023) == 10


def test_attention_cpu_benchmark_checks_agreement_and_times_both():
    """A tiny run: ours and jax.nn's XLA path agree (the script returns 1 otherwise) and
    both are timed."""
    script = _load("attention_cpu")
    assert script.main(["--batch", "1", "--seq", "16", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
                        "--rounds", "1"]) == 0
    with pytest.raises(SystemExit):
        script.main(["--heads", "3", "--kv-heads", "2"])
