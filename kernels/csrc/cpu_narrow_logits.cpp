// narrow_logits_rows: the logits of rows whose structured-output mask allows few tokens, for those tokens alone
// (`structgen.engine.narrow_logits`). Each listed row's output row is set to -inf, then each allowed token's
// entry to the dot product of its lm_head row with the row's hidden state, summed in float32 and rounded to the
// weight's dtype (as the full product's output is). The reference (`narrow_logits_reference` in the launcher)
// gathers the allowed rows of the weight, converts them to float32 and takes a matrix-vector product per row:
// two copies of up to ~2k lm_head rows per narrow row, where this reads them in place.
//
// A product is summed in one fixed order (16 lanes over the hidden size, then the lanes in order), whatever else
// is in the batch: a row's logits, and so its draws, must not depend on its neighbours. Rows are spread over
// torch's threads in runs of about equal cost (the -inf fill of a row, its allowed tokens).
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace structgen_cpu {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kAhead = 6;  // weight rows prefetched ahead of the one being summed

// The dot product of a weight row and a float32 hidden state, in the fixed order described above.
template <typename WT>
inline float dot_row(const typename Elem<WT>::storage* w, const float* h, int64_t size) {
  float lanes[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= size; d += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) lanes[l] += Elem<WT>::load(w[d + l]) * h[d + l];
  }
  for (int l = 0; d < size; ++d, ++l) lanes[l] += Elem<WT>::load(w[d]) * h[d];
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

template <typename WT, typename HT>
void narrow_rows(const at::Tensor& weight, const at::Tensor& hidden, at::IntArrayRef rows, at::TensorList ids,
                 at::Tensor& out) {
  using WS = typename Elem<WT>::storage;
  using HS = typename Elem<HT>::storage;
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t size = hidden.size(1), vocab = out.size(1);
  const auto* w = reinterpret_cast<const WS*>(weight.data_ptr());
  const auto* hid = reinterpret_cast<const HS*>(hidden.data_ptr());
  float* o = out.data_ptr<float>();
  const int64_t w_stride = weight.stride(0), h_stride = hidden.stride(0), o_stride = out.stride(0);
  const int64_t row_bytes = size * static_cast<int64_t>(sizeof(WS));
  std::vector<int64_t> cost(n);
  for (int64_t j = 0; j < n; ++j) cost[j] = vocab / 64 + ids[j].size(0) * (size / 16 + 1);
  const std::vector<int64_t> bounds = cost_balanced_bounds(cost, at::get_num_threads());
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<float> h(size);
    for (int64_t j = bounds[part_begin]; j < bounds[part_end]; ++j) {
      const int64_t row = rows[j];
      const HS* src = hid + row * h_stride;
      for (int64_t d = 0; d < size; ++d) h[d] = Elem<HT>::load(src[d]);
      float* dst = o + row * o_stride;
      std::fill(dst, dst + vocab, -std::numeric_limits<float>::infinity());
      const int64_t* id = ids[j].data_ptr<int64_t>();
      const int64_t count = ids[j].size(0);
      // The allowed rows are scattered over the weight (a number's digit tokens across cl100k's 100k): fetch a
      // few rows ahead, which the hardware prefetcher cannot guess.
      for (int64_t k = 0; k < count; ++k) {
        if (k + kAhead < count) {
          const char* next = reinterpret_cast<const char*>(w + id[k + kAhead] * w_stride);
          for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b);
        }
        dst[id[k]] = Elem<WT>::round(dot_row<WT>(w + id[k] * w_stride, h.data(), size));
      }
    }
  });
}

template <typename WT>
void dispatch_hidden(const at::Tensor& weight, const at::Tensor& hidden, at::IntArrayRef rows, at::TensorList ids,
                     at::Tensor& out) {
  if (hidden.scalar_type() == at::kFloat) {
    narrow_rows<WT, float>(weight, hidden, rows, ids, out);
  } else if (hidden.scalar_type() == at::kBFloat16) {
    narrow_rows<WT, c10::BFloat16>(weight, hidden, rows, ids, out);
  } else {
    TORCH_CHECK(false, "narrow_logits_rows: hidden must be float32 or bfloat16");
  }
}

}  // namespace

// weight [vocab, size] (float32 or bfloat16, rows contiguous), hidden [batch, size] (float32 or bfloat16, rows
// contiguous), out [batch, >= ...] float32. For each j: out[rows[j]] = -inf except at ids[j] (int64, each below
// both the weight's rows and out's width), which get the products described at the top.
void narrow_logits_rows(const at::Tensor& weight, const at::Tensor& hidden, at::IntArrayRef rows,
                        at::TensorList ids, at::Tensor out) {
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1, "narrow_logits_rows: weight must be [vocab, size]");
  TORCH_CHECK(hidden.dim() == 2 && hidden.stride(1) == 1 && hidden.size(1) == weight.size(1),
              "narrow_logits_rows: hidden must be [batch, size] with the weight's size");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.scalar_type() == at::kFloat &&
                  out.size(0) == hidden.size(0),
              "narrow_logits_rows: out must be [batch, vocab] float32");
  TORCH_CHECK(ids.size() == rows.size(), "narrow_logits_rows: one ids tensor per row");
  const int64_t limit = std::min(weight.size(0), out.size(1));
  for (size_t j = 0; j < rows.size(); ++j) {
    TORCH_CHECK(rows[j] >= 0 && rows[j] < hidden.size(0), "narrow_logits_rows: row ", rows[j], " out of range");
    const at::Tensor& listed = ids[j];
    TORCH_CHECK(listed.dim() == 1 && listed.scalar_type() == at::kLong && listed.is_contiguous(),
                "narrow_logits_rows: each ids entry must be a contiguous 1-D int64 tensor");
    const int64_t* id = listed.data_ptr<int64_t>();
    for (int64_t k = 0; k < listed.size(0); ++k) {
      TORCH_CHECK(id[k] >= 0 && id[k] < limit, "narrow_logits_rows: token id ", id[k], " out of range");
    }
  }
  if (weight.scalar_type() == at::kFloat) {
    dispatch_hidden<float>(weight, hidden, rows, ids, out);
  } else if (weight.scalar_type() == at::kBFloat16) {
    dispatch_hidden<c10::BFloat16>(weight, hidden, rows, ids, out);
  } else {
    TORCH_CHECK(false, "narrow_logits_rows: weight must be float32 or bfloat16");
  }
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def("narrow_logits_rows(Tensor weight, Tensor hidden, int[] rows, Tensor[] ids, Tensor(a!) out) -> ()");
  m.impl("narrow_logits_rows", c10::DispatchKey::CPU, &structgen_cpu::narrow_logits_rows);
}
