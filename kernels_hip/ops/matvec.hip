// Matrix-vector products of the decode step: y = W x, W row-major [rows, in] in bf16 or fp16, x fp32,
// fp32 accumulation, with the fused prologue (RMSNorm of x into shared memory) and the fused epilogues of
// a Llama layer:
//   matvec          y = W·x (+ residual)                  O-proj / down-proj (+ residual add), LM head
//   matvec_gate_up  y = silu(Wg·x) * (Wu·x)                the MLP's first half
//   matvec_qkv      [q|k|v] = Wqkv·x + b, RoPE on q and k,  attention's input; k/v appended to the cache
//                   k/v appended to the KV cache
// (prefill.hip holds the multi-token form, built on he_wdot8.)
//
// Why this shape. At batch 1 the step is bound by HBM: every weight byte is read once and used once. Each
// lane issues 16-byte loads (8 weights), a warp sweeps kWarpSize·8 consecutive weights of a row per load,
// and every lane keeps kMatvecUnroll·kRows loads in flight (16 × 16 B × 32 lanes = 8 KiB per warp on NVIDIA) so the
// memory system sees enough outstanding requests (H200: ~4.8 TB/s × ~1 µs latency ≈ 36 KiB per SM).
// Weights are read with the streaming load (no L1 allocation): they are used exactly once per step.
// The grid is sized by the host to a few blocks per SM and blocks stride over row groups, so the fused
// prologue (x staged in shared memory, ≤ 32 KiB) is paid a few hundred times, not once per row.
//
// Requirements (checked by the host wrapper): in % 8 == 0 and 16-byte aligned rows (every model dimension
// here is a multiple of 64), blockDim a multiple of kWarpSize, dynamic shared memory = in * 4 bytes.
#ifndef HE_OPS_MATVEC_HIP
#define HE_OPS_MATVEC_HIP
#include "port.h"
#include "ops/rmsnorm.hip"

// 16-byte loads in flight per lane per row (per batch). A define so benchmarks can compare depths.
#ifndef HE_MATVEC_UNROLL
#define HE_MATVEC_UNROLL 4
#endif
constexpr int kMatvecUnroll = HE_MATVEC_UNROLL;

// Dot product of 8 packed weights with 8 fp32 activations (x 16-byte aligned).
template <bool kF16>
HE_INLINE float he_wdot8(const he_vec16 w, const float* x) {
  const he_u32 q[4] = {w.x, w.y, w.z, w.w};
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float lo = kF16 ? he_f16lo_to_f32(q[j]) : he_bf16lo_to_f32(q[j]);
    const float hi = kF16 ? he_f16hi_to_f32(q[j]) : he_bf16hi_to_f32(q[j]);
    s += lo * x[2 * j] + hi * x[2 * j + 1];
  }
  return s;
}

// A batch is kMatvecUnroll warp-wide sweeps of kWarpSize·8 weights per row, starting at column c0. Loads past
// the row's end are predicated off (zero vectors), so every `in` that is a multiple of 8 works and short rows
// still issue all their loads at once.
constexpr int kMatvecSweep = kWarpSize * 8;
// Launch bound of the matvec kernels: 512 threads leaves 128 registers per thread (NVIDIA), enough for the
// 2 x kMatvecUnroll 16-byte loads in flight without spilling; a 1024 bound capped them at 64 and spilled
// (measured on H200: the LM head fell from 96% to 56% of HBM bandwidth).
constexpr int kMatvecMaxThreads = 512;
constexpr int kMatvecBatch = kMatvecUnroll * kMatvecSweep;

template <int kRows>
HE_INLINE void he_matvec_load(const he_u16* const (&rows)[kRows], int in, int c0, he_vec16 (&w)[kRows][kMatvecUnroll]) {
  const int lane = he_lane_id();
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int u = 0; u < kMatvecUnroll; ++u) {
      const int c = c0 + u * kMatvecSweep + lane * 8;
      w[r][u] = (c < in) ? he_load16_stream(rows[r] + c) : he_vec16{0u, 0u, 0u, 0u};
    }
}

// ---- the row stream --------------------------------------------------------------------------------------
// A warp's work in one matvec is its units u0, u0 + stride, ... (u0 = global warp index, stride = warps in
// the grid); a unit is kRows rows of `in` weights, consumed in batches of kMatvecBatch columns. The batches
// flow through a 2-deep register pipeline that does not drain at unit boundaries: while batch k is reduced
// into the accumulators, batch k + 1 (of this unit or of the warp's next one) is already in flight, and the
// unit's epilogue (warp reduction, RoPE, store) runs with the next unit's loads outstanding.
//
// Two phases, so weights (which never depend on the activation) can be requested before the activation
// exists:  he_mv_begin()  issues the warp's first two batches;  he_mv_finish()  stages the activation in
// shared memory (the fused RMSNorm prologue) and runs the stream. The per-op kernels call them back to
// back; the monokernel calls he_mv_begin() while its block waits at the grid barrier that publishes x, so
// HBM latency hides behind the barrier.
//
// An op is a small struct: the prologue input (x, gamma, eps, in), units(), rows(u, rp) (the kRows row
// pointers of unit u) and epi(u, acc) (lane-0 stores of the unit's kRows sums, identical in every lane).
template <int kRows>
struct HeMvStream {
  he_vec16 cur[kRows][kMatvecUnroll];  // batch at (u, c0): arrived or in flight
  he_vec16 nxt[kRows][kMatvecUnroll];  // batch at (nu, nc0): in flight (none when nu >= units)
  int u, c0, nu, nc0;
};

HE_INLINE int he_mv_stride() { return he_grid_dim() * he_num_warps(); }

template <class Op, int kRows>
HE_INLINE void he_mv_load(const Op& op, int u, int c0, he_vec16 (&w)[kRows][kMatvecUnroll]) {
  const he_u16* rp[kRows];
  op.rows(u, rp);
  he_matvec_load<kRows>(rp, op.in, c0, w);
}

template <int kRows>
HE_INLINE void he_mv_zero(he_vec16 (&w)[kRows][kMatvecUnroll]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int k = 0; k < kMatvecUnroll; ++k) w[r][k] = he_vec16{0u, 0u, 0u, 0u};
}

// (u, c0) -> the position of the warp's next batch.
HE_INLINE void he_mv_step(int& u, int& c0, int in) {
  c0 += kMatvecBatch;
  if (c0 >= in) { c0 = 0; u += he_mv_stride(); }
}

template <class Op, int kRows>
HE_INLINE void he_mv_begin(const Op& op, HeMvStream<kRows>& s) {
  const int units = op.units();
  s.u = he_block_idx() * he_num_warps() + he_warp_id();
  s.c0 = 0;
  s.nu = s.u;
  s.nc0 = 0;
  he_mv_step(s.nu, s.nc0, op.in);
  // Both buffers are always written (zeros past the end) so no value of a previous stage stays live: the
  // monokernel keeps `s` across attention, and stale contents would have to be kept in registers.
  if (s.u < units) he_mv_load(op, s.u, 0, s.cur);
  else he_mv_zero(s.cur);
  if (s.nu < units) he_mv_load(op, s.nu, s.nc0, s.nxt);
  else he_mv_zero(s.nxt);
}

// acc[r] += this lane's part of batch w (columns c0 + k·sweep + lane·8) of the unit's rows.
template <bool kF16, int kRows>
HE_INLINE void he_mv_consume(const he_vec16 (&w)[kRows][kMatvecUnroll], int c0, int in, const float* xs,
                             float (&acc)[kRows]) {
  const int lane = he_lane_id();
#pragma unroll
  for (int k = 0; k < kMatvecUnroll; ++k) {
    const int c = c0 + k * kMatvecSweep + lane * 8;
    if (c < in) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] += he_wdot8<kF16>(w[r][k], xs + c);
    }
  }
}

// The unit ends with this batch: reduce over the warp, store, restart the accumulators.
template <class Op, int kRows>
HE_INLINE void he_mv_unit_end(const Op& op, int u, float (&acc)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = he_warp_sum(acc[r]);
  op.epi(u, acc);
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
}

// The stream's two buffers alternate roles (ping-pong, no register copies): consume A, refill A with the
// batch after B's, consume B, refill B with the batch after A's new one. Batches are consumed in order, so
// every lane's columns are summed in the same order as a plain loop (results do not depend on the pipeline).
template <bool kF16, class Op, int kRows>
HE_INLINE void he_mv_finish(const Op& op, HeMvStream<kRows>& s, float* xs, float* scratch) {
  he_rmsnorm_stage(op.x, op.gamma, op.eps, op.in, xs, scratch);
  const int units = op.units(), in = op.in;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
  int ua = s.u, ca = s.c0, ub = s.nu, cb = s.nc0;  // positions of the batches in A (s.cur) and B (s.nxt)
  while (ua < units) {
    he_mv_consume<kF16>(s.cur, ca, in, xs, acc);
    if (ub != ua) he_mv_unit_end(op, ua, acc);
    ua = ub;
    ca = cb;
    he_mv_step(ua, ca, in);
    if (ua < units) he_mv_load(op, ua, ca, s.cur);
    if (ub >= units) break;
    he_mv_consume<kF16>(s.nxt, cb, in, xs, acc);
    if (ua != ub) he_mv_unit_end(op, ub, acc);
    ub = ua;
    cb = ca;
    he_mv_step(ub, cb, in);
    if (ub < units) he_mv_load(op, ub, cb, s.nxt);
  }
}

HE_INLINE float he_silu(float g) { return g / (1.f + he_exp(-g)); }

// ---- y = W·x (+ residual) ------------------------------------------------------------------------------
// Two rows per unit (more loads in flight per warp). residual may alias y: each y[r] is read then written by
// the same lane. gamma != nullptr fuses RMSNorm(x; gamma, eps) as the prologue. Odd `rows`: the last unit
// computes the last row twice and writes it once.
struct HeMvPlain {
  const float* x;
  const float* gamma;
  float eps;
  int in;
  const he_u16* W;
  const float* residual;
  float* y;
  int n_rows;
  HE_INLINE int units() const { return (n_rows + 1) / 2; }
  HE_INLINE void rows(int u, const he_u16* (&rp)[2]) const {
    const int r0 = 2 * u, r1 = r0 + 1 < n_rows ? r0 + 1 : r0;
    rp[0] = W + (he_i64)r0 * in;
    rp[1] = W + (he_i64)r1 * in;
  }
  HE_INLINE void epi(int u, const float (&acc)[2]) const {
    if (he_lane_id() != 0) return;
    const int r0 = 2 * u, r1 = r0 + 1;
    y[r0] = acc[0] + (residual ? residual[r0] : 0.f);
    if (r1 < n_rows) y[r1] = acc[1] + (residual ? residual[r1] : 0.f);
  }
};

template <bool kF16>
HE_INLINE void he_matvec_body(const he_u16* W, const float* x, const float* gamma, float eps,
                              const float* residual, float* y, int rows, int in, float* xs, float* scratch) {
  const HeMvPlain op{x, gamma, eps, in, W, residual, y, rows};
  HeMvStream<2> s;
  he_mv_begin(op, s);
  he_mv_finish<kF16>(op, s, xs, scratch);
}

HE_KERNEL(kMatvecMaxThreads) matvec(const he_u16* __restrict__ W, const float* x, const float* __restrict__ gamma, float eps,
                       const float* residual, float* y, int rows, int in, int w_f16) {
  extern __shared__ float he_xs[];  // [in]
  __shared__ float scratch[kMaxWarpsPerBlock];
  if (w_f16) he_matvec_body<true>(W, x, gamma, eps, residual, y, rows, in, he_xs, scratch);
  else he_matvec_body<false>(W, x, gamma, eps, residual, y, rows, in, he_xs, scratch);
}

// ---- y = silu(Wg·x) * (Wu·x) ------------------------------------------------------------------------------
// Unit u = gate row u and up row u.
struct HeMvGateUp {
  const float* x;
  const float* gamma;
  float eps;
  int in;
  const he_u16* Wg;
  const he_u16* Wu;
  float* y;
  int n_rows;
  HE_INLINE int units() const { return n_rows; }
  HE_INLINE void rows(int u, const he_u16* (&rp)[2]) const {
    rp[0] = Wg + (he_i64)u * in;
    rp[1] = Wu + (he_i64)u * in;
  }
  HE_INLINE void epi(int u, const float (&acc)[2]) const {
    if (he_lane_id() == 0) y[u] = he_silu(acc[0]) * acc[1];
  }
};

template <bool kF16>
HE_INLINE void he_matvec_gate_up_body(const he_u16* Wg, const he_u16* Wu, const float* x, const float* gamma,
                                      float eps, float* y, int rows, int in, float* xs, float* scratch) {
  const HeMvGateUp op{x, gamma, eps, in, Wg, Wu, y, rows};
  HeMvStream<2> s;
  he_mv_begin(op, s);
  he_mv_finish<kF16>(op, s, xs, scratch);
}

HE_KERNEL(kMatvecMaxThreads) matvec_gate_up(const he_u16* __restrict__ Wg, const he_u16* __restrict__ Wu, const float* x,
                               const float* __restrict__ gamma, float eps, float* y, int rows, int in, int w_f16) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  if (w_f16) he_matvec_gate_up_body<true>(Wg, Wu, x, gamma, eps, y, rows, in, he_xs, scratch);
  else he_matvec_gate_up_body<false>(Wg, Wu, x, gamma, eps, y, rows, in, he_xs, scratch);
}

// ---- QKV + bias + RoPE + KV append -------------------------------------------------------------------------
// Wqkv is wq, wk, wv stacked: [q_dim + 2·kv_dim, in]. RoPE is in rotate-half form, pairing element i of a
// head with element i + hd/2, so one unit is exactly that pair of rows and rotates it in registers:
//   out[i]        = a·cos − b·sin
//   out[i + hd/2] = b·cos + a·sin        (a = row i, b = row i + hd/2; cos/sin at [pos][i])
// cos/sin tables [max_ctx][hd/2] fp32 come from the host (ModelConfig.rope_inv_freq(), float64) so the
// device never recomputes frequencies. The position is read from device memory (*pos_p) so a captured
// graph / the monokernel advances it without relaunch arguments changing.
// KV cache (per layer): k_cache, v_cache bf16 [num_kv_heads][max_ctx][hd].
// rope == 0 (Qwen3 qk_norm path): no RoPE/append here; raw q|k|v (+bias) go to q_out [q_dim + 2·kv_dim]
// and qk_norm_rope finishes the job after the per-head norm.
struct HeMvQkv {
  const float* x;
  const float* gamma;
  float eps;
  int in;
  const he_u16* W;
  const float* bias;
  const float* cos_t;
  const float* sin_t;
  const int* pos_p;
  float* q_out;
  he_bf16* k_cache;
  he_bf16* v_cache;
  int max_ctx, q_dim, kv_dim, hd, rope;
  HE_INLINE int units() const { return (q_dim + 2 * kv_dim) / 2; }
  HE_INLINE void rows(int u, const he_u16* (&rp)[2]) const {
    const int half = hd / 2, ra = (u / half) * hd + u % half;
    rp[0] = W + (he_i64)ra * in;
    rp[1] = W + (he_i64)(ra + half) * in;
  }
  HE_INLINE void epi(int u, const float (&acc)[2]) const {
    if (he_lane_id() != 0) return;
    const int half = hd / 2, i = u % half;
    const int ra = (u / half) * hd + i, rb = ra + half;  // rows in the stacked matrix
    float a = acc[0] + (bias ? bias[ra] : 0.f), b = acc[1] + (bias ? bias[rb] : 0.f);
    if (!rope) { q_out[ra] = a; q_out[rb] = b; return; }
    const int pos = *pos_p;
    if (ra < q_dim + kv_dim) {  // q or k: rotate
      const float c = cos_t[(he_i64)pos * half + i], s = sin_t[(he_i64)pos * half + i];
      const float ra_v = a * c - b * s, rb_v = b * c + a * s;
      a = ra_v; b = rb_v;
    }
    if (ra < q_dim) { q_out[ra] = a; q_out[rb] = b; return; }
    const bool is_k = ra < q_dim + kv_dim;
    const int kvh = (ra - q_dim - (is_k ? 0 : kv_dim)) / hd;
    he_bf16* dst = (is_k ? k_cache : v_cache) + ((he_i64)kvh * max_ctx + pos) * hd;
    dst[i] = he_f32_to_bf16(a);
    dst[i + half] = he_f32_to_bf16(b);
  }
};

template <bool kF16>
HE_INLINE void he_matvec_qkv_body(const HeMvQkv& op, float* xs, float* scratch) {
  HeMvStream<2> s;
  he_mv_begin(op, s);
  he_mv_finish<kF16>(op, s, xs, scratch);
}

HE_KERNEL(kMatvecMaxThreads) matvec_qkv(const he_u16* __restrict__ W, const float* x, const float* __restrict__ gamma, float eps,
                           const float* __restrict__ bias, const float* __restrict__ cos_t,
                           const float* __restrict__ sin_t, const int* __restrict__ pos_p, float* __restrict__ q_out,
                           he_bf16* __restrict__ k_cache, he_bf16* __restrict__ v_cache, int max_ctx, int q_dim,
                           int kv_dim, int hd, int in, int rope, int w_f16) {
  extern __shared__ float he_xs[];
  __shared__ float scratch[kMaxWarpsPerBlock];
  const HeMvQkv op{x, gamma, eps, in, W, bias, cos_t, sin_t, pos_p, q_out, k_cache, v_cache,
                   max_ctx, q_dim, kv_dim, hd, rope};
  if (w_f16) he_matvec_qkv_body<true>(op, he_xs, scratch);
  else he_matvec_qkv_body<false>(op, he_xs, scratch);
}

#endif
