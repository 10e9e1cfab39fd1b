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
import datetime
import subprocess
import time


def _smi_fields() -> str | None:
    """The nvidia-smi query fields: newer drivers call the flags clocks_event_reasons."""
    for prefix in ("clocks_event_reasons", "clocks_throttle_reasons"):
        fields = f"timestamp,power.draw,clocks.sm,{prefix}.sw_power_cap"
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                               capture_output=True)
        if probe.returncode == 0:
            return fields
    return None


def _parse(lines: list[str]) -> list[tuple[float, float, float, bool]]:
    """(unix time, W, MHz, power cap active) per sample; nvidia-smi stamps local time."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((stamp, float(parts[1]), float(parts[2]), parts[3] == "Active"))
        except (ValueError, IndexError):
            continue
    return out


def main() -> None:
    # (imported here, not at the top: tests/test_benchmark_scripts.py loads this file by its path, without
    # the repository root on sys.path)
    from benchmarks.attention_cli import add_shape_args, heads_label, shape_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    add_shape_args(parser)
    args = parser.parse_args()
    if args.rounds < 1 or not args.seconds >= 2.0:
        parser.error("--rounds must be >= 1 and --seconds >= 2")
    kinds, dims = shape_args(parser, args)
    try:
        fields = _smi_fields()
    except FileNotFoundError:
        fields = None
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
            smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                                    "-lms", "100"], stdout=subprocess.PIPE, text=True)
            phases = []
            try:
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
            finally:
                smi.terminate()
            samples = _parse(smi.stdout.read().splitlines())
            case = f"fwd+bwd {kind} B{b} S{s} H{heads_label(args)} D{d}"
            for name, rnd, t0, t1, calls in phases:
                sel = [x for x in samples if t0 + 1.0 <= x[0] <= t1]
                tf = flops * calls / (t1 - t0) / 1e12
                if not sel:
                    print(f"{case:30s} {name:6s} {rnd:5d} {tf:7.1f}  (no samples)")
                    continue
                watts = sum(x[1] for x in sel) / len(sel)
                mhz = sum(x[2] for x in sel) / len(sel)
                cap = sum(x[3] for x in sel) / len(sel)
                print(f"{case:30s} {name:6s} {rnd:5d} {tf:7.1f} {watts:6.1f} "
                      f"{mhz:7.0f} {cap:5.0%} {tf / mhz:9.4f}", flush=True)


if __name__ == "__main__":
    main()
