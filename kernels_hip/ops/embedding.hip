// Embedding lookup: out[t, :] = float(table[tokens[t], :]), table bf16 or fp16 [vocab, hidden].
// Token ids come from device memory so the sampler's output feeds the next step without a host round trip.
// Ids outside [0, vocab) produce a zero row instead of reading out of bounds (the host validates prompts;
// this only keeps a corrupted id from faulting the whole context).
#ifndef HE_OPS_EMBEDDING_HIP
#define HE_OPS_EMBEDDING_HIP
#include "port.h"

// fx (optional): the residual stream's fixed-point addend (ops/mlp.hip), cleared with the new row.
template <bool kF16>
HE_INLINE void he_embedding_row(const he_u16* __restrict__ table, int token, int vocab, int hidden,
                                float* __restrict__ out, he_i64* fx = nullptr) {
  const bool ok = token >= 0 && token < vocab;
  const he_u16* row = table + (he_i64)(ok ? token : 0) * hidden;
  for (int i = he_thread_idx(); i < hidden; i += he_block_dim()) {
    const float v = kF16 ? he_f16_to_f32(row[i]) : he_bf16_to_f32(row[i]);
    out[i] = ok ? v : 0.f;
    if (fx != nullptr) fx[i] = 0;
  }
}

// grid.x = number of tokens. fx: as he_embedding_row's (one token only).
HE_KERNEL(1024) embedding(const he_u16* __restrict__ table, const int* tokens, int vocab, int hidden,
                          float* __restrict__ out, int w_f16, he_i64* fx) {
  he_pdl_trigger();
  he_pdl_wait();  // port.h: everything below reads or writes step data
  const int t = he_block_idx();
  if (w_f16) he_embedding_row<true>(table, tokens[t], vocab, hidden, out + (he_i64)t * hidden, fx);
  else he_embedding_row<false>(table, tokens[t], vocab, hidden, out + (he_i64)t * hidden, fx);
}
#endif
