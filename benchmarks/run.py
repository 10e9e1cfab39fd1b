"""Benchmark runner: prints a table of ratios for a list of case modules.

    python -m benchmarks.run                       # every case module, default device
    python -m benchmarks.run --cases rms_norm --device cpu --json out.json
    python -m benchmarks.run --cases rowwise --filter "softmax fwd"   # only matching cases

Each ``benchmarks/cases_<name>.py`` defines ``cases(device_kind) -> list[Case]``
(device_kind is "cpu" or "gpu"); see harness.py for what is timed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import re
import sys

import jax

from benchmarks.harness import default_batch, run_case

HERE = pathlib.Path(__file__).parent


def available_case_modules() -> list[str]:
    return sorted(p.stem[len("cases_"):] for p in HERE.glob("cases_*.py"))


def format_table(rows: list[dict]) -> str:
    """One line a case; "host" is the time a call of ours spent being dispatched (with
    ``batch`` > 1, a figure near "ours ms" means the host, not the device, set the pace)."""
    head = (f"{'case':44s} {'ours ms':>9s} {'XLA ms':>9s} {'copy ms':>9s} {'XLA/ours':>9s} {'ours/copy':>9s} "
            f"{'ours GB/s':>9s} {'host ms':>8s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['case']:44s} {r['ours_ms']:9.3f} {r['xla_ms']:9.3f} {r['floor_ms']:9.3f} "
            f"{r['xla_over_ours']:9.2f} {r['ours_over_floor']:9.2f} {r['ours_GBps']:9.1f} {r['ours_host_ms']:8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="all", help="comma-separated case modules (default: all): " + ", ".join(available_case_modules()))
    parser.add_argument("--device", choices=["cpu", "gpu"], default=None, help="default: the default JAX backend")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per round (median taken)")
    parser.add_argument("--batch", type=int, default=None,
                        help="calls dispatched back to back per timing sample (default: 10 on a GPU, 1 on the CPU)")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--filter", default=None, metavar="REGEX",
                        help="run only the cases whose name matches REGEX (re.search)")
    args = parser.parse_args(argv)

    import rlx_jax

    names = available_case_modules() if args.cases == "all" else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(names) - set(available_case_modules()))
    if unknown:
        parser.error(f"unknown case module(s) {unknown}; available: {available_case_modules()}")
    device = jax.devices(args.device)[0] if args.device else jax.devices()[0]
    kind = "gpu" if device.platform in ("gpu", "cuda", "rocm") else "cpu"
    print(f"# device: {device.device_kind} ({device.platform}); jax {jax.__version__}; "
          f"kernels: {({p: i['loaded'] for p, i in rlx_jax.kernel_info().items()})}; "
          f"calls per timing sample: {args.batch or default_batch(device)}", flush=True)
    pattern = re.compile(args.filter) if args.filter else None
    rows = []
    for name in names:
        module = importlib.import_module(f"benchmarks.cases_{name}")
        for case in module.cases(kind):
            if pattern is not None and not pattern.search(case.name):
                continue
            row = run_case(case, device, args.reps, args.batch)
            rows.append(row)
            print(format_table([row]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
