"""Launch wrappers for the per-op kernels (kernels_hip/ops/*.hip) and their float64 numpy oracles.

One method per standalone kernel; tests, benchmarks and the per-op executor all launch through here, so a
kernel's launch geometry, shared-memory size and preconditions are defined once. ``ref_*`` functions are the
oracles (float64, same semantics as the kernel comments) used by tests/test_ops_gpu.py.

Pointer arguments take a DeviceBuffer, a raw device address (int) or None (a null pointer: "no bias",
"no norm", "no residual"). bf16 helpers convert with round-to-nearest-even, exactly as port.h does.
"""
from __future__ import annotations

import math
import os
import re
from ctypes import c_float, c_int32, c_uint32, c_void_p
from typing import NamedTuple

import numpy as np

from ..errors import DeviceError, UnsupportedError
from .runtime import DeviceBuffer, HostBuffer

MATVEC_THREADS = 256  # 8 warps (NVIDIA) / 4 waves (AMD) per block; kernels allow up to 512
ATTN_THREADS = 256
SAMPLE_THREADS = 1024  # must equal kSampleThreads in sampling.hip
MAX_M = 8  # kMaxM in prefill.hip: token rows per matmul_small_m launch
PREFILL_M = 128  # prompt tokens per prefill chunk (the largest matmul_mma_m* instantiation)
MMA_MAX_TILE_ROWS = 128  # kPfBN in prefill.hip (16 · HE_PF_WARPS): weight rows per matmul_mma block, at most
MMA_BK = 32  # kPfBK: columns per k-step (a K split is a multiple of it)
ATTN_MAX_GROUP = 8  # kAttnMaxGroup in attention_decode.hip


# ---- host-side dtype helpers --------------------------------------------------------------------------------
def to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays NaN (port.h's he_f32_to_bf16)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    if nan.any():
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def weight_bits(a: np.ndarray) -> tuple[np.ndarray, bool]:
    """(uint16 bits, is_f16) for upload: fp16 arrays stay fp16, everything else becomes bf16."""
    if a.dtype == np.float16:
        return np.ascontiguousarray(a).view(np.uint16), True
    return to_bf16(a), False


def bits_to_f64(bits: np.ndarray, f16: bool) -> np.ndarray:
    return (bits.view(np.float16) if f16 else from_bf16(bits)).astype(np.float64)


def _p(x) -> c_void_p:
    if x is None:
        return c_void_p(0)
    if isinstance(x, DeviceBuffer):
        return c_void_p(x.ptr)
    if isinstance(x, HostBuffer):
        return c_void_p(x.dptr)
    return c_void_p(int(x))


def _addr(x) -> int:
    """The device address of a pointer argument (see _p), for offsets into a buffer."""
    return int(_p(x).value or 0)


def attn_lanes(hd: int) -> int:
    """Lanes per K/V row in the attention split (attention_decode.hip HE_ATTN_LPR): hd/8 rounded up to a
    power of two."""
    n = 1
    while n * 8 < hd:
        n *= 2
    return n


def o_group_tile_rows(cols: int, warp: int, threads: int = MATVEC_THREADS) -> int:
    """Rows of one block's tile of the grouped O-proj (ops/matvec_group.hip HeMvgGeom::block_rows): 16 loads per lane,
    warp / (cols / 8) rows per load, per warp."""
    return 16 * (warp // (cols // 8)) * (threads // warp)


def o_group_misfit(group: int, head_dim: int, hidden: int, num_kv_heads: int, blocks: int, warp: int,
                   threads: int = MATVEC_THREADS) -> str | None:
    """Why the grouped O-proj cannot serve this shape (None: it can): a group's G·hd columns must be 8·2^k with
    16 <= 2^k <= the warp width lanes, the hidden size whole tiles of a block's rows, and every (group, tile) a
    block of the grid (ops/matvec_group.hip HeMvgGeom)."""
    cols = group * head_dim
    lanes = cols // 8
    if cols % 8 or lanes < 16 or lanes > warp or lanes & (lanes - 1):
        return f"G*head_dim = {cols} columns per KV-head group (needs 8 x a power of two from 16 to {warp})"
    rows = o_group_tile_rows(cols, warp, threads)
    if hidden % rows:
        return f"hidden size {hidden} is not whole tiles of {rows} rows"
    if num_kv_heads * (hidden // rows) > blocks:
        return f"{num_kv_heads} groups x {hidden // rows} tiles need more blocks than the grid's {blocks}"
    return None


def attention_blocks_per_sm() -> float | None:
    """(kv head, split) blocks per SM the split plan aims for when HIPENGINE_ATTN_BLOCKS_PER_SM sets it
    (sweeps; fractions allowed); None: attention_plan's rule (1, or 2 where one would spill past a round)."""
    raw = os.environ.get("HIPENGINE_ATTN_BLOCKS_PER_SM", "")
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = 0.0
    if not v > 0:
        raise UnsupportedError(f"HIPENGINE_ATTN_BLOCKS_PER_SM={raw}: a positive number of blocks per SM")
    return v


ATTN_MAX_CHUNK = 1024            # longest split of a two-round plan (v32)
ATTN_ONE_ROUND_MAX_CHUNK = 2048  # longest split of a one-round plan (session 29)


def attention_max_chunk(one_round: bool = False) -> int:
    """Longest split of the attention plan (positions), or HIPENGINE_ATTN_MAX_CHUNK for every plan (sweeps; a
    multiple of 32). Two-round plans: 1,024 — measured on H200 at 32K (llama-3.2-1b, docs/perf-log.md v32, two
    rounds then): 512 → 1,024 took the monokernel from 575 to 694 tok/s (its 132 blocks score ~2 splits each
    instead of ~4, each split paying q staging, the merges and the partial's round trips once) and the per-op
    path from 693 to 729; 2,048 lost on both (568 / 574). The monokernel's one-round plans (attention_plan
    one_round): 2,048, so that llama-3.2-1b keeps one round of 16 splits per KV head up to 32K (session 29)."""
    raw = os.environ.get("HIPENGINE_ATTN_MAX_CHUNK", "")
    v = int(raw) if raw else (ATTN_ONE_ROUND_MAX_CHUNK if one_round else ATTN_MAX_CHUNK)
    if v < 32 or v % 32:
        raise UnsupportedError(f"HIPENGINE_ATTN_MAX_CHUNK={v}: a multiple of 32, at least 32")
    return v


ATTN_COMBINE_BATCH = 16  # attention_decode.hip kCombineBatch: split partials the combine loads per round trip
ATTN_UNROLL = 4          # attention_decode.hip kAttnUnroll: rows per lane group per batch
# Caches of up to SHORT_PLAN_CTX positions aim for SHORT_PLAN_BPS (KV head, split) blocks per SM (attention_plan).
SHORT_PLAN_CTX = 1024
SHORT_PLAN_BPS = 0.5


def attention_plan(max_ctx: int, num_kv_heads: int, num_sms: int, blocks_per_sm: float | None = None,
                   head_dim: int = 64, one_round: bool = False) -> tuple[int, int]:
    """(nsplit, chunk): the decode attention's split plan for a KV cache of max_ctx positions — chunks a multiple
    of 32 positions, at least 32. Fixed per max_ctx so a captured graph stays valid. Two paths taking the same
    plan give bit-identical results.

    The per-op path's (v48's rule): one round of ceil(num_sms / num_kv_heads) splits per KV head, splits up to
    1,024 positions, unless that plan has more (kv head, split) blocks than SMs (a 16K cache of llama-3.2-1b:
    17 splits x 8 KV heads = 136 blocks, so 4 SMs would take a second round), then two full rounds of
    half-length splits (blocks_per_sm 2). Measured on H200 at 16K (docs/perf-log.md v48): per-op 812 → 931
    tok/s. (At 8K two per SM are faster for the per-op path only — 967 → 1,033 — and cost the monokernel its
    one round, so the per-op plan keeps one there.)

    one_round (the monokernel's plan, monokernel.mk_plan): first one round of num_sms // num_kv_heads splits
    (llama-3.2-1b on 132 SMs: 16, 128 blocks) of up to 2,048 positions (attention_max_chunk(one_round=True)),
    then the same two rounds. Measured on H200, llama-3.2-1b, both paths on each plan (docs/perf-log.md,
    session 29): monokernel 940.9 → 994.1 tok/s at 16K (+5.7%), 802.4 → 837.9 at 32K (+4.4%: no second round
    of split items and no fine-2 barrier); per-op 1,031.1 → 899.3 (−12.8%) and 873.1 → 695.0 (−20.4%: its
    split kernel runs two blocks per SM, and 128 blocks leave half of them empty) — so each path keeps its own.
    The two rules give the same plan at 1K / 4K / 8K and wherever num_kv_heads divides num_sms up to the
    one-round bound (the default model's 3 KV heads, a TP=2 rank's 4, on 132 SMs). blocks_per_sm (or
    HIPENGINE_ATTN_BLOCKS_PER_SM, sweeps) asks for ~that many blocks per SM instead, for either path.

    Caches of up to SHORT_PLAN_CTX (1K) positions aim for half a block per SM (SHORT_PLAN_BPS; llama-3.2-1b: 8
    splits of 128, 64 items, where the rules above give 16 of 64): measured for the monokernel in four H100
    calls at 1K (docs/perf-log.md sessions 41-42) at +1.3 to +2.0%, and at +1.7% on session 45's kernels — its
    split items then sit on the blocks that stream one QKV unit, and more blocks request their O-proj tile early
    — for −1.4% on the per-op path, whose
    tokens must stay the monokernel's (one plan for both). At 2K the same plan cost the monokernel 0.5-0.8%, so
    the rule stops at 1K.

    Then fewer, longer splits where that is free: if the plan has more splits than the combine loads in one
    round trip (ATTN_COMBINE_BATCH) but 16 splits still give each warp a single batch of rows (chunk <= the
    rows a 256-thread block scores per batch: 128 at head_dim 64), take 16 — the split takes one batch either
    way, and the combine and the arrival counter save a dependent round trip (at TP=2, 4 KV heads per rank,
    the 1K plan was 32 splits of 32 positions). HIPENGINE_ATTN_SPLIT_CAP=0 keeps the first plan (A/B)."""
    bps = blocks_per_sm or attention_blocks_per_sm()
    if bps is None and max_ctx <= SHORT_PLAN_CTX:
        bps = SHORT_PLAN_BPS
    if bps is None:
        if one_round:
            plan = _split_plan(max_ctx, num_sms // num_kv_heads, attention_max_chunk(one_round=True), head_dim)
        else:
            plan = _split_plan(max_ctx, math.ceil(num_sms / num_kv_heads), attention_max_chunk(), head_dim)
        if num_kv_heads * plan[0] <= num_sms:
            return plan
        bps = 2.0
    return _split_plan(max_ctx, math.ceil(bps * num_sms / num_kv_heads), attention_max_chunk(), head_dim)


def _split_plan(max_ctx: int, want: int, max_chunk: int, head_dim: int) -> tuple[int, int]:
    """attention_plan for ~`want` splits per KV head, splits of at most max_chunk positions."""
    chunk = math.ceil(max_ctx / max(1, want))
    chunk = min(max_chunk, max(32, (chunk + 31) // 32 * 32))
    nsplit = math.ceil(max_ctx / chunk)
    if nsplit > ATTN_COMBINE_BATCH and os.environ.get("HIPENGINE_ATTN_SPLIT_CAP", "1") != "0":
        one_batch = ATTN_THREADS // attn_lanes(head_dim) * ATTN_UNROLL
        c2 = (math.ceil(max_ctx / ATTN_COMBINE_BATCH) + 31) // 32 * 32
        if c2 <= one_batch:
            chunk, nsplit = c2, math.ceil(max_ctx / c2)
    return nsplit, chunk


def _env_switch(var: str) -> bool | None:
    """A 0 / 1 override of a default from the environment (A/B benchmarks); None when unset."""
    raw = os.environ.get(var, "")
    if raw in ("0", "1"):
        return raw == "1"
    if raw:
        raise UnsupportedError(f"{var} must be 0 or 1, not {raw!r}")
    return None


def _blocks_per_sm(var: str, default: int) -> int:
    raw = os.environ.get(var, str(default))
    if not raw.strip().isdigit() or int(raw) < 1:
        raise UnsupportedError(f"{var}={raw}: a whole number of blocks per SM, at least 1")
    return int(raw)


def matvec_blocks_per_sm() -> int:
    """Grid cap of the decode matvec kernels, in 256-thread blocks per SM: 2 (HIPENGINE_MATVEC_BLOCKS_PER_SM).
    Only the large matrices reach it (gate/up, LM head). Two blocks per SM are what is resident at the
    kernels' 128 registers, so every block streams from the start and a warp's weight stream runs on from
    unit to unit instead of a second wave of blocks restarting it (prologue, first loads); the next kernel's
    blocks also find room as soon as these drain. Measured on H200, per-op decode of llama-3.2-1b at
    1K / 8K / 32K (docs/perf-log.md v35): 4 → 1,085 / 923 / 755 tok/s, 3 → 1,092 / 921 / 755,
    **2 → 1,116 / 940 / 768**, 1 → 1,009 / 864 / 719."""
    return _blocks_per_sm("HIPENGINE_MATVEC_BLOCKS_PER_SM", 2)


MATVEC_UNROLL = 4        # matvec.hip kMatvecUnroll (HE_MATVEC_UNROLL's default): 16-byte loads per lane per batch
MATVEC_ROWS1_UNROLL = 8  # the unroll of the one-row-unit build (matvec_rows1): the same 64 registers in flight


def matvec_rows1(rows: int, inn: int, warp: int, num_sms: int) -> bool:
    """Whether a plain matvec (y = W·x (+ residual)) runs as matvec_rows1 — one row per warp unit, built with
    HE_MATVEC_UNROLL=8 — rather than matvec's two-row units: when a two-row unit is longer than the pair of
    batches a warp keeps in flight (so each warp streams its unit in several dependent rounds) and two-row
    units leave the grid short of its cap (matvec_blocks_per_sm), so that one-row units double the warps — and
    the bytes in flight — instead of lengthening the rounds. Llama-3.2-1B: the down-projection (2,048 rows of
    8,192) only. Same sums in the same order, so the same bits (matvec.hip HeMvPlain1).
    HIPENGINE_MATVEC_ROWS1=0 / 1 forces either form."""
    force = _env_switch("HIPENGINE_MATVEC_ROWS1")
    if force is not None:
        return force
    pair = 2 * MATVEC_UNROLL * warp * 8  # columns of a unit's rows a warp holds in flight
    blocks2 = math.ceil((rows + 1) // 2 / (MATVEC_THREADS // warp))
    return inn > pair and blocks2 < matvec_blocks_per_sm() * num_sms


def whole_pairs(inn: int, unroll: int, warp: int) -> dict:
    """The matvec build's define for rows of `inn` weights: HE_MV_WHOLE_PAIRS=1 when `inn` is a multiple of the
    pair of batches a warp holds (2 · unroll · warp · 8 columns), so the kernel compiles without the predicated
    load and consume paths that such rows never take (dead code between the hot paths: docs/perf-log.md v67).
    Same loads, same sums in the same order: the same bits. HIPENGINE_MV_WHOLE_PAIRS=0 turns it off (A/B)."""
    if _env_switch("HIPENGINE_MV_WHOLE_PAIRS") is False:
        return {}
    return {"HE_MV_WHOLE_PAIRS": 1} if inn % (2 * unroll * warp * 8) == 0 else {}


def prefill_blocks_per_sm() -> int:
    """Grid cap of the prefill matmul (matmul_small_m), blocks per SM: 3 (HIPENGINE_PREFILL_BLOCKS_PER_SM).
    Time to first token of a 1K prompt on H200 with the cap at 1 / 2 / 3 / 4: 641 / 380 / 327 / 361 ms (v35)."""
    return _blocks_per_sm("HIPENGINE_PREFILL_BLOCKS_PER_SM", 3)


def sm_version(arch: str) -> int:
    """NVIDIA compute capability of `arch` as an integer ("sm_90a" -> 90); 0 for any other target."""
    digits = "".join(ch for ch in arch[3:] if ch.isdigit()) if arch.startswith("sm_") else ""
    return int(digits) if digits else 0


def mma_supported(arch: str) -> bool:
    """Whether port.h's matrix-core tiles (he_mma) exist on `arch`: NVIDIA sm_80 and later (mma.sync
    m16n8k16 bf16/f16), AMD CDNA with bf16 MFMA (gfx90a, gfx94x, gfx95x; wave64)."""
    if arch.startswith("sm_"):
        return sm_version(arch) >= 80
    return arch.startswith(("gfx90a", "gfx94", "gfx95"))


def bulk_copy_supported(arch: str) -> bool:
    """Whether port.h's bulk copies (kHasBulkCopy: the TMA's cp.async.bulk on an mbarrier) exist on `arch`:
    NVIDIA sm_90 and later; AMD has no such engine."""
    return sm_version(arch) >= 90


def prefill_mma(arch: str) -> bool:
    """Whether the prefill projections run on the matrix cores (matmul_mma_m*) rather than matmul_small_m:
    where mma_supported(arch), unless HIPENGINE_PREFILL_MMA=0 (A/B benchmarks)."""
    return mma_supported(arch) and _env_switch("HIPENGINE_PREFILL_MMA") is not False


def prefill_split() -> bool:
    """Whether the prefill's matrix-core kernels take their fp32 activations as hi/lo 16-bit pairs (two
    products: ~16 bits of mantissa kept, the FMA path's accuracy) rather than rounded to the weights' 16 bits
    (one product, as bf16 / fp16 frameworks compute): HIPENGINE_PREFILL_SPLIT=0|1."""
    return _env_switch("HIPENGINE_PREFILL_SPLIT") is not False


def ap_min_blocks(hd: int) -> int:
    """attention_prefill.hip's HE_AP_MIN_BLOCKS default: 4 blocks of 4 warps resident per SM at hd ≤ 64
    (registers capped at 128: v44e), 0 (the compiler's choice) above, where the O and q fragments need more."""
    return 4 if hd <= 64 else 0


AP_QTILES = 1  # attention_prefill.hip HE_AP_QTILES: 16-query tiles per block (HIPENGINE_AP_QTILES: 1, 2, 4)


def ap_qtiles_setting() -> int:
    """The build's HE_AP_QTILES: HIPENGINE_AP_QTILES (1, 2 or 4) or AP_QTILES."""
    raw = os.environ.get("HIPENGINE_AP_QTILES", "")
    if raw and raw not in ("1", "2", "4"):
        raise UnsupportedError(f"HIPENGINE_AP_QTILES must be 1, 2 or 4, not {raw!r}")
    return int(raw) if raw else AP_QTILES


def ap_qtiles(G: int, warp: int, setting: int | None = None) -> int:
    """Query tiles per attention_prefill_g<G> block (attention_prefill.hip he_ap_qtiles): the setting, capped
    at 16 warps and 1,024 threads per block."""
    qt = ap_qtiles_setting() if setting is None else setting
    cap = min(16 // G, 1024 // (G * warp))
    return max(1, min(qt, cap))


def ap_defines(hd: int) -> dict:
    """Build defines of attention_prefill.hip for head size hd: its head size, the activations' split
    (prefill_split), the warps kept resident per SM (ap_min_blocks; HIPENGINE_AP_MIN_BLOCKS=0..8 overrides it,
    0: the compiler's choice) and the query tiles per block (ap_qtiles_setting) — A/B knobs."""
    raw = os.environ.get("HIPENGINE_AP_MIN_BLOCKS", "")
    if raw and (not raw.isdigit() or int(raw) > 8):
        raise UnsupportedError(f"HIPENGINE_AP_MIN_BLOCKS must be 0..8, not {raw!r}")
    d = {"HE_AP_HD": int(hd), "HE_AP_XSPLIT": int(prefill_split()),
         "HE_AP_MIN_BLOCKS": int(raw) if raw else ap_min_blocks(hd)}
    qt = ap_qtiles_setting()
    if qt != 1:  # the default build keeps its key (compile caches, precompiled modules)
        d["HE_AP_QTILES"] = qt
    return d


def mma_rotate() -> bool:
    """Whether each matmul_mma tile starts its k-loop at its own step (tile % steps) rather than at column 0:
    on unless HIPENGINE_MMA_ROTATE=0 (A/B)."""
    return _env_switch("HIPENGINE_MMA_ROTATE") is not False


def mma_tiles(rows: int, mode: int, tile_rows: int) -> int:
    """Blocks of one matmul_mma launch along the weight: tile_rows weight rows each (mode 2: tile_rows / 2 rows
    of each of gate and up, so half as many output rows per tile)."""
    return math.ceil(rows / (tile_rows // 2 if mode == 2 else tile_rows))


def mma_plan(rows: int, inn: int, mode: int, num_sms: int, tile_rows: int = 64,
             ztiles: int = 1) -> tuple[int, int, int]:
    """(tiles, splits, kchunk) of one matmul_mma launch: tiles of `tile_rows` weight rows (mode 2: half as
    many output rows per tile), each launched for `ztiles` token tiles (mma_token_tiles); when the
    tiles · ztiles blocks cannot fill the GPU, K is split so that at most 2 blocks per SM run, each split a
    whole number of MMA_BK-column k-steps (no empty split). tiles · ztiles · splits ≤ 2 · num_sms and
    tiles · ztiles < num_sms whenever splits > 1 (mma_part_floats and the arrival counters rely on it)."""
    tiles = mma_tiles(rows, mode, tile_rows)
    steps = math.ceil(inn / MMA_BK)
    blocks = tiles * ztiles
    # at most 2 blocks per SM: with the ring sized for two blocks (MmaBuild) that is all that is resident at
    # once, and a second wave of a few blocks cost QKV 21% (6 splits of 48 tiles = 288 blocks; v42e)
    splits = 1 if blocks >= num_sms else min(steps, max(1, (2 * num_sms) // blocks))
    kchunk = math.ceil(steps / splits) * MMA_BK
    return tiles, math.ceil(inn / kchunk), kchunk


def mma_rows(m: int) -> int:
    """Token rows of the matmul_mma_m* instantiation that takes m tokens: 16, 32, 64 or 128 (PREFILL_M)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else PREFILL_M


def mma_ztiles() -> int | None:
    """HIPENGINE_MMA_ZTILES = 1, 2, 4 or 8: the token tiles mma_token_tiles cuts a chunk into (A/B); None when
    unset (the default rule there)."""
    raw = os.environ.get("HIPENGINE_MMA_ZTILES", "")
    if raw == "":
        return None
    if raw not in ("1", "2", "4", "8"):
        raise UnsupportedError(f"HIPENGINE_MMA_ZTILES must be 1, 2, 4 or 8, not {raw!r}")
    return int(raw)


def mma_token_tiles(M: int, tiles: int, num_sms: int) -> tuple[int, int]:
    """(mt, ztiles): the matmul_mma_m{mt} instantiation for a chunk of M tokens and the token tiles (grid.z)
    it is launched for. Where the weight has fewer row tiles than SMs, Z token tiles (blocks of about M / Z
    tokens, mt the instantiation that holds them) fill the grid with Z · tiles blocks and K is split less
    (prefill.hip: token tiles); otherwise one tile of mma_rows(M) tokens. Z: 2 for chunks of more than 64
    tokens (tiles of at least 64), else 1; HIPENGINE_MMA_ZTILES forces it. Measured on H200 (Llama-3.2-1B,
    docs/perf-log.md v45b/v45c): Z = 2 took a 1K prompt from 31.4 to 28.4 ms (O −25%); Z = 4 and 8 (m32 / m16
    k-steps) lost (gate/up +36% / +120%), as did Z = 2 on a 64-token prompt (+7%)."""
    forced = mma_ztiles()
    z = (forced or (2 if M > 64 else 1)) if tiles < num_sms else 1
    mt = mma_rows(math.ceil(M / z))
    return mt, math.ceil(M / mt)


AP_MAX_SPLITS = 16  # attention_prefill's splits: at most the combine's one-round-trip batch (ATTN_COMBINE_BATCH)


def ap_shared_bytes(G: int, hd: int) -> int:
    """Dynamic shared memory of attention_prefill_g<G> for head size hd (attention_prefill.hip
    he_ap_smem_bytes): one step's K [64][hd + 8] and Vᵀ [hd][72], 16-bit (scores and softmax state live in
    registers, so G does not change it)."""
    del G
    return 64 * (hd + 8) * 2 + hd * 72 * 2


def attention_prefill_mma(arch: str, G: int, hd: int, max_shared: int) -> bool:
    """Whether a prefill chunk's attention runs on the matrix cores (attention_prefill_g*, then the combine)
    rather than attention_split once per query: with prefill_mma(arch), hd a multiple of 16, G ≤ 8 and its
    shared memory within the device's and gfx942's 64 KiB."""
    return (prefill_mma(arch) and hd % 16 == 0 and 1 <= G <= 8
            and ap_shared_bytes(G, hd) <= min(max_shared, 64 * 1024))


MMA_WIDE_STEPS = 12  # mma_build: the fewest k-steps per K split for which 8 warps beat 4 with split K
MMA_SMEM_CAP = 112 * 1024  # a block's ring on NVIDIA: two blocks per SM (H100 / H200: 228 KB per SM)
# the environment knobs a prefill launch reads (the executor's chunk graphs are keyed by them)
MMA_KNOBS = ("HIPENGINE_PREFILL_MMA", "HIPENGINE_MMA_ROTATE", "HIPENGINE_MMA_WARPS", "HIPENGINE_MMA_STAGES",
             "HIPENGINE_PREFILL_SPLIT", "HIPENGINE_AP_MIN_BLOCKS", "HIPENGINE_MMA_ZTILES", "HIPENGINE_AP_QTILES")


class MmaBuild(NamedTuple):
    """One build of prefill.hip's matmul_mma (HE_PF_WARPS, HE_PF_STAGES): warps per block (its weight rows:
    16 per warp) and stages of the shared-memory ring."""
    warps: int
    stages: int

    @property
    def tile_rows(self) -> int:
        return 16 * self.warps

    def defines(self) -> dict:
        return {"HE_PF_WARPS": self.warps, "HE_PF_STAGES": self.stages, "HE_PF_XSPLIT": int(prefill_split())}

    def shared_bytes(self, mt: int) -> int:
        return mma_shared_bytes(mt, self.stages, self.tile_rows)


def mma_build(rt, rows: int | None = None, mode: int = 0, inn: int | None = None, M: int = PREFILL_M) -> MmaBuild:
    """The matmul_mma build for a weight of `rows` × `inn` (mode as prefill_matmul) and chunks of M tokens:
    8 warps (128-row tiles) where the block fits (not on gfx942) and either such tiles fill at least half the
    GPU (gate/up, the LM head: gate/up measured 13% faster, bench_prefill_h200_v43a.json) or, with the token
    tiles of mma_token_tiles, each K split of the 8-warp plan keeps at least MMA_WIDE_STEPS k-steps (QKV and
    down of Llama-3.2-1B: 13 and 32 steps, −22% / −17% against 4 warps; O: 8 steps, +7%; v45c); else 4 (64-row
    tiles). HIPENGINE_MMA_WARPS=4|8 forces it. The ring as deep as fits (at most 6 stages) a chunk of
    PREFILL_M tokens in a block's shared memory — on NVIDIA within MMA_SMEM_CAP (two blocks per SM), on
    gfx942 its 64 KiB of LDS — or HIPENGINE_MMA_STAGES."""
    raw = os.environ.get("HIPENGINE_MMA_WARPS", "")
    if raw:
        if raw not in ("4", "8"):
            raise UnsupportedError(f"HIPENGINE_MMA_WARPS must be 4 or 8, not {raw!r}")
        warps = int(raw)
    else:
        # 8 warps where the 128-row tiles take at most two K splits (gate/up of Llama-3.2-1B: 128 tiles × 2)
        t = mma_tiles(rows, mode, 128) if rows is not None else 0
        wide = rows is not None and 2 * t >= rt.num_sms
        if rows is not None and inn is not None and not wide:
            kchunk = mma_plan(rows, inn, mode, rt.num_sms, 128, mma_token_tiles(M, t, rt.num_sms)[1])[2]
            wide = kchunk // MMA_BK >= MMA_WIDE_STEPS
        # gfx942: the 8-warp block's [128][132] fp32 result tile alone exceeds its 64 KiB of LDS
        warps = 8 if wide and mma_shared_bytes(PREFILL_M, 2, 128) <= rt.max_shared_per_block else 4
    forced = os.environ.get("HIPENGINE_MMA_STAGES")
    if forced:
        n = int(forced) if forced.isdigit() else 0
        if n < 2 or mma_shared_bytes(PREFILL_M, n, 16 * warps) > rt.max_shared_per_block:
            raise UnsupportedError(f"HIPENGINE_MMA_STAGES={forced}: needs 2 or more stages within "
                                   f"{rt.max_shared_per_block} bytes of shared memory")
        return MmaBuild(warps, n)
    cap = min(rt.max_shared_per_block, MMA_SMEM_CAP)
    n = 6
    while n > 2 and mma_shared_bytes(PREFILL_M, n, 16 * warps) > cap:
        n -= 1
    if mma_shared_bytes(PREFILL_M, n, 16 * warps) > rt.max_shared_per_block:
        raise UnsupportedError(f"matmul_mma with {warps} warps does not fit {rt.max_shared_per_block} bytes of "
                               f"shared memory")
    return MmaBuild(warps, n)


def mma_shared_bytes(mt: int, stages: int, tile_rows: int = 64) -> int:
    """Dynamic shared memory of matmul_mma_m{mt} (prefill.hip HePfSmem) with a ring of `stages`: each a weight
    tile of tile_rows bf16 rows padded to MMA_BK + 8 and an X tile of mt fp32 rows padded to MMA_BK + 8; the
    result tile [mt][tile_rows + 4] reuses it."""
    stage = tile_rows * (MMA_BK + 8) * 2 + mt * (MMA_BK + 8) * 4
    return max(stages * stage, mt * (tile_rows + 4) * 4)


def mma_part_floats(num_sms: int, max_m: int) -> int:
    """Size of matmul_mma's split-K scratch for chunks of up to max_m tokens, any build and token tiling: at
    most 2 · num_sms blocks when K is split (mma_plan), each a [mt, tile_rows] partial tile with
    mt ≤ mma_rows(max_m) (the instantiation's rows, not the chunk's: 100 tokens run as m128)."""
    return 2 * num_sms * MMA_MAX_TILE_ROWS * mma_rows(max_m)


def attention_one_kernel(blocks: int, num_sms: int) -> bool:
    """Whether decode attention (one query token) runs as one kernel, attention_decode_g* (the last split
    block of each KV head combines it), rather than attention_split_g* + attention_combine: when its grid of
    (KV head, split) blocks puts more than 1.5 blocks on an SM on average. Measured on H200 (llama-3.2-1b,
    132 SMs, per-op path; docs/perf-log.md v36): 128 blocks (1K, 8K) −1.3%, −0.5%; 136 blocks (16K) −1.8%;
    256 blocks (32K) +1.9%. With about one attention block per SM the next kernel (O-proj) becomes resident
    beside it at once and its weight requests queue in front of the K/V loads (the combine kernel's launch
    hop delayed that); with the SMs full of attention blocks there is no such room, and removing the combine
    kernel is a plain gain.
    HIPENGINE_ATTN_ONE_KERNEL=1 / 0 forces either form."""
    force = _env_switch("HIPENGINE_ATTN_ONE_KERNEL")
    if force is not None:
        return force
    return 2 * blocks > 3 * num_sms


def attention_early() -> bool:
    """Whether the decode attention kernel may load its K/V rows before the previous kernel completes, where
    the caller allows it (Ops.attention `early`); HIPENGINE_ATTN_EARLY=0 turns it off (A/B benchmarks)."""
    return _env_switch("HIPENGINE_ATTN_EARLY") is not False


def attention_early_pos() -> bool:
    """Whether the two-kernel decode attention (split, combine) reads the position before waiting for the
    kernel before it, where the caller allows it (Ops.attention `early`: inside the captured decode graph);
    HIPENGINE_ATTN_EARLY_POS=0 turns it off (A/B benchmarks)."""
    return _env_switch("HIPENGINE_ATTN_EARLY_POS") is not False


def fused_pick() -> bool:
    """Whether the per-op greedy loop ends a step with Ops.argmax_step (two launches) rather than
    decode_advance, argmax and emit_token (four): yes unless HIPENGINE_FUSED_PICK=0 (A/B). Measured +0.1–0.3%
    per-op at 1K on H200, −2.5 µs per token (session 11); same tokens as the CPU path on the GPU
    (tests/test_gpu_engine.py test_tiny_greedy_matches_cpu, both tails; docs/perf-log.md, session 12)."""
    return _env_switch("HIPENGINE_FUSED_PICK") is not False


def fused_mlp() -> bool:
    """HIPENGINE_FUSED_MLP=1: the MLP as one stage (ops/mlp.hip: each gate/up unit applies its row of down, no
    grid-wide wait between the halves, fixed-point partial sums) on both decode paths at tp = 1. Off by default:
    on H200 it measured 1-2% slower than gate/up, then down (docs/perf-log.md v75b) — the residual addend it needs
    costs the QKV and O-proj stages more than the boundary it removes saves."""
    return _env_switch("HIPENGINE_FUSED_MLP") is True


def l2_persist_kv() -> bool:
    """HIPENGINE_L2_PERSIST_KV=1: the KV cache's lines marked persisting in L2 for the decode stream's kernels (NVIDIA:
    an access-policy window over the cache and an L2 set-aside of up to the device's limit; nothing on AMD, whose
    runtime has no such window). Every step rereads the whole cache while the weights stream past it once; the
    attention splits' K/V loads, and the q poll that returns behind them, then come from L2 instead of HBM. Values do
    not change. Off by default until measured (docs/perf-log.md session 57)."""
    return _env_switch("HIPENGINE_L2_PERSIST_KV") is True


def _fx_defines(x_fx=None, res_fx=None) -> dict:
    """The matvec module's build for the fixed-point addends given (ops/matvec.hip HE_MV_X_FX / HE_MV_RES_FX)."""
    return {**({"HE_MV_X_FX": 1} if x_fx is not None else {}), **({"HE_MV_RES_FX": 1} if res_fx is not None else {})}


MLP_MAX_DVEC = 8  # ops/mlp.hip: 16-byte vectors of a down row per lane held in registers (a 2,048-wide row on NVIDIA)


def mlp_dvec(d: int, warp: int) -> int:
    """ops/mlp.hip HE_MLP_DVEC: 16-byte vectors (8 columns) of a Wdᵀ row per lane."""
    return -(-d // (8 * warp))


def mlp_supported(d: int, warp: int) -> bool:
    """Whether the fused MLP's per-lane registers hold a row of this hidden size (llama-3.2-1b: 8 vectors on
    NVIDIA, 4 on wave64)."""
    return mlp_dvec(d, warp) <= MLP_MAX_DVEC


def mlp_shared_bytes(d: int, warp: int, cp_async: bool, threads: int = MATVEC_THREADS) -> int:
    """Shared memory of the fused MLP stage (ops/mlp.hip): x̂ [d] | every warp's partial of the output (whole
    sweeps of warp · 8 columns) | with cp_async (NVIDIA: port.h kHasCpAsync) every warp's buffer of a down row
    (mlp_dvec vectors of 16 bytes per lane)."""
    warps, dvec = threads // warp, mlp_dvec(d, warp)
    rows = warps * dvec * warp * 16 if cp_async else 0
    return 4 * (d + warps * dvec * warp * 8) + rows


def pdl_enabled(rt) -> bool:
    """Whether the per-op kernels launch with programmatic dependent launch: where the runtime has it (NVIDIA
    sm_90+: Runtime.pdl_launch), unless HIPENGINE_PDL=0 (A/B benchmarks; docs/perf-log.md v29)."""
    return bool(getattr(rt, "pdl_launch", False)) and os.environ.get("HIPENGINE_PDL", "1") != "0"


PDL_ROLES = ("qkv", "attn", "combine", "o", "gate_up", "down", "lm_head")


def pdl_off_roles() -> frozenset:
    """Decode-step kernels launched in plain stream order although the path uses programmatic dependent
    launch: HIPENGINE_PDL_OFF, a list of PDL_ROLES separated by commas or "+" (A/B and profiling of where each
    kernel should become resident; scripts/profile_perop.py). Such a kernel starts once the one before it has
    completed, and the kernel after it cannot start before it has."""
    return _pdl_role_list("HIPENGINE_PDL_OFF", os.environ.get("HIPENGINE_PDL_OFF", ""))


def _pdl_role_list(var: str, raw: str) -> frozenset:
    """The PDL_ROLES named in `raw` (separated by commas or "+"; "none" names none); an unknown one is one
    clear error naming `var`."""
    roles = frozenset(r.strip() for r in re.split(r"[,+]", raw) if r.strip() and r.strip() != "none")
    bad = sorted(roles - set(PDL_ROLES))
    if bad:
        raise UnsupportedError(f"{var}: unknown role(s) {', '.join(bad)} (roles: {', '.join(PDL_ROLES)})")
    return roles


# The roles whose kernels trigger late by default: the O-proj (gate/up then launches once the attention stage has
# completed instead of during it) and the attention split. Measured per-op on H200 (docs/perf-log.md v48), tok/s
# at 1K / 8K: every kernel at its top 1,163 / 955; o late 1,192 / 964; o and attn late 1,197 / 972; one role
# late alone otherwise −0.7% (combine) to +0.3% (down).
PDL_LATE_DEFAULT = frozenset({"attn", "o"})
# The matvec roles, whose kernels can also trigger once their activation is staged (port.h HE_PDL_LATE=2).
PDL_MATVEC_ROLES = ("qkv", "o", "gate_up", "down", "lm_head")
# The roles staged by default: the down-projection (the next QKV launches once down's blocks have staged their
# input). Measured per-op on H200 (docs/perf-log.md v50–v52), tok/s at 1K / 8K, alternated: v48's defaults
# 1,197 / 972, down staged 1,203 / 976; the LM head or QKV staged as well −0.2% / −0.1%; the O-proj staged
# instead of after its wait −1.7%.
PDL_STAGED_DEFAULT = frozenset({"down"})


def pdl_staged_roles() -> frozenset:
    """Matvec roles whose kernels let the next one launch once the block has staged its activation (port.h
    HE_PDL_LATE=2): PDL_STAGED_DEFAULT, or HIPENGINE_PDL_STAGED — roles as in pdl_late_roles, matvec roles only,
    or "none"."""
    raw = os.environ.get("HIPENGINE_PDL_STAGED")
    if raw is None:
        return PDL_STAGED_DEFAULT
    roles = _pdl_role_list("HIPENGINE_PDL_STAGED", raw)
    bad = sorted(roles - set(PDL_MATVEC_ROLES))
    if bad:
        raise UnsupportedError(f"HIPENGINE_PDL_STAGED: {', '.join(bad)} is not a matvec role "
                               f"(roles: {', '.join(PDL_MATVEC_ROLES)})")
    return roles


def pdl_trigger_levels() -> dict:
    """Role -> where its kernel triggers the next launch (port.h HE_PDL_LATE: 1 after its wait, 2 once its
    activation is staged; roles not named trigger at their top). A role both late and staged is staged."""
    levels = {r: 1 for r in pdl_late_roles()}
    levels.update({r: 2 for r in pdl_staged_roles()})
    return levels


def pdl_late_roles() -> frozenset:
    """Decode-step kernels that let the next kernel launch after their own wait instead of at their top
    (port.h HE_PDL_LATE: the module is built with it): PDL_LATE_DEFAULT, or HIPENGINE_PDL_LATE — a list of
    PDL_ROLES separated by commas or "+", or "none". The next kernel then becomes resident only once the
    kernel before this one has completed: the chain of resident kernels runs shallower."""
    raw = os.environ.get("HIPENGINE_PDL_LATE")
    return PDL_LATE_DEFAULT if raw is None else _pdl_role_list("HIPENGINE_PDL_LATE", raw)


ATTN_WARP_MAX_CTX = 8192  # KV caches shorter than this take the warp's running max (attn_warp_max)


def attn_warp_max(max_ctx: int) -> bool:
    """Whether the attention split keeps the warp's running max (attention_decode.hip HE_ATTN_WARP_MAX) for a
    KV cache of max_ctx tokens: below ATTN_WARP_MAX_CTX, where a warp scores few batches. Measured per-op on
    H200 (llama-3.2-1b, docs/perf-log.md v40) against the lane group's max: +1.1% at 1K, −0.9% at 8K, −3.3%
    at 32K. Both paths take the same build for one cache (the monokernel's compile_args), so they stay
    bit-identical. HIPENGINE_ATTN_WARP_MAX=0|1 forces it (A/B)."""
    forced = _env_switch("HIPENGINE_ATTN_WARP_MAX")
    return forced if forced is not None else max_ctx < ATTN_WARP_MAX_CTX


# The decode split on the matrix cores where attn_mma allows it (HIPENGINE_ATTN_MMA=0 keeps the FMA body). Measured
# on H200, llama-3.2-1b, against the FMA body, alternated (docs/perf-log.md v53), tok/s at 1K / 8K / 32K: per-op
# 1,203 / 978 / 786 → 1,234 / 1,040 / 864 (+2.6% / +6.3% / +9.9%); the monokernel (its split a call between
# compiler fences) 1,093 / 976 / 706 → 1,123 / 1,016 / 738 (+2.6% / +4.0% / +4.5%).
ATTN_MMA_DEFAULT = True


def attn_mma(arch: str | None, hd: int) -> bool:
    """Whether the decode attention split runs on the matrix cores (attention_decode.hip HE_ATTN_MMA: G query
    heads as the rows of port.h's attention tiles, 16-key tiles per warp): where the target has them
    (mma_supported) and head_dim is a multiple of 16 up to 128 (the sizes tested; at 256 its per-warp tiles
    would outgrow a CDNA work-group's 64 KiB of LDS), by ATTN_MMA_DEFAULT or HIPENGINE_ATTN_MMA=0|1. Both paths
    take the same build for one cache (the monokernel's compile_args), so they stay bit-identical; q and the
    probabilities enter as hi/lo 16-bit pairs (~16 bits kept: the op tests hold it to 1e-3 of float64, the FMA
    body to 1e-4)."""
    if arch is None or hd % 16 or hd > 128 or not mma_supported(arch):
        return False
    forced = _env_switch("HIPENGINE_ATTN_MMA")
    return ATTN_MMA_DEFAULT if forced is None else forced


# Session 48's change, the default since session 49: on one H100 in one process, alternated twice, tokens equal, the
# monokernel +3.3 / +3.5% at 1K, +3.2 / +2.6% at 8K, +0.6 / +1.5% at 32K (monokernel_fresh_combine_ab_h100_s49.json);
# the bench of record on that machine +3.1 / +2.1 / +1.5% for the monokernel, −1.0 / −0.7 / +0.2% per-op
# (monokernel_decode_h100_s49_{default,fresh_combine}.json; docs/perf-log.md session 49).
ATTN_FRESH_COMBINE_DEFAULT = True


def attn_fresh_combine() -> bool:
    """Whether the decode attention's splits leave the newest cache row to the combine (attention_decode.hip
    HE_ATTN_FRESH_COMBINE: the row this step's QKV writes, so the split holding it waited for the end of that
    stage): ATTN_FRESH_COMBINE_DEFAULT, or HIPENGINE_ATTN_FRESH_COMBINE=0|1. Both paths take the same build
    (attention_defines), so they stay bit-identical."""
    forced = _env_switch("HIPENGINE_ATTN_FRESH_COMBINE")
    return forced if forced is not None else ATTN_FRESH_COMBINE_DEFAULT


def attention_defines(hd: int, max_ctx: int, arch: str | None = None) -> dict:
    """Compile-time defines of the attention module (attention_decode.hip) for head_dim hd and a KV cache of
    max_ctx tokens on `arch`: lanes per K/V row, hd itself (HE_ATTN_HD: its index arithmetic folds), whose
    running max the softmax keeps (attn_warp_max), where attn_mma says so the matrix-core split (HE_ATTN_MMA;
    without an arch, the FMA body) and whether the combine takes the newest row (attn_fresh_combine)."""
    d = {"HE_ATTN_LPR": attn_lanes(hd), "HE_ATTN_HD": int(hd), "HE_ATTN_WARP_MAX": int(attn_warp_max(max_ctx))}
    if attn_mma(arch, hd):
        d["HE_ATTN_MMA"] = 1
    if attn_fresh_combine():
        d["HE_ATTN_FRESH_COMBINE"] = 1
    return d


def attention_shared_bytes(G: int, hd: int, warp_size: int, mma: bool) -> int:
    """Dynamic shared memory of the decode attention split (both paths): the FMA body's q and per-warp states
    ((G·hd + warps·G·(hd + 2))·4 bytes), or the matrix-core body's q hi/lo tiles and per-warp K / Vᵀ tiles
    (attention_decode.hip he_attn_mma_smem)."""
    warps = ATTN_THREADS // warp_size
    if not mma:
        return (G * hd + warps * G * (hd + 2)) * 4
    return 2 * G * (hd + 8) * 2 + warps * (16 * (hd + 8) + hd * 24) * 2


class Ops:
    """Compiled op modules for one device, with one launcher per kernel."""

    def __init__(self, rt, defines: dict | None = None):
        self.rt = rt
        self.defines = defines  # compile-time knobs (e.g. HE_MATVEC_UNROLL) for benchmarks
        self._mods: dict[str, object] = {}
        self.warps_per_block = MATVEC_THREADS // rt.warp_size
        # Launch every kernel with programmatic dependent launch (Runtime.launch `pdl`): the next kernel's
        # weight loads overlap this one's end. Every kernel of kernels_hip/ops waits (he_pdl_wait) before it
        # touches data of the kernels before it, so this is safe for any sequence; pdl_enabled() decides.
        self.pdl = pdl_enabled(rt)
        self.pdl_off = pdl_off_roles()
        self.pdl_levels = pdl_trigger_levels()

    def _pdl(self, role: str) -> bool:
        """Whether a kernel of this decode-step role launches with programmatic dependent launch."""
        return self.pdl and role not in self.pdl_off

    def _late(self, role: str) -> dict:
        """The defines that make a kernel of this role trigger the next launch later than at its top
        (pdl_trigger_levels: after its wait or once its activation is staged)."""
        level = self.pdl_levels.get(role, 0) if self.pdl else 0
        return {"HE_PDL_LATE": level} if level else {}

    def _whole(self, inn: int, unroll: int | None = None) -> dict:
        """whole_pairs for this module's unroll (a benchmark's HE_MATVEC_UNROLL define, else MATVEC_UNROLL)."""
        if unroll is None:
            unroll = int((self.defines or {}).get("HE_MATVEC_UNROLL", MATVEC_UNROLL))
        return whole_pairs(inn, unroll, self.rt.warp_size)

    def fn(self, source: str, name: str, defines: dict | None = None):
        """Kernel `name` of ops/<source>.hip, compiled once per (source, extra defines)."""
        key = (source, tuple(sorted((defines or {}).items())))
        mod = self._mods.get(key)
        if mod is None:
            mod = self._mods[key] = self.rt.compile(f"ops/{source}.hip", defines={**(self.defines or {}),
                                                                                   **(defines or {})} or None)
        return mod.function(name)

    def _grid(self, units: int, threads: int = MATVEC_THREADS, blocks_per_sm: int | None = None) -> int:
        """Blocks for a grid-stride kernel over `units` warp tasks: at most blocks_per_sm (default
        matvec_blocks_per_sm()) blocks of MATVEC_THREADS per SM, so the fused prologue is paid a few hundred
        times per launch rather than once per row."""
        need = max(1, math.ceil(units / (threads // self.rt.warp_size)))
        bps = blocks_per_sm or matvec_blocks_per_sm()
        return min(need, bps * self.rt.num_sms * MATVEC_THREADS // threads)

    def _check_in(self, inn: int) -> None:
        if inn % 8:
            raise UnsupportedError(f"matvec input length {inn} is not a multiple of 8 (16-byte weight loads)")
        if inn * 4 > self.rt.max_shared_per_block:
            raise UnsupportedError(f"matvec input length {inn} needs {inn * 4} B of shared memory; the device "
                                   f"allows {self.rt.max_shared_per_block}")

    # ---- embedding / norms ------------------------------------------------------------------------------
    def embedding(self, table, tokens, T: int, vocab: int, hidden: int, out, f16=False, stream=None, x_fx=None):
        """out[t] = table[tokens[t]]; x_fx (one token): the fused MLP's residual addend [hidden] int64, cleared."""
        if x_fx is not None and T != 1:
            raise ValueError("embedding: x_fx is one token's residual addend")
        self.rt.launch(self.fn("embedding", "embedding"), T, 256,
                       [_p(table), _p(tokens), c_int32(vocab), c_int32(hidden), _p(out), c_int32(int(f16)),
                        _p(x_fx)], stream=stream, pdl=self.pdl)

    def rmsnorm(self, x, gamma, eps: float, n: int, y, rows: int = 1, stream=None):
        self.rt.launch(self.fn("rmsnorm", "rmsnorm"), rows, 256,
                       [_p(x), _p(gamma), c_float(eps), c_int32(n), _p(y)], stream=stream, pdl=self.pdl)

    # ---- matvecs ------------------------------------------------------------------------------------------
    def matvec(self, W, x, y, rows: int, inn: int, gamma=None, eps: float = 0.0, residual=None, f16=False,
               stream=None, grid: int | None = None, threads: int = MATVEC_THREADS, role: str = "",
               rows1: bool | None = None, x_fx=None, res_fx=None):
        """y = W·x (+ residual), RMSNorm(x; gamma) first when gamma is given. rows1: the one-row-unit kernel
        (default: matvec_rows1(...) decides; an explicit grid keeps the two-row kernel unless rows1=True).
        x_fx / res_fx: the fused MLP's residual addend (mlp_fused), added to x (the LM head's input) or to the
        residual rows, which are then complete in y and their addend cleared (the O-proj)."""
        self._check_in(inn)
        if (x_fx is not None or res_fx is not None) and rows1:
            raise ValueError("matvec: the one-row kernel takes no fixed-point addend")
        if rows1 is None:
            rows1 = (grid is None and x_fx is None and res_fx is None
                     and matvec_rows1(rows, inn, self.rt.warp_size, self.rt.num_sms))
        if rows1:
            fn = self._rows1_fn("matvec_rows1", role, inn)
            g = grid or self._grid(rows, threads)
        else:
            fn = self.fn("matvec", "matvec", {**self._late(role), **self._whole(inn), **_fx_defines(x_fx, res_fx)})
            g = grid or self._grid((rows + 1) // 2, threads)
        args = [_p(W), _p(x), _p(gamma), c_float(eps), _p(residual), _p(y), c_int32(rows), c_int32(inn),
                c_int32(int(f16))]
        if not rows1:
            args += [_p(x_fx), _p(res_fx)]
        self.rt.launch(fn, g, threads, args, shared=inn * 4, stream=stream, pdl=self._pdl(role))

    def head_screen(self, Wq, meta, c2: float, x, gamma, eps: float, d: int, vocab: int, lo, hi, block_lo,
                    grid: int, threads: int = MATVEC_THREADS, W=None, f16: bool = False, out=None, scratch_lo=None):
        """The screened LM head's kernels on their own (ops/head_screen.hip; the monokernel runs the same bodies):
        every row's [A - B, A + B] into lo / hi and each block's max lower bound into block_lo; with W (the
        bf16 / fp16 head) and out, a second launch on the same grid recomputes each block's candidates exactly
        and writes its (value, row bits) pairs to out[2 * grid]."""
        from .head_screen import check_shape, smem_bytes

        check_shape(vocab, d)
        self._check_in(d)
        if grid < self.rt.num_sms:
            raise ValueError("head_screen: the grid must have at least one block per SM (the slots' size)")
        smem = smem_bytes(d, vocab, self.rt.num_sms, threads // self.rt.warp_size)
        common = [_p(Wq), _p(meta), c_float(c2), _p(x), _p(gamma), c_float(eps), c_int32(d), c_int32(vocab)]
        self.rt.launch(self.fn("head_screen", "head_screen_bounds", self._whole(d)), grid, threads,
                       common + [_p(lo), _p(hi), _p(block_lo)], shared=smem)
        if W is not None:
            self.rt.launch(self.fn("head_screen", "head_screen_pick", self._whole(d)), grid, threads,
                           common + [_p(block_lo), _p(scratch_lo), _p(W), c_int32(int(f16)), _p(out)], shared=smem)

    def matvec_packed(self, Wp, esc, W, d: int, x, y, rows: int, inn: int, gamma=None, eps: float = 0.0,
                      residual=None, threads: int = MATVEC_THREADS):
        """matvec over packed 13-bit rows (ops/matvec_packed.hip; hipengine/gpu/packed.py made Wp, esc and the
        offset d from the bf16 rows W, which the rare units flagged in esc are recomputed from): the same y, bit
        for bit, as matvec(W, ...)."""
        from .packed import check_shape

        self._check_in(inn)
        check_shape(inn, self.rt.warp_size)
        self.rt.launch(self.fn("matvec_packed", "matvec_packed", self._whole(inn)), self._grid((rows + 1) // 2, threads),
                       threads, [_p(Wp), _p(esc), _p(W), c_float(2.0 ** d), c_float(2.0 ** -d), _p(x), _p(gamma),
                                 c_float(eps), _p(residual), _p(y), c_int32(rows), c_int32(inn)], shared=inn * 4)

    def matvec_gate_up_packed(self, Wgp, Wup, esc, Wg, Wu, d: int, x, y, rows: int, inn: int, gamma=None,
                              eps: float = 0.0, threads: int = MATVEC_THREADS):
        """matvec_gate_up over packed gate and up rows (one offset d for both): the same y, bit for bit."""
        from .packed import check_shape

        self._check_in(inn)
        check_shape(inn, self.rt.warp_size)
        self.rt.launch(self.fn("matvec_packed", "matvec_gate_up_packed", self._whole(inn)), self._grid(rows, threads),
                       threads, [_p(Wgp), _p(Wup), _p(esc), _p(Wg), _p(Wu), c_float(2.0 ** d), c_float(2.0 ** -d),
                                 _p(x), _p(gamma), c_float(eps), _p(y), c_int32(rows), c_int32(inn)], shared=inn * 4)

    def matvec_gate_up(self, Wg, Wu, x, y, rows: int, inn: int, gamma=None, eps: float = 0.0, f16=False,
                       stream=None, grid: int | None = None, threads: int = MATVEC_THREADS):
        self._check_in(inn)
        g = grid or self._grid(rows, threads)
        self.rt.launch(self.fn("matvec", "matvec_gate_up", {**self._late("gate_up"), **self._whole(inn)}), g, threads,
                       [_p(Wg), _p(Wu), _p(x), _p(gamma), c_float(eps), _p(y), c_int32(rows), c_int32(inn),
                        c_int32(int(f16))], shared=inn * 4, stream=stream, pdl=self._pdl("gate_up"))

    # ---- the O-projection by KV-head group (ops/matvec_group.hip; the monokernel's MK_O_GROUP stages) -------------
    def matvec_group_o(self, W, att, x, y_fx, rows: int, inn: int, nkv: int, f16=False, stream=None):
        """y_fx += fx(W[:, group g] · att_g) for every KV-head group g, and group 0's tiles add fx(x) too: the O-proj
        whose output is the whole residual in 64-bit fixed point (int64 [rows]; zero before). One block per (group,
        tile of rows): the monokernel's shares, the same bits."""
        cols = inn // nkv
        why = o_group_misfit(1, cols, rows, nkv, 1 << 30, self.rt.warp_size, MATVEC_THREADS)
        if inn % nkv or why:
            raise UnsupportedError(f"the grouped O-proj cannot serve this shape: {why or f'{inn} columns, {nkv} groups'}")
        tiles = rows // o_group_tile_rows(cols, self.rt.warp_size)
        self.rt.launch(self.fn("matvec_group", "matvec_group_o", {"HE_MVG_COLS": cols, **self._late("o")}),
                       nkv * tiles, MATVEC_THREADS,
                       [_p(W), _p(att), _p(x), _p(y_fx), c_int32(inn), c_int32(rows), c_int32(int(f16))],
                       stream=stream, pdl=self._pdl("o"))

    def matvec_gate_up_fx(self, Wg, Wu, x_fx, y, rows: int, inn: int, gamma=None, eps: float = 0.0, f16=False,
                          stream=None):
        """matvec_gate_up whose input is the fixed-point residual x_fx (int64 [inn]) alone."""
        self._check_in(inn)
        self.rt.launch(self.fn("matvec_group", "matvec_gate_up_fx", {**self._late("gate_up"), **self._whole(inn)}),
                       self._grid(rows), MATVEC_THREADS,
                       [_p(Wg), _p(Wu), _p(x_fx), _p(gamma), c_float(eps), _p(y), c_int32(rows), c_int32(inn),
                        c_int32(int(f16))], shared=inn * 4, stream=stream, pdl=self._pdl("gate_up"))

    def matvec_fx_res(self, W, x, res_fx, y, rows: int, inn: int, f16=False, stream=None, rows1: bool | None = None):
        """y = W·x + res_fx (the fixed-point residual, int64 [rows]), which is then cleared: the down-projection
        after the grouped O-proj. rows1: one-row units (matvec.hip matvec_rows1_fx_res) instead of two-row ones
        (matvec_group.hip matvec_fx_res); default: where matvec_rows1(...) picks them for a plain matvec of this
        shape (llama-3.2-1b's down). Same sums, same conversion: the same bits either way."""
        self._check_in(inn)
        if rows1 is None:
            rows1 = matvec_rows1(rows, inn, self.rt.warp_size, self.rt.num_sms)
        if rows1:
            fn = self._rows1_fn("matvec_rows1_fx_res", "down", inn)
            grid = self._grid(rows)
        else:
            fn = self.fn("matvec_group", "matvec_fx_res", {**self._late("down"), **self._whole(inn)})
            grid = self._grid((rows + 1) // 2)
        self.rt.launch(fn, grid, MATVEC_THREADS,
                       [_p(W), _p(x), _p(res_fx), _p(y), c_int32(rows), c_int32(inn), c_int32(int(f16))],
                       shared=inn * 4, stream=stream, pdl=self._pdl("down"))

    def _rows1_fn(self, name: str, role: str, inn: int):
        """A kernel of matvec.hip's one-row-unit build (HE_MATVEC_UNROLL = MATVEC_ROWS1_UNROLL): matvec_rows1 or
        matvec_rows1_fx_res."""
        return self.fn("matvec", name, {"HE_MATVEC_UNROLL": MATVEC_ROWS1_UNROLL, **self._late(role),
                                        **self._whole(inn, MATVEC_ROWS1_UNROLL)})

    def matvec_qkv(self, W, x, q_out, k_cache, v_cache, cos, sin, pos, *, max_ctx: int, q_dim: int, kv_dim: int,
                   hd: int, inn: int, gamma=None, eps: float = 0.0, bias=None, rope: bool = True, f16=False,
                   stream=None, threads: int = MATVEC_THREADS, x_fx=None):
        self._check_in(inn)
        g = self._grid((q_dim + 2 * kv_dim) // 2, threads)
        self.rt.launch(self.fn("matvec", "matvec_qkv", {**self._late("qkv"), **self._whole(inn), **_fx_defines(x_fx)}),
                       g, threads,
                       [_p(W), _p(x), _p(gamma), c_float(eps), _p(bias), _p(cos), _p(sin), _p(pos), _p(q_out),
                        _p(k_cache), _p(v_cache), c_int32(max_ctx), c_int32(q_dim), c_int32(kv_dim), c_int32(hd),
                        c_int32(inn), c_int32(int(rope)), c_int32(int(f16)), _p(x_fx)], shared=inn * 4, stream=stream,
                       pdl=self._pdl("qkv"))

    def mlp_fused(self, Wg, Wu, WdT, x, y_fx, d: int, F: int, gamma=None, eps: float = 0.0, f16=False,
                  stream=None, variant: int = 0):
        """The MLP as one launch (ops/mlp.hip): y_fx += fx(W_down · (silu(Wg·x̂) * (Wu·x̂))), x̂ = RMSNorm(x;
        gamma), with WdT = W_down transposed [F, d], on the monokernel's grid (one block per SM: the same warps
        take the same rows, hence the same bits). variant: bench_ops' breakdown builds (HE_MLP_VARIANT)."""
        self._check_in(d)
        if not mlp_supported(d, self.rt.warp_size):
            raise UnsupportedError(f"the fused MLP holds {mlp_dvec(d, self.rt.warp_size)} vectors per lane for "
                                   f"hidden size {d}; at most {MLP_MAX_DVEC}")
        defines = {**self._late("gate_up"), **self._whole(d), "HE_MLP_DVEC": mlp_dvec(d, self.rt.warp_size),
                   **({"HE_MLP_VARIANT": variant} if variant else {})}
        self.rt.launch(self.fn("mlp", "mlp_fused", defines), self.rt.num_sms, MATVEC_THREADS,
                       [_p(Wg), _p(Wu), _p(WdT), _p(x), _p(gamma), c_float(eps), _p(y_fx), c_int32(d), c_int32(F),
                        c_int32(int(f16))],
                       shared=mlp_shared_bytes(d, self.rt.warp_size, self.rt.vendor == "nvidia"), stream=stream,
                       pdl=self._pdl("gate_up"))

    def matmul_small_m(self, W, X, Y, M: int, rows: int, inn: int, mode: int = 0, W2=None, bias=None, f16=False,
                       stream=None):
        """mode 0: Y = X Wᵀ (+bias); 1: Y += X Wᵀ; 2: Y = silu(X Wᵀ) * (X W2ᵀ). X [M, inn], Y [M, rows]."""
        if not 1 <= M <= MAX_M:
            raise DeviceError(f"matmul_small_m takes 1..{MAX_M} rows of X, got {M}")
        if inn % 8:
            raise UnsupportedError(f"matmul input length {inn} is not a multiple of 8")
        self.rt.launch(self.fn("prefill", "matmul_small_m"), self._grid(rows, blocks_per_sm=prefill_blocks_per_sm()),
                       MATVEC_THREADS,
                       [_p(W), _p(W2), _p(X), _p(bias), _p(Y), c_int32(M), c_int32(rows), c_int32(inn),
                        c_int32(mode), c_int32(int(f16))], stream=stream, pdl=self.pdl)

    def prefill_matmul(self, W, X, Y, M: int, rows: int, inn: int, mode: int = 0, W2=None, bias=None, f16=False,
                       part=None, count=None, stream=None):
        """A prefill projection of M ≤ PREFILL_M tokens, modes as matmul_small_m: on the matrix cores
        (matmul_mma_m16/32/64/128; part: mma_part_floats(num_sms, M) floats of scratch, count: num_sms zeroed
        uint32 words, left zero) where prefill_mma(arch), else matmul_small_m over slabs of MAX_M rows."""
        if not 1 <= M <= PREFILL_M:
            raise DeviceError(f"prefill_matmul takes 1..{PREFILL_M} rows of X, got {M}")
        if inn % 8:
            raise UnsupportedError(f"matmul input length {inn} is not a multiple of 8")
        if not prefill_mma(self.rt.arch):
            for m0 in range(0, M, MAX_M):  # X and Y rows are contiguous: a slab is a pointer offset
                xo, yo = _addr(X) + m0 * inn * 4, _addr(Y) + m0 * rows * 4
                self.matmul_small_m(W, xo, yo, min(MAX_M, M - m0), rows, inn, mode=mode, W2=W2, bias=bias,
                                    f16=f16, stream=stream)
            return
        if part is None or count is None:
            raise DeviceError("prefill_matmul on the matrix cores needs its split-K scratch (part, count)")
        build = mma_build(self.rt, rows, mode, inn, M)
        mt, ztiles = mma_token_tiles(M, mma_tiles(rows, mode, build.tile_rows), self.rt.num_sms)
        tiles, splits, kchunk = mma_plan(rows, inn, mode, self.rt.num_sms, build.tile_rows, ztiles)
        self.rt.launch(self.fn("prefill", f"matmul_mma_m{mt}", build.defines()), (tiles, splits, ztiles),
                       build.warps * self.rt.warp_size,
                       [_p(W), _p(W2), _p(X), _p(bias), _p(Y), c_int32(M), c_int32(rows), c_int32(inn),
                        c_int32(mode), c_int32(int(f16)), c_int32(kchunk), c_int32(int(mma_rotate())), _p(part),
                        _p(count)],
                       shared=build.shared_bytes(mt), stream=stream, pdl=self.pdl)

    # ---- attention ----------------------------------------------------------------------------------------
    def qk_norm_rope(self, qkv, q_out, k_cache, v_cache, cos, sin, pos, *, T: int, nh: int, nkv: int, hd: int,
                     max_ctx: int, q_norm=None, k_norm=None, eps: float = 0.0, stream=None):
        block = max(self.rt.warp_size, min(256, (hd // 2 + self.rt.warp_size - 1) // self.rt.warp_size
                                           * self.rt.warp_size))
        self.rt.launch(self.fn("qk_norm", "qk_norm_rope"), (nh + 2 * nkv, T), block,
                       [_p(qkv), _p(q_norm), _p(k_norm), c_float(eps), _p(cos), _p(sin), _p(pos), _p(q_out),
                        _p(k_cache), _p(v_cache), c_int32(max_ctx), c_int32(nh), c_int32(nkv), c_int32(hd)],
                       stream=stream, pdl=self.pdl)

    def attention(self, q, k_cache, v_cache, partial, out, pos, *, T: int, nh: int, nkv: int, hd: int,
                  max_ctx: int, nsplit: int, chunk: int, count=None, early: bool = False,
                  one_kernel: bool | None = None, stream=None):
        """partial: fp32 scratch of T·nh·nsplit·(hd+2) floats (see partial_floats).

        One query token with `count` (nkv uint32 words, zero, left zero by every launch), where `one_kernel`
        (default: attention_one_kernel(nkv·nsplit blocks, SMs)) says so: one kernel, attention_decode_g* —
        the splits, and the last split block of each KV head combines its heads. Otherwise
        attention_split_g* then attention_combine; both give the same bits.
        `early`: the caller guarantees that *pos and every cache row before the newest were written before
        the kernel before this one was launched (a captured decode graph: the position is set before the
        graph) — the one kernel then loads those rows, and the two kernels the position, before they wait
        for the previous kernel (with programmatic dependent launch only; elsewhere it changes nothing)."""
        G = nh // nkv
        if not 1 <= G <= ATTN_MAX_GROUP or nh % nkv or hd % 8 or hd > 8 * self.rt.warp_size:
            raise UnsupportedError(f"attention: group {G} (max {ATTN_MAX_GROUP}) / head_dim {hd} not supported")
        lanes = attention_defines(hd, max_ctx, self.rt.arch)
        shared = attention_shared_bytes(G, hd, self.rt.warp_size, "HE_ATTN_MMA" in lanes)
        if T == 1 and count is not None and (one_kernel if one_kernel is not None
                                             else attention_one_kernel(nkv * nsplit, self.rt.num_sms)):
            self.rt.launch(self.fn("attention_decode", f"attention_decode_g{G}", {**lanes, **self._late("attn")}),
                           nkv * nsplit,
                           ATTN_THREADS,
                           [_p(q), _p(k_cache), _p(v_cache), _p(partial), _p(pos), _p(count), _p(out),
                            c_int32(nsplit), c_int32(chunk), c_int32(nh), c_int32(nkv), c_int32(hd),
                            c_int32(max_ctx), c_int32(int(early and self._pdl("attn") and attention_early()))],
                           shared=shared, stream=stream, pdl=self._pdl("attn"))
            return
        if T > 1 and attention_prefill_mma(self.rt.arch, G, hd, self.rt.max_shared_per_block):
            nsp = min(AP_MAX_SPLITS, nsplit)  # partial holds T·nh·nsplit·(hd + 2) floats: enough
            qt = ap_qtiles(G, self.rt.warp_size)
            self.rt.launch(self.fn("attention_prefill", f"attention_prefill_g{G}", ap_defines(hd)),
                           (nkv * nsp, math.ceil(T / (16 * qt))), G * qt * self.rt.warp_size,
                           [_p(q), _p(k_cache), _p(v_cache), _p(partial), _p(pos), c_int32(T), c_int32(nsp),
                            c_int32(nh), c_int32(nkv), c_int32(hd), c_int32(max_ctx)],
                           shared=ap_shared_bytes(G, hd), stream=stream, pdl=self.pdl)
            self.rt.launch(self.fn("attention_decode", "attention_combine", lanes), (nh, T), 128,
                           [_p(partial), _p(pos), c_int32(nsp), c_int32(nh), c_int32(hd), _p(out), c_int32(0),
                            *self._combine_fresh(q, k_cache, v_cache, nkv, max_ctx, False)],
                           stream=stream, pdl=self.pdl)
            return
        self.rt.launch(self.fn("attention_decode", f"attention_split_g{G}", {**lanes, **self._late("attn")}),
                       (nkv * nsplit, T), ATTN_THREADS,
                       [_p(q), _p(k_cache), _p(v_cache), _p(partial), _p(pos), c_int32(nsplit), c_int32(chunk),
                        c_int32(nh), c_int32(nkv), c_int32(hd), c_int32(max_ctx),
                        c_int32(int(early and self._pdl("attn") and attention_early_pos()))], shared=shared,
                       stream=stream, pdl=self._pdl("attn"))
        self.rt.launch(self.fn("attention_decode", "attention_combine", {**lanes, **self._late("combine")}),
                       (nh, T), 128,
                       [_p(partial), _p(pos), c_int32(nsplit), c_int32(nh), c_int32(hd), _p(out),
                        c_int32(int(early and self._pdl("combine") and attention_early_pos())),
                        *self._combine_fresh(q, k_cache, v_cache, nkv, max_ctx, "HE_ATTN_FRESH_COMBINE" in lanes)],
                       stream=stream, pdl=self._pdl("combine"))

    @staticmethod
    def _combine_fresh(q, k_cache, v_cache, nkv: int, max_ctx: int, fresh: bool) -> list:
        """attention_combine's last arguments: where the newest row comes from, and whether the splits before it
        left that row out (attention_split in an HE_ATTN_FRESH_COMBINE build; attention_prefill never does)."""
        return [_p(q), _p(k_cache), _p(v_cache), c_int32(nkv), c_int32(max_ctx), c_int32(int(fresh))]

    @staticmethod
    def partial_floats(T: int, nh: int, hd: int, nsplit: int) -> int:
        return T * nh * nsplit * (hd + 2)

    # ---- sampling -----------------------------------------------------------------------------------------
    def sample(self, logits, n: int, history, hist_len, step, out_token, z, *, temperature=0.0, top_k=0,
               top_p=1.0, min_p=0.0, repetition_penalty=1.0, seed=0, stream=None):
        seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        self.rt.launch(self.fn("sampling", "sample"), 1, SAMPLE_THREADS,
                       [_p(logits), c_int32(n), _p(history), _p(hist_len), c_float(temperature), c_int32(top_k),
                        c_float(top_p), c_float(min_p), c_float(repetition_penalty), c_uint32(seed & 0xFFFFFFFF),
                        c_uint32(seed >> 32), _p(step), _p(out_token), _p(z)],
                       shared=((n + 31) // 32) * 4, stream=stream, pdl=self.pdl)

    def argmax_blocks(self) -> int:
        """Blocks of the grid-wide greedy pick (one per SM): Ops.argmax's candidate buffer holds 2 floats each."""
        return self.rt.num_sms

    def argmax(self, logits, n: int, out_token, cand, stream=None):
        """out_token[0] = first index of max(logits[:n]) (NaN never wins): sampling.hip argmax_blocks over one
        block per SM, then argmax_pick over their candidates (cand: 2 * argmax_blocks() floats). The same token
        as sample(temperature=0) without a repetition penalty, which runs on one block."""
        nb = self._argmax_candidates(logits, n, cand, stream)
        self.rt.launch(self.fn("sampling", "argmax_pick"), 1, MATVEC_THREADS, [_p(cand), c_int32(nb), _p(out_token)],
                       stream=stream, pdl=self.pdl)

    def _argmax_candidates(self, logits, n: int, cand, stream) -> int:
        """argmax_blocks: one candidate per block (SM) into cand; returns how many."""
        nb = self.argmax_blocks()
        self.rt.launch(self.fn("sampling", "argmax_blocks"), nb, MATVEC_THREADS, [_p(logits), c_int32(n), _p(cand)],
                       stream=stream, pdl=self.pdl)
        return nb

    def argmax_step(self, logits, n: int, token, cand, history, hist_len, pos, hist_cap: int, count, host_words,
                    cap: int, stream=None):
        """A greedy decode step's end, as decode_advance + argmax + emit_token in that order, in two launches:
        argmax_blocks, then argmax_pick_step (sampling.hip), which advances the history and the position for
        the token the step consumed, picks the next one into token[0] and hands it to the host."""
        nb = self._argmax_candidates(logits, n, cand, stream)
        self.rt.launch(self.fn("sampling", "argmax_pick_step"), 1, MATVEC_THREADS,
                       [_p(cand), c_int32(nb), _p(token), _p(history), _p(hist_len), _p(pos), c_int32(hist_cap),
                        _p(count), _p(host_words), c_int32(cap)], stream=stream, pdl=self.pdl)

    def emit_token(self, token, count, host_words, cap: int, stream=None):
        """host_words: mapped host memory, [0] tokens written, [1 + i] token i (sampling.hip emit_token)."""
        self.rt.launch(self.fn("sampling", "emit_token"), 1, self.rt.warp_size,
                       [_p(token), _p(count), _p(host_words), c_int32(cap)], stream=stream, pdl=self.pdl)

    def decode_advance(self, token, history, hist_len, pos, hist_cap: int, stream=None):
        self.rt.launch(self.fn("sampling", "decode_advance"), 1, self.rt.warp_size,
                       [_p(token), _p(history), _p(hist_len), _p(pos), c_int32(hist_cap)], stream=stream, pdl=self.pdl)


# ---- float64 oracles ------------------------------------------------------------------------------------------
def ref_rmsnorm(x, gamma, eps):
    x = np.asarray(x, np.float64)
    if gamma is None:
        return x
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(gamma, np.float64)


def ref_silu(g):
    return g / (1.0 + np.exp(-g))


def ref_rope(x, cos, sin):
    """x (..., hd) rotate-half with cos/sin (..., hd/2)."""
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def rope_tables(inv_freq: np.ndarray, max_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_ctx, hd/2] float32 from ModelConfig.rope_inv_freq() (float64 angles)."""
    ang = np.arange(max_ctx, dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def ref_attention(q, k, v, seq):
    """q (nh, hd), k/v (nkv, >=seq, hd) float64 -> (nh*hd) over positions [0, seq)."""
    nh, hd = q.shape
    nkv = k.shape[0]
    G = nh // nkv
    out = np.empty((nh, hd))
    for h in range(nh):
        kk, vv = k[h // G, :seq], v[h // G, :seq]
        s = kk @ q[h] / math.sqrt(hd)
        e = np.exp(s - s.max())
        out[h] = (e / e.sum()) @ vv
    return out.reshape(-1)


def philox4x32_10(counter, key) -> list[int]:
    """Philox4x32-10, bit-exact with he_philox4x32_10 in sampling.hip."""
    c = [int(v) & 0xFFFFFFFF for v in counter]
    k0, k1 = int(key[0]) & 0xFFFFFFFF, int(key[1]) & 0xFFFFFFFF
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        hi0, lo0, hi1, lo1 = p0 >> 32, p0 & 0xFFFFFFFF, p1 >> 32, p1 & 0xFFFFFFFF
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c


def sample_uniform(seed: int, step: int) -> float:
    c = philox4x32_10([step, 0, 0, 0], [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF])
    return float(np.float32((c[0] >> 8) * (1.0 / 16777216.0)))


def ref_sample_keep(logits, history, temperature, top_k, top_p, min_p, rep_pen):
    """(z, kept mask, argmax) with the kernel's semantics, thresholds exact (sort-based), float64."""
    z = np.asarray(logits, np.float64).copy()
    if rep_pen != 1.0 and len(history):
        seen = np.unique(np.asarray(history))
        seen = seen[(seen >= 0) & (seen < z.size)]
        z[seen] = np.where(z[seen] > 0, z[seen] / rep_pen, z[seen] * rep_pen)
    if temperature <= 0:
        return z, None, int(np.argmax(z))
    z = z / temperature
    m = z.max()
    keep = np.ones(z.size, bool)
    if 0 < top_k < z.size:
        kth = np.sort(z)[::-1][top_k - 1]
        keep &= z >= kth
    if top_p < 1.0:
        e = np.where(keep, np.exp(z - m), 0.0)
        order = np.argsort(-z, kind="stable")
        cum = np.cumsum(e[order])
        n_keep = int(np.searchsorted(cum, top_p * e.sum() * (1 - 1e-12))) + 1
        thr = z[order[n_keep - 1]]
        keep &= z >= thr
    if min_p > 0:
        keep &= np.exp(z - m) >= min_p
    return z, keep, int(np.argmax(z))
