// The sampler's structured-output fast path (`structgen.engine.fast_picks`): listing the tokens a bitmask row
// allows, and picking each row among its few allowed tokens. The references (`cpu_sparse_picks.py`) take ~20
// small tensor ops a call, ~0.5-1 ms on a CPU for what is microseconds of arithmetic here; the results are the
// same, roundings included (float32 values, float64 cumulative sums searched by the same rule).
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace structgen_cpu {
namespace {

// Bits set in `words` 64-bit words, stopping early once past `limit`.
int64_t count_bits(const uint64_t* words, int64_t n, int64_t limit) {
  int64_t count = 0;
  for (int64_t w = 0; w < n && count <= limit; ++w) {
    count += __builtin_popcountll(words[w]);
  }
  return count;
}

}  // namespace

// bitmask [rows, words] int32 (bit b of word w allows token 32w + b; rows contiguous). For each listed row: its
// allowed ids below `vocab`, ascending (int64), or a [0, 0] tensor when more than `limit` bits are set (ids past
// `vocab` count: the reference counts before it filters).
std::vector<at::Tensor> list_allowed(const at::Tensor& bitmask, at::IntArrayRef rows, int64_t vocab,
                                     int64_t limit) {
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.stride(1) == 1,
              "list_allowed: bitmask must be [rows, words] int32 with contiguous rows");
  TORCH_CHECK(limit >= 0 && vocab >= 0, "list_allowed: vocab and limit must be >= 0");
  const int64_t words = bitmask.size(1);
  const auto* base = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  std::vector<at::Tensor> out;
  out.reserve(rows.size());
  std::vector<int64_t> ids;
  for (const int64_t row : rows) {
    TORCH_CHECK(row >= 0 && row < bitmask.size(0), "list_allowed: row ", row, " out of range");
    const uint32_t* bits = base + row * bitmask.stride(0);
    int64_t count = 0;
    if (words % 2 == 0 && reinterpret_cast<uintptr_t>(bits) % alignof(uint64_t) == 0) {
      count = count_bits(reinterpret_cast<const uint64_t*>(bits), words / 2, limit);
    } else {
      for (int64_t w = 0; w < words && count <= limit; ++w) count += __builtin_popcount(bits[w]);
    }
    if (count > limit) {
      out.push_back(at::empty({0, 0}, at::kLong));
      continue;
    }
    ids.clear();
    for (int64_t w = 0; w < words; ++w) {
      uint32_t word = bits[w];
      while (word != 0) {
        const int64_t id = 32 * w + __builtin_ctz(word);
        if (id < vocab) ids.push_back(id);
        word &= word - 1;
      }
    }
    at::Tensor listed = at::empty({static_cast<int64_t>(ids.size())}, at::kLong);
    if (!ids.empty()) std::memcpy(listed.data_ptr<int64_t>(), ids.data(), ids.size() * sizeof(int64_t));
    out.push_back(listed);
  }
  return out;
}

// x [batch, vocab] float32 (rows contiguous). For each j: batch row rows[j], its allowed ids[j] (int64, each in
// [0, vocab)), temperatures[j] and uniforms[j] (float64; NaN: greedy). The values are x[row, ids] / temperature in
// float32; a row is possible when their maximum is finite (no NaN, no +inf, not all -inf). Greedy: the first
// maximum. Sampled: the first index whose float64 cumulative sum of exp(value - maximum) exceeds uniform * total,
// never past the last index with mass. Writes token_ids[row] = that id (-1 when not possible), ok[row] = possible.
void pick_among_allowed(const at::Tensor& x, at::IntArrayRef rows, at::TensorList ids,
                        at::ArrayRef<double> temperatures, const at::Tensor& uniforms, at::Tensor token_ids,
                        at::Tensor ok) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "pick_among_allowed: x must be [batch, vocab] float32 with contiguous rows");
  const int64_t n = static_cast<int64_t>(rows.size());
  TORCH_CHECK(static_cast<int64_t>(ids.size()) == n && static_cast<int64_t>(temperatures.size()) == n,
              "pick_among_allowed: rows, ids and temperatures must have one entry per pick");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == n && uniforms.scalar_type() == at::kDouble &&
                  uniforms.is_contiguous(),
              "pick_among_allowed: uniforms must be [picks] float64");
  const int64_t batch = x.size(0), vocab = x.size(1);
  TORCH_CHECK(token_ids.dim() == 1 && token_ids.size(0) == batch && token_ids.scalar_type() == at::kLong &&
                  token_ids.is_contiguous(),
              "pick_among_allowed: token_ids must be [batch] int64");
  TORCH_CHECK(ok.dim() == 1 && ok.size(0) == batch && ok.scalar_type() == at::kBool && ok.is_contiguous(),
              "pick_among_allowed: ok must be [batch] bool");
  const float* data = x.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* out = token_ids.data_ptr<int64_t>();
  bool* possible_out = ok.data_ptr<bool>();
  std::vector<float> values;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = rows[j];
    TORCH_CHECK(row >= 0 && row < batch, "pick_among_allowed: row ", row, " out of range");
    const at::Tensor& listed = ids[j];
    TORCH_CHECK(listed.dim() == 1 && listed.scalar_type() == at::kLong && listed.is_contiguous(),
                "pick_among_allowed: each ids entry must be a contiguous 1-D int64 tensor");
    const int64_t count = listed.size(0);
    const int64_t* id = listed.data_ptr<int64_t>();
    const float* logits = data + row * x.stride(0);
    const float temperature = static_cast<float>(temperatures[j]);  // the reference divides in float32
    values.resize(count);
    float top = -INFINITY;
    bool has_nan = false;
    for (int64_t k = 0; k < count; ++k) {
      TORCH_CHECK(id[k] >= 0 && id[k] < vocab, "pick_among_allowed: token id ", id[k], " out of range");
      const float v = logits[id[k]] / temperature;
      values[k] = v;
      has_nan |= std::isnan(v);
      if (v > top) top = v;
    }
    const bool possible = count > 0 && !has_nan && std::isfinite(top);
    possible_out[row] = possible;
    if (!possible) {
      out[row] = -1;
      continue;
    }
    int64_t index = 0;
    if (std::isnan(u[j])) {
      while (values[index] != top) ++index;  // the first maximum
    } else {
      const double shift = static_cast<double>(top);
      double total = 0.0;
      for (int64_t k = 0; k < count; ++k) total += std::exp(static_cast<double>(values[k]) - shift);
      const double target = u[j] * total;
      double cum = 0.0;
      for (index = 0; index < count; ++index) {
        cum += std::exp(static_cast<double>(values[index]) - shift);
        if (cum > target || cum >= total) break;
      }
      if (index == count) index = count - 1;  // (unreachable: the last cum equals total)
    }
    out[row] = id[index];
  }
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def("list_allowed(Tensor bitmask, int[] rows, int vocab, int limit) -> Tensor[]");
  m.impl("list_allowed", c10::DispatchKey::CPU, &structgen_cpu::list_allowed);
  m.def(
      "pick_among_allowed(Tensor x, int[] rows, Tensor[] ids, float[] temperatures, Tensor uniforms, "
      "Tensor(a!) token_ids, Tensor(b!) ok) -> ()");
  m.impl("pick_among_allowed", c10::DispatchKey::CPU, &structgen_cpu::pick_among_allowed);
}
