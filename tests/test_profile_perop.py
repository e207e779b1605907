"""scripts/profile_perop.py's analysis (no GPU): kernels labelled by their place in the decode step, each
charged its increment over the previous kernel's end, whole steps only."""
import pytest


@pytest.fixture(scope="module")
def prof(script_module):
    return script_module("profile_perop")


LAYER = ["matvec_qkv", "attention_split_g4", "attention_combine", "matvec", "matvec_gate_up", "matvec_rows1"]
TAIL = ["matvec", "argmax_blocks", "argmax_pick", "decode_advance", "emit_token"]


def test_labels(prof):
    names = ["embedding"] + LAYER + ["matvec_qkv", "attention_decode_g4", "matvec", "matvec_gate_up", "matvec"] + TAIL
    roles = prof.label(names)
    assert roles[:7] == ["embedding", "qkv", "attn", "combine", "o", "gate_up", "down"]
    assert roles[7:12] == ["qkv", "attn", "o", "gate_up", "down"]  # the one-kernel attention, two-row down
    assert roles[12:] == ["lm_head", "argmax_blocks", "argmax_pick", "decode_advance", "emit_token"]


def test_increments_add_up_to_the_step(prof):
    names, events, t = [], [], 0.0
    for _ in range(5):  # 5 steps of 2 layers; every kernel ends 2 us after the one before, starts 1 us early
        for n in ["embedding"] + LAYER * 2 + TAIL:
            names.append(n)
            events.append({"name": n, "start": t - 1.0, "end": t + 2.0})
            t += 2.0
    res = prof.analyse(events, 2)
    per_step = len(names) // 5
    assert res["steps"] == 3 and res["step_us_median"] == pytest.approx(2.0 * per_step)
    assert res["roles"]["qkv"]["count_per_step"] == 2 and res["roles"]["lm_head"]["count_per_step"] == 1
    assert sum(r["inc_total_per_step_us"] for r in res["roles"].values()) == pytest.approx(res["step_us_median"])
    assert res["roles"]["down"]["start_minus_prev_end_us"] == pytest.approx(-1.0)
    assert [e[1] for e in res["sample_step"]][:2] == ["embedding", "qkv"]


def test_too_few_steps_is_an_error(prof):
    with pytest.raises(RuntimeError, match="decode steps"):
        prof.analyse([{"name": "embedding", "start": 0.0, "end": 1.0}], 1)
