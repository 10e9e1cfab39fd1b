"""Where the e2e training step's GPU time goes, by kind of kernel, for each variant.

Runs ``--steps`` compiled steps of ``benchmarks/e2e_step.py``'s Llama-style decoder back to
back under the JAX profiler (CUPTI activity records), for each variant in turn, ``--rounds``
times (the variants interleaved, as the step benchmark times them: a GPU whose clock drifts
between two profiles taken one after the other shows the drift as a difference between the
variants). It prints, per variant, the step's kernel time split into kinds (matrix
multiplies, attention, rlx_jax kernels, XLA fusions, copies) with each kind's time in every
round, the span and idle time (each step waited for before the next is dispatched, so the
idle time includes the host's dispatch between steps; with ``--back-to-back`` the steps are
dispatched as a training loop does, one wait at the end, and the idle time is the gaps the
GPU itself leaves between kernels), then the ``--top`` kernels by time, and with ``--by-op N``
the N XLA operations (the ``hlo_op`` of the profiler's kernel records: a cuBLAS custom call,
a fusion, an FFI call) by time, with the kernel each ran and the operation's line of the
compiled step's optimized HLO (its result type, opcode and operands, shortened: the
parameters among them say which weight a matmul reads). ``--by-op`` turns
XLA's command buffers off (``--xla_gpu_enable_command_buffer=``): inside a CUDA graph every
kernel is recorded under the graph's operation, not its own; launched one by one, the
step's idle time grows by the launches' gaps.

    python -m benchmarks.e2e_profile --preset llama-v32k --variants plain-cudnn,rlx --rounds 3
    python -m benchmarks.e2e_profile --preset llama-v32k --variants rlx-lean --by-op 80

The kinds say where a fusion can pay: a step's time outside its matrix multiplies and
attention is the part fused element-wise kernels can shrink.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import sys
import tempfile

#: kernel kinds, first match wins, by lower-cased substrings of the kernel's full name
#: (cuBLAS's Hopper kernels are nvjet_* / sm90_xmma_*, CUTLASS's cutlass*, cuDNN's
#: attention cudnn* / *fmha* / *flash*; rlx_jax's kernels live in namespace rlx::)
KINDS = (
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "gemv")),
    ("attention (cuDNN)", ("cudnn", "fmha", "flash", "sdpa")),
    ("rlx_jax kernels", ("rlx::",)),
    ("copies", ("memcpy", "memset", "copy", "transpose")),
    ("XLA reductions", ("reduce", "scatter")),
    ("XLA fusions", ("fusion", "loop_", "input_", "wrapped_", "convert", "add", "multiply", "select")),
)


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel from its full (unshortened) name; 'other' if none matches."""
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def _load(name: str):
    """A sibling script as a module, by its path (this file also runs without the repository
    root on sys.path)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_e2e_profile_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


_kernels = _load("attention_kernels")


def kind_table(events, steps: int):
    """[(kind, launches per step, us per step)] of ``steps`` steps' GPU events (name, start ns,
    duration ns), rows by decreasing time."""
    return _kernels.kernel_table(events, steps, key=kernel_kind)[0]


def main(argv=None) -> int:
    e2e = _load("e2e_step")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(e2e.PRESETS), default="llama-v32k")
    p.add_argument("--variants", default="plain-cudnn,rlx", help="comma-separated e2e_step variant names")
    p.add_argument("--steps", type=int, default=5, help="steps profiled back to back")
    p.add_argument("--rounds", type=int, default=1, help="profiles per variant, the variants interleaved")
    p.add_argument("--top", type=int, default=25, help="kernels listed per variant")
    p.add_argument("--by-op", type=int, default=0, help="XLA operations listed per variant (0: none)")
    p.add_argument("--back-to-back", action="store_true",
                   help="dispatch the profiled steps back to back with one wait at the end (idle: the GPU's own gaps)")
    a = p.parse_args(argv)
    if a.steps < 1 or a.rounds < 1:
        p.error("--steps and --rounds must be >= 1")
    if a.by_op:  # before jax starts: flags are read once
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

    import jax
    import numpy as np

    device = jax.devices()[0]
    if device.platform not in ("gpu", "cuda"):
        raise SystemExit("e2e_profile reads GPU kernel records: run it on a GPU")
    s = e2e.Shape(**e2e.PRESETS[a.preset])
    by_name = {v.name: v for v in e2e.variants("gpu")}
    wanted = a.variants.split(",")
    unknown = [w for w in wanted if w not in by_name]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {sorted(by_name)}")
    params = e2e.init_params(s, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    tokens = jax.numpy.asarray(rng.integers(0, s.vocab, size=(s.batch, s.seq)), jax.numpy.int32)
    labels = jax.numpy.asarray(rng.integers(0, s.vocab, size=s.tokens), jax.numpy.int32)

    print(f"# {device.device_kind}; jax {jax.__version__}; preset {a.preset} ({s}); {a.steps} steps "
          f"{'dispatched back to back, one wait' if a.back_to_back else 'each waited for'} under the JAX profiler, "
          f"{a.rounds} round(s), the variants interleaved; us per step")
    runners = {name: e2e.step_runner(s, by_name[name], params, tokens, labels) for name in wanted}
    for runner in runners.values():
        for _ in range(2):
            runner.step()
    rounds = {name: [] for name in wanted}  # per variant, each round's GPU events
    for _ in range(a.rounds):
        for name in wanted:
            rounds[name].append(profile_events(runners[name].launch, a.steps, gpu_op_events,
                                               wait_each=not a.back_to_back))
    for name in wanted:
        events = [[e[:3] for e in r] for r in rounds[name]]
        print_variant(name, events, a.steps, a.top)
        if a.by_op:
            hlo = runners[name].hlo
            print_ops([e for r in rounds[name] for e in r], a.steps * a.rounds, a.by_op,
                      hlo_ops(hlo()) if hlo else {})
    return 0


def gpu_op_events(trace_dir: str):
    """(name, start ns, duration ns, XLA operation) of the profile's GPU kernel records (the
    operation: the record's ``hlo_op`` stat, "" where it has none)."""
    return _kernels._gpu_events(trace_dir, with_op=True)


def op_table(events, steps: int):
    """[(operation, launches per step, us per step, short name of its longest kernel)] of GPU
    events (name, start ns, duration ns, operation), by decreasing time."""
    total = collections.defaultdict(float)
    count = collections.Counter()
    longest = {}
    for name, _, dur, op in events:
        key = op or "(no hlo_op) " + _kernels.short_kernel_name(name)
        total[key] += dur
        count[key] += 1
        if dur >= longest.get(key, ("", -1))[1]:
            longest[key] = (_kernels.short_kernel_name(name), dur)
    rows = [(k, count[k] / steps, total[k] / steps / 1e3, longest[k][0]) for k in total]
    return sorted(rows, key=lambda r: -r[2])


_HLO_LINE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*?)\)(?:, |$)")


def hlo_ops(text: str) -> dict[str, str]:
    """{operation name: "result type = opcode(operands)"} of an HLO module's text: layouts
    dropped, a custom call named by its target, a bitcast operand by what it reinterprets
    (so a matmul shows the parameter it reads), a matmul's contracting dimensions appended
    as "c(lhs,rhs)"; at most 120 characters."""
    lines = {}
    for line in text.splitlines():
        m = _HLO_LINE.match(line)
        if m:
            lines[m.group(1)] = (m, line)
    source = {name: m.group(4).split(",")[0].strip().lstrip("%") for name, (m, _) in lines.items()
              if m.group(3) == "bitcast"}

    def resolve(arg):
        arg = arg.strip().lstrip("%")
        base, _, index = arg.partition("#")
        seen = 0
        while base in source and seen < 16:  # a chain of bitcasts
            base, seen = source[base].partition("#")[0], seen + 1
        return "%" + base + (f"#{index}" if index and not seen else "")

    out = {}
    for name, (m, line) in lines.items():
        _, ty, opcode, args = m.groups()
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if target:
            opcode = target.group(1)
        dims = re.search(r'"lhs_contracting_dimensions":\["(\d+)"\].*?"rhs_contracting_dimensions":\["(\d+)"\]', line)
        args = ", ".join(resolve(a) for a in args.split(",") if a.strip())
        desc = re.sub(r"\{[\d,]*\}", "", f"{ty} = {opcode}({args})").replace(", s8[33554432]", "")
        if dims:
            desc += f" c({dims.group(1)},{dims.group(2)})"
        out[name] = desc if len(desc) <= 120 else desc[:117] + "..."
    return out


def print_ops(events, steps: int, top: int, ops: dict[str, str]) -> None:
    print(f"   top {top} XLA operations (us and kernels a step, the op's longest kernel, its HLO):")
    for op, launches, us, kernel in op_table(events, steps)[:top]:
        print(f"   {us:9.1f} us  {launches:5.1f}x  {op:24s} {kernel[:40]:40s} {ops.get(op, '')}")


def profile_events(launch, steps: int, read_events, wait_each: bool = True):
    """The GPU events (name, start ns, duration ns) of ``steps`` calls of ``launch`` (which
    dispatches a step and returns its outputs) under the JAX profiler, read from its trace
    by ``read_events(trace_dir)``: each step waited for before the next (``wait_each``), or
    all dispatched back to back and waited for once."""
    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            pending = []
            for _ in range(steps):
                out = launch()
                if wait_each:
                    jax.block_until_ready(out)
                else:
                    pending.append(out)
            jax.block_until_ready(pending)
        return read_events(trace_dir)


def round_tables(rounds, steps: int):
    """Per-step figures over profiled rounds (each a list of GPU events of ``steps`` steps):
    (kernel rows and kind rows over all rounds, kernel us, span us averaged over the rounds
    (each round's own span: the gaps between rounds are not the step's), [{kind: us} of
    each round])."""
    events = [e for r in rounds for e in r]
    rows, busy, _ = _kernels.kernel_table(events, steps * len(rounds))
    kinds = kind_table(events, steps * len(rounds))
    span = sum(_kernels.kernel_table(r, steps)[2] for r in rounds) / len(rounds)
    per_round = [{kind: us for kind, _, us in kind_table(r, steps)} for r in rounds]
    return rows, kinds, busy, span, per_round


def print_variant(name, rounds, steps: int, top: int) -> None:
    rows, kinds, busy, span, per_round = round_tables(rounds, steps)
    print(f"## {name}: kernels {busy / 1e3:.2f} ms, span {span / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms "
          f"a step")
    for kind, launches, us in kinds:
        each = " ".join(f"{r.get(kind, 0.0) / 1e3:.2f}" for r in per_round) if len(per_round) > 1 else ""
        print(f"   {us / 1e3:8.2f} ms  {100 * us / busy:5.1f} %  {launches:6.0f} launches  {kind}"
              + (f"  (rounds: {each})" if each else ""))
    print(f"   top {top} kernels:")
    for kname, launches, us in rows[:top]:
        print(f"   {us:9.1f} us  {launches:5.1f}x  {kname}")


if __name__ == "__main__":
    sys.exit(main())
