"""Fill ./.mkcache (or $HIPENGINE_CACHE) with sm_90 builds of the per-op kernels and of the monokernel
variants a device session uses, on this CPU machine (NVRTC only), so device time is not spent compiling.
Usage: HIPENGINE_CACHE=$PWD/.mkcache python scripts/precompile_mk.py [variant ...]
Variants: default (groups 1-4, bf16 + fp16), session (groups 2-4), profile, unroll8, 2blk, 1b, 1b-profile,
1b-bf16-head, 1b-packed, 1b-packed-profile, 1b-1k-gu-l2, 1b-1k-gu-l2x2, 1b-1k, 1b-1k-profile, 1b-1k-gu-pace148, 1b-1k-gu-pace74,
1b-1k-gu-x2-pace74, 1b-1k-gu-pace148-profile, 1b-f3, 1b-ogroup, 1b-ogroup-2pass, 1b-plain-o, 1b-1k-ogroup-profile, 1b-f3-qflow, 1b-1k-qflow-profile, 1b-f3-noflow, 1b-1k-ge0, 1b-1k-ge1, 1b-f3-nofc, 1b-f3-sl0, 1b-f3-sl4, 1b-1k-sl0, 1b-1k-sl4, 1b-tp, 1b-tp-profile (from 1b on: llama-3.2-1b only,
bf16, group 4; -tp: the LL exchange build, MK_TP=1; -1k-: the 1K cache class only).
Compile-time experiments: set HIPENGINE_MK_DEFINES for the run (it is part of the build)."""
from __future__ import annotations

import sys

# llama-3.2-1b's stream row lengths (hidden size, q_dim, ffn; at tp = 2 the ffn and q_dim are halved): they pick
# the monokernel build without the stream's predicated paths (compile_args `rows`)
L1B, L1B_TP2 = {"rows": (2048, 2048, 8192)}, {"rows": (2048, 1024, 4096)}
L1B_1K = {**L1B, "sizes": (1024,), "fines": (3,)}  # the 1K cache class only (1K-only sweeps)
L1B_F3 = {**L1B, "fines": (3,)}  # every cache class, fine = 3 only (mk_fine's choice for llama-3.2-1b at every size)
ANY = {"qk_norm": (False, True)}  # the tests' models: Qwen3 (q/k norms) among them
VARIANTS = {  # name: (environment, weight dtypes, groups, precompile keywords)
    "default": ({}, (False, True), (1, 2, 3, 4), ANY),
    "session": ({}, (False, True), (2, 3, 4), ANY),  # what device_session.sh + device_default_model.sh build
    "profile": ({"HIPENGINE_MK_PROFILE": "1"}, (False, True), (3, 4), ANY),
    "unroll8": ({"HIPENGINE_MK_UNROLL": "8"}, (False,), (4,), L1B),
    "2blk": ({"HIPENGINE_MK_MIN_BLOCKS": "2", "HIPENGINE_MK_UNROLL": "2"}, (False,), (4,), L1B),
    "1b": ({}, (False,), (4,), L1B),
    "1b-profile": ({"HIPENGINE_MK_PROFILE": "1"}, (False,), (4,), L1B),
    "1b-bf16-head": ({"HIPENGINE_MK_HEAD_SCREEN": "0"}, (False,), (4,), L1B),  # the LM head without the screen (v77)
    "1b-packed": ({"HIPENGINE_MK_PACKED": "1"}, (False,), (4,), L1B),  # packed 13-bit MLP weights (v78)
    "1b-packed-profile": ({"HIPENGINE_MK_PACKED": "1", "HIPENGINE_MK_PROFILE": "1"}, (False,), (4,), L1B),
    # session 34's probe at 1K (mk_sweep 23 / 24): gate/up rows prefetched into L2 by the blocks without a split
    "1b-1k-gu-l2": ({"HIPENGINE_MK_DEFINES": "MK_GU_L2=1"}, (False,), (4,), L1B_1K),
    "1b-1k-gu-l2x2": ({"HIPENGINE_MK_DEFINES": "MK_GU_L2=2"}, (False,), (4,), L1B_1K),
    # the default and its profile build, 1K only
    "1b-1k": ({}, (False,), (4,), L1B_1K),
    "1b-1k-profile": ({"HIPENGINE_MK_PROFILE": "1"}, (False,), (4,), L1B_1K),
    # session 35: the same rows paced (mk_sweep 25-28; MK_GU_L2_GAP cycles per 32-row group), and 25's profile build
    "1b-1k-gu-pace148": ({"HIPENGINE_MK_DEFINES": "MK_GU_L2=1,MK_GU_L2_GAP=148"}, (False,), (4,), L1B_1K),
    "1b-1k-gu-pace74": ({"HIPENGINE_MK_DEFINES": "MK_GU_L2=1,MK_GU_L2_GAP=74"}, (False,), (4,), L1B_1K),
    "1b-1k-gu-x2-pace74": ({"HIPENGINE_MK_DEFINES": "MK_GU_L2=2,MK_GU_L2_GAP=74"}, (False,), (4,), L1B_1K),
    "1b-1k-gu-pace148-profile": ({"HIPENGINE_MK_DEFINES": "MK_GU_L2=1,MK_GU_L2_GAP=148", "HIPENGINE_MK_PROFILE": "1"},
                                 (False,), (4,), L1B_1K),
    # every cache class at fine = 3 (the default build since session 39 includes the grouped O-proj, MK_O_GROUP)
    "1b-f3": ({}, (False,), (4,), L1B_F3),
    "1b-ogroup": ({"HIPENGINE_MK_OGROUP": "1"}, (False,), (4,), L1B_F3),
    "1b-ogroup-2pass": ({"HIPENGINE_MK_OGROUP": "1", "HIPENGINE_MK_DEFINES": "HE_NORM_FX_ONE_PASS=0"}, (False,), (4,),
                        L1B_F3),
    "1b-plain-o": ({"HIPENGINE_MK_OGROUP": "0"}, (False,), (4,), L1B_F3),  # the plain O-proj (mk_sweep 29)
    "1b-1k-ogroup-profile": ({"HIPENGINE_MK_OGROUP": "1", "HIPENGINE_MK_PROFILE": "1"}, (False,), (4,), L1B_1K),
    # session 41: the attention splits fed by the QKV stage's LL words, no QKV barrier (decode.hip MK_QFLOW; mk_sweep 31 / 32)
    "1b-f3-qflow": ({"HIPENGINE_MK_QFLOW": "1"}, (False,), (4,), L1B_F3),
    "1b-1k-qflow-profile": ({"HIPENGINE_MK_QFLOW": "1", "HIPENGINE_MK_PROFILE": "1"}, (False,), (4,), L1B_1K),
    "1b-f3-noflow": ({"HIPENGINE_MK_QFLOW": "0"}, (False,), (4,), L1B_F3),  # the QKV barrier (mk_sweep 33; default before)
    # session 43: the RMSNorm prologues' gamma loads at 1K (mk_sweep 35 / 36: session 42's prologues, gate/up's only)
    "1b-1k-ge0": ({"HIPENGINE_MK_DEFINES": "HE_NORM_GAMMA_EARLY=0"}, (False,), (4,), L1B_1K),
    "1b-1k-ge1": ({"HIPENGINE_MK_DEFINES": "HE_NORM_GAMMA_EARLY=1"}, (False,), (4,), L1B_1K),
    # session 48: the newest row added by the combine (HE_ATTN_FRESH_COMBINE; the default since session 49), and the
    # newest row in its split (the default before: mk_sweep 38)
    "1b-f3-nofc": ({"HIPENGINE_ATTN_FRESH_COMBINE": "0"}, (False,), (4,), L1B_F3),
    # session 50: MK_START_L2 (the next layer's QKV second pair into L2 as the down barrier opens, the default since):
    # the build without MK_START_L2 (mk_sweep 39); session 52: mask 4 alone, the short build's default before masks 7 / 7
    # (mk_sweep 40; the long builds keep it)
    "1b-f3-sl0": ({"HIPENGINE_MK_DEFINES": "MK_START_L2=0"}, (False,), (4,), L1B_F3),
    "1b-f3-sl4": ({"HIPENGINE_MK_DEFINES": "MK_START_L2=4"}, (False,), (4,), L1B_F3),
    # session 57: the same two at 1K only (the H200's first A/B of the masks, mk_sweep 39 / 40)
    "1b-1k-sl0": ({"HIPENGINE_MK_DEFINES": "MK_START_L2=0"}, (False,), (4,), L1B_1K),
    "1b-1k-sl4": ({"HIPENGINE_MK_DEFINES": "MK_START_L2=4"}, (False,), (4,), L1B_1K),
    "1b-tp": ({"HIPENGINE_MK_LL": "1"}, (False,), (4,), L1B_TP2),  # the tensor-parallel build (MK_TP=1)
    "1b-tp-profile": ({"HIPENGINE_MK_LL": "1", "HIPENGINE_MK_PROFILE": "1"}, (False,), (4,), L1B_TP2),
}


def main() -> int:
    from hipengine.gpu.monokernel import environ_set, precompile

    for name in sys.argv[1:] or list(VARIANTS):
        env, f16s, groups, kw = VARIANTS[name]
        with environ_set(env):
            done = precompile("sm_90", f16_variants=f16s, groups=groups, **kw)
            print(f"{name}: {len(done)} units cached", flush=True)
    return 0


if __name__ == "__main__":
    from hipengine.errors import run_script

    run_script(main)
