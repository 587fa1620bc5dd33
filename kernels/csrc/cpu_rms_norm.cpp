// rms_norm / fused_add_rms_norm: the decoder's pre-norms in one pass each, with the arithmetic (and roundings)
// of HF Llama's RMSNorm: the sum of squares and the scaling in float32, the normalized row rounded to the model
// dtype, then multiplied by the weight in the model dtype. The fused form first adds the sublayer output into
// the residual stream (rounded to the model dtype, as a tensor add would) and normalizes that. One row per task.
// The reference is `RMSNorm` in structgen/models/layers.py.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <vector>

#include "cpu_common.h"
#include "cpu_kernels.h"

namespace structgen_cpu {
namespace {

// One row; restrict-qualified pointer arguments let the loops vectorize (see cpu_activation.cpp).
template <typename T>
inline void norm_row(const typename Elem<T>::storage* __restrict x, typename Elem<T>::storage* __restrict res,
                     const typename Elem<T>::storage* __restrict w, typename Elem<T>::storage* __restrict y,
                     float* __restrict b, int64_t hidden, float eps) {
  using E = Elem<T>;
  using S = typename E::storage;
  if (res) {
#pragma omp simd
    for (int64_t d = 0; d < hidden; ++d) {
      const S sum = E::store(E::load(x[d]) + E::load(res[d]));
      res[d] = sum;
      b[d] = E::load(sum);
    }
  } else {
#pragma omp simd
    for (int64_t d = 0; d < hidden; ++d) b[d] = E::load(x[d]);
  }
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t d = 0; d < hidden; ++d) squares += b[d] * b[d];
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t d = 0; d < hidden; ++d) y[d] = E::store(E::load(w[d]) * E::round(b[d] * inv));
}

template <typename T>
void norm_rows(const at::Tensor& input, at::Tensor* residual, const at::Tensor& weight, double eps,
               at::Tensor& out) {
  using S = typename Elem<T>::storage;
  const int64_t rows = input.size(0), hidden = input.size(1);
  const auto* x = reinterpret_cast<const S*>(input.data_ptr());
  auto* res = residual ? reinterpret_cast<S*>(residual->data_ptr()) : nullptr;
  const auto* w = reinterpret_cast<const S*>(weight.data_ptr());
  auto* y = reinterpret_cast<S*>(out.data_ptr());
  const int64_t x_stride = input.stride(0), y_stride = out.stride(0);
  const int64_t r_stride = residual ? residual->stride(0) : 0;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(hidden);
    for (int64_t i = begin; i < end; ++i) {
      norm_row<T>(x + i * x_stride, res ? res + i * r_stride : nullptr, w, y + i * y_stride, buf.data(), hidden,
                  feps);
    }
  });
}

void check(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& out, const char* name) {
  TORCH_CHECK(input.dim() == 2 && input.stride(1) == 1, name, ": input must be [rows, hidden], rows contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == input.size(1) &&
                  weight.scalar_type() == input.scalar_type(),
              name, ": weight must be [hidden] of the input's dtype");
  TORCH_CHECK(out.sizes() == input.sizes() && out.stride(1) == 1 && out.scalar_type() == input.scalar_type(), name,
              ": out must match the input");
  TORCH_CHECK(input.scalar_type() == at::kFloat || input.scalar_type() == at::kBFloat16, name,
              ": float32 or bfloat16 only");
}

template <typename F>
void dispatch(const at::Tensor& input, F&& f) {
  if (input.scalar_type() == at::kFloat) {
    f(float{});
  } else {
    f(c10::BFloat16{});
  }
}

}  // namespace

// out = weight * norm(input)
void rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps, at::Tensor out) {
  check(input, weight, out, "rms_norm");
  dispatch(input, [&](auto tag) { norm_rows<decltype(tag)>(input, nullptr, weight, eps, out); });
}

// residual += input (in place); out = weight * norm(residual)
void fused_add_rms_norm(const at::Tensor& input, at::Tensor residual, const at::Tensor& weight, double eps,
                        at::Tensor out) {
  check(input, weight, out, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == input.sizes() && residual.stride(1) == 1 &&
                  residual.scalar_type() == input.scalar_type(),
              "fused_add_rms_norm: residual must match the input");
  dispatch(input, [&](auto tag) { norm_rows<decltype(tag)>(input, &residual, weight, eps, out); });
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &structgen_cpu::rms_norm);
  m.def("fused_add_rms_norm(Tensor input, Tensor(a!) residual, Tensor weight, float eps, Tensor(b!) out) -> ()");
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &structgen_cpu::fused_add_rms_norm);
}
