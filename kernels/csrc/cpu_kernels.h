// The CPU kernels' entry points, for kernels that call others (`cpu_decode_step.cpp`) without going back through
// Python or the dispatcher. Each is registered as `torch.ops.structgen_cpu.<name>` in its own file, which also
// documents its arguments; the checks are the same whichever way it is called.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace structgen_cpu {

void rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps, at::Tensor out);
void fused_add_rms_norm(const at::Tensor& input, at::Tensor residual, const at::Tensor& weight, double eps,
                        at::Tensor out);
void rotary_embedding(at::Tensor query, at::Tensor key, const at::Tensor& cos, const at::Tensor& sin);
void silu_and_mul(const at::Tensor& input, at::Tensor out);
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                    const at::Tensor& slot_mapping);
void paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            at::Tensor out, const c10::optional<at::Tensor>& rows);
bool gemv_available();
void woq_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
              int64_t bits, at::Tensor& out);
bool gemv_avx2_available();
void woq_gemv_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                   int64_t bits, at::Tensor& out);
bool woq_q8_avx2_available();
void woq_q8_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                 int64_t bits, at::Tensor& out);

void lora_add(const at::Tensor& x, at::Tensor y, const at::Tensor& a, at::TensorList b, at::IntArrayRef offsets,
              const at::Tensor& slots, const at::Tensor& ranks, const c10::optional<at::Tensor>& a_pairs);

}  // namespace structgen_cpu
