"""The GPU's power draw and SM clock while a benchmark runs, sampled by ``nvidia-smi``.

Sustained work on an H100 / H200 runs at the board's power limit (700 W): the driver then
lowers the clocks until the draw fits, so a kernel that draws more power per cycle runs
at lower clocks, and its neighbours with it. Timings alone do not show that; these
samples do. ``PowerSampler`` runs ``nvidia-smi`` every 100 ms beside the benchmark;
``summarize`` gives a phase's mean power, SM clock and share of samples with the power
cap active. A phase's energy is its mean power times its length.
"""

from __future__ import annotations

import datetime
import os
import subprocess

SAMPLE_MS = 100


def smi_fields() -> str | None:
    """The nvidia-smi query fields (newer drivers call the flags clocks_event_reasons), or
    None where nvidia-smi cannot report them."""
    for prefix in ("clocks_event_reasons", "clocks_throttle_reasons"):
        fields = f"timestamp,power.draw,clocks.sm,{prefix}.sw_power_cap"
        try:
            probe = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                   capture_output=True)
        except FileNotFoundError:
            return None
        if probe.returncode == 0:
            return fields
    return None


def parse_samples(lines: list[str]) -> list[tuple[float, float, float, bool]]:
    """(unix time, W, MHz, power cap active) per sample; nvidia-smi stamps local time.
    Lines that are not samples ([N/A] fields, warnings) are skipped."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((stamp, float(parts[1]), float(parts[2]), parts[3] == "Active"))
        except (ValueError, IndexError):
            continue
    return out


def smi_index(device) -> str | None:
    """nvidia-smi's ``-i`` for a JAX GPU device: its entry in CUDA_VISIBLE_DEVICES where that
    is set (an index or a UUID), else its CUDA ordinal. nvidia-smi numbers GPUs in PCI bus
    order, CUDA fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID: on a host of identical
    GPUs the two agree. None for a device without an ordinal."""
    ordinal = getattr(device, "local_hardware_id", None)
    if ordinal is None:
        return None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        return visible[ordinal] if ordinal < len(visible) else None
    return str(ordinal)


def summarize(samples, t0: float, t1: float, skip: float = 1.0) -> dict | None:
    """Mean power (W), SM clock (MHz) and share of samples with the power cap active over
    the samples in [t0 + skip, t1] (the first ``skip`` seconds, while the clocks settle,
    left out); None without samples there."""
    sel = [x for x in samples if t0 + skip <= x[0] <= t1]
    if not sel:
        return None
    n = len(sel)
    return {"watts": sum(x[1] for x in sel) / n, "mhz": sum(x[2] for x in sel) / n,
            "cap_share": sum(x[3] for x in sel) / n, "samples": n}


class PowerSampler:
    """``with PowerSampler(fields, index) as p: ...`` samples the GPU (all GPUs where
    ``index`` is None) every SAMPLE_MS ms; ``p.samples`` after the block."""

    def __init__(self, fields: str, index: str | None = None):
        self.cmd = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", str(SAMPLE_MS)]
        if index is not None:
            self.cmd += ["-i", index]
        self.samples: list[tuple[float, float, float, bool]] = []

    def __enter__(self):
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        out, _ = self.proc.communicate()
        self.samples = parse_samples(out.splitlines())
        return False
