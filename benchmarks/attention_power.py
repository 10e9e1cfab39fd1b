"""Sustained attention fwd+bwd, ours and cuDNN, with the GPU's power draw and SM clock.

The attention table (benchmarks.cases_attention) times calls back to back; on an H100 that
regime runs at the board's power limit, so the clocks it sees depend on how much power each
kernel draws per cycle. This script makes
that visible: for each case it runs ours and cuDNN's fwd+bwd for ``--seconds`` each, alternating,
while ``nvidia-smi`` samples power.draw, clocks.sm and the power-cap event flag every 100 ms, and
prints per phase the TFLOP/s, the mean power and SM clock over the phase's samples (the first
second left out), the share of samples with the power cap active, and TFLOP/s per MHz (work per
cycle: the ratio of two kernels' figures is their speed ratio at equal clocks).

    python3 -m benchmarks.attention_power --rounds 2 --seconds 8

bf16, B4 S4096 H16 (``--batch``, ``--seq``, ``--heads``), D 128 (``--head-dims``), mask none and
causal (``--kinds``); flops as benchmarks.cases_attention (fwd+bwd = 3.5 x 4 B H S^2 D, halved
when causal).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    # (imported here, not at the top: tests/test_benchmark_scripts.py loads this file by its path, without
    # the repository root on sys.path)
    from benchmarks.attention_cli import add_shape_args, heads_label, shape_args
    from benchmarks.gpu_power import PowerSampler, smi_fields, smi_index, summarize

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    add_shape_args(parser)
    args = parser.parse_args()
    if args.rounds < 1 or not args.seconds >= 2.0:
        parser.error("--rounds must be >= 1 and --seconds >= 2")
    kinds, dims = shape_args(parser, args)
    fields = smi_fields()
    if fields is None:
        raise SystemExit("nvidia-smi cannot report power.draw / clocks.sm here")

    import jax

    from benchmarks.cases_attention import _fwd_bwd, _gpu_fns, attention_flops, gpu_inputs

    dev = next(d for d in jax.devices() if d.platform == "gpu")
    b, s, h = args.batch, args.seq, args.heads
    print(f"# {dev.device_kind}; {args.seconds:g} s a phase, samples every 100 ms (the first second of a phase left out)")
    head = (f"{'case':30s} {'kernel':6s} {'round':>5s} {'TF/s':>7s} {'W':>6s} {'SM MHz':>7s} {'cap':>5s} "
            f"{'TF/s/MHz':>9s}")
    print(head)
    print("-" * len(head))
    for d in dims:
        inputs = gpu_inputs(b, s, h, d, dev, args.kv_heads)
        for kind in kinds:
            ours, cudnn, _ = _gpu_fns(kind)
            fns = {"ours": jax.jit(_fwd_bwd(ours)), "cuDNN": jax.jit(_fwd_bwd(cudnn))}
            for fn in fns.values():
                jax.block_until_ready(fn(*inputs))
            flops = attention_flops(b, h, s, d, causal=kind == "causal", backward=True)
            phases = []
            with PowerSampler(fields, smi_index(dev)) as sampler:
                for rnd in range(args.rounds):
                    for name, fn in fns.items():
                        time.sleep(2.0)  # idle between phases: the clocks recover
                        t0, calls = time.time(), 0
                        while time.time() - t0 < args.seconds:
                            for _ in range(10):
                                out = fn(*inputs)
                            jax.block_until_ready(out)
                            calls += 10
                        phases.append((name, rnd, t0, time.time(), calls))
                time.sleep(0.5)
            case = f"fwd+bwd {kind} B{b} S{s} H{heads_label(args)} D{d}"
            for name, rnd, t0, t1, calls in phases:
                tf = flops * calls / (t1 - t0) / 1e12
                got = summarize(sampler.samples, t0, t1)
                if got is None:
                    print(f"{case:30s} {name:6s} {rnd:5d} {tf:7.1f}  (no samples)")
                    continue
                watts, mhz, cap = got["watts"], got["mhz"], got["cap_share"]
                print(f"{case:30s} {name:6s} {rnd:5d} {tf:7.1f} {watts:6.1f} "
                      f"{mhz:7.0f} {cap:5.0%} {tf / mhz:9.4f}", flush=True)


if __name__ == "__main__":
    main()
