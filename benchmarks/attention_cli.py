"""Command-line options the attention GPU scripts share (attention_kernels, attention_power,
attention_determinism). No jax import here: the scripts check their arguments before they import it."""

from __future__ import annotations

import argparse

KINDS = ("none", "causal")


def add_shape_args(parser: argparse.ArgumentParser, head_dims: str = "128") -> None:
    """--batch, --seq, --heads, --kv-heads, --head-dims and --kinds of the [B, S, H, D] bf16
    cases (k and v [B, S, Hkv, D])."""
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="kv heads of grouped-query attention (default: --heads), dividing --heads")
    parser.add_argument("--head-dims", default=head_dims, help="head dims, comma-separated")
    parser.add_argument("--kinds", default="none,causal", help="mask kinds, comma-separated (none, causal)")


def shape_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[int]]:
    """(mask kinds, head dims) of the parsed options; a bad value ends in parser.error."""
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in KINDS:
            parser.error(f"--kinds: {kind!r} is not none or causal")
    try:
        dims = [int(x) for x in args.head_dims.split(",")]
    except ValueError:
        parser.error(f"--head-dims: {args.head_dims!r} is not a comma-separated list of integers")
    if min(args.batch, args.seq, args.heads, *dims) < 1:
        parser.error("--batch, --seq, --heads and --head-dims must be >= 1")
    if args.kv_heads is None:
        args.kv_heads = args.heads
    if args.kv_heads < 1 or args.heads % args.kv_heads:
        parser.error(f"--kv-heads: {args.kv_heads} does not divide --heads {args.heads}")
    return kinds, dims


def heads_label(args: argparse.Namespace) -> str:
    """The heads of a case label: "16", or "16/4" (query / kv heads) for grouped-query attention."""
    return str(args.heads) if args.kv_heads == args.heads else f"{args.heads}/{args.kv_heads}"
