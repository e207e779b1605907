"""bf16 weights packed losslessly in 13 bits (kernels_hip/ops/matvec_packed.hip, hipengine/gpu/packed.py).

CPU: the packer and the device's decode (mirrored in numpy: byte permutes, nibble spreads, sign shifts) give back
every weight the window holds, scaled by exactly 2^-D; the weights it cannot hold (zeros, tiny, inf / nan) are
the rows reported, for 32- and 64-lane warps; the unit bitmaps follow the ops' unit shapes.
GPU (marker gpu): the packed per-op kernels give the bf16 kernels' outputs bit for bit, escapes included, and the
monokernel with packed MLP weights the same greedy tokens as without.
"""
import numpy as np
import pytest

from hipengine.errors import UnsupportedError
from hipengine.gpu import packed as P
from hipengine.gpu.ops import to_bf16

RNG = np.random.default_rng(11)


def _matrix(rows, inn, scale=0.02, escapes=True):
    w = (RNG.uniform(-1.7, 1.7, (rows, inn)) * scale).astype(np.float32)
    if escapes:
        w[1, 5] = 0.0            # zero: exponent 0
        w[2, 7] = 1e-30          # far below the window
        w[3, inn - 1] = -0.0     # negative zero
        w[4, 100] = np.inf       # inf: exponent 255
        w[5, 3] = 3.0 * scale * 1.7 * 2 ** -33  # just below the window (31 binades under the largest)
    return to_bf16(w)


def _window(bits, d):
    e = ((bits >> 7) & 0xFF).astype(np.int64)
    ep = e - d
    return (ep >= P.E_LO) & (ep <= P.E_HI) & (e != 255)


@pytest.mark.parametrize("warp", [32, 64])
def test_round_trip_holds_every_weight_in_the_window(warp):
    bits = _matrix(9, 2 * P.batch_cols(warp))
    d = P.offset_for(bits)
    pk = P.pack(bits, d, warp)
    assert pk.data.shape == (9, P.row_bytes(bits.shape[1])) and pk.data.dtype == np.uint8
    back = P.unpack(pk.data, bits.shape[1], warp)
    win = _window(bits, d)
    assert np.array_equal(back[win], P.scaled(bits, d)[win])
    assert pk.row_esc.tolist() == [not win[r].all() for r in range(9)]
    assert pk.row_esc[1:6].all() and not pk.row_esc[0] and not pk.row_esc[6:].any()
    # the scaled weights are the weights times 2^-D exactly (as float64 values)
    f = lambda b: (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)  # noqa: E731
    assert np.array_equal(f(back[win]) * 2.0 ** d, f(bits[win]))


def test_offset_maps_the_largest_binade_to_95_and_is_never_negative():
    bits = _matrix(4, 1024, escapes=False)
    e_max = int(((bits >> 7) & 0xFF).max())
    assert P.offset_for(bits) == e_max - 95
    inf = bits.copy()
    inf[0, 0] = 0x7F80  # inf does not set the window
    assert P.offset_for(inf) == e_max - 95
    tiny = to_bf16(np.full((2, 1024), 1e-20, np.float32))
    assert P.offset_for(tiny) == 0  # E_max < 95: D = 0, the staged input is never scaled down
    assert P.offset_for(bits, tiny) == e_max - 95  # a group: the larger binade


def test_the_staged_input_scales_exactly():
    # subnormals, zero, and values up to the bound |x| < 2^(128 - D) (ops/matvec_packed.hip's header)
    x = np.concatenate([RNG.standard_normal(1000).astype(np.float32), np.float32([1e-40, -3e-39, 1e25, 0.0])])
    for d in (0, 25, 40):
        y = (x * np.float32(2.0 ** d)).astype(np.float32)
        assert np.isfinite(y).all()
        assert np.array_equal((y * np.float32(2.0 ** -d)).astype(np.float32), x)


def test_unit_bitmaps():
    esc = np.zeros(70, bool)
    esc[[0, 33, 69]] = True
    words = P.unit_bitmap(esc)
    assert words.dtype == np.uint32 and words.tolist() == [1, 2, 1 << 5]
    assert P.plain_units(np.array([0, 0, 1, 0, 0], bool)).tolist() == [False, True, False]  # odd: last alone
    assert P.plain_units(np.array([0, 0, 0, 0, 0, 1], bool)).tolist() == [False, False, True]
    assert P.gate_up_units(np.array([1, 0, 0], bool), np.array([0, 0, 1], bool)).tolist() == [True, False, True]


def test_shapes_it_cannot_pack_are_one_clear_error():
    with pytest.raises(UnsupportedError, match="multiple of 1024"):
        P.check_shape(576, 32)
    with pytest.raises(UnsupportedError, match="multiple of 2048"):
        P.check_shape(1024, 64)
    P.check_shape(2048, 64)


def test_switch_and_build_define(monkeypatch):
    from hipengine.gpu import monokernel as M

    monkeypatch.delenv("HIPENGINE_MK_PACKED", raising=False)
    assert not M.mlp_packed_on()
    assert "MK_MLP_PACKED" not in M.compile_args("nvidia", False, 4)["defines"]
    assert M.compile_args("nvidia", False, 4, mlp_packed=True)["defines"]["MK_MLP_PACKED"] == 1
    assert "MK_MLP_PACKED" not in M.compile_args("nvidia", False, 4, tp=True, mlp_packed=True)["defines"]
    monkeypatch.setenv("HIPENGINE_MK_PACKED", "1")
    assert M.mlp_packed_on()


def test_packed_wanted_says_why_not(monkeypatch):
    from types import SimpleNamespace

    from hipengine.gpu import monokernel as M

    fake = SimpleNamespace(config=SimpleNamespace(hidden_size=2048, intermediate_size=8192), mk_tp=False,
                           fused_mlp=False, w_f16=False, rt=SimpleNamespace(warp_size=32))
    monkeypatch.delenv("HIPENGINE_MK_PACKED", raising=False)
    assert M.MonokernelBackend._packed_wanted(fake) is False
    monkeypatch.setenv("HIPENGINE_MK_PACKED", "1")
    assert M.MonokernelBackend._packed_wanted(fake) is True
    fake.w_f16 = True
    with pytest.raises(UnsupportedError, match="fp16"):
        M.MonokernelBackend._packed_wanted(fake)
    fake.w_f16, fake.config.hidden_size = False, 576
    with pytest.raises(UnsupportedError, match="multiple of 1024"):
        M.MonokernelBackend._packed_wanted(fake)


# ---- GPU ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu():
    from hipengine.gpu import ops as O
    from hipengine.gpu.runtime import get_runtime

    rt = get_runtime(0)
    return rt, O.Ops(rt)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,mult,norm,res", [(301, 2, True, False), (64, 1, False, True), (2048, 8, False, True)])
def test_gpu_packed_matvec_is_the_bf16_matvec_bit_for_bit(gpu, rows, mult, norm, res):
    rt, ops = gpu
    inn = mult * P.batch_cols(rt.warp_size)
    bits = _matrix(rows, inn)
    d = P.offset_for(bits)
    pk = P.pack(bits, d, rt.warp_size)
    W, Wp, esc = rt.upload(bits), rt.upload(pk.data.reshape(-1)), rt.upload(P.unit_bitmap(P.plain_units(pk.row_esc)))
    x = (RNG.standard_normal(inn) * 3).astype(np.float32)
    x[7] = 1e-39  # a subnormal input element
    X = rt.upload(x)
    G = rt.upload((1 + 0.2 * RNG.standard_normal(inn)).astype(np.float32)) if norm else None
    R = rt.upload(RNG.standard_normal(rows).astype(np.float32)) if res else None
    y0, y1 = rt.upload(np.full(rows, np.nan, np.float32)), rt.upload(np.full(rows, np.nan, np.float32))
    ops.matvec(W, X, y0, rows, inn, gamma=G, eps=1e-5, residual=R, rows1=False)
    ops.matvec_packed(Wp, esc, W, d, X, y1, rows, inn, gamma=G, eps=1e-5, residual=R)
    rt.synchronize()
    a, b = rt.download(y0, (rows,), np.float32), rt.download(y1, (rows,), np.float32)
    fin = np.isfinite(a)
    assert np.array_equal(a.view(np.uint32)[fin], b.view(np.uint32)[fin])
    assert np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a[~fin & ~np.isnan(a)], b[~fin & ~np.isnan(a)])


@pytest.mark.gpu
def test_gpu_packed_gate_up_is_the_bf16_gate_up_bit_for_bit(gpu):
    rt, ops = gpu
    rows, inn = 1000, 2 * P.batch_cols(rt.warp_size)
    g, u = _matrix(rows, inn, 0.03), _matrix(rows, inn, 0.01, escapes=False)
    u[600, 9] = 0  # an escape in the up rows only
    d = P.offset_for(g, u)
    pg, pu = P.pack(g, d, rt.warp_size), P.pack(u, d, rt.warp_size)
    esc = P.unit_bitmap(P.gate_up_units(pg.row_esc, pu.row_esc))
    Wg, Wu = rt.upload(g), rt.upload(u)
    x = RNG.standard_normal(inn).astype(np.float32)
    X, G = rt.upload(x), rt.upload((1 + 0.1 * RNG.standard_normal(inn)).astype(np.float32))
    y0, y1 = rt.upload(np.full(rows, np.nan, np.float32)), rt.upload(np.full(rows, np.nan, np.float32))
    ops.matvec_gate_up(Wg, Wu, X, y0, rows, inn, gamma=G, eps=1e-5)
    ops.matvec_gate_up_packed(rt.upload(pg.data.reshape(-1)), rt.upload(pu.data.reshape(-1)), rt.upload(esc), Wg, Wu,
                              d, X, y1, rows, inn, gamma=G, eps=1e-5)
    rt.synchronize()
    a, b = rt.download(y0, (rows,), np.float32), rt.download(y1, (rows,), np.float32)
    fin = np.isfinite(a)  # row 4 of the gate holds an inf
    assert fin.sum() >= rows - 1 and np.array_equal(a.view(np.uint32)[fin], b.view(np.uint32)[fin])
    assert np.array_equal(np.isnan(a), np.isnan(b))


@pytest.mark.gpu
def test_gpu_monokernel_packed_gives_the_same_tokens(monkeypatch):
    from hipengine.backend import SamplingParams
    from hipengine.gpu.monokernel import MonokernelBackend
    from hipengine.loader import LoadedModel
    from hipengine.presets import PRESETS, LazyWeights

    cfg = PRESETS["llama-3.2-1b"].replace(num_layers=3, vocab_size=8192, max_position_embeddings=512)
    model = LoadedModel(config=cfg, weights=LazyWeights(cfg, 4), path=None, source="preset")
    prompt = np.array([1, 5, 9, 200, 31, 7], np.int64)
    runs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("HIPENGINE_MK_PACKED", on)
        be = MonokernelBackend(model, max_context=512)
        try:
            assert be.mlp_packed == (on == "1")
            runs[on] = list(be.generate_ids(prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)))
            runs[on + "s"] = list(be.generate_ids(prompt, SamplingParams(max_tokens=16, temperature=0.8, seed=5,
                                                                         ignore_eos=True)))
        finally:
            be.close()
    assert runs["1"] == runs["0"]
    assert runs["1s"] == runs["0s"]
