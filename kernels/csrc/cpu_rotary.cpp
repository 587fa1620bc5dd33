// rotary_embedding: rotates q and k in place by their positions' cos/sin, neox style ("rotate half"), with the
// roundings of HF's `x * cos + rotate_half(x) * sin` in the model dtype (each product rounded, then the sum).
// One token per task, q and k heads together. The reference is `RotaryEmbedding.apply` (structgen/models/rotary.py).
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "cpu_common.h"
#include "cpu_kernels.h"

namespace structgen_cpu {
namespace {

// One head; the two halves and cos/sin never overlap, and saying so (restrict) lets the loop vectorize.
template <typename T>
inline void rotate_head(typename Elem<T>::storage* __restrict x1, typename Elem<T>::storage* __restrict x2,
                        const typename Elem<T>::storage* __restrict c, const typename Elem<T>::storage* __restrict s,
                        int64_t half) {
  using E = Elem<T>;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float a = E::load(x1[d]), b = E::load(x2[d]);
    const float cd = E::load(c[d]), sd = E::load(s[d]);
    x1[d] = E::store(E::round(a * cd) - E::round(b * sd));
    x2[d] = E::store(E::round(b * cd) + E::round(a * sd));
  }
}

template <typename T>
void rotate_heads(typename Elem<T>::storage* x, int64_t heads, int64_t head_stride, int64_t half,
                  const typename Elem<T>::storage* c, const typename Elem<T>::storage* s) {
  for (int64_t h = 0; h < heads; ++h) {
    auto* x1 = x + h * head_stride;
    rotate_head<T>(x1, x1 + half, c, s, half);
  }
}

template <typename T>
void rotate(at::Tensor& query, at::Tensor& key, const at::Tensor& cos, const at::Tensor& sin) {
  using S = typename Elem<T>::storage;
  const int64_t tokens = query.size(0), half = cos.size(-1);
  auto* q = reinterpret_cast<S*>(query.data_ptr());
  auto* k = reinterpret_cast<S*>(key.data_ptr());
  const auto* c = reinterpret_cast<const S*>(cos.data_ptr());
  const auto* s = reinterpret_cast<const S*>(sin.data_ptr());
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate_heads<T>(q + t * query.stride(0), query.size(1), query.stride(1), half, c + t * half, s + t * half);
      rotate_heads<T>(k + t * key.stride(0), key.size(1), key.stride(1), half, c + t * half, s + t * half);
    }
  });
}

}  // namespace

// query [tokens, heads, dim], key [tokens, kv_heads, dim] (strided views of the fused projection are fine),
// cos/sin [tokens, dim / 2] contiguous (any leading broadcast dims of size 1 allowed), all one dtype.
void rotary_embedding(at::Tensor query, at::Tensor key, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1,
              "rotary_embedding: query/key must be [tokens, heads, dim] with contiguous rows");
  TORCH_CHECK(query.size(0) == key.size(0) && query.size(2) == key.size(2) && query.size(2) % 2 == 0,
              "rotary_embedding: query and key must share tokens and an even head dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == query.size(0) * query.size(2) / 2 &&
                  sin.numel() == cos.numel() && cos.size(-1) == query.size(2) / 2,
              "rotary_embedding: cos/sin must be contiguous [tokens, dim / 2]");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(key.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "rotary_embedding: query, key, cos and sin must share a dtype");
  if (dtype == at::kFloat) {
    rotate<float>(query, key, cos, sin);
  } else if (dtype == at::kBFloat16) {
    rotate<c10::BFloat16>(query, key, cos, sin);
  } else {
    TORCH_CHECK(false, "rotary_embedding: float32 or bfloat16 only");
  }
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def("rotary_embedding(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &structgen_cpu::rotary_embedding);
}
