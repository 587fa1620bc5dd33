// The sampler's draw by inverse CDF (`structgen.engine.inverse_cdf.InverseCdf.draw`): for each uniform, the
// block whose float64 cumulative sum it falls in, then the token within that block. The reference is ~20 small
// tensor ops a call (~130-180 us on a CPU whether it draws 1 row or 30), called several times a step where the
// structured-output mask rejects picks and rows draw again; here it is a binary search and a scan of one block
// per row. The results are the reference's exactly: the same float64 values, summed in the same order (a
// float64 cumsum on the CPU accumulates left to right), searched by the same rule (`search`).
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace structgen_cpu {
namespace {

// `search` of inverse_cdf.py on one row: the first index whose cumulative value exceeds `target`, never past the
// first index that reaches the row's total (so never on trailing zero-mass entries).
int64_t search_row(const double* cum, int64_t n, double target) {
  const int64_t found = std::upper_bound(cum, cum + n, target) - cum;
  const int64_t last = std::lower_bound(cum, cum + n, cum[n - 1]) - cum;
  return std::min(found, last);
}

}  // namespace

// probs [batch, vocab] float32 (rows contiguous, non-negative), block_cum [batch, blocks] float64 (contiguous: the
// cumulative block sums, block `block` tokens wide, the last one possibly short), uniforms [n] float64 in [0, 1),
// rows: [n] int64 (the row of each draw) or empty (n == batch, draw j from row j). Returns [n] int64 token ids.
at::Tensor inverse_cdf_draw(const at::Tensor& probs, const at::Tensor& block_cum, const at::Tensor& uniforms,
                            int64_t block, const at::Tensor& rows) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.stride(1) == 1,
              "inverse_cdf_draw: probs must be [batch, vocab] float32 with contiguous rows");
  TORCH_CHECK(block_cum.dim() == 2 && block_cum.scalar_type() == at::kDouble && block_cum.is_contiguous(),
              "inverse_cdf_draw: block_cum must be a contiguous [batch, blocks] float64 tensor");
  const int64_t batch = probs.size(0), vocab = probs.size(1), blocks = block_cum.size(1);
  TORCH_CHECK(block_cum.size(0) == batch, "inverse_cdf_draw: block_cum has ", block_cum.size(0),
              " rows, probs ", batch);
  TORCH_CHECK(block > 0 && blocks > 0 && blocks == (vocab + block - 1) / block,
              "inverse_cdf_draw: ", blocks, " blocks of ", block, " do not cover a vocabulary of ", vocab);
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous(),
              "inverse_cdf_draw: uniforms must be a contiguous 1-D float64 tensor");
  const int64_t n = uniforms.size(0);
  const bool subset = rows.numel() > 0;
  if (subset) {
    TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.size(0) == n,
                "inverse_cdf_draw: rows must be a contiguous [n] int64 tensor, one per uniform");
  } else {
    TORCH_CHECK(n == batch, "inverse_cdf_draw: without rows, one uniform per row of probs (", batch, "), got ", n);
  }
  const float* p = probs.data_ptr<float>();
  const double* cums = block_cum.data_ptr<double>();
  const double* u = uniforms.data_ptr<double>();
  const int64_t* which = subset ? rows.data_ptr<int64_t>() : nullptr;
  at::Tensor out = at::empty({n}, at::kLong);
  int64_t* tokens = out.data_ptr<int64_t>();
  std::vector<double> inner(block);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = subset ? which[j] : j;
    TORCH_CHECK(row >= 0 && row < batch, "inverse_cdf_draw: row ", row, " out of range");
    const double* cum = cums + row * blocks;
    const double target = u[j] * cum[blocks - 1];
    const int64_t chosen = std::min(search_row(cum, blocks, target), blocks - 1);
    const double before = chosen == 0 ? 0.0 : cum[chosen - 1];
    // The block's tokens (past the vocabulary: no mass), cumulated in float64 left to right as torch's cumsum.
    const float* values = p + row * probs.stride(0) + chosen * block;
    const int64_t width = std::min(block, vocab - chosen * block);
    double sum = 0.0;
    for (int64_t k = 0; k < block; ++k) {
      if (k < width) sum += static_cast<double>(values[k]);
      inner[k] = sum;
    }
    // Where the target falls within the block, as a fraction of the block's float32-summed mass (see the
    // reference), placed on the block's own float64 cumsum. A NaN (a dead row) stays NaN, as with torch's clamp.
    double fraction = (target - before) / (cum[chosen] - before);
    if (fraction < 0.0) fraction = 0.0;
    if (fraction > 1.0) fraction = 1.0;
    const int64_t position = std::min(search_row(inner.data(), block, fraction * inner[block - 1]), block - 1);
    tokens[j] = std::min(chosen * block + position, vocab - 1);
  }
  return out;
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def("inverse_cdf_draw(Tensor probs, Tensor block_cum, Tensor uniforms, int block, Tensor rows) -> Tensor");
  m.impl("inverse_cdf_draw", c10::DispatchKey::CPU, &structgen_cpu::inverse_cdf_draw);
}
