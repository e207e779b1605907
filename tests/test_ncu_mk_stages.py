"""scripts/ncu_mk_stages.py's statement-to-stage naming (no GPU, no NVRTC): every matvec stage, weight fill
and grid wait of monokernel_decode in the current decode.hip gets its name, so a profile cannot silently lump
a stage into "other" after the kernel is edited."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool(script_module):
    return script_module("ncu_mk_stages")


def test_every_stage_statement_is_named(tool):
    src = (ROOT / "kernels_hip" / "monokernel" / "decode.hip").read_text().splitlines()
    start = next(i + 1 for i, s in enumerate(src) if "monokernel_decode(" in s and "__global__" in s)
    names = {tool.stage_of("decode.hip", n, src, start) for n in range(start, len(src) + 1)
             if any(k in src[n - 1] for k in ("he_mv_finish<", "he_mv_fill_next(", "barrier(kProf", "wait(kProf",
                                               "mk_attention(", "mk_attention<", "he_block_wait_geq("))}
    want = {"qkv", "o_proj", "gate_up", "down", "lm_head", "fill_qkv", "fill_o", "fill_gate_up", "fill_down",
            "fill_lm_head", "attention", "wait_attention_count", "wait_qkv", "wait_o", "wait_gate_up", "wait_down",
            "wait_lm_head"}
    assert want <= names and not any(n.startswith("other") for n in names), names
    assert tool.stage_of("attention_decode.hip", 10, src, start) == "attention"
    assert tool.stage_of("decode.hip", 1, src, start) == "prologue"


def test_opcode(tool):
    assert tool.opcode("@!P1 LDG.E.NA.128.CONSTANT R104, desc[UR34][R138.64+0x200] ;") == "LDG"
    assert tool.opcode("  FFMA R138, R5, R152, R138 ;") == "FFMA"
