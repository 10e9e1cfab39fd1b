"""benchmarks/e2e_memory.py: the live-range report's peak, read back with each buffer's
instruction, kind and source line."""

import pathlib
import re
import subprocess
import sys

import pytest
from testutil import load_script

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "e2e_memory.py"
_mem = load_script(_SCRIPT, "_e2e_memory_under_test")

_REPORT = """HloLiveRange (max 5):
  InstructionSequence:
    0:w.1
  BufferLiveRange:
    w.1{}:0-5
  Live ranges at 4 (peak):
    big_fusion{}: 524288 bytes (cumulative: 524288 bytes)
    w.1{}: 262144 bytes (cumulative: 786432 bytes)
    call.3{1}: 1024 bytes (cumulative: 787456 bytes)
  Stack trace breakdown for peak usage: 787 456 bytes
    main.1 (100.0%, total: 787 456 bytes)
"""

_HLO = """HloModule jit_loss, is_scheduled=true

FileNames
1 "/src/model.py"
2 "/site/rlx_jax/vjp_rules/op.py"

FunctionNames
1 "loss"
2 "block"
3 "rule"

FileLocations
1 {file_name_id=1 function_name_id=1 line=40 end_line=40 column=1 end_column=9}
2 {file_name_id=1 function_name_id=2 line=12 end_line=12 column=1 end_column=9}
3 {file_name_id=2 function_name_id=3 line=7 end_line=7 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}

ENTRY %main (w.1: f32[256,256]) -> (f32[256,256], f32[256]) {
  %w.1 = f32[256,256]{1,0} parameter(0), metadata={op_name="w"}
  %big_fusion = f32[512,256]{1,0} fusion(%w.1), kind=kLoop, metadata={op_name="jit(loss)/jvp()/mul" stack_frame_id=3}
  %call.3 = (f32[4]{0}, f32[256]{0}) custom-call(%big_fusion), custom_call_target="k", metadata={op_name="jit(loss)/x" stack_frame_id=2}
  %gte = f32[256]{0} get-tuple-element(%call.3), index=1
  ROOT %tuple = (f32[256,256]{1,0}, f32[256]{0}) tuple(%w.1, %gte)
}
"""


def test_peak_section_and_buffers_are_read_with_their_instructions():
    peak = _mem.parse_live_range(_REPORT)
    assert peak.position == 4 and peak.bytes == 524288 + 262144 + 1024
    assert [(b.name, b.index, b.nbytes) for b in peak.buffers] == [
        ("big_fusion", "", 524288), ("w.1", "", 262144), ("call.3", "1", 1024)]
    peak = _mem.describe(peak, _HLO)
    by = {b.name: b for b in peak.buffers}
    assert by["w.1"].kind == "parameter" and by["big_fusion"].kind == "temp"
    assert by["big_fusion"].opcode == "fusion" and by["big_fusion"].shape.startswith("f32[512,256]")
    # the frame inside rlx_jax is left out: the op's line in the model, then its caller
    assert by["big_fusion"].op_name == "jit(loss)/jvp()/mul  at model.py:12 block < model.py:40 loss"
    assert by["call.3"].op_name == "jit(loss)/x  at model.py:12 block < model.py:40 loss"
    text = _mem.format_peak("v", peak, 600000, top=2)
    assert "compiled temp 0.6 MiB" in text and "schedule position 4" in text and "call.3" not in text
    with pytest.raises(ValueError, match="peak"):
        _mem.parse_live_range("HloLiveRange (max 1):\n")


def test_script_reports_each_variant_peak_with_source_lines():
    out = subprocess.run([sys.executable, str(_SCRIPT), "--preset", "tiny", "--variants", "plain-xla,rlx-lean",
                          "--top", "6"], capture_output=True, text=True, timeout=300, check=True).stdout
    heads = re.findall(r"^## (\S+): compiled temp ([\d.]+) MiB; live at the peak .*?: ([\d.]+) MiB", out, re.M)
    assert [h[0] for h in heads] == ["plain-xla", "rlx-lean"], out
    for _, temp, live in heads:
        assert float(temp) > 0 and float(live) >= float(temp) / 2
    assert "params['embed']" in out or "params['head']" in out
    assert re.search(r"at e2e_step\.py:\d+ ", out), out
