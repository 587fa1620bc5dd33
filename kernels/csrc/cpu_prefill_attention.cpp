// Causal attention of one sequence's prompt chunk on AVX-512: a flash-attention loop over tiles of 32 query rows
// and 64 keys, reading the keys and values from the paged cache (so a chunk on top of a cached prefix needs no
// gather and no mask tensor). bf16 on AVX512-BF16, fp32 on AVX-512F (`cpu_prefill_tiles.h`); fp32 on CPUs with
// AVX2 and FMA but no AVX-512 goes to the same loop with AVX2 register tiles (`cpu_prefill_attention_avx2.cpp`).
//
// Why: torch's CPU flash kernel (SDPA) ran a 960-token SmolLM2 prompt at ~13 ms a layer with the prefix cache's
// offset mask and ~9 ms causal, 60% of the prompt's forward: ~115-175 GFLOP/s, where the dot products below run
// at AVX512-BF16's pairwise rate (VDPBF16PS: 32 products an instruction, exact, summed in fp32). This kernel:
// ~2.5 ms a layer on that prompt, either way (2-core Zen 5; BENCHMARKS.md, the peers' session 29).
//
// Per KV head, the context's keys and values are first repacked once for all the query heads of its group
// (layouts in `cpu_prefill_tiles.h`), so a score tile is broadcasts of the query against 16 keys a vector, and the
// value product is broadcasts of the weights against 16 dims a vector. Scores are fp32, the softmax runs in fp32
// (online: running max and sum; `fast_exp`); in bf16 the weights are rounded to bf16 for the value product, as
// flash kernels do; the output is fp32 divided by the sum, stored in the query's dtype. Reference:
// `prefill_attention_reference` (kernels/cpu_prefill_attention.py).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_prefill_avx2.h"
#include "cpu_prefill_tiles.h"

namespace structgen_cpu {
namespace {

#if defined(__AVX512F__)

using prefill::kKeyTile;
using prefill::kScoreRows;
constexpr int kQueryTile = 32;  // query rows a task (one head)

// fast_exp (cpu_common.h) on 16 lanes: the same clamp and polynomial, 2^n applied by VSCALEFPS; 0 below -87.3
// (masked scores are -inf).
inline __m512 exp16(__m512 x) {
  const __m512 c = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.72283f));
  const __m512 t = _mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  for (const float coefficient : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(coefficient));
  const __m512 r = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_GE_OQ), r);
}

// The context's keys and values of every KV head, packed by the dtype's policy `T`.
template <typename T>
struct PackedKV {
  const typename T::KeyWord* keys;  // [kv_heads][key groups][kKeyWords][16]
  const typename T::ValueWord* values;  // [kv_heads][key groups x 16 keys' D words]
  int64_t key_groups;  // padded keys / 16
};

struct Strides {
  int64_t q_row, q_head, o_row, o_head;
};

// One task: query rows [first, first + rows) of head `head` (positions offset + i), over the keys they see.
template <typename T, int D>
void attend_tile(const typename T::Elem* query, typename T::Elem* out, const Strides& st, int64_t head,
                 int64_t kv_head, int64_t first, int rows, int64_t offset, float scale, const PackedKV<T>& kv) {
  constexpr int kValueRows = prefill::value_rows<D>();
  static_assert(kKeyTile == 64, "the softmax below holds a row's tile in 4 vectors");
  alignas(64) float s[kQueryTile * kKeyTile];
  alignas(64) typename T::WeightWord w[kQueryTile * T::kWeightWords];
  alignas(64) float o[kQueryTile * D];
  float m[kQueryTile], l[kQueryTile];
  const typename T::Elem* q[kQueryTile];
  for (int r = 0; r < rows; ++r) {
    q[r] = query + (first + r) * st.q_row + head * st.q_head;
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  std::fill(o, o + rows * D, 0.0f);
  const typename T::KeyWord* keys = kv.keys + kv_head * kv.key_groups * 16 * T::kKeyWords;
  const typename T::ValueWord* values = kv.values + kv_head * kv.key_groups * 16 * D;
  const int64_t last_pos = offset + first + rows - 1;
  const __m512 lane_index = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t tile = 0; tile * kKeyTile <= last_pos; ++tile) {
    const int64_t j0 = tile * kKeyTile;
    for (int r0 = 0; r0 < rows; r0 += kScoreRows)
      T::scores(q + r0, std::min(kScoreRows, rows - r0), keys, tile, scale, s + r0 * kKeyTile);
    const bool masked = j0 + kKeyTile - 1 > offset + first;
    for (int r = 0; r < rows; ++r) {
      float* sr = s + r * kKeyTile;
      __m512 v[4];
      for (int g = 0; g < 4; ++g) v[g] = _mm512_loadu_ps(sr + 16 * g);
      if (masked) {  // keys j0 + j with j > visible are not seen
        const __m512 visible = _mm512_set1_ps(static_cast<float>(offset + first + r - j0));
        for (int g = 0; g < 4; ++g) {
          const __m512 j = _mm512_add_ps(lane_index, _mm512_set1_ps(16.0f * g));
          v[g] = _mm512_mask_mov_ps(v[g], _mm512_cmp_ps_mask(j, visible, _CMP_GT_OQ), minus_inf);
        }
      }
      const float tile_max =
          _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3])));
      const float new_max = std::max(m[r], tile_max);  // finite: every row sees key 0 in its first tile
      const float alpha = fast_exp(m[r] - new_max);
      const __m512 shift = _mm512_set1_ps(new_max);
      for (int g = 0; g < 4; ++g) v[g] = exp16(_mm512_sub_ps(v[g], shift));
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(v[0], v[1]), _mm512_add_ps(v[2], v[3])));
      m[r] = new_max;
      if (alpha != 1.0f) {
        const __m512 a = _mm512_set1_ps(alpha);
        for (int c = 0; c < D / 16; ++c)
          _mm512_storeu_ps(o + r * D + 16 * c, _mm512_mul_ps(a, _mm512_loadu_ps(o + r * D + 16 * c)));
      }
      T::weights(v, w + r * T::kWeightWords);
    }
    for (int r0 = 0; r0 < rows; r0 += kValueRows) {
      T::template add_values<kValueRows>(w + r0 * T::kWeightWords, std::min(kValueRows, rows - r0), values, tile,
                                         o + r0 * D);
    }
  }
  for (int r = 0; r < rows; ++r) T::store(o + r * D, 1.0f / l[r], out + (first + r) * st.o_row + head * st.o_head);
}

template <typename T, int D>
void prefill(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
             const int32_t* table, int64_t context_len, float scale, at::Tensor& out) {
  using Elem = typename T::Elem;
  const int64_t q_len = query.size(0), heads = query.size(1);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads, offset = context_len - q_len;
  const int64_t key_groups = (context_len + kKeyTile - 1) / kKeyTile * (kKeyTile / 16);
  // Reused across calls (one per layer): a fresh buffer each time cost page faults on every layer.
  static thread_local std::vector<typename T::KeyWord> keys_buffer;
  static thread_local std::vector<typename T::ValueWord> values_buffer;
  keys_buffer.resize(kv_heads * key_groups * 16 * T::kKeyWords);
  values_buffer.resize(kv_heads * key_groups * 16 * D);
  typename T::KeyWord* const keys = keys_buffer.data();
  typename T::ValueWord* const values = values_buffer.data();
  T::pack(reinterpret_cast<const Elem*>(key_cache.data_ptr()), reinterpret_cast<const Elem*>(value_cache.data_ptr()),
          table, context_len, block_size, kv_heads, keys, values, key_groups);
  const PackedKV<T> kv{keys, values, key_groups};
  const int64_t tiles = (q_len + kQueryTile - 1) / kQueryTile;
  // Tasks (KV head, query tile, head of the group), in that order so a thread's run reuses one KV head's packed
  // keys and values; a tile costs the key tiles it visits, which grow along the prompt: cut runs by cost.
  const std::vector<int64_t> cost = causal_tile_costs(kv_heads, group, q_len, offset, kQueryTile, kKeyTile);
  const std::vector<int64_t> bounds = cost_balanced_bounds(cost, at::get_num_threads());
  const auto* q = reinterpret_cast<const Elem*>(query.data_ptr());
  auto* o = reinterpret_cast<Elem*>(out.data_ptr());
  const Strides st{query.stride(0), query.stride(1), out.stride(0), out.stride(1)};
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t part_begin, int64_t part_end) {
    for (int64_t task = bounds[part_begin]; task < bounds[part_end]; ++task) {
      const int64_t kv_head = task / (tiles * group), tile = task / group % tiles, g = task % group;
      const int64_t first = tile * kQueryTile;
      const int rows = static_cast<int>(std::min<int64_t>(kQueryTile, q_len - first));
      attend_tile<T, D>(q, o, st, kv_head * group + g, kv_head, first, rows, offset, scale, kv);
    }
  });
}

template <template <int> class T>
void by_head_dim(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const int32_t* table, int64_t context_len, float scale, at::Tensor& out) {
  switch (query.size(2)) {
    case 32: return prefill<T<32>, 32>(query, key_cache, value_cache, table, context_len, scale, out);
    case 64: return prefill<T<64>, 64>(query, key_cache, value_cache, table, context_len, scale, out);
    default: return prefill<T<128>, 128>(query, key_cache, value_cache, table, context_len, scale, out);
  }
}

#endif  // __AVX512F__

}  // namespace

// Whether this build and CPU run the AVX-512F fp32 path (else fp32 takes the AVX2 one where it can).
static bool avx512_fp32() {
#if defined(__AVX512F__)
  __builtin_cpu_init();
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
#else
  return false;
#endif
}

// Whether the kernel runs here for bf16 (AVX512-BF16) or fp32 (AVX-512F, or AVX2 with FMA) tensors.
bool prefill_attention_available(bool bf16) {
  __builtin_cpu_init();
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  static const bool with_bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  static const bool with_bf16 = false;
#endif
  static const bool with_fp32 = avx512_fp32() || prefill_attention_avx2_usable();
  return bf16 ? with_bf16 : with_fp32;
}

// query / out [q_len, heads, D] (rows contiguous in D), the q_len newest tokens of a context of `context_len`
// tokens whose keys and values (these tokens' included) are in the paged caches [blocks, block_size, kv_heads, D]
// at `block_table` [>= blocks of the context] int32; all bf16 or all fp32.
void prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_table, int64_t context_len, double scale, at::Tensor out) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "prefill_attention: query must be bf16 or fp32");
  TORCH_CHECK(prefill_attention_available(dtype == at::kBFloat16),
              "prefill_attention: this CPU (or build) cannot run it for ", dtype == at::kBFloat16 ? "bf16" : "fp32",
              " (needs AVX512-BF16 / AVX-512F or AVX2 with FMA)");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1,
              "prefill_attention: query must be [rows, heads, dim] with contiguous rows");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.scalar_type() == dtype,
              "prefill_attention: out must match query");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == dtype &&
                  value_cache.scalar_type() == dtype,
              "prefill_attention: caches must be contiguous [blocks, block_size, kv_heads, dim] of the query's dtype");
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && query.size(1) % key_cache.size(2) == 0,
              "prefill_attention: cache shape does not fit the query");
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128, "prefill_attention: head_dim must be 32, 64 or 128");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "prefill_attention: block_table must be a contiguous int32 vector");
  const int64_t block_size = key_cache.size(1), num_blocks = key_cache.size(0);
  TORCH_CHECK(context_len >= query.size(0) && context_len <= block_table.size(0) * block_size,
              "prefill_attention: context_len must cover the query rows and fit the block table");
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b * block_size < context_len; ++b) {
    TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks,
                "prefill_attention: a block table entry within the context is out of range");
  }
  if (query.size(0) == 0) return;
  const float s = static_cast<float>(scale);
  if (dtype == at::kFloat) {
#if defined(__AVX512F__)
    if (avx512_fp32()) return by_head_dim<prefill::F32Tiles>(query, key_cache, value_cache, table, context_len, s, out);
#endif
    return prefill_attention_avx2(query, key_cache, value_cache, table, context_len, s, out);
  }
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  by_head_dim<prefill::Bf16Tiles>(query, key_cache, value_cache, table, context_len, s, out);
#endif
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def("prefill_attention_available(bool bf16) -> bool", &structgen_cpu::prefill_attention_available);
  m.def(
      "prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, int context_len, "
      "float scale, Tensor(a!) out) -> ()");
  m.impl("prefill_attention", c10::DispatchKey::CPU, &structgen_cpu::prefill_attention);
}
