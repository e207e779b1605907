"""Host side of the monokernel (kernels_hip/monokernel/decode.hip): the whole decode step — and the whole
generation loop — in one persistent, cooperatively launched kernel.

Layout. The parameter block (``MkParams``), the per-layer table (``MkLayer``), the kernel-written state
(``MkState``) and the host-mapped control words have ONE definition: the tables below. ``c_layout_text()``
generates the C structs with ``static_assert(sizeof/offsetof)`` lines, pasted verbatim between the
GENERATED markers of decode.hip; tests/test_monokernel_layout.py fails when the two drift, and every
compile of decode.hip (NVRTC, clang gfx942) checks the C side's offsets against the numbers Python computed.

Streaming. One launch generates up to ``max_tokens`` tokens. Each token id goes into a pinned, mapped host
ring (plain store, then a system-scope release of the write index); the host thread polls the index and
yields ids as they land. ``should_stop()`` (cancel, stop strings) sets a host-written cancel word the kernel
reads once per token with a system-scope acquire. Every spin-wait in the kernel has a timeout that writes an
error code into the mapped status word; the host raises it as ``DeviceError``.

Knobs (environment; defaults from the H200 sweep in docs/perf-log.md): HIPENGINE_MK_MIN_BLOCKS (resident
blocks per SM the kernel is compiled for, 1), HIPENGINE_MK_BLOCKS_PER_SM (grid, default = min blocks),
HIPENGINE_MK_FINE (2/3 attention -> O-proj synchronisation; default by the split plan, mk_fine), HIPENGINE_MK_UNROLL (4),
HIPENGINE_MK_POLL_SLEEP_NS (0), HIPENGINE_MK_TIMEOUT_S (every spin-wait, 5 s), HIPENGINE_MK_PROFILE (0; 1
builds the stage-profiling variant, read with read_profile()), HIPENGINE_MK_ONE_ROUND (1: the monokernel's own
one-round attention split plan, mk_plan; 0: the per-op path's), HIPENGINE_MK_HEAD_SCREEN (1: greedy steps read the
LM head's int8 copy and recompute exactly only the rows that can hold the arg-max, head_screen_on; 0: the bf16 head),
HIPENGINE_MK_PACKED (0: the MLP's weights as bf16 rows; 1: their lossless 13-bit copies, mlp_packed_on),
HIPENGINE_MK_OGROUP (1: the O-proj by KV-head group, o_group_decide — both decode paths; 0: the plain O-proj;
unset: O_GROUP_DEFAULT where it applies), HIPENGINE_MK_QFLOW (1: the attention splits poll the QKV stage's LL words,
no grid barrier between them, q_flow_decide; 0: the barrier; unset: Q_FLOW_DEFAULT where it applies),
HIPENGINE_MK_SMEM_PAD (0: bytes of unused dynamic shared memory added to the launch — a measurement knob for the L1 /
shared-memory carve-out, smem_pad).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
from ctypes import c_float, c_int32, c_uint32, c_uint64, c_void_p
from types import SimpleNamespace
from typing import Callable, Iterator

import numpy as np

from ..backend import SamplingParams
from ..errors import DeviceError, RequestError, UnsupportedError
from . import ops as O
from . import packed
from .executor import GpuBackend

SOURCE = "monokernel/decode.hip"
KERNEL = "monokernel_decode"
THREADS = 256  # == ops.MATVEC_THREADS == ops.ATTN_THREADS: same block reductions -> bit-identical to per-op
MAX_EOS = 16

# ---- the one layout definition ----------------------------------------------------------------------------
# (field name, C type). C pointer types are 8 bytes on every target we build for (sm_90, gfx942).
_CTYPES = {"he_i32": c_int32, "he_u32": c_uint32, "float": c_float, "he_u64": c_uint64}

LAYER_FIELDS = [
    ("wqkv", "const he_u16*"),      # [q_dim + 2 kv_dim, d] bf16/fp16 (wq|wk|wv stacked)
    ("wo", "const he_u16*"),        # [d, q_dim]
    ("w_gate", "const he_u16*"),    # [ffn, d]
    ("w_up", "const he_u16*"),      # [ffn, d]
    ("w_down", "const he_u16*"),    # [d, ffn]
    ("attn_norm", "const float*"),  # [d]
    ("ffn_norm", "const float*"),   # [d]
    ("bqkv", "const float*"),       # [q_dim + 2 kv_dim] or null
    ("q_norm", "const float*"),     # [hd] or null (Qwen3)
    ("k_norm", "const float*"),     # [hd] or null
    ("k_cache", "he_kv*"),          # [nkv, max_ctx, hd] bf16 or fp16 (port.h he_kv)
    ("v_cache", "he_kv*"),          # [nkv, max_ctx, hd]
    ("w_f16", "he_i32"),            # weights are fp16 (else bf16)
    ("pad0", "he_i32"),
    ("w_down_t", "const he_u16*"),  # [ffn, d] W_down transposed (the fused MLP, ops/mlp.hip) or null
    # MK_MLP_PACKED builds (ops/matvec_packed.hip, hipengine/gpu/packed.py), else null / 0:
    ("w_gate_p", "const he_u8*"),   # gate rows, packed 13-bit
    ("w_up_p", "const he_u8*"),     # up rows, packed
    ("w_down_p", "const he_u8*"),   # down rows, packed
    ("esc_gu", "const he_u32*"),    # gate/up units the packed form cannot hold (bitmap)
    ("esc_down", "const he_u32*"),  # down units likewise
    ("gu_post", "float"),           # 2^D of gate and up (their staged input is x · 2^D)
    ("gu_unpost", "float"),         # 2^-D
    ("down_post", "float"),
    ("down_unpost", "float"),
]

PARAM_FIELDS = [
    ("layers", "const MkLayer*"),   # [n_layers]
    ("embed", "const he_u16*"),     # [vocab, d]
    ("lm_head", "const he_u16*"),   # [vocab, d] (== embed when tied)
    ("final_norm", "const float*"), # [d]
    ("cos_t", "const float*"),      # [max_ctx, hd/2]
    ("sin_t", "const float*"),      # [max_ctx, hd/2]
    ("iota", "const int*"),         # [max_ctx] iota[i] = i: a read-only position word for the op bodies
    ("x", "float*"),                # [d] residual stream
    ("qkv", "float*"),              # [q_dim + 2 kv_dim] raw projections (qk_norm path)
    ("q", "float*"),                # [q_dim] rotated queries
    ("att", "float*"),              # [q_dim] attention output
    ("h", "float*"),                # [ffn] MLP hidden
    ("partial", "float*"),          # [nh, nsplit, hd + 2] attention split partials
    ("logits", "float*"),           # [vocab]
    ("z", "float*"),                # [vocab] sampling scratch
    ("history", "int*"),            # [max_ctx] prompt + generated ids (repetition penalty)
    ("eos", "const int*"),          # [n_eos]
    ("state", "MkState*"),          # device memory, written by the kernel
    ("bar", "HeGridBarrier*"),      # device memory, zeroed before each launch
    ("attn_count", "he_u32*"),      # [nkv + 2] split arrivals per KV head, greedy arrivals, heads combined
    ("cand", "float*"),             # [2 * grid] greedy candidates per block: (value, index bits)
    ("host", "he_u32*"),            # mapped host words (MK_HOST_WORDS)
    ("ring", "int*"),               # mapped host token ring [ring_cap]
    ("timeout_ns", "he_u64"),       # every spin-wait gives up after this long
    ("vocab", "he_i32"),
    ("d", "he_i32"),
    ("ffn", "he_i32"),
    ("nh", "he_i32"),
    ("nkv", "he_i32"),
    ("hd", "he_i32"),
    ("n_layers", "he_i32"),
    ("max_ctx", "he_i32"),
    ("nsplit", "he_i32"),
    ("chunk", "he_i32"),
    ("embed_f16", "he_i32"),
    ("head_f16", "he_i32"),
    ("qk_norm", "he_i32"),
    ("n_eos", "he_i32"),
    ("mode", "he_i32"),             # MK_MODE_* bits
    ("max_tokens", "he_i32"),
    ("ring_cap", "he_i32"),
    ("top_k", "he_i32"),
    ("eps", "float"),
    ("temperature", "float"),
    ("top_p", "float"),
    ("min_p", "float"),
    ("rep_pen", "float"),
    ("seed_lo", "he_u32"),
    ("seed_hi", "he_u32"),
    ("fine", "he_i32"),             # attention -> O-proj: 2: barrier, heads combined one per block;
                                    # 3: the last split block of each KV head combines its group. O-proj
                                    # then waits on the heads-combined counter (no grid barrier)
    ("poll_sleep_ns", "he_u32"),    # back-off between polls of a barrier/counter (0: spin)
    ("prof", "he_u64*"),            # [MK_PROF_WORDS] stage profile (MK_PROFILE builds only), else null
    ("tp_ll", "const he_u64*"),     # tp > 1: [world] every rank's LL exchange region (monokernel/tp_exchange.h)
    ("xb", "float*"),               # tp > 1: [d] second residual-stream buffer (gate/up's input)
    ("tp_world", "he_i32"),         # ranks (1: no tensor parallelism)
    ("tp_rank", "he_i32"),
    ("vocab_off", "he_i32"),        # first global token id of this rank's LM-head slice
    ("embed_vocab", "he_i32"),      # rows of the embedding (all token ids; `vocab` is the LM head's slice)
    ("x_fx", "he_i64*"),            # [d] the fused MLP's fixed-point residual addend (ops/mlp.hip), or null
    ("head_q", "const he_u8*"),     # [V4, d] int8 copy of the LM head (ops/head_screen.hip), or null
    ("head_meta", "const float*"),  # [V4 / 4, 8] its scales and bound coefficients (hipengine/gpu/head_screen.py)
    ("screen_lo", "float*"),        # [grid] each block's max lower bound, published by the LM head's barrier
    ("head_c2", "float"),           # the screen's bound on the dequantised rows' norms
    ("screen", "he_i32"),           # 1: greedy steps of a generation take the screened head (MK_HEAD_SCREEN builds)
    ("flow_ll", "he_u64*"),         # [q_dim + 2 kv_dim] the QKV rows as LL words (MK_QFLOW builds: decode.hip), or null
]

STATE_FIELDS = [
    ("token", "he_i32"),     # the token to embed next (host-written for MK_MODE_EMBED_FIRST)
    ("pos", "he_i32"),       # position the next decode step writes (final value on exit)
    ("hist_len", "he_i32"),  # valid entries of history
    ("n_out", "he_i32"),     # tokens emitted by this launch
    ("stop", "he_i32"),      # MK_FINISH_* decided by block 0 after sampling (0 = continue)
    ("steps", "he_i32"),     # decode steps run by this launch
    ("cancel", "he_i32"),    # the host's cancel word as block 0 read it this token (handed to the leader)
    ("pad1", "he_i32"),
]

# Host-mapped control words (u32 indices). write_idx/status/finish are device-written (system-scope
# release); cancel is host-written (device reads with a system-scope acquire once per token).
MK_HOST_WORDS = ["write_idx", "status", "finish", "cancel", "n_out", "pos", "pad0", "pad1"]

MK_MODE_EMBED_FIRST = 1  # start with a decode step of state.token (else: sample from the logits buffer)
MK_MODE_ONE_STEP = 2     # stop after one decode step (the logits stay in the buffer; no sampling)
MK_FINISH = {1: "stop", 2: "length", 3: "cancelled", 4: "context"}
# Must match sync.h's kStatus* (checked by tests/test_monokernel_layout.py).
MK_STATUS = {0: "running", 1: "done", 2: "grid barrier timeout", 3: "counter wait timeout",
             4: "aborted by another block's error", 5: "tensor-parallel peer exchange timeout"}


def _ctype(ct: str):
    return c_uint64 if ct.endswith("*") else _CTYPES[ct]


def _struct(name: str, fields) -> type:
    return type(name, (ctypes.Structure,), {"_fields_": [(n, _ctype(t)) for n, t in fields]})


MkLayer = _struct("MkLayer", LAYER_FIELDS)
MkParams = _struct("MkParams", PARAM_FIELDS)
MkState = _struct("MkState", STATE_FIELDS)
_STRUCTS = [("MkLayer", MkLayer, LAYER_FIELDS), ("MkState", MkState, STATE_FIELDS),
            ("MkParams", MkParams, PARAM_FIELDS)]
# Python side of the layout check: natural alignment, no hidden padding (every pointer/u64 8-aligned).
for _n, _S, _f in _STRUCTS:
    _off = 0
    for _name, _t in _f:
        _sz = ctypes.sizeof(_ctype(_t))
        _off = (_off + _sz - 1) // _sz * _sz
        assert getattr(_S, _name).offset == _off, (_n, _name)
        _off += _sz
    assert ctypes.sizeof(_S) == (_off + 7) // 8 * 8, _n


def c_layout_text() -> str:
    """The C definitions decode.hip must contain verbatim (between the GENERATED markers)."""
    out = ["// BEGIN GENERATED by hipengine/gpu/monokernel.py c_layout_text(): edit the Python tables, not this.",
           "// Offsets are compile-time checked where the front end has __builtin_offsetof (clang: gfx942 and the",
           "// host layout probe); NVRTC lacks it, so monokernel_layout() reports them at run time and the host",
           "// compares (MonokernelBackend._check_layout).",
           "#if defined(__clang__)",
           "#define MK_OFFSET_CHECK(T, f, off) static_assert(__builtin_offsetof(T, f) == off, #T \".\" #f);",
           "#else",
           "#define MK_OFFSET_CHECK(T, f, off)",
           "#endif",
           "struct HeGridBarrier;", "struct MkLayer;", "struct MkState;"]
    for name, S, fields in _STRUCTS:
        out.append(f"struct {name} {{")
        out += [f"  {t} {n};" for n, t in fields]
        out.append("};")
        out.append(f'static_assert(sizeof({name}) == {ctypes.sizeof(S)}, "{name} size (Python table)");')
        out += [f"MK_OFFSET_CHECK({name}, {n}, {getattr(S, n).offset})" for n, _ in fields]
    # enums, not constexpr ints: NVRTC warns about unreferenced constants and warnings are errors
    out.append("enum MkHostWord { " + ", ".join(f"kMkHost_{w} = {i}" for i, w in enumerate(MK_HOST_WORDS)) + " };")
    out.append(f"enum MkMode {{ kMkModeEmbedFirst = {MK_MODE_EMBED_FIRST}, kMkModeOneStep = {MK_MODE_ONE_STEP} }};")
    out.append("enum MkFinish { " + ", ".join(f"kMkFinish_{v} = {k}" for k, v in MK_FINISH.items()) + " };")
    out.append(f"enum {{ kMkThreads = {THREADS} }};")
    # Run-time layout report (NVRTC has no offsetof): sizes then offsets, in layout_expected() order.
    out.append("extern \"C\" __global__ void monokernel_layout(he_u64* out) {")
    out.append("  if (he_thread_idx() != 0 || he_block_idx() != 0) return;")
    i = 0
    for name, _S, fields in _STRUCTS:
        v = f"v{name}"
        out.append(f"  {name} {v}{{}};")
        out.append(f"  out[{i}] = sizeof({name});")
        i += 1
        for n, _ in fields:
            out.append(f"  out[{i}] = (he_u64)((const char*)&{v}.{n} - (const char*)&{v});")
            i += 1
    out.append("}")
    out.append("// END GENERATED")
    return "\n".join(out) + "\n"


def layout_expected() -> list[int]:
    """What monokernel_layout() must report: per struct, its size then each field's offset."""
    vals = []
    for _name, S, fields in _STRUCTS:
        vals.append(ctypes.sizeof(S))
        vals += [getattr(S, n).offset for n, _ in fields]
    return vals


GEN_BEGIN, GEN_END = "// BEGIN GENERATED", "// END GENERATED\n"


def source_layout_block(text: str) -> str:
    a = text.index(GEN_BEGIN)
    b = text.index(GEN_END, a) + len(GEN_END)
    return text[a:b]


def write_layout(path=None) -> None:
    """Regenerate the layout block of decode.hip from the tables (run after editing them)."""
    from .runtime import KERNELS_DIR

    path = path or KERNELS_DIR / SOURCE
    text = path.read_text()
    path.write_text(text.replace(source_layout_block(text), c_layout_text()))


def compile_args(vendor: str, f16: bool, group: int, kv_f16: bool = False, head_dim: int = 64,
                 tp: bool = False, q_regs: bool = False, max_context: int = 4096, arch: str | None = None,
                 rows: tuple[int, ...] = (), qk_norm: bool = False, fine: int = 3, fused_mlp: bool = False,
                 head_screen: bool = False, mlp_packed: bool = False, o_group: bool = False,
                 q_flow: bool = False) -> dict:
    """rt.compile() keyword arguments for decode.hip (weight dtype, group size, attention lanes per row and
    head_dim itself, blocks per SM, unroll, profile build, fp16 KV cache, the LL exchange build for tensor
    parallelism — ``tp`` or HIPENGINE_MK_LL=1 — the long-context build ``q_regs``: q_regs_build — the
    attention split's build for a KV cache of ``max_context`` tokens on ``arch``: ops.attention_defines, as the
    per-op path's — and, when every row length the stream reads (``rows``: hidden size, this rank's q_dim and
    ffn) is a whole number of pairs, the stream without its predicated paths: ops.whole_pairs — and the loop's
    stages that only some models or settings run: the q/k-norm stage for ``qk_norm`` models, the fine = 2
    combine).
    HIPENGINE_MK_MAXRREG adds an NVRTC register cap (experiments only: the launch bound from MK_MIN_BLOCKS
    already sets 255 at one block per SM)."""
    opts = []
    cap = os.environ.get("HIPENGINE_MK_MAXRREG")
    if cap and vendor == "nvidia":
        opts.append(f"--maxrregcount={int(cap)}")
    from .ops import attention_defines

    defines = {"MK_WEIGHT_F16": int(f16), "MK_ATTN_G": int(group), **attention_defines(head_dim, max_context, arch),
               "MK_MIN_BLOCKS": min_blocks(), "HE_MATVEC_UNROLL": matvec_unroll(),
               "HE_COLD_HINTS": 1}  # port.h HE_UNLIKELY: never-taken branches after the hot code (v68)
    warp = 32 if vendor == "nvidia" else 64
    if rows and all(O.whole_pairs(n, matvec_unroll(), warp) for n in rows):
        defines["HE_MV_WHOLE_PAIRS"] = 1
    if qk_norm:
        defines["MK_QK_NORM"] = 1
    if fine == 2:
        defines["MK_FINE2"] = 1
    if profiling():
        defines["MK_PROFILE"] = 1
    if kv_f16:
        defines["HE_KV_F16"] = 1
    if tp or ll_local():
        defines["MK_TP"] = 1
    defines["MK_FUSED_MLP"] = int(fused_mlp and not (tp or ll_local()))
    if defines["MK_FUSED_MLP"] and rows:
        defines["HE_MLP_DVEC"] = O.mlp_dvec(rows[0], warp)  # rows[0]: the hidden size
    if q_regs:
        defines["HE_ATTN_Q_REGS"] = 1
    if head_screen and not (tp or ll_local()):
        defines["MK_HEAD_SCREEN"] = 1
    if mlp_packed and not (tp or ll_local() or defines["MK_FUSED_MLP"]):
        defines["MK_MLP_PACKED"] = 1
    if o_group:
        defines["MK_O_GROUP"] = 1
        if q_flow:
            defines["MK_QFLOW"] = 1
    extra = extra_defines()
    if not extra.keys() & {"MK_START_L2", "MK_START_L2_HALF"}:  # a sweep naming either mask gets only what it names
        defines.update(start_l2_defines(vendor, q_regs, bool(defines.get("MK_TP")),
                                        bool(defines["MK_FUSED_MLP"] or defines.get("MK_MLP_PACKED"))))
    defines.update(extra)
    return {"defines": defines, "options": opts or None}


def start_l2_defines(vendor: str, q_regs: bool, tp: bool, bf16_mlp: bool) -> dict:
    """decode.hip's MK_START_L2 / MK_START_L2_HALF for this build: the short-context build (not q_regs_build's) at tp =
    1 on NVIDIA asks L2, as each layer's three grid barriers open, for the first batch of the next stage's second
    pair (masks 7 / 7); every other build keeps decode.hip's default (the next layer's QKV whole second pair only,
    mask 4). Measured on H100s against mask 4 in eight rounds over four processes (docs/perf-log.md sessions 51,
    52): at 1K +0.1 to +1.3% in every round (+0.7% mean), at 8K −0.3% and at 32K −0.8% (means) — hence the short
    build only. The bf16 two-stage MLP builds (``bf16_mlp``) cannot take bits 1 and 2; tensor parallelism and AMD
    (where the prefetch is nothing) are not measured. Values do not change."""
    if vendor == "nvidia" and not (q_regs or tp or bf16_mlp):
        return {"MK_START_L2": 7, "MK_START_L2_HALF": 7}
    return {}


def extra_defines() -> dict:
    """HIPENGINE_MK_DEFINES="NAME=1,OTHER=2": extra -D for the monokernel build, for A/B sweeps of a kernel
    change kept behind a define while it is measured (scripts/mk_sweep.py variants; session 6's v22-v24 were
    measured this way); empty by default."""
    out = {}
    for item in filter(None, (x.strip() for x in os.environ.get("HIPENGINE_MK_DEFINES", "").split(","))):
        name, _, val = item.partition("=")
        if not name.isidentifier() or not (val or "1").lstrip("-").isdigit():
            raise UnsupportedError(f"HIPENGINE_MK_DEFINES: {item!r} is not NAME=INTEGER")
        out[name] = int(val or 1)
    return out


def smem_pad() -> int:
    """HIPENGINE_MK_SMEM_PAD: bytes of dynamic shared memory the launch asks for beyond what the kernel uses (default
    0). A measurement knob: a larger shared-memory carve-out leaves the SM less L1 (session 56: the removed MK_O_SMEM's
    64 KiB more per block came with streaming stages that never touched it running slower); values do not change."""
    raw = os.environ.get("HIPENGINE_MK_SMEM_PAD", "").strip() or "0"
    if not raw.isdigit():
        raise UnsupportedError(f"HIPENGINE_MK_SMEM_PAD={raw!r}: a number of bytes (0 or more)")
    return int(raw)


def carveout() -> int:
    """HIPENGINE_MK_CARVEOUT: the monokernel's preferred shared-memory carve-out in percent of the SM's unified L1 /
    shared storage (NVIDIA; 0: the most L1 its shared memory allows), or -1 (unset, the default): the driver's
    choice. A measurement knob beside smem_pad (session 57): the streams' loads bypass L1 allocation, but every
    experiment with 64 KiB more shared memory per block slowed them on an H100. Values do not change."""
    raw = os.environ.get("HIPENGINE_MK_CARVEOUT", "").strip()
    if not raw:
        return -1
    if not raw.isdigit() or int(raw) > 100:
        raise UnsupportedError(f"HIPENGINE_MK_CARVEOUT={raw!r}: a percentage from 0 to 100")
    return int(raw)


LONG_CONTEXT = 8192  # KV caches from this many tokens get the long-context build (q_regs_build)


def q_regs_build(max_context: int, vendor: str = "nvidia") -> bool:
    """Whether the monokernel is built with the attention split's q slices held in registers
    (HE_ATTN_Q_REGS): for KV caches of LONG_CONTEXT tokens or more, where each split runs several batches per
    warp. Same results either way (same values, same products); measured on H200 in one process: +9% at 32K,
    +2% at 8K, but -1.2% at 1K, where the split is one batch and the larger body only costs; at TP=2 +5% at
    32K, equal at 8K (docs/perf-log.md v28). NVIDIA only until it is measured on AMD: the gfx942 build of it
    reports 84 VGPR spills against the default's 20. HIPENGINE_MK_QREGS=0|1 forces the choice (A/B, tests)."""
    forced = os.environ.get("HIPENGINE_MK_QREGS", "")
    if forced:
        return forced != "0"
    return vendor == "nvidia" and max_context >= LONG_CONTEXT


def ll_local() -> bool:
    """HIPENGINE_MK_LL=1: at tp = 1, publish the O-proj / down-proj results through the LL exchange instead
    of two grid barriers per layer (bit-identical output; measured slower on H200, docs/perf-log.md v15)."""
    return os.environ.get("HIPENGINE_MK_LL", "0") not in ("", "0")


def fine_override() -> int | None:
    """HIPENGINE_MK_FINE=2|3 forces the attention -> O-proj scheme at every context (A/B sweeps); None: mk_fine's rule."""
    raw = os.environ.get("HIPENGINE_MK_FINE", "")
    if not raw:
        return None
    if raw not in ("2", "3"):
        raise UnsupportedError(f"HIPENGINE_MK_FINE={raw}: 2 (a grid barrier, then one head per block) or 3 "
                               "(the last split block of each KV head combines its group)")
    return int(raw)


def mk_fine(max_context: int, num_kv_heads: int, num_sms: int, head_dim: int = 64, tp: bool = False) -> int:
    """How the attention splits' partials reach the O-proj (decode.hip `fine`): 3 — the last split block of each
    KV head combines its group's heads and counts them on the heads-combined counter, no grid barrier — while
    the split plan's (kv head, split) items (mk_plan: the monokernel's own plan) fit in one round of the
    grid (one block per SM, min_blocks()); 2 — a grid barrier after the splits, then one head per block — when
    they take two rounds (llama-3.2-1b at 48K: 8 x 48 = 384 items on 132 blocks; up to 32K its plan is one round
    of 8 x 16 since session 29, before that 8 x 32 from 12K), where the blocks that
    finish a head's last split in the second round would each combine a whole group serially. Measured on H200
    (docs/perf-log.md, session 28), fine 2 against 3: llama-3.2-1b −2.1% at 1K and −2.0% at 8K (128 items),
    **+3.7% at 16K, +3.0 to +3.2% at 32K** (256 items); the default model's shape (smollm2-135m: 3 KV heads x 43
    splits = 129 items in a 4K cache) −8.6% / −7.5% at 1K / 2K contexts — so the bound is the grid's round,
    not the combine's rounds of partials. Same sums either way (he_attention_combine per head): the same
    tokens. The LL exchange builds (tp > 1, HIPENGINE_MK_LL) keep 3 (not measured there). HIPENGINE_MK_FINE
    forces either."""
    forced = fine_override()
    if forced is not None:
        return forced
    if tp:
        return 3
    nsplit, _ = mk_plan(max_context, num_kv_heads, num_sms, head_dim)
    return 2 if num_kv_heads * nsplit > num_sms * min_blocks() else 3


def head_screen_on() -> bool:
    """Whether greedy generation in the monokernel reads the LM head's int8 copy and recomputes only the rows
    that can hold the arg-max (ops/head_screen.hip; exact: the same tokens). On by default: +6.7 / +5.6 / +5.0%
    at 1K / 8K / 32K on H200 (docs/perf-log.md v77); HIPENGINE_MK_HEAD_SCREEN=0 keeps the bf16 head."""
    return O._env_switch("HIPENGINE_MK_HEAD_SCREEN") is not False


def mlp_packed_on() -> bool:
    """Whether the monokernel's gate/up and down stages stream the weights' lossless 13-bit copies
    (ops/matvec_packed.hip, hipengine/gpu/packed.py: the same sums, bit for bit, from 13/16 of the bytes).
    HIPENGINE_MK_PACKED=1 / 0; the default is off until measured (docs/perf-log.md v78)."""
    return O._env_switch("HIPENGINE_MK_PACKED") is True


# The grouped O-proj's default where it applies (o_group_decide). Measured in session 39 on an H100 against the
# plain O-proj, alternated twice in one process, tokens equal (monokernel_ogroup_default_ab_h100_s39.json): +1.1% at
# 1K, +1.7% at 8K, +2.1% at 32K; the two paths' greedy tokens identical with it at every context and the monokernel's
# logits equal to the per-op path's bit for bit (docs/perf-log.md session 39).
O_GROUP_DEFAULT = True


# MK_QFLOW's default where it applies (q_flow_decide; decode.hip: the QKV values as LL words, no grid barrier between
# QKV and attention). Measured in session 41 on an H100 against the barrier, alternated twice in one process, tokens
# equal (monokernel_qflow_fresh_ab_h100_s41.json): +2.0% at 1K, +0.2% at 8K; the logits equal the per-op path's bit for
# bit (docs/perf-log.md session 41).
Q_FLOW_DEFAULT = True


def q_flow_on() -> bool | None:
    """HIPENGINE_MK_QFLOW: 1 asks for the monokernel build whose attention splits poll the QKV stage's LL words
    instead of waiting at a grid barrier (decode.hip MK_QFLOW), 0 keeps the barrier, unset: Q_FLOW_DEFAULT."""
    return O._env_switch("HIPENGINE_MK_QFLOW")


def q_flow_asked() -> bool:
    """Whether MK_QFLOW is wanted where it applies: HIPENGINE_MK_QFLOW, else Q_FLOW_DEFAULT."""
    setting = q_flow_on()
    return Q_FLOW_DEFAULT if setting is None else setting


def q_flow_why_not(cfg, arch: str | None, o_group: bool, tp: bool) -> str | None:
    """Why MK_QFLOW cannot serve this build (None: it can): it needs the grouped O-proj, tp = 1 without the LL
    exchange, no q/k norms and the matrix-core attention split."""
    if tp:
        return "tensor parallelism / the LL exchange"
    if not o_group:
        return "the plain O-proj (the grouped O-proj is off here)"
    if cfg.qk_norm:
        return "q/k-norm models"
    if not O.attn_mma(arch, cfg.head_dim):
        return "the FMA attention split (no matrix cores or HIPENGINE_ATTN_MMA=0)"
    return None


def q_flow_decide(cfg, arch: str | None, o_group: bool, tp: bool) -> bool:
    """MK_QFLOW where it applies, if asked (HIPENGINE_MK_QFLOW, else Q_FLOW_DEFAULT); asked for with 1 where it does
    not apply, the reason is one clear error."""
    if not q_flow_asked():
        return False
    setting = q_flow_on()
    why = q_flow_why_not(cfg, arch, o_group, tp)
    if why and setting:
        raise UnsupportedError(f"HIPENGINE_MK_QFLOW=1: the LL-fed attention does not apply here ({why})")
    return why is None


def o_group_on() -> bool | None:
    """HIPENGINE_MK_OGROUP: 1 asks for the O-proj by KV-head group (decode.hip MK_O_GROUP, ops/matvec_group.hip: the
    blocks of each group combine its heads themselves and add their shares in fixed point, one publication fewer on
    the attention -> O-proj chain), 0 keeps the plain O-proj, unset: O_GROUP_DEFAULT where it applies."""
    return O._env_switch("HIPENGINE_MK_OGROUP")


def o_group_asked() -> bool:
    """Whether the grouped O-proj is wanted where it applies: HIPENGINE_MK_OGROUP, else O_GROUP_DEFAULT."""
    setting = o_group_on()
    return O_GROUP_DEFAULT if setting is None else setting


def o_group_why_not(cfg, num_sms: int, warp: int, max_context: int, fused_mlp: bool = False) -> str | None:
    """Why the grouped O-proj cannot serve this decode (None: it can): it needs the two-stage bf16 MLP, the
    monokernel's fine = 3 scheme at this cache size (mk_fine) and a shape ops.o_group_misfit accepts on this grid."""
    if fused_mlp or mlp_packed_on():
        return "the fused MLP / packed MLP weights"
    fine = mk_fine(max_context, cfg.num_kv_heads, num_sms, cfg.head_dim)
    if fine != 3:
        return f"the attention -> O-proj scheme fine = {fine}"
    return O.o_group_misfit(cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.num_kv_heads,
                            num_sms, warp)


def o_group_decide(cfg, num_sms: int, warp: int, max_context: int, fused_mlp: bool = False,
                   why: str | None = None) -> bool:
    """Whether a tp = 1 decode runs its O-proj by KV-head group — one rule for both paths (the monokernel's build and
    the per-op path's kernels: ops.matvec_group_o and its readers), so their greedy tokens stay the same. `why`: a
    reason of the caller's that rules it out (tensor parallelism, the LL exchange). Asked for (HIPENGINE_MK_OGROUP=1)
    where it cannot serve, the reason is one clear error; by default it falls back to the plain O-proj silently."""
    if not o_group_asked():
        return False
    why = why or o_group_why_not(cfg, num_sms, warp, max_context, fused_mlp)
    if why and o_group_on():
        raise UnsupportedError(f"HIPENGINE_MK_OGROUP=1: the grouped O-proj cannot serve this model: {why}")
    return why is None


def mk_one_round() -> bool:
    """Whether the monokernel takes the one-round split plan (ops.attention_plan one_round; default) or the
    per-op path's (HIPENGINE_MK_ONE_ROUND=0: the same plan as the per-op path, hence its bits at every cache)."""
    return O._env_switch("HIPENGINE_MK_ONE_ROUND") is not False


def mk_plan(max_context: int, num_kv_heads: int, num_sms: int, head_dim: int = 64) -> tuple[int, int]:
    """The monokernel's attention split plan (nsplit, chunk): ops.attention_plan's one-round rule (mk_one_round).
    It has at most the per-op plan's splits (the one-round try asks for floor(SMs / KV heads) splits of up to
    2,048 positions where the per-op one asks for the ceiling of up to 1,024, and both fall back to the same two
    rounds), so the partials buffer sized for the per-op plan holds it (MonokernelBackend checks)."""
    return O.attention_plan(max_context, num_kv_heads, num_sms, head_dim=head_dim, one_round=mk_one_round())


def min_blocks() -> int:
    """Resident blocks per SM the kernel is compiled for (HIPENGINE_MK_MIN_BLOCKS, default 1). One 256-thread
    block per SM leaves the compiler 255 registers: the matvec stream (2 batches x 2 rows x 4 16-byte loads
    per lane) stays in registers through attention without spilling. Two blocks cap it at 128 registers,
    where the stream spilled to local memory (each spill store waits for its load: no overlap left)."""
    return int(os.environ.get("HIPENGINE_MK_MIN_BLOCKS", "1"))


def matvec_unroll() -> int:
    """16-byte weight loads per lane per row per batch in the monokernel's matvec stream
    (HIPENGINE_MK_UNROLL, default 4, as the per-op kernels: the H200 sweep measured 848 tok/s against 799 for 8,
    and 4 lets the stream stay in registers through attention). Summation order does not depend on it."""
    return int(os.environ.get("HIPENGINE_MK_UNROLL", "4"))


@contextlib.contextmanager
def environ_set(values: dict):
    """These environment variables set inside the block, restored after it (precompile's builds)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def precompile(arch: str = "sm_90", f16_variants=(False,), groups=(2, 4), head_dim: int = 64,
               rows: tuple[int, ...] = (), qk_norm=(False,), fines=(3, 2), sizes: tuple[int, ...] = ()) -> list[str]:
    """Fill the compile cache for an NVIDIA arch without a GPU (NVRTC only): the per-op modules and the
    monokernel, keyed exactly as CudaRuntime.compile keys them, so a device run starts without compiling.
    ``rows``: the model's hidden size, q_dim and ffn (compile_args), e.g. (2048, 2048, 8192) for
    llama-3.2-1b; their per-op matvec builds as well (ops.whole_pairs). ``qk_norm``: the monokernel builds
    with / without the q/k-norm stage to make ((False, True) for the tests' Qwen3 model). ``sizes``: the KV cache
    sizes to build the monokernel for (default: one of every cache-size class), e.g. (1024,) for a 1K-only sweep."""
    from . import backend_cuda as bc, compiler
    from .executor import kv_defines
    from .ops import MATVEC_ROWS1_UNROLL, attention_defines
    from .runtime import KERNELS_DIR

    # fp16-weight models (GGUF) also keep an fp16 KV cache (GpuBackend.kv_f16): their op modules differ;
    # the attention module is built per head_dim and cache class (Ops.attention: ops.attention_defines, below)
    per_hd = ("attention_decode.hip", "attention_prefill.hip")
    ops = [p.name for p in sorted((KERNELS_DIR / "ops").glob("*.hip")) if p.name not in per_hd]
    jobs = [(f"ops/{n}", {"defines": kv_defines(f16)}) for f16 in sorted(set(f16_variants)) for n in ops]
    # the prefill projections' two builds (Ops.prefill_matmul: ops.mma_build on an H100 / H200, 4 and 8 warps)
    h200 = SimpleNamespace(max_shared_per_block=227 * 1024)
    builds = []
    for w in (4, 8):
        with environ_set({"HIPENGINE_MMA_WARPS": str(w)}):
            builds.append(O.mma_build(h200))
    jobs += [("ops/prefill.hip", {"defines": {**(kv_defines(f16) or {}), **b.defines()}})
             for f16 in sorted(set(f16_variants)) for b in builds]
    # the prefill attention on the matrix cores, built per head_dim (Ops.attention)
    jobs += [("ops/attention_prefill.hip", {"defines": {**(kv_defines(f16) or {}), **O.ap_defines(head_dim)}})
             for f16 in sorted(set(f16_variants)) if head_dim % 16 == 0]
    # the one-row-unit matvec's build (Ops.matvec rows1)
    jobs += [("ops/matvec.hip", {"defines": {**(kv_defines(f16) or {}), "HE_MATVEC_UNROLL": MATVEC_ROWS1_UNROLL}})
             for f16 in sorted(set(f16_variants))]
    # the matvec builds of whole-pair rows (Ops._whole), two-row and one-row units
    whole = [(u, d) for u in (O.MATVEC_UNROLL, MATVEC_ROWS1_UNROLL) for n in rows
             for d in [O.whole_pairs(n, u, 32)] if d]
    jobs += [("ops/matvec.hip", {"defines": {**(kv_defines(f16) or {}), **d,
                                             **({"HE_MATVEC_UNROLL": u} if u != O.MATVEC_UNROLL else {})}})
             for f16 in sorted(set(f16_variants)) for u, d in whole]
    # every cache-size class: either side of LONG_CONTEXT (q_regs_build) and of ops.ATTN_WARP_MAX_CTX
    # (attn_warp_max), the per-op attention module and the monokernel of each; builds that coincide once
    sizes = sorted(set(sizes) or {LONG_CONTEXT - 1, LONG_CONTEXT, O.ATTN_WARP_MAX_CTX - 1, O.ATTN_WARP_MAX_CTX})
    jobs += [("ops/attention_decode.hip",
              {"defines": {**(kv_defines(f16) or {}), **attention_defines(head_dim, n, arch)}})
             for f16 in sorted(set(f16_variants)) for n in sizes]
    # ... each with both attention -> O-proj schemes (mk_fine: which one a cache takes depends on its split plan)
    jobs += [(SOURCE, compile_args("nvidia", f16, g, kv_f16=f16, head_dim=head_dim, q_regs=q_regs_build(n),
                                   max_context=n, arch=arch, rows=rows, qk_norm=qn, fine=fine,
                                   fused_mlp=O.fused_mlp(), head_screen=head_screen_on(),
                                   mlp_packed=mlp_packed_on() and bool(rows) and not f16
                                   and all(n % packed.batch_cols(32) == 0 for n in (rows[0], rows[-1])),
                                   o_group=o_group_asked() and fine == 3 and bool(rows) and not O.fused_mlp()
                                   and not mlp_packed_on() and not ll_local()
                                   and O.o_group_misfit(g, head_dim, rows[0], 1, 1 << 30, 32) is None,
                                   q_flow=q_flow_asked() and not qn and O.attn_mma(arch, head_dim)))
             for f16 in f16_variants for g in groups for n in sizes for qn in qk_norm for fine in fines]
    # the decode-step modules' HE_PDL_LATE builds (Ops._late: the default trigger places or the env's)
    levels = O.pdl_trigger_levels()
    jobs += [(src, {**kw, "defines": {**(kw.get("defines") or {}), "HE_PDL_LATE": lv}}) for src, kw in jobs
             for lv in sorted(set(levels.values()))
             if src == "ops/matvec.hip" or (src == "ops/attention_decode.hip" and lv == 1)]
    unique = {}
    for src, kw in jobs:
        unique.setdefault((src, repr(sorted((kw.get("defines") or {}).items())), repr(kw.get("options"))), (src, kw))
    done = []
    for src, kw in unique.values():
        path, text = compiler.resolve_source(src)
        opts = bc.nvrtc_options(arch, path.parent, kw.get("defines"), kw.get("options"))
        key_opts = [o for o in opts if not o.startswith("-I")]
        compiler.cached_build(text, path.parent, arch, key_opts, bc.nvrtc_id(),
                              lambda: bc.nvrtc_compile(text, path.name, opts)[0], ".cubin")
        done.append(src)
    return done


# ---- the backend ------------------------------------------------------------------------------------------
class MonokernelBackend(GpuBackend):
    """GpuBackend whose decode / generate_ids run in the monokernel; prefill keeps the per-op path."""

    # Tensor parallelism (hipengine/gpu/tp_monokernel.py sets these per rank): ranks, this rank, the first
    # token id of its LM-head slice. The LL exchange (monokernel/tp_exchange.h: its region, the table of
    # every rank's region, the second residual buffer) is set up here for one rank and replaced at tp > 1.
    tp_world, tp_rank, vocab_off = 1, 0, 0
    mk_tp = False  # build with the LL exchange (MK_TP=1): TP ranks, or HIPENGINE_MK_LL=1

    def __init__(self, loaded, max_context: int | None = None, tp: int = 1, monokernel: bool = True,
                 allreduce: str = "custom", device: int = 0):
        super().__init__(loaded, max_context=max_context, tp=tp, monokernel=True, allreduce=allreduce,
                         device=device)
        try:
            self._init_monokernel()
        except BaseException:
            self.close()  # the weights are on the GPU already: free them before a caller falls back to per-op
            raise

    def fused_mlp_ok(self) -> bool:
        return not self.mk_tp and not ll_local()  # the LL exchange builds keep gate/up, then down

    def _init_monokernel(self) -> None:
        f16 = {bool(L["f16"]) for L in self.layers} | {bool(self.embed_f16), bool(self.head_f16)}
        if len(f16) != 1:
            raise UnsupportedError("the monokernel needs one weight dtype (all bf16 or all fp16); "
                                   "use --no-monokernel for mixed-dtype models")
        self.ll_local = ll_local()
        self.w_f16 = f16.pop()
        self.head_screen = self._screen_wanted()
        self.mlp_packed = self._packed_wanted()
        fine_override()  # a bad HIPENGINE_MK_FINE is one clear error before anything is compiled
        self._build()
        self.timeout_ns = int(float(os.environ.get("HIPENGINE_MK_TIMEOUT_S", "5")) * 1e9)
        self.poll_sleep_ns = int(os.environ.get("HIPENGINE_MK_POLL_SLEEP_NS", "0"))
        self.prof_buf = self._buf(8 * MK_PROF_WORDS) if profiling() else None
        # The LL exchange (MK_TP builds): set up here for HIPENGINE_MK_LL at tp = 1, by TpMonokernelBackend
        # for every rank at tp > 1.
        self.ll_buf, self.tp_ll_ptr, self.xb_ptr = None, 0, 0
        if self.ll_local:
            self.alloc_exchange(1)
            self.set_exchange_table([self.ll_buf.ptr])
        self.head_q = self.head_meta = None
        self.head_c2 = 0.0
        if self.head_screen:
            self._upload_screen()
        self.packed_layers = []
        if self.mlp_packed:
            self._upload_packed()
        self._size_launch()
        self._setup_buffers()

    def _screen_wanted(self) -> bool:
        """The screened LM head (head_screen_on) where it applies: tp = 1 without the LL exchange, a hidden size
        it can bound. By default a shape it cannot bound keeps the bf16 head; asked for explicitly
        (HIPENGINE_MK_HEAD_SCREEN=1) it is one clear error."""
        if not head_screen_on() or self.mk_tp or ll_local():
            return False
        from .head_screen import check_shape

        try:
            check_shape(self.config.vocab_size, self.config.hidden_size)
        except UnsupportedError:
            if O._env_switch("HIPENGINE_MK_HEAD_SCREEN") is True:
                raise
            return False
        return True

    def o_group_ok(self) -> bool:
        return not self.mk_tp and not ll_local()  # the LL exchange builds keep the plain O-proj

    def _o_group_wanted(self) -> bool:
        """The grouped O-proj by o_group_decide's rule (the per-op path's too) at this cache size."""
        return o_group_decide(self.config, self.rt.num_sms, self.rt.warp_size, self.max_context, self.fused_mlp,
                              None if self.o_group_ok() else "tensor parallelism / the LL exchange")

    def _packed_wanted(self) -> bool:
        """The packed MLP weights (mlp_packed_on) where they apply: tp = 1 without the LL exchange, the two-stage
        MLP, bf16 weights, the matvec unroll of 4, hidden and FFN sizes of whole batches (packed.check_shape).
        Elsewhere the bf16 rows, silently by default; asked for (HIPENGINE_MK_PACKED=1) on a model it cannot
        serve, the reason is one clear error."""
        if not mlp_packed_on():
            return False
        cfg = self.config
        why = None
        if self.mk_tp or ll_local():
            why = "tensor parallelism / the LL exchange"
        elif getattr(self, "fused_mlp", False):
            why = "the fused MLP (HIPENGINE_FUSED_MLP)"
        elif getattr(self, "w_f16", False):
            why = "fp16 weights"
        elif matvec_unroll() != 4:
            why = "HIPENGINE_MK_UNROLL other than 4"
        else:
            try:
                for n in (cfg.hidden_size, cfg.intermediate_size):
                    packed.check_shape(n, self.rt.warp_size)
            except UnsupportedError as e:
                why = str(e)
        if why is not None:
            raise UnsupportedError(f"HIPENGINE_MK_PACKED=1: packed MLP weights do not apply here ({why})")
        return True

    def _extra_weight_bytes(self) -> int:
        from .head_screen import table_bytes

        cfg = self.config
        extra = table_bytes(cfg.vocab_size, cfg.hidden_size) if self._screen_wanted() else 0
        B = packed.batch_cols(self.rt.warp_size)
        if mlp_packed_on() and cfg.hidden_size % B == 0 and cfg.intermediate_size % B == 0:
            # the packed copies beside the bf16 rows (prefill and the rare units read those)
            extra += 3 * cfg.num_layers * packed.row_bytes(cfg.hidden_size) * cfg.intermediate_size
        return extra

    def _upload_packed(self) -> None:
        """Each layer's gate, up and down rows packed (hipengine/gpu/packed.py) from their bits as uploaded, with
        the bitmaps of the units the packed form cannot hold (the device recomputes those from the bf16 rows)."""
        from concurrent.futures import ThreadPoolExecutor

        cfg, W = self.config, self.rt.warp_size
        d, F = cfg.hidden_size, cfg.intermediate_size

        def one(L):
            g = self.rt.download(L["w_gate"], (F, d), np.uint16)
            u = self.rt.download(L["w_up"], (F, d), np.uint16)
            dn = self.rt.download(L["w_down"], (d, F), np.uint16)
            dgu, dd = packed.offset_for(g, u), packed.offset_for(dn)
            pg, pu, pd = packed.pack(g, dgu, W), packed.pack(u, dgu, W), packed.pack(dn, dd, W)
            return pg, pu, pd, packed.gate_up_units(pg.row_esc, pu.row_esc), packed.plain_units(pd.row_esc)

        n_units = n_esc = 0
        with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as ex:
            for pg, pu, pd, egu, edn in ex.map(one, self.layers):
                n_units += egu.size + edn.size
                n_esc += int(egu.sum()) + int(edn.sum())
                self.packed_layers.append({
                    "gate": self._up(pg.data.reshape(-1)), "up": self._up(pu.data.reshape(-1)),
                    "down": self._up(pd.data.reshape(-1)),
                    "esc_gu": self._up(packed.unit_bitmap(egu)), "esc_down": self._up(packed.unit_bitmap(edn)),
                    "gu": pg.d, "dn": pd.d})
        self.packed_esc_units = n_esc
        if n_esc * 64 > n_units:  # > 1/64 of the units recomputed from bf16: say so (still exact)
            print(f"hipengine: {n_esc} of {n_units} MLP units hold weights outside the packed window; they are "
                  "recomputed from the bf16 rows (exact, slower)", file=sys.stderr)

    def _upload_screen(self) -> None:
        """The head's int8 copy and bound tables (hipengine/gpu/head_screen.py), made from the head's bits as
        uploaded, so they bound exactly the values the bf16 head multiplies."""
        from .head_screen import screen_tables

        cfg = self.config
        bits = self.rt.download(self.lm_head, (cfg.vocab_size, cfg.hidden_size), np.uint16)
        t = screen_tables(bits=bits, f16=bool(self.head_f16))
        self.head_q = self._up(t.q.view(np.uint8))
        self.head_meta = self._up(t.meta)
        self.head_c2 = t.c2

    def _alloc_state(self) -> None:
        """GpuBackend's buffers and per-op split plan, then the monokernel's own split plan (mk_plan)."""
        super()._alloc_state()
        cfg = self.config
        self.mk_nsplit, self.mk_chunk = mk_plan(self.max_context, cfg.num_kv_heads, self.rt.num_sms, cfg.head_dim)
        if self.mk_nsplit > self.nsplit:  # mk_plan's bound: the partials buffer is sized for the per-op plan
            raise DeviceError(f"monokernel split plan {self.mk_nsplit} x {self.mk_chunk} has more splits than the "
                              f"per-op plan {self.nsplit} x {self.chunk} its partials buffer is sized for")

    def _size_launch(self) -> None:
        """Shared memory, occupancy and grid for the current max_context (the combine's shared memory grows
        with the attention split count)."""
        rt, cfg = self.rt, self.config
        G = cfg.num_heads // cfg.num_kv_heads
        mma = O.attn_mma(rt.arch, cfg.head_dim)
        self.smem = max(4 * max(cfg.hidden_size, cfg.intermediate_size, cfg.q_dim),      # matvec x staging
                        O.attention_shared_bytes(G, cfg.head_dim, rt.warp_size, mma),   # attention (ops.attention)
                        4 * ((cfg.vocab_size + 31) // 32),                               # sampling history bitmap
                        O.mlp_shared_bytes(cfg.hidden_size, rt.warp_size, rt.vendor == "nvidia", THREADS)
                        if self.fused_mlp else 0)
        if self.head_screen:  # the staged input, its int16 copy and the warps' slots (ops/head_screen.hip)
            from .head_screen import smem_bytes

            self.smem = max(self.smem, smem_bytes(cfg.hidden_size, cfg.vocab_size, rt.num_sms, THREADS // rt.warp_size))
        self.smem += smem_pad()
        if self.smem > rt.max_shared_per_block:
            raise UnsupportedError(f"monokernel needs {self.smem} B of shared memory per block; the device "
                                   f"allows {rt.max_shared_per_block}")
        # set every time: the loaded kernel is shared by every backend of the process (mk_sweep's variants)
        self.fn.prefer_carveout(carveout())
        occ = rt.max_active_blocks(self.fn, THREADS, self.smem)
        if occ < 1:
            raise UnsupportedError(f"monokernel cannot be resident with {THREADS} threads and {self.smem} B "
                                   "shared memory")
        want = int(os.environ.get("HIPENGINE_MK_BLOCKS_PER_SM", "0")) or min_blocks()
        self.blocks_per_sm = min(occ, want)
        self.grid = rt.num_sms * self.blocks_per_sm
        self.occupancy = occ

    def _build_class(self) -> tuple[bool, bool, int]:
        """(q_regs_build, ops.attn_warp_max, the attention -> O-proj scheme: mk_fine) for the current
        max_context: what selects the build."""
        cfg = self.config
        fine = mk_fine(self.max_context, cfg.num_kv_heads, self.rt.num_sms, cfg.head_dim,
                       tp=self.mk_tp or bool(self.ll_local))
        return q_regs_build(self.max_context, self.rt.vendor), O.attn_warp_max(self.max_context), fine

    def _build(self) -> None:
        """Compile (or take from the cache) the build for the current max_context — the long-context build
        from LONG_CONTEXT tokens (q_regs_build), the attention split's softmax max (ops.attn_warp_max, as the
        per-op path's), the attention -> O-proj scheme (mk_fine) — and load its kernel."""
        rt, cfg = self.rt, self.config
        self.q_regs, self.warp_max, self.fine = self._build_class()
        self.o_group = self._o_group_wanted()
        self.q_flow = q_flow_decide(cfg, rt.arch, self.o_group, self.mk_tp or bool(self.ll_local))
        self.module = rt.compile(SOURCE, **compile_args(rt.vendor, self.w_f16, cfg.num_heads // cfg.num_kv_heads,
                                                        self.kv_f16, cfg.head_dim, tp=self.mk_tp, q_regs=self.q_regs,
                                                        max_context=self.max_context, arch=rt.arch,
                                                        rows=(cfg.hidden_size, cfg.q_dim, cfg.intermediate_size),
                                                        qk_norm=cfg.qk_norm, fine=self.fine,
                                                        fused_mlp=self.fused_mlp, head_screen=self.head_screen,
                                                        mlp_packed=self.mlp_packed, o_group=self.o_group,
                                                        q_flow=self.q_flow))
        self.fn = self.module.function(KERNEL)
        self._check_layout()

    def _check_layout(self) -> None:
        """NVRTC cannot static_assert offsets: ask the compiled code for them once (a 1-thread kernel)."""
        want = layout_expected()
        out = self._buf(8 * len(want))
        self.rt.launch(self.module.function("monokernel_layout"), 1, self.rt.warp_size, [c_void_p(out.ptr)],
                       stream=self.stream)
        self.stream.synchronize()
        got = self.rt.download(out, (len(want),), np.uint64).tolist()
        if got != want:
            raise DeviceError(f"monokernel parameter layout differs between C and Python: device {got}, "
                              f"host {want}; regenerate with hipengine.gpu.monokernel.write_layout()")

    def _setup_buffers(self) -> None:
        cfg, rt = self.config, self.rt
        layers = (MkLayer * cfg.num_layers)()
        for i, L in enumerate(self.layers):
            p = lambda b: b.ptr if b is not None else 0  # noqa: E731
            P = self.packed_layers[i] if self.packed_layers else {}
            two = lambda e: (2.0 ** e, 2.0 ** -e) if P else (0.0, 0.0)  # noqa: E731
            layers[i] = MkLayer(p(L["wqkv"]), p(L["wo"]), p(L["w_gate"]), p(L["w_up"]), p(L["w_down"]),
                                p(L["attn_norm"]), p(L["ffn_norm"]), p(L["bqkv"]), p(L.get("q_norm")),
                                p(L.get("k_norm")), self._kc(i), self._vc(i), int(L["f16"]), 0,
                                p(L.get("w_down_t")), p(P.get("gate")), p(P.get("up")), p(P.get("down")),
                                p(P.get("esc_gu")), p(P.get("esc_down")), *two(P.get("gu", 0)), *two(P.get("dn", 0)))
        self.layer_buf = self._up(np.frombuffer(bytes(layers), np.uint8))
        self.iota = self._up(np.arange(self.max_context, dtype=np.int32))
        self.state_buf = self._buf(ctypes.sizeof(MkState))
        self.bar_buf = self._buf(16)
        self.attn_count_bytes = 4 * (cfg.num_kv_heads + 2)
        self.attn_count = self._buf(self.attn_count_bytes)
        # MK_QFLOW's LL words (any build: 24 KB at d = 2,048). Fine-grained: on an MI300X the polling CU and the writing
        # one may sit in different XCDs, whose L2s do not see each other's lines of coarse-grained memory within a kernel.
        self.flow_words = cfg.q_dim + 2 * cfg.num_kv_heads * cfg.head_dim
        self.flow_ll = rt.malloc_fine_grained(8 * self.flow_words)
        self._bufs.append(self.flow_ll)
        self.cand = self._buf(8 * rt.num_sms * max(self.occupancy, 1))
        self.screen_lo = self._buf(4 * self.grid) if self.head_screen else None
        self.eos_buf = self._buf(4 * MAX_EOS)
        self.ring_cap = self.max_context
        self.hostmem = rt.host_alloc_mapped(4 * (len(MK_HOST_WORDS) + self.ring_cap))
        self.host_words = self.hostmem.array[:4 * len(MK_HOST_WORDS)].view(np.uint32)
        self.ring = self.hostmem.array[4 * len(MK_HOST_WORDS):].view(np.int32)
        self.W = {w: i for i, w in enumerate(MK_HOST_WORDS)}

    # ---- launch ------------------------------------------------------------------------------------------
    def _params(self, mode: int, params: SamplingParams | None, eos: list[int], seed: int) -> MkParams:
        cfg = self.config
        sp = params or SamplingParams(max_tokens=1)
        hd = self.hostmem.dptr
        return MkParams(
            layers=self.layer_buf.ptr, embed=self.embed.ptr, lm_head=self.lm_head.ptr,
            final_norm=self.final_norm.ptr, cos_t=self.cos.ptr, sin_t=self.sin.ptr, iota=self.iota.ptr,
            x=self.x.ptr, qkv=self.qkv.ptr, q=self.q.ptr, att=self.att.ptr, h=self.h.ptr,
            partial=self.partial.ptr, logits=self.logits.ptr, z=self.z.ptr, history=self.history.ptr,
            eos=self.eos_buf.ptr, state=self.state_buf.ptr, bar=self.bar_buf.ptr, attn_count=self.attn_count.ptr,
            cand=self.cand.ptr,
            host=hd, ring=hd + 4 * len(MK_HOST_WORDS), timeout_ns=self.timeout_ns,
            vocab=cfg.vocab_size, d=cfg.hidden_size, ffn=cfg.intermediate_size, nh=cfg.num_heads,
            nkv=cfg.num_kv_heads, hd=cfg.head_dim, n_layers=cfg.num_layers, max_ctx=self.max_context,
            nsplit=self.mk_nsplit, chunk=self.mk_chunk, embed_f16=int(self.embed_f16), head_f16=int(self.head_f16),
            qk_norm=int(cfg.qk_norm), n_eos=len(eos), mode=mode, max_tokens=int(sp.max_tokens),
            ring_cap=self.ring_cap, top_k=int(sp.top_k), eps=float(cfg.rms_norm_eps),
            temperature=float(sp.temperature), top_p=float(sp.top_p), min_p=float(sp.min_p),
            rep_pen=float(sp.repetition_penalty), seed_lo=seed & 0xFFFFFFFF, seed_hi=(seed >> 32) & 0xFFFFFFFF,
            fine=self.fine, poll_sleep_ns=self.poll_sleep_ns,
            prof=self.prof_buf.ptr if self.prof_buf is not None else 0,
            tp_ll=self.tp_ll_ptr if self._ll_on() else 0, xb=self.xb_ptr, tp_world=self.tp_world,
            tp_rank=self.tp_rank, vocab_off=self.vocab_off, embed_vocab=self.embed_vocab,
            x_fx=self.x_fx.ptr if self.fused_mlp or self.o_group else 0,
            head_q=self.head_q.ptr if self.head_q is not None else 0,
            head_meta=self.head_meta.ptr if self.head_meta is not None else 0,
            screen_lo=self.screen_lo.ptr if self.screen_lo is not None else 0, head_c2=float(self.head_c2),
            screen=int(self.head_screen), flow_ll=self.flow_ll.ptr if self.q_flow else 0)

    def _ll_on(self) -> bool:
        return self.tp_world > 1 or bool(self.ll_local)

    def alloc_exchange(self, world: int) -> None:
        """This rank's LL exchange region for `world` ranks (zeroed; fine-grained on AMD: peers store into it
        while this GPU polls it) and the second residual buffer the exchange build uses."""
        d = self.config.hidden_size
        self.ll_bytes = 8 * ll_words(world, d)
        self.ll_buf = self.rt.malloc_fine_grained(self.ll_bytes)
        self._bufs.append(self.ll_buf)
        self.rt.memset(self.ll_buf, 0, self.ll_bytes)
        self.xb_ptr = self._buf(4 * d).ptr

    def set_exchange_table(self, bases: list[int]) -> None:
        """The device table of every rank's LL region (index = rank), as the kernel reads p.tp_ll."""
        self.tp_ll_ptr = self._up(np.array(bases, np.uint64)).ptr

    def _launch(self, mode: int, token: int, pos: int, hist_len: int, params: SamplingParams | None = None,
                eos: list[int] = (), seed: int = 0) -> None:
        self._prepare(mode, token, pos, hist_len, params, eos, seed)
        self._start()

    def _prepare(self, mode: int, token: int, pos: int, hist_len: int, params: SamplingParams | None = None,
                 eos: list[int] = (), seed: int = 0) -> None:
        """Everything a launch needs, on the device and in the host words, with nothing left in flight."""
        if len(eos) > MAX_EOS:
            eos = list(eos)[:MAX_EOS]
        s, rt = self.stream, self.rt
        st = MkState(token=int(token), pos=int(pos), hist_len=int(hist_len))
        rt.copy_htod(self.state_buf, np.frombuffer(bytes(st), np.uint8).copy(), stream=s)
        # the kernel's one argument, the parameter block by value (decode.hip: the constant bank); the driver
        # copies it at the launch call
        self._block = self._params(mode, params, list(eos), seed)
        if eos:
            rt.copy_htod(self.eos_buf, np.asarray(eos, np.int32), stream=s)
        rt.memset(self.bar_buf, 0, 16, stream=s)
        if self._ll_on():  # every launch starts the exchange at epoch 0 (at tp > 1: before any rank starts)
            rt.memset(self.ll_buf, 0, self.ll_bytes, stream=s)
        rt.memset(self.attn_count, 0, self.attn_count_bytes, stream=s)
        if self.q_flow:  # the LL words' epochs count from 1 in every launch
            rt.memset(self.flow_ll, 0, 8 * self.flow_words, stream=s)
        if self.o_group:  # the O-proj's fixed-point shares start from zero (the kernel clears them after each use)
            rt.memset(self.x_fx, 0, 8 * self.config.hidden_size, stream=s)
        s.synchronize()  # the host words below are read by the kernel: reset them with nothing in flight
        self.host_words[:] = 0

    def _start(self) -> None:
        self.rt.launch(self.fn, self.grid, THREADS, [self._block], shared=self.smem, stream=self.stream,
                       cooperative=True)

    def _where(self) -> str:
        return f"GPU {self.rt.device_index}"

    def _finish(self) -> None:
        """Wait for the kernel, then turn a non-done status into DeviceError."""
        self.stream.synchronize()
        status = int(self.host_words[self.W["status"]])
        if status != 1:
            what = MK_STATUS.get(status, f"unknown status {status}")
            raise DeviceError(f"monokernel failed on {self._where()}: {what} (after "
                              f"{int(self.host_words[self.W['write_idx']])} tokens); "
                              "set HIPENGINE_MK_TIMEOUT_S higher or use --no-monokernel")

    # ---- Backend API -------------------------------------------------------------------------------------
    def decode(self, token_id: int) -> np.ndarray:
        if self.pos >= self.max_context:
            raise RequestError(f"context of {self.max_context} tokens is full")
        self._launch(MK_MODE_EMBED_FIRST | MK_MODE_ONE_STEP, token_id, self.pos, 0)
        self._finish()
        self.pos += 1
        return self._read_logits(1)[0]

    def generate_ids(self, prompt_ids, params: SamplingParams,
                     should_stop: Callable[[], bool] = lambda: False) -> Iterator[int]:
        prompt = self.check_prompt(prompt_ids)
        if should_stop():
            return
        self.reset()
        self.prefill(prompt)  # the last prompt row's logits are in row 0 of the logits buffer (GpuBackend.prefill)
        self.rt.copy_htod(self.history, prompt.astype(np.int32), stream=self.stream)
        yield from self.generate_from_state(0, int(prompt.size), params, should_stop, embed_first=False)

    def generate_from_state(self, token: int, hist_len: int, params: SamplingParams,
                            should_stop: Callable[[], bool] = lambda: False,
                            embed_first: bool = True) -> Iterator[int]:
        """Generate from the current KV cache / position: either sample from the logits already in the buffer
        (after prefill) or first run a decode step of ``token`` (benchmarks at long context)."""
        if params.max_tokens < 1:
            return
        eos = [] if params.ignore_eos else [int(e) for e in self.config.eos_token_ids]
        seed = params.resolved_seed()
        mode = MK_MODE_EMBED_FIRST if embed_first else 0
        self._launch(mode, token, self.pos, hist_len, params, eos, int(seed) & 0xFFFFFFFFFFFFFFFF)
        yield from self._stream(should_stop)

    def _stream(self, should_stop: Callable[[], bool]) -> Iterator[int]:
        """Yield the running launch's tokens as they land in the mapped ring; cancel, finish, and take the
        final position from the host words."""
        hw, W, ring = self.host_words, self.W, self.ring
        read, cancelled, done = 0, False, False
        stall_limit = 2 * self.timeout_ns / 1e9 + 10.0
        last_progress = time.monotonic()
        try:
            while True:
                status = int(hw[W["status"]])  # read before write_idx: a done status implies a final index
                widx = int(hw[W["write_idx"]])
                if widx > read:
                    last_progress = time.monotonic()
                while read < widx and not cancelled:
                    tok = int(ring[read])
                    read += 1
                    yield tok
                    if should_stop():
                        self._cancel()
                        cancelled = True
                if status != 0:
                    done = True
                    break
                if not cancelled and should_stop():
                    self._cancel()
                    cancelled = True
                if time.monotonic() - last_progress > stall_limit:
                    raise DeviceError(f"monokernel made no progress for {stall_limit:.0f} s on {self._where()} "
                                      "and reported no error")
                time.sleep(20e-6)
        finally:
            if not done and not cancelled:
                self._cancel()  # the consumer stopped iterating (or raised): end the kernel at the next token
            self._finish()
            self.pos = int(hw[W["pos"]])
            self.last_finish = MK_FINISH.get(int(hw[W["finish"]]), "unknown")
            self.last_n_out = int(hw[W["n_out"]])

    def resize_context(self, max_context: int) -> None:
        """Re-size the KV cache, RoPE tables and attention split plan to a new max_context, keeping the
        weights (benchmarks sweep contexts without re-uploading a model). Old buffers are freed at close()."""
        self.max_context = int(max_context)
        self._drop_graphs()
        cos, sin = O.rope_tables(self.config.rope_inv_freq(), self.max_context)
        self.cos, self.sin = self._up(cos), self._up(sin)
        self._alloc_state()
        if self.hostmem is not None:
            self.hostmem.free()
        if self._build_class() != (self.q_regs, self.warp_max, self.fine):
            self._build()  # the cache crossed LONG_CONTEXT / ops.ATTN_WARP_MAX_CTX / mk_fine's bound: another build
        self._size_launch()
        self._setup_buffers()
        self.pos = 0

    def _cancel(self) -> None:
        """Raise the cancel word (the kernel reads it once per token with a system-scope acquire) and note
        how many tokens had landed by then (tests: generation stops within one token)."""
        self.host_words[self.W["cancel"]] = 1
        self.cancel_seen_at = int(self.host_words[self.W["write_idx"]])

    def close(self) -> None:
        hm = getattr(self, "hostmem", None)
        if hm is not None:
            try:
                hm.free()
            except Exception:
                pass
            self.hostmem = None
        super().close()


def grid_info(backend: MonokernelBackend) -> dict:
    return {"grid": backend.grid, "blocks_per_sm": backend.blocks_per_sm, "occupancy": backend.occupancy,
            "unroll": matvec_unroll(), "fine": backend.fine, "poll_sleep_ns": backend.poll_sleep_ns,
            "threads": THREADS, "shared_bytes": backend.smem, "sms": backend.rt.num_sms,
            "barriers_per_token": None if not hasattr(backend, "config") else
            barriers_per_token(backend.config, backend.fine, 2 if backend._ll_on() else 1,
                               getattr(backend, "q_flow", False)),
            "q_flow": bool(getattr(backend, "q_flow", False)),
            "ll_exchange": backend._ll_on(), "q_regs": getattr(backend, "q_regs", False),
            "attn_warp_max": getattr(backend, "warp_max", None),
            "head_screen": bool(getattr(backend, "head_screen", False)),
            "mlp_packed": bool(getattr(backend, "mlp_packed", False))}


def ll_words(world: int, d: int) -> int:
    """u64 words of one rank's LL exchange region (monokernel/tp_exchange.h): O and D partials [world][d]
    each, greedy candidates [world][2]."""
    return 2 * world * d + 2 * world


def barriers_per_token(cfg, fine: int = 3, tp: int = 1, q_flow: bool = False) -> int:
    """Grid barriers one decode step crosses (the monokernel's main fixed cost; see docs/perf-log.md)."""
    # qkv | (fine 2: attention) | (combine -> O-proj: a counter wait) | O | gate-up | down; at tp > 1 the
    # stages after O and down gather the ranks' LL words instead (monokernel/tp_exchange.h); MK_QFLOW: no qkv one
    per_layer = (4 if tp == 1 else 2) + (1 if fine == 2 else 0) + (1 if cfg.qk_norm else 0) - (1 if q_flow else 0)
    return cfg.num_layers * per_layer + 2  # + LM head + sample/embed


# ---- stage profile (HIPENGINE_MK_PROFILE=1: a separate build with -DMK_PROFILE=1) --------------------------
# attn_*: block 0's attention items, stage start -> that point (MK_QFLOW's splits, in their blocks' rows: attn_q_first /
# attn_q_ready thread 0's q poll's first pass back / its words all there, attn_fresh the newest row's words all there)
PROF_STAGES = ["select", "qkv", "attention", "combine", "o_proj", "gate_up", "down", "lm_head", "attn_split",
               "attn_q", "attn_loop", "attn_merge", "attn_q_first", "attn_q_ready", "attn_fresh"]
MK_PROF_HEADER = 2 * len(PROF_STAGES) + 3
# + one row per block (decode.hip kMkProfMaxBlocks rows of kMkProfRow words): per stage its cycles to the work
# mark, to the block's slowest warp, to its barrier arrival issued, to the stage's exit (PROF_COLS); its SM
PROF_COLS = ["work_us", "sync_us", "arrive_us", "total_us"]
MK_PROF_MAX_BLOCKS = 2048
MK_PROF_ROW = len(PROF_COLS) * len(PROF_STAGES) + 1
MK_PROF_WORDS = MK_PROF_HEADER + MK_PROF_MAX_BLOCKS * MK_PROF_ROW


def profiling() -> bool:
    return os.environ.get("HIPENGINE_MK_PROFILE", "0") not in ("", "0")


def read_profile(backend: "MonokernelBackend") -> dict:
    """Per-stage microseconds per decode step, summed over the launches since the last reset_profile():
    ``work`` (block 0 from the stage's start to its barrier arrival) and ``total`` (to the barrier's exit).
    Cycles are converted with the launch's own ns/cycle ratio."""
    if backend.prof_buf is None:
        raise DeviceError("stage profile needs HIPENGINE_MK_PROFILE=1 when the backend is built")
    raw = backend.rt.download(backend.prof_buf, (MK_PROF_WORDS,), np.uint64)
    v = raw[:MK_PROF_HEADER].astype(np.float64)
    n = len(PROF_STAGES)
    ns, cyc, steps = v[2 * n], v[2 * n + 1], max(v[2 * n + 2], 1.0)
    us = (ns / cyc / 1e3) if cyc else 0.0
    nb = min(backend.grid, MK_PROF_MAX_BLOCKS)
    rows = raw[MK_PROF_HEADER:MK_PROF_HEADER + nb * MK_PROF_ROW].reshape(nb, MK_PROF_ROW)
    per = rows[:, :-1].astype(np.float64) * us / steps  # per block, µs per step (block 0's clock rate)
    blocks = {"sm": rows[:, -1].astype(int).tolist()}
    for c, col in enumerate(PROF_COLS):  # cumulative from the stage start: work <= sync <= arrive <= total
        blocks[col] = {k: [round(float(x), 3) for x in per[:, c * n + i]]
                       for i, k in enumerate(PROF_STAGES) if per[:, c * n + i].any()}
    return {"steps": int(v[2 * n + 2]), "ghz": (cyc / ns) if ns else 0.0, "us_per_step": ns / steps / 1e3,
            "work_us": {k: v[i] * us / steps for i, k in enumerate(PROF_STAGES)},
            "total_us": {k: v[n + i] * us / steps for i, k in enumerate(PROF_STAGES)},
            "blocks": blocks}


def reset_profile(backend: "MonokernelBackend") -> None:
    if backend.prof_buf is not None:
        backend.rt.memset(backend.prof_buf, 0, 8 * MK_PROF_WORDS, stream=backend.stream)
        backend.stream.synchronize()
