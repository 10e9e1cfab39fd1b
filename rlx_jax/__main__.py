"""Command line: ``rlx-jax`` / ``python -m rlx_jax``.

    rlx-jax            same as ``rlx-jax info``
    rlx-jax info       devices, loaded kernels, and an RMSNorm gradient computed with the
                       compiled kernel checked against the pure-JAX reference
"""

from __future__ import annotations

import argparse
import sys


def cmd_info(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    import rlx_jax
    from rlx_jax.ops import rms_norm
    from rlx_jax.vjp_rules.rms_norm import reference_rms_norm

    print(f"rlx_jax {rlx_jax.__version__}, jax {jax.__version__}")
    print("devices:", ", ".join(f"{d.platform}:{d.id} ({d.device_kind})" for d in jax.devices()))
    for platform, info in rlx_jax.kernel_info().items():
        state = "loaded" if info["loaded"] else "not loaded"
        print(f"kernels [{platform}]: {state}; targets: {', '.join(info['targets']) or '-'}")
        if info["error"]:
            print(f"  ({info['error']})")

    kx, kg = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (256, 512))
    g = 1.0 + 0.1 * jax.random.normal(kg, (512,))
    loss = lambda x, g: jnp.sum(jnp.sin(rms_norm(x, g)))
    loss_ref = lambda x, g: jnp.sum(jnp.sin(reference_rms_norm(x, g, jnp.zeros_like(g), eps=1e-6)[0]))
    grad = jax.jit(jax.grad(loss, (0, 1)))
    hlo = grad.lower(x, g).as_text()
    fused = "rlx_rms_norm_bwd" in hlo
    got = grad(x, g)
    want = jax.grad(loss_ref, (0, 1))(x, g)
    errs = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want)]
    print(
        f"rms_norm gradient [256x512 f32]: fused backward kernel {'used' if fused else 'NOT used (reference)'}; "
        f"max relative error vs reference: dx {errs[0]:.2e}, dgamma {errs[1]:.2e}"
    )
    ok = all(e < 1e-4 for e in errs)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlx-jax", description="rlx_jax: the RLX gradient compiler on JAX/XLA")
    sub = parser.add_subparsers(dest="command")
    p_info = sub.add_parser("info", help="devices, loaded kernels, and a fused-gradient self-check")
    p_info.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["info"])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
