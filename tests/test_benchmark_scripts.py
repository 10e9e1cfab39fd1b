"""CPU checks of the GPU benchmark scripts' host-side helpers (their GPU paths run on the device machine)."""

import importlib.util
import pathlib

# loaded from its file, as tests/test_benchmark_harness.py loads the harness: benchmarks/ is not an
# installed package
_spec = importlib.util.spec_from_file_location(
    "rlx_benchmarks_attention_power",
    pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "attention_power.py")
_power = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_power)


def test_power_samples_parse_and_skip_bad_lines():
    lines = [
        "2026/11/27 23:40:01.100, 698.20, 1612, Active",
        "[N/A], [N/A], [N/A], [N/A]",
        "2026/11/27 23:40:01.200, 690.00, 1600, Not Active",
    ]
    samples = _power._parse(lines)
    assert [s[1:] for s in samples] == [(698.2, 1612.0, True), (690.0, 1600.0, False)]
    assert abs((samples[1][0] - samples[0][0]) - 0.1) < 1e-6  # timestamps parsed to seconds
