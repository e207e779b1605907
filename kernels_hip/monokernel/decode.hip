// The monokernel: the whole decode step — and the whole generation loop — in one persistent kernel.
//
// One launch per request (or per single decode step). The grid is every SM × MK_MIN_BLOCKS blocks
// (cooperative launch: all blocks resident), kMkThreads threads each. Per token:
//
//   [token selection: greedy = every block arg-maxes a slice of the logits, the last to arrive leads;
//    otherwise he_sample_block on block 0. The leader writes the ring + history, checks the stop
//    conditions and the host's cancel word, and embeds the token]
//   ── grid barrier ──
//   per layer:  QKV (RMSNorm prologue, bias, RoPE, KV append)   HeMvQkv
//               (Qwen3: raw q|k|v ── barrier ── per-head norm + RoPE + append: he_qk_norm_rope_head)
//               ── barrier ── (MK_QFLOW, the default where it applies: none — the splits poll the QKV values'
//                              LL words, below)
//               attention splits (he_attention_split_block)
//               fine == 3: the last split block of each KV head (arrival counter) combines its G heads
//               fine == 2: ── barrier ── one head per block
//               ── O-proj waits on the heads-combined counter ──
//               O-proj + residual (HeMvPlain)                    ── barrier ──
//               gate/up + SiLU·mul, RMSNorm prologue (HeMvGateUp) ── barrier ──
//               down + residual (HeMvPlain)                      ── barrier ──
//               (MK_FUSED_MLP, opt-in at tp = 1: gate/up units that also apply their row of down, the block's
//                sum added in fixed point to p.x_fx (ops/mlp.hip) ── barrier ──)
//   LM head with the final-norm prologue (HeMvPlain)             ── barrier ──
//
// Tensor parallelism (-DMK_TP=1, monokernel/tp_exchange.h): every rank runs this kernel on its shard; the
// O-proj / down-proj rows go out as LL words to every rank, the barriers after those two stages become
// gathers (each block sums the ranks' words itself), and the leaders of all ranks agree on the greedy token.
//
// Every stage is the op's own __device__ code from ops/*.hip (the per-op kernels run the same op
// descriptors and bodies), so with the same block size (kMkThreads == the per-op launch's 256) and the same
// attention split plan each value is computed with the same instructions in the same order: greedy output
// is bit-identical to the per-op path. The bodies stride over the grid (he_block_idx / he_grid_dim), so they
// need no change to run on the persistent grid.
//
// Weights before activations: a matvec stage's weights never depend on the step's activations, so each
// warp's weight stream (ops/matvec.hip) runs on from one matvec stage into the next: the first two batches
// of its part of the next stage are requested as soon as this block has arrived at the barrier in between
// (after the arrival's release, which would otherwise wait for them: v22), or for the O-proj once this
// block's attention splits are done (v24), so the barrier, the combine chain or token selection only delay
// their use.
//
// Coherence of data rewritten inside the kernel (activations, partials, logits, KV rows): read with plain
// loads after a grid barrier / counter acquire (sync.h). Pointers come from the parameter block, and the op
// bodies take such data through plain (not `const __restrict__`) pointers, so the compiler cannot turn
// those loads into non-coherent read-only-path loads (ld.global.nc). The position is passed to the op
// bodies as &iota[pos] (a table the kernel never writes) instead of a device word that changes every step.
// KV rows are read with he_load16_stream_rw (coherent, no L1 allocation): row `pos` is first read after it
// was written and a barrier's acquire.
#include "port.h"
#include "sync.h"
// The op files below are included for their device bodies; kernels of theirs that the monokernel's module
// has no use for may skip themselves (ops/attention_decode.hip's attention_decode_g*).
#define HE_IN_MONOKERNEL 1
// 16-byte loads per lane per row per batch of the matvec stream (the host passes HIPENGINE_MK_UNROLL; the
// per-op kernels default to 4 too).
#ifndef HE_MATVEC_UNROLL
#define HE_MATVEC_UNROLL 4
#endif
#include "ops/embedding.hip"
#include "ops/matvec.hip"
#include "ops/mlp.hip"
#ifndef MK_PROFILE
#define MK_PROFILE 0
#endif
#if MK_PROFILE
// Attention sub-stage marks (profile builds): each block's thread 0 adds the cycles since the stage started into its
// row (block 0's also into the header; mk_prof_t: that stage's start, kept by MkProf::done).
__shared__ he_u64 mk_prof_t;
__device__ inline void mk_attn_mark(int k);
__device__ inline void mk_attn_mark_warp(int k);
#define HE_ATTN_MARK(k) mk_attn_mark(k)
#define HE_ATTN_MARK_WARP(k) mk_attn_mark_warp(k)
#endif
#include "ops/attention_decode.hip"
#include "ops/qk_norm.hip"
#include "ops/sampling.hip"
// MK_HEAD_SCREEN=1 (tp = 1; hipengine/gpu/monokernel.py head_screen_on): greedy steps of a generation stream
// the LM head's int8 copy and recompute only the rows that can hold the arg-max (ops/head_screen.hip: exact).
#ifndef MK_HEAD_SCREEN
#define MK_HEAD_SCREEN 0
#endif
#if MK_HEAD_SCREEN
#include "ops/head_screen.hip"
#endif
// MK_MLP_PACKED=1 (tp = 1, bf16, rows of whole batches; hipengine/gpu/monokernel.py mlp_packed_on): gate/up and
// down stream their weights' lossless 13-bit copies (ops/matvec_packed.hip: the same sums, bit for bit).
#ifndef MK_MLP_PACKED
#define MK_MLP_PACKED 0
#endif
#if MK_MLP_PACKED
#include "ops/matvec_packed.hip"
#endif
// MK_O_GROUP=1 (tp = 1; hipengine/gpu/monokernel.py o_group_wanted): the O-proj by KV-head group
// (ops/matvec_group.hip), below.
#ifndef MK_O_GROUP
#define MK_O_GROUP 0
#endif
#if MK_O_GROUP
#include "ops/matvec_group.hip"
#endif

// BEGIN GENERATED by hipengine/gpu/monokernel.py c_layout_text(): edit the Python tables, not this.
// Offsets are compile-time checked where the front end has __builtin_offsetof (clang: gfx942 and the
// host layout probe); NVRTC lacks it, so monokernel_layout() reports them at run time and the host
// compares (MonokernelBackend._check_layout).
#if defined(__clang__)
#define MK_OFFSET_CHECK(T, f, off) static_assert(__builtin_offsetof(T, f) == off, #T "." #f);
#else
#define MK_OFFSET_CHECK(T, f, off)
#endif
struct HeGridBarrier;
struct MkLayer;
struct MkState;
struct MkLayer {
  const he_u16* wqkv;
  const he_u16* wo;
  const he_u16* w_gate;
  const he_u16* w_up;
  const he_u16* w_down;
  const float* attn_norm;
  const float* ffn_norm;
  const float* bqkv;
  const float* q_norm;
  const float* k_norm;
  he_kv* k_cache;
  he_kv* v_cache;
  he_i32 w_f16;
  he_i32 pad0;
  const he_u16* w_down_t;
  const he_u8* w_gate_p;
  const he_u8* w_up_p;
  const he_u8* w_down_p;
  const he_u32* esc_gu;
  const he_u32* esc_down;
  float gu_post;
  float gu_unpost;
  float down_post;
  float down_unpost;
};
static_assert(sizeof(MkLayer) == 168, "MkLayer size (Python table)");
MK_OFFSET_CHECK(MkLayer, wqkv, 0)
MK_OFFSET_CHECK(MkLayer, wo, 8)
MK_OFFSET_CHECK(MkLayer, w_gate, 16)
MK_OFFSET_CHECK(MkLayer, w_up, 24)
MK_OFFSET_CHECK(MkLayer, w_down, 32)
MK_OFFSET_CHECK(MkLayer, attn_norm, 40)
MK_OFFSET_CHECK(MkLayer, ffn_norm, 48)
MK_OFFSET_CHECK(MkLayer, bqkv, 56)
MK_OFFSET_CHECK(MkLayer, q_norm, 64)
MK_OFFSET_CHECK(MkLayer, k_norm, 72)
MK_OFFSET_CHECK(MkLayer, k_cache, 80)
MK_OFFSET_CHECK(MkLayer, v_cache, 88)
MK_OFFSET_CHECK(MkLayer, w_f16, 96)
MK_OFFSET_CHECK(MkLayer, pad0, 100)
MK_OFFSET_CHECK(MkLayer, w_down_t, 104)
MK_OFFSET_CHECK(MkLayer, w_gate_p, 112)
MK_OFFSET_CHECK(MkLayer, w_up_p, 120)
MK_OFFSET_CHECK(MkLayer, w_down_p, 128)
MK_OFFSET_CHECK(MkLayer, esc_gu, 136)
MK_OFFSET_CHECK(MkLayer, esc_down, 144)
MK_OFFSET_CHECK(MkLayer, gu_post, 152)
MK_OFFSET_CHECK(MkLayer, gu_unpost, 156)
MK_OFFSET_CHECK(MkLayer, down_post, 160)
MK_OFFSET_CHECK(MkLayer, down_unpost, 164)
struct MkState {
  he_i32 token;
  he_i32 pos;
  he_i32 hist_len;
  he_i32 n_out;
  he_i32 stop;
  he_i32 steps;
  he_i32 cancel;
  he_i32 pad1;
};
static_assert(sizeof(MkState) == 32, "MkState size (Python table)");
MK_OFFSET_CHECK(MkState, token, 0)
MK_OFFSET_CHECK(MkState, pos, 4)
MK_OFFSET_CHECK(MkState, hist_len, 8)
MK_OFFSET_CHECK(MkState, n_out, 12)
MK_OFFSET_CHECK(MkState, stop, 16)
MK_OFFSET_CHECK(MkState, steps, 20)
MK_OFFSET_CHECK(MkState, cancel, 24)
MK_OFFSET_CHECK(MkState, pad1, 28)
struct MkParams {
  const MkLayer* layers;
  const he_u16* embed;
  const he_u16* lm_head;
  const float* final_norm;
  const float* cos_t;
  const float* sin_t;
  const int* iota;
  float* x;
  float* qkv;
  float* q;
  float* att;
  float* h;
  float* partial;
  float* logits;
  float* z;
  int* history;
  const int* eos;
  MkState* state;
  HeGridBarrier* bar;
  he_u32* attn_count;
  float* cand;
  he_u32* host;
  int* ring;
  he_u64 timeout_ns;
  he_i32 vocab;
  he_i32 d;
  he_i32 ffn;
  he_i32 nh;
  he_i32 nkv;
  he_i32 hd;
  he_i32 n_layers;
  he_i32 max_ctx;
  he_i32 nsplit;
  he_i32 chunk;
  he_i32 embed_f16;
  he_i32 head_f16;
  he_i32 qk_norm;
  he_i32 n_eos;
  he_i32 mode;
  he_i32 max_tokens;
  he_i32 ring_cap;
  he_i32 top_k;
  float eps;
  float temperature;
  float top_p;
  float min_p;
  float rep_pen;
  he_u32 seed_lo;
  he_u32 seed_hi;
  he_i32 fine;
  he_u32 poll_sleep_ns;
  he_u64* prof;
  const he_u64* tp_ll;
  float* xb;
  he_i32 tp_world;
  he_i32 tp_rank;
  he_i32 vocab_off;
  he_i32 embed_vocab;
  he_i64* x_fx;
  const he_u8* head_q;
  const float* head_meta;
  float* screen_lo;
  float head_c2;
  he_i32 screen;
  he_u64* flow_ll;
};
static_assert(sizeof(MkParams) == 392, "MkParams size (Python table)");
MK_OFFSET_CHECK(MkParams, layers, 0)
MK_OFFSET_CHECK(MkParams, embed, 8)
MK_OFFSET_CHECK(MkParams, lm_head, 16)
MK_OFFSET_CHECK(MkParams, final_norm, 24)
MK_OFFSET_CHECK(MkParams, cos_t, 32)
MK_OFFSET_CHECK(MkParams, sin_t, 40)
MK_OFFSET_CHECK(MkParams, iota, 48)
MK_OFFSET_CHECK(MkParams, x, 56)
MK_OFFSET_CHECK(MkParams, qkv, 64)
MK_OFFSET_CHECK(MkParams, q, 72)
MK_OFFSET_CHECK(MkParams, att, 80)
MK_OFFSET_CHECK(MkParams, h, 88)
MK_OFFSET_CHECK(MkParams, partial, 96)
MK_OFFSET_CHECK(MkParams, logits, 104)
MK_OFFSET_CHECK(MkParams, z, 112)
MK_OFFSET_CHECK(MkParams, history, 120)
MK_OFFSET_CHECK(MkParams, eos, 128)
MK_OFFSET_CHECK(MkParams, state, 136)
MK_OFFSET_CHECK(MkParams, bar, 144)
MK_OFFSET_CHECK(MkParams, attn_count, 152)
MK_OFFSET_CHECK(MkParams, cand, 160)
MK_OFFSET_CHECK(MkParams, host, 168)
MK_OFFSET_CHECK(MkParams, ring, 176)
MK_OFFSET_CHECK(MkParams, timeout_ns, 184)
MK_OFFSET_CHECK(MkParams, vocab, 192)
MK_OFFSET_CHECK(MkParams, d, 196)
MK_OFFSET_CHECK(MkParams, ffn, 200)
MK_OFFSET_CHECK(MkParams, nh, 204)
MK_OFFSET_CHECK(MkParams, nkv, 208)
MK_OFFSET_CHECK(MkParams, hd, 212)
MK_OFFSET_CHECK(MkParams, n_layers, 216)
MK_OFFSET_CHECK(MkParams, max_ctx, 220)
MK_OFFSET_CHECK(MkParams, nsplit, 224)
MK_OFFSET_CHECK(MkParams, chunk, 228)
MK_OFFSET_CHECK(MkParams, embed_f16, 232)
MK_OFFSET_CHECK(MkParams, head_f16, 236)
MK_OFFSET_CHECK(MkParams, qk_norm, 240)
MK_OFFSET_CHECK(MkParams, n_eos, 244)
MK_OFFSET_CHECK(MkParams, mode, 248)
MK_OFFSET_CHECK(MkParams, max_tokens, 252)
MK_OFFSET_CHECK(MkParams, ring_cap, 256)
MK_OFFSET_CHECK(MkParams, top_k, 260)
MK_OFFSET_CHECK(MkParams, eps, 264)
MK_OFFSET_CHECK(MkParams, temperature, 268)
MK_OFFSET_CHECK(MkParams, top_p, 272)
MK_OFFSET_CHECK(MkParams, min_p, 276)
MK_OFFSET_CHECK(MkParams, rep_pen, 280)
MK_OFFSET_CHECK(MkParams, seed_lo, 284)
MK_OFFSET_CHECK(MkParams, seed_hi, 288)
MK_OFFSET_CHECK(MkParams, fine, 292)
MK_OFFSET_CHECK(MkParams, poll_sleep_ns, 296)
MK_OFFSET_CHECK(MkParams, prof, 304)
MK_OFFSET_CHECK(MkParams, tp_ll, 312)
MK_OFFSET_CHECK(MkParams, xb, 320)
MK_OFFSET_CHECK(MkParams, tp_world, 328)
MK_OFFSET_CHECK(MkParams, tp_rank, 332)
MK_OFFSET_CHECK(MkParams, vocab_off, 336)
MK_OFFSET_CHECK(MkParams, embed_vocab, 340)
MK_OFFSET_CHECK(MkParams, x_fx, 344)
MK_OFFSET_CHECK(MkParams, head_q, 352)
MK_OFFSET_CHECK(MkParams, head_meta, 360)
MK_OFFSET_CHECK(MkParams, screen_lo, 368)
MK_OFFSET_CHECK(MkParams, head_c2, 376)
MK_OFFSET_CHECK(MkParams, screen, 380)
MK_OFFSET_CHECK(MkParams, flow_ll, 384)
enum MkHostWord { kMkHost_write_idx = 0, kMkHost_status = 1, kMkHost_finish = 2, kMkHost_cancel = 3, kMkHost_n_out = 4, kMkHost_pos = 5, kMkHost_pad0 = 6, kMkHost_pad1 = 7 };
enum MkMode { kMkModeEmbedFirst = 1, kMkModeOneStep = 2 };
enum MkFinish { kMkFinish_stop = 1, kMkFinish_length = 2, kMkFinish_cancelled = 3, kMkFinish_context = 4 };
enum { kMkThreads = 256 };
extern "C" __global__ void monokernel_layout(he_u64* out) {
  if (he_thread_idx() != 0 || he_block_idx() != 0) return;
  MkLayer vMkLayer{};
  out[0] = sizeof(MkLayer);
  out[1] = (he_u64)((const char*)&vMkLayer.wqkv - (const char*)&vMkLayer);
  out[2] = (he_u64)((const char*)&vMkLayer.wo - (const char*)&vMkLayer);
  out[3] = (he_u64)((const char*)&vMkLayer.w_gate - (const char*)&vMkLayer);
  out[4] = (he_u64)((const char*)&vMkLayer.w_up - (const char*)&vMkLayer);
  out[5] = (he_u64)((const char*)&vMkLayer.w_down - (const char*)&vMkLayer);
  out[6] = (he_u64)((const char*)&vMkLayer.attn_norm - (const char*)&vMkLayer);
  out[7] = (he_u64)((const char*)&vMkLayer.ffn_norm - (const char*)&vMkLayer);
  out[8] = (he_u64)((const char*)&vMkLayer.bqkv - (const char*)&vMkLayer);
  out[9] = (he_u64)((const char*)&vMkLayer.q_norm - (const char*)&vMkLayer);
  out[10] = (he_u64)((const char*)&vMkLayer.k_norm - (const char*)&vMkLayer);
  out[11] = (he_u64)((const char*)&vMkLayer.k_cache - (const char*)&vMkLayer);
  out[12] = (he_u64)((const char*)&vMkLayer.v_cache - (const char*)&vMkLayer);
  out[13] = (he_u64)((const char*)&vMkLayer.w_f16 - (const char*)&vMkLayer);
  out[14] = (he_u64)((const char*)&vMkLayer.pad0 - (const char*)&vMkLayer);
  out[15] = (he_u64)((const char*)&vMkLayer.w_down_t - (const char*)&vMkLayer);
  out[16] = (he_u64)((const char*)&vMkLayer.w_gate_p - (const char*)&vMkLayer);
  out[17] = (he_u64)((const char*)&vMkLayer.w_up_p - (const char*)&vMkLayer);
  out[18] = (he_u64)((const char*)&vMkLayer.w_down_p - (const char*)&vMkLayer);
  out[19] = (he_u64)((const char*)&vMkLayer.esc_gu - (const char*)&vMkLayer);
  out[20] = (he_u64)((const char*)&vMkLayer.esc_down - (const char*)&vMkLayer);
  out[21] = (he_u64)((const char*)&vMkLayer.gu_post - (const char*)&vMkLayer);
  out[22] = (he_u64)((const char*)&vMkLayer.gu_unpost - (const char*)&vMkLayer);
  out[23] = (he_u64)((const char*)&vMkLayer.down_post - (const char*)&vMkLayer);
  out[24] = (he_u64)((const char*)&vMkLayer.down_unpost - (const char*)&vMkLayer);
  MkState vMkState{};
  out[25] = sizeof(MkState);
  out[26] = (he_u64)((const char*)&vMkState.token - (const char*)&vMkState);
  out[27] = (he_u64)((const char*)&vMkState.pos - (const char*)&vMkState);
  out[28] = (he_u64)((const char*)&vMkState.hist_len - (const char*)&vMkState);
  out[29] = (he_u64)((const char*)&vMkState.n_out - (const char*)&vMkState);
  out[30] = (he_u64)((const char*)&vMkState.stop - (const char*)&vMkState);
  out[31] = (he_u64)((const char*)&vMkState.steps - (const char*)&vMkState);
  out[32] = (he_u64)((const char*)&vMkState.cancel - (const char*)&vMkState);
  out[33] = (he_u64)((const char*)&vMkState.pad1 - (const char*)&vMkState);
  MkParams vMkParams{};
  out[34] = sizeof(MkParams);
  out[35] = (he_u64)((const char*)&vMkParams.layers - (const char*)&vMkParams);
  out[36] = (he_u64)((const char*)&vMkParams.embed - (const char*)&vMkParams);
  out[37] = (he_u64)((const char*)&vMkParams.lm_head - (const char*)&vMkParams);
  out[38] = (he_u64)((const char*)&vMkParams.final_norm - (const char*)&vMkParams);
  out[39] = (he_u64)((const char*)&vMkParams.cos_t - (const char*)&vMkParams);
  out[40] = (he_u64)((const char*)&vMkParams.sin_t - (const char*)&vMkParams);
  out[41] = (he_u64)((const char*)&vMkParams.iota - (const char*)&vMkParams);
  out[42] = (he_u64)((const char*)&vMkParams.x - (const char*)&vMkParams);
  out[43] = (he_u64)((const char*)&vMkParams.qkv - (const char*)&vMkParams);
  out[44] = (he_u64)((const char*)&vMkParams.q - (const char*)&vMkParams);
  out[45] = (he_u64)((const char*)&vMkParams.att - (const char*)&vMkParams);
  out[46] = (he_u64)((const char*)&vMkParams.h - (const char*)&vMkParams);
  out[47] = (he_u64)((const char*)&vMkParams.partial - (const char*)&vMkParams);
  out[48] = (he_u64)((const char*)&vMkParams.logits - (const char*)&vMkParams);
  out[49] = (he_u64)((const char*)&vMkParams.z - (const char*)&vMkParams);
  out[50] = (he_u64)((const char*)&vMkParams.history - (const char*)&vMkParams);
  out[51] = (he_u64)((const char*)&vMkParams.eos - (const char*)&vMkParams);
  out[52] = (he_u64)((const char*)&vMkParams.state - (const char*)&vMkParams);
  out[53] = (he_u64)((const char*)&vMkParams.bar - (const char*)&vMkParams);
  out[54] = (he_u64)((const char*)&vMkParams.attn_count - (const char*)&vMkParams);
  out[55] = (he_u64)((const char*)&vMkParams.cand - (const char*)&vMkParams);
  out[56] = (he_u64)((const char*)&vMkParams.host - (const char*)&vMkParams);
  out[57] = (he_u64)((const char*)&vMkParams.ring - (const char*)&vMkParams);
  out[58] = (he_u64)((const char*)&vMkParams.timeout_ns - (const char*)&vMkParams);
  out[59] = (he_u64)((const char*)&vMkParams.vocab - (const char*)&vMkParams);
  out[60] = (he_u64)((const char*)&vMkParams.d - (const char*)&vMkParams);
  out[61] = (he_u64)((const char*)&vMkParams.ffn - (const char*)&vMkParams);
  out[62] = (he_u64)((const char*)&vMkParams.nh - (const char*)&vMkParams);
  out[63] = (he_u64)((const char*)&vMkParams.nkv - (const char*)&vMkParams);
  out[64] = (he_u64)((const char*)&vMkParams.hd - (const char*)&vMkParams);
  out[65] = (he_u64)((const char*)&vMkParams.n_layers - (const char*)&vMkParams);
  out[66] = (he_u64)((const char*)&vMkParams.max_ctx - (const char*)&vMkParams);
  out[67] = (he_u64)((const char*)&vMkParams.nsplit - (const char*)&vMkParams);
  out[68] = (he_u64)((const char*)&vMkParams.chunk - (const char*)&vMkParams);
  out[69] = (he_u64)((const char*)&vMkParams.embed_f16 - (const char*)&vMkParams);
  out[70] = (he_u64)((const char*)&vMkParams.head_f16 - (const char*)&vMkParams);
  out[71] = (he_u64)((const char*)&vMkParams.qk_norm - (const char*)&vMkParams);
  out[72] = (he_u64)((const char*)&vMkParams.n_eos - (const char*)&vMkParams);
  out[73] = (he_u64)((const char*)&vMkParams.mode - (const char*)&vMkParams);
  out[74] = (he_u64)((const char*)&vMkParams.max_tokens - (const char*)&vMkParams);
  out[75] = (he_u64)((const char*)&vMkParams.ring_cap - (const char*)&vMkParams);
  out[76] = (he_u64)((const char*)&vMkParams.top_k - (const char*)&vMkParams);
  out[77] = (he_u64)((const char*)&vMkParams.eps - (const char*)&vMkParams);
  out[78] = (he_u64)((const char*)&vMkParams.temperature - (const char*)&vMkParams);
  out[79] = (he_u64)((const char*)&vMkParams.top_p - (const char*)&vMkParams);
  out[80] = (he_u64)((const char*)&vMkParams.min_p - (const char*)&vMkParams);
  out[81] = (he_u64)((const char*)&vMkParams.rep_pen - (const char*)&vMkParams);
  out[82] = (he_u64)((const char*)&vMkParams.seed_lo - (const char*)&vMkParams);
  out[83] = (he_u64)((const char*)&vMkParams.seed_hi - (const char*)&vMkParams);
  out[84] = (he_u64)((const char*)&vMkParams.fine - (const char*)&vMkParams);
  out[85] = (he_u64)((const char*)&vMkParams.poll_sleep_ns - (const char*)&vMkParams);
  out[86] = (he_u64)((const char*)&vMkParams.prof - (const char*)&vMkParams);
  out[87] = (he_u64)((const char*)&vMkParams.tp_ll - (const char*)&vMkParams);
  out[88] = (he_u64)((const char*)&vMkParams.xb - (const char*)&vMkParams);
  out[89] = (he_u64)((const char*)&vMkParams.tp_world - (const char*)&vMkParams);
  out[90] = (he_u64)((const char*)&vMkParams.tp_rank - (const char*)&vMkParams);
  out[91] = (he_u64)((const char*)&vMkParams.vocab_off - (const char*)&vMkParams);
  out[92] = (he_u64)((const char*)&vMkParams.embed_vocab - (const char*)&vMkParams);
  out[93] = (he_u64)((const char*)&vMkParams.x_fx - (const char*)&vMkParams);
  out[94] = (he_u64)((const char*)&vMkParams.head_q - (const char*)&vMkParams);
  out[95] = (he_u64)((const char*)&vMkParams.head_meta - (const char*)&vMkParams);
  out[96] = (he_u64)((const char*)&vMkParams.screen_lo - (const char*)&vMkParams);
  out[97] = (he_u64)((const char*)&vMkParams.head_c2 - (const char*)&vMkParams);
  out[98] = (he_u64)((const char*)&vMkParams.screen - (const char*)&vMkParams);
  out[99] = (he_u64)((const char*)&vMkParams.flow_ll - (const char*)&vMkParams);
}
// END GENERATED

static_assert(sizeof(HeGridBarrier) == 16, "HeGridBarrier is 16 bytes (the host zeroes 16)");
static_assert(kMkThreads == kAttnThreads, "the attention split plan assumes the per-op block size");

// Weight dtype is a compile-time choice (-DMK_WEIGHT_F16=0|1, picked by the host from the model): one
// instantiation of every body instead of two halves the (long) compile of this unit.
#ifndef MK_WEIGHT_F16
#define MK_WEIGHT_F16 0
#endif
constexpr bool kMkF16 = MK_WEIGHT_F16 != 0;
// The LL exchange (monokernel/tp_exchange.h: tensor parallelism, or HIPENGINE_MK_LL at tp = 1) is a build of its
// own (-DMK_TP=1). Compiled out (the default), monokernel_decode's SASS is v12's instruction for instruction
// (checked with nvdisasm); with the exchange's branches merely present, ptxas scheduled one matvec stage
// differently and tp = 1 ran 3-6% slower (docs/perf-log.md, v15).
#ifndef MK_TP
#define MK_TP 0
#endif
constexpr bool kMkTp = MK_TP != 0;
// A matvec stage followed by a grid barrier requests the next stage's first weights after its barrier
// arrival, not at the end of its loop: the arrival's release would otherwise wait for those loads too
// (+3-4% at 1K/8K on H200, docs/perf-log.md v22). At tp > 1 the O-proj / down-proj end in an LL push with no
// fence, and keep the stream's own refill (kMkDeferOD).
constexpr bool kMkDefer = true;
constexpr bool kMkDeferOD = !kMkTp;
// Stages of the layer loop that only some models or settings run are compiled only into their builds
// (-D from the host): the Qwen3 q/k-norm stage (MK_QK_NORM, models with q/k norms) and the fine = 2 combine
// (MK_FINE2, HIPENGINE_MK_FINE=2). Code the loop never executes, between the code it does, costs instruction
// fetch every layer: without it and the stream's predicated paths (matvec.hip HE_MV_WHOLE_PAIRS) the step was
// 6-7% faster at 1K on H200 (docs/perf-log.md v67).
#ifndef MK_QK_NORM
#define MK_QK_NORM 0
#endif
#ifndef MK_FINE2
#define MK_FINE2 0
#endif

// The MLP as one stage (-DMK_FUSED_MLP=1, opt-in at tp = 1 with HIPENGINE_FUSED_MLP=1: ops/mlp.hip, hipengine/gpu/
// ops.py fused_mlp; measured 1-2% slower than the two stages on H200, docs/perf-log.md v75b): each gate/up unit
// also applies its row of the down-projection to the warp's partial, and each block adds its warps' sum into
// p.x_fx (the residual stream's fixed-point addend) — no grid barrier between the halves. Readers of x add p.x_fx (the QKV / LM head prologues); the O-proj folds it into x and clears it;
// every embedding of a token clears it. The LL exchange builds (MK_TP) keep gate/up ── barrier ── down.
#ifndef MK_FUSED_MLP
#define MK_FUSED_MLP 0
#endif
static_assert(!(MK_FUSED_MLP && MK_TP), "the fused MLP is a tp = 1 build (its output is not an LL exchange)");
constexpr bool kMkFusedMlp = MK_FUSED_MLP != 0;

// MK_ATTN_EARLY=1 (v72, an opt-in build: HIPENGINE_MK_DEFINES=MK_ATTN_EARLY=1): the attention splits' first K/V
// requests go out between the QKV barrier's arrival and its wait (mk_attention's kEarly), as the per-op split
// kernel's go out before its he_pdl_wait. Same loads, same sums, same tokens. Measured on H200 against the default
// in one process, five rounds over two calls: level at 1K (+0.2 / −0.3%), +0.8% at 8K, −0.1 / −0.2% at 32K — the
// poll queues behind those K/V loads (in-order return) and the barrier's exit comes later by about what the split
// saves (docs/perf-log.md v72). Not the default for that reason; 255 registers, +29 KB of code.
#ifndef MK_ATTN_EARLY
#define MK_ATTN_EARLY 0
#endif
constexpr bool kMkAttnEarly = MK_ATTN_EARLY != 0;

// MK_GU_L2=K (a probe, session 34; default 0): right after the QKV barrier, the blocks that have no attention split
// item (the plan's nkv x nsplit items leave nb - items of them idle: 68 of 132 with HIPENGINE_ATTN_BLOCKS_PER_SM=0.5
// at 1K) ask L2 for the layer's gate/up units [S, (1 + K) S) — S = the stream's unit stride (grid x warps), so
// every warp's 2nd .. (K+1)-th gate/up unit; its 1st is in its registers by then — by bulk prefetch (no registers,
// fire and forget). The blocks doing attention issue nothing, so their chain's loads queue behind none of it; the
// question the probe answers is whether HBM traffic from OTHER SMs still slows that chain (v14 / v39 / v60 moved
// bytes into the attention window from the attention's own SMs and lost). Values do not change. Measured (4f8958a,
// H200, 1K): −2.3 / −3.8% (K = 1), −5.3% (K = 2) — it does: kept off, as the probe (docs/perf-log.md session 34).
#ifndef MK_GU_L2
#define MK_GU_L2 0
#endif
static_assert(MK_GU_L2 >= 0, "MK_GU_L2: gate/up units per warp to prefetch");
// MK_GU_L2_GAP=C (session 35, with MK_GU_L2 = K > 0): the same rows, PACED — the probe above asked for all of them
// at once (a burst of K x 8.6 MB, whose queue every L2 round trip of the attention chain waited behind). Here the
// idle blocks' warps take 32-row groups (one 4 KiB row per lane), group g = warp i, i + idle warps, ..., and a
// warp issues group g when its SM's clock is g x C cycles past the block's entry, after the block's O-proj fill:
// the rows go out at a set rate (4 KiB x 32 per C cycles) so that only ~rate x latency bytes are ever queued.
// The question: is the chain's loss a function of the bytes queued (a paced stream of the same bytes costs the
// chain little) or of the bytes moved (it costs the same)? 0: the burst, at the probe's position (before the splits).
// Measured (14cfa05, H200, 1K, the 0.5 plan): paced at 1.7 TB/s −4.3% against the burst's −3.0% (the plan alone
// −0.8%) — the bytes moved, not the queue; with the default plan the 4 issuing blocks cannot issue that fast and
// delay the O barrier (−5.4 to −5.9%). Off (docs/perf-log.md session 35).
#ifndef MK_GU_L2_GAP
#define MK_GU_L2_GAP 0
#endif
static_assert(MK_GU_L2_GAP >= 0 && (MK_GU_L2 > 0 || MK_GU_L2_GAP == 0), "MK_GU_L2_GAP paces MK_GU_L2's rows");
static_assert(!(MK_GU_L2 && (MK_MLP_PACKED || MK_FUSED_MLP)), "MK_GU_L2 prefetches the bf16 gate/up stage's rows");

// MK_START_L2=mask (session 50; default 4 — the host's short-context build 7, with MK_START_L2_HALF=7, since session
// 52: hipengine/gpu/monokernel.py start_l2_defines): when a grid barrier opens, before the next stage's prologue, each
// warp asks L2 for the pair after the first one it holds — kRows rows x 2B columns, 4 KiB per row, by bulk prefetch
// (fire and forget: no registers, none on AMD). Bit 1: gate/up's, after the O barrier; 2: down's, after the gate/up
// barrier; 4: the next layer's QKV, after the down barrier. Why: the first pair lands before the barrier opens (the
// poll returns behind it), but the second is requested only after the prologue (the input's RMSNorm: L2 round trips)
// and the first pair's consume, so HBM idles at each stage's start. Measured on an H100 (docs/perf-log.md sessions 50,
// 51): bit 4 alone +0.6 / +1.0% at 1K, +2.3 / 0.0% at 8K, +1.2 / +1.1% at 32K in session 50, +0.3 / +0.4 / +1.4% (four
// rounds' means) in session 51 — the default; bit 1 lost (−1.8 / −2.1% at 1K), bit 2 (−0.2 / −0.9%) and all three
// together (−0.9 / −1.2%): their stages' work got shorter, their totals did not (why is not established). Session 51
// also measured, and removed, the next step's QKV after the LM head's barrier and the LM head's own pair after the last
// down barrier (level to −1.9%). The same bytes asked for at the barrier's arrival (session 50's MK_ARRIVE_L2) lost
// 1-5%: they shared HBM with the first fill, which the barrier's exit waits for. Values do not change.
#ifndef MK_START_L2
#define MK_START_L2 4
#endif
static_assert(MK_START_L2 >= 0 && MK_START_L2 < 8, "MK_START_L2: a mask of the layer's barriers' next stages");
// MK_START_L2_HALF=mask (a subset of MK_START_L2's bits; default none): those bits ask for their pair's first batch
// only (2 KiB a row: 4.2 MB at llama-3.2-1b's gate/up and down, 2 MB at QKV, whose second pair only 480 of the 1,056
// warps have) instead of the whole pair (8.4 / 3.9 MB). Session 51 (H100, two rounds each in two processes): all three
// bits halved (mask 7, half 7) +0.6 / +0.1 / +0.4 / +1.0% at 1K against the default, but −1.0 to −1.5% at 32K; gate/up
// and QKV halved (mask 5, half 5) −0.8 / −1.0% at 1K. Session 52 (H100, four rounds in two processes): down's half pair
// with QKV's whole one (6 / 2) +0.3 / −0.2 / +0.1% at 1K / 8K / 32K, gate/up's and down's halves (7 / 3; two rounds)
// +0.7 / −0.9 / −0.4%, all three halved (7 / 7) +1.0 / −0.3 / −0.3% — over its eight rounds +0.7% at 1K (every round ≥
// +0.1%), −0.3 / −0.8% at 8K / 32K: the short-context build's (the host sets it), the long builds keep mask 4.
#ifndef MK_START_L2_HALF
#define MK_START_L2_HALF 0
#endif
static_assert((MK_START_L2_HALF & ~MK_START_L2) == 0, "MK_START_L2_HALF: a subset of MK_START_L2's bits");
static_assert(!((MK_START_L2 & 3) && (MK_MLP_PACKED || MK_FUSED_MLP)), "MK_START_L2: the bf16 two-stage MLP's streams");

// Query heads per KV head, also a compile-time choice (-DMK_ATTN_G): the attention body keeps kG·10 values
// per lane in registers and is a template on it.
#ifndef MK_ATTN_G
#define MK_ATTN_G 4
#endif

// MK_O_GROUP=1: the attention -> O-proj chain without the combining block's publication. Each split block
// counts its item on its KV head's split counter (p.attn_count[kvh], a release add at device scope after
// he_sync_block, monotone through the launch: nsplit more per layer); the blocks of group g (the first
// nkv x d / kBlockRows blocks, d / kBlockRows per group) request their share of Wo's group-g columns
// (ops/matvec_group.hip) right after their own splits, wait for that counter (acquire), combine the group's G
// heads into shared memory themselves (he_attention_combine: the per-op combine's arithmetic) and add their rows'
// shares into p.x_fx in fixed point, group 0's tiles x itself as well, so p.x_fx holds the whole residual: the
// gate/up prologue reads it alone, the down-proj's residual rows read it, write x and clear it (zero again before
// the next layer's O-proj, two barriers later). No heads-combined counter, no att in global memory. tp = 1,
// fine = 3, the two-stage bf16 MLP only. Measured: docs/perf-log.md session 36.
static_assert(!(MK_O_GROUP && (MK_TP || MK_FUSED_MLP || MK_MLP_PACKED || MK_FINE2 || MK_GU_L2)),
              "MK_O_GROUP: tp = 1, fine = 3, the two-stage bf16 MLP");
#if MK_O_GROUP
static_assert(HE_ATTN_HD > 0, "MK_O_GROUP: the build's head_dim (HE_ATTN_HD, ops.attention_defines) sizes Wo's groups");
constexpr int kMkOCols = MK_ATTN_G * HE_ATTN_HD;  // one KV head's group of columns of Wo
#endif

// MK_QFLOW=1 (tp = 1, the grouped O-proj, no q/k norms, the matrix-core split; hipengine/gpu/monokernel.py
// q_flow_decide): no grid barrier between QKV and attention. The QKV epilogue also writes each q / k / v value it
// computes as an LL word {payload, epoch} into p.flow_ll (row r of the stacked matrix at word r: q as f32 bits, k and
// v as the cache's 16 bits; monokernel/tp_exchange.h's one-store protocol: an aligned 8-byte store is single-copy
// atomic, so a reader that sees the epoch holds the value), and the attention splits poll the words they need —
// their group's q, and the split that holds the newest position its K/V row — instead of waiting for the whole QKV
// stage: a split's rows of earlier steps and its q are ready after the first round of QKV units, the newest K/V row
// after the second (1,536 units on 1,056 warps at d = 2,048), and the barrier's exit came after both. The split items
// go to the grid's last blocks (blocks 0 .. a few dozen stream the second round). The same loads and sums as the
// default build, so the same bits. Epochs: one per layer of the launch from 1 (flow_ep); the host zeroes the words
// before each launch (fine-grained memory on AMD: an MI300X's XCDs do not share L2 lines of coarse-grained
// memory). Reuse: layer l + 1's QKV writes the words only after the down(l) barrier, which follows every
// split of layer l (each split's block arrives at the O barrier after it).
#ifndef MK_QFLOW
#define MK_QFLOW 0
#endif
static_assert(!MK_QFLOW || (MK_O_GROUP && !MK_QK_NORM && !MK_ATTN_EARLY && kAttnMma),
              "MK_QFLOW: the grouped O-proj, no q/k norms, the matrix-core split");
#if MK_QFLOW
// The block's poll failed (timeout or another block's error): the kernel ends after the split (mk_attention_flow).
__shared__ int mk_flow_fail;
HE_INLINE he_u32 mk_ll_epoch(he_u64 v) { return (he_u32)(v >> 32); }

// QKV with the LL copy of every value (above). Same arithmetic as HeMvQkv (rope = 1).
struct MkQkvFlow : HeMvQkv {
  he_u64* ll;
  he_u32 epoch;
  HE_INLINE void epi(int u, const float (&acc)[2], const float (&)[2]) const {
    if (he_lane_id() != 0) return;
    int ra, rb, i;
    float a, b;
    biased(u, acc, ra, rb, i, a, b);
    const int pos = *pos_p;
    rotate(ra, i, pos, a, b);
    he_u32 wa = he_f32_as_u32(a), wb = he_f32_as_u32(b);
    if (ra >= q_dim) {
      he_kv ka, kb;
      append(ra, i, pos, a, b, ka, kb);
      wa = ka;
      wb = kb;
    }
    volatile he_u64* w = ll;
    w[ra] = ((he_u64)epoch << 32) | wa;
    w[rb] = ((he_u64)epoch << 32) | wb;
  }
};

// The split body's source of q and of the newest K/V row (ops/attention_decode.hip HeAttnPlainQ): the LL words.
// Polls re-load only the words not yet there, all at once (one round trip per pass); a poll that outlives the
// timeout reports kStatusCounterTimeout, and one that sees another block's error stops: both set mk_flow_fail.
struct MkFlowWait {
  static constexpr bool kFlow = true;
  HeWaitCtx w;
  const he_u64* ll;
  he_u32 epoch;
  int q_dim, kv_dim;
  HE_INLINE bool operator()() const { return true; }  // nothing to wait for as a block: the words are polled
  // words p[0 .. N)
  template <int N>
  HE_INLINE void poll(const he_u64* p, he_u64 (&v)[N]) const {
    const he_u64* at[N];
#pragma unroll
    for (int j = 0; j < N; ++j) at[j] = p + j;
    poll_at(at, v);
  }
  // words *at[0 .. N)
  template <int N>
  HE_INLINE void poll_at(const he_u64* const (&at)[N], he_u64 (&v)[N]) const {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = *(const volatile he_u64*)at[j];
    he_u64 t0 = 0;
    for (int polls = 0;; ++polls) {
      bool all = true;
#pragma unroll
      for (int j = 0; j < N; ++j) all = all && mk_ll_epoch(v[j]) == epoch;
#if MK_PROFILE
      // q2's marks (thread 0's): kProfAttnQFirst, its first pass back — the test reads a word, so the clock is read
      // after the pass returns (no epoch is ~0; without it the clock read was scheduled before the loads' first use) —
      // and kProfAttnQReady, its words all there
      if (N == 2 && polls == 0 && mk_ll_epoch(v[0]) != ~0u) mk_attn_mark(3);
      if (N == 2 && all) mk_attn_mark(4);
#endif
      if (all) return;
      if (polls % kPollsPerClock == 0) {
        if (polls == 0) {
          t0 = he_clock_ns();
        } else if (he_aborted(w)) {
          mk_flow_fail = 1;
          return;
        } else if (he_clock_ns() - t0 > w.timeout_ns) {
          he_report_error(w, kStatusCounterTimeout);
          mk_flow_fail = 1;
          return;
        }
      }
#pragma unroll
      for (int j = 0; j < N; ++j)
        if (mk_ll_epoch(v[j]) != epoch) v[j] = *(const volatile he_u64*)at[j];
    }
  }
  HE_INLINE void q2(const float*, he_i64 i, float& a, float& b) const {
    he_u64 v[2];
    poll(ll + i, v);
    a = he_u32_as_f32((he_u32)v[0]);
    b = he_u32_as_f32((he_u32)v[1]);
  }
  HE_INLINE he_vec16 kv8(int kvh, bool is_v, int c) const {
    he_u64 v[8];
    poll(ll + q_dim + (is_v ? kv_dim : 0) + (he_i64)kvh * HE_ATTN_HD + c, v);
    auto two = [&](int j) { return ((he_u32)v[j] & 0xffffu) | ((he_u32)v[j + 1] << 16); };
    return he_vec16{two(0), two(2), two(4), two(6)};
  }
};

// HE_ATTN_FRESH_COMBINE's source of the newest row in the grouped O-proj's combine (ops/attention_decode.hip
// HeAttnFreshPlain's interface): head h's q[d] and dim d of KV head kvh's K (when wk) and V row, from the QKV stage's
// LL words — the combine's blocks passed no barrier after QKV. The three words polled together (one round trip).
struct MkFlowFresh {
  MkFlowWait f;
  HE_INLINE void fetch(int h, int kvh, int, int d, int hd, bool wk, float& qv, float& kv, float& vv) const {
    const he_u64 *q = f.ll + (he_i64)h * hd + d, *k = f.ll + f.q_dim + (he_i64)kvh * hd + d;
    const he_u64* const at[3] = {q, wk ? k : q, wk ? k + f.kv_dim : q};  // (!wk: q's word again, not used)
    he_u64 v[3];
    f.poll_at(at, v);
    qv = he_u32_as_f32((he_u32)v[0]);
    kv = he_kvlo_to_f32((he_u32)v[1]);
    vv = he_kvlo_to_f32((he_u32)v[2]);
  }
};
#endif

// ---- stage profile (-DMK_PROFILE=1 builds only) -----------------------------------------------------------
// Block 0's thread 0 accumulates, per stage kind, the cycles from the stage's start to its arrival at the
// next barrier ("work") and to that barrier's exit ("total" = work + wait), over every decode step of the
// launch; then the wall time and cycles of the whole loop so the host can convert cycles to ns.
// prof[k] work, prof[kMkProfN + k] total, prof[2N] ns, prof[2N + 1] cycles, prof[2N + 2] steps.
// kProfAttnQ/Loop/Merge: block 0's attention items, from the stage start to the HE_ATTN_MARK points (q staged,
// rows scored, warp states in shared memory); kProfAttnSplit to the item's partial written. MK_QFLOW's split also
// marks kProfAttnQFirst / kProfAttnQReady (thread 0's q poll: its first pass back, its words all there — so the q
// wait splits into a round trip and the producers' lateness) and kProfAttnFresh (the newest row's words all there,
// in the warp whose tile holds it).
// Then one row per block b < kMkProfMaxBlocks at prof + kMkProfHeader + b·kMkProfRow, per stage kind (thread
// 0's cycles, same marks as block 0's): work; for a grid barrier, from the work mark to every warp of the block
// done (he_sync_block: the block's slowest warp), from there to the arrival issued (the release fence), and
// the total to the barrier's exit; last, the SM it ran on — so the host can tell a slow block from a slow SM
// and the barrier's own cost from waiting for others (hipengine/gpu/monokernel.py read_profile: "blocks").
enum MkProfStage { kProfSelect, kProfQkv, kProfAttn, kProfCombine, kProfO, kProfGateUp, kProfDown, kProfHead,
                   kProfAttnSplit, kProfAttnQ, kProfAttnLoop, kProfAttnMerge, kProfAttnQFirst, kProfAttnQReady,
                   kProfAttnFresh, kMkProfN };
static_assert(kProfAttnLoop == kProfAttnQ + 1 && kProfAttnMerge == kProfAttnQ + 2 && kProfAttnQFirst == kProfAttnQ + 3 &&
                  kProfAttnQReady == kProfAttnQ + 4 && kProfAttnFresh == kProfAttnQ + 5,
              "the attention marks' k (HE_ATTN_MARK / HE_ATTN_MARK_WARP, MkFlowWait::poll): kProfAttnQ + k");
enum MkProfCol { kProfColWork, kProfColSync, kProfColArrive, kProfColTotal, kProfCols };
#if MK_PROFILE
constexpr int kMkProfHeader = 2 * kMkProfN + 3, kMkProfRow = kProfCols * kMkProfN + 1, kMkProfMaxBlocks = 2048;
// Thread 0's sums over the launch, in shared memory ([the header (block 0 only) | this block's row]), added to
// the buffer once, by finish(). A read-modify-write of the global buffer at every mark put an L2 round trip
// after each grid wait (whose acquire empties L1) into the thread being timed: session 23's profile builds ran
// ~8% slower than the production build, and the sub-stage marks just after a wait read that trip too.
__shared__ he_u64 mk_prof_sh[kMkProfHeader + kMkProfRow];
// One attention mark's cycles since the stage start, added by the one thread that calls it: to the header (block 0)
// and to the block's row (work column: MK_QFLOW's splits are not block 0's).
__device__ inline void mk_attn_add(int k) {
  if (he_block_idx() >= kMkProfMaxBlocks) return;
  const he_u64 d = he_cycles() - mk_prof_t;
  if (he_block_idx() == 0) mk_prof_sh[kProfAttnQ + k] += d;
  mk_prof_sh[kMkProfHeader + kProfAttnQ + k] += d;
}
__device__ inline void mk_attn_mark(int k) {  // by the block's thread 0
  if (he_thread_idx() == 0) mk_attn_add(k);
}
// A mark that one warp of the block reaches (attn_fresh: the warp that polls the newest row), by its lane 0: a word of
// its own in the row, so no other thread writes it; finish() reads it after the launch's last barrier.
__device__ inline void mk_attn_mark_warp(int k) {
  if (he_lane_id() == 0) mk_attn_add(k);
}
#endif
struct MkProf {
#if MK_PROFILE
  he_u64* out;  // the buffer: block 0 adds the header, every block its row (blk), at finish()
  he_u64* blk;
  he_u64 t, t0, ns0;
  bool on, lead;
  // the sums in shared memory: the header, then this block's row
  static HE_INLINE he_u64* hdr() { return mk_prof_sh; }
  static HE_INLINE he_u64* row() { return mk_prof_sh + kMkProfHeader; }
  HE_INLINE explicit MkProf(he_u64* o) : out(o), blk(nullptr), t(0), t0(0), ns0(0) {
    on = o != nullptr && he_thread_idx() == 0 && he_block_idx() < kMkProfMaxBlocks;
    lead = on && he_block_idx() == 0;
    if (!on) return;
    for (int i = 0; i < kMkProfHeader + kMkProfRow; ++i) mk_prof_sh[i] = 0;
    blk = o + kMkProfHeader + (he_u64)he_block_idx() * kMkProfRow;
    blk[kProfCols * kMkProfN] = he_sm_id();
    t = t0 = he_cycles();
    mk_prof_t = t;
    if (lead) ns0 = he_clock_ns();
  }
  HE_INLINE void work(int k) {
    if (!on) return;
    const he_u64 d = he_cycles() - t;
    row()[k] += d;
    if (lead) hdr()[k] += d;
  }
  // this block's column `col` of stage k += cycles since the stage started (work/sync/arrive marks)
  HE_INLINE void mark(int col, int k) {
    if (on) row()[col * kMkProfN + k] += he_cycles() - t;
  }
  HE_INLINE void done(int k) {
    if (!on) return;
    const he_u64 now = he_cycles();
    row()[kProfColTotal * kMkProfN + k] += now - t;
    if (lead) hdr()[kMkProfN + k] += now - t;
    mk_prof_t = now;
    t = now;
  }
  // The launch's sums into the buffer (accumulated over launches; the host clears it: reset_profile). Only a
  // launch that ends normally reports.
  HE_INLINE void finish(int steps) {
    if (!on) return;
    if (lead) {
      hdr()[2 * kMkProfN] = he_clock_ns() - ns0;
      hdr()[2 * kMkProfN + 1] = he_cycles() - t0;
      hdr()[2 * kMkProfN + 2] = (he_u64)steps;
      for (int i = 0; i < kMkProfHeader; ++i) out[i] += hdr()[i];
    }
    for (int i = 0; i < kProfCols * kMkProfN; ++i) blk[i] += row()[i];  // (the row's last word: its SM, set above)
  }
#else
  HE_INLINE explicit MkProf(he_u64*) {}
  HE_INLINE void work(int) {}
  HE_INLINE void mark(int, int) {}
  HE_INLINE void done(int) {}
  HE_INLINE void finish(int) {}
#endif
};

#include "monokernel/tp_exchange.h"

// ---- the matvec stages as op descriptors (ops/matvec.hip) ------------------------------------------------
// `x`: the stage's input — p.x, or with the LL exchange on (p.tp_ll: always at tp > 1, a knob at tp = 1) the
// block's gathered copy in shared memory (monokernel/tp_exchange.h). O-proj / down-proj then push LL words of
// epoch `ep` instead of writing x; rank 0 adds the residual (p.x through attention, p.xb through the MLP).
// The fixed-point addend of the fused MLP's builds, known non-null there, so the prologues that add it carry
// no path without it (and a literal nullptr in the other builds, where they carry none with it).
HE_INLINE he_i64* mk_fx(const MkParams& p) {
  if constexpr (!kMkFusedMlp) return nullptr;
  he_i64* f = p.x_fx;
  __builtin_assume(f != nullptr);
  return f;
}
// The O-proj's fixed-point shares (MK_O_GROUP builds: known non-null there; a literal nullptr elsewhere).
HE_INLINE he_i64* mk_ofx(const MkParams& p) {
  if constexpr (!MK_O_GROUP) return nullptr;
  he_i64* f = p.x_fx;
  __builtin_assume(f != nullptr);
  return f;
}
HE_INLINE HeMvQkv mk_qkv_op(const MkParams& p, const MkLayer& L, int pos, const float* x) {
  // qk_norm models write raw q|k|v (rope = 0); the per-head norm stage rotates and appends.
  return HeMvQkv{x, L.attn_norm, p.eps, p.d, L.wqkv, L.bqkv, p.cos_t, p.sin_t, p.iota + pos,
                 p.qk_norm ? p.qkv : p.q, L.k_cache, L.v_cache, p.max_ctx, p.nh * p.hd, p.nkv * p.hd, p.hd,
                 p.qk_norm ? 0 : 1, mk_fx(p)};
}
#if MK_QFLOW
// The QKV stage itself in MK_QFLOW builds (the other sites only stream its rows): the LL copy of layer epoch `ep`.
HE_INLINE MkQkvFlow mk_qkv_flow_op(const MkParams& p, const MkLayer& L, int pos, const float* x, he_u32 ep) {
  return MkQkvFlow{mk_qkv_op(p, L, pos, x), p.flow_ll, ep};
}
#endif
#if MK_TP
HE_INLINE MkMvOut mk_o_op(const MkParams& p, const MkLayer& L, he_u32 ep) {
  return MkMvOut{{p.att, nullptr, 0.f, p.nh * p.hd, L.wo, p.tp_rank ? nullptr : p.x, p.x, p.d},
                 p.tp_ll, mk_ll_off(p, kMkLlO, p.tp_rank), p.tp_world, ep};
}
HE_INLINE MkMvOut mk_down_op(const MkParams& p, const MkLayer& L, he_u32 ep) {
  const float* res = p.tp_ll ? (p.tp_rank ? nullptr : p.xb) : p.x;
  return MkMvOut{{p.h, nullptr, 0.f, p.ffn, L.w_down, res, p.x, p.d},
                 p.tp_ll, mk_ll_off(p, kMkLlD, p.tp_rank), p.tp_world, ep};
}
#else  // the plain op descriptors: the PTX of the tp = 1 build stays v12's (see kMkTp)
HE_INLINE HeMvPlain mk_o_op(const MkParams& p, const MkLayer& L, he_u32) {
  return HeMvPlain{p.att, nullptr, 0.f, p.nh * p.hd, L.wo, p.x, p.x, p.d, nullptr, mk_fx(p)};
}
#if MK_MLP_PACKED  // the packed rows, with the bf16 ones for the units they cannot hold
HE_INLINE HeMvPlainP mk_down_op(const MkParams& p, const MkLayer& L, he_u32) {
  return he_mvp_plain(HeMvPlain{p.h, nullptr, 0.f, p.ffn, L.w_down, p.x, p.x, p.d, nullptr, nullptr}, L.w_down_p,
                      L.esc_down, L.down_post, L.down_unpost);
}
#else
#if MK_O_GROUP  // the residual rows from the fixed-point buffer the grouped O-proj fills (ops/matvec_group.hip)
HE_INLINE HeMvPlainFxRes mk_down_op(const MkParams& p, const MkLayer& L, he_u32) {
  return HeMvPlainFxRes{{p.h, nullptr, 0.f, p.ffn, L.w_down, nullptr, p.x, p.d, nullptr, mk_ofx(p)}};
}
#else
HE_INLINE HeMvPlain mk_down_op(const MkParams& p, const MkLayer& L, he_u32) {
  return HeMvPlain{p.h, nullptr, 0.f, p.ffn, L.w_down, p.x, p.x, p.d};
}
#endif
#endif
#endif
#if MK_MLP_PACKED
static_assert(!MK_TP && !MK_FUSED_MLP, "packed MLP weights: tp = 1, the two-stage MLP");
HE_INLINE HeMvGateUpP mk_gate_up_op(const MkParams& p, const MkLayer& L, const float* x) {
  return he_mvp_gate_up(HeMvGateUp{x, L.ffn_norm, p.eps, p.d, L.w_gate, L.w_up, p.h, p.ffn, nullptr}, L.w_gate_p,
                        L.w_up_p, L.esc_gu, L.gu_post, L.gu_unpost);
}
#elif MK_O_GROUP  // its input is the fixed-point buffer alone (ops/matvec_group.hip)
HE_INLINE HeMvGateUpFx mk_gate_up_op(const MkParams& p, const MkLayer& L, const float*) {
  return HeMvGateUpFx{{nullptr, L.ffn_norm, p.eps, p.d, L.w_gate, L.w_up, p.h, p.ffn, mk_ofx(p)}};
}
#else
HE_INLINE HeMvGateUp mk_gate_up_op(const MkParams& p, const MkLayer& L, const float* x) {
  return HeMvGateUp{x, L.ffn_norm, p.eps, p.d, L.w_gate, L.w_up, p.h, p.ffn};
}
#endif
// screen (MK_HEAD_SCREEN builds): the int8 rows [V4, d] as the bf16-shaped matrix [V4 / 2, d] the stream reads
// (ops/head_screen.hip); the op's y is unused then.
HE_INLINE HeMvPlain mk_head_op(const MkParams& p, const float* x, bool screen = false) {
  if (MK_HEAD_SCREEN && screen)
    return HeMvPlain{x, p.final_norm, p.eps, p.d, (const he_u16*)p.head_q, nullptr, p.logits, (p.vocab + 3) / 4 * 2,
                     mk_fx(p)};
  return HeMvPlain{x, p.final_norm, p.eps, p.d, p.lm_head, nullptr, p.logits, p.vocab, mk_fx(p)};
}

// ---- attention --------------------------------------------------------------------------------------------
// Combine heads [h0, h0 + n) into att, then count them on the heads-combined counter (release add at device
// scope after he_sync_block, so every thread's att writes happen-before it; O-proj acquires the count).
// HE_ATTN_FRESH_COMBINE: with the newest row, which the splits left out (q and the caches are published by the QKV
// barrier this block passed; staged in smem).
HE_INLINE void mk_combine(const MkParams& p, const MkLayer& L, int h0, int n, int seq, float* smem) {
  const float* pr = p.partial + (he_i64)h0 * p.nsplit * (p.hd + 2);
  float* att = p.att + (he_i64)h0 * p.hd;
  if constexpr (kAttnFreshCombine)
    he_attention_combine_fresh(pr, n, p.nsplit, seq, p.hd, att, h0, MK_ATTN_G, smem,
                               HeAttnFreshPlain{p.q, L.k_cache, L.v_cache, p.max_ctx});
  else
    he_attention_combine(pr, n, p.nsplit, seq, p.hd, att);
  he_sync_block();
  if (he_thread_idx() == 0) he_arrive_add(p.attn_count + p.nkv + 1, (he_u32)n);
}

// The QKV barrier's wait as the split body's kEarly wait (MK_ATTN_EARLY): he_grid_wait on a copy of the block's
// barrier count (the caller advances its own after mk_attention returns), then the QKV stage's profile mark.
struct MkWaitQkv : HeAttnPlainQ {
  HeWaitCtx w;
  he_u32 epoch;
  int nb;
  MkProf* prof;
  HE_INLINE bool operator()() const {
    he_u32 e = epoch;
    const bool ok = he_grid_wait(w, e, nb);
    prof->done(kProfQkv);
    return ok;
  }
};

// One decode step's attention splits of this block (items it = block, block + grid, ...). kEarly (MK_ATTN_EARLY):
// the QKV barrier's arrival has been made but not its wait — `wait` is it. The block's first split requests its
// K/V rows (all but the newest, which this step's QKV appended) before waiting, as the per-op split kernel does
// before its he_pdl_wait: their HBM round trip overlaps the barrier instead of heading the split's chain after it.
// A block without an item just waits. False when a wait failed (the kernel must end).
// (v73 handed fine == 3's combine to the blocks without a split item, two heads each, so that split blocks need
// not wait for he_arrive_last's reply: 3% slower at 1K / 8K on H200 — the combine is on the O-proj's critical
// path, and serialising two of them lengthened it; docs/perf-log.md.)
template <bool kEarly, class Wait>
HE_INLINE bool mk_attention(const MkParams& p, const MkLayer& L, int pos, float* smem, MkProf& prof, const Wait& wait) {
  const int items = p.nkv * p.nsplit;
  if (kEarly && he_block_idx() >= items) return wait();
  for (int it = he_block_idx(); it < items; it += he_grid_dim()) {
    const int kvh = it / p.nsplit, split = it % p.nsplit;
    if (kEarly && it == he_block_idx()) {
      if (!he_attention_split_block<MK_ATTN_G, true>(p.q, L.k_cache, L.v_cache, p.partial, pos + 1, kvh, split,
                                                     p.nsplit, p.chunk, p.nh, p.nkv, p.hd, p.max_ctx, smem, wait))
        return false;
    } else {
      he_attention_split_block<MK_ATTN_G>(p.q, L.k_cache, L.v_cache, p.partial, pos + 1, kvh, split, p.nsplit,
                                          p.chunk, p.nh, p.nkv, p.hd, p.max_ctx, smem);
    }
    if (it == he_block_idx()) prof.work(kProfAttnSplit);  // block 0: stage start -> end of its first split
    // fine == 3: the last of this KV head's nsplit blocks to arrive (acq_rel counter at device scope: it
    // sees every split's partial) combines the whole group, one thread per (head, dim), no grid barrier.
    if constexpr (MK_O_GROUP) {  // the group's O-proj blocks combine it themselves (above)
      he_sync_block();
      if (he_thread_idx() == 0) he_arrive_add(p.attn_count + kvh, 1u);
    } else if (p.fine == 3 && he_arrive_last(p.attn_count + kvh, (he_u32)p.nsplit)) {
      mk_combine(p, L, kvh * MK_ATTN_G, MK_ATTN_G, pos + 1, smem);
    }
    he_sync_block();  // shared memory is reused by the next item
  }
  return true;
}

#if MK_QFLOW
// mk_attention of the MK_QFLOW build: every item polls its words (the split body's kEarly path, with a wait that
// returns at once), and the items of one round go to the grid's last blocks (the first ones stream the QKV stage's
// second units). The grouped O-proj's split counters as above. False when a poll failed (the kernel must end).
// (A function of its own rather than a branch of mk_attention: with the branch there, ptxas allocated the barrier
// build differently — 16 / 44 B of stack / spill loads against 24 / 48; apart, its SASS stays as measured.)
HE_INLINE bool mk_attention_flow(const MkParams& p, const MkLayer& L, int pos, float* smem, MkProf& prof,
                                 const MkFlowWait& wait) {
  const int items = p.nkv * p.nsplit, nb = he_grid_dim();
  const int first = items <= nb ? he_block_idx() - (nb - items) : he_block_idx();
  for (int it = first < 0 ? items : first; it < items; it += nb) {
    const int kvh = it / p.nsplit, split = it % p.nsplit;
    he_attention_split_block<MK_ATTN_G, true>(p.q, L.k_cache, L.v_cache, p.partial, pos + 1, kvh, split, p.nsplit,
                                              p.chunk, p.nh, p.nkv, p.hd, p.max_ctx, smem, wait);
    if (it == first) prof.work(kProfAttnSplit);
    he_sync_block();
    if (he_thread_idx() == 0) he_arrive_add(p.attn_count + kvh, 1u);
    he_sync_block();  // shared memory is reused by the next item
    if (mk_flow_fail) return false;
  }
  return true;
}
#endif

// MK_GU_L2's prefetch (above): rows 2j (gate) and 2j + 1 (up) of unit S + j, j < units, in 32-row groups (one row
// per lane), group g by idle warp g mod (idle warps); MK_GU_L2_GAP > 0: group g not before g x GAP cycles after entry.
HE_INLINE void mk_gu_prefetch(const MkParams& p, const MkLayer& L) {
  const int items = p.nkv * p.nsplit, nb = he_grid_dim();
  if (he_block_idx() < items) return;
  const int stride = nb * he_num_warps();
  const int units = (p.ffn < (MK_GU_L2 + 1) * stride ? p.ffn : (MK_GU_L2 + 1) * stride) - stride;
  const int groups = (2 * units + kWarpSize - 1) / kWarpSize, idle = (nb - items) * he_num_warps();
  const he_u32 bytes = (he_u32)p.d * (he_u32)sizeof(he_u16);
  [[maybe_unused]] const he_u64 t0 = he_cycles();
  for (int g = (he_block_idx() - items) * he_num_warps() + he_warp_id(); g < groups; g += idle) {
    if constexpr (MK_GU_L2_GAP > 0) {
      const he_u64 due = (he_u64)g * (he_u64)MK_GU_L2_GAP;
      while (he_cycles() - t0 < due) {
      }
    }
    const int j = g * kWarpSize + he_lane_id();
    if (j < 2 * units) he_prefetch_l2_bulk(((j & 1) ? L.w_up : L.w_gate) + (he_i64)(stride + (j >> 1)) * p.d, bytes);
  }
}

// MK_START_L2's prefetch (above): s.p is op's first pair, just requested; lane r < kRows asks L2 for row r of the
// pair after it (the unit's next 2B columns, else the warp's next unit; its first B where kBit is in MK_START_L2_HALF).
template <int kBit, class Op, int kRows>
HE_INLINE void mk_start_l2(const Op& op, const HeMvStream<kRows>& s) {
  if constexpr ((MK_START_L2 & kBit) != 0) {
    HeMvPos n = s.p;  // he_mv_advance's step, written out: through it the measured build's SASS changes (+8)
    n.c0 += 2 * kMatvecBatch;
    if (n.c0 >= op.in) {
      n.c0 = 0;
      n.u += he_mv_stride();
    }
    const int lane = he_lane_id();
    if (lane >= kRows || n.u >= op.units()) return;
    const he_u16* rp[kRows];
    op.rows(n.u, rp);
    const he_u16* row = rp[0];
#pragma unroll
    for (int r = 1; r < kRows; ++r) row = lane == r ? rp[r] : row;
    constexpr int kCols = ((MK_START_L2_HALF & kBit) != 0 ? 1 : 2) * kMatvecBatch;
    const int cols = op.in - n.c0 < kCols ? op.in - n.c0 : kCols;
    he_prefetch_l2_bulk(row + n.c0, (he_u32)cols * (he_u32)sizeof(he_u16));
  }
}

// ---- greedy token selection spread over the grid ----------------------------------------------------------
// Every block arg-maxes a contiguous slice of the logits and publishes its candidate; the last block to
// arrive (acq_rel counter at device scope, sync.h) reduces the candidates and leads this token (emission,
// stop checks, embedding). Ties go to the smaller index at every level and NaN never wins (`>`), the same
// rule as he_sample_block's greedy path, so the token is the per-op path's. Costs no extra grid barrier,
// and replaces one block streaming the whole 128K-entry logits vector (≈ 0.5 MB from L2) by ~1 KB per block.
// `cancel` (block 0's thread 0 only): the host's cancel word as block 0 read it at the start of the selection;
// published in state.cancel before block 0's arrival, so the leader (the last arriver, acq_rel) sees it.
// The block's candidate (best, bi) published, then the last block to arrive reduces every block's.
HE_INLINE bool mk_argmax_publish(const MkParams& p, float best, int bi, float* wv, int* wi, int& tok, float& val,
                                 he_u32 cancel) {
  const int nb = he_grid_dim(), t = he_thread_idx(), nt = he_block_dim();
  he_block_argmax(best, bi, wv, wi);
  if (t == 0) {
    if (he_block_idx() == 0) p.state->cancel = (int)cancel;
    p.cand[2 * he_block_idx()] = best;
    p.cand[2 * he_block_idx() + 1] = he_u32_as_f32((he_u32)bi);
  }
  if (!he_arrive_last(p.attn_count + p.nkv, (he_u32)nb)) return false;
  best = he_neg_inf();
  bi = 0x7fffffff;
  for (int b = t; b < nb; b += nt) {  // candidates in block order = index order: `>` keeps the first
    const float v = p.cand[2 * b];
    const int i = (int)he_f32_as_u32(p.cand[2 * b + 1]);
    if (v > best || (v == best && i < bi)) { best = v; bi = i; }
  }
  he_block_argmax(best, bi, wv, wi);
  tok = bi;
  val = best;
  return true;
}

HE_INLINE bool mk_argmax_grid(const MkParams& p, int& tok, float& val, he_u32 cancel) {
  __shared__ float wv[kMaxWarpsPerBlock];
  __shared__ int wi[kMaxWarpsPerBlock];
  const int nb = he_grid_dim(), t = he_thread_idx(), nt = he_block_dim();
  const int per = (p.vocab + nb - 1) / nb, b0 = he_block_idx() * per;
  const int b1 = b0 + per < p.vocab ? b0 + per : p.vocab;
  float best = he_neg_inf();
  int bi = 0x7fffffff;
  for (int i = b0 + t; i < b1; i += nt) {
    const float v = p.logits[i];
    if (v > best) { best = v; bi = i; }
  }
  return mk_argmax_publish(p, best, bi, wv, wi, tok, val, cancel);
}

#if MK_HEAD_SCREEN
// Greedy selection after the screened LM head (ops/head_screen.hip): each warp's candidate rows recomputed
// exactly from the bf16 rows, then as mk_argmax_grid. `smem`: he_mk_smem, still holding the head stage's staged
// input and this block's slots; p.screen_lo is published by the LM head's barrier.
HE_INLINE bool mk_argmax_screen(const MkParams& p, const float* smem, int& tok, float& val, he_u32 cancel) {
  __shared__ float wv[kMaxWarpsPerBlock];
  __shared__ int wi[kMaxWarpsPerBlock];
  float best;
  int bi;
  he_head_screen_pick<kMkF16>(p.lm_head, p.d, p.vocab, p.screen_lo, smem, wv, best, bi);
  return mk_argmax_publish(p, best, bi, wv, wi, tok, val, cancel);
}
#endif

// ---- the kernel ------------------------------------------------------------------------------------------
// MK_MIN_BLOCKS resident blocks per SM (-D from the host, default 1). Memory-level parallelism comes from
// the matvec stream's registers (2 batches x 2 rows x HE_MATVEC_UNROLL 16-byte loads per lane), not from
// more warps: at 2 blocks per SM (128 registers) ptxas spilled the stream to local memory, and a spill
// store of a just-loaded register waits for the load — the pipeline collapsed (see docs/perf-log.md).
#ifndef MK_MIN_BLOCKS
#define MK_MIN_BLOCKS 1
#endif
// The parameter block is the kernel's argument, by value: kernel arguments live in the constant bank, which
// no acquire invalidates, and the compiler reads them with (uniform) constant loads where they are needed
// instead of holding them in registers. Passed by pointer, the block was read through L1, which every grid
// wait's acquire empties, so the kernel reloaded it after each wait (an L2 round trip before a stage's first
// load) and kept copies in registers: ptxas spilled 28 / 80 bytes; by value it spills none and the step is
// 0.9 / 1.4 / 1.7% faster at 1K / 8K / 32K on H200 (docs/perf-log.md v62). The layer table stays in global
// memory: passed by value as well (36 entries, 4,088 bytes of arguments) it was 1.9 / 1.2% slower at 1K /
// 8K, its extra time in the streaming stages' load waits (Nsight Compute; cause not established, that build
// spills 36 / 68 bytes).
extern "C" __global__ void HE_LAUNCH_BOUNDS_MIN(kMkThreads, MK_MIN_BLOCKS) monokernel_decode(const MkParams p) {
  extern __shared__ float he_mk_smem[];  // max(matvec x staging, attention, sampling bitmap), host-sized
  __shared__ float scratch[kMaxWarpsPerBlock];
  __shared__ float slice_sums[kSampleThreads];
  __shared__ int mk_token;
  const HeWaitCtx w{p.bar, p.host + kMkHost_status, p.timeout_ns, p.poll_sleep_ns};
  const int nb = he_grid_dim();
  const bool lead = he_block_idx() == 0;
  he_u32 epoch = 0, attn_done = 0;
#if MK_QFLOW
  he_u32 flow_ep = 0;  // the LL words' epoch: one per layer of the launch
  if (he_thread_idx() == 0) mk_flow_fail = 0;
#endif
  // LL exchange (monokernel/tp_exchange.h; always at tp > 1, HIPENGINE_MK_LL at tp = 1): epochs of its
  // regions, advanced identically on every rank
  const bool tp = kMkTp && p.tp_ll != nullptr;
  he_u32 ep_o = 0, ep_d = 0, ep_c = 0;
  MkState* st = p.state;
  int pos = st->pos, hist_len = st->hist_len, n_out = 0, steps = 0, finish = 0;
  bool sample_now = !(p.mode & kMkModeEmbedFirst);
  // The screened LM head (MK_HEAD_SCREEN builds): greedy steps of a generation at tp = 1; `screened` says the
  // logits of the next selection are the screen's (the launch's first selection may read a prefill's logits).
  const bool screen = MK_HEAD_SCREEN && !tp && p.screen && !(p.temperature > 0.f) && p.rep_pen == 1.f &&
                      !(p.mode & kMkModeOneStep);
#if MK_HEAD_SCREEN
  bool screened = false;
#endif
  // The weight stream (ops/matvec.hip): one per warp for the whole launch. Each matvec stage consumes its
  // part and refills from the next stage's descriptor, so the next stage's first weights are in flight
  // before the barrier that publishes its input (the issue's "weights before the activation").
  HeMvStream<2> s;
  he_mv_begin(mk_qkv_op(p, p.layers[0], pos, p.x), s, mk_o_op(p, p.layers[0], 1u));
  MkProf prof(p.prof);

  // Grid barrier after `stage` (its profile slot), in two halves so that a matvec stage can request the next
  // stage's first weights between this block's arrival (its release) and its wait (kMkDefer). `barrier` is
  // both halves at once; the production build spells it he_grid_barrier, the same code (and the SASS measured).
  auto arrive = [&](int stage) {
    prof.work(stage);
#if MK_PROFILE  // the barrier's phases: the block's slowest warp, the arrival (release fence), the wait
    he_sync_block();
    prof.mark(kProfColSync, stage);
#endif
    he_grid_arrive(w);
    prof.mark(kProfColArrive, stage);
  };
  auto wait = [&](int stage) {
    const bool ok = he_grid_wait(w, epoch, nb);
    prof.done(stage);
    return ok;
  };
  auto barrier = [&](int stage) {
#if MK_PROFILE
    arrive(stage);
    return wait(stage);
#else
    prof.work(stage);
    const bool ok = he_grid_barrier(w, epoch, nb);
    prof.done(stage);
    return ok;
#endif
  };
  // The LL gather that replaces the grid barrier after `stage` (profile: the stage's work, then its total).
  auto gather = [&](int stage, int region, he_u32 ep, float* out) {
    prof.work(stage);
    const bool ok = mk_ll_gather(p, w, region, ep, he_mk_smem, out);
    prof.done(stage);
    return ok;
  };

  if (!sample_now) {
    if (lead) he_embedding_row<kMkF16>(p.embed, st->token, p.embed_vocab, p.d, p.x, mk_fx(p));
    if (!barrier(kProfSelect)) return;
  }
  for (;;) {
    if (sample_now) {
      // ---- token selection, emission and stop checks by one block (the others go on to the barrier) ----
      // Plain greedy: spread over the grid, led by the last block to finish its slice. Anything else
      // (temperature, penalties): he_sample_block on block 0.
      // Block 0 reads the host's cancel word first (relaxed at system scope: it publishes no data) and
      // uses it only after its arg-max slice, so the PCIe round trip overlaps the slice.
      const he_u32 cancel = (lead && he_thread_idx() == 0) ? he_load_relaxed_system(p.host + kMkHost_cancel) : 0u;
      int tok = 0;
      bool leads = lead;
      if (!(p.temperature > 0.f) && p.rep_pen == 1.f) {
        float val = 0.f;
#if MK_HEAD_SCREEN
        if (screened) leads = mk_argmax_screen(p, he_mk_smem, tok, val, cancel);
        else
#endif
          leads = mk_argmax_grid(p, tok, val, cancel);
        // tp > 1: each rank's leader has its slice's pick; all of them agree on the global one (and on cancel)
        // (ep_c advances in every block: the leader is whichever block arrives last, a different one each token)
        ++ep_c;
        if (kMkTp && p.tp_world > 1 && leads && !mk_ll_pick(p, w, ep_c, val, tok, tok)) return;
      } else if (lead) {  // (the host never launches tp > 1 with sampling: it has only a slice of the logits)
        tok = he_sample_block(p.logits, p.vocab, p.history, hist_len, p.temperature, p.top_k, p.top_p, p.min_p,
                              p.rep_pen, p.seed_lo, p.seed_hi, (he_u32)pos, p.z, scratch, slice_sums,
                              (he_u32*)he_mk_smem);
        if (he_thread_idx() == 0) st->cancel = (int)cancel;
      }
      if (leads) {
        if (he_thread_idx() == 0) {
          if (hist_len < p.max_ctx) p.history[hist_len] = tok;
          int stop = 0;
          for (int e = 0; e < p.n_eos; ++e) stop = p.eos[e] == tok ? kMkFinish_stop : stop;
          if (!stop && n_out + 1 >= p.max_tokens) stop = kMkFinish_length;
          if (!stop && pos >= p.max_ctx) stop = kMkFinish_context;
          if (!stop && st->cancel != 0) stop = kMkFinish_cancelled;
          st->stop = stop;
          mk_token = tok;
        }
        he_sync_block();
        he_embedding_row<kMkF16>(p.embed, mk_token, p.embed_vocab, p.d, p.x,  // harmless when stopping
                                 mk_fx(p));
      }
      prof.work(kProfSelect);
      he_grid_arrive(w);
      // Emission after the arrival, by the leader's last warp: its system-scope release (the ring entry is
      // visible to the host before the index that covers it) waits for the PCIe write, off the barrier's path.
      if (leads && he_thread_idx() == he_block_dim() - kWarpSize) {
        if (n_out < p.ring_cap) p.ring[n_out] = mk_token;
        he_store_release_system(p.host + kMkHost_write_idx, (he_u32)(n_out + 1));
      }
      if (!he_grid_wait(w, epoch, nb)) return;
      prof.done(kProfSelect);
      n_out += 1;
      hist_len = hist_len < p.max_ctx ? hist_len + 1 : hist_len;
      finish = st->stop;  // plain load after the barrier's acquire; rewritten only after every block's next barrier
      if (finish) break;
    }
    // ---- one decode step at `pos` ----
    for (int l = 0; l < p.n_layers; ++l) {
      const MkLayer& L = p.layers[l];
      // tp > 1: the input is down(l-1)'s sum over ranks, gathered by every block (block 0 keeps it in p.x,
      // the residual stream the O-proj's rank 0 adds); layer 0's is the embedding in p.x.
      const float* qx = p.x;
      if (tp && l > 0) {
        if (!gather(kProfDown, kMkLlD, ep_d, lead ? p.x : nullptr)) return;
        qx = he_mk_smem;
      }
      // QKV's stream stops at its end; the O-proj's first weights are requested after the attention splits.
#if MK_QFLOW
      ++flow_ep;  // no barrier: the splits poll the LL words of this epoch (above)
      he_mv_finish<kMkF16, kMkDefer>(mk_qkv_flow_op(p, L, pos, qx, flow_ep), s, he_mk_smem, scratch,
                                     mk_o_op(p, L, ep_o + 1));
      prof.work(kProfQkv);
      he_sync_block();  // the split reuses the shared memory the QKV prologue staged x in
      prof.done(kProfQkv);
#else
      he_mv_finish<kMkF16, kMkDefer>(mk_qkv_op(p, L, pos, qx), s, he_mk_smem, scratch, mk_o_op(p, L, ep_o + 1));
      if (kMkAttnEarly) arrive(kProfQkv);  // its wait is in mk_attention, after the splits' first K/V requests
      else if (!barrier(kProfQkv)) return;
#endif
      if (MK_QK_NORM && p.qk_norm) {  // raw q|k|v published: per-head norm + RoPE + append, then one more barrier
        if (kMkAttnEarly && !wait(kProfQkv)) return;
        for (int head = he_block_idx(); head < p.nh + 2 * p.nkv; head += nb)
          he_qk_norm_rope_head(p.qkv, L.q_norm, L.k_norm, p.eps, p.cos_t, p.sin_t, pos, p.q, L.k_cache, L.v_cache,
                               p.max_ctx, p.nh, p.nkv, p.hd, head, scratch);
        if (kMkAttnEarly) arrive(kProfQkv);
        else if (!barrier(kProfQkv)) return;
      }
      if constexpr (MK_GU_L2 > 0 && MK_GU_L2_GAP == 0) mk_gu_prefetch(p, L);  // the burst (session 34's position)
      // The matrix-core split is a call (ops/attention_decode.hip HE_ATTN_MMA_FN): compiler fences around the
      // stage, so the kernel reloads its parameters after it instead of keeping them live (spilled) across it.
      if (kAttnMma) he_compiler_fence();
#if MK_QFLOW
      if (!mk_attention_flow(p, L, pos, he_mk_smem, prof, MkFlowWait{w, p.flow_ll, flow_ep, p.nh * p.hd, p.nkv * p.hd}))
        return;
#else
      if constexpr (kMkAttnEarly) {
        const bool ok = mk_attention<true>(p, L, pos, he_mk_smem, prof, MkWaitQkv{{}, w, epoch, nb, &prof});
        ++epoch;  // the barrier MkWaitQkv waited for
        if (!ok) return;
      } else {
        mk_attention<false>(p, L, pos, he_mk_smem, prof, HeAttnPdlWait{});
      }
#endif
      if (kAttnMma) he_compiler_fence();
      // The O-proj's first weights, requested after this block's splits rather than at the QKV barrier: the
      // splits' K/V loads then do not queue behind 8 MB of them, and they stream during the combine chain
      // instead (+1% at 1K/8K/32K on H200, docs/perf-log.md v24). Nor after the heads wait: the chain ran 0.8 µs
      // per layer faster without them, the O-proj's restart cost 1.9 (−1.1 to −1.3%, session 35).
#if MK_O_GROUP
      const float* gx = p.x;  // gate/up's input, with p.x_fx: both published by the O barrier below
      {  // the O-proj by KV-head group (above): this block's share requested, its group's splits awaited
        using G = HeMvgGeom<kMkOCols>;
        const int rows = G::block_rows(he_block_dim()), per = p.d / rows;
        const bool og = he_block_idx() < p.nkv * per;
        // (a block without a tile fills zeros — rows past the end — so that s's previous values die here, not
        // at its last use: conditionally filled, they stayed live through attention and ptxas spilled 366 B)
        const HeMvGroupO oop{L.wo, p.nh * p.hd, p.d, he_block_idx() / per,
                             og ? (he_block_idx() % per) * rows + he_warp_id() * G::kWarpRows : p.d, p.x_fx,
                             he_block_idx() < per ? p.x : nullptr};
        he_mvg_fill<kMkOCols>(oop, s);
        attn_done += (he_u32)p.nsplit;
        prof.work(kProfAttn);
        if (og && !he_block_wait_geq(w, p.attn_count + oop.g, attn_done)) return;
        prof.done(kProfAttn);
        if (og) {
          const float* pr = p.partial + (he_i64)oop.g * MK_ATTN_G * p.nsplit * (p.hd + 2);
          if constexpr (kAttnFreshCombine) {  // + the newest row, which the splits left out (staged after att)
#if MK_QFLOW
            const MkFlowFresh row{{w, p.flow_ll, flow_ep, p.nh * p.hd, p.nkv * p.hd}};
#else
            const HeAttnFreshPlain row{p.q, L.k_cache, L.v_cache, p.max_ctx};
#endif
            he_attention_combine_fresh(pr, MK_ATTN_G, p.nsplit, pos + 1, p.hd, he_mk_smem, oop.g * MK_ATTN_G, MK_ATTN_G,
                                       he_mk_smem + MK_ATTN_G * p.hd, row);
          } else {
            he_attention_combine(pr, MK_ATTN_G, p.nsplit, pos + 1, p.hd, he_mk_smem);
          }
          he_sync_block();
#if MK_QFLOW
          if (kAttnFreshCombine && mk_flow_fail) return;  // a poll timed out or saw another block's error
#endif
          he_mvg_finish<kMkF16, kMkOCols>(oop, s, he_mk_smem);
        }
        s.p = HeMvPos{he_mv_first(), 0, false};  // the stream goes on with gate/up's first pair
        arrive(kProfO);
        he_mv_fill_next(mk_gate_up_op(p, L, p.x), s);
        if (!wait(kProfO)) return;
        mk_start_l2<1>(mk_gate_up_op(p, L, p.x), s);
      }
#else
      he_mv_fill_next(mk_o_op(p, L, ep_o + 1), s);
      if constexpr (MK_GU_L2 > 0 && MK_GU_L2_GAP > 0) mk_gu_prefetch(p, L);  // paced, after the block's O-proj fill
      if (MK_FINE2 && p.fine == 2) {  // every split's partial is published by the barrier; heads combine in parallel
        if (!barrier(kProfAttn)) return;
        for (int h = he_block_idx(); h < p.nh; h += nb) mk_combine(p, L, h, 1, pos + 1, he_mk_smem);
      }
      // O-proj needs every head of att and nothing else of this stage, so it waits for the heads-combined
      // counter (nh more per layer) instead of a grid barrier: no grid-wide arrival, and blocks with no
      // combine work start as soon as the last combine lands. Safe without a barrier: until the next grid
      // barrier the O-proj reads att and x and writes x, which attention and the combine never touch.
      attn_done += (he_u32)p.nh;
      prof.work(MK_FINE2 && p.fine == 2 ? kProfCombine : kProfAttn);
      if (!he_block_wait_geq(w, p.attn_count + p.nkv + 1, attn_done)) return;
      prof.done(MK_FINE2 && p.fine == 2 ? kProfCombine : kProfAttn);
      ++ep_o;
      he_mv_finish<kMkF16, kMkDeferOD>(mk_o_op(p, L, ep_o), s, he_mk_smem, scratch, mk_gate_up_op(p, L, p.x));
      // gate/up's input: tp > 1, the O-proj's sum over ranks gathered by every block (no grid barrier; block
      // 0 keeps it in p.xb for the down-proj's residual); else x, published by the barrier.
      const float* gx = p.x;
      if (tp) {
        if (!gather(kProfO, kMkLlO, ep_o, lead ? p.xb : nullptr)) return;
        gx = he_mk_smem;
      } else if (kMkDeferOD) {
        arrive(kProfO);
        he_mv_fill_next(mk_gate_up_op(p, L, p.x), s);
        if (!wait(kProfO)) return;
      } else if (!barrier(kProfO)) {
        return;
      }
#endif  // MK_O_GROUP
#if MK_FUSED_MLP
      {  // the MLP in one stage: gate/up units that also apply their row of down (ops/mlp.hip), then the block's sum
        HeMlpWarp mw;
        he_mlp_begin(mw, he_mk_smem, p.d);
        const auto gu = he_mlp_op<kMkF16>(gx, L.ffn_norm, p.eps, p.d, L.w_gate, L.w_up, L.w_down_t, p.ffn, mw);
        if (l + 1 < p.n_layers) he_mv_finish<kMkF16, true>(gu, s, he_mk_smem, scratch, mk_qkv_op(p, p.layers[l + 1], pos, p.x));
        else he_mv_finish<kMkF16, true>(gu, s, he_mk_smem, scratch, mk_head_op(p, p.x, screen));
        he_mlp_reduce(he_mk_smem + he_mlp_part_offset(p.d), p.d, p.x_fx);
        arrive(kProfDown);
        if (l + 1 < p.n_layers) he_mv_fill_next(mk_qkv_op(p, p.layers[l + 1], pos, p.x), s);
        else he_mv_fill_next(mk_head_op(p, p.x, screen), s);
        if (!wait(kProfDown)) return;
      }
#else
      he_mv_finish<kMkF16, kMkDefer>(mk_gate_up_op(p, L, gx), s, he_mk_smem, scratch, mk_down_op(p, L, ep_d + 1));
      arrive(kProfGateUp);
      he_mv_fill_next(mk_down_op(p, L, ep_d + 1), s);
      if (!wait(kProfGateUp)) return;
      mk_start_l2<2>(mk_down_op(p, L, ep_d + 1), s);
      ++ep_d;
      if (l + 1 < p.n_layers)
        he_mv_finish<kMkF16, kMkDeferOD>(mk_down_op(p, L, ep_d), s, he_mk_smem, scratch, mk_qkv_op(p, p.layers[l + 1], pos, p.x));
      else
        he_mv_finish<kMkF16, kMkDeferOD>(mk_down_op(p, L, ep_d), s, he_mk_smem, scratch, mk_head_op(p, p.x, screen));
      if (kMkDeferOD && !tp) {
        arrive(kProfDown);
        if (l + 1 < p.n_layers) he_mv_fill_next(mk_qkv_op(p, p.layers[l + 1], pos, p.x), s);
        else he_mv_fill_next(mk_head_op(p, p.x, screen), s);
        if (!wait(kProfDown)) return;
        if (l + 1 < p.n_layers) mk_start_l2<4>(mk_qkv_op(p, p.layers[l + 1], pos, p.x), s);
      } else if (!tp && !barrier(kProfDown)) {
        return;  // tp > 1: the next stage gathers instead
      }
#endif
    }
    const float* hx = p.x;
    if (tp) {
      if (!gather(kProfDown, kMkLlD, ep_d, nullptr)) return;
      hx = he_mk_smem;
    }
    // The LM head refills with the next step's first QKV weights (held through token selection).
#if MK_HEAD_SCREEN
    if (screen)
      he_head_screen_finish<kMkDefer>(mk_head_op(p, hx, true), s, he_mk_smem, scratch,
                                      mk_qkv_op(p, p.layers[0], pos + 1, p.x),
                                      HeHeadScreen{p.head_meta, p.head_c2, p.vocab, p.screen_lo, nullptr, nullptr});
    else
#endif
      he_mv_finish<kMkF16, kMkDefer>(mk_head_op(p, hx), s, he_mk_smem, scratch, mk_qkv_op(p, p.layers[0], pos + 1, p.x));
#if MK_HEAD_SCREEN
    screened = screen;
#endif
    arrive(kProfHead);
    he_mv_fill_next(mk_qkv_op(p, p.layers[0], pos + 1, p.x), s);
    if (!wait(kProfHead)) return;
    pos += 1;
    steps += 1;
    if (p.mode & kMkModeOneStep) break;
    sample_now = true;
  }
  prof.finish(steps);
  // ---- exit: block 0 publishes the final state; status last (system-scope release) ----
  if (lead && he_thread_idx() == 0) {
    st->pos = pos;
    st->hist_len = hist_len;
    st->n_out = n_out;
    st->steps = steps;
    p.host[kMkHost_n_out] = (he_u32)n_out;
    p.host[kMkHost_pos] = (he_u32)pos;
    p.host[kMkHost_finish] = (he_u32)finish;
    if (he_load_relaxed_system(p.host + kMkHost_status) == kStatusRunning)
      he_store_release_system(p.host + kMkHost_status, kStatusDone);
  }
}
