"""The per-op GPU executor against the numpy ReferenceBackend (on the GPU), and its wiring on the CPU through
a numpy-emulated device (end of file).

* tiny Llama made with transformers: teacher-forced top-1 agreement >= 99% over 512 positions (prefill and
  decode paths), logits relative error <= 2e-2, greedy 32 tokens identical to the CPU path;
* random llama-3.2-1b preset (real dimensions): 512 teacher-forced positions, agreement counted where the
  reference's top1-top2 gap exceeds the bf16 error bound, logits relative error <= 2e-2.
"""
import re

import numpy as np
import pytest

from hipengine.backend import SamplingParams
from hipengine.errors import UnsupportedError


def _agreement(gpu_logits, ref_logits, min_gap=0.0):
    top = np.sort(ref_logits, axis=-1)
    gap = top[:, -1] - top[:, -2]
    mask = gap > min_gap
    agree = np.argmax(gpu_logits, -1) == np.argmax(ref_logits, -1)
    return float(agree[mask].mean()), int(mask.sum())


def _rel_err(a, b):
    return float(np.max(np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)))


def test_philox_known_answer():
    """Random123's published Philox4x32-10 vectors; the kernel is checked bit-exact against this function."""
    from hipengine.gpu.ops import philox4x32_10

    assert philox4x32_10([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox4x32_10([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def test_bf16_round_to_nearest_even():
    torch = pytest.importorskip("torch")
    from hipengine.gpu.ops import from_bf16, to_bf16

    x = np.random.default_rng(0).standard_normal(100000).astype(np.float32) * 1e3
    x[:4] = [np.inf, -np.inf, 0.0, -0.0]
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(to_bf16(x), want)
    assert np.isnan(from_bf16(to_bf16(np.array([np.nan], np.float32)))).all()


def test_rope_tables_match_reference():
    from hipengine.config import ModelConfig
    from hipengine.gpu.ops import rope_tables
    from hipengine.reference import rope_tables as ref_tables

    cfg = ModelConfig(family="llama", vocab_size=10, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    for a, b in zip(rope_tables(cfg.rope_inv_freq(), 300), ref_tables(cfg, 300)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("kw", [dict(top_k=5), dict(top_p=0.5), dict(min_p=0.2), dict(top_k=50, top_p=0.9, min_p=0.01)])
def test_device_sampling_keeps_what_host_sampling_keeps(kw):
    """The kernel's kept set (oracle: ops.ref_sample_keep) equals the host sampler's non-zero probabilities."""
    from hipengine.gpu.ops import ref_sample_keep
    from hipengine.sampling import probabilities

    for seed in range(5):
        logits = (np.random.default_rng(seed).standard_normal(5000) * 3).astype(np.float32)
        params = SamplingParams(temperature=0.8, **kw)
        _, keep, _ = ref_sample_keep(logits, [], 0.8, params.top_k, params.top_p, params.min_p, 1.0)
        assert np.array_equal(keep, probabilities(logits, params) > 0)


def test_attention_plan_covers_the_context():
    from hipengine.gpu.ops import attention_plan

    for ctx in (1, 31, 1024, 4096, 32768, 131072):
        for nkv in (1, 2, 8):
            nsplit, chunk = attention_plan(ctx, nkv, 132)
            assert nsplit * chunk >= ctx and (nsplit - 1) * chunk < ctx and chunk % 32 == 0


def test_mma_plan_covers_k_and_fits_the_scratch():
    """The matrix-core prefill's split plan: every column in exactly one split (whole k-steps, none empty),
    and S · tiles within mma_part_floats' bound when K is split; the constants match prefill.hip."""
    import math
    import re
    from pathlib import Path

    from hipengine.gpu import ops

    src = (Path(ops.__file__).parents[2] / "kernels_hip/ops/prefill.hip").read_text()
    assert re.search(r"kPfBN = 16 \* kPfWarps;", src) and "constexpr int kPfWarps = HE_PF_WARPS;" in src
    assert "kPfStages = HE_PF_STAGES;" in src
    assert "kPfWld = kPfBK + 8;" in src and "kPfXld = kPfBK + 8;" in src and "kPfCld = kPfBN + 4;" in src
    assert ops.MMA_MAX_TILE_ROWS == 128 and "kPfWarps == 4 || kPfWarps == 8" in src and f"kPfBK = {ops.MMA_BK};" in src
    assert ops.mma_shared_bytes(64, 4) == 61440 <= 64 * 1024  # gfx942's LDS per workgroup
    from types import SimpleNamespace
    gfx942 = SimpleNamespace(max_shared_per_block=64 * 1024, num_sms=304)
    h200 = SimpleNamespace(max_shared_per_block=227 * 1024, num_sms=132)
    # 128-token chunks: 4 warps -> 4 stages of 25 KiB, 8 warps -> 3 of 30 KiB (two blocks per SM); gfx942: 2
    assert ops.PREFILL_M == 128
    # Llama-3.2-1B: gate/up (8192 rows of each, 128 tiles of 64 + 64) and the LM head on 8 warps; QKV, O on 4
    assert ops.mma_build(h200) == (4, 4) and ops.mma_build(h200, 8192, 2) == (8, 3)
    assert ops.mma_build(h200, 2048, 0) == (4, 4) and ops.mma_build(h200, 3072, 0) == (4, 4)
    assert ops.mma_build(h200, 128256, 0) == (8, 3)
    # with the weight's columns and the chunk: 8 warps where each K split keeps >= MMA_WIDE_STEPS k-steps
    assert ops.mma_build(h200, 3072, 0, 2048) == (8, 3) and ops.mma_build(h200, 2048, 1, 8192) == (8, 3)
    assert ops.mma_build(h200, 2048, 1, 2048) == (4, 4) and ops.mma_build(h200, 3072, 0, 2048, 64) == (4, 4)
    assert ops.mma_build(gfx942) == (4, 2) and ops.mma_build(gfx942, 128256, 0) == (4, 2)  # 8 warps: no room
    for dev in (h200, gfx942):
        for rows, mode in ((2048, 1), (16384, 2), (128256, 0)):
            b = ops.mma_build(dev, rows, mode)
            assert b.shared_bytes(ops.PREFILL_M) <= min(dev.max_shared_per_block, ops.MMA_SMEM_CAP)
            assert 2 * (b.shared_bytes(ops.PREFILL_M) + 1024) <= 228 * 1024  # two blocks per SM (NVIDIA)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HIPENGINE_MMA_WARPS", "8")
        assert ops.mma_build(h200) == (8, 3) and ops.mma_build(h200, 2048, 1) == (8, 3)
        mp.setenv("HIPENGINE_MMA_WARPS", "6")
        with pytest.raises(ops.UnsupportedError, match="HIPENGINE_MMA_WARPS"):
            ops.mma_build(h200)
    # attention_prefill.hip's shared memory, mirrored by ops.ap_shared_bytes
    ap = (Path(ops.__file__).parents[2] / "kernels_hip/ops/attention_prefill.hip").read_text()
    for c in ("kApKeys = 64;", "kApQ = 16;", "kApKld = kApHd + 8;", "kApVld = kApKeys + 8;",
              "return (void)G, kApKeys * kApKld * 2 + kApHd * kApVld * 2;"):
        assert c in ap, c
    assert ops.ap_shared_bytes(4, 64) == 64 * 72 * 2 + 64 * 72 * 2
    assert ops.ap_shared_bytes(8, 128) == 64 * 136 * 2 + 128 * 72 * 2
    assert re.search(rf"HE_MATMUL_MMA_KERNEL\(matmul_mma_m{ops.PREFILL_M}, {ops.PREFILL_M // 16}\)", src)
    for sms in (8, 132, 304):
        for rows in (1, 13, 576, 960, 2048, 3072, 8192, 128256):
            for inn in (8, 72, 576, 2048, 2056, 8192, 14336):
                for mode in (0, 2):
                    for tr, z in ((64, 1), (128, 1), (64, 2), (64, 8), (128, 4)):
                        tiles, S, kchunk = ops.mma_plan(rows, inn, mode, sms, tr, z)
                        assert tiles == math.ceil(rows / (tr // 2 if mode == 2 else tr))
                        assert kchunk % ops.MMA_BK == 0 and S * kchunk >= inn and (S - 1) * kchunk < inn
                        if S > 1:  # one arrival counter per (row, token) tile; the partial tiles fit
                            assert tiles * z < sms and S * tiles * z * tr * 128 <= ops.mma_part_floats(sms, 128)
    # token tiles: a 100-token chunk is an m128 launch, so its scratch is sized for 128 rows
    assert ops.mma_part_floats(132, 100) == ops.mma_part_floats(132, 128) == 2 * 132 * 128 * 128
    assert ops.mma_supported("sm_90") and ops.mma_supported("gfx942") and not ops.mma_supported("sm_75")
    assert ops.bulk_copy_supported("sm_90a") and not ops.bulk_copy_supported("sm_80")
    assert not ops.bulk_copy_supported("gfx942") and ops.sm_version("gfx942") == 0


def test_mma_token_tiles(monkeypatch):
    """HIPENGINE_MMA_ZTILES cuts a chunk into token tiles only for weights with fewer row tiles than SMs; the
    instantiation holds ceil(M / Z) tokens and the tiles cover M."""
    from hipengine.gpu import ops

    assert ops.mma_token_tiles(128, 32, 132) == (64, 2) and ops.mma_token_tiles(100, 32, 132) == (64, 2)
    assert ops.mma_token_tiles(128, 132, 132) == (128, 1) and ops.mma_token_tiles(16, 32, 132) == (16, 1)
    assert ops.mma_token_tiles(64, 32, 132) == (64, 1)  # no tiles under 64 tokens unless forced
    monkeypatch.setenv("HIPENGINE_MMA_ZTILES", "1")
    assert ops.mma_token_tiles(128, 32, 132) == (128, 1) and ops.mma_token_tiles(100, 32, 132) == (128, 1)
    monkeypatch.setenv("HIPENGINE_MMA_ZTILES", "4")
    assert ops.mma_token_tiles(128, 32, 132) == (32, 4) and ops.mma_token_tiles(128, 132, 132) == (128, 1)
    assert ops.mma_token_tiles(100, 32, 132) == (32, 4) and ops.mma_token_tiles(5, 32, 132) == (16, 1)
    monkeypatch.setenv("HIPENGINE_MMA_ZTILES", "8")
    assert ops.mma_token_tiles(100, 32, 132) == (16, 7)
    for M in range(1, 129):
        for z in ("1", "2", "4", "8"):
            monkeypatch.setenv("HIPENGINE_MMA_ZTILES", z)
            mt, zt = ops.mma_token_tiles(M, 16, 132)
            assert mt in (16, 32, 64, 128) and (zt - 1) * mt < M <= zt * mt
    assert "HIPENGINE_MMA_ZTILES" in ops.MMA_KNOBS  # the chunk graphs are keyed by it
    monkeypatch.setenv("HIPENGINE_MMA_ZTILES", "3")
    with pytest.raises(ops.UnsupportedError, match="HIPENGINE_MMA_ZTILES"):
        ops.mma_token_tiles(128, 32, 132)


def test_attention_plan_caps_splits_when_free():
    """More splits than one combine batch only when 16 splits would need more than one batch of rows."""
    import re
    from pathlib import Path

    from hipengine.gpu import ops

    src = (Path(ops.__file__).parents[2] / "kernels_hip/ops/attention_decode.hip").read_text()
    assert f"kCombineBatch = {ops.ATTN_COMBINE_BATCH};" in src
    assert re.search(rf"kAttnUnroll = {ops.ATTN_UNROLL};", src)
    assert ops.attention_plan(1024, 4, 132) == (16, 64)       # TP=2 rank of llama-3.2-1b at 1K (was 32 x 32)
    assert ops.attention_plan(1024, 8, 132) == (8, 128)       # TP=1: the short-cache plan (SHORT_PLAN_BPS)
    assert ops.attention_plan(8192, 4, 132) == (32, 256)      # 16 splits would be 512 rows: kept
    assert ops.attention_plan(1024, 4, 132, head_dim=128) == (16, 64)  # 64 rows per batch at hd 128: fits
    assert ops.attention_plan(2048, 4, 132, head_dim=128) == (32, 64)  # 128 rows would not: kept
    assert ops.attention_plan(2048, 2, 132) == (16, 128)
    assert ops.attention_plan(32768, 8, 132) == (32, 1024)    # llama-3.2-1b at 32K (v32; was 64 x 512)
    assert ops.attention_plan(32768, 4, 132) == (32, 1024)    # its TP=2 rank: one split per block


def test_matvec_grid_caps(monkeypatch):
    """Decode matvecs: one wave of 2 blocks per SM for the large matrices (v35); the prefill matmul: 3; the
    small matrices need fewer blocks than either cap; a bad knob is one clear error."""
    from types import SimpleNamespace

    from hipengine.errors import UnsupportedError
    from hipengine.gpu import ops

    o = ops.Ops.__new__(ops.Ops)
    o.rt = SimpleNamespace(warp_size=32, num_sms=132)
    assert o._grid(8192) == 264                                    # gate/up of llama-3.2-1b: 2 per SM
    assert o._grid(64128) == 264                                   # LM head (2 rows per unit)
    assert o._grid(1536) == 192 and o._grid(1024) == 128           # QKV, O-proj / down: below the cap
    assert o._grid(8192, blocks_per_sm=ops.prefill_blocks_per_sm()) == 396
    assert o._grid(1) == 1
    monkeypatch.setenv("HIPENGINE_MATVEC_BLOCKS_PER_SM", "4")
    assert o._grid(8192) == 528
    for bad in ("0", "two"):
        monkeypatch.setenv("HIPENGINE_MATVEC_BLOCKS_PER_SM", bad)
        with pytest.raises(UnsupportedError, match=f"HIPENGINE_MATVEC_BLOCKS_PER_SM={bad}"):
            o._grid(8192)


def test_prefill_build_knobs(monkeypatch):
    """attention_prefill's and matmul_mma's build defines: the defaults match the kernels' own (so `kernels
    check` compiles what runs), the A/B knobs override them, bad values are refused."""
    from pathlib import Path

    from hipengine.gpu import ops

    ap = (Path(ops.__file__).parents[2] / "kernels_hip/ops/attention_prefill.hip").read_text()
    pf = (Path(ops.__file__).parents[2] / "kernels_hip/ops/prefill.hip").read_text()
    assert "#define HE_AP_MIN_BLOCKS (HE_AP_HD <= 64 ? 4 : 0)\n" in ap
    assert [ops.ap_min_blocks(hd) for hd in (16, 64, 80, 128)] == [4, 4, 0, 0]
    assert "#define HE_AP_XSPLIT 1\n" in ap and "#define HE_PF_XSPLIT 1\n" in pf
    assert ops.ap_defines(64) == {"HE_AP_HD": 64, "HE_AP_XSPLIT": 1, "HE_AP_MIN_BLOCKS": 4}
    assert ops.ap_defines(128)["HE_AP_MIN_BLOCKS"] == 0
    assert ops.MmaBuild(4, 6).defines() == {"HE_PF_WARPS": 4, "HE_PF_STAGES": 6, "HE_PF_XSPLIT": 1}
    monkeypatch.setenv("HIPENGINE_AP_MIN_BLOCKS", "0")
    monkeypatch.setenv("HIPENGINE_PREFILL_SPLIT", "0")
    assert ops.ap_defines(128) == {"HE_AP_HD": 128, "HE_AP_XSPLIT": 0, "HE_AP_MIN_BLOCKS": 0}
    assert ops.MmaBuild(8, 3).defines()["HE_PF_XSPLIT"] == 0
    for knob in ("HIPENGINE_AP_MIN_BLOCKS", "HIPENGINE_PREFILL_SPLIT"):  # the chunk graphs are keyed by them
        assert knob in ops.MMA_KNOBS
    for bad in ("9", "x", "-1"):
        monkeypatch.setenv("HIPENGINE_AP_MIN_BLOCKS", bad)
        with pytest.raises(ops.UnsupportedError, match="HIPENGINE_AP_MIN_BLOCKS"):
            ops.ap_defines(64)
    monkeypatch.setenv("HIPENGINE_AP_MIN_BLOCKS", "4")
    monkeypatch.setenv("HIPENGINE_PREFILL_SPLIT", "2")
    with pytest.raises(ops.UnsupportedError, match="HIPENGINE_PREFILL_SPLIT"):
        ops.ap_defines(64)
    monkeypatch.delenv("HIPENGINE_PREFILL_SPLIT")
    # query tiles per block: the knob's value, capped at 16 warps and 1,024 threads (he_ap_qtiles mirrors it)
    assert "HIPENGINE_AP_QTILES" in ops.MMA_KNOBS and ops.ap_qtiles(4, 32) == ops.AP_QTILES
    assert [ops.ap_qtiles(G, 32, 4) for G in (1, 4, 5, 8)] == [4, 4, 3, 2]
    assert [ops.ap_qtiles(G, 64, 4) for G in (1, 4, 5, 8)] == [4, 4, 3, 2]
    assert ops.ap_qtiles(8, 64, 2) == 2 and ops.ap_qtiles(6, 32, 1) == 1
    src = ap.split("constexpr int he_ap_qtiles(int g) {")[1].split("}")[0]
    assert "16 / g" in src and "1024 / (g * kWarpSize)" in src
    monkeypatch.setenv("HIPENGINE_AP_QTILES", "2")
    assert ops.ap_defines(64)["HE_AP_QTILES"] == 2 and ops.ap_qtiles(4, 32) == 2
    monkeypatch.setenv("HIPENGINE_AP_QTILES", "3")
    with pytest.raises(ops.UnsupportedError, match="HIPENGINE_AP_QTILES"):
        ops.ap_defines(64)


def test_attention_plan_two_rounds_where_one_spills(monkeypatch):
    """The per-op plan (v48): one (KV head, split) block per SM unless that plan spills past one round of the
    SMs, then two full rounds (llama-3.2-1b on 132 SMs: 16K takes 32 splits of 512 instead of 17 of 992; 8K
    and 32K keep their plans, and so does every cache of a TP=2 rank). The monokernel's (one_round, session 29):
    one round of num_sms // num_kv_heads splits of up to 2,048 positions first (llama-3.2-1b: 16 splits at every
    cache from 2K up to 32K; caches up to 1K: test_attention_plan_short_caches). HIPENGINE_ATTN_BLOCKS_PER_SM
    overrides both; bad values are one clear error."""
    from hipengine.errors import UnsupportedError
    from hipengine.gpu import ops

    for var in ("HIPENGINE_ATTN_BLOCKS_PER_SM", "HIPENGINE_ATTN_SPLIT_CAP", "HIPENGINE_ATTN_MAX_CHUNK"):
        monkeypatch.delenv(var, raising=False)
    assert ops.attention_plan(16384, 8, 132) == (32, 512)
    assert ops.attention_plan(12288, 8, 132) == (32, 384)
    assert ops.attention_plan(8192, 8, 132) == (16, 512)
    assert ops.attention_plan(8704, 8, 132) == (31, 288)  # 17 splits of 512 would spill
    assert ops.attention_plan(2048, 8, 132) == (16, 128)
    assert ops.attention_plan(32768, 8, 132) == (32, 1024)
    for ctx in (1024, 4096, 8192, 16384, 32768):
        assert ops.attention_plan(ctx, 4, 132) == ops.attention_plan(ctx, 4, 132, blocks_per_sm=1.0)
    one = lambda ctx, nkv=8: ops.attention_plan(ctx, nkv, 132, one_round=True)  # noqa: E731
    assert [one(c) for c in (1024, 8192, 8704, 12288, 16384, 32768)] == [
        (8, 128), (16, 512), (16, 544), (16, 768), (16, 1024), (16, 2048)]
    assert one(49152) == (48, 1024)  # 2,048-position splits would need 24: the per-op plan's two rounds
    for ctx in (1024, 4096, 8192, 16384, 32768):  # the same where the KV heads divide the SMs
        for nkv in (2, 3, 4):
            assert one(ctx, nkv) == ops.attention_plan(ctx, nkv, 132), (ctx, nkv)
    for ctx in (1, 100, 1024, 12288, 32768, 49152, 65536, 131072):  # never more splits (monokernel.mk_plan)
        for nkv in (1, 2, 3, 4, 8, 16):
            assert one(ctx, nkv)[0] <= ops.attention_plan(ctx, nkv, 132)[0], (ctx, nkv)
    monkeypatch.setenv("HIPENGINE_ATTN_BLOCKS_PER_SM", "1")
    assert ops.attention_plan(16384, 8, 132) == (17, 992) == one(16384)
    monkeypatch.setenv("HIPENGINE_ATTN_BLOCKS_PER_SM", "2")
    assert ops.attention_plan(8192, 8, 132) == (32, 256)
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv("HIPENGINE_ATTN_BLOCKS_PER_SM", bad)
        with pytest.raises(UnsupportedError, match="HIPENGINE_ATTN_BLOCKS_PER_SM"):
            ops.attention_plan(8192, 8, 132)


def test_attention_plan_short_caches(monkeypatch):
    """Caches of up to 1K positions take half a (KV head, split) block per SM on both paths (ops.SHORT_PLAN_BPS):
    llama-3.2-1b 8 splits of 128 at 1K instead of 16 of 64; larger caches, and an explicit blocks per SM, keep
    the rules they had. The default model's 3 KV heads and a TP=2 rank's 4 keep 16 splits of 64 at 1K."""
    from hipengine.gpu import monokernel as M
    from hipengine.gpu import ops

    for var in ("HIPENGINE_ATTN_BLOCKS_PER_SM", "HIPENGINE_ATTN_SPLIT_CAP", "HIPENGINE_ATTN_MAX_CHUNK",
                "HIPENGINE_MK_ONE_ROUND", "HIPENGINE_MK_FINE"):
        monkeypatch.delenv(var, raising=False)
    assert ops.SHORT_PLAN_CTX == 1024
    assert ops.attention_plan(1024, 8, 132) == ops.attention_plan(1024, 8, 132, one_round=True) == (8, 128)
    assert ops.attention_plan(512, 8, 132) == (8, 64)
    assert ops.attention_plan(2048, 8, 132) == ops.attention_plan(2048, 8, 132, one_round=True) == (16, 128)
    assert ops.attention_plan(1024, 8, 132, blocks_per_sm=1.0) == (16, 64)
    assert ops.attention_plan(1024, 3, 132) == ops.attention_plan(1024, 4, 132) == (16, 64)
    assert M.mk_plan(1024, 8, 132) == (8, 128) and M.mk_fine(1024, 8, 132) == 3  # 64 items: one round
    monkeypatch.setenv("HIPENGINE_ATTN_BLOCKS_PER_SM", "1")
    assert ops.attention_plan(1024, 8, 132) == (16, 64)  # the old plan, for A/B


def test_pdl_late_roles(monkeypatch):
    """v48: the O-proj and the attention split trigger the next launch after their wait by default, v52: the
    down-projection once its input is staged; HIPENGINE_PDL_LATE / _STAGED name other roles (commas or "+"),
    "none" none; unknown roles are one clear error; the modules are built with HE_PDL_LATE=1 / 2, the others
    without it."""
    from hipengine.errors import UnsupportedError
    from hipengine.gpu import ops

    monkeypatch.delenv("HIPENGINE_PDL_LATE", raising=False)
    assert ops.pdl_late_roles() == {"o", "attn"}
    monkeypatch.setenv("HIPENGINE_PDL_LATE", "o+down,qkv")
    assert ops.pdl_late_roles() == {"o", "down", "qkv"}
    monkeypatch.setenv("HIPENGINE_PDL_LATE", "none")
    assert ops.pdl_late_roles() == frozenset()
    monkeypatch.setenv("HIPENGINE_PDL_LATE", "o,oproj")
    with pytest.raises(UnsupportedError, match="HIPENGINE_PDL_LATE: unknown role"):
        ops.pdl_late_roles()
    monkeypatch.delenv("HIPENGINE_PDL_LATE")
    o = ops.Ops.__new__(ops.Ops)
    o.pdl, o.pdl_levels = True, ops.pdl_trigger_levels()
    assert o._late("o") == {"HE_PDL_LATE": 1} and o._late("attn") == {"HE_PDL_LATE": 1}
    assert o._late("qkv") == {} and o._late("") == {}
    # v52: the down-projection triggers once its input is staged by default (HE_PDL_LATE=2)
    assert o._late("down") == {"HE_PDL_LATE": 2}
    o.pdl = False  # no programmatic launch (AMD, HIPENGINE_PDL=0): one build for every role
    assert o._late("o") == {} and o._late("down") == {}
    # HIPENGINE_PDL_STAGED names matvec roles (staged wins over late), "none" none; a role that is not a
    # matvec is one clear error
    o.pdl = True
    monkeypatch.setenv("HIPENGINE_PDL_STAGED", "o+gate_up")
    assert ops.pdl_trigger_levels() == {"o": 2, "attn": 1, "gate_up": 2}
    o.pdl_levels = ops.pdl_trigger_levels()
    assert o._late("o") == {"HE_PDL_LATE": 2} and o._late("down") == {}
    monkeypatch.setenv("HIPENGINE_PDL_STAGED", "none")
    assert ops.pdl_trigger_levels() == {"o": 1, "attn": 1}
    monkeypatch.setenv("HIPENGINE_PDL_STAGED", "attn")
    with pytest.raises(UnsupportedError, match="HIPENGINE_PDL_STAGED: attn is not a matvec role"):
        ops.pdl_trigger_levels()


def test_attention_one_kernel_rule(monkeypatch):
    """Decode attention runs as one kernel when its grid puts more than 1.5 blocks on an SM (v36, llama-3.2-1b
    on 132 SMs: it loses at 1K / 8K with 128 blocks and at 16K with 136, wins at 32K with 256; since v48 the
    16K plan has 256 blocks too); the knob forces either form; a bad value is one clear error."""
    from hipengine.errors import UnsupportedError
    from hipengine.gpu import ops

    monkeypatch.delenv("HIPENGINE_ATTN_ONE_KERNEL", raising=False)
    monkeypatch.delenv("HIPENGINE_ATTN_BLOCKS_PER_SM", raising=False)
    for ctx, one in ((1024, False), (8192, False), (16384, True), (32768, True)):
        nsplit, _ = ops.attention_plan(ctx, 8, 132)
        assert ops.attention_one_kernel(8 * nsplit, 132) == one, ctx
    monkeypatch.setenv("HIPENGINE_ATTN_ONE_KERNEL", "1")
    assert ops.attention_one_kernel(128, 132)
    monkeypatch.setenv("HIPENGINE_ATTN_ONE_KERNEL", "0")
    assert not ops.attention_one_kernel(256, 132)
    monkeypatch.setenv("HIPENGINE_ATTN_ONE_KERNEL", "yes")
    with pytest.raises(UnsupportedError, match="HIPENGINE_ATTN_ONE_KERNEL"):
        ops.attention_one_kernel(128, 132)


def test_matvec_rows1_rule(monkeypatch):
    """One-row units (matvec_rows1) where a two-row unit streams in several rounds and two-row units leave the
    grid short of its cap (v37): llama-3.2-1b's down-projection only, on NVIDIA (warp 32, 132 SMs) and on
    MI300X (wave 64, 304 CUs: a pair of batches covers 4,096 columns there); the knob forces either form; PDL
    roles are checked by name."""
    from hipengine.errors import UnsupportedError
    from hipengine.gpu import ops

    monkeypatch.delenv("HIPENGINE_MATVEC_ROWS1", raising=False)
    monkeypatch.delenv("HIPENGINE_MATVEC_BLOCKS_PER_SM", raising=False)
    cases = {(2048, 8192): True, (2048, 2048): False, (3072, 2048): False, (128256, 2048): False,
             (8192, 2048): False, (2048, 4096): True}  # down, O, QKV rows, LM head, gate/up rows, TP=2 down
    for (rows, inn), want in cases.items():
        assert ops.matvec_rows1(rows, inn, 32, 132) == want, (rows, inn)
    assert ops.matvec_rows1(2048, 8192, 64, 304) and not ops.matvec_rows1(2048, 4096, 64, 304)
    assert not ops.matvec_rows1(64128, 8192, 32, 132)  # two-row units fill the grid already
    monkeypatch.setenv("HIPENGINE_MATVEC_ROWS1", "0")
    assert not ops.matvec_rows1(2048, 8192, 32, 132)
    monkeypatch.setenv("HIPENGINE_MATVEC_ROWS1", "1")
    assert ops.matvec_rows1(2048, 2048, 32, 132)
    monkeypatch.setenv("HIPENGINE_MATVEC_ROWS1", "on")
    with pytest.raises(UnsupportedError, match="HIPENGINE_MATVEC_ROWS1"):
        ops.matvec_rows1(2048, 8192, 32, 132)
    monkeypatch.setenv("HIPENGINE_PDL_OFF", "o, down")
    assert ops.pdl_off_roles() == {"o", "down"}
    monkeypatch.setenv("HIPENGINE_PDL_OFF", "o+down")
    assert ops.pdl_off_roles() == {"o", "down"}
    monkeypatch.setenv("HIPENGINE_PDL_OFF", "o,oproj")
    with pytest.raises(UnsupportedError, match="oproj"):
        ops.pdl_off_roles()


def test_tp_not_supported_yet():
    from hipengine.gpu.executor import GpuBackend

    class Fake:
        config = None

    with pytest.raises(UnsupportedError, match="tensor parallelism"):
        GpuBackend(Fake(), tp=2)


_TINY: dict = {}


def _tiny_model(kind, tmp_path_factory):
    """A tiny transformers model of `kind`, saved and loaded once per session."""
    if kind not in _TINY:
        from hipengine.loader import load_model
        from tiny_models import save_tiny_model

        path, _ = save_tiny_model(kind, tmp_path_factory.mktemp(f"tiny_{kind}"), seed=3,
                                  max_position_embeddings=1024)
        _TINY[kind] = load_model(path, progress=False)
    return _TINY[kind]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_model("llama", tmp_path_factory)


# llama: head_dim 24 (not a power of two); llama3: rope scaling, G = 4, head_dim 8; qwen2: q/k/v bias;
# qwen3: per-head q/k norm (the unfused QKV path); smollm: tied embeddings, G = 3.
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "qwen3", "smollm"])
def test_tiny_teacher_forced(kind, tmp_path_factory):
    from hipengine.gpu.executor import GpuBackend
    from hipengine.reference import ReferenceBackend

    tiny = _tiny_model(kind, tmp_path_factory)

    ids = np.random.default_rng(0).integers(3, tiny.config.vocab_size, 512)
    ref = ReferenceBackend(tiny, max_context=1024)
    want = ref.prefill(ids, all_logits=True)
    gpu = GpuBackend(tiny, max_context=1024, monokernel=False)
    try:
        got = gpu.prefill(ids, all_logits=True)  # prefill path (small-M matmuls, 8-token chunks)
        agree, n = _agreement(got, want)
        assert agree >= 0.99, f"prefill top-1 agreement {agree:.3f} over {n}"
        assert _rel_err(got, want) <= 2e-2
        gpu.reset()  # decode path: 256 prefilled, 256 decoded one by one (the captured graph)
        dec = [gpu.prefill(ids[:256], all_logits=True)]
        dec += [gpu.decode(int(t))[None] for t in ids[256:]]
        dec = np.concatenate(dec)[:-1]
        agree, n = _agreement(dec, want[:-1])
        assert agree >= 0.99, f"decode top-1 agreement {agree:.3f} over {n}"
        assert _rel_err(dec, want[:-1]) <= 2e-2
    finally:
        gpu.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fused,graph", [("0", "1"), ("1", "1"), ("1", "0")])
def test_tiny_greedy_matches_cpu(tiny, monkeypatch, fused, graph):
    """fused: HIPENGINE_FUSED_PICK (greedy steps end in argmax_step, or in decode_advance + argmax + emit);
    graph "0": every step launched eagerly (HIPENGINE_NO_GRAPH=1) — with programmatic dependent launch a
    kernel may start while the step's end that writes the position is still running, so this catches a
    position or token read before he_pdl_wait (port.h he_ld_step)."""
    from hipengine.gpu.executor import GpuBackend
    from hipengine.reference import ReferenceBackend

    monkeypatch.setenv("HIPENGINE_FUSED_PICK", fused)
    monkeypatch.setenv("HIPENGINE_NO_GRAPH", "0" if graph == "1" else "1")

    prompt = np.array([5, 17, 99, 42, 7, 250, 31], np.int64)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    cpu = list(ReferenceBackend(tiny, max_context=1024).generate_ids(prompt, params, lambda: False))
    gpu = GpuBackend(tiny, max_context=1024, monokernel=False)
    try:
        got = list(gpu.generate_ids(prompt, params, lambda: False))
        sampled = list(gpu.generate_ids(prompt, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7,
                                                               ignore_eos=True), lambda: False))
        again = list(gpu.generate_ids(prompt, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7,
                                                             ignore_eos=True), lambda: False))
    finally:
        gpu.close()
    assert got == cpu
    assert sampled == again and len(sampled) == 16  # seeded device sampling replays


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen3"])
def test_pdl_launches_match_stream_order(kind, tmp_path_factory):
    """With programmatic dependent launch (Ops.pdl) each kernel may start before the previous one ends; every
    kernel waits (he_pdl_wait) before it touches that kernel's data, so prefill and 256 decode steps must give
    the same logits, bit for bit, as plain stream order. A missing or misplaced wait shows up here as a race:
    the tiny models' kernels are short, so consecutive kernels overlap almost entirely."""
    from hipengine.gpu.executor import GpuBackend

    model = _tiny_model(kind, tmp_path_factory)
    ids = np.random.default_rng(5).integers(3, model.config.vocab_size, 300)
    runs = {}
    for pdl in (True, False):
        gpu = GpuBackend(model, max_context=1024, monokernel=False)
        try:
            if pdl and not gpu.ops.pdl:
                pytest.skip("this runtime launches in plain stream order only (no programmatic dependent launch)")
            gpu.ops.pdl = pdl
            out = [gpu.prefill(ids[:44], all_logits=True)]
            out += [gpu.decode(int(t))[None] for t in ids[44:]]
            runs[pdl] = np.concatenate(out)
        finally:
            gpu.close()
    assert np.array_equal(runs[True], runs[False])


@pytest.mark.gpu
def test_llama_1b_preset():
    presets = pytest.importorskip("hipengine.presets")
    from hipengine.gpu.executor import GpuBackend
    from hipengine.reference import ReferenceBackend

    model = presets.preset_model("llama-3.2-1b", 0)
    n = 512  # issue 3's bar; the float32 CPU reference needs ~6 GB and a few seconds on the GPU machine
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, n)
    gpu = GpuBackend(model, max_context=1024, monokernel=False)
    try:
        got = gpu.prefill(ids, all_logits=True)
    finally:
        gpu.close()
    ref = ReferenceBackend(model, max_context=1024)
    want = ref.prefill(ids, all_logits=True)
    print(f"1B preset: {n} teacher-forced positions")
    # bf16 weights: relative error per dot product ~ 2^-8/sqrt-ish; bound the logit error by 2^-7 of the range
    bound = 2 ** -7 * float(np.abs(want).max())
    agree, m = _agreement(got, want, bound)
    assert m >= n // 4, f"only {m} of {n} positions have a clear top-1"
    assert agree >= 0.99, f"1B preset top-1 agreement {agree:.3f} over {m} clear positions"
    assert _rel_err(got, want) <= 2e-2


# ---- the executor's wiring on the CPU ------------------------------------------------------------------------
# A runtime that executes each kernel launch with the numpy oracles of hipengine/gpu/ops.py over an emulated
# device memory. The kernels are proven on the GPU (test_ops_gpu.py); this proves that the executor hands them
# the right buffers, offsets, layouts and positions (stacked QKV, the Qwen3 unfused path, biases, tied heads,
# prefill chunks, the captured decode graph, device-side sampling state) for every tiny architecture.
import ctypes  # noqa: E402

from hipengine.gpu import ops as O  # noqa: E402
from hipengine.gpu.runtime import DeviceBuffer, HostBuffer  # noqa: E402

BASE = 1 << 32  # fake device addresses start here, so a host pointer mix-up cannot alias


class _Fn:
    def __init__(self, name):
        self.name = name


class _Mod:
    def function(self, name):
        return _Fn(name)


class _Stream:
    def synchronize(self):
        pass


class _Graph:
    def __init__(self, rt, launches):
        self.rt, self.launches = rt, launches

    def launch(self, stream=None):
        for item in self.launches:
            self.rt._execute(*item)

    def destroy(self):
        pass


class EmulatedRuntime:
    vendor, device_index, name, arch = "emulated", 0, "numpy", "sm_90"
    warp_size, num_sms, max_shared_per_block, l2_bytes, total_mem = 32, 132, 227 * 1024, 60 << 20, 1 << 30

    def __init__(self, nbytes=256 << 20):
        self.mem = np.zeros(nbytes, np.uint8)
        self.top = 0
        self.capturing = None
        self.kv_f16 = False
        self.attn_fresh = False

    # cache policy (an emulated device has no L2 to steer: as the Runtime base class, AMD's) --------------------
    def l2_persist(self, stream, base, nbytes):
        return 0

    def l2_persist_reset(self, stream=None):
        pass

    # memory ---------------------------------------------------------------------------------------------
    def malloc(self, n):
        p = self.top
        self.top += (int(n) + 255) // 256 * 256
        assert self.top <= self.mem.size, "emulated device memory exhausted"
        return DeviceBuffer(BASE + p, int(n), self)

    def _free(self, buf):
        pass

    def host_alloc_mapped(self, n):  # "mapped host memory" is emulated device memory the host reads directly
        buf = self.malloc(n)
        return HostBuffer(self.view(buf.ptr, np.uint8, int(n)), buf.ptr, self, 0)

    def view(self, ptr, dtype, count):
        off = int(ptr) - BASE
        assert 0 <= off and off + count * np.dtype(dtype).itemsize <= self.mem.size, "wild pointer"
        return self.mem[off:off + count * np.dtype(dtype).itemsize].view(dtype)

    def _addr(self, x):
        return x.ptr if isinstance(x, DeviceBuffer) else int(x)

    def copy_htod(self, dst, src, stream=None):
        src = np.ascontiguousarray(src)
        self.view(self._addr(dst), np.uint8, src.nbytes)[:] = src.view(np.uint8).reshape(-1)

    def copy_dtoh(self, dst, src, stream=None):
        dst.view(np.uint8).reshape(-1)[:] = self.view(self._addr(src), np.uint8, dst.nbytes)

    def copy_dtod(self, dst, src, nbytes, stream=None):
        self.view(self._addr(dst), np.uint8, nbytes)[:] = self.view(self._addr(src), np.uint8, nbytes).copy()

    def memset(self, dst, value, nbytes, stream=None):
        self.view(self._addr(dst), np.uint8, nbytes)[:] = value

    def upload(self, a):
        b = self.malloc(max(a.nbytes, 1))
        self.copy_htod(b, a)
        return b

    def download(self, src, shape, dtype):
        out = np.empty(shape, dtype)
        self.copy_dtoh(out, src)
        return out

    def mem_info(self):
        return self.mem.size - self.top, self.mem.size

    # code / execution -----------------------------------------------------------------------------------
    def compile(self, source, **kw):
        defines = kw.get("defines") or {}
        self.kv_f16 = bool(defines.get("HE_KV_F16", 0))  # port.h's he_kv element type
        if "HE_ATTN_LPR" in defines:  # the attention module: whether its splits leave the newest row to the combine
            self.attn_fresh = bool(defines.get("HE_ATTN_FRESH_COMBINE", 0))
        return _Mod()

    def _kv_enc(self, a):
        return np.asarray(a, np.float32).astype(np.float16).view(np.uint16) if self.kv_f16 else O.to_bf16(
            np.asarray(a, np.float32))

    def _kv_dec(self, bits):
        return bits.view(np.float16).astype(np.float32) if self.kv_f16 else O.from_bf16(bits)

    def stream(self):
        return _Stream()

    def synchronize(self):
        pass

    def begin_capture(self, stream):
        self.capturing = []

    def end_capture(self, stream):
        g, self.capturing = _Graph(self, self.capturing), None
        return g

    def launch(self, fn, grid, block, args, shared=0, stream=None, cooperative=False, pdl=False):
        vals = [a.value if isinstance(a, ctypes._SimpleCData) else a for a in args]
        vals = [0 if v is None else v for v in vals]
        grid = (grid, 1) if isinstance(grid, int) else tuple(grid)
        if self.capturing is not None:
            self.capturing.append((fn.name, grid, vals))
        else:
            self._execute(fn.name, grid, vals)

    # the kernels, as numpy ------------------------------------------------------------------------------
    def _f32(self, p, n):
        return self.view(p, np.float32, n)

    def _w(self, p, rows, inn, f16):
        return O.bits_to_f64(self.view(p, np.uint16, rows * inn), bool(f16)).reshape(rows, inn)

    def _norm(self, x, gamma_p, eps, n):
        return O.ref_rmsnorm(x, None if not gamma_p else self._f32(gamma_p, n), eps)

    def _execute(self, name, grid, v):
        name = re.sub(r"^(attention_split|attention_decode|attention_prefill)_g\d+$", r"\1", name)
        getattr(self, "_k_" + re.sub(r"^matmul_mma_m\d+$", "matmul_mma", name))(grid, *v)

    def _k_embedding(self, grid, table, tokens, vocab, hidden, out, f16, fx=0):
        T = grid[0]
        tok = self.view(tokens, np.int32, T)
        tab = self._w(table, vocab, hidden, f16)
        self._f32(out, T * hidden)[:] = np.stack([tab[t] for t in tok]).reshape(-1)
        if fx:
            self.view(fx, np.int64, hidden)[:] = 0

    def _plus_fx(self, x, fx, n):  # x + the fused MLP's fixed-point addend (ops/mlp.hip), in fp32 as the kernels
        if not fx:
            return x
        return (np.asarray(x, np.float32) + self.view(fx, np.int64, n).astype(np.float32) * np.float32(2.0 ** -32))

    def _k_rmsnorm(self, grid, x, gamma, eps, n, y):
        rows = grid[0]
        xs = self._f32(x, rows * n).reshape(rows, n).astype(np.float64)
        self._f32(y, rows * n)[:] = self._norm(xs, gamma, eps, n).reshape(-1)

    def _k_matvec(self, grid, W, x, gamma, eps, residual, y, rows, inn, f16, x_fx=0, res_fx=0):
        xe = self._plus_fx(self._f32(x, inn), x_fx, inn)
        r = self._w(W, rows, inn, f16) @ self._norm(np.asarray(xe, np.float64), gamma, eps, inn)
        if residual:
            r = r + self._plus_fx(self._f32(residual, rows), res_fx, rows)
        if res_fx:
            self.view(res_fx, np.int64, rows)[:] = 0
        self._f32(y, rows)[:] = r

    def _k_matvec_group_o(self, grid, W, att, x, y_fx, inn, rows, f16):  # ops/matvec_group.hip: the whole residual
        r = self._w(W, rows, inn, f16) @ self._f32(att, inn).astype(np.float64) + self._f32(x, rows)
        self.view(y_fx, np.int64, rows)[:] += np.round(r * 2.0 ** 32).astype(np.int64)

    def _k_matvec_gate_up_fx(self, grid, Wg, Wu, x_fx, gamma, eps, y, rows, inn, f16):
        xe = self._plus_fx(np.zeros(inn, np.float32), x_fx, inn)
        xn = self._norm(np.asarray(xe, np.float64), gamma, eps, inn)
        self._f32(y, rows)[:] = O.ref_silu(self._w(Wg, rows, inn, f16) @ xn) * (self._w(Wu, rows, inn, f16) @ xn)

    def _k_matvec_fx_res(self, grid, W, x, res_fx, y, rows, inn, f16):
        r = self._w(W, rows, inn, f16) @ self._f32(x, inn).astype(np.float64)
        self._f32(y, rows)[:] = r + self._plus_fx(np.zeros(rows, np.float32), res_fx, rows)
        self.view(res_fx, np.int64, rows)[:] = 0

    _k_matvec_rows1_fx_res = _k_matvec_fx_res  # its one-row-unit kernel (matvec.hip): the same result

    def _k_mlp_fused(self, grid, Wg, Wu, WdT, x, gamma, eps, y_fx, d, F, f16):
        xn = self._norm(self._f32(x, d).astype(np.float64), gamma, eps, d)
        h = O.ref_silu(self._w(Wg, F, d, f16) @ xn) * (self._w(Wu, F, d, f16) @ xn)
        out = self._w(WdT, F, d, f16).T @ h
        self.view(y_fx, np.int64, d)[:] += np.round(out * 2.0 ** 32).astype(np.int64)

    def _k_matvec_gate_up(self, grid, Wg, Wu, x, gamma, eps, y, rows, inn, f16):
        xn = self._norm(self._f32(x, inn).astype(np.float64), gamma, eps, inn)
        self._f32(y, rows)[:] = O.ref_silu(self._w(Wg, rows, inn, f16) @ xn) * (self._w(Wu, rows, inn, f16) @ xn)

    def _k_matvec_qkv(self, grid, W, x, gamma, eps, bias, cos, sin, pos, q_out, kc, vc, max_ctx, q_dim, kv_dim, hd,
                      inn, rope, f16, x_fx=0):
        rows = q_dim + 2 * kv_dim
        xe = self._plus_fx(self._f32(x, inn), x_fx, inn)
        qkv = self._w(W, rows, inn, f16) @ self._norm(np.asarray(xe, np.float64), gamma, eps, inn)
        if bias:
            qkv = qkv + self._f32(bias, rows)
        if not rope:
            self._f32(q_out, rows)[:] = qkv
            return
        tmp = self.malloc(rows * 4)
        self._f32(tmp.ptr, rows)[:] = qkv
        self._k_qk_norm_rope((q_dim // hd + 2 * kv_dim // hd, 1), tmp.ptr, 0, 0, 0.0, cos, sin, pos, q_out, kc, vc,
                             max_ctx, q_dim // hd, kv_dim // hd, hd)

    def _k_matmul_small_m(self, grid, W, W2, X, bias, Y, M, rows, inn, mode, f16):
        Xs = self._f32(X, M * inn).reshape(M, inn).astype(np.float64)
        r = Xs @ self._w(W, rows, inn, f16).T
        y = self._f32(Y, M * rows).reshape(M, rows)
        if mode == 0:
            y[:] = r + (self._f32(bias, rows) if bias else 0)
        elif mode == 1:
            y[:] = y + r
        else:
            y[:] = O.ref_silu(r) * (Xs @ self._w(W2, rows, inn, f16).T)

    def _k_matmul_mma(self, grid, W, W2, X, bias, Y, M, rows, inn, mode, f16, kchunk, rotate, part, count):
        assert grid[1] * kchunk >= inn and kchunk % O.MMA_BK == 0 and part and count  # the split plan covers K
        self._k_matmul_small_m(grid, W, W2, X, bias, Y, M, rows, inn, mode, f16)

    def _k_qk_norm_rope(self, grid, qkv, qn, kn, eps, cos, sin, pos, q_out, kc, vc, max_ctx, nh, nkv, hd):
        T, half = grid[1], hd // 2
        p0 = int(self.view(pos, np.int32, 1)[0])
        W = (nh + 2 * nkv) * hd
        x = self._f32(qkv, T * W).reshape(T, W).astype(np.float64)
        cs = self._f32(cos, max_ctx * half).reshape(max_ctx, half)
        sn = self._f32(sin, max_ctx * half).reshape(max_ctx, half)
        K = self.view(kc, np.uint16, nkv * max_ctx * hd).reshape(nkv, max_ctx, hd)
        V = self.view(vc, np.uint16, nkv * max_ctx * hd).reshape(nkv, max_ctx, hd)
        for t in range(T):
            p = p0 + t
            q = x[t, :nh * hd].reshape(nh, hd)
            k = x[t, nh * hd:(nh + nkv) * hd].reshape(nkv, hd)
            v = x[t, (nh + nkv) * hd:].reshape(nkv, hd)
            if qn:
                q = O.ref_rmsnorm(q, self._f32(qn, hd), eps)
            if kn:
                k = O.ref_rmsnorm(k, self._f32(kn, hd), eps)
            c, s = cs[p].astype(np.float64), sn[p].astype(np.float64)
            self._f32(q_out + t * nh * hd * 4, nh * hd)[:] = O.ref_rope(q, c, s).reshape(-1)
            K[:, p] = self._kv_enc(O.ref_rope(k, c, s))
            V[:, p] = self._kv_enc(v)

    def _k_attention_split(self, grid, q, kc, vc, partial, pos, nsplit, chunk, nh, nkv, hd, max_ctx, early_pos=0,
                           fresh=None):
        T, G = grid[1], nh // nkv
        fresh = self.attn_fresh if fresh is None else fresh  # HE_ATTN_FRESH_COMBINE: the newest row is the combine's
        p0 = int(self.view(pos, np.int32, 1)[0])
        K = self._kv_dec(self.view(kc, np.uint16, nkv * max_ctx * hd)).reshape(nkv, max_ctx, hd).astype(np.float64)
        V = self._kv_dec(self.view(vc, np.uint16, nkv * max_ctx * hd)).reshape(nkv, max_ctx, hd).astype(np.float64)
        Q = self._f32(q, T * nh * hd).reshape(T, nh, hd).astype(np.float64)
        P = self._f32(partial, T * nh * nsplit * (hd + 2)).reshape(T, nh, nsplit, hd + 2)
        for t in range(T):
            seq = p0 + t + 1
            for h in range(nh):
                s_all = K[h // G, :seq] @ Q[t, h] / np.sqrt(hd) * np.log2(np.e)
                for sp in range(nsplit):
                    a, b = sp * chunk, min(seq - int(fresh), (sp + 1) * chunk)
                    if a >= b:
                        P[t, h, sp, hd], P[t, h, sp, hd + 1] = -np.inf, 0.0
                        continue
                    s = s_all[a:b]
                    m = s.max()
                    e = np.exp2(s - m)
                    P[t, h, sp, :hd] = e @ V[h // G, a:b]
                    P[t, h, sp, hd], P[t, h, sp, hd + 1] = m, e.sum()

    def _k_attention_prefill(self, grid, q, kc, vc, partial, pos, T, nsp, nh, nkv, hd, max_ctx):
        assert grid == (nkv * nsp, -(-T // 16)) and nsp <= O.AP_MAX_SPLITS
        p0 = int(self.view(pos, np.int32, 1)[0])
        length = -(-(-(-(p0 + T) // nsp)) // 64) * 64  # the splits: whole 64-key steps over [0, pos + T)
        self._k_attention_split((nkv * nsp, T), q, kc, vc, partial, pos, nsp, length, nh, nkv, hd, max_ctx,
                                fresh=False)

    def _k_attention_decode(self, grid, q, kc, vc, partial, pos, count, out, nsplit, chunk, nh, nkv, hd, max_ctx,
                            early):
        assert not any(self.view(count, np.uint32, nkv)), "arrival counters must be left at zero"
        self._k_attention_split(grid, q, kc, vc, partial, pos, nsplit, chunk, nh, nkv, hd, max_ctx)
        self._k_attention_combine((nh, 1), partial, pos, nsplit, nh, hd, out, 0, q, kc, vc, nkv, max_ctx,
                                  int(self.attn_fresh))

    def _k_attention_combine(self, grid, partial, pos, nsplit, nh, hd, out, early_pos=0, q=0, kc=0, vc=0, nkv=1,
                             max_ctx=0, fresh=0):
        T = grid[1]
        P = self._f32(partial, T * nh * nsplit * (hd + 2)).reshape(T, nh, nsplit, hd + 2).astype(np.float64)
        m, l, o = P[..., hd], P[..., hd + 1], P[..., :hd]
        if fresh:  # the newest row of each token, which the splits left out: one more (m, l, o) state (s, 1, v)
            p0, G = int(self.view(pos, np.int32, 1)[0]), nh // nkv
            K = self._kv_dec(self.view(kc, np.uint16, nkv * max_ctx * hd)).reshape(nkv, max_ctx, hd)
            V = self._kv_dec(self.view(vc, np.uint16, nkv * max_ctx * hd)).reshape(nkv, max_ctx, hd)
            Q = self._f32(q, T * nh * hd).reshape(T, nh, hd).astype(np.float64)
            rows = np.arange(T) + p0
            kv = np.arange(nh) // G
            Kn, Vn = K[kv[None, :], rows[:, None]].astype(np.float64), V[kv[None, :], rows[:, None]].astype(np.float64)
            s = (Q * Kn).sum(-1) / np.sqrt(hd) * np.log2(np.e)
            m = np.concatenate([m, s[..., None]], -1)
            l = np.concatenate([l, np.ones_like(s)[..., None]], -1)
            o = np.concatenate([o, Vn[:, :, None, :]], -2)
        M = np.where(l > 0, m, -np.inf).max(-1, keepdims=True)
        w = np.where(l > 0, np.exp2(np.where(l > 0, m, 0) - M), 0.0)
        o = (o * w[..., None]).sum(-2) / (l * w).sum(-1)[..., None]
        self._f32(out, T * nh * hd)[:] = o.reshape(-1)

    def _k_sample(self, grid, logits, n, history, hist_len, temp, top_k, top_p, min_p, rep, seed_lo, seed_hi, step,
                  out_token, z):
        hl = int(self.view(hist_len, np.int32, 1)[0])
        hist = self.view(history, np.int32, hl).tolist() if hl else []
        zz, keep, arg = O.ref_sample_keep(self._f32(logits, n), hist, temp, top_k, top_p, min_p, rep)
        if temp > 0:
            seed = seed_lo | (seed_hi << 32)
            e = np.where(keep, np.exp(zz - zz.max()), 0.0)
            cum = np.cumsum(e)
            u = O.sample_uniform(seed, int(self.view(step, np.int32, 1)[0]))
            arg = int(min(np.searchsorted(cum, u * cum[-1], side="right"), np.flatnonzero(keep)[-1]))
        self.view(out_token, np.int32, 1)[0] = arg

    def _k_argmax_blocks(self, grid, logits, n, cand):
        nb, x = grid[0], self._f32(logits, n)
        per, c = -(-n // nb), self.view(cand, np.float32, 2 * nb)
        for b in range(nb):
            sl = x[b * per:min(n, (b + 1) * per)]
            ok = sl > -np.inf  # `v > best` from best = -inf: NaN and -inf never win
            best, bi = -np.inf, 0x7FFFFFFF
            if ok.any():
                best = sl[ok].max()
                bi = b * per + int(np.flatnonzero(ok & (sl == best))[0])
            c[2 * b] = best
            c[2 * b + 1:2 * b + 2].view(np.uint32)[0] = bi

    def _k_argmax_pick(self, grid, cand, nb, out_token):
        c = self.view(cand, np.float32, 2 * nb)
        best, bi = -np.inf, 0x7FFFFFFF
        for b in range(nb):
            v, i = c[2 * b], int(c[2 * b + 1:2 * b + 2].view(np.uint32)[0])
            if v > best or (v == best and i < bi):
                best, bi = v, i
        self.view(out_token, np.int32, 1)[0] = bi

    def _k_argmax_pick_step(self, grid, cand, nb, token, history, hist_len, pos, hist_cap, count, host_words, cap):
        self._k_decode_advance(grid, token, history, hist_len, pos, hist_cap)  # the consumed token, first
        self._k_argmax_pick(grid, cand, nb, token)
        self._k_emit_token(grid, token, count, host_words, cap)

    def _k_decode_advance(self, grid, token, history, hist_len, pos, cap):
        h = int(self.view(hist_len, np.int32, 1)[0])
        if h < cap:
            self.view(history + 4 * h, np.int32, 1)[0] = self.view(token, np.int32, 1)[0]
            self.view(hist_len, np.int32, 1)[0] = h + 1
        self.view(pos, np.int32, 1)[0] += 1

    def _k_emit_token(self, grid, token, count, host_words, cap):
        n = int(self.view(count, np.int32, 1)[0])
        if n >= cap:
            return
        self.view(host_words + 4 * (1 + n), np.int32, 1)[0] = self.view(token, np.int32, 1)[0]
        self.view(count, np.int32, 1)[0] = n + 1
        self.view(host_words, np.int32, 1)[0] = n + 1


@pytest.fixture
def emulated(monkeypatch):
    import hipengine.gpu.executor as E

    rt = EmulatedRuntime()
    monkeypatch.setattr(E, "get_runtime", lambda index=0: rt)
    return E.GpuBackend


def _decode_matches_reference(gpu, model, ids, want):
    """Decode logits within 2e-2 of the reference's prefill logits `want` (11 prompt tokens, then one by one), and
    the reference's greedy tokens after 9 prompt tokens."""
    from hipengine.reference import ReferenceBackend

    gpu.reset()
    dec = [gpu.prefill(ids[:11], all_logits=True)] + [gpu.decode(int(t))[None] for t in ids[11:]]
    dec = np.concatenate(dec)
    rel = np.linalg.norm(dec - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert rel.max() < 2e-2, f"decode logits rel err {rel.max():.3g}"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cpu = list(ReferenceBackend(model, max_context=64).generate_ids(ids[:9], params, lambda: False))
    assert list(gpu.generate_ids(ids[:9], params, lambda: False)) == cpu


@pytest.mark.parametrize("kind,one_kernel", [("llama", "0"), ("llama", "1"), ("llama3", ""), ("qwen2", "1"),
                                             ("qwen3", ""), ("smollm", "")])
def test_executor_wiring_matches_reference(emulated, kind, one_kernel, tmp_path, monkeypatch):
    """one_kernel: HIPENGINE_ATTN_ONE_KERNEL (decode attention as one kernel or two; "" = by grid size)."""
    monkeypatch.setenv("HIPENGINE_ATTN_ONE_KERNEL", one_kernel)
    from hipengine.loader import load_model
    from hipengine.reference import ReferenceBackend
    from tiny_models import save_tiny_model

    path, _ = save_tiny_model(kind, tmp_path, seed=5, max_position_embeddings=1024)
    model = load_model(path, progress=False)
    ids = np.random.default_rng(2).integers(3, model.config.vocab_size, 21)
    want = ReferenceBackend(model, max_context=64).prefill(ids, all_logits=True)
    gpu = emulated(model, max_context=64)
    got = gpu.prefill(ids, all_logits=True)  # one chunk (prefill_m = 128), padded to the 32-token graph
    rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert rel.max() < 2e-2, f"prefill logits rel err {rel.max():.3g}"
    gpu.prefill_m = 8  # 8 + 8 + 5 (padded to 8): the first chunk runs eagerly once, then all replay its graph
    for _ in range(2):
        gpu.reset()
        assert np.array_equal(gpu.prefill(ids, all_logits=True), got)
    assert [k[:2] for k in gpu._prefill_graphs] == [(32, "all"), (8, "all")]  # (chunk, logits, A/B knobs)
    with monkeypatch.context() as mp:  # eager, unpadded: the same bits
        mp.setenv("HIPENGINE_NO_GRAPH", "1")
        gpu.reset()
        assert np.array_equal(gpu.prefill(ids, all_logits=True), got)
    # without all_logits only the last row's logits are made (the decode LM head on it), from a partial last
    # chunk (eager) and from a full one (its graph)
    for n in (21, 16):
        gpu.reset()
        np.testing.assert_allclose(gpu.prefill(ids[:n]), got[n - 1], rtol=1e-5, atol=1e-5 * np.abs(got).max())
    assert [k[:2] for k in gpu._prefill_graphs] == [(32, "all"), (8, "all"), (8, "")]  # "last": after the graph
    # near the end of the cache the padding would not fit: that chunk runs eagerly, unpadded
    gpu.prefill_m = 128
    long = np.concatenate([ids, ids, ids])[:60]
    gpu.reset()
    whole = gpu.prefill(long)  # one chunk, padded to 64 = max_context
    gpu.reset()
    gpu.prefill(long[:50])
    np.testing.assert_allclose(gpu.prefill(long[50:]), whole, rtol=1e-5, atol=1e-5 * np.abs(whole).max())
    _decode_matches_reference(gpu, model, ids, want)
    sp = SamplingParams(max_tokens=6, temperature=0.9, top_k=20, repetition_penalty=1.2, seed=3, ignore_eos=True)
    assert list(gpu.generate_ids(ids[:9], sp, lambda: False)) == list(gpu.generate_ids(ids[:9], sp, lambda: False))
    gpu.close()


@pytest.mark.parametrize("one_kernel,prefill_mma", [("0", "1"), ("1", "1"), ("1", "0")])
def test_fresh_combine_wiring_matches_reference(emulated, one_kernel, prefill_mma, tmp_path, monkeypatch):
    """HIPENGINE_ATTN_FRESH_COMBINE=1 (attention_decode.hip HE_ATTN_FRESH_COMBINE) on the per-op path: the decode
    splits leave each token's newest row out and the combine adds it from q and the caches (attention_combine's
    `fresh` argument, or the one-kernel form's last split block); the prefill's matrix-core splits cover every row
    (fresh 0), its split kernels without them (HIPENGINE_PREFILL_MMA=0) leave each token's newest row out as well —
    prefill and decode logits as the reference's, greedy tokens equal."""
    monkeypatch.setenv("HIPENGINE_ATTN_FRESH_COMBINE", "1")
    monkeypatch.setenv("HIPENGINE_ATTN_ONE_KERNEL", one_kernel)
    monkeypatch.setenv("HIPENGINE_PREFILL_MMA", prefill_mma)
    from hipengine.loader import load_model
    from hipengine.reference import ReferenceBackend
    from tiny_models import save_tiny_model

    assert "HE_ATTN_FRESH_COMBINE" in O.attention_defines(64, 1024, "sm_90")
    path, _ = save_tiny_model("llama3", tmp_path, seed=5, max_position_embeddings=1024)
    model = load_model(path, progress=False)
    ids = np.random.default_rng(2).integers(3, model.config.vocab_size, 21)
    want = ReferenceBackend(model, max_context=64).prefill(ids, all_logits=True)
    gpu = emulated(model, max_context=64)
    got = gpu.prefill(ids, all_logits=True)
    assert gpu.rt.attn_fresh
    rel = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert rel.max() < 2e-2, f"prefill logits rel err {rel.max():.3g}"
    _decode_matches_reference(gpu, model, ids, want)
    gpu.close()
    monkeypatch.setenv("HIPENGINE_ATTN_FRESH_COMBINE", "0")
    assert "HE_ATTN_FRESH_COMBINE" not in O.attention_defines(64, 1024, "sm_90")


@pytest.mark.parametrize("kind", ["llama", "smollm", "qwen3"])
def test_fused_mlp_wiring_matches_reference(emulated, kind, tmp_path, monkeypatch):
    """HIPENGINE_FUSED_MLP=1 (ops/mlp.hip) on the per-op path: the transposed down weights, the residual addend
    cleared by the embedding, added by the QKV / LM-head prologues, folded in and cleared by the O-proj — decode
    logits as the reference's and greedy tokens equal; between steps the addend holds the last MLP's output."""
    monkeypatch.setenv("HIPENGINE_FUSED_MLP", "1")
    from hipengine.loader import load_model
    from hipengine.reference import ReferenceBackend
    from tiny_models import save_tiny_model

    path, _ = save_tiny_model(kind, tmp_path, seed=5, max_position_embeddings=1024)
    model = load_model(path, progress=False)
    ids = np.random.default_rng(2).integers(3, model.config.vocab_size, 21)
    want = ReferenceBackend(model, max_context=64).prefill(ids, all_logits=True)
    gpu = emulated(model, max_context=64)
    assert gpu.fused_mlp and all(L["w_down_t"] is not None for L in gpu.layers)
    _decode_matches_reference(gpu, model, ids, want)
    # after the LM head the addend holds the last layer's MLP output (the next step's embedding clears it)
    gpu.decode(int(ids[0]))
    d = model.config.hidden_size
    assert gpu.rt.download(gpu.x_fx, d, np.int64).any()
    gpu.close()


@pytest.mark.parametrize("setting", ["", "1", "0"])
def test_o_group_wiring_matches_reference(emulated, setting, tmp_path, monkeypatch):
    """The grouped O-proj on the per-op path (ops/matvec_group.hip; hipengine/gpu/monokernel.py o_group_decide:
    HIPENGINE_MK_OGROUP=1, or unset where O_GROUP_DEFAULT says so and a shape fits): x + the O-proj's output into the
    fixed-point buffer, gate/up reading it alone, down adding it to its rows and clearing it — decode logits as the
    reference's and greedy tokens equal, the buffer zero between steps; HIPENGINE_MK_OGROUP=0 keeps the plain
    O-proj; the tiny shapes that do not fit keep it too."""
    from hipengine.gpu.monokernel import O_GROUP_DEFAULT

    monkeypatch.setenv("HIPENGINE_MK_OGROUP", setting)
    from hipengine.loader import load_model
    from hipengine.reference import ReferenceBackend
    from tiny_models import save_tiny_model

    # G·hd = 4 x 32 = 128 columns (16 lanes a row), 256 hidden rows: one tile per group on a 32-lane warp
    path, _ = save_tiny_model("llama3", tmp_path, seed=5, max_position_embeddings=1024, hidden_size=256,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    model = load_model(path, progress=False)
    ids = np.random.default_rng(2).integers(3, model.config.vocab_size, 21)
    want = ReferenceBackend(model, max_context=64).prefill(ids, all_logits=True)
    gpu = emulated(model, max_context=64)
    assert gpu.o_group == (setting == "1" or (setting == "" and O_GROUP_DEFAULT))
    _decode_matches_reference(gpu, model, ids, want)
    assert not gpu.rt.download(gpu.x_fx, model.config.hidden_size, np.int64).any()
    gpu.close()
    path, _ = save_tiny_model("llama", tmp_path / "misfit", seed=5, max_position_embeddings=1024)
    if setting == "1":  # asked for on a shape it cannot serve: one clear error
        from hipengine.errors import UnsupportedError

        with pytest.raises(UnsupportedError, match="grouped O-proj cannot serve"):
            emulated(load_model(path, progress=False), max_context=64)
    else:
        gpu = emulated(load_model(path, progress=False), max_context=64)
        assert not gpu.o_group
        gpu.close()


@pytest.mark.parametrize("fused", ["1", "0"])
def test_per_op_generation_stops_where_a_host_loop_would(emulated, tmp_path, monkeypatch, fused):
    """The per-op generation loop enqueues decode steps ahead of the tokens it has read (RUN_AHEAD); it must
    still yield exactly what a token-by-token loop yields — max_tokens, a full context (the last step writes K/V
    at max_context - 1), an end-of-sequence id (yielded, then nothing), should_stop() — and leave pos where
    the device stopped: at most RUN_AHEAD steps past the last token it handed out. Greedy steps end in
    decode_advance + argmax + emit_token (HIPENGINE_FUSED_PICK=0) or in argmax_step (1, the default)."""
    import dataclasses

    monkeypatch.setenv("HIPENGINE_FUSED_PICK", fused)

    from hipengine.gpu.executor import RUN_AHEAD
    from hipengine.loader import load_model
    from hipengine.reference import ReferenceBackend
    from tiny_models import save_tiny_model

    path, _ = save_tiny_model("llama3", tmp_path, seed=7, max_position_embeddings=1024)
    model = load_model(path, progress=False)
    prompt = np.random.default_rng(4).integers(3, model.config.vocab_size, 9)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    cpu = list(ReferenceBackend(model, max_context=32).generate_ids(prompt, greedy, lambda: False))
    assert len(cpu) == 32 - 9 + 1  # the reference stops at the full context too
    gpu = emulated(model, max_context=32)
    try:
        assert list(gpu.generate_ids(prompt, greedy, lambda: False)) == cpu and gpu.pos == 32
        five = dataclasses.replace(greedy, max_tokens=5)
        assert list(gpu.generate_ids(prompt, five, lambda: False)) == cpu[:5] and gpu.pos == 9 + 4
        one = dataclasses.replace(greedy, max_tokens=1)
        assert list(gpu.generate_ids(prompt, one, lambda: False)) == cpu[:1] and gpu.pos == 9
        k = next(i for i in range(2, len(cpu)) if cpu[i] not in cpu[:i])  # a first occurrence as the EOS id
        gpu.config = dataclasses.replace(gpu.config, eos_token_ids=(cpu[k],))
        assert list(gpu.generate_ids(prompt, dataclasses.replace(greedy, ignore_eos=False), lambda: False)) == \
            cpu[:k + 1]
        assert 9 + k <= gpu.pos <= 9 + k + RUN_AHEAD
        calls = []
        stop = lambda: calls.append(1) or len(calls) > 3  # noqa: E731 (False at the start and after 2 tokens)
        assert list(gpu.generate_ids(prompt, greedy, stop)) == cpu[:3]
    finally:
        gpu.close()
