"""Where an attention fwd+bwd step's GPU time goes, kernel by kernel, in the back-to-back regime.

ncu times each kernel alone with the caches flushed and the clocks free; the attention table
times calls back to back, where an H100 runs at its power cap (``benchmarks.attention_power``).
This script reads the kernels' own durations in the
table's regime: it dispatches ``--steps`` jitted fwd+bwd calls back to back under the JAX profiler
(CUPTI activity records) and prints, for ours and cuDNN, each kernel's launches per step and its
mean time per step, then the step's kernel time, its span (first kernel start to last kernel end,
per step) and the difference (the GPU idle between kernels).

    python3 -m benchmarks.attention_kernels --kinds none,causal --head-dims 128,64

bf16, B4 S4096 H16 by default; flops as benchmarks.cases_attention (the TF/s column divides the
step's flops by its span).
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import tempfile


def short_kernel_name(name: str) -> str:
    """A kernel's name without its return type, argument list and namespaces, at most 72 characters:
    'void rlx::cuda::attn::k<__nv_bfloat16, 128>(rlx::cuda::attn::AttnArgs, ...)' -> 'k<bf16, 128>';
    an anonymous namespace is dropped like any other."""
    name = re.sub(r"^void\s+", "", name.strip()).replace("(anonymous namespace)::", "")
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the argument list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            cut = i
            break
    name = name[:cut]
    name = re.sub(r"\b[A-Za-z_]\w*::", "", name)
    name = name.replace("__nv_bfloat16", "bf16").replace("__half", "f16")
    return name if len(name) <= 72 else name[:69] + "..."


def kernel_table(events, steps: int, key=short_kernel_name):
    """Per-step figures of ``steps`` back-to-back steps from their GPU events (name, start ns,
    duration ns): ([(key of the name, launches per step, us per step)], kernel us per step, span
    us per step), rows by decreasing time; ``key`` maps a kernel's full name to its row (default:
    its short name)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not events:
        raise ValueError("no GPU events: the profiler saw no kernel")
    total = collections.defaultdict(float)
    count = collections.Counter()
    for name, _, dur in events:
        row = key(name)
        total[row] += dur
        count[row] += 1
    rows = sorted(((k, count[k] / steps, total[k] / steps / 1e3) for k in total), key=lambda r: -r[2])
    busy = sum(total.values()) / steps / 1e3
    span = (max(s + d for _, s, d in events) - min(s for _, s, _ in events)) / steps / 1e3
    return rows, busy, span


def _gpu_events(trace_dir: str, with_op: bool = False):
    """(name, start ns, duration ns) of every event on the GPU planes' stream lines of the
    profile written to trace_dir; ``with_op`` adds a fourth field, the XLA operation that
    launched it (the record's ``hlo_op`` stat, "" where it has none)."""
    from jax.profiler import ProfileData

    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not files:
        raise SystemExit(f"the profiler wrote no xplane.pb under {trace_dir}")
    events = []
    for plane in ProfileData.from_file(files[0]).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                op = (str(dict(e.stats).get("hlo_op", "")),) if with_op else ()
                events.append((e.name, e.start_ns, e.duration_ns, *op))
    return events


def main() -> None:
    # (imported here, not at the top: tests/test_benchmark_scripts.py loads this file by its path, without
    # the repository root on sys.path)
    from benchmarks.attention_cli import add_shape_args, heads_label, shape_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="fwd+bwd calls profiled back to back")
    add_shape_args(parser)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    kinds, dims = shape_args(parser, args)

    import jax

    from benchmarks.cases_attention import _fwd_bwd, _gpu_fns, attention_flops, gpu_inputs

    dev = next(d for d in jax.devices() if d.platform == "gpu")
    b, s, h = args.batch, args.seq, args.heads
    print(f"# {dev.device_kind}; jax {jax.__version__}; bf16; {args.steps} fwd+bwd steps back to back under the "
          "JAX profiler; us per step")
    for d in dims:
        inputs = gpu_inputs(b, s, h, d, dev, args.kv_heads)
        for kind in kinds:
            ours, cudnn, _ = _gpu_fns(kind)
            flops = attention_flops(b, h, s, d, causal=kind == "causal", backward=True)
            for impl, fn in (("ours", ours), ("cuDNN", cudnn)):
                step = jax.jit(_fwd_bwd(fn))
                for _ in range(3):
                    jax.block_until_ready(step(*inputs))
                with tempfile.TemporaryDirectory() as trace_dir:
                    with jax.profiler.trace(trace_dir):
                        for _ in range(args.steps):
                            out = step(*inputs)
                        jax.block_until_ready(out)
                    events = _gpu_events(trace_dir)
                rows, busy, span = kernel_table(events, args.steps)
                print(f"## fwd+bwd {kind} B{b} S{s} H{heads_label(args)} D{d} {impl}: kernels {busy:.1f}, span {span:.1f}, "
                      f"idle {span - busy:.1f} us a step; {flops / span / 1e6:.1f} TF/s over the span")
                for name, per_step, us in rows:
                    print(f"   {us:9.1f} us  {per_step:5.2f}x  {name}")


if __name__ == "__main__":
    main()
