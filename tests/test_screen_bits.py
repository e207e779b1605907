"""scripts/screen_bits.py's quantiser (no GPU, no model): the rows it would stream are within half a step of the
weights, per row or per column group, so the bounds it prints are the screen's bounds for that format."""
import numpy as np
import pytest


@pytest.fixture(scope="module")
def tool(script_module):
    return script_module("screen_bits")


@pytest.mark.parametrize("levels,group", [(127, None), (7, None), (7, 16), (31, 32)])
def test_quantised_within_half_a_step(tool, levels, group):
    rng = np.random.default_rng(0)
    w = rng.standard_t(3, size=(37, 64)).astype(np.float32)
    w[5] = 0.0  # an all-zero row stays zero (no division by a zero scale)
    wq = tool.quantised(w, levels, group)
    g = w.reshape(37, 1 if group is None else 64 // group, -1)
    step = (np.abs(g).max(2, keepdims=True) / levels)
    err = np.abs(w - wq).reshape(g.shape)
    assert np.all(err <= step / 2 * (1 + 1e-5) + 1e-7)
    assert np.all(wq[5] == 0)
    # at most 2 * levels + 1 distinct values per scale group
    for r in range(37):
        for c in range(g.shape[1]):
            assert len(np.unique(wq.reshape(g.shape)[r, c])) <= 2 * levels + 1
