"""The stage profile's per-layer tables by block role (hipengine/bench/decode.py layer_marks, printed by `bench decode
--profile` and scripts/profile_table.py; no GPU): from a committed profile they are the ones docs/perf-log.md quotes
for it (session 53's 1K critical path), the block roles are found from the data, and a file the script cannot use
is one error line."""
import json
from pathlib import Path

import pytest

from hipengine.bench import decode
from hipengine.errors import HipEngineError

S53 = Path(__file__).resolve().parents[1] / "benchmarks/results/monokernel_profile_1k_h100_s53_default.json"


@pytest.fixture(scope="module")
def tool(script_module):
    return script_module("profile_table")


def test_session_53_critical_path(tool):
    doc, res = tool.load(str(S53), None)
    blocks = res["stage_profile"]["blocks"]
    groups = decode.block_roles(blocks)
    assert [(lo, hi) for lo, hi, _ in groups] == [(0, 59), (60, 67), (68, 131)]
    assert [role for *_, role in groups] == ["QKV long", "QKV short", "QKV short + split"]
    rows = decode.layer_marks(blocks, groups, tool.layers_of(doc, None))
    # perf-log session 53: blocks 0-59 QKV done 4.67, group counter seen 7.90, O work 10.62, O exit 13.74;
    # the splits' first q poll 1.86, q complete 1.96, tiles 3.12, merge 3.30, split done 3.63 (µs per layer)
    long_, split = rows[0], rows[2]
    assert [round(long_[k], 2) for k in ("qkv", "o_work")] == [4.67, 10.62]
    assert abs(long_["attn_left"] - 7.90) < 0.02 and abs(long_["window"] - 13.74) < 0.02
    assert [round(split["split"][k], 2) for k, _ in decode.SPLIT_MARKS] == [1.86, 1.96, 3.12, 3.30, 3.63]
    assert long_["layer"] == pytest.approx(long_["window"] + long_["gate_up"] + long_["down"])
    text = tool.render(S53.name, doc, res, rows, 16)
    assert "a46cd4a" in text and "68-131" in text and "split done" in text
    # bench decode --profile's own text ends with the same table
    cli = decode.profile_table(res["stage_profile"], 16)
    assert decode.role_table(rows) in cli and "QKV short + split" in cli


def test_given_groups_and_errors(tool, tmp_path):
    doc, res = tool.load(str(S53), 1024)
    nb = len(res["stage_profile"]["blocks"]["total_us"]["qkv"])
    assert tool.parse_groups("0-59,60-131", nb) == [(0, 59, "given"), (60, 131, "given")]
    with pytest.raises(HipEngineError, match="outside"):
        tool.parse_groups("0-200", nb)
    with pytest.raises(HipEngineError, match="block range"):
        tool.parse_groups("a-b", nb)
    with pytest.raises(HipEngineError, match="at context 8192"):
        tool.load(str(S53), 8192)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(HipEngineError, match="cannot read"):
        tool.load(str(bad), None)
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"model": "nope", "results": [{"context": 1024, "tok_s": 1.0}]}))
    with pytest.raises(HipEngineError, match="per-block stage profile"):
        tool.load(str(plain), None)
    with pytest.raises(HipEngineError, match="give --layers"):
        tool.layers_of({"model": "nope"}, None)
    assert tool.layers_of({"model": "nope"}, 7) == 7
    with pytest.raises(HipEngineError, match="--layers 0"):
        tool.layers_of({"model": "llama-3.2-1b"}, 0)
