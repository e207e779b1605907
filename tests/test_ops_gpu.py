"""Every per-op kernel against a float64 numpy oracle: |out - ref| <= atol + rtol*|ref|.

Fresh random inputs each run, shapes that are not multiples of the block/sweep, outputs poisoned with NaN
before launch, and every launch option the wrappers expose (bf16/fp16 weights, fused norm, residual, bias,
RoPE on/off, qk-norm, prefill M, group sizes, splits).
"""
import math

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

RNG = np.random.default_rng()


@pytest.fixture(scope="module")
def gpu():
    from hipengine.gpu import ops as O
    from hipengine.gpu.runtime import get_runtime

    rt = get_runtime(0)
    return rt, O.Ops(rt), O


def poisoned(rt, n, dtype=np.float32):
    a = np.full(n, np.nan, np.float32)
    if dtype == np.uint16:
        a = np.full(n, 0x7FC0, np.uint16)
    return rt.upload(a)


def close(out, ref, rtol, atol):
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), "NaN in output (unwritten element?)"
    err = np.abs(out - ref)
    bad = err > atol + rtol * np.abs(ref)
    assert not bad.any(), f"{bad.sum()} of {bad.size} off; worst {err.max():.3g} (atol {atol:.3g}, rtol {rtol})"


def weights(O, rows, inn, f16, scale=1.0):
    w = (RNG.standard_normal((rows, inn)) * scale / math.sqrt(inn)).astype(np.float32)
    bits = w.astype(np.float16).view(np.uint16) if f16 else O.to_bf16(w)
    return bits, O.bits_to_f64(bits, f16)


@pytest.mark.parametrize("f16", [False, True])
def test_embedding(gpu, f16):
    rt, ops, O = gpu
    vocab, hidden = 97, 200
    bits, ref = weights(O, vocab, hidden, f16, scale=math.sqrt(hidden))
    toks = np.array([0, 96, 5, 200, -1], np.int32)  # last two out of range -> zero rows
    out = poisoned(rt, len(toks) * hidden)
    ops.embedding(rt.upload(bits), rt.upload(toks), len(toks), vocab, hidden, out, f16)
    got = rt.download(out, (len(toks), hidden), np.float32)
    exp = np.stack([ref[t] if 0 <= t < vocab else np.zeros(hidden) for t in toks])
    close(got, exp, 0, 0)


@pytest.mark.parametrize("rows,n", [(1, 7), (3, 1000), (2, 2048)])
def test_rmsnorm(gpu, rows, n):
    rt, ops, O = gpu
    x = RNG.standard_normal((rows, n)).astype(np.float32) * 3
    g = (1 + 0.3 * RNG.standard_normal(n)).astype(np.float32)
    y = poisoned(rt, rows * n)
    ops.rmsnorm(rt.upload(x), rt.upload(g), 1e-5, n, y, rows=rows)
    close(rt.download(y, (rows, n), np.float32), O.ref_rmsnorm(x, g, 1e-5), 1e-5, 1e-5)


MATVEC_SHAPES = [(1, 8), (7, 264), (333, 2056), (2051, 576), (64, 8192)]


@pytest.mark.parametrize("rows,inn", MATVEC_SHAPES)
@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("norm,residual", [(False, False), (True, False), (False, True)])
def test_matvec(gpu, rows, inn, f16, norm, residual):
    rt, ops, O = gpu
    bits, W = weights(O, rows, inn, f16)
    x = RNG.standard_normal(inn).astype(np.float32)
    g = (1 + 0.3 * RNG.standard_normal(inn)).astype(np.float32) if norm else None
    xn = O.ref_rmsnorm(x, g, 1e-5)
    ref = W @ xn
    if residual:
        r = RNG.standard_normal(rows).astype(np.float32)
        y = rt.upload(r)  # in place: y = W x + y
        ref = ref + r
    else:
        y = poisoned(rt, rows)
    ops.matvec(rt.upload(bits), rt.upload(x), y, rows, inn, gamma=rt.upload(g) if norm else None, eps=1e-5,
               residual=y if residual else None, f16=f16)
    scale = np.abs(W) @ np.abs(xn)  # accumulation error bound grows with sum |w x|
    close(rt.download(y, rows, np.float32), ref, 1e-5, 1e-5 * scale.max() + 1e-6)


@pytest.mark.parametrize("rows,inn", [(1, 8), (333, 2056), (2051, 576), (2048, 8192), (5, 12296)])
@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("norm,residual", [(False, False), (True, True)])
def test_matvec_rows1_same_bits(gpu, rows, inn, f16, norm, residual):
    """matvec_rows1 (one row per warp unit, unroll 8) gives matvec's two-row bits: same sums, same order."""
    rt, ops, O = gpu
    bits, W = weights(O, rows, inn, f16)
    x = rt.upload(RNG.standard_normal(inn).astype(np.float32))
    g = rt.upload((1 + 0.3 * RNG.standard_normal(inn)).astype(np.float32)) if norm else None
    r = RNG.standard_normal(rows).astype(np.float32)
    wb, out = rt.upload(bits), {}
    for rows1 in (False, True):
        y = rt.upload(r) if residual else poisoned(rt, rows)
        ops.matvec(wb, x, y, rows, inn, gamma=g, eps=1e-5, residual=y if residual else None, f16=f16, rows1=rows1)
        out[rows1] = rt.download(y, rows, np.float32)
    assert not np.isnan(out[True]).any()
    assert out[True].tobytes() == out[False].tobytes()
    ref = W @ O.ref_rmsnorm(rt.download(x, inn, np.float32), rt.download(g, inn, np.float32) if norm else None,
                            1e-5) + (r if residual else 0)
    close(out[True], ref, 1e-4, 1e-4)


@pytest.mark.parametrize("grid", [1, 3, 1000])
def test_matvec_grid_sizes(gpu, grid):
    """The grid-stride loop is correct whatever grid the caller picks (the monokernel picks its own)."""
    rt, ops, O = gpu
    rows, inn = 517, 1032
    bits, W = weights(O, rows, inn, False)
    x = RNG.standard_normal(inn).astype(np.float32)
    y = poisoned(rt, rows)
    ops.matvec(rt.upload(bits), rt.upload(x), y, rows, inn, grid=grid)
    close(rt.download(y, rows, np.float32), W @ x, 1e-5, 1e-4)


@pytest.mark.parametrize("rows,inn", [(1, 8), (333, 576), (1537, 2048)])
@pytest.mark.parametrize("f16", [False, True])
def test_matvec_gate_up(gpu, rows, inn, f16):
    rt, ops, O = gpu
    bg, Wg = weights(O, rows, inn, f16, scale=2.0)
    bu, Wu = weights(O, rows, inn, f16)
    x = RNG.standard_normal(inn).astype(np.float32)
    g = (1 + 0.3 * RNG.standard_normal(inn)).astype(np.float32)
    xn = O.ref_rmsnorm(x, g, 1e-6)
    ref = O.ref_silu(Wg @ xn) * (Wu @ xn)
    y = poisoned(rt, rows)
    ops.matvec_gate_up(rt.upload(bg), rt.upload(bu), rt.upload(x), y, rows, inn, gamma=rt.upload(g), eps=1e-6,
                       f16=f16)
    close(rt.download(y, rows, np.float32), ref, 1e-4, 1e-5)


FX = 2.0 ** 32  # ops/mlp.hip's fixed point: 32 fraction bits


@pytest.mark.parametrize("d,F", [(2048, 8192), (576, 1536), (64, 96), (256, 40), (2048, 24)])
@pytest.mark.parametrize("f16", [False, True])
def test_mlp_fused(gpu, d, F, f16):
    """The fused MLP (gate/up units that apply their row of down; block sums added in fixed point) against
    float64, added onto an existing addend; and the same bits on a second run."""
    rt, ops, O = gpu
    bg, Wg = weights(O, F, d, f16, scale=2.0)
    bu, Wu = weights(O, F, d, f16)
    bd, Wd = weights(O, d, F, f16)
    x = RNG.standard_normal(d).astype(np.float32)
    g = (1 + 0.3 * RNG.standard_normal(d)).astype(np.float32)
    xn = O.ref_rmsnorm(x, g, 1e-6)
    ref = Wd @ (O.ref_silu(Wg @ xn) * (Wu @ xn))
    start = np.round(RNG.standard_normal(d) * FX).astype(np.int64)  # a pending addend: the kernel adds to it
    outs = []
    for _ in range(2):
        fx = rt.upload(start)
        ops.mlp_fused(rt.upload(bg), rt.upload(bu), rt.upload(np.ascontiguousarray(bd.reshape(d, F).T)),
                      rt.upload(x), fx, d, F, gamma=rt.upload(g), eps=1e-6, f16=f16)
        outs.append(rt.download(fx, d, np.int64))
    np.testing.assert_array_equal(outs[0], outs[1])
    close((outs[0] - start) / FX, ref, 1e-4, 1e-5)


def test_mlp_fused_refuses_wide_rows(gpu):
    rt, ops, O = gpu
    from hipengine.errors import UnsupportedError
    with pytest.raises(UnsupportedError, match="fused MLP"):
        ops.mlp_fused(0, 0, 0, 0, 0, 4096, 1024)


@pytest.mark.parametrize("inn", [2048, 576, 72])
def test_matvec_fixed_point_addend(gpu, inn):
    """x_fx: the LM head's / QKV's prologue normalises x + addend; res_fx: the O-proj adds the addend to its
    residual rows, writes them complete and clears their addend."""
    rt, ops, O = gpu
    rows = 130
    bw, W = weights(O, rows, inn, False)
    x = RNG.standard_normal(inn).astype(np.float32)
    fx = np.round(RNG.standard_normal(inn) * FX).astype(np.int64)
    g = (1 + 0.3 * RNG.standard_normal(inn)).astype(np.float32)
    xe = (x + (fx.astype(np.float32) * np.float32(1 / FX))).astype(np.float32)
    y = poisoned(rt, rows)
    ops.matvec(rt.upload(bw), rt.upload(x), y, rows, inn, gamma=rt.upload(g), eps=1e-6, x_fx=rt.upload(fx))
    close(rt.download(y, rows, np.float32), W @ O.ref_rmsnorm(xe, g, 1e-6), 1e-4, 1e-5)
    # O-proj form: residual x (rows long) plus its addend
    res = RNG.standard_normal(rows).astype(np.float32)
    rfx = np.round(RNG.standard_normal(rows) * FX).astype(np.int64)
    xb, rb = rt.upload(res), rt.upload(rfx)
    ops.matvec(rt.upload(bw), rt.upload(x), xb, rows, inn, residual=xb, res_fx=rb)
    want = W @ x + (res + rfx.astype(np.float32) * np.float32(1 / FX)).astype(np.float32)
    close(rt.download(xb, rows, np.float32), want, 1e-4, 1e-5)
    assert not rt.download(rb, rows, np.int64).any(), "the O-proj form must clear the addend it folded in"


@pytest.mark.parametrize("nkv,G,hd,d", [(8, 4, 64, 2048), (2, 2, 64, 512), (4, 1, 128, 1024)])
@pytest.mark.parametrize("f16", [False, True])
def test_matvec_group_o_and_readers(gpu, nkv, G, hd, d, f16):
    """The O-proj by KV-head group (ops/matvec_group.hip, the monokernel's MK_O_GROUP shares): y_fx = fx(x) +
    every group's fx(Wo[:, g] · att_g) against float64, the same bits on a second run; then its two readers —
    gate/up whose prologue reads y_fx alone, and the down-projection whose residual rows are y_fx's (it writes
    them complete into y and clears y_fx) — against float64 on the value y_fx holds."""
    rt, ops, O = gpu
    if (G * hd // 8) > rt.warp_size:
        pytest.skip("a group's columns need more lanes than this warp has")
    qd, F = nkv * G * hd, 3 * d // 2
    bo, Wo = weights(O, d, qd, f16)
    att = RNG.standard_normal(qd).astype(np.float32)
    x = RNG.standard_normal(d).astype(np.float32)
    outs = []
    for _ in range(2):
        fx = rt.upload(np.zeros(d, np.int64))
        ops.matvec_group_o(rt.upload(bo), rt.upload(att), rt.upload(x), fx, d, qd, nkv, f16=f16)
        outs.append(rt.download(fx, d, np.int64))
    np.testing.assert_array_equal(outs[0], outs[1])
    xo = outs[0].astype(np.float64) / FX
    close(xo, x + Wo @ att, 1e-4, 1e-5)
    # gate/up on x_fx alone (its prologue converts each word to float32, as the device does)
    bg, Wg = weights(O, F, d, f16, scale=2.0)
    bu, Wu = weights(O, F, d, f16)
    g = (1 + 0.3 * RNG.standard_normal(d)).astype(np.float32)
    xn = O.ref_rmsnorm((outs[0].astype(np.float32) * np.float32(1 / FX)).astype(np.float64), g, 1e-6)
    h = poisoned(rt, F)
    ops.matvec_gate_up_fx(rt.upload(bg), rt.upload(bu), rt.upload(outs[0]), h, F, d, gamma=rt.upload(g), eps=1e-6,
                          f16=f16)
    close(rt.download(h, F, np.float32), O.ref_silu(Wg @ xn) * (Wu @ xn), 1e-4, 1e-5)
    # down with the fixed-point residual rows
    bd, Wd = weights(O, d, F, f16)
    hv = RNG.standard_normal(F).astype(np.float32)
    y, rfx = poisoned(rt, d), rt.upload(outs[0])
    ops.matvec_fx_res(rt.upload(bd), rt.upload(hv), rfx, y, d, F, f16=f16)
    close(rt.download(y, d, np.float32), Wd @ hv + outs[0].astype(np.float32) * np.float32(1 / FX), 1e-4, 1e-5)
    assert not rt.download(rfx, d, np.int64).any(), "the down-projection must clear the residual it read"


@pytest.mark.parametrize("rows1", [False, True])
@pytest.mark.parametrize("rows", [1, 513])
def test_matvec_fx_res_odd_rows(gpu, rows, rows1):
    """The grouped O-proj's down-projection with an odd row count: the last unit's second lane loads a clamped row
    and must neither write nor clear past the end (ops/matvec_group.hip HeMvPlainFxRes); the one-row-unit kernel
    (matvec.hip HeMvPlain1FxRes) likewise."""
    rt, ops, O = gpu
    inn = 1024
    bd, Wd = weights(O, rows, inn, False)
    hv = RNG.standard_normal(inn).astype(np.float32)
    rfx_host = np.round(RNG.standard_normal(rows + 1) * FX).astype(np.int64)  # one guard word past the rows
    y, rfx = poisoned(rt, rows + 1), rt.upload(rfx_host)  # y's guard element stays NaN
    ops.matvec_fx_res(rt.upload(bd), rt.upload(hv), rfx, y, rows, inn, rows1=rows1)
    got = rt.download(y, rows + 1, np.float32)
    close(got[:rows], Wd @ hv + rfx_host[:rows].astype(np.float32) * np.float32(1 / FX), 1e-4, 1e-5)
    assert np.isnan(got[rows]), "wrote past the last row"
    words = rt.download(rfx, rows + 1, np.int64)
    assert not words[:rows].any() and words[rows] == rfx_host[rows], "must clear its rows and only them"


@pytest.mark.parametrize("rows,inn", [(2048, 8192), (333, 2048), (3, 12288)])
@pytest.mark.parametrize("f16", [False, True])
def test_matvec_fx_res_rows1_same_bits(gpu, rows, inn, f16):
    """The per-op down-projection after the grouped O-proj in one-row units (matvec.hip matvec_rows1_fx_res, which
    ops.matvec_fx_res picks for llama-3.2-1b's down) gives the two-row kernel's bits — the monokernel's — and clears
    the words it read; the words are positive and negative (their high halves differ: 0 / 0xffffffff and beyond), so
    both halves matter."""
    rt, ops, O = gpu
    bits, W = weights(O, rows, inn, f16)
    hv = rt.upload(RNG.standard_normal(inn).astype(np.float32))
    words = np.round(RNG.standard_normal(rows) * FX * 8).astype(np.int64)
    out = {}
    for rows1 in (False, True):
        y, rfx = poisoned(rt, rows), rt.upload(words)
        ops.matvec_fx_res(rt.upload(bits), hv, rfx, y, rows, inn, f16=f16, rows1=rows1)
        out[rows1] = rt.download(y, rows, np.float32)
        assert not rt.download(rfx, rows, np.int64).any(), "must clear the residual words it read"
    assert not np.isnan(out[True]).any()
    assert out[True].tobytes() == out[False].tobytes()
    close(out[True], W @ rt.download(hv, inn, np.float32) + words.astype(np.float32) * np.float32(1 / FX), 1e-4, 1e-4)


def test_matvec_group_o_refuses_misfits(gpu):
    rt, ops, O = gpu
    from hipengine.errors import UnsupportedError
    with pytest.raises(UnsupportedError, match="grouped O-proj"):
        ops.matvec_group_o(0, 0, 0, 0, 576, 576, 3)


QKV_CASES = [  # nh, nkv, hd, inn
    (4, 2, 24, 64), (6, 2, 16, 96), (32, 8, 64, 2048), (12, 2, 128, 264), (8, 8, 32, 72)]


def _kv_ref(O, qkv, nh, nkv, hd, cos_p, sin_p, q_norm=None, k_norm=None, eps=1e-6, rope=True):
    q = qkv[:nh * hd].reshape(nh, hd)
    k = qkv[nh * hd:(nh + nkv) * hd].reshape(nkv, hd)
    v = qkv[(nh + nkv) * hd:].reshape(nkv, hd)
    if q_norm is not None:
        q, k = O.ref_rmsnorm(q, q_norm, eps), O.ref_rmsnorm(k, k_norm, eps)
    if rope:
        q, k = O.ref_rope(q, cos_p, sin_p), O.ref_rope(k, cos_p, sin_p)
    return q, k, v


@pytest.mark.parametrize("nh,nkv,hd,inn", QKV_CASES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rope", [True, False])
def test_matvec_qkv(gpu, nh, nkv, hd, inn, bias, rope):
    rt, ops, O = gpu
    rows, max_ctx = (nh + 2 * nkv) * hd, 50
    bits, W = weights(O, rows, inn, False)
    x = RNG.standard_normal(inn).astype(np.float32)
    g = (1 + 0.3 * RNG.standard_normal(inn)).astype(np.float32)
    b = (0.1 * RNG.standard_normal(rows)).astype(np.float32) if bias else None
    inv = 1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd))
    cos, sin = O.rope_tables(inv, max_ctx)
    pos = int(RNG.integers(0, max_ctx))
    qkv = W @ O.ref_rmsnorm(x, g, 1e-5) + (b if bias else 0)
    q_out = poisoned(rt, rows)
    kc, vc = poisoned(rt, nkv * max_ctx * hd, np.uint16), poisoned(rt, nkv * max_ctx * hd, np.uint16)
    ops.matvec_qkv(rt.upload(bits), rt.upload(x), q_out, kc, vc, rt.upload(cos), rt.upload(sin),
                   rt.upload(np.array([pos], np.int32)), max_ctx=max_ctx, q_dim=nh * hd, kv_dim=nkv * hd, hd=hd,
                   inn=inn, gamma=rt.upload(g), eps=1e-5, bias=rt.upload(b) if bias else None, rope=rope)
    if not rope:
        close(rt.download(q_out, rows, np.float32), qkv, 1e-4, 1e-5)
        return
    q, k, v = _kv_ref(O, qkv, nh, nkv, hd, cos[pos].astype(np.float64), sin[pos].astype(np.float64))
    close(rt.download(q_out, rows, np.float32)[:nh * hd], q.reshape(-1), 1e-4, 1e-5)
    kcache = O.from_bf16(rt.download(kc, (nkv, max_ctx, hd), np.uint16))
    vcache = O.from_bf16(rt.download(vc, (nkv, max_ctx, hd), np.uint16))
    close(kcache[:, pos], k, 2 ** -8, 1e-5)  # bf16 storage
    close(vcache[:, pos], v, 2 ** -8, 1e-5)
    others = np.delete(np.arange(max_ctx), pos)
    assert np.isnan(kcache[:, others]).all() and np.isnan(vcache[:, others]).all(), "wrote outside position"


@pytest.mark.parametrize("nh,nkv,hd", [(4, 2, 24), (16, 8, 128), (6, 2, 64)])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("norm", [False, True])
def test_qk_norm_rope(gpu, nh, nkv, hd, T, norm):
    rt, ops, O = gpu
    max_ctx, pos0 = 40, int(RNG.integers(0, 30))
    W = (nh + 2 * nkv) * hd
    qkv = RNG.standard_normal((T, W)).astype(np.float32)
    qn = (1 + 0.3 * RNG.standard_normal(hd)).astype(np.float32) if norm else None
    kn = (1 + 0.3 * RNG.standard_normal(hd)).astype(np.float32) if norm else None
    cos, sin = O.rope_tables(1.0 / (1e6 ** (np.arange(0, hd, 2) / hd)), max_ctx)
    q_out = poisoned(rt, T * nh * hd)
    kc, vc = poisoned(rt, nkv * max_ctx * hd, np.uint16), poisoned(rt, nkv * max_ctx * hd, np.uint16)
    ops.qk_norm_rope(rt.upload(qkv), q_out, kc, vc, rt.upload(cos), rt.upload(sin), rt.upload(np.array([pos0], np.int32)),
                     T=T, nh=nh, nkv=nkv, hd=hd, max_ctx=max_ctx, q_norm=rt.upload(qn) if norm else None,
                     k_norm=rt.upload(kn) if norm else None, eps=1e-6)
    qg = rt.download(q_out, (T, nh * hd), np.float32)
    kcache = O.from_bf16(rt.download(kc, (nkv, max_ctx, hd), np.uint16))
    vcache = O.from_bf16(rt.download(vc, (nkv, max_ctx, hd), np.uint16))
    for t in range(T):
        p = pos0 + t
        q, k, v = _kv_ref(O, qkv[t].astype(np.float64), nh, nkv, hd, cos[p].astype(np.float64),
                          sin[p].astype(np.float64), qn, kn, 1e-6)
        close(qg[t], q.reshape(-1), 1e-5, 1e-5)
        close(kcache[:, p], k, 2 ** -8, 1e-5)
        close(vcache[:, p], v, 2 ** -8, 1e-5)


ATTN_CASES = [  # nh, nkv, hd, seq, max_ctx, T
    (4, 2, 24, 37, 64, 1), (32, 8, 64, 1000, 1024, 1), (12, 2, 128, 5, 4096, 1), (6, 6, 16, 300, 512, 3),
    (6, 2, 16, 300, 512, 1),  # hd 16: a matrix-core split tile is fewer 16-byte vectors than a warp has lanes
    (32, 8, 128, 3000, 4096, 1), (16, 2, 64, 77, 100, 8), (9, 3, 64, 1, 32, 1),
    # a 64-split plan: 900 rows take 16 splits of 64 (one combine batch), 3000 rows keep 47 of 64
    (8, 2, 64, 900, 8192, 2), (8, 2, 64, 3000, 8192, 1),
    # llama-3.2-1b's 32K plan: 32 splits of 1,024 (the longest split, ops.attention_max_chunk), full and partial
    (32, 8, 64, 32768, 32768, 1), (32, 8, 64, 20000, 32768, 2),
    # prefill chunks (attention_prefill_g* where the GPU has matrix cores): a whole 64-token chunk at the end
    # of a 1K prompt and at its start; several 64-key steps per split; G = 6 at hd 128; a partial query tile
    (32, 8, 64, 1024, 1088, 64), (32, 8, 64, 64, 4160, 64), (8, 2, 128, 4100, 8192, 37), (12, 2, 128, 300, 512, 20)]


def _run_attention(gpu, nh, nkv, hd, seq, max_ctx, T, one_round=False):
    """Ops.attention of T random queries at pos0 = seq - T over a random bf16 cache, outputs poisoned:
    (output [T][nh·hd], q, K and V as float64, pos0). one_round: the monokernel's split plan (monokernel.mk_plan)
    instead of the per-op path's."""
    rt, ops, O = gpu
    nsplit, chunk = O.attention_plan(max_ctx, nkv, rt.num_sms, head_dim=hd, one_round=one_round)
    k = O.to_bf16(RNG.standard_normal((nkv, max_ctx, hd)).astype(np.float32) * 2)
    v = O.to_bf16(RNG.standard_normal((nkv, max_ctx, hd)).astype(np.float32))
    q = RNG.standard_normal((T, nh * hd)).astype(np.float32)
    pos0 = seq - T
    part = poisoned(rt, O.Ops.partial_floats(T, nh, hd, nsplit))
    out = poisoned(rt, T * nh * hd)
    ops.attention(rt.upload(q), rt.upload(k), rt.upload(v), part, out, rt.upload(np.array([pos0], np.int32)), T=T,
                  nh=nh, nkv=nkv, hd=hd, max_ctx=max_ctx, nsplit=nsplit, chunk=chunk)
    got = rt.download(out, (T, nh * hd), np.float32)
    return got, q, O.from_bf16(k).astype(np.float64), O.from_bf16(v).astype(np.float64), pos0


@pytest.mark.parametrize("nh,nkv,hd,seq,max_ctx,T", ATTN_CASES)
@pytest.mark.parametrize("split_mma", ["0", "1"])
def test_attention(gpu, nh, nkv, hd, seq, max_ctx, T, split_mma, monkeypatch):
    """Query t sees positions [0, pos0 + t]; pos0 = seq - T. Splits past the end must be skipped. Decode (T = 1)
    with either split body: FMA (HIPENGINE_ATTN_MMA=0) or the matrix cores where ops.attn_mma allows them."""
    rt, ops, O = gpu
    if T > 1 and split_mma == "1":
        pytest.skip("the split body is a decode choice (T = 1)")
    monkeypatch.setenv("HIPENGINE_ATTN_MMA", split_mma)
    got, q, kf, vf, pos0 = _run_attention(gpu, nh, nkv, hd, seq, max_ctx, T)
    # the matrix-core prefill and split take q and the probabilities as hi/lo 16-bit pairs (~16 bits): their
    # scores, in the tens here, carry ~1e-4 of absolute error
    mma = (T > 1 and O.attention_prefill_mma(rt.arch, nh // nkv, hd, rt.max_shared_per_block)) or (
        T == 1 and O.attn_mma(rt.arch, hd))
    for t in range(T):
        ref = O.ref_attention(q[t].reshape(nh, hd).astype(np.float64), kf, vf, pos0 + t + 1)
        close(got[t], ref, 1e-3 if mma else 1e-4, 1e-4 if mma else 1e-5)


@pytest.mark.parametrize("seq", [32768, 20000])
@pytest.mark.parametrize("split_mma", ["0", "1"])
def test_attention_one_round_plan(gpu, seq, split_mma, monkeypatch):
    """The split body on the monokernel's plan for llama-3.2-1b's 32K cache (16 splits of 2,048 on 132 SMs: the
    longest split either path takes), full and partial, either split body, against float64."""
    rt, ops, O = gpu
    monkeypatch.setenv("HIPENGINE_ATTN_MMA", split_mma)
    got, q, kf, vf, pos0 = _run_attention(gpu, 32, 8, 64, seq, 32768, 1, one_round=True)
    mma = O.attn_mma(rt.arch, 64)
    ref = O.ref_attention(q[0].reshape(32, 64).astype(np.float64), kf, vf, pos0 + 1)
    close(got[0], ref, 1e-3 if mma else 1e-4, 1e-4 if mma else 1e-5)


@pytest.fixture(scope="module")
def gpu_kv16(gpu):
    """Ops built for an fp16 KV cache (HE_KV_F16: what fp16-weight models get, executor.kv_defines)."""
    rt, _, O = gpu
    return rt, O.Ops(rt, {"HE_KV_F16": 1}), O


@pytest.mark.parametrize("nh,nkv,hd,seq,max_ctx", [(32, 8, 64, 1000, 1024), (9, 3, 64, 1, 32), (12, 2, 128, 5, 4096),
                                                   (8, 2, 64, 3000, 8192), (32, 8, 64, 32768, 32768)])
@pytest.mark.parametrize("split_mma", ["0", "1"])
def test_attention_f16_cache(gpu_kv16, nh, nkv, hd, seq, max_ctx, split_mma, monkeypatch):
    """Decode attention over an fp16 KV cache, either split body (the matrix cores multiply fp16 tiles there):
    against float64 attention of the fp16-rounded cache."""
    rt, ops, O = gpu_kv16
    monkeypatch.setenv("HIPENGINE_ATTN_MMA", split_mma)
    nsplit, chunk = O.attention_plan(max_ctx, nkv, rt.num_sms, head_dim=hd)
    k = (RNG.standard_normal((nkv, max_ctx, hd)) * 2).astype(np.float16)
    v = RNG.standard_normal((nkv, max_ctx, hd)).astype(np.float16)
    q = RNG.standard_normal((1, nh * hd)).astype(np.float32)
    part, out = poisoned(rt, O.Ops.partial_floats(1, nh, hd, nsplit)), poisoned(rt, nh * hd)
    ops.attention(rt.upload(q), rt.upload(k.view(np.uint16)), rt.upload(v.view(np.uint16)), part, out,
                  rt.upload(np.array([seq - 1], np.int32)), T=1, nh=nh, nkv=nkv, hd=hd, max_ctx=max_ctx,
                  nsplit=nsplit, chunk=chunk)
    got = rt.download(out, (nh * hd,), np.float32)
    ref = O.ref_attention(q[0].reshape(nh, hd).astype(np.float64), k.astype(np.float64), v.astype(np.float64), seq)
    mma = O.attn_mma(rt.arch, hd)
    close(got, ref, 1e-3 if mma else 1e-4, 1e-4 if mma else 1e-5)


@pytest.mark.parametrize("nh,nkv,hd,seq,max_ctx,T", [c for c in ATTN_CASES if c[5] > 1])
def test_attention_prefill_unsplit(gpu, nh, nkv, hd, seq, max_ctx, T, monkeypatch):
    """The matrix-core prefill attention with 16-bit q and probabilities (HIPENGINE_PREFILL_SPLIT=0): against
    float64 attention of the bf16-rounded q (what it computes but for the probabilities' rounding, ~2^-9)."""
    rt, ops, O = gpu
    if not (T > 1 and O.attention_prefill_mma(rt.arch, nh // nkv, hd, rt.max_shared_per_block)):
        pytest.skip("no matrix-core prefill attention here")
    monkeypatch.setenv("HIPENGINE_PREFILL_SPLIT", "0")
    got, q, kf, vf, pos0 = _run_attention(gpu, nh, nkv, hd, seq, max_ctx, T)
    q16 = O.from_bf16(O.to_bf16(q)).astype(np.float64)
    for t in range(T):
        ref = O.ref_attention(q16[t].reshape(nh, hd), kf, vf, pos0 + t + 1)
        close(got[t], ref, 1e-2, 5e-3)


@pytest.mark.parametrize("nh,nkv,hd,seq,max_ctx,T", [c for c in ATTN_CASES if c[5] > 1])
def test_attention_prefill_qtiles_same_bits(gpu, nh, nkv, hd, seq, max_ctx, T, monkeypatch):
    """attention_prefill with 2 and 4 query tiles per block (HIPENGINE_AP_QTILES) gives the one-tile bits: each
    warp's sums are the same whatever warps share its block's K/V staging."""
    rt, ops, O = gpu
    if not O.attention_prefill_mma(rt.arch, nh // nkv, hd, rt.max_shared_per_block):
        pytest.skip("no matrix-core prefill attention here")
    nsplit, chunk = O.attention_plan(max_ctx, nkv, rt.num_sms, head_dim=hd)
    k = rt.upload(O.to_bf16(RNG.standard_normal((nkv, max_ctx, hd)).astype(np.float32) * 2))
    v = rt.upload(O.to_bf16(RNG.standard_normal((nkv, max_ctx, hd)).astype(np.float32)))
    q = rt.upload(RNG.standard_normal((T, nh * hd)).astype(np.float32))
    pos = rt.upload(np.array([seq - T], np.int32))
    got = {}
    for qt in ("1", "2", "4"):
        monkeypatch.setenv("HIPENGINE_AP_QTILES", qt)
        part, out = poisoned(rt, O.Ops.partial_floats(T, nh, hd, nsplit)), poisoned(rt, T * nh * hd)
        ops.attention(q, k, v, part, out, pos, T=T, nh=nh, nkv=nkv, hd=hd, max_ctx=max_ctx, nsplit=nsplit,
                      chunk=chunk)
        got[qt] = rt.download(out, (T, nh * hd), np.float32)
    assert not np.isnan(got["1"]).any()
    assert got["2"].tobytes() == got["1"].tobytes() and got["4"].tobytes() == got["1"].tobytes()


@pytest.mark.parametrize("nh,nkv,hd,seq,max_ctx,T", [c for c in ATTN_CASES if c[5] == 1])
@pytest.mark.parametrize("split_mma", ["0", "1"])
def test_attention_decode_fused(gpu, nh, nkv, hd, seq, max_ctx, T, split_mma, monkeypatch):
    """The one-kernel decode form (attention_decode_g*: splits, the last split block of a KV head combines it)
    gives the bits of attention_split + attention_combine, with and without the early K/V loads (launched
    here after a synchronisation, so the previous kernel is long done: this checks the held-back newest row
    and the indexing, not the overlap), and leaves its arrival counters at zero for the next launch; so do
    the two kernels when they read the position before their wait (early_pos). Either split body
    (HIPENGINE_ATTN_MMA)."""
    rt, ops, O = gpu
    monkeypatch.setenv("HIPENGINE_ATTN_MMA", split_mma)
    nsplit, chunk = O.attention_plan(max_ctx, nkv, rt.num_sms, head_dim=hd)
    k = O.to_bf16(RNG.standard_normal((nkv, max_ctx, hd)).astype(np.float32) * 2)
    v = O.to_bf16(RNG.standard_normal((nkv, max_ctx, hd)).astype(np.float32))
    q = RNG.standard_normal((1, nh * hd)).astype(np.float32)
    args = (rt.upload(q), rt.upload(k), rt.upload(v))
    pos = rt.upload(np.array([seq - 1], np.int32))
    kw = dict(T=1, nh=nh, nkv=nkv, hd=hd, max_ctx=max_ctx, nsplit=nsplit, chunk=chunk)
    part = poisoned(rt, O.Ops.partial_floats(1, nh, hd, nsplit))
    want = poisoned(rt, nh * hd)
    ops.attention(*args, part, want, pos, one_kernel=False, **kw)
    want = rt.download(want, (nh * hd,), np.float32)
    count = rt.upload(np.zeros(nkv, np.uint32))
    for early in (False, True, False, True):
        part = poisoned(rt, O.Ops.partial_floats(1, nh, hd, nsplit))
        out = poisoned(rt, nh * hd)
        ops.attention(*args, part, out, pos, count=count, early=early, one_kernel=True, **kw)
        rt.synchronize()
        got = rt.download(out, (nh * hd,), np.float32)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"early={early}"
        assert not rt.download(count, (nkv,), np.uint32).any(), "arrival counters not reset"
    # the two kernels with the position read before their wait (early_pos: Ops.attention early, two kernels)
    part = poisoned(rt, O.Ops.partial_floats(1, nh, hd, nsplit))
    out = poisoned(rt, nh * hd)
    ops.attention(*args, part, out, pos, count=count, early=True, one_kernel=False, **kw)
    got = rt.download(out, (nh * hd,), np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), "two kernels, early position"


# The newest row left to the combine (HE_ATTN_FRESH_COMBINE): the first position (every split empty); 225 rows in a 1K
# cache's 8 splits (he_attn_len: 32 rows each, so the newest row is alone in the last split, which the splits then leave
# empty); a 1K cache nearly full; 64 splits at hd 128 (four combine batches).
@pytest.mark.parametrize("nh,nkv,hd,seq,max_ctx", [(9, 3, 64, 1, 32), (32, 8, 64, 225, 1024), (32, 8, 64, 1000, 1024),
                                                   (8, 2, 128, 3000, 8192)])
@pytest.mark.parametrize("split_mma", ["0", "1"])
def test_attention_fresh_combine(gpu, nh, nkv, hd, seq, max_ctx, split_mma, monkeypatch):
    """Decode attention with the newest row added by the combine (HIPENGINE_ATTN_FRESH_COMBINE=1, both split bodies):
    against float64, and the one-kernel form (with and without its early loads) gives the two kernels' bits."""
    rt, ops, O = gpu
    monkeypatch.setenv("HIPENGINE_ATTN_FRESH_COMBINE", "1")
    assert O.attention_defines(hd, max_ctx, rt.arch)["HE_ATTN_FRESH_COMBINE"] == 1
    test_attention(gpu, nh, nkv, hd, seq, max_ctx, 1, split_mma, monkeypatch)
    test_attention_decode_fused(gpu, nh, nkv, hd, seq, max_ctx, 1, split_mma, monkeypatch)


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("rows,inn", [(13, 72), (333, 2056)])
def test_matmul_small_m(gpu, M, mode, rows, inn):
    rt, ops, O = gpu
    bits, W = weights(O, rows, inn, False)
    bits2, W2 = weights(O, rows, inn, True)
    X = RNG.standard_normal((M, inn)).astype(np.float32)
    b = RNG.standard_normal(rows).astype(np.float32)
    if mode == 2:  # gate/up in fp16 exercises the other weight type
        bits, W = weights(O, rows, inn, True)
        ref = O.ref_silu(X @ W.T) * (X @ W2.T)
        Y = poisoned(rt, M * rows)
    elif mode == 1:
        Y0 = RNG.standard_normal((M, rows)).astype(np.float32)
        ref = Y0 + X @ W.T
        Y = rt.upload(Y0)
    else:
        ref = X @ W.T + b
        Y = poisoned(rt, M * rows)
    ops.matmul_small_m(rt.upload(bits), rt.upload(X), Y, M, rows, inn, mode=mode,
                       W2=rt.upload(bits2) if mode == 2 else None, bias=rt.upload(b) if mode == 0 else None,
                       f16=mode == 2)
    close(rt.download(Y, (M, rows), np.float32), ref, 1e-4, 1e-4)


@pytest.mark.parametrize("M", [1, 17, 64, 100, 128])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("rows,inn", [(13, 72), (333, 2056), (9000, 136)])
@pytest.mark.parametrize("warps", ["4", "8"])
def test_prefill_matmul_mma(gpu, M, mode, f16, rows, inn, warps, monkeypatch):
    """The matrix-core prefill projection (hi/lo activations) against float64, in both builds (4 / 8 warps,
    ops.mma_build): split K (13 and 333 rows: one or a few tiles) and one split (9,000 rows), rows and
    columns that are not tile multiples, chunks of 1 .. 128 tokens, outputs poisoned; then bit-identical on
    a second launch, arrival counters left zero."""
    monkeypatch.setenv("HIPENGINE_MMA_WARPS", warps)
    _check_prefill_matmul_mma(gpu, M, mode, f16, rows, inn)


@pytest.mark.parametrize("M", [37, 100, 128])
@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("rows,inn", [(333, 2056), (2048, 2048)])
@pytest.mark.parametrize("ztiles", ["1", "4", "8"])  # 2: the default, in the tests above
def test_prefill_matmul_mma_token_tiles(gpu, M, mode, rows, inn, ztiles, monkeypatch):
    """The matrix-core prefill projection cut into token tiles (HIPENGINE_MMA_ZTILES: grid.z, fewer K
    splits), last tiles short, against float64; deterministic, counters left zero."""
    monkeypatch.setenv("HIPENGINE_MMA_ZTILES", ztiles)
    _check_prefill_matmul_mma(gpu, M, mode, mode == 2, rows, inn)


def _check_prefill_matmul_mma(gpu, M, mode, f16, rows, inn):
    rt, ops, O = gpu
    if not O.mma_supported(rt.arch):
        pytest.skip(f"no matrix cores on {rt.arch}")
    bits, W = weights(O, rows, inn, f16)
    bits2, W2 = weights(O, rows, inn, f16)
    X = RNG.standard_normal((M, inn)).astype(np.float32)
    b = RNG.standard_normal(rows).astype(np.float32)
    Y0 = RNG.standard_normal((M, rows)).astype(np.float32)
    if mode == 2:
        ref = O.ref_silu(X @ W.T) * (X @ W2.T)
    elif mode == 1:
        ref = Y0 + X @ W.T
    else:
        ref = X @ W.T + b
    part, count = rt.malloc(O.mma_part_floats(rt.num_sms, M) * 4), rt.upload(np.zeros(rt.num_sms, np.uint32))
    args = (rt.upload(bits), rt.upload(X))
    kw = dict(mode=mode, W2=rt.upload(bits2) if mode == 2 else None, bias=rt.upload(b) if mode == 0 else None,
              f16=f16, part=part, count=count)
    outs = []
    for _ in range(2):
        Y = rt.upload(Y0) if mode == 1 else poisoned(rt, M * rows)
        ops.prefill_matmul(*args, Y, M, rows, inn, **kw)
        outs.append(rt.download(Y, (M, rows), np.float32))
    close(outs[0], ref, 1e-4, 1e-4)
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), "not deterministic"
    assert not rt.download(count, (rt.num_sms,), np.uint32).any(), "arrival counters not reset"


@pytest.mark.parametrize("M", [17, 128])
@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("rows,inn", [(333, 2056), (9000, 136)])
@pytest.mark.parametrize("warps", ["4", "8"])
def test_prefill_matmul_mma_unsplit(gpu, M, mode, f16, rows, inn, warps, monkeypatch):
    """The matrix-core prefill projection with 16-bit activations (HIPENGINE_PREFILL_SPLIT=0): exactly the
    product of X rounded to the weights' 16-bit type (fp32 sums), against float64; deterministic."""
    rt, ops, O = gpu
    if not O.mma_supported(rt.arch):
        pytest.skip(f"no matrix cores on {rt.arch}")
    monkeypatch.setenv("HIPENGINE_MMA_WARPS", warps)
    monkeypatch.setenv("HIPENGINE_PREFILL_SPLIT", "0")
    bits, W = weights(O, rows, inn, f16)
    bits2, W2 = weights(O, rows, inn, f16)
    X = RNG.standard_normal((M, inn)).astype(np.float32)
    X16 = X.astype(np.float16).astype(np.float64) if f16 else O.from_bf16(O.to_bf16(X)).astype(np.float64)
    b = RNG.standard_normal(rows).astype(np.float32)
    ref = O.ref_silu(X16 @ W.T) * (X16 @ W2.T) if mode == 2 else X16 @ W.T + b
    part, count = rt.malloc(O.mma_part_floats(rt.num_sms, M) * 4), rt.upload(np.zeros(rt.num_sms, np.uint32))
    kw = dict(mode=mode, W2=rt.upload(bits2) if mode == 2 else None, bias=rt.upload(b) if mode == 0 else None,
              f16=f16, part=part, count=count)
    outs = []
    for _ in range(2):
        Y = poisoned(rt, M * rows)
        ops.prefill_matmul(rt.upload(bits), rt.upload(X), Y, M, rows, inn, **kw)
        outs.append(rt.download(Y, (M, rows), np.float32))
    close(outs[0], ref, 1e-4, 1e-4)
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), "not deterministic"
    assert not rt.download(count, (rt.num_sms,), np.uint32).any(), "arrival counters not reset"


def _run_sample(rt, ops, logits, history, step, **kw):
    n = logits.size
    out = rt.upload(np.array([-7], np.int32))
    hist = rt.upload(np.asarray(history if len(history) else [0], np.int32))
    ops.sample(rt.upload(logits), n, hist, rt.upload(np.array([len(history)], np.int32)),
               rt.upload(np.array([step], np.int32)), out, rt.malloc(n * 4), **kw)
    return int(rt.download(out, 1, np.int32)[0])


@pytest.mark.parametrize("n", [5, 1000, 128256])
def test_sample_greedy(gpu, n):
    rt, ops, O = gpu
    logits = RNG.standard_normal(n).astype(np.float32)
    assert _run_sample(rt, ops, logits, [], 0) == int(np.argmax(logits))
    tied = np.zeros(n, np.float32)
    tied[[n // 2, n - 1]] = 3.0
    assert _run_sample(rt, ops, tied, [], 0) == n // 2  # first index wins, like numpy
    # repetition penalty flips the winner in greedy mode too (HF semantics)
    two = np.full(n, -5, np.float32)
    two[[1, 3]] = [2.0, 1.5]
    assert _run_sample(rt, ops, two, [1, 1, 4], 0, repetition_penalty=2.0) == 3


@pytest.mark.parametrize("n", [1, 131, 1000, 128256, 151936])
def test_argmax_grid(gpu, n):
    """The grid-wide greedy pick equals numpy's argmax and the one-block sampler's greedy token: ties to the
    first index (also across block slices), NaN and -inf never win, sizes below and above one block per SM."""
    rt, ops, O = gpu
    cand = rt.malloc(8 * ops.argmax_blocks())
    out = rt.upload(np.array([-1], np.int32))

    def pick(logits):
        buf = rt.upload(logits.astype(np.float32))
        rt.copy_htod(out, np.array([-1], np.int32))
        ops.argmax(buf, n, out, cand)
        rt.synchronize()
        return int(rt.download(out, 1, np.int32)[0])

    for trial in range(4):
        logits = (RNG.standard_normal(n) * 4).astype(np.float32)
        if n > 3:
            logits[RNG.integers(0, n, max(1, n // 50))] = np.nan
            logits[RNG.integers(0, n, max(1, n // 50))] = -np.inf
        want = int(np.nanargmax(np.where(np.isnan(logits), -np.inf, logits)))
        assert pick(logits) == want == _run_sample(rt, ops, logits, [], 0)
    if n > 2:
        tied = np.zeros(n, np.float32)
        tied[[n - 1, n // 2, n // 3 + 1]] = 7.0  # equal maxima in different blocks' slices
        assert pick(tied) == min(n // 2, n // 3 + 1) == _run_sample(rt, ops, tied, [], 0)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                dict(temperature=1.3, top_p=0.5), dict(temperature=1.0, min_p=0.2),
                                dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.3)])
def test_sample_distribution(gpu, kw):
    """The token is the kept one whose cumulative-weight interval (index order) contains u·total."""
    rt, ops, O = gpu
    n = 50000
    history = RNG.integers(0, n, 20).tolist()
    for trial in range(6):
        logits = (RNG.standard_normal(n) * 3).astype(np.float32)
        seed, step = int(RNG.integers(0, 2 ** 63)), int(RNG.integers(0, 10000))
        tok = _run_sample(rt, ops, logits, history, step, seed=seed, **kw)
        z, keep, _ = O.ref_sample_keep(logits, history, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0),
                                       kw.get("min_p", 0.0), kw.get("repetition_penalty", 1.0))
        assert keep[tok], f"sampled a token outside the kept set ({kw})"
        e = np.where(keep, np.exp(z - z.max()), 0.0)
        cum = np.cumsum(e)
        target = O.sample_uniform(seed, step) * cum[-1]
        slack = 1e-4 * cum[-1]
        assert cum[tok] - e[tok] - slack <= target <= cum[tok] + slack


def test_decode_advance(gpu):
    rt, ops, O = gpu
    tok, hist = rt.upload(np.array([42], np.int32)), rt.upload(np.zeros(4, np.int32))
    hl, pos = rt.upload(np.array([3], np.int32)), rt.upload(np.array([9], np.int32))
    ops.decode_advance(tok, hist, hl, pos, 4)
    ops.decode_advance(tok, hist, hl, pos, 4)  # history full: position still advances
    assert rt.download(hist, 4, np.int32).tolist() == [0, 0, 0, 42]
    assert int(rt.download(hl, 1, np.int32)[0]) == 4 and int(rt.download(pos, 1, np.int32)[0]) == 11


@pytest.mark.parametrize("n,hl0", [(1000, 2), (128256, 4)])
def test_argmax_step_equals_the_four_kernels(gpu, n, hl0):
    """Ops.argmax_step (argmax_blocks + argmax_pick_step) leaves what decode_advance, argmax and emit_token
    leave, in that order: the consumed token joins the history (until it is full), the position advances, the
    picked token replaces it and is handed to the host (slot and count); a full host ring takes no more."""
    rt, ops, O = gpu
    logits = rt.upload((RNG.standard_normal(n) * 4).astype(np.float32))
    cand = rt.malloc(8 * ops.argmax_blocks())
    out = {}
    for fused in (False, True):
        tok = rt.upload(np.array([42], np.int32))
        hist, hl = rt.upload(np.zeros(4, np.int32)), rt.upload(np.array([hl0], np.int32))
        pos, count = rt.upload(np.array([9], np.int32)), rt.upload(np.array([0], np.int32))
        host = rt.host_alloc_mapped(4 * 3)
        words = host.array.view(np.int32)
        words[:] = -1
        try:
            for _ in range(3):  # the third token finds the ring (cap 2) full
                if fused:
                    ops.argmax_step(logits, n, tok, cand, hist, hl, pos, 4, count, host, 2)
                else:
                    ops.decode_advance(tok, hist, hl, pos, 4)
                    ops.argmax(logits, n, tok, cand)
                    ops.emit_token(tok, count, host, 2)
            rt.synchronize()
            out[fused] = (rt.download(tok, 1, np.int32).tolist(), rt.download(hist, 4, np.int32).tolist(),
                          rt.download(hl, 1, np.int32).tolist(), rt.download(pos, 1, np.int32).tolist(),
                          rt.download(count, 1, np.int32).tolist(), words.tolist())
        finally:
            host.free()
    want = int(np.argmax(rt.download(logits, n, np.float32)))
    assert out[True] == out[False]
    assert out[True][0] == [want] and out[True][3] == [12] and out[True][5] == [2, want, want]
