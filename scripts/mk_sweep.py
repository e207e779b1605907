"""Monokernel build/launch-configuration sweep on the llama-3.2-1b preset, at one or more contexts
(--contexts 1024,8192,32768; default 1K).

Each variant is (environment for the build, runtime attributes); a variant with a new build constructs a new
MonokernelBackend (the compile cache makes repeats cheap). Every variant must produce the same greedy tokens
as the first at each context (none of the knobs may change a result): a difference is recorded and printed.
Prints one line per variant and context and writes JSON (--json) with the commit, GPU and every figure, so
the defaults in hipengine/gpu/monokernel.py can cite it.

A/B against older trees in the same call: --baseline-tree DIR (repeatable; e.g. `git archive` of a commit
under .carry/) measures each tree's default build first, each in its own process, with its own package and
kernels; --only "" measures the trees alone (alternate them, "a b a b", to control for order).
--max-context N sizes the KV cache for N tokens at every context (the Engine's default is 4096).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from hipengine.bench import git_commit, utc_now
from hipengine.bench.decode import measure
from hipengine.presets import preset_model


VARIANTS = [  # name, build env, runtime attrs
    ("default (1 blk/SM, unroll 4, fine by context: mk_fine)", {}, {}),
    ("fine 2 at every context (barrier + one head per block)", {"HIPENGINE_MK_FINE": "2"}, {}),
    ("fine 3 at every context (last split block combines)", {"HIPENGINE_MK_FINE": "3"}, {}),
    ("poll sleep 100 ns", {}, {"poll_sleep_ns": 100}),
    ("LL exchange for O/down (no barrier after them)", {"HIPENGINE_MK_LL": "1"}, {}),
    ("long-context build at every context (q in registers)", {"HIPENGINE_MK_QREGS": "1"}, {}),
    ("short-context build at every context", {"HIPENGINE_MK_QREGS": "0"}, {}),
    ("default again (drift check)", {}, {}),
    # two blocks per SM (128 registers: the stream at unroll 2 keeps 64 KiB per SM in flight, the attention
    # splits get 16 warps per SM like the per-op kernel's): long / short attention build by context, then short
    ("2 blocks/SM, unroll 2", {"HIPENGINE_MK_MIN_BLOCKS": "2", "HIPENGINE_MK_UNROLL": "2"}, {}),
    ("2 blocks/SM, unroll 2, short-context build", {"HIPENGINE_MK_MIN_BLOCKS": "2", "HIPENGINE_MK_UNROLL": "2",
                                                    "HIPENGINE_MK_QREGS": "0"}, {}),
    # longer attention splits at long context (fewer items per block: 2 instead of ~4 at 32K)
    ("attention splits up to 1,024 positions", {"HIPENGINE_ATTN_MAX_CHUNK": "1024"}, {}),
    ("attention splits up to 2,048 positions", {"HIPENGINE_ATTN_MAX_CHUNK": "2048"}, {}),
    # the attention split's two bodies (docs/perf-log.md v53; their bits differ: tokens may differ from variant
    # 0's when the default is the other)
    ("attention split on the FMA units (v52's body)", {"HIPENGINE_ATTN_MMA": "0"}, {}),
    ("attention split on the matrix cores", {"HIPENGINE_ATTN_MMA": "1"}, {}),
    # the stream with its predicated paths where rows are whole pairs (v67: 6% slower at 1K)
    ("stream with its predicated paths", {"HIPENGINE_MV_WHOLE_PAIRS": "0"}, {}),
    ("without the cold-branch hints (v68: 0.3% slower at 1K)", {"HIPENGINE_MK_DEFINES": "HE_COLD_HINTS=0"}, {}),
    # the attention splits' first K/V requests between the QKV barrier's arrival and its wait (v72)
    ("attention K/V requested before the QKV wait", {"HIPENGINE_MK_DEFINES": "MK_ATTN_EARLY=1"}, {}),
    # the attention plan aiming at half a (KV head, split) block per SM: 8 splits of 128 positions at 1K (session
    # 20: +1% for the monokernel, -1.7% per-op at 1K; session 28: -0.4% at 1K, -7% at 8K; sessions 41-42 under
    # MK_QFLOW: +1.3 to +2.0% at 1K, -0.5 to -0.8% at 2K; the default's plan at caches up to 1K since session 44 — there
    # variant 37 is the plan before): its sums differ
    ("attention plan at 0.5 blocks per SM", {"HIPENGINE_ATTN_BLOCKS_PER_SM": "0.5"}, {}),
    # the per-op path's split plan (session 29 gave the monokernel its own one-round plan: 16 splits of 1,024 at 16K
    # and of 2,048 at 32K, fine 3, +5.7 / +4.4%): 32 splits of 512 / 1,024 there (256 items, fine 2); 1K / 8K
    # unchanged. Its sums differ from the default's there (and equal the per-op path's).
    ("the per-op path's split plan (two rounds from 12K)", {"HIPENGINE_MK_ONE_ROUND": "0"}, {}),
    # session 30: the MLP as one stage (ops/mlp.hip, v75b: 1-2% slower on H200, opt-in) against the default
    # gate/up ── barrier ── down. Its sums differ (fixed-point partials): tokens may differ from variant 0's.
    ("fused MLP (gate/up units apply their down rows)", {"HIPENGINE_FUSED_MLP": "1"}, {}),
    # session 32 (v77): greedy steps stream the LM head's int8 copy and recompute only the rows that can hold the
    # arg-max (ops/head_screen.hip; the default since, +5 to +7%): exact, so the tokens must equal variant 0's
    ("the bf16 LM head (the screen off)", {"HIPENGINE_MK_HEAD_SCREEN": "0"}, {}),
    # (session 33's v77b — the screen's four row sums in one butterfly — was variant 21: +1.4 / +0.8 / −0.3%, now the
    # default; the lane-0 epilogue is gone. Variant 21 is kept as a no-op so the indices below stay.)
    ("default again (v77b's slot)", {}, {}),
    # session 33 (v78): gate/up and down stream the weights' lossless 13-bit copies (ops/matvec_packed.hip):
    # exact, so the tokens must equal variant 0's
    ("packed 13-bit MLP weights (HIPENGINE_MK_PACKED)", {"HIPENGINE_MK_PACKED": "1"}, {}),
    # (v78b — the packed stream with an L2 bulk prefetch of the batches 2 / 4 ahead, and packed gate/up only: −6 to
    # −14% — were variants 23-25 here, removed.)
    # session 34's probe (decode.hip MK_GU_L2, 1K): with the attention plan at 0.5 blocks per SM (variant 18: 64
    # split items, 68 blocks idle during attention) the idle blocks prefetch every warp's next 1 / 2 gate/up units
    # into L2. Values do not change (the tokens are compared with the first variant's). Measured at 1K (4f8958a):
    # −2.3 / −3.8% (K = 1), −5.3% (K = 2) against variant 0; the plan alone is variant 17 (−0.4%, session 28).
    ("0.5 plan + gate/up units 2 of every warp prefetched into L2 (MK_GU_L2=1)",
     {"HIPENGINE_ATTN_BLOCKS_PER_SM": "0.5", "HIPENGINE_MK_DEFINES": "MK_GU_L2=1"}, {}),
    ("0.5 plan + gate/up units 2-3 of every warp prefetched into L2 (MK_GU_L2=2)",
     {"HIPENGINE_ATTN_BLOCKS_PER_SM": "0.5", "HIPENGINE_MK_DEFINES": "MK_GU_L2=2"}, {}),
    # session 35: the same rows PACED (MK_GU_L2_GAP: 32 rows of 4 KiB per GAP cycles, ~1.96 GHz; after the block's
    # O-proj fill): 148 cycles = 1.7 TB/s over ~5 us for K = 1, 74 = 3.5 TB/s. With the default plan the 4 blocks
    # without a split item (128 items at 1K) issue them; with the 0.5 plan 68 do. Values do not change. Measured at
    # 1K (14cfa05): −5.9 / −5.4 / −4.3 / −5.6% against variant 0 (the burst, 23: −3.0%; the plan alone, 17: −0.8%).
    ("default plan + gate/up units 2 paced at 1.7 TB/s (MK_GU_L2=1, GAP=148)",
     {"HIPENGINE_MK_DEFINES": "MK_GU_L2=1,MK_GU_L2_GAP=148"}, {}),
    ("default plan + gate/up units 2 paced at 3.5 TB/s (MK_GU_L2=1, GAP=74)",
     {"HIPENGINE_MK_DEFINES": "MK_GU_L2=1,MK_GU_L2_GAP=74"}, {}),
    ("0.5 plan + gate/up units 2 paced at 1.7 TB/s (MK_GU_L2=1, GAP=148)",
     {"HIPENGINE_ATTN_BLOCKS_PER_SM": "0.5", "HIPENGINE_MK_DEFINES": "MK_GU_L2=1,MK_GU_L2_GAP=148"}, {}),
    ("0.5 plan + gate/up units 2-3 paced at 3.5 TB/s (MK_GU_L2=2, GAP=74)",
     {"HIPENGINE_ATTN_BLOCKS_PER_SM": "0.5", "HIPENGINE_MK_DEFINES": "MK_GU_L2=2,MK_GU_L2_GAP=74"}, {}),
    # session 36: the O-proj by KV-head group (decode.hip MK_O_GROUP, ops/matvec_group.hip): the blocks of each group
    # combine its heads themselves and add their rows' shares in fixed point (no combining block, no heads-combined
    # counter, no att in global memory). The default since session 39 (H100: +1.1 / +1.7 / +2.1% at 1K / 8K / 32K,
    # tokens equal); variant 29 is the plain O-proj it replaced, for the A/B on any part.
    ("plain O-proj (HIPENGINE_MK_OGROUP=0)", {"HIPENGINE_MK_OGROUP": "0"}, {}),
    # ... the grouped O-proj with gate/up's fixed-point prologue in two passes (ops/rmsnorm.hip HE_NORM_FX_ONE_PASS=0:
    # one more round trip)
    ("O-proj by KV-head group, gate/up prologue in two passes",
     {"HIPENGINE_MK_OGROUP": "1", "HIPENGINE_MK_DEFINES": "HE_NORM_FX_ONE_PASS=0"}, {}),
    # session 41: the attention splits poll the QKV stage's LL words instead of waiting at a grid barrier (decode.hip
    # MK_QFLOW; the same sums: tokens must equal variant 0's), with the default plan and with the 0.5 plan (64 items at
    # 1K, all on blocks without a second QKV unit; its sums differ)
    ("QKV values as LL words, no QKV barrier (MK_QFLOW)", {"HIPENGINE_MK_QFLOW": "1"}, {}),
    ("MK_QFLOW + attention plan at 0.5 blocks per SM", {"HIPENGINE_MK_QFLOW": "1", "HIPENGINE_ATTN_BLOCKS_PER_SM": "0.5"},
     {}),
    # ... and (the default since session 41) without it: the grid barrier between QKV and attention, for the A/B
    ("QKV barrier (HIPENGINE_MK_QFLOW=0)", {"HIPENGINE_MK_QFLOW": "0"}, {}),
    # session 42: a quarter of the default plan's items (4 splits of 256 at 1K: 32 items on the grid's last blocks, so
    # 100 blocks hold no split); variant 17 is the 0.5 plan (with MK_QFLOW, the default since session 41). Sums differ.
    # Measured on an H100 (0bb64a1): −2.7% at 1K, −6.3% at 2K against the default plan (the 0.5 plan: +1.3 / −0.8%).
    ("attention plan at 0.24 blocks per SM", {"HIPENGINE_ATTN_BLOCKS_PER_SM": "0.24"}, {}),
    # (session 42's MK_O_SPARE — with the 0.5 plan the O-proj's tiles two to a block on the 64 blocks without a split item,
    # the second by cp.async into shared memory: −2.8% at 1K, −3.7% at 2K against the 0.5 plan — was variant 35, removed.)
    # session 43: the RMSNorm prologues' gamma loads (ops/rmsnorm.hip HE_NORM_GAMMA_EARLY; the default 2: gamma requested
    # with the input, QKV's and the LM head's plain x in one pass too — one L2 round trip per prologue). The same values:
    # tokens must equal variant 0's. 35: session 42's prologues (gamma after the sum: gate/up 3 round trips, QKV and
    # the LM head 2); 36: the early gamma in gate/up's fixed-point prologue only.
    ("RMSNorm prologues as session 42's (HE_NORM_GAMMA_EARLY=0)", {"HIPENGINE_MK_DEFINES": "HE_NORM_GAMMA_EARLY=0"}, {}),
    ("gamma early in gate/up's prologue only (HE_NORM_GAMMA_EARLY=1)", {"HIPENGINE_MK_DEFINES": "HE_NORM_GAMMA_EARLY=1"},
     {}),
    # session 44: caches of up to 1K take half a block per SM by default (ops.SHORT_PLAN_BPS: variant 17's plan there);
    # 37 is the plan before, one block per SM (16 splits of 64 at 1K; at 2K and above the default's own plan). Sums differ.
    ("attention plan at 1 block per SM (the plan at 1K before session 44)", {"HIPENGINE_ATTN_BLOCKS_PER_SM": "1"}, {}),
    # session 48: the splits leave the newest row to the combine (attention_decode.hip HE_ATTN_FRESH_COMBINE; both paths'
    # build), measured +3.3 / +2.9 / +1.0% in session 49 and the default since: 38 is the newest row in its split, the
    # default before. Its sums differ: tokens may differ from variant 0's.
    ("the newest row in its split (HIPENGINE_ATTN_FRESH_COMBINE=0; the default before session 49)",
     {"HIPENGINE_ATTN_FRESH_COMBINE": "0"}, {}),
    # (session 49's MK_PART_LL — the splits' partials as LL words the grouped O-proj's combine polled, no split counter:
    # −1.5 to −2.4 / −3.2 to −3.8 / −3.5% at 1K / 8K / 32K on an H100 — was variant 39, removed.)
    # (session 49's MK_GU_L2_LATE — gate/up's next rows prefetched into L2 by the grouped O-proj's blocks once their
    # group's splits were done: =1 −3.3 / −2.4 / −1.2%, =2 −3.8 / −3.4 / −2.3%, =1 after the group's combine −2.8 /
    # −1.0 / −1.9% at 1K / 8K / 32K on an H100 in session 50 (the O-proj +2.1 µs per layer, gate/up −1.1) — were
    # variants 39-41, removed.)
    # (session 50's MK_ARRIVE_L2 — at each grid barrier's arrival, the next stage's second pair asked of L2 after its
    # first pair's request; mask 1 gate/up, 2 down, 4 the next QKV, 7 all three, 15 and the next step's QKV: −2.8 /
    # −1.9 / −0.9 / −4.6 / −3.9% at 1K, −1.5 / −1.4 / +0.1 / −3.8 / −4.1% at 8K on an H100 (the exits wait for the
    # first fill, which shared HBM with them) — were variants 39-43, removed.)
    # session 50: when the down barrier opens, the next layer's QKV second pair asked of L2 (decode.hip MK_START_L2=4,
    # the default since: +0.6 / +1.0% at 1K, +2.3 / 0.0% at 8K, +1.2 / +1.1% at 32K on an H100); 39 is the build
    # without it, the default before. Values unchanged: tokens must equal variant 0's. (Its other bits, measured as
    # variants 39-42 on d32548a: gate/up's pair after the O barrier −1.8 / −2.1% at 1K, down's after the gate/up
    # barrier −0.2 / −0.9%, all three −0.9 / −1.2% — not kept.)
    ("no stage's 2nd pair into L2 as its barrier opens (MK_START_L2=0; the default before session 50)",
     {"HIPENGINE_MK_DEFINES": "MK_START_L2=0"}, {}),
    # (session 50's bits 8 (the next step's QKV pair after the LM head's barrier) and 16 (the LM head's pair after the last
    # down barrier), measured in session 51 with the default's bit 4 on an H100: 12 −0.3 / −0.2% at 1K, +2.2 / +0.4% at
    # 8K, +0.1 / +0.2% at 32K; 20 −0.2 / −0.2, −0.3 / −0.4, 0.0 / −0.9%; 28 −0.7 / 0.0, −1.3 / −1.5, −0.9 / −1.9% — were
    # variants 40-42, removed with the bits. And the half-pair form of masks 7 and 5, all bits halved (then
    # MK_START_L2_BATCHES=1): 7 +0.6 / +0.1 / +0.4 / +1.0% at 1K, +1.6 / −0.4 / −0.8 / −1.6% at 8K, −1.5 / −1.3 / −1.0 /
    # −1.1% at 32K; 5 −0.8 / −1.0, +0.7 / −0.5, −1.5 / −1.5% — were variants 43 / 44.)
    # (session 51's MK_START_L2_HALF — the bits that ask for their pair's first batch only — measured in session 52 on
    # an H100 against mask 4 (means of four rounds in two processes; 7 / 3 two in one): down's half pair with the whole
    # QKV pair (6 / 2) +0.3 / −0.2 / +0.1% at 1K / 8K / 32K, gate/up's and down's halves (7 / 3) +0.7 / −0.9 / −0.4%,
    # every bit halved (7 / 7) +1.0 / −0.3 / −0.3%, with session 51's rounds of it +0.7 / −0.3 / −0.8% over eight — the
    # short-context build's default since (monokernel.start_l2_defines); 40-42 were these, 40 is now the mask the long
    # builds keep.)
    ("the next layer's QKV whole 2nd pair into L2 only (MK_START_L2=4; the long builds' default, the short build's "
     "before session 52)", {"HIPENGINE_MK_DEFINES": "MK_START_L2=4"}, {}),
    # (session 56's MK_O_SMEM=1 — each grouped O-proj block's Wo tile copied into shared memory by the copy engine one stage
    # early, as the previous layer's gate/up started: −5.5% at 1K on an H100, the window unchanged (13.43 → 13.40 µs per
    # layer), gate/up +1.95 and down +1.15 µs — and the probe MK_PROBE_NO_O=1 — no O-proj weight bytes at all, wrong
    # values: +2.1%, the bound on moving those bytes — were variants 41 / 42, removed.)
    # session 56: the default build launched with MK_O_SMEM's 64 KiB + 128 B of shared memory unused (HIPENGINE_MK_SMEM_PAD):
    # the L1 / shared-memory carve-out alone (session 22 on an H200: level from 44 to 175 KiB). Values unchanged.
    ("the default with 65,664 B of unused shared memory (HIPENGINE_MK_SMEM_PAD)", {"HIPENGINE_MK_SMEM_PAD": "65664"}, {}),
    # session 57: the KV cache's lines persisting in L2 (an access-policy window on the decode stream, an L2 set-aside of
    # up to the device's limit: hipengine/gpu/ops.py l2_persist_kv). A host setting: same build, same values.
    ("the KV cache persisting in L2 (HIPENGINE_L2_PERSIST_KV=1)", {"HIPENGINE_L2_PERSIST_KV": "1"}, {}),
    # ... and the launch's carve-out asked for the most L1 its shared memory allows (HIPENGINE_MK_CARVEOUT=0; the driver
    # chooses otherwise — session 11's profile of the split kernel found it taking 64 KiB where 32 held its blocks)
    ("the default preferring the most L1 (HIPENGINE_MK_CARVEOUT=0)", {"HIPENGINE_MK_CARVEOUT": "0"}, {}),
    # (session 52's neighbours of the short build's masks 7 / 7, measured at 1K in session 53 on an H100: without the
    # next layer's QKV half pair (3 / 3) +0.2 / −0.1%, level; down's whole pair (7 / 5) −0.6% — were variants 41 / 42.)
    # (session 53's MK_KV_L2=1 — the attention splits' K/V rows asked of L2 as the down barrier opens (token selection's
    # for layer 0) by the blocks that run them — measured in session 54 on an H100 at 1K: −0.8 / −0.7 / −1.0% over three
    # rounds (its q poll came back 0.4 µs sooner, the split blocks' QKV 0.4 µs later) — was variant 41, removed.)
    # (session 54's MK_QKV_LATE=d — QKV's second round (the newest K/V rows, blocks 0-59) requested only after ceil(64 / d)
    # split items had staged their q — measured in session 55 on an H100 at 1K: d = 1 / 2 / 8 −6.0 / −5.5 / −5.6%, d = 1
    # without the QKV half pair in L2 −6.6% (the split's q poll stayed at 2.0 µs; the deferred round ended inside the
    # O-proj window) — were variants 41-44, removed.)
    # (session 45's MK_KV_EARLY=128 — each split block's cache rows copied into shared memory by two bulk copies after its
    # QKV prologue, read there by the split: −2.3% at 1K on an H100 — was variant 38, removed.)
    # (session 45's HE_STREAM_EVICT_FIRST=1 — the weight stream's loads with an L2 evict-first policy: +0.4 / −1.1 / −0.7%
    # at 1K / 8K / 32K on an H100 — and with HE_KV_EVICT_LAST=1, the KV rows evict-last too: −0.7% at 1K — were variants
    # 38 and 39, removed.)
    # (session 45's HE_ATTN_FRESH_GUARD=1 — in MK_QFLOW's split only the warp whose first tile holds the newest row enters
    # the fresh-row load: level at 1K on an H100, −0.2% — and session 46's =2 — the next tiles' loads without the poll code
    # where the tile does not hold the newest row: +4.3 / +3.2% at 8K / 32K — were variants 38 and 39; both the default
    # since session 47, the define removed.)
    # (session 44's MK_O_RES_EARLY=0 — the grouped O-proj's group-0 residual read after the combine, against the default
    # then: its rows staged by cp.async before the combine, +0.3 / +0.2% for the old place, level — and MK_BAL=1 / 2 —
    # QKV's (and gate/up's) partial last round dealt warp-major over the blocks: −2.0 / −2.7% — were variants 37-39,
    # removed with them; 37 is now the plan A/B above.)
    # (session 43's HE_MV_EARLY_A — each matvec stage's first refill by cp.async during its prologue: −1.5% for batch a,
    # −6.8% for the whole pair at 1K on an H100 — was variant 37 then, and MK_QKV_POS=2 — MK_QFLOW's QKV epilogue with the
    # position by value and cos / sin requested by pre(): −2.2%, and not the same bits — variant 38 then; both removed.)
    # (session 40's MK_O_BULK=1 — each grouped O-proj block's Wo tile copied into shared memory by the copy engine, at the
    # attention stage's start and then from inside the block's split after its first K/V and q requests: −3.6 / −3.9 /
    # −2.6% and −1.6 / −3.6 / −2.7% — was variant 31 here, removed.)
    # (session 40's MK_SPLIT_TAIL_SYNC=0 — no block barrier after a block's last attention split, so warps 1-7 request
    # their O-proj weights during thread 0's release: −0.2 / +0.1 / +0.1%, level — was variant 31 here, removed.)
    # (session 38's MK_OG_XOUT — gate/up's prologue wrote the fixed-point residual back into x, down added x and
    # cleared x_fx — was variant 29 here and session 37's down 31: XOUT −0.4 / −0.5 / −0.8% against it, removed.
    # Then 31 was session 37's down against session 39's (ops/matvec_group.hip HeMvPlainFxRes: the words' raw bits
    # kept until the epilogue): level, −0.1 / +0.1 / +0.1%; removed. 29 is now the plain O-proj.)
    # (session 35's MK_FILL_O_AFTER_WAIT — the O-proj's first pair after the heads-combined wait: −1.1 / −1.3 / −1.1% —
    # and then MK_ATTN_LL — the attention -> O-proj handoff through LL words: −26 / −23 / −19% — were variant 29 here,
    # removed.)
    # (session 31's v76 — the matrix-core attention split with 2 / 3 K/V tiles in flight per warp: −1.3 / −2.9 / −2.1%
    # and −4 to −7% at 1K / 8K / 32K — were variants 20 / 21 here, removed.)
    # (session 27's v71 — the QKV position by value: level — and v73 — the combine by the spare blocks: −3% — were
    # variants here, removed.)
    # (session 26's v69 / v69b — a fill's two batches at once, everywhere or per site; down's fill serialised —
    # and v70 — the grid waits' abort word every 64 polls — were variants here: all slower or level, removed)
    # (session 6's compile-time experiments HE_ARRIVE_RED / MK_DEFER_NEXT / HE_POLL_RELAXED / HE_MV_WARP_MAJOR /
    # MK_FILL_O_LATE were variants here via HIPENGINE_MK_DEFINES: the first two and the last are now the default,
    # the others were slower and are gone from the kernels; docs/perf-log.md v22-v24)
]
BUILD_KNOBS = ("HIPENGINE_MK_UNROLL", "HIPENGINE_MK_MIN_BLOCKS", "HIPENGINE_MK_LL", "HIPENGINE_MK_DEFINES",
               "HIPENGINE_MK_QREGS", "HIPENGINE_ATTN_MAX_CHUNK", "HIPENGINE_ATTN_MMA", "HIPENGINE_MK_FINE",
               "HIPENGINE_MV_WHOLE_PAIRS", "HIPENGINE_ATTN_BLOCKS_PER_SM", "HIPENGINE_MK_ONE_ROUND",
               "HIPENGINE_FUSED_MLP", "HIPENGINE_MK_HEAD_SCREEN", "HIPENGINE_MK_PACKED", "HIPENGINE_MK_OGROUP",
               "HIPENGINE_MK_QFLOW")


# Run in a subprocess with PYTHONPATH = an older tree (its package and kernels): the same measurement of its
# default monokernel build, for an A/B inside one device call. Prints one JSON line.
BASELINE = """
import json, sys
from hipengine.bench.decode import measure
from hipengine.gpu.monokernel import MonokernelBackend
from hipengine.presets import preset_model
contexts, max_context = json.loads(sys.argv[1]), int(sys.argv[3])
be = MonokernelBackend(preset_model("llama-3.2-1b", 0), max_context=max(min(contexts), max_context))
if max_context:  # older trees' measure() sizes the cache per context: size it for max_context instead
    resize = be.resize_context
    be.resize_context = lambda C: resize(max(C, max_context))
rows = measure(be, contexts, ["monokernel"], runs=int(sys.argv[2]), log=lambda m: None)
be.close()
print(json.dumps([{k: r[k] for k in ("context", "tok_s", "tok_s_runs", "tokens")} for r in rows]))
"""


def gpu_name() -> str:
    from hipengine.gpu.runtime import get_runtime

    try:
        return get_runtime(0).name
    except Exception:  # noqa: BLE001 — a label only
        return ""


def baseline(tree: str, contexts: list[int], runs: int, max_context: int = 0) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    for k in BUILD_KNOBS:
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", BASELINE, json.dumps(contexts), str(runs), str(max_context)], env=env,
                         capture_output=True, text=True, cwd=os.path.abspath(tree))
    if out.returncode != 0:
        raise SystemExit(f"baseline tree {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def sweep(picks, model, contexts, args, rows: list, ref: dict) -> None:
    """Measure variants `picks` at `contexts` in this process, appending a row per (variant, context) to rows."""
    from hipengine.errors import DeviceError, UnsupportedError
    from hipengine.gpu.monokernel import MonokernelBackend, grid_info

    be, be_env, base = None, None, {}
    try:
        for i in picks:
            name, env, attrs = VARIANTS[i]
            try:
                if be is None or env != be_env:
                    if be is not None:
                        be.close()
                        be = None
                    for k in set(BUILD_KNOBS) | {k for _, e, _ in VARIANTS for k in e}:  # nothing leaks between variants
                        os.environ.pop(k, None)
                    os.environ.update(env)
                    t0 = time.perf_counter()
                    be, be_env = MonokernelBackend(model, max_context=max(min(contexts), args.max_context)), env
                    base = {"poll_sleep_ns": be.poll_sleep_ns}  # (fine is the build's: mk_fine / HIPENGINE_MK_FINE)
                    l2 = getattr(be, "l2_kv_bytes", 0)
                    print(f"built {name}: {time.perf_counter() - t0:.1f} s, {grid_info(be)}"
                          + (f", {l2 / 2**20:.1f} MiB of L2 set aside for the {be.kv_cache.nbytes / 2**20:.1f} MiB KV cache"
                             if l2 else ""), flush=True)
                for k, v in {**base, **attrs}.items():
                    setattr(be, k, v)
                for r in measure(be, contexts, ["monokernel"], runs=args.runs, log=lambda m: None,
                                 max_context=args.max_context or None):
                    C = r["context"]
                    first = ref.setdefault(C, r["tokens"])
                    same = first == r["tokens"]
                    prefix = next((i for i, (a, b) in enumerate(zip(first, r["tokens"])) if a != b),
                                  min(len(first), len(r["tokens"])))
                    rows.append({"variant": name, "env": env, "attrs": attrs, "context": C, "tok_s": r["tok_s"],
                                 "tok_s_runs": r["tok_s_runs"], "tokens_equal_first_variant": same,
                                 "tokens_common_prefix": prefix, "tokens": len(r["tokens"]), "grid": grid_info(be)})
                    print(f"{name:50s} {C:6d} {r['tok_s']:8.1f} tok/s  runs {[round(x, 1) for x in r['tok_s_runs']]}"
                          f"{'' if same else f'  TOKENS DIFFER from the first variant from token {prefix} of {len(first)}'}",
                          flush=True)
            except (DeviceError, UnsupportedError) as e:  # one variant's failure is its row; the sweep goes on
                rows.append({"variant": name, "env": env, "attrs": attrs, "error": str(e)})
                print(f"{name:50s} FAILED: {e}", flush=True)
                if be is not None:
                    try:
                        be.close()
                    except DeviceError:
                        pass
                be, be_env = None, None
    finally:
        if be is not None:
            be.close()


def _time_up(*_):
    raise KeyboardInterrupt("SIGTERM: the sweep's time is up")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024", help="comma-separated contexts (tokens in the KV cache)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=0,
                    help="size the KV cache for this many tokens at every context (0: the context itself)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="comma-separated variant indices (\"\": none, trees only)")
    ap.add_argument("--baseline-tree", action="append", default=[],
                    help="an older checkout (e.g. `git archive` of the last commit): its default build is "
                         "measured first, in a subprocess, and every variant's tokens are compared with the "
                         "first tree's (repeatable: each tree in turn)")
    ap.add_argument("--best-env", default=None, help="write the fastest variant's runtime knobs as shell exports")
    args = ap.parse_args()
    model = preset_model("llama-3.2-1b", 0)
    contexts = [int(c) for c in args.contexts.split(",")]
    rows, ref = [], {}
    picks = [int(i) for i in args.only.split(",") if i.strip()] if args.only is not None else range(len(VARIANTS))
    for tree in args.baseline_tree:
        t0 = time.perf_counter()
        for r in baseline(tree, contexts, args.runs, args.max_context):
            same = ref.setdefault(r["context"], r["tokens"]) == r["tokens"]
            rows.append({"variant": f"baseline tree {tree}", "env": {}, "attrs": {}, "context": r["context"],
                         "tok_s": r["tok_s"], "tok_s_runs": r["tok_s_runs"], "tokens_equal_first_variant": same})
            print(f"{'baseline ' + tree:50s} {r['context']:6d} {r['tok_s']:8.1f} tok/s  runs "
                  f"{[round(x, 1) for x in r['tok_s_runs']]}{'' if same else '  TOKENS DIFFER from the first'}",
                  flush=True)
        print(f"baseline {tree} measured in {time.perf_counter() - t0:.1f} s", flush=True)
    # A time-boxed call (device_session.sh: `timeout`) ends the sweep with SIGTERM: it stops there (the backend
    # closed by sweep()) and the rows so far are written, so a sweep cut short still leaves its JSON.
    signal.signal(signal.SIGTERM, _time_up)
    try:
        sweep(picks, model, contexts, args, rows, ref)
    except KeyboardInterrupt as e:
        print(f"sweep stopped early ({e}); writing the {len(rows)} rows measured", flush=True)
        rows.append({"variant": "(the sweep stopped here)", "env": {}, "attrs": {}, "error": str(e) or "interrupted"})
    ours = [r for r in rows if r.get("context") == contexts[0] and not r["variant"].startswith("baseline tree")
            and "tok_s" in r]
    if args.best_env and ours:  # the fastest of this tree's variants at the first context
        best = max(ours, key=lambda r: r["tok_s"])
        names = {"poll_sleep_ns": "HIPENGINE_MK_POLL_SLEEP_NS"}
        with open(args.best_env, "w") as f:
            f.write(f"# fastest: {best['variant']} ({best['tok_s']:.1f} tok/s)\n")
            for k, v in {**best["env"], **best["attrs"]}.items():
                f.write(f"export {names.get(k, k)}={v}\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "monokernel sweep", "model": "llama-3.2-1b preset (bf16)", "contexts": contexts,
                       "max_context": args.max_context or None,
                       "commit": git_commit(), "date": utc_now(), "gpu": os.environ.get("GPU_NAME") or gpu_name(),
                       "results": rows}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    from hipengine.errors import run_script

    run_script(main)
