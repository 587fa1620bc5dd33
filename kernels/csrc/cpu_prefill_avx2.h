// The AVX2 + FMA fp32 path of the prompt attention (`cpu_prefill_attention_avx2.cpp`), called by the op in
// `cpu_prefill_attention.cpp` on CPUs without AVX-512F, after that op's argument checks.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace structgen_cpu {

// Whether this build and CPU run the AVX2 path (AVX2, FMA and F16C; false on other architectures).
bool prefill_attention_avx2_usable();

// query / out fp32 [q_len, heads, D] with contiguous rows, D in {32, 64, 128}; the caches fp32 contiguous
// [blocks, block_size, kv_heads, D]; `table` the sequence's blocks, checked to cover `context_len` tokens.
void prefill_attention_avx2(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const int32_t* table, int64_t context_len, float scale, at::Tensor& out);

}  // namespace structgen_cpu
