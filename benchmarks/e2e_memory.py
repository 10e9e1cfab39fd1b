"""Where a compiled e2e training step's memory peaks: the buffers live at the peak of XLA's
schedule, largest first, each with the operation that defines it.

Compiles ``benchmarks/e2e_step.py``'s Llama-style step (loss and gradients under ``jit``)
for each variant with XLA's dumps on, reads the compiled module's live-range report (the
buffers alive at the schedule's peak, which XLA writes beside the optimized HLO) and
prints, per variant, the compiled temp memory, the peak's position in the schedule and its
buffers: bytes, what they are (parameter, output, temp), the defining instruction and its
shape, and the JAX operation it came from (the instruction's ``op_name`` and the model's
source line). "output" is a buffer the program returns, followed from the entry's ROOT
through bitcasts and tuples; a loop's accumulator that becomes an output is listed as
temp while the loop runs, so the live temp at a peak inside a loop can exceed the
compiled temp memory a little. The report lists values (XLA's HloValues), not
allocations: where values share one buffer (an output written over an operand's buffer, a
loop's carried state), the listed bytes may count that buffer more than once. Nothing
runs, so it works on any backend, but the schedule is the compiling backend's: a GPU's
peak differs from a CPU's.

    python -m benchmarks.e2e_memory --preset llama-v32k --variants rlx-lean,plain-cudnn --top 25
    python -m benchmarks.e2e_memory --preset cpu --variants plain-xla,rlx

The temp memory is one compile's: on a GPU XLA's autotuner may choose other kernels in
another process, and its schedule and peak with them (``e2e_step.py --processes N`` lists
the temp memory of each process).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.util
import os
import re
import sys
import tempfile


def _load(name: str):
    """A sibling script as a module, by its path (this file also runs without the
    repository root on sys.path)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_e2e_memory_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@dataclasses.dataclass
class Buffer:
    """One buffer live at the peak: ``name{index}`` as the live-range report names it."""

    name: str
    index: str
    nbytes: int
    kind: str = "temp"  # "parameter", "output" or "temp"
    opcode: str = ""
    shape: str = ""
    op_name: str = ""


@dataclasses.dataclass
class Peak:
    position: int
    bytes: int
    buffers: list


_PEAK = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_LIVE = re.compile(r"^\s*([\w.\-]+)\{([\d,]*)\}: (\d+) bytes")


def parse_live_range(text: str) -> Peak:
    """The peak of an XLA live-range report (``*-live-range.txt``): its schedule position
    and the buffers listed under "Live ranges at N (peak):", in the report's order."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _PEAK.match(line)), None)
    if start is None:
        raise ValueError("live-range report without a 'Live ranges at N (peak):' section")
    position = int(_PEAK.match(lines[start]).group(1))
    buffers = []
    for line in lines[start + 1:]:
        m = _LIVE.match(line)
        if not m:
            break
        buffers.append(Buffer(m.group(1), m.group(2), int(m.group(3))))
    return Peak(position, sum(b.nbytes for b in buffers), buffers)


_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\(")


def _section(hlo: str, title: str) -> dict:
    """id -> rest of line of a numbered table in an HLO module's header (FileNames,
    FunctionNames, FileLocations, StackFrames: lines "id value" after the title)."""
    rows, on = {}, False
    for line in hlo.splitlines():
        if line.strip() == title:
            on = True
            continue
        if on:
            m = re.match(r"^(\d+) (.*)$", line)
            if not m:
                break
            rows[int(m.group(1))] = m.group(2)
    return rows


def stack_frames(hlo: str) -> dict:
    """stack_frame_id -> ["file:line function", ...] innermost first, from the module's
    header tables (empty where the module has none), leaving out the frames inside the
    rlx_jax package: the line of the model that called the op is the one to read."""
    files = {k: v.strip('"') for k, v in _section(hlo, "FileNames").items()}
    funcs = {k: v.strip('"') for k, v in _section(hlo, "FunctionNames").items()}
    locs = {}
    for k, v in _section(hlo, "FileLocations").items():
        f = dict(re.findall(r"(\w+)=(\d+)", v))
        path = files.get(int(f.get("file_name_id", 0)), "?")
        if f"{os.sep}rlx_jax{os.sep}" in path:
            continue
        locs[k] = f"{os.path.basename(path)}:{f.get('line', '?')} {funcs.get(int(f.get('function_name_id', 0)), '?')}"
    frames = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in _section(hlo, "StackFrames").items()}
    out = {}
    for k in frames:
        chain, seen, at = [], set(), k
        while at in frames and at not in seen:
            seen.add(at)
            loc = locs.get(int(frames[at].get("file_location_id", 0)))
            if loc:
                chain.append(loc)
            # XLA prints a frame's parent as the parent's id + 1 (1: no parent); the
            # frame ids themselves, as stack_frame_id refers to them, count from 1
            at = int(frames[at].get("parent_frame_id", 1)) - 1
        out[k] = chain
    return out


def instruction_table(hlo: str) -> dict:
    """name -> (shape, opcode, where, is the entry's root) for every instruction of an
    optimized HLO module's text; ``where`` is the instruction's JAX ``op_name``, then its
    two innermost source frames where the module records them."""
    frames = stack_frames(hlo)
    table = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        where = op.group(1).replace("\\'", "'") if op else ""
        frame = re.search(r"stack_frame_id=(\d+)", line)
        if frame and frames.get(int(frame.group(1))):
            where += "  at " + " < ".join(frames[int(frame.group(1))][:2])
        table[m.group(2)] = (m.group(3), m.group(4), where, bool(m.group(1)))
    return table


def _entry_outputs(hlo: str) -> set:
    """The entry computation's instructions whose buffers are the program's outputs: the
    ROOT's operands, followed through the instructions that pass a buffer on unchanged
    (bitcast, get-tuple-element, tuple)."""
    entry = hlo[hlo.find("\nENTRY"):]
    operands, root = {}, None
    for line in entry.splitlines()[1:]:
        m = _INSTR.match(line)
        if not m:
            continue
        args = line[m.end():]
        operands[m.group(2)] = (m.group(4), re.findall(r"%([\w.\-]+)", args[:args.find(")")]))
        if m.group(1):
            root = m.group(2)
    out, todo = set(), [root] if root else []
    while todo:
        name = todo.pop()
        if name in out or name not in operands:
            continue
        out.add(name)
        opcode, args = operands[name]
        if name == root or opcode in ("bitcast", "get-tuple-element", "tuple"):
            todo.extend(args)
    return out


def describe(peak: Peak, hlo: str) -> Peak:
    """``peak`` with each buffer's kind, opcode, shape and op_name from the module's HLO."""
    table = instruction_table(hlo)
    outputs = _entry_outputs(hlo)
    for b in peak.buffers:
        shape, opcode, op_name, root = table.get(b.name, ("", "", "", False))
        b.shape, b.opcode, b.op_name = shape, opcode, op_name
        b.kind = "parameter" if opcode == "parameter" else "output" if root or b.name in outputs else "temp"
    return peak


def dumped_modules(dump_dir: str) -> set:
    """The live-range reports in ``dump_dir`` (one a compiled module)."""
    return set(glob.glob(os.path.join(dump_dir, "*after_optimizations-live-range.txt")))


def module_peak(report: str) -> Peak:
    """The described peak of the module whose live-range report is ``report``."""
    hlo_path = report.replace("-live-range.txt", ".txt")
    with open(report, encoding="utf-8") as f:
        peak = parse_live_range(f.read())
    with open(hlo_path, encoding="utf-8") as f:
        return describe(peak, f.read())


def format_peak(name: str, peak: Peak, temp_bytes: int | None, top: int) -> str:
    mib = 2.0 ** 20
    kinds = {}
    for b in peak.buffers:
        kinds[b.kind] = kinds.get(b.kind, 0) + b.nbytes
    split = ", ".join(f"{k} {v / mib:.1f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
    temp = "n/a" if temp_bytes is None else f"{temp_bytes / mib:.1f} MiB"
    lines = [f"## {name}: compiled temp {temp}; live at the peak (schedule position {peak.position}): "
             f"{peak.bytes / mib:.1f} MiB ({split}), {len(peak.buffers)} buffers",
             "       MiB  kind       buffer                          opcode         shape / JAX operation"]
    for b in sorted(peak.buffers, key=lambda b: -b.nbytes)[:top]:
        where = f"{b.name}{{{b.index}}}"
        lines.append(f"  {b.nbytes / mib:8.1f}  {b.kind:9s}  {where:30s}  {b.opcode:13s}  {b.shape[:60]}")
        if b.op_name:
            lines.append(f"{'':58s}{b.op_name[:110]}")
    return "\n".join(lines)


def _report(e2e, a, p, dump_dir: str) -> None:
    """Compiles each of ``a.variants`` with XLA's dumps going to ``dump_dir`` and prints its peak."""
    # before jax starts: XLA reads its flags once
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=jit_loss").strip()

    import jax
    import numpy as np

    platform = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"
    by_name = {v.name: v for v in e2e.variants(platform)}
    wanted = a.variants.split(",")
    unknown = [w for w in wanted if w not in by_name]
    if unknown:
        p.error(f"--variants: unknown {unknown}; on this platform choose from {sorted(by_name)}")
    s = e2e.Shape(**e2e.PRESETS[a.preset])
    params = e2e.init_params(s, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    tokens = jax.numpy.asarray(rng.integers(0, s.vocab, size=(s.batch, s.seq)), jax.numpy.int32)
    labels = jax.numpy.asarray(rng.integers(0, s.vocab, size=s.tokens), jax.numpy.int32)
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}; preset {a.preset} ({s}); buffers live at the "
          f"peak of each compiled step's schedule (XLA's live-range report), MiB")
    for name in wanted:
        before = dumped_modules(dump_dir)
        compiled = jax.jit(jax.value_and_grad(e2e.make_loss(s, by_name[name]))).lower(params, tokens, labels).compile()
        new = sorted(dumped_modules(dump_dir) - before)
        if len(new) != 1:
            raise SystemExit(f"{name}: expected one new live-range report in {dump_dir}, found {len(new)} (XLA "
                             "reads its dump flags when jax starts: run this script as a process of its own)")
        temp = e2e._temp_bytes(compiled)
        print(format_peak(name, module_peak(new[0]), temp, a.top), flush=True)


def main(argv=None) -> int:
    e2e = _load("e2e_step")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(e2e.PRESETS), default="llama-v32k")
    p.add_argument("--variants", default="plain-cudnn,rlx-lean", help="comma-separated e2e_step variant names")
    p.add_argument("--top", type=int, default=25, help="buffers listed per variant")
    a = p.parse_args(argv)
    if a.top < 1:
        p.error("--top must be >= 1")
    with tempfile.TemporaryDirectory(prefix="rlx-e2e-memory-") as dump_dir:
        _report(e2e, a, p, dump_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
