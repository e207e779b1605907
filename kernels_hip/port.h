// kernels_hip/port.h — the ONE place that knows which GPU vendor we compile for.
//
// Every other kernel file includes this header and uses only what it defines: no vendor `#if` anywhere
// else, no literal warp width (32/64), no 0xffffffff shuffle mask.
//
// It is self-contained on purpose: it includes NO vendor header, so the same text compiles under
//   * NVRTC (sm_90)                 : defines __CUDACC_RTC__ (and __CUDA_ARCH__); device builtins
//                                     (threadIdx, __syncthreads, __shfl_xor_sync, ...) are implicit.
//   * nvcc -x cu (compile checks)   : defines __CUDACC__.
//   * hiprtc on AMD                 : defines __HIPCC_RTC__ and __AMDGCN__; supplies threadIdx/__global__.
//   * Debian clang-19 `-x hip --offload-arch=gfx942 --cuda-device-only -nogpuinc -nogpulib`: defines
//     __HIP__/__AMDGCN__/__AMDGCN_WAVEFRONT_SIZE__ but no HIP headers, so this file supplies the attribute
//     macros and reads thread/block indices straight from the amdgcn builtins.
//
// Naming: functions are `he_*`, macros `HE_*`. Indices are always read through he_thread_idx() & co, never
// threadIdx, because the no-header clang build has no threadIdx.
//
// Memory-order vocabulary used below (same meaning as C++11 / the PTX and AMDGPU memory models):
//   relaxed  — atomic, but orders nothing else.
//   acquire  — a load; no later memory access of this thread may be performed before it. Pairs with a
//              release store (or fetch-op) by another thread at a scope covering both threads: once the
//              acquire load observes the released value, everything written before the release is visible.
//   release  — a store / RMW; every earlier memory access of this thread is performed before it.
//   scope    — who the ordering is promised to: "block" (threads of one block), "device" (all blocks of this
//              GPU = CUDA gpu scope = HIP agent scope), "system" (other GPUs over NVLink/xGMI and the host =
//              CUDA sys scope = HIP system scope). Use the narrowest scope that covers the reader.
#pragma once

// ------------------------------------------------------------------------------------------------------
// Vendor detection (the only vendor switch in the project).
// ------------------------------------------------------------------------------------------------------
#if defined(__AMDGCN__) || defined(__HIP_PLATFORM_AMD__)
#define HE_AMD 1
#elif defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(__CUDA_ARCH__)
#define HE_NVIDIA 1
#else
#error "kernels_hip/port.h: unknown GPU compiler (expected NVRTC/nvcc or clang/hiprtc targeting amdgcn)"
#endif

// Fixed-width integer names without <stdint.h> (not available under NVRTC or -nogpuinc).
typedef unsigned char he_u8;
typedef unsigned short he_u16;
typedef short he_i16;
typedef unsigned int he_u32;
typedef int he_i32;
typedef unsigned long long he_u64;
typedef long long he_i64;
static_assert(sizeof(he_u16) == 2 && sizeof(he_u32) == 4 && sizeof(he_u64) == 8, "integer widths");

// ------------------------------------------------------------------------------------------------------
// Attribute macros. HIP headers / NVRTC normally provide these; the header-less clang build does not.
// ------------------------------------------------------------------------------------------------------
#if HE_AMD
#ifndef __global__
#define __global__ __attribute__((global))
#endif
#ifndef __device__
#define __device__ __attribute__((device))
#endif
#ifndef __host__
#define __host__ __attribute__((host))
#endif
#ifndef __shared__
#define __shared__ __attribute__((shared))
#endif
#ifndef __constant__
#define __constant__ __attribute__((constant))
#endif
#define HE_INLINE __device__ inline __attribute__((always_inline))
// amdgpu_flat_work_group_size bounds the block so the register allocator can budget VGPRs for it.
#define HE_LAUNCH_BOUNDS(max_threads) __attribute__((amdgpu_flat_work_group_size(1, max_threads)))
// + at least min_blocks resident per CU: caps VGPRs so they fit (waves per SIMD = blocks · waves / 4 SIMDs).
#define HE_LAUNCH_BOUNDS_MIN(max_threads, min_blocks)                                                    \
  __attribute__((amdgpu_flat_work_group_size(1, max_threads),                                           \
                 amdgpu_waves_per_eu((min_blocks * max_threads + 4 * kWarpSize - 1) / (4 * kWarpSize))))
#else
#define HE_INLINE __device__ __forceinline__
#define HE_LAUNCH_BOUNDS(max_threads) __launch_bounds__(max_threads)
// + at least min_blocks resident per SM: the compiler caps registers so they fit (persistent kernels).
#define HE_LAUNCH_BOUNDS_MIN(max_threads, min_blocks) __launch_bounds__(max_threads, min_blocks)
#endif

// ------------------------------------------------------------------------------------------------------
// Warp (NVIDIA) / wavefront (AMD) width. gfx942 (MI300X) is wave64; RDNA parts compile as wave32 and the
// compiler tells us through __AMDGCN_WAVEFRONT_SIZE__.
// ------------------------------------------------------------------------------------------------------
#if HE_AMD
#if defined(__AMDGCN_WAVEFRONT_SIZE__)
constexpr int kWarpSize = __AMDGCN_WAVEFRONT_SIZE__;
#else
constexpr int kWarpSize = 64;
#endif
#else
constexpr int kWarpSize = 32;
#endif
// A branch that the hot path does not take, for the compiler's block placement: its code goes after the hot
// code instead of between it (instruction fetch: docs/perf-log.md v67, v68). Same values either way. On in the
// monokernel's build (HE_COLD_HINTS=1 from the host: +0.3% at 1K / 8K on H200, v68), off in the per-op
// modules, where it was not measured.
#ifndef HE_COLD_HINTS
#define HE_COLD_HINTS 0
#endif
#define HE_UNLIKELY(cond) (HE_COLD_HINTS ? __builtin_expect(!!(cond), 0) : !!(cond))
constexpr int kMaxBlockThreads = 1024;
constexpr int kMaxWarpsPerBlock = kMaxBlockThreads / kWarpSize;  // sizes block-reduction scratch

// ------------------------------------------------------------------------------------------------------
// Thread / block indices (x, y, z; kernels here use at most 3-D grids and 1-D blocks).
// ------------------------------------------------------------------------------------------------------
#if HE_AMD
HE_INLINE int he_thread_idx() { return (int)__builtin_amdgcn_workitem_id_x(); }
HE_INLINE int he_block_idx() { return (int)__builtin_amdgcn_workgroup_id_x(); }
HE_INLINE int he_block_idx_y() { return (int)__builtin_amdgcn_workgroup_id_y(); }
HE_INLINE int he_block_idx_z() { return (int)__builtin_amdgcn_workgroup_id_z(); }
HE_INLINE int he_block_dim() { return (int)__builtin_amdgcn_workgroup_size_x(); }
// grid_size is in work-items on AMD (HSA dispatch packet); divide by the block size to get blocks.
HE_INLINE int he_grid_dim() { return (int)(__builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x()); }
HE_INLINE int he_grid_dim_y() { return (int)(__builtin_amdgcn_grid_size_y() / __builtin_amdgcn_workgroup_size_y()); }
HE_INLINE int he_grid_dim_z() { return (int)(__builtin_amdgcn_grid_size_z() / __builtin_amdgcn_workgroup_size_z()); }
HE_INLINE int he_lane_id() { return (int)__builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u)); }
#else
HE_INLINE int he_thread_idx() { return (int)threadIdx.x; }
HE_INLINE int he_block_idx() { return (int)blockIdx.x; }
HE_INLINE int he_block_idx_y() { return (int)blockIdx.y; }
HE_INLINE int he_block_idx_z() { return (int)blockIdx.z; }
HE_INLINE int he_block_dim() { return (int)blockDim.x; }
HE_INLINE int he_grid_dim() { return (int)gridDim.x; }
HE_INLINE int he_grid_dim_y() { return (int)gridDim.y; }
HE_INLINE int he_grid_dim_z() { return (int)gridDim.z; }
HE_INLINE int he_lane_id() { return (int)(threadIdx.x & (kWarpSize - 1)); }
#endif
HE_INLINE int he_warp_id() { return he_thread_idx() / kWarpSize; }
HE_INLINE int he_num_warps() { return (he_block_dim() + kWarpSize - 1) / kWarpSize; }

// ------------------------------------------------------------------------------------------------------
// Bit casts and small math. Fast paths are approximate (≈1-2 ulp); every caller accumulates in fp32.
// ------------------------------------------------------------------------------------------------------
#if HE_AMD
HE_INLINE float he_u32_as_f32(he_u32 u) { return __builtin_bit_cast(float, u); }
HE_INLINE he_u32 he_f32_as_u32(float f) { return __builtin_bit_cast(he_u32, f); }
HE_INLINE float he_exp2(float x) { return __builtin_amdgcn_exp2f(x); }  // v_exp_f32
HE_INLINE float he_rsqrt(float x) { return __builtin_amdgcn_rsqf(x); }  // v_rsq_f32
HE_INLINE float he_sqrt(float x) { return __builtin_sqrtf(x); }
HE_INLINE float he_log2(float x) { return __builtin_amdgcn_logf(x); }   // v_log_f32
HE_INLINE float he_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }  // v_fma_f32
#else
HE_INLINE float he_u32_as_f32(he_u32 u) { return __uint_as_float(u); }
HE_INLINE he_u32 he_f32_as_u32(float f) { return __float_as_uint(f); }
HE_INLINE float he_exp2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
HE_INLINE float he_rsqrt(float x) { float y; asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
HE_INLINE float he_sqrt(float x) { float y; asm("sqrt.rn.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
HE_INLINE float he_log2(float x) { float y; asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
HE_INLINE float he_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }  // a·b + c, one rounding
#endif
// Integer dot products of the screened LM head (ops/head_screen.hip): c + a.lo16·b.byte0 + a.hi16·b.byte1
// (lo: bytes 0-1 of b; hi: bytes 2-3), signed — NVIDIA's dp2a. Exact in int32; the caller bounds the sum.
// he_f32_to_i32_rn: round to nearest even (in range by the caller's clamp).
#if HE_AMD
HE_INLINE int he_dp2a_lo(he_u32 a, he_u32 b, int c) {
  return c + (int)(short)(a & 0xffffu) * (int)(signed char)(b & 0xffu) +
         (int)(short)(a >> 16) * (int)(signed char)((b >> 8) & 0xffu);
}
HE_INLINE int he_dp2a_hi(he_u32 a, he_u32 b, int c) {
  return c + (int)(short)(a & 0xffffu) * (int)(signed char)((b >> 16) & 0xffu) +
         (int)(short)(a >> 16) * (int)(signed char)(b >> 24);
}
HE_INLINE int he_f32_to_i32_rn(float x) { return (int)__builtin_rintf(x); }
#else
HE_INLINE int he_dp2a_lo(he_u32 a, he_u32 b, int c) {
  int d;
  asm("dp2a.lo.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
HE_INLINE int he_dp2a_hi(he_u32 a, he_u32 b, int c) {
  int d;
  asm("dp2a.hi.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
HE_INLINE int he_f32_to_i32_rn(float x) { int i; asm("cvt.rni.s32.f32 %0, %1;" : "=r"(i) : "f"(x)); return i; }
#endif
// Byte permute, NVIDIA's prmt / __byte_perm: byte i of the result is byte (sel >> 4i) & 7 of the 8-byte value
// b:a (a holds bytes 0-3, b bytes 4-7). Selectors 0-7 only (no sign-replicate mode: AMD's v_perm_b32 codes 8-15
// differ). v_perm_b32 numbers its first operand's bytes 4-7, hence the swap.
#if HE_AMD
HE_INLINE he_u32 he_prmt(he_u32 a, he_u32 b, he_u32 sel) { return __builtin_amdgcn_perm(b, a, sel); }
#else
HE_INLINE he_u32 he_prmt(he_u32 a, he_u32 b, he_u32 sel) { return __byte_perm(a, b, sel); }
#endif
constexpr float kLog2e = 1.4426950408889634f;
HE_INLINE float he_exp(float x) { return he_exp2(x * kLog2e); }  // e^x = 2^(x·log2 e); -inf -> 0
HE_INLINE float he_fmax(float a, float b) { return a > b ? a : b; }
HE_INLINE float he_fmin(float a, float b) { return a < b ? a : b; }
HE_INLINE float he_neg_inf() { return he_u32_as_f32(0xff800000u); }
HE_INLINE float he_nan() { return he_u32_as_f32(0x7fc00000u); }

// ------------------------------------------------------------------------------------------------------
// 64-bit fixed point with 32 fraction bits: the fused MLP's split-K sums (ops/mlp.hip). Integer addition is
// associative, so partial sums added by any number of blocks in any order give the same bits every run — a
// float atomic add would not. Range ±2^31, resolution 2^-32 (2.3e-10). Conversion rounds to nearest; values
// beyond the range saturate, NaN becomes the most negative value (a NaN'd step shows as garbage, not zeros).
// ------------------------------------------------------------------------------------------------------
constexpr float kFxOne = 4294967296.f;           // 2^32
constexpr float kFxUnit = 2.3283064365386963e-10f;  // 2^-32
#if HE_AMD
HE_INLINE he_i64 he_fx_from_f32(float v) {
  const float s = __builtin_rintf(v * kFxOne);
  return !(s > -9.2e18f) ? (he_i64)(-0x7fffffffffffffffll - 1) : s < 9.2e18f ? (he_i64)s : 0x7fffffffffffffffll;
}
#else
HE_INLINE he_i64 he_fx_from_f32(float v) {  // cvt.rni.s64.f32 saturates; NaN -> the most negative value as on AMD
  return v == v ? __float2ll_rn(v * kFxOne) : (he_i64)(-0x7fffffffffffffffll - 1);
}
#endif
HE_INLINE float he_fx_to_f32(he_i64 v) { return (float)v * kFxUnit; }  // int64 -> fp32 rounds to nearest
// The int64 of two 32-bit words (little-endian: lo first), e.g. half of a 16-byte load of fixed-point values.
HE_INLINE he_i64 he_i64_of_words(he_u32 lo, he_u32 hi) { return (he_i64)(((he_u64)hi << 32) | lo); }

// ------------------------------------------------------------------------------------------------------
// bf16 / fp16 stored as raw 16-bit integers (no vendor bf16 type: the headers differ and NVRTC would need
// cuda_bf16.h). bf16 is the top half of an fp32, so widening is a shift.
// ------------------------------------------------------------------------------------------------------
typedef he_u16 he_bf16;
typedef he_u16 he_f16;

HE_INLINE float he_bf16_to_f32(he_bf16 h) { return he_u32_as_f32(((he_u32)h) << 16); }
// The two bf16 halves of a 32-bit word: element 0 is the low half (little-endian memory order).
HE_INLINE float he_bf16lo_to_f32(he_u32 w) { return he_u32_as_f32(w << 16); }
HE_INLINE float he_bf16hi_to_f32(he_u32 w) { return he_u32_as_f32(w & 0xffff0000u); }

// Round-to-nearest-even; NaN stays a (quiet) NaN instead of rounding into infinity.
HE_INLINE he_bf16 he_f32_to_bf16(float f) {
  he_u32 u = he_f32_as_u32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (he_bf16)((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (he_bf16)(u >> 16);
}

#if HE_AMD
HE_INLINE float he_f16_to_f32(he_f16 h) { return (float)__builtin_bit_cast(_Float16, h); }
HE_INLINE he_f16 he_f32_to_f16(float f) { return __builtin_bit_cast(he_u16, (_Float16)f); }  // RNE
#else
HE_INLINE float he_f16_to_f32(he_f16 h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
HE_INLINE he_f16 he_f32_to_f16(float f) { he_u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
#endif
HE_INLINE float he_f16lo_to_f32(he_u32 w) { return he_f16_to_f32((he_f16)(w & 0xffffu)); }
HE_INLINE float he_f16hi_to_f32(he_u32 w) { return he_f16_to_f32((he_f16)(w >> 16)); }

// KV-cache element: bf16 by default, fp16 when built with -DHE_KV_F16=1 (the host picks it per model: fp16
// for models whose weights are fp16, e.g. GGUF — on the default model a bf16 cache alone moves the logits
// 2.7e-2 from the fp32 reference, an fp16 one 2.7e-3). Storage is 16 bits either way.
#ifndef HE_KV_F16
#define HE_KV_F16 0
#endif
typedef he_u16 he_kv;
HE_INLINE he_kv he_f32_to_kv(float f) { return HE_KV_F16 ? he_f32_to_f16(f) : he_f32_to_bf16(f); }
HE_INLINE float he_kvlo_to_f32(he_u32 w) { return HE_KV_F16 ? he_f16lo_to_f32(w) : he_bf16lo_to_f32(w); }
HE_INLINE float he_kvhi_to_f32(he_u32 w) { return HE_KV_F16 ? he_f16hi_to_f32(w) : he_bf16hi_to_f32(w); }

// ------------------------------------------------------------------------------------------------------
// 16-byte vectors: the unit of every weight load (8 bf16/fp16). Pointers must be 16-byte aligned.
// ------------------------------------------------------------------------------------------------------
struct alignas(16) he_vec16 {
  he_u32 x, y, z, w;
};
static_assert(sizeof(he_vec16) == 16, "he_vec16 must be 16 bytes");

// Plain cached 16-byte load (activations, small tables that other threads re-read).
HE_INLINE he_vec16 he_load16(const void* p) { return *(const he_vec16*)p; }

// Streaming 16-byte load for data read exactly once per step (weights, KV cache): read-only path and no
// L1 allocation on NVIDIA; non-temporal hint on AMD. Only for memory not written during the kernel.
#if HE_AMD
HE_INLINE he_vec16 he_load16_stream(const void* p) {
  const he_vec16* q = (const he_vec16*)p;
  he_vec16 v;
  v.x = __builtin_nontemporal_load(&q->x);
  v.y = __builtin_nontemporal_load(&q->y);
  v.z = __builtin_nontemporal_load(&q->z);
  v.w = __builtin_nontemporal_load(&q->w);
  return v;
}
#else
HE_INLINE he_vec16 he_load16_stream(const void* p) {
  he_vec16 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
#endif

// Prefetch `bytes` (a multiple of 16, p 16-byte aligned) into L2 without waiting and without registers (the
// monokernel's MK_GU_L2 probe: gate/up rows requested by blocks that have no attention split). sm_90: one bulk
// prefetch (cp.async.bulk.prefetch.L2, the copy engine); before sm_90 and on AMD (gfx942 has no such engine):
// nothing.
#if HE_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
HE_INLINE void he_prefetch_l2_bulk(const void* p, he_u32 bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes));
}
#else
HE_INLINE void he_prefetch_l2_bulk(const void*, he_u32) {}
#endif

// Streaming 4-byte load (the packed weights' sign plane, ops/matvec_packed.hip): as he_load16_stream.
#if HE_AMD
HE_INLINE he_u32 he_load4_stream(const void* p) { return __builtin_nontemporal_load((const he_u32*)p); }
#else
HE_INLINE he_u32 he_load4_stream(const void* p) {
  he_u32 v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
#endif

// Streaming 16-byte load for data written earlier in the same kernel and read once (KV-cache rows in the
// monokernel: row `pos` is appended, then read after a grid barrier). The coherent path: no .nc (the
// read-only path may serve a stale line for memory rewritten during the kernel) and no L1 allocation on
// NVIDIA; on AMD the non-temporal load is an ordinary coherent load with a cache hint.
#if HE_AMD
HE_INLINE he_vec16 he_load16_stream_rw(const void* p) { return he_load16_stream(p); }
#else
HE_INLINE he_vec16 he_load16_stream_rw(const void* p) {
  he_vec16 v;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
#endif

// ------------------------------------------------------------------------------------------------------
// Warp shuffles and reductions. All lanes of the warp must be active (kernels here launch whole warps and
// keep every lane in the reduction, masking data instead of threads).
// ------------------------------------------------------------------------------------------------------
#if HE_AMD
// ds_bpermute: lane i reads lane (addr/4) of the operand, across the whole wave.
HE_INLINE float he_shfl_xor(float v, int mask) {
  int src = he_lane_id() ^ mask;
  return he_u32_as_f32((he_u32)__builtin_amdgcn_ds_bpermute(src << 2, (int)he_f32_as_u32(v)));
}
HE_INLINE int he_shfl_xor_int(int v, int mask) {
  return __builtin_amdgcn_ds_bpermute((he_lane_id() ^ mask) << 2, v);
}
HE_INLINE float he_shfl_down(float v, int delta) {
  int src = he_lane_id() + delta;
  if (src >= kWarpSize) src = he_lane_id();  // same contract as CUDA: out-of-range lanes keep their value
  return he_u32_as_f32((he_u32)__builtin_amdgcn_ds_bpermute(src << 2, (int)he_f32_as_u32(v)));
}
HE_INLINE float he_shfl(float v, int src_lane) {
  return he_u32_as_f32((he_u32)__builtin_amdgcn_ds_bpermute(src_lane << 2, (int)he_f32_as_u32(v)));
}
#else
// The full-warp mask exists only here.
#define HE_FULL_WARP_MASK 0xffffffffu
HE_INLINE float he_shfl_xor(float v, int mask) { return __shfl_xor_sync(HE_FULL_WARP_MASK, v, mask); }
HE_INLINE int he_shfl_xor_int(int v, int mask) { return __shfl_xor_sync(HE_FULL_WARP_MASK, v, mask); }
HE_INLINE float he_shfl_down(float v, int delta) { return __shfl_down_sync(HE_FULL_WARP_MASK, v, delta); }
HE_INLINE float he_shfl(float v, int src_lane) { return __shfl_sync(HE_FULL_WARP_MASK, v, src_lane); }
#endif

// Butterfly reductions: every lane ends with the result (no broadcast needed).
HE_INLINE float he_warp_sum(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += he_shfl_xor(v, o);
  return v;
}
HE_INLINE float he_warp_max(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v = he_fmax(v, he_shfl_xor(v, o));
  return v;
}
// Arg-max over (value, index): ties go to the smaller index so the result is deterministic and matches
// numpy's argmax (first occurrence).
HE_INLINE void he_warp_argmax(float& v, int& idx) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    float ov = he_shfl_xor(v, o);
    int oi = he_shfl_xor_int(idx, o);
    if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
  }
}

// ------------------------------------------------------------------------------------------------------
// Block barrier: all threads of the block arrive, and block-scope memory (shared + global) written before
// it is visible to the block after it (acq_rel at block scope; __syncthreads has that meaning on NVIDIA).
// ------------------------------------------------------------------------------------------------------
#if HE_AMD
HE_INLINE void he_sync_block() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}
#else
HE_INLINE void he_sync_block() { __syncthreads(); }
#endif
// Compiler-only fence: no instruction; values loaded from memory before it are not reused after it (the
// compiler reloads them), so it bounds how long such values stay live in registers.
HE_INLINE void he_compiler_fence() { asm volatile("" ::: "memory"); }
// Warp (wave) barrier: every lane of the warp arrives, and shared memory written by one lane before it is
// visible to the warp's other lanes after it (NVIDIA __syncwarp; AMD: a wave barrier between wave-scope fences,
// which keep the compiler from moving LDS accesses across it).
#if HE_AMD
HE_INLINE void he_sync_warp() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
#else
HE_INLINE void he_sync_warp() { __syncwarp(); }
#endif

// Block-wide sum / max: every thread gets the result. `scratch` is __shared__ float[kMaxWarpsPerBlock];
// the trailing barrier makes it safe to call again with the same scratch immediately.
HE_INLINE float he_block_sum(float v, float* scratch) {
  v = he_warp_sum(v);
  if (he_lane_id() == 0) scratch[he_warp_id()] = v;
  he_sync_block();
  float r = 0.f;
  for (int w = 0; w < he_num_warps(); ++w) r += scratch[w];  // same order in every thread: deterministic
  he_sync_block();
  return r;
}
HE_INLINE float he_block_max(float v, float* scratch) {
  v = he_warp_max(v);
  if (he_lane_id() == 0) scratch[he_warp_id()] = v;
  he_sync_block();
  float r = scratch[0];
  for (int w = 1; w < he_num_warps(); ++w) r = he_fmax(r, scratch[w]);
  he_sync_block();
  return r;
}

// ------------------------------------------------------------------------------------------------------
// Matrix cores: one warp (wave) multiplies 16×16×16 tiles, 16-bit inputs, fp32 accumulation.
//   C[m][n] += Σ_k A[m][k] · B[n][k]      (A: 16 rows m × 16 k; B: 16 rows n × 16 k — a weight tile as stored)
// Operands come from shared memory as tiles of 16 rows with a row stride of `ld` elements (ld a multiple of
// 4; 16-byte-aligned rows keep every fragment load aligned). Which (m, n) element a lane's accumulator
// slot i holds is vendor-specific: he_mma_acc_m(i) / he_mma_acc_n(i) say it, so op code never needs the layout.
//   NVIDIA sm_80+: two mma.sync.m16n8k16 (PTX ISA "Matrix Fragments for mma.m16n8k16"): lane = 4·g + t;
//     A words {A[g][2t..], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..]}, B words per n-half h
//     {B[8h+g][2t..], B[8h+g][2t+8..]}, accumulator slot 4h+j at (g + 8·(j/2), 8h + 2t + j%2).
//   AMD CDNA (gfx90a / gfx942, wave64): one v_mfma_f32_16x16x16{bf16_1k,f16} (AMD matrix instruction
//     calculator): lane l holds A[l%16][4·(l/16) .. +3] and B[l%16][4·(l/16) .. +3] (B[n][k] = the
//     instruction's B[k][n]), accumulator slot r at (4·(l/16) + r, l%16).
// he_mma_load_a_rows(t, ld, rows): he_mma_load_a with rows ≥ `rows` read as zeros (their memory is not touched).
// he_mma_load_a_split<kF16>: an A fragment from an fp32 tile, as two 16-bit fragments hi = round(a) and
//   lo = round(a − hi) (hi + lo keeps ~16 bits of mantissa in bf16, ~22 in fp16); rows ≥ `rows` read as
//   zeros (their memory is not touched). The tile may be in shared or global memory (8-byte aligned rows).
// he_pack2<kF16>(a, b): one word of two 16-bit values, a in the low half, round to nearest even.
// Asynchronous copies global -> shared (the multi-stage k-loops): he_cp_async16(dst, src, valid) copies 16
//   bytes (zeros when !valid; src must still be a mapped address), he_cp_async_commit() closes a group,
//   he_cp_async_wait<N>() returns once at most N of this thread's groups are still in flight; a block
//   barrier after it makes every thread's copies visible. NVIDIA sm_80+: cp.async.cg (L2 only, no
//   registers); elsewhere a plain 16-byte load and store, complete at once.
// ------------------------------------------------------------------------------------------------------
// HE_HAS_MMA: this target has the instructions (the host launches matrix-core kernels only there:
// hipengine/gpu/ops.py mma_supported). Elsewhere the functions compile to a trap, so that the modules which
// hold such kernels next to plain ones (ops/prefill.hip) still build for every target.
#if HE_AMD && (defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || \
               defined(__gfx950__))
#define HE_HAS_MMA 1
#elif HE_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define HE_HAS_MMA 1
#else
#define HE_HAS_MMA 0
#endif
#if HE_AMD
HE_INLINE void he_trap() { __builtin_trap(); }
#else
HE_INLINE void he_trap() { __trap(); }
#endif
#if HE_AMD
constexpr int kMmaAcc = 4;    // fp32 accumulator slots per lane for one 16×16 tile
constexpr int kMmaWords = 2;  // 32-bit words per lane per 16×16 operand fragment (4 × 16-bit)
#else
constexpr int kMmaAcc = 8;
constexpr int kMmaWords = 4;  // 8 × 16-bit
#endif
struct HeMmaAcc {
  float v[kMmaAcc];
};
struct HeMmaFrag {
  he_u32 w[kMmaWords];
};
HE_INLINE void he_mma_zero(HeMmaAcc& c) {
#pragma unroll
  for (int i = 0; i < kMmaAcc; ++i) c.v[i] = 0.f;
}
#if HE_AMD
typedef short he_v4i16 __attribute__((ext_vector_type(4)));
typedef _Float16 he_v4f16 __attribute__((ext_vector_type(4)));
typedef float he_v4f32 __attribute__((ext_vector_type(4)));
HE_INLINE HeMmaFrag he_mma_load(const he_u16* t, int ld) {  // A and B: the same lane layout (wave64)
  const int l = he_lane_id();
  const he_u32* p = (const he_u32*)(t + (l & 15) * ld + 4 * (l >> 4));
  HeMmaFrag f;
  f.w[0] = p[0];
  f.w[1] = p[1];
  return f;
}
HE_INLINE HeMmaFrag he_mma_load_a(const he_u16* t, int ld) { return he_mma_load(t, ld); }
HE_INLINE HeMmaFrag he_mma_load_b(const he_u16* t, int ld) { return he_mma_load(t, ld); }
HE_INLINE HeMmaFrag he_mma_load_a_rows(const he_u16* t, int ld, int rows) {
  if ((he_lane_id() & 15) < rows) return he_mma_load(t, ld);
  return HeMmaFrag{{0u, 0u}};
}
template <bool kF16>
HE_INLINE void he_mma(HeMmaAcc& c, const HeMmaFrag& a, const HeMmaFrag& b) {
#if HE_HAS_MMA
  he_v4f32 acc = {c.v[0], c.v[1], c.v[2], c.v[3]};
  if constexpr (kF16) {
    acc = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(he_v4f16, a), __builtin_bit_cast(he_v4f16, b),
                                                acc, 0, 0, 0);
  } else {
    acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(__builtin_bit_cast(he_v4i16, a),
                                                    __builtin_bit_cast(he_v4i16, b), acc, 0, 0, 0);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) c.v[i] = acc[i];
#else
  (void)c, (void)a, (void)b;
  he_trap();
#endif
}
HE_INLINE int he_mma_acc_m(int i) { return 4 * (he_lane_id() >> 4) + i; }
HE_INLINE int he_mma_acc_n(int i) { (void)i; return he_lane_id() & 15; }
template <bool kF16>
HE_INLINE he_u32 he_pack2(float a, float b) {
  return kF16 ? ((he_u32)he_f32_to_f16(a) | ((he_u32)he_f32_to_f16(b) << 16))
              : ((he_u32)he_f32_to_bf16(a) | ((he_u32)he_f32_to_bf16(b) << 16));
}
#else
HE_INLINE HeMmaFrag he_mma_load_a_rows(const he_u16* t, int ld, int rows) {
  const int l = he_lane_id(), g = l >> 2, c = 2 * (l & 3);
  HeMmaFrag f;
  f.w[0] = g < rows ? *(const he_u32*)(t + g * ld + c) : 0u;
  f.w[1] = g + 8 < rows ? *(const he_u32*)(t + (g + 8) * ld + c) : 0u;
  f.w[2] = g < rows ? *(const he_u32*)(t + g * ld + c + 8) : 0u;
  f.w[3] = g + 8 < rows ? *(const he_u32*)(t + (g + 8) * ld + c + 8) : 0u;
  return f;
}
HE_INLINE HeMmaFrag he_mma_load_a(const he_u16* t, int ld) { return he_mma_load_a_rows(t, ld, 16); }
HE_INLINE HeMmaFrag he_mma_load_b(const he_u16* t, int ld) {
  const int l = he_lane_id(), g = l >> 2, c = 2 * (l & 3);
  HeMmaFrag f;
  f.w[0] = *(const he_u32*)(t + g * ld + c);
  f.w[1] = *(const he_u32*)(t + g * ld + c + 8);
  f.w[2] = *(const he_u32*)(t + (g + 8) * ld + c);
  f.w[3] = *(const he_u32*)(t + (g + 8) * ld + c + 8);
  return f;
}
template <bool kF16>
HE_INLINE void he_mma(HeMmaAcc& c, const HeMmaFrag& a, const HeMmaFrag& b) {
#if !HE_HAS_MMA
  (void)c, (void)a, (void)b;
  he_trap();
#else
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (kF16) {
      asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};"
          : "+f"(c.v[4 * h]), "+f"(c.v[4 * h + 1]), "+f"(c.v[4 * h + 2]), "+f"(c.v[4 * h + 3])
          : "r"(a.w[0]), "r"(a.w[1]), "r"(a.w[2]), "r"(a.w[3]), "r"(b.w[2 * h]), "r"(b.w[2 * h + 1]));
    } else {
      asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};"
          : "+f"(c.v[4 * h]), "+f"(c.v[4 * h + 1]), "+f"(c.v[4 * h + 2]), "+f"(c.v[4 * h + 3])
          : "r"(a.w[0]), "r"(a.w[1]), "r"(a.w[2]), "r"(a.w[3]), "r"(b.w[2 * h]), "r"(b.w[2 * h + 1]));
    }
  }
#endif
}
HE_INLINE int he_mma_acc_m(int i) { return (he_lane_id() >> 2) + 8 * ((i >> 1) & 1); }
HE_INLINE int he_mma_acc_n(int i) { return 8 * (i >> 2) + 2 * (he_lane_id() & 3) + (i & 1); }
template <bool kF16>
HE_INLINE he_u32 he_pack2(float a, float b) {  // cvt ... d, x, y puts x in the high half (sm_80+)
#if HE_HAS_MMA
  he_u32 r;
  if constexpr (kF16) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  else asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
#else
  return kF16 ? ((he_u32)he_f32_to_f16(a) | ((he_u32)he_f32_to_f16(b) << 16))
              : ((he_u32)he_f32_to_bf16(a) | ((he_u32)he_f32_to_bf16(b) << 16));
#endif
}
#endif
// hi/lo split of two fp32 values into 16-bit pairs (he_mma_load_a_split).
template <bool kF16>
HE_INLINE void he_split2(float a, float b, he_u32& hi, he_u32& lo) {
  hi = he_pack2<kF16>(a, b);
  const float ha = kF16 ? he_f16lo_to_f32(hi) : he_bf16lo_to_f32(hi);
  const float hb = kF16 ? he_f16hi_to_f32(hi) : he_bf16hi_to_f32(hi);
  lo = he_pack2<kF16>(a - ha, b - hb);
}
struct alignas(8) he_f32x2 {
  float x, y;
};
#if HE_AMD
template <bool kF16>
HE_INLINE void he_mma_load_a_split(const float* t, int ld, HeMmaFrag& hi, HeMmaFrag& lo, int rows = 16) {
  const int l = he_lane_id();
  const he_vec16 v = (l & 15) < rows ? *(const he_vec16*)(t + (l & 15) * ld + 4 * (l >> 4)) : he_vec16{0u, 0u, 0u, 0u};
  he_split2<kF16>(he_u32_as_f32(v.x), he_u32_as_f32(v.y), hi.w[0], lo.w[0]);
  he_split2<kF16>(he_u32_as_f32(v.z), he_u32_as_f32(v.w), hi.w[1], lo.w[1]);
}
#else
template <bool kF16>
HE_INLINE void he_mma_load_a_split(const float* t, int ld, HeMmaFrag& hi, HeMmaFrag& lo, int rows = 16) {
  const int l = he_lane_id(), g = l >> 2, c = 2 * (l & 3);
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // word order of he_mma_load_a: (g, c), (g+8, c), (g, c+8), (g+8, c+8)
    const int r = g + 8 * (q & 1);
    const he_f32x2 v = r < rows ? *(const he_f32x2*)(t + r * ld + c + 8 * (q >> 1)) : he_f32x2{0.f, 0.f};
    he_split2<kF16>(v.x, v.y, hi.w[q], lo.w[q]);
  }
}
#endif

// Attention tiles on the matrix cores (ops/attention_prefill.hip): scores S = Q·Kᵀ (16 queries × 16 keys) and
// output O += P·V (16 queries × 16 head dims), laid out so that the probabilities P become an A fragment
// without leaving registers, and a lane's O slots belong to the queries whose softmax state it holds.
// NVIDIA: the accumulator's own layout (lane 4g + t holds queries g and g + 8). AMD CDNA: the products are
// taken with swapped operands (Sᵀ = K·Qᵀ, Oᵀ = Vᵀ·Pᵀ), so lane l holds one query, l % 16, and its 4 slots
// are 4 consecutive keys — the A fragment's own lane layout.
//   he_att_qk<kF16>(s, q, k): s += Q·Kᵀ (q: an A fragment, 16 queries × 16 dims; k: he_mma_load_b of 16 keys
//     × 16 dims).  he_att_pv<kF16>(o, p, vt): o += P·V (p: he_att_p_frag; vt: he_mma_load_b of Vᵀ, 16 dims ×
//     16 keys).
//   he_att_q(i) / he_att_c(i): the query (0..15) and the key (or head dim) of slot i of this lane.
//   kAttQ: the queries a lane holds (2 / 1); he_att_qi(i): which of them slot i belongs to; he_att_qrow(j):
//     the query of the lane's j-th; he_att_row_max / he_att_row_sum: over the lanes holding the same queries;
//     he_att_leader(): one lane per query.
//   he_att_p_frag<kF16>(s, hi, lo): the tile s (16 queries × 16 keys) as hi/lo 16-bit A fragments.
#if HE_AMD
constexpr int kAttQ = 1;
HE_INLINE int he_att_qi(int) { return 0; }
HE_INLINE int he_att_q(int) { return he_lane_id() & 15; }
HE_INLINE int he_att_c(int i) { return 4 * (he_lane_id() >> 4) + i; }
HE_INLINE int he_att_qrow(int) { return he_lane_id() & 15; }
HE_INLINE bool he_att_leader() { return (he_lane_id() >> 4) == 0; }
HE_INLINE constexpr int he_att_row_lanes() { return 16; }  // lanes l, l ^ 16, l ^ 32, l ^ 48: one query
template <bool kF16>
HE_INLINE void he_att_qk(HeMmaAcc& s, const HeMmaFrag& q, const HeMmaFrag& k) { he_mma<kF16>(s, k, q); }
template <bool kF16>
HE_INLINE void he_att_pv(HeMmaAcc& o, const HeMmaFrag& p, const HeMmaFrag& vt) { he_mma<kF16>(o, vt, p); }
template <bool kF16>
HE_INLINE void he_att_p_frag(const HeMmaAcc& s, HeMmaFrag& hi, HeMmaFrag& lo) {
  he_split2<kF16>(s.v[0], s.v[1], hi.w[0], lo.w[0]);
  he_split2<kF16>(s.v[2], s.v[3], hi.w[1], lo.w[1]);
}
#else
constexpr int kAttQ = 2;
HE_INLINE int he_att_qi(int i) { return (i >> 1) & 1; }
HE_INLINE int he_att_q(int i) { return he_mma_acc_m(i); }
HE_INLINE int he_att_c(int i) { return he_mma_acc_n(i); }
HE_INLINE int he_att_qrow(int j) { return (he_lane_id() >> 2) + 8 * j; }
HE_INLINE bool he_att_leader() { return (he_lane_id() & 3) == 0; }
HE_INLINE constexpr int he_att_row_lanes() { return 1; }  // lanes 4g .. 4g + 3: the same queries
template <bool kF16>
HE_INLINE void he_att_qk(HeMmaAcc& s, const HeMmaFrag& q, const HeMmaFrag& k) { he_mma<kF16>(s, q, k); }
template <bool kF16>
HE_INLINE void he_att_pv(HeMmaAcc& o, const HeMmaFrag& p, const HeMmaFrag& vt) { he_mma<kF16>(o, p, vt); }
template <bool kF16>
HE_INLINE void he_att_p_frag(const HeMmaAcc& s, HeMmaFrag& hi, HeMmaFrag& lo) {
#pragma unroll
  for (int q = 0; q < 4; ++q) he_split2<kF16>(s.v[2 * q], s.v[2 * q + 1], hi.w[q], lo.w[q]);  // slots 2q, 2q+1
}
#endif
HE_INLINE float he_att_row_max(float v) {  // over the four lanes of a query: xor he_att_row_lanes(), then twice it
  v = he_fmax(v, he_shfl_xor(v, he_att_row_lanes()));
  return he_fmax(v, he_shfl_xor(v, 2 * he_att_row_lanes()));
}
HE_INLINE float he_att_row_sum(float v) {
  v += he_shfl_xor(v, he_att_row_lanes());
  return v + he_shfl_xor(v, 2 * he_att_row_lanes());
}

// HeSmem: a shared-memory buffer as a generic pointer and (NVIDIA) its 32-bit shared-window address, taken once
// per kernel (he_smem(p)) so that copies into it at byte offsets (he_cp_async16_at) need no per-copy address
// conversion (on sm_90 each cvta.to.shared reads two special registers).
struct HeSmem {
  char* p;
  he_u32 s;
};
#if HE_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
HE_INLINE HeSmem he_smem(char* p) {
  he_u32 s;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(s) : "l"(p));
  return HeSmem{p, s};
}
HE_INLINE void he_cp_async16_at(const HeSmem& b, int off, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(b.s + off), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
HE_INLINE void he_cp_async16(void* dst, const void* src, bool valid) {
  he_cp_async16_at(he_smem((char*)dst), 0, src, valid);
}
HE_INLINE void he_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
HE_INLINE void he_cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
constexpr bool kHasCpAsync = true;  // the copies are in flight without registers
#else
constexpr bool kHasCpAsync = false;  // the fallback below: a load and a store, complete at once
HE_INLINE HeSmem he_smem(char* p) { return HeSmem{p, 0u}; }
HE_INLINE void he_cp_async16(void* dst, const void* src, bool valid) {
  *(he_vec16*)dst = valid ? *(const he_vec16*)src : he_vec16{0u, 0u, 0u, 0u};
}
HE_INLINE void he_cp_async16_at(const HeSmem& b, int off, const void* src, bool valid) {
  he_cp_async16(b.p + off, src, valid);
}
HE_INLINE void he_cp_async_commit() {}
template <int N>
HE_INLINE void he_cp_async_wait() {}
#endif

// ------------------------------------------------------------------------------------------------------
// Bulk copies global -> shared memory completing on a shared-memory barrier (`hipengine bench probe`: do they
// hold back the SM's later polls and releases as its loads do?). kHasBulkCopy says whether the target has the
// engine: NVIDIA sm_90+ has the TMA (cp.async.bulk: one instruction per contiguous run, issued by one lane,
// no registers; the mbarrier's phase completes when its arrivals have arrived and the announced bytes have
// landed). AMD gfx942 has no such engine: kHasBulkCopy is false and callers must not reach these (they trap).
//   he_mbar_init(bar, n)               phase 0 open, n arrivals per phase (one thread; then he_mbar_init_fence
//                                      and a block barrier before anyone uses it)
//   he_mbar_expect_arrive(bar, bytes)  one arrival, and `bytes` more to land before the phase completes
//   he_bulk_load(dst, src, bytes, bar) copy `bytes` (a multiple of 16; both addresses 16-byte aligned)
//   he_mbar_try_wait(bar, parity)      true once the phase of that parity has completed (the bytes are then
//                                      visible to the waiting thread)
//   he_fence_proxy_async()             this thread's earlier shared-memory accesses before its later bulk
//                                      copies (a slot read by the warp, then refilled by the copy engine)
// ------------------------------------------------------------------------------------------------------
#if HE_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr bool kHasBulkCopy = true;
HE_INLINE he_u32 he_smem_addr(const void* p) { return (he_u32)__cvta_generic_to_shared(p); }
HE_INLINE void he_mbar_init(he_u64* bar, he_u32 n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(he_smem_addr(bar)), "r"(n) : "memory");
}
HE_INLINE void he_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
HE_INLINE void he_mbar_expect_arrive(he_u64* bar, he_u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(he_smem_addr(bar)), "r"(bytes)
               : "memory");
}
HE_INLINE void he_bulk_load(void* dst, const void* src, he_u32 bytes, he_u64* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(he_smem_addr(dst)), "l"(src), "r"(bytes), "r"(he_smem_addr(bar)) : "memory");
}
HE_INLINE bool he_mbar_try_wait(he_u64* bar, he_u32 parity) {
  he_u32 ok;
  asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
               : "=r"(ok) : "r"(he_smem_addr(bar)), "r"(parity) : "memory");
  return ok != 0;
}
HE_INLINE void he_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#else
constexpr bool kHasBulkCopy = false;
HE_INLINE void he_mbar_init(he_u64*, he_u32) { __builtin_trap(); }
HE_INLINE void he_mbar_init_fence() { __builtin_trap(); }
HE_INLINE void he_mbar_expect_arrive(he_u64*, he_u32) { __builtin_trap(); }
HE_INLINE void he_bulk_load(void*, const void*, he_u32, he_u64*) { __builtin_trap(); }
HE_INLINE bool he_mbar_try_wait(he_u64*, he_u32) { __builtin_trap(); return true; }
HE_INLINE void he_fence_proxy_async() { __builtin_trap(); }
#endif

// ------------------------------------------------------------------------------------------------------
// Fences. A fence orders this thread's earlier accesses before its later ones, as seen at the scope:
//   he_fence_acq_rel_device(): e.g. "write data, fence, relaxed-store flag" publishes data to other blocks.
//   he_fence_acq_rel_system(): same, seen by peer GPUs and the host (NVLink / xGMI / PCIe-mapped memory).
//   he_fence_seq_cst_device(): total order with other seq_cst fences (needed by some barrier protocols).
// ------------------------------------------------------------------------------------------------------
#if HE_AMD
HE_INLINE void he_fence_acq_rel_block() { __builtin_amdgcn_fence(__ATOMIC_ACQ_REL, "workgroup"); }
HE_INLINE void he_fence_acq_rel_device() { __builtin_amdgcn_fence(__ATOMIC_ACQ_REL, "agent"); }
HE_INLINE void he_fence_acq_rel_system() { __builtin_amdgcn_fence(__ATOMIC_ACQ_REL, ""); }  // "" = system
HE_INLINE void he_fence_seq_cst_device() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent"); }
HE_INLINE void he_fence_seq_cst_system() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, ""); }
#else
HE_INLINE void he_fence_acq_rel_block() { asm volatile("fence.acq_rel.cta;" ::: "memory"); }
HE_INLINE void he_fence_acq_rel_device() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
HE_INLINE void he_fence_acq_rel_system() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
HE_INLINE void he_fence_seq_cst_device() { asm volatile("fence.sc.gpu;" ::: "memory"); }
HE_INLINE void he_fence_seq_cst_system() { asm volatile("fence.sc.sys;" ::: "memory"); }
#endif

// ------------------------------------------------------------------------------------------------------
// Scoped atomics on 32-bit flags/counters (naturally aligned, in global memory, peer-mapped memory or
// host-mapped memory). Names are he_<op>_<order>_<scope>.
//   load_acquire   : see "acquire" above — the reader side of a flag.
//   store_release  : see "release" above — the writer side of a flag (data first, then the flag).
//   load_relaxed   : polling without ordering; follow a successful poll with an acquire fence or load.
//   fetch_add_*    : returns the old value. acq_rel = both (arrival counters of barriers); relaxed = pure
//                    counting (statistics, work queues whose items carry their own flags).
//   red_add_release: add without reading the old value, release only (an arrival nobody waits on here: the
//                    thread goes on without the round trip; its later acquire loads order the rest).
// ------------------------------------------------------------------------------------------------------
#if HE_AMD
#define HE_AMD_SCOPE_device __HIP_MEMORY_SCOPE_AGENT
#define HE_AMD_SCOPE_system __HIP_MEMORY_SCOPE_SYSTEM
#define HE_DEFINE_ATOMICS(scope)                                                                        \
  HE_INLINE he_u32 he_load_acquire_##scope(const he_u32* p) {                                          \
    return __hip_atomic_load(p, __ATOMIC_ACQUIRE, HE_AMD_SCOPE_##scope);                                \
  }                                                                                                     \
  HE_INLINE he_u32 he_load_relaxed_##scope(const he_u32* p) {                                          \
    return __hip_atomic_load(p, __ATOMIC_RELAXED, HE_AMD_SCOPE_##scope);                                \
  }                                                                                                     \
  HE_INLINE void he_store_release_##scope(he_u32* p, he_u32 v) {                                       \
    __hip_atomic_store(p, v, __ATOMIC_RELEASE, HE_AMD_SCOPE_##scope);                                   \
  }                                                                                                     \
  HE_INLINE void he_store_relaxed_##scope(he_u32* p, he_u32 v) {                                       \
    __hip_atomic_store(p, v, __ATOMIC_RELAXED, HE_AMD_SCOPE_##scope);                                   \
  }                                                                                                     \
  HE_INLINE he_u32 he_fetch_add_acq_rel_##scope(he_u32* p, he_u32 v) {                                 \
    return __hip_atomic_fetch_add(p, v, __ATOMIC_ACQ_REL, HE_AMD_SCOPE_##scope);                        \
  }                                                                                                     \
  HE_INLINE he_u32 he_fetch_add_relaxed_##scope(he_u32* p, he_u32 v) {                                 \
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, HE_AMD_SCOPE_##scope);                        \
  }                                                                                                     \
  HE_INLINE void he_red_add_release_##scope(he_u32* p, he_u32 v) {                                     \
    (void)__hip_atomic_fetch_add(p, v, __ATOMIC_RELEASE, HE_AMD_SCOPE_##scope);                         \
  }                                                                                                     \
  HE_INLINE float he_atomic_add_f32_relaxed_##scope(float* p, float v) {                               \
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, HE_AMD_SCOPE_##scope);                        \
  }
#else
// PTX scope names: gpu = device, sys = system. Generic addressing so host-mapped pointers work too.
#define HE_PTX_SCOPE_device "gpu"
#define HE_PTX_SCOPE_system "sys"
#define HE_DEFINE_ATOMICS(scope)                                                                        \
  HE_INLINE he_u32 he_load_acquire_##scope(const he_u32* p) {                                          \
    he_u32 v;                                                                                           \
    asm volatile("ld.acquire." HE_PTX_SCOPE_##scope ".u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");    \
    return v;                                                                                           \
  }                                                                                                     \
  HE_INLINE he_u32 he_load_relaxed_##scope(const he_u32* p) {                                          \
    he_u32 v;                                                                                           \
    asm volatile("ld.relaxed." HE_PTX_SCOPE_##scope ".u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");    \
    return v;                                                                                           \
  }                                                                                                     \
  HE_INLINE void he_store_release_##scope(he_u32* p, he_u32 v) {                                       \
    asm volatile("st.release." HE_PTX_SCOPE_##scope ".u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");      \
  }                                                                                                     \
  HE_INLINE void he_store_relaxed_##scope(he_u32* p, he_u32 v) {                                       \
    asm volatile("st.relaxed." HE_PTX_SCOPE_##scope ".u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");      \
  }                                                                                                     \
  HE_INLINE he_u32 he_fetch_add_acq_rel_##scope(he_u32* p, he_u32 v) {                                 \
    he_u32 old;                                                                                         \
    asm volatile("atom.acq_rel." HE_PTX_SCOPE_##scope ".add.u32 %0, [%1], %2;"                          \
                 : "=r"(old) : "l"(p), "r"(v) : "memory");                                              \
    return old;                                                                                         \
  }                                                                                                     \
  HE_INLINE he_u32 he_fetch_add_relaxed_##scope(he_u32* p, he_u32 v) {                                 \
    he_u32 old;                                                                                         \
    asm volatile("atom.relaxed." HE_PTX_SCOPE_##scope ".add.u32 %0, [%1], %2;"                          \
                 : "=r"(old) : "l"(p), "r"(v) : "memory");                                              \
    return old;                                                                                         \
  }                                                                                                     \
  HE_INLINE void he_red_add_release_##scope(he_u32* p, he_u32 v) {                                     \
    asm volatile("red.release." HE_PTX_SCOPE_##scope ".global.add.u32 [%0], %1;" ::"l"(p), "r"(v)        \
                 : "memory");                                                                           \
  }                                                                                                     \
  HE_INLINE float he_atomic_add_f32_relaxed_##scope(float* p, float v) {                               \
    float old;                                                                                          \
    asm volatile("atom.relaxed." HE_PTX_SCOPE_##scope ".add.f32 %0, [%1], %2;"                          \
                 : "=f"(old) : "l"(p), "f"(v) : "memory");                                              \
    return old;                                                                                         \
  }
#endif
HE_DEFINE_ATOMICS(device)
HE_DEFINE_ATOMICS(system)
#undef HE_DEFINE_ATOMICS

// Relaxed 64-bit add without the old value (the fused MLP's fixed-point partial sums, ops/mlp.hip): ordered for
// readers by the grid barrier / kernel boundary that follows, like a plain store.
#if HE_AMD
HE_INLINE void he_red_add_i64_relaxed_device(he_i64* p, he_i64 v) {
  (void)__hip_atomic_fetch_add((unsigned long long*)p, (unsigned long long)v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
#else
HE_INLINE void he_red_add_i64_relaxed_device(he_i64* p, he_i64 v) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
#endif

// Relaxed atomic OR on a block-shared word (bitmaps built cooperatively inside one block; the following
// he_sync_block() orders them for the readers).
#if HE_AMD
HE_INLINE void he_atomic_or_relaxed_block(he_u32* p, he_u32 v) {
  __hip_atomic_fetch_or(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_WORKGROUP);
}
#else
HE_INLINE void he_atomic_or_relaxed_block(he_u32* p, he_u32 v) { atomicOr(p, v); }
#endif

// ------------------------------------------------------------------------------------------------------
// Waiting. he_sleep backs a polling loop off so spinning threads leave issue slots and memory bandwidth to
// the threads doing work. The argument is a hint in nanoseconds; AMD's s_sleep takes an immediate (units of
// 64 clocks), so it sleeps a fixed short time (~0.1 µs at 2.1 GHz) per call whatever the hint.
// he_clock_ns: a monotonically increasing wall clock for timeouts (not for fine profiling).
//   NVIDIA: %globaltimer (ns, updated every ~µs).  AMD: s_memrealtime, a constant 100 MHz counter.
// he_cycles: this SM's / CU's cycle counter, for stage profiles inside one block (calibrated against
//   he_clock_ns over whole steps by the host).
// he_sm_id: which SM / CU this block runs on, for profiles only (tells a slow SM from a slow block).
//   NVIDIA: %smid. AMD: XCC_ID (hwreg 20, gfx940+) and HW_ID's se/sh/cu fields (hwreg 4), packed
//   as xcc << 8 | se << 5 | sh << 4 | cu — unique per CU, not dense.
// ------------------------------------------------------------------------------------------------------
#if HE_AMD
HE_INLINE void he_sleep(unsigned ns) { (void)ns; __builtin_amdgcn_s_sleep(2); }
HE_INLINE he_u64 he_clock_ns() { return __builtin_amdgcn_s_memrealtime() * 10ull; }
HE_INLINE he_u64 he_cycles() { return __builtin_readcyclecounter(); }
HE_INLINE he_u32 he_sm_id() {
  // s_getreg simm16 = (bits - 1) << 11 | offset << 6 | register id
  const he_u32 hw = __builtin_amdgcn_s_getreg((31 << 11) | 4);    // HW_ID: cu [11:8], sh [12], se [15:13]
  const he_u32 xcc = __builtin_amdgcn_s_getreg((3 << 11) | 20);   // XCC_ID [3:0]
  return (xcc << 8) | (((hw >> 13) & 7u) << 5) | (((hw >> 12) & 1u) << 4) | ((hw >> 8) & 15u);
}
#else
HE_INLINE void he_sleep(unsigned ns) { __nanosleep(ns); }
HE_INLINE he_u64 he_clock_ns() {
  he_u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
HE_INLINE he_u64 he_cycles() { return clock64(); }
HE_INLINE he_u32 he_sm_id() {
  he_u32 id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
#endif

// Portable extern "C" kernel declaration; standalone kernels are `HE_KERNEL(256) name(args) {...}`.
#define HE_KERNEL(max_threads) extern "C" __global__ void HE_LAUNCH_BOUNDS(max_threads)
// + at least min_blocks blocks resident per SM / CU (registers capped to fit: HE_LAUNCH_BOUNDS_MIN)
#define HE_KERNEL_MIN(max_threads, min_blocks) \
  extern "C" __global__ void HE_LAUNCH_BOUNDS_MIN(max_threads, min_blocks)

// ------------------------------------------------------------------------------------------------------
// Launch overlap between consecutive kernels of one stream (the per-op path's decode step).
// NVIDIA sm_90+: programmatic dependent launch. A kernel launched with the host's `pdl` flag
// (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) may start while the kernel before it in the stream
// is still running, once every block of that one has called he_pdl_trigger() (or exited).
//   he_pdl_trigger(): this block lets the next kernel start launching (it orders and publishes nothing).
//   he_pdl_wait():    returns once the previous kernel has completed and its memory writes are visible —
//                     the same guarantee as plain stream order. Returns at once when the kernel was not
//                     launched with the flag. Before it a kernel may only READ data no kernel of the step
//                     writes (weights, tables); every other load and every store comes after it.
// Each kernel of kernels_hip/ops calls he_pdl_trigger() first (the decode step's matvecs, attention split and
// combine: he_pdl_trigger_top / _late below) and he_pdl_wait() before its first access to step data
// (tests/test_port_rules.py checks that every kernel there has the wait). AMD has no such launch:
// kernels run in stream order and both calls are empty.
// ------------------------------------------------------------------------------------------------------
// he_ld_step(p): a word of step data (a position, a token, a length) read after he_pdl_wait(). A plain `*p`
// is not enough: when every store of a kernel goes through __restrict__ pointers, NVRTC proves any other
// pointer read-only, loads it through the non-coherent path (ld.global.nc) — which assumes memory that does
// not change while the kernel runs — and issued such loads BEFORE griddepcontrol.wait (the attention split's
// and combine's position, qk_norm_rope's, the sampler's history length and step: docs/perf-log.md v41),
// i.e. possibly before the kernel that writes them had finished. An asm volatile load is never moved across
// the wait's asm volatile. AMD runs kernels in stream order: a plain load.
#if HE_AMD
HE_INLINE void he_pdl_trigger() {}
HE_INLINE void he_pdl_wait() {}
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
HE_INLINE void he_pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
HE_INLINE void he_pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
#else
HE_INLINE void he_pdl_trigger() {}
HE_INLINE void he_pdl_wait() {}
#endif
// Where a per-op kernel lets the next one launch (hipengine/gpu/ops.py Ops._late, per decode-step role; a
// separate module per place):
//   HE_PDL_LATE=0  at its top: the next kernel's blocks become resident, and request their weights, as early
//                  as slots allow;
//   HE_PDL_LATE=1  right after its own he_pdl_wait(), so the next kernel launches only once the kernel before
//                  this one has completed: the chain of resident kernels runs one kernel deep instead of
//                  several (docs/perf-log.md v48);
//   HE_PDL_LATE=2  (matvec.hip only) once the block has staged its activation (the prologue's barrier): the
//                  down-projection's, so the next QKV launches a little later (docs/perf-log.md v50–v52).
#ifndef HE_PDL_LATE
#define HE_PDL_LATE 0
#endif
static_assert(HE_PDL_LATE >= 0 && HE_PDL_LATE <= 2, "HE_PDL_LATE: 0 (top), 1 (after the wait), 2 (staged)");
HE_INLINE void he_pdl_trigger_top() {
  if (HE_PDL_LATE == 0) he_pdl_trigger();
}
HE_INLINE void he_pdl_trigger_late() {
  if (HE_PDL_LATE == 1) he_pdl_trigger();
}
HE_INLINE void he_pdl_trigger_staged() {
  if (HE_PDL_LATE == 2) he_pdl_trigger();
}
#if HE_AMD
HE_INLINE int he_ld_step(const int* p) { return *p; }
#else
HE_INLINE int he_ld_step(const int* p) {
  int v;
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
#endif
