// Shared helpers of the CPU kernels: element conversions and a vectorizable exp.
//
// The kernels are plain loops that GCC/Clang vectorize for the build machine (-O3 -march=native, `omp simd`);
// bf16 is handled as raw 16-bit patterns so the loops stay free of calls the vectorizer cannot see through.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace structgen_cpu {

// __builtin_bit_cast (GCC >= 11, Clang >= 9), not memcpy: the vectorizer sees through it.
inline float bits_to_float(uint32_t bits) { return __builtin_bit_cast(float, bits); }

inline uint32_t float_to_bits(float f) { return __builtin_bit_cast(uint32_t, f); }

// Element types as the kernels see them: load to float, store from float (rounding like torch does).
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  using storage = float;
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
  static inline float round(float v) { return v; }
};

template <>
struct Elem<c10::BFloat16> {
  using storage = uint16_t;
  static inline float load(uint16_t v) { return bits_to_float(static_cast<uint32_t>(v) << 16); }
  // Round to nearest even, NaN kept NaN: the same rounding as c10::BFloat16's constructor.
  static inline uint16_t store(float v) {
    uint32_t bits = float_to_bits(v);
    if (std::isnan(v)) return 0x7fc0;
    uint32_t rounding_bias = ((bits >> 16) & 1u) + 0x7fffu;
    return static_cast<uint16_t>((bits + rounding_bias) >> 16);
  }
  // What a bf16 tensor op does to an intermediate: compute in float, round to bf16, continue in float.
  static inline float round(float v) { return load(store(v)); }
};

// For functions whose loops call `fast_exp`: GCC without AVX-512 leaves such loops scalar ("control flow in
// loop"), because partial redundancy elimination and sinking specialize the clamps' paths (a clamped input folds
// to a constant) into branches it cannot if-convert without masked instructions. On an AVX2-only Zen 3 that kept
// `silu_and_mul` at 0.23 G elements/s, a third of torch's speed; with these two passes off the loop vectorizes
// (BENCHMARKS.md, "Session 33"). AVX-512 builds vectorized either way. Clang has no such attribute (nor the issue).
#if defined(__GNUC__) && !defined(__clang__)
#define STRUCTGEN_VECTORIZE_EXP __attribute__((optimize("no-tree-pre", "no-tree-sink")))
#else
#define STRUCTGEN_VECTORIZE_EXP
#endif

// exp(x) to ~2 ulp over the float range, written so a loop of it vectorizes (no libm call): 2^(x log2 e) split
// into 2^n (exponent bits) times a degree-7 polynomial for 2^f, f in [-0.5, 0.5]. Underflows to 0 below
// -87.3 (softmax weights of masked or far-below-max scores), overflows to inf above 88.7, NaN stays NaN.
inline float fast_exp(float x) {
  float c = x < -87.33654f ? -87.33654f : x;
  c = c > 88.72283f ? 88.72283f : c;
  const float t = c * 1.44269504088896341f;
  // Round to nearest by the 1.5 * 2^23 trick (|t| < 128 here): vectorizes where nearbyint may not.
  const float n = (t + 12582912.0f) - 12582912.0f;
  const float f = t - n;
  // 2^f = e^(f ln 2): Taylor terms of e^y, |y| <= 0.35, truncation error < 1e-8 relative.
  const float y = f * 0.693147180559945309f;
  float p = 1.0f / 5040.0f;
  p = p * y + 1.0f / 720.0f;
  p = p * y + 1.0f / 120.0f;
  p = p * y + 1.0f / 24.0f;
  p = p * y + 1.0f / 6.0f;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  const float scale = bits_to_float(static_cast<uint32_t>(e < 1 ? 1 : e) << 23);
  float r = p * scale;
  r = x < -87.33654f ? 0.0f : r;
  r = x > 88.72283f ? INFINITY : r;
  return x != x ? x : r;
}

// Boundaries [0, b1, ..., n] cutting n tasks of the given costs into `parts` runs of about equal total cost, for
// a parallel loop over the runs: at::parallel_for cuts into equal counts, which leaves one thread most of the work
// when costs differ (attention over contexts of unequal length, rows allowing unequal numbers of tokens). A task
// goes to the run its cost's midpoint falls in; runs may be empty where one task outweighs a run.
inline std::vector<int64_t> cost_balanced_bounds(const std::vector<int64_t>& cost, int64_t parts) {
  const int64_t n = static_cast<int64_t>(cost.size());
  parts = std::max<int64_t>(1, std::min(parts, n));
  int64_t total = 0;
  for (const int64_t c : cost) total += c;
  std::vector<int64_t> bounds{0};
  int64_t done = 0, task = 0;
  for (int64_t part = 1; part < parts; ++part) {
    const int64_t target = total * part / parts;  // the cost at the end of this run
    while (task < n && done + cost[task] / 2 < target) done += cost[task++];
    bounds.push_back(task);
  }
  bounds.push_back(n);
  return bounds;
}

// The cost of each task of a causal prompt attention (KV head, query tile, head of the group, in that order): the
// key tiles a query tile visits, which grow along the prompt (`offset` cached tokens before its `q_len` new ones).
inline std::vector<int64_t> causal_tile_costs(int64_t kv_heads, int64_t group, int64_t q_len, int64_t offset,
                                              int64_t query_tile, int64_t key_tile) {
  const int64_t tiles = (q_len + query_tile - 1) / query_tile;
  std::vector<int64_t> cost(kv_heads * tiles * group);
  for (int64_t task = 0; task < static_cast<int64_t>(cost.size()); ++task) {
    const int64_t tile = task / group % tiles;
    cost[task] = (offset + std::min(q_len, (tile + 1) * query_tile)) / key_tile + 1;
  }
  return cost;
}

}  // namespace structgen_cpu
