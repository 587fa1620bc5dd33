// Causal attention of one sequence's prompt chunk on AVX512-BF16: a flash-attention loop over tiles of 32 query
// rows and 64 keys, reading the keys and values from the paged cache (so a chunk on top of a cached prefix needs
// no gather and no mask tensor).
//
// Why: torch's CPU flash kernel (SDPA) ran a 960-token SmolLM2 prompt at ~13 ms a layer with the prefix cache's
// offset mask and ~9 ms causal, 60% of the prompt's forward: ~115-175 GFLOP/s, where the dot products below run
// at AVX512-BF16's pairwise rate (VDPBF16PS: 32 products an instruction, exact, summed in fp32). This kernel:
// ~2.5 ms a layer on that prompt, either way (2-core Zen 5; BENCHMARKS.md, the peers' session 29).
//
// Per KV head, the context's keys and values are first repacked once for all the query heads of its group:
//   keys   [key group of 16][dim pair p][key j]    (int32 = the bf16 pair k[2p], k[2p + 1] of key 16 g + j)
//   values [key pair kp][dim d][2]                 (bf16 v[2 kp][d], v[2 kp + 1][d])
// so a score tile is dim-pair broadcasts of the query against 16 keys a vector, and the value product is key-pair
// broadcasts of the weights against 16 dims a vector. Scores are fp32, the softmax runs in fp32 (online: running
// max and sum; `fast_exp`), and the weights are rounded to bf16 for the value product, as flash kernels do; the
// output is fp32 divided by the sum, rounded to bf16. Reference: `prefill_attention_reference`
// (kernels/cpu_prefill_attention.py).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define STRUCTGEN_PREFILL_BF16 1
#else
#define STRUCTGEN_PREFILL_BF16 0
#endif

namespace structgen_cpu {
namespace {

#if STRUCTGEN_PREFILL_BF16

constexpr int kKeyTile = 64;  // keys a tile: 4 vectors of 16 scores a row
constexpr int kQueryTile = 32;  // query rows a task (one head)
constexpr int kScoreRows = 4;  // rows a score pass holds in registers: 4 rows x 4 key vectors = 16 accumulators
typedef int32_t __attribute__((may_alias)) AliasedInt32;  // a bf16 pair read as one broadcast lane

// The context's keys and values of every KV head in the layouts above, zero past the context.
struct PackedKV {
  const int32_t* keys;  // [kv_heads][key groups][D / 2][16]
  const uint16_t* values;  // [kv_heads][key pairs][D][2]
  int64_t key_groups;  // padded keys / 16
};

template <int D>
void pack_kv(const uint16_t* kc, const uint16_t* vc, const int32_t* table, int64_t context_len, int64_t block_size,
             int64_t kv_heads, int32_t* keys, uint16_t* values, int64_t key_groups) {
  constexpr int P = D / 2;
  const int64_t slot_stride = kv_heads * D;
  at::parallel_for(0, kv_heads * key_groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / key_groups, g = task % key_groups;
      int32_t* kdst = keys + (h * key_groups + g) * P * 16;
      uint16_t* vdst = values + (h * key_groups + g) * 8 * D * 2;  // the group's 8 key pairs
      for (int j = 0; j < 16; ++j) {
        const int64_t t = 16 * g + j;
        if (t >= context_len) {
          for (int p = 0; p < P; ++p) kdst[p * 16 + j] = 0;
          for (int d = 0; d < D; ++d) vdst[((j / 2) * D + d) * 2 + j % 2] = 0;
          continue;
        }
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        const auto* k = reinterpret_cast<const AliasedInt32*>(kc + slot * slot_stride + h * D);
        const uint16_t* v = vc + slot * slot_stride + h * D;
        for (int p = 0; p < P; ++p) kdst[p * 16 + j] = k[p];
        for (int d = 0; d < D; ++d) vdst[((j / 2) * D + d) * 2 + j % 2] = v[d];
      }
    }
  });
}

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

// Scores of `rows` (<= kScoreRows) query rows against the 64 keys of tile `tile`, scaled, into s[row][64].
template <int D>
inline void score_rows(const uint16_t* const* q, int rows, const int32_t* keys, int64_t tile, float scale, float* s) {
  constexpr int P = D / 2;
  __m512 acc[kScoreRows][4];
  for (int r = 0; r < kScoreRows; ++r)
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
  const int32_t* k0 = keys + tile * 4 * P * 16;
  for (int p = 0; p < P; ++p) {
    __m512bh kv[4];
    for (int g = 0; g < 4; ++g) kv[g] = (__m512bh)_mm512_loadu_si512(k0 + (g * P + p) * 16);
    for (int r = 0; r < kScoreRows; ++r) {
      if (r >= rows) break;
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const AliasedInt32*>(q[r])[p]);
      for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], qb, kv[g]);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(s + r * kKeyTile + 16 * g, _mm512_mul_ps(acc[r][g], vs));
}

// o[row][D] += weights (bf16 pairs, w[row][32]) x the tile's values, for `rows` rows (<= R).
template <int D, int R>
inline void add_values(const int32_t* w, int rows, const uint16_t* values, int64_t tile, float* o) {
  constexpr int V = D / 16;
  __m512 acc[R][V];
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < V; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + 16 * c);
  const uint16_t* v0 = values + tile * (kKeyTile / 2) * D * 2;
  for (int kp = 0; kp < kKeyTile / 2; ++kp) {
    __m512bh vv[V];
    for (int c = 0; c < V; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v0 + (kp * D + 16 * c) * 2);
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      const __m512bh wb = (__m512bh)_mm512_set1_epi32(w[r * (kKeyTile / 2) + kp]);
      for (int c = 0; c < V; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wb, vv[c]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

// One task: query rows [first, first + rows) of head `head` (positions offset + i), over the keys they see.
template <int D>
void attend_tile(const uint16_t* query, int64_t q_row_stride, int64_t q_head_stride, uint16_t* out,
                 int64_t o_row_stride, int64_t o_head_stride, int64_t head, int64_t kv_head, int64_t first, int rows,
                 int64_t offset, float scale, const PackedKV& kv) {
  constexpr int P = D / 2;
  constexpr int kValueRows = 16 / (D / 16) < 1 ? 1 : (16 / (D / 16) > 8 ? 8 : 16 / (D / 16));
  static_assert(kKeyTile == 64, "the softmax below holds a row's tile in 4 vectors");
  alignas(64) float s[kQueryTile * kKeyTile];
  alignas(64) int32_t w[kQueryTile * kKeyTile / 2];
  alignas(64) float o[kQueryTile * D];
  float m[kQueryTile], l[kQueryTile];
  const uint16_t* q[kQueryTile];
  for (int r = 0; r < rows; ++r) {
    q[r] = query + (first + r) * q_row_stride + head * q_head_stride;
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  std::fill(o, o + rows * D, 0.0f);
  const int32_t* keys = kv.keys + kv_head * kv.key_groups * P * 16;
  const uint16_t* values = kv.values + kv_head * kv.key_groups * 8 * D * 2;
  const int64_t last_pos = offset + first + rows - 1;
  const __m512 lane_index = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t tile = 0; tile * kKeyTile <= last_pos; ++tile) {
    const int64_t j0 = tile * kKeyTile;
    for (int r0 = 0; r0 < rows; r0 += kScoreRows)
      score_rows<D>(q + r0, std::min(kScoreRows, rows - r0), keys, tile, scale, s + r0 * kKeyTile);
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
      // bf16 weights, keys in order: cvtne2ps puts its second operand in the low half
      for (int g = 0; g < 2; ++g)
        _mm512_storeu_si512(w + r * (kKeyTile / 2) + 16 * g, (__m512i)_mm512_cvtne2ps_pbh(v[2 * g + 1], v[2 * g]));
    }
    for (int r0 = 0; r0 < rows; r0 += kValueRows)
      add_values<D, kValueRows>(w + r0 * (kKeyTile / 2), std::min(kValueRows, rows - r0), values, tile, o + r0 * D);
  }
  for (int r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
    uint16_t* dst = out + (first + r) * o_row_stride + head * o_head_stride;
    for (int c = 0; c < D / 16; ++c) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * c), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), (__m256i)y);
    }
  }
}

template <int D>
void prefill_bf16(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const int32_t* table, int64_t context_len, float scale, at::Tensor& out) {
  const int64_t q_len = query.size(0), heads = query.size(1);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads, offset = context_len - q_len;
  const int64_t key_groups = (context_len + kKeyTile - 1) / kKeyTile * (kKeyTile / 16);
  // Reused across calls (one per layer): a fresh buffer each time cost page faults on every layer.
  static thread_local std::vector<int32_t> keys_buffer;
  static thread_local std::vector<uint16_t> values_buffer;
  keys_buffer.resize(kv_heads * key_groups * 16 * D / 2);
  values_buffer.resize(kv_heads * key_groups * 16 * D);
  int32_t* const keys = keys_buffer.data();
  uint16_t* const values = values_buffer.data();
  pack_kv<D>(reinterpret_cast<const uint16_t*>(key_cache.data_ptr()),
             reinterpret_cast<const uint16_t*>(value_cache.data_ptr()), table, context_len, block_size, kv_heads,
             keys, values, key_groups);
  const PackedKV kv{keys, values, key_groups};
  const int64_t tiles = (q_len + kQueryTile - 1) / kQueryTile;
  // Tasks (KV head, query tile, head of the group), in that order so a thread's run reuses one KV head's packed
  // keys and values; a tile costs the key tiles it visits, which grow along the prompt: cut runs by cost.
  std::vector<int64_t> cost(kv_heads * tiles * group);
  for (int64_t task = 0; task < static_cast<int64_t>(cost.size()); ++task) {
    const int64_t tile = task / group % tiles;
    cost[task] = (offset + std::min(q_len, (tile + 1) * kQueryTile)) / kKeyTile + 1;
  }
  const std::vector<int64_t> bounds = cost_balanced_bounds(cost, at::get_num_threads());
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t part_begin, int64_t part_end) {
    for (int64_t task = bounds[part_begin]; task < bounds[part_end]; ++task) {
      const int64_t kv_head = task / (tiles * group), tile = task / group % tiles, g = task % group;
      const int64_t first = tile * kQueryTile;
      const int rows = static_cast<int>(std::min<int64_t>(kQueryTile, q_len - first));
      attend_tile<D>(q, query.stride(0), query.stride(1), o, out.stride(0), out.stride(1), kv_head * group + g,
                     kv_head, first, rows, offset, scale, kv);
    }
  });
}

#endif  // STRUCTGEN_PREFILL_BF16

}  // namespace

bool prefill_attention_available() {
#if STRUCTGEN_PREFILL_BF16
  static const bool usable = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  }();
  return usable;
#else
  return false;
#endif
}

// query / out [q_len, heads, D] bf16 (rows contiguous in D), the q_len newest tokens of a context of
// `context_len` tokens whose keys and values (these tokens' included) are in the paged caches
// [blocks, block_size, kv_heads, D] bf16 at `block_table` [>= blocks of the context] int32.
void prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_table, int64_t context_len, double scale, at::Tensor out) {
  TORCH_CHECK(prefill_attention_available(), "prefill_attention: this CPU (or build) has no AVX512-BF16");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.scalar_type() == at::kBFloat16,
              "prefill_attention: query must be bf16 [rows, heads, dim] with contiguous rows");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.scalar_type() == at::kBFloat16,
              "prefill_attention: out must match query");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.scalar_type() == at::kBFloat16,
              "prefill_attention: caches must be contiguous bf16 [blocks, block_size, kv_heads, dim]");
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
#if STRUCTGEN_PREFILL_BF16
  const float s = static_cast<float>(scale);
  if (head_dim == 32) prefill_bf16<32>(query, key_cache, value_cache, table, context_len, s, out);
  if (head_dim == 64) prefill_bf16<64>(query, key_cache, value_cache, table, context_len, s, out);
  if (head_dim == 128) prefill_bf16<128>(query, key_cache, value_cache, table, context_len, s, out);
#endif
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def("prefill_attention_available() -> bool", &structgen_cpu::prefill_attention_available);
  m.def(
      "prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, int context_len, "
      "float scale, Tensor(a!) out) -> ()");
  m.impl("prefill_attention", c10::DispatchKey::CPU, &structgen_cpu::prefill_attention);
}
