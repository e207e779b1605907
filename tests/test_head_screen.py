"""The screened greedy LM head (kernels_hip/ops/head_screen.hip, hipengine/gpu/head_screen.py).

CPU: the host tables and the device's bound, emulated in numpy, hold on rows and inputs built to stress them
(heavy-tailed rows, outliers in x, x = 0, fp16 rows, vocabularies that are not multiples of 4): every logit
lies inside its interval, whatever the fp32 summation order, and the arg-max is always a candidate.
GPU (marker gpu): the kernels' intervals contain the per-op LM head's own logits, and the exact pick returns
their arg-max; the monokernel with the screen gives the same greedy tokens as without it.
"""
import math

import numpy as np
import pytest

from hipengine.errors import UnsupportedError
from hipengine.gpu import head_screen as H
from hipengine.gpu.ops import bits_to_f64, to_bf16

RNG = np.random.default_rng(7)


def _rows(vocab, d, f16=False, gain=0.5):
    w = RNG.standard_normal((vocab, d)) / math.sqrt(d) * np.exp(gain * RNG.standard_normal((vocab, 1)))
    w[3] *= 40.0  # one row far larger than the rest
    w[5, 11] = 0.9  # one outlier weight (its row's scale is set by it)
    w[vocab - 1] = 0.0  # an all-zero row: scale 0
    bits = np.ascontiguousarray(w, np.float16).view(np.uint16) if f16 else to_bf16(w.astype(np.float32))
    return bits, bits_to_f64(bits, f16)


def _inputs(d):
    yield RNG.standard_normal(d).astype(np.float32)
    yield (RNG.standard_normal(d) * 20).astype(np.float32)
    x = RNG.standard_normal(d).astype(np.float32)
    x[17] = 400.0  # an outlier sets s_x: the int16 copy of the rest is coarse
    yield x
    yield np.zeros(d, np.float32)
    yield (RNG.standard_normal(d) * 1e-3).astype(np.float32)


@pytest.mark.parametrize("vocab,d,f16", [(1001, 256, False), (998, 576, True), (4099, 2048, False)])
def test_bound_holds_and_argmax_is_a_candidate(vocab, d, f16):
    bits, w = _rows(vocab, d, f16)
    t = H.screen_tables(bits=bits, f16=f16)
    assert t.q.shape == ((vocab + 3) // 4 * 4, d) and t.meta.shape == ((vocab + 3) // 4, 8)
    assert not t.q[vocab:].any()
    for x in _inputs(d):
        lo, hi = H.screen_bounds(t, x)
        exact = w @ x.astype(np.float64)
        assert np.all(lo <= exact) and np.all(exact <= hi)
        # any fp32 order of the bf16 head's sum (here: BLAS's, and a sequential one) stays inside as well
        f32 = w.astype(np.float32) @ x
        seq = np.zeros(vocab, np.float32)
        for j in range(0, d, 8):
            seq += w[:, j:j + 8].astype(np.float32) @ x[j:j + 8]
        for logits in (f32, seq):
            assert np.all(lo <= logits) and np.all(logits <= hi)
            assert int(np.argmax(logits)) in H.candidates(t, x)


def test_rows_from_values_equal_rows_from_bits():
    bits, w = _rows(203, 64)
    a = H.screen_tables(bits=bits)
    b = H.screen_tables(w.astype(np.float32))
    assert np.array_equal(a.q, b.q) and np.array_equal(a.meta, b.meta) and a.c2 == b.c2


def test_few_candidates_on_a_peaked_head():
    """What makes the screen pay: with logits of a few units of spread, only a handful of rows survive."""
    vocab, d = 20000, 1024
    w = (RNG.standard_normal((vocab, d)) * 8 / math.sqrt(d)).astype(np.float32)
    t = H.screen_tables(bits=to_bf16(w))
    counts = [len(H.candidates(t, RNG.standard_normal(d).astype(np.float32))) for _ in range(8)]
    assert max(counts) <= 32, counts


def test_shapes_it_cannot_bound_are_one_clear_error():
    with pytest.raises(UnsupportedError, match="multiple of 16"):
        H.check_shape(100, 72)
    with pytest.raises(UnsupportedError, match="at most"):
        H.check_shape(100, 16384)
    w = np.ones((8, 32), np.float32)
    w[2, 3] = np.inf
    with pytest.raises(UnsupportedError, match="non-finite"):
        H.screen_tables(w)


def test_shared_memory_covers_every_warps_slots():
    # llama-3.2-1b on 132 SMs, 8 warps of 32: 32,064 units over 1,056 warps -> 31 units of 4 slots per warp
    assert H.smem_bytes(2048, 128256, 132, 8) == 4 * (2048 + 1024 + 8 * 4 * 31)


# ---- GPU ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu():
    from hipengine.gpu import ops as O
    from hipengine.gpu.runtime import get_runtime

    rt = get_runtime(0)
    return rt, O.Ops(rt)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,d,f16", [(4099, 2048, False), (998, 576, True), (50001, 1024, False)])
def test_gpu_bounds_contain_the_heads_logits_and_the_pick_is_its_argmax(gpu, vocab, d, f16):
    rt, ops = gpu
    bits, _ = _rows(vocab, d, f16, gain=0.2)
    t = H.screen_tables(bits=bits, f16=f16)
    W, Wq, meta = rt.upload(bits), rt.upload(t.q.view(np.uint8)), rt.upload(t.meta)
    g = (1 + 0.2 * RNG.standard_normal(d)).astype(np.float32)
    G = rt.upload(g)
    grid = rt.num_sms
    for x in list(_inputs(d))[:3]:
        X = rt.upload((x * 3).astype(np.float32))
        logits = rt.upload(np.full(vocab, np.nan, np.float32))
        ops.matvec(W, X, logits, vocab, d, gamma=G, eps=1e-5, f16=f16, role="lm_head")
        lo, hi = rt.upload(np.full(vocab, np.nan, np.float32)), rt.upload(np.full(vocab, np.nan, np.float32))
        blo, slo = rt.upload(np.zeros(grid, np.float32)), rt.upload(np.zeros(grid, np.float32))
        out = rt.upload(np.zeros(2 * grid, np.float32))
        ops.head_screen(Wq, meta, t.c2, X, G, 1e-5, d, vocab, lo, hi, blo, grid, W=W, f16=f16, out=out,
                        scratch_lo=slo)
        rt.synchronize()
        L = rt.download(logits, (vocab,), np.float32)
        a, b = rt.download(lo, (vocab,), np.float32), rt.download(hi, (vocab,), np.float32)
        assert np.all(a <= L) and np.all(L <= b), f"{int(np.sum((a > L) | (L > b)))} rows outside their bound"
        o = rt.download(out, (2 * grid,), np.float32)
        vals, idx = o[0::2], o[1::2].view(np.uint32).astype(np.int64)
        k = int(np.argmax(vals))  # blocks hold disjoint rows; ties between blocks -> the smaller row
        best = vals[k]
        row = int(min(idx[vals == best]))
        assert row == int(np.argmax(L)) and best == L[row]  # the bf16 head's own value, bit for bit


@pytest.mark.gpu
def test_gpu_monokernel_screen_gives_the_same_tokens(monkeypatch):
    from hipengine.backend import SamplingParams
    from hipengine.gpu.monokernel import MonokernelBackend
    from hipengine.presets import preset_model

    model = preset_model("tiny-llama3", 3)
    prompt = np.array([1, 5, 9, 200, 31, 7], np.int64)
    runs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("HIPENGINE_MK_HEAD_SCREEN", on)
        be = MonokernelBackend(model, max_context=256)
        try:
            assert be.head_screen == (on == "1")
            runs[on] = list(be.generate_ids(prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)))
            runs[on + "s"] = list(be.generate_ids(prompt, SamplingParams(max_tokens=16, temperature=0.8, seed=5,
                                                                         ignore_eos=True)))
        finally:
            be.close()
    assert runs["1"] == runs["0"]
    assert runs["1s"] == runs["0s"]  # sampling keeps the bf16 head: same draws


def test_switch_and_build_define(monkeypatch):
    from hipengine.gpu import monokernel as M

    monkeypatch.delenv("HIPENGINE_MK_HEAD_SCREEN", raising=False)
    assert M.head_screen_on()  # the default
    assert "MK_HEAD_SCREEN" not in M.compile_args("nvidia", False, 4)["defines"]
    monkeypatch.setenv("HIPENGINE_MK_HEAD_SCREEN", "0")
    assert not M.head_screen_on()
    assert M.compile_args("nvidia", False, 4, head_screen=True)["defines"]["MK_HEAD_SCREEN"] == 1
    # the tensor-parallel (LL exchange) builds keep the bf16 head
    assert "MK_HEAD_SCREEN" not in M.compile_args("nvidia", False, 4, tp=True, head_screen=True)["defines"]
    monkeypatch.setenv("HIPENGINE_MK_HEAD_SCREEN", "yes")
    with pytest.raises(UnsupportedError, match="0 or 1"):
        M.head_screen_on()


def test_unsupported_shape_keeps_the_bf16_head_unless_asked(monkeypatch):
    from types import SimpleNamespace

    from hipengine.gpu import monokernel as M

    fake = SimpleNamespace(config=SimpleNamespace(vocab_size=1000, hidden_size=72), mk_tp=False)
    monkeypatch.delenv("HIPENGINE_MK_HEAD_SCREEN", raising=False)
    assert M.MonokernelBackend._screen_wanted(fake) is False
    monkeypatch.setenv("HIPENGINE_MK_HEAD_SCREEN", "1")
    with pytest.raises(UnsupportedError, match="multiple of 16"):
        M.MonokernelBackend._screen_wanted(fake)
    fake.config.hidden_size = 64
    assert M.MonokernelBackend._screen_wanted(fake) is True
