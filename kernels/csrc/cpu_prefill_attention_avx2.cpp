// Causal attention of one sequence's prompt chunk in fp32 on AVX2 + FMA (no AVX-512): the flash-attention loop of
// `cpu_prefill_attention.cpp` (keys and values read from the paged cache through the block table, repacked once a
// call; exact online softmax in fp32) with register tiles sized for AVX2's 16 ymm registers.
//
// Why: a CPU without AVX-512 runs the model in fp32, and its prompts' attention went to torch's SDPA: ~10% of a
// 384-token prefill and ~24% of a 1,022-token one on a 2-core Zen 3, at ~40% of the cores' FMA peak. This kernel:
// ~70% of one core's peak on long prompts, ~64% of both cores' (106 GFLOP/s at 2,048 tokens), 1.6-2.8x faster
// than SDPA from 2,048 tokens down to 128. Measurements: BENCHMARKS.md, "AVX2 prefill attention".
//
// Register tiles: a score pass holds 6 query rows x 16 keys (12 accumulators, 2 key vectors, 1 broadcast: 15 of
// the 16 registers), reading 2 key vectors and 6 broadcast query scalars per 12 FMAs; a value pass holds 6 rows
// x 16 dims the same way, the softmax weights broadcast against the values' dims. A task is 24 query rows (4
// passes) of one head against tiles of 64 keys: each 16-key block of keys (4 KB at D = 64) and each 16-dim strip
// of the tile's values serve the 4 row passes from L1. Tiles of 64 keys ran 3-5% faster than 32 (half the
// softmax's per-row bookkeeping); 128 gained ~3% more on 1,024-2,048 tokens but lost ~5% at 128: kept 64.
//
// Layouts, per KV head, keys padded with zeros to a multiple of 64 (the causal mask hides the padding):
//   keys   [key group of 16][dim d][key j]   (a score pass's two key vectors are one 64-byte line)
//   values [key][dim d]                      (the cache's own row order)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu_avx2_vec.h"
#include "cpu_common.h"
#include "cpu_prefill_avx2.h"

namespace structgen_cpu {
namespace {

#if STRUCTGEN_AVX2

#define AVX2_TARGET STRUCTGEN_AVX2_TARGET

constexpr int kQueryTile = 24;  // query rows a task (one head): 4 passes of kPassRows
constexpr int kKeyTile = 64;  // keys a softmax step: 8 vectors a row
constexpr int kPassRows = 6;  // rows a score or value pass holds in registers
constexpr int kKeyVectors = kKeyTile / 8;
static_assert(kKeyTile % 16 == 0, "a tile is whole key groups of 16");

// A thread's packing buffer, reused across calls (one per layer: a fresh one cost page faults every layer), its
// start on a cache line so that a key group's two vectors never straddle lines.
struct AlignedBuffer {
  std::vector<float> data;
  float* get(size_t n) {
    data.resize(n + 16);
    const auto address = reinterpret_cast<uintptr_t>(data.data());
    return data.data() + ((64 - address % 64) % 64) / sizeof(float);
  }
};

// 2^x on 8 lanes, x <= 0 (scores minus their running max, in log2 units): 2^n in the exponent bits times a
// degree-6 polynomial for 2^f, f in [-0.5, 0.5] (Cephes' exp2f coefficients, ~2e-7 relative); 0 below -126,
// where masked scores (-inf) fall. Scores in log2 units (the scale times log2 e, applied where the score pass
// stores them) save exp's multiplications by log2 e and ln 2 and its upper clamp: with AVX2's 8 lanes the
// exponentials are a visible share of the kernel (~1 op a score for every 16 FMAs of the products at D = 64).
AVX2_TARGET inline __m256 exp2_8(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-126.0f);
  const __m256 c = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(c, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  for (const float coefficient : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f,
                                  2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f})
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(coefficient));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_and_ps(r, _mm256_cmp_ps(x, lowest, _CMP_GE_OQ));
}

// Scores of R rows against 16 keys (a key group [D][16]), times `scale` (log2 units), into s[row][kKeyTile].
template <int D, int R>
AVX2_TARGET inline void score_pass(const float* const* q, const float* k, float scale, float* s) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_load_ps(k + 16 * d), k1 = _mm256_load_ps(k + 16 * d + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 qb = _mm256_broadcast_ss(q[r] + d);
      acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
    }
  }
  const __m256 vs = _mm256_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(s + r * kKeyTile, _mm256_mul_ps(acc[r][0], vs));
    _mm256_store_ps(s + r * kKeyTile + 8, _mm256_mul_ps(acc[r][1], vs));
  }
}

// o[row][16 dims] += the R rows' weights w[row][kKeyTile] times the tile's values v[key][D] (at those dims), over
// the tile's first `keys` keys (the others' weights are 0 for these rows).
template <int D, int R>
AVX2_TARGET inline void value_pass(const float* w, const float* v, float* o, int keys) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = _mm256_load_ps(o + r * D);
    acc[r][1] = _mm256_load_ps(o + r * D + 8);
  }
  for (int key = 0; key < keys; ++key) {
    const __m256 v0 = _mm256_load_ps(v + key * D), v1 = _mm256_load_ps(v + key * D + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 wb = _mm256_broadcast_ss(w + r * kKeyTile + key);
      acc[r][0] = _mm256_fmadd_ps(wb, v0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(wb, v1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(o + r * D, acc[r][0]);
    _mm256_store_ps(o + r * D + 8, acc[r][1]);
  }
}

// The passes for the 1..kPassRows rows left, the count a template argument so the accumulators stay registers.
template <int D>
AVX2_TARGET inline void score_rows(const float* const* q, int rows, const float* k, float scale, float* s) {
  switch (rows) {
    case 1: return score_pass<D, 1>(q, k, scale, s);
    case 2: return score_pass<D, 2>(q, k, scale, s);
    case 3: return score_pass<D, 3>(q, k, scale, s);
    case 4: return score_pass<D, 4>(q, k, scale, s);
    case 5: return score_pass<D, 5>(q, k, scale, s);
    default: return score_pass<D, 6>(q, k, scale, s);
  }
}

template <int D>
AVX2_TARGET inline void value_rows(const float* w, int rows, const float* v, float* o, int keys) {
  switch (rows) {
    case 1: return value_pass<D, 1>(w, v, o, keys);
    case 2: return value_pass<D, 2>(w, v, o, keys);
    case 3: return value_pass<D, 3>(w, v, o, keys);
    case 4: return value_pass<D, 4>(w, v, o, keys);
    case 5: return value_pass<D, 5>(w, v, o, keys);
    default: return value_pass<D, 6>(w, v, o, keys);
  }
}

// A vector's lanes reduced by max or sum, for 8 vectors at once: lane i of the result is vector i's (the
// hadd pattern: 3 steps of shuffles for 8 rows, where one row alone takes 3 dependent steps too).
struct Max {
  AVX2_TARGET static __m256 op(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
};
struct Sum {
  AVX2_TARGET static __m256 op(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
};

template <typename Op>
AVX2_TARGET inline __m256 pairs(__m256 a, __m256 b) {  // per 128-bit half: a0.a1, a2.a3, b0.b1, b2.b3
  return Op::op(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));
}

template <typename Op>
AVX2_TARGET inline __m256 reduce8x8(const __m256 (&v)[8]) {
  const __m256 low = pairs<Op>(pairs<Op>(v[0], v[1]), pairs<Op>(v[2], v[3]));  // halves of vectors 0-3
  const __m256 high = pairs<Op>(pairs<Op>(v[4], v[5]), pairs<Op>(v[6], v[7]));
  return Op::op(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

// A row's kKeyVectors vectors reduced to one by a tree (short dependency chains).
template <typename Op>
AVX2_TARGET inline __m256 tree(const float* row) {
  __m256 v[kKeyVectors];
  for (int g = 0; g < kKeyVectors; ++g) v[g] = _mm256_load_ps(row + 8 * g);
  for (int width = kKeyVectors / 2; width > 0; width /= 2)
    for (int g = 0; g < width; ++g) v[g] = Op::op(v[g], v[g + width]);
  return v[0];
}

// Eight rows' scores of a key tile, s[8][kKeyTile], in place into their softmax weights under the running maxima
// m[8] and sums l[8], each row's factor for its earlier sums (2 ^ (old max - new)) into alpha[8]. Row i sees keys
// 0..first_visible + i of the tile (masked: some row sees fewer than all). Eight rows at once: one row at a time,
// each row a chain of dependent steps (max, reduce, a scalar exp, exponentials, sum, reduce), the kernel spent 26%
// of its time outside the two FMA loops (perf, 2,048 tokens), 19% this way, where the bookkeeping is vectors of
// 8 rows (3-9% faster overall). Rows past the task's hold zeros: finite, and never stored.
AVX2_TARGET inline void softmax8(float* s, int64_t first_visible, bool masked, float* m, float* l, float* alpha) {
  if (masked) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < 8; ++i) {
      const __m256 limit = _mm256_set1_ps(static_cast<float>(std::clamp<int64_t>(first_visible + i, -1, kKeyTile)));
      for (int g = 0; g < kKeyVectors; ++g) {
        float* p = s + i * kKeyTile + 8 * g;
        const __m256 hidden = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(8.0f * g)), limit, _CMP_GT_OQ);
        _mm256_store_ps(p, _mm256_blendv_ps(_mm256_load_ps(p), _mm256_set1_ps(-INFINITY), hidden));
      }
    }
  }
  __m256 top[8];
  for (int i = 0; i < 8; ++i) top[i] = tree<Max>(s + i * kKeyTile);
  // finite for every row of the task: each sees key 0 in the first tile, so `m` is finite from then on
  const __m256 old_max = _mm256_loadu_ps(m);
  const __m256 new_max = _mm256_max_ps(old_max, reduce8x8<Max>(top));
  const __m256 factor = exp2_8(_mm256_sub_ps(old_max, new_max));  // old -inf (the first tile): 0
  _mm256_storeu_ps(m, new_max);
  _mm256_storeu_ps(alpha, factor);
  __m256 sums[8];
  for (int i = 0; i < 8; ++i) {
    const __m256 shift = _mm256_broadcast_ss(m + i);
    float* row = s + i * kKeyTile;
    for (int g = 0; g < kKeyVectors; ++g)
      _mm256_store_ps(row + 8 * g, exp2_8(_mm256_sub_ps(_mm256_load_ps(row + 8 * g), shift)));
    sums[i] = tree<Sum>(row);
  }
  _mm256_storeu_ps(l, _mm256_fmadd_ps(_mm256_loadu_ps(l), factor, reduce8x8<Sum>(sums)));
}

struct Rows {
  const float* base;  // row 0 of the task's head
  int64_t stride;  // between rows
};

// Query rows [first, first + rows) of one head (positions offset + first + i) over the keys they see, from the
// packed keys and values of the head's KV head; `scale` in log2 units (see exp2_8).
template <int D>
AVX2_TARGET void attend_tile(Rows query, float* out, int64_t out_stride, const float* keys, const float* values,
                             int64_t first, int rows, int64_t offset, float scale) {
  constexpr int kPasses = (kQueryTile + kPassRows - 1) / kPassRows;
  static_assert(kQueryTile % 8 == 0, "the softmax takes rows 8 at a time");
  alignas(64) float s[kQueryTile * kKeyTile];
  alignas(64) float o[kQueryTile * D];
  float m[kQueryTile], l[kQueryTile], alpha[kQueryTile];
  const float* q[kQueryTile];
  for (int r = 0; r < rows; ++r) q[r] = query.base + (first + r) * query.stride;
  std::fill(m, m + kQueryTile, -INFINITY);
  std::fill(l, l + kQueryTile, 0.0f);
  std::fill(o, o + rows * D, 0.0f);
  // Zeros where no score pass writes: the rows past the task's, and key groups a pass skips (masked).
  std::fill(s, s + kQueryTile * kKeyTile, 0.0f);
  const int64_t first_pos = offset + first, last_pos = first_pos + rows - 1;
  for (int64_t j0 = 0; j0 <= last_pos; j0 += kKeyTile) {
    // The keys of this tile each row pass sees at all: on the diagonal the rest would only be masked (for a
    // 128-token prompt, ~a third of the products a whole tile would take).
    int seen[kPasses];
    for (int p = 0; p < kPasses && p * kPassRows < rows; ++p) {
      const int64_t pass_last = first_pos + std::min(rows, (p + 1) * kPassRows) - 1;
      seen[p] = static_cast<int>(std::clamp<int64_t>(pass_last - j0 + 1, 0, kKeyTile));
    }
    // Each key group's [D][16] block is reused by every row pass while it is in L1.
    for (int g = 0; g < kKeyTile / 16; ++g) {
      const float* kg = keys + (j0 + 16 * g) * D;
      for (int p = 0; p * kPassRows < rows; ++p) {
        const int r0 = p * kPassRows;
        if (16 * g < seen[p])
          score_rows<D>(q + r0, std::min(kPassRows, rows - r0), kg, scale, s + r0 * kKeyTile + 16 * g);
      }
    }
    const bool masked = j0 + kKeyTile - 1 > first_pos;
    for (int r0 = 0; r0 < rows; r0 += 8)
      softmax8(s + r0 * kKeyTile, first_pos + r0 - j0, masked, m + r0, l + r0, alpha + r0);
    for (int r = 0; r < rows; ++r) {
      if (alpha[r] != 1.0f) {
        const __m256 a = _mm256_set1_ps(alpha[r]);
        for (int c = 0; c < D; c += 8) _mm256_store_ps(o + r * D + c, _mm256_mul_ps(a, _mm256_load_ps(o + r * D + c)));
      }
    }
    for (int c = 0; c < D; c += 16) {
      for (int p = 0; p * kPassRows < rows; ++p) {
        const int r0 = p * kPassRows;
        if (seen[p] > 0)
          value_rows<D>(s + r0 * kKeyTile, std::min(kPassRows, rows - r0), values + j0 * D + c, o + r0 * D + c,
                        seen[p]);
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const __m256 inv = _mm256_set1_ps(1.0f / l[r]);
    float* dst = out + (first + r) * out_stride;
    for (int c = 0; c < D; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_load_ps(o + r * D + c), inv));
  }
}

// Every KV head's context into the layouts above, one task a (KV head, group of 16 keys), each key's row found
// through the block table.
template <int D>
void pack(const float* kc, const float* vc, const int32_t* table, int64_t context_len, int64_t block_size,
          int64_t kv_heads, int64_t padded, float* keys, float* values) {
  const int64_t groups = padded / 16, slot_stride = kv_heads * D;
  at::parallel_for(0, kv_heads * groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / groups, g = task % groups;
      float* kdst = keys + (h * groups + g) * 16 * D;
      float* vdst = values + (h * padded + 16 * g) * D;
      for (int j = 0; j < 16; ++j) {
        const int64_t t = 16 * g + j;
        if (t >= context_len) {
          for (int d = 0; d < D; ++d) kdst[d * 16 + j] = 0.0f;
          std::fill(vdst + j * D, vdst + (j + 1) * D, 0.0f);
          continue;
        }
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        const float* k = kc + slot * slot_stride + h * D;
        for (int d = 0; d < D; ++d) kdst[d * 16 + j] = k[d];
        std::memcpy(vdst + j * D, vc + slot * slot_stride + h * D, D * sizeof(float));
      }
    }
  });
}

template <int D>
void prefill(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
             const int32_t* table, int64_t context_len, float scale, at::Tensor& out) {
  const int64_t q_len = query.size(0), heads = query.size(1);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = heads / kv_heads, offset = context_len - q_len;
  const int64_t padded = (context_len + kKeyTile - 1) / kKeyTile * kKeyTile;
  static thread_local AlignedBuffer keys_buffer, values_buffer;
  // Pointers taken here: inside the parallel region each thread would see its own (empty) thread_local copies.
  float* const keys = keys_buffer.get(kv_heads * padded * D);
  float* const values = values_buffer.get(kv_heads * padded * D);
  pack<D>(key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), table, context_len, block_size, kv_heads,
          padded, keys, values);
  const int64_t tiles = (q_len + kQueryTile - 1) / kQueryTile;
  // Tasks (KV head, query tile, head of the group), in that order so a thread's run reuses one KV head's packed
  // keys and values; a tile costs the key tiles it visits, which grow along the prompt: cut runs by cost.
  const std::vector<int64_t> cost = causal_tile_costs(kv_heads, group, q_len, offset, kQueryTile, kKeyTile);
  const std::vector<int64_t> bounds = cost_balanced_bounds(cost, at::get_num_threads());
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float log2_scale = scale * 1.44269504088896341f;
  const int64_t q_row = query.stride(0), q_head = query.stride(1), o_row = out.stride(0), o_head = out.stride(1);
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t part_begin, int64_t part_end) {
    for (int64_t task = bounds[part_begin]; task < bounds[part_end]; ++task) {
      const int64_t kv_head = task / (tiles * group), tile = task / group % tiles;
      const int64_t head = kv_head * group + task % group, first = tile * kQueryTile;
      const int rows = static_cast<int>(std::min<int64_t>(kQueryTile, q_len - first));
      attend_tile<D>(Rows{q + head * q_head, q_row}, o + head * o_head, o_row, keys + kv_head * padded * D,
                     values + kv_head * padded * D, first, rows, offset, log2_scale);
    }
  });
}

#endif  // STRUCTGEN_AVX2

}  // namespace

bool prefill_attention_avx2_usable() {
#if STRUCTGEN_AVX2
  return avx2::usable();
#else
  return false;
#endif
}

void prefill_attention_avx2(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const int32_t* table, int64_t context_len, float scale, at::Tensor& out) {
  TORCH_CHECK(prefill_attention_avx2_usable(), "prefill_attention: this CPU (or build) has no AVX2 with FMA");
#if STRUCTGEN_AVX2
  switch (query.size(2)) {
    case 32: return prefill<32>(query, key_cache, value_cache, table, context_len, scale, out);
    case 64: return prefill<64>(query, key_cache, value_cache, table, context_len, scale, out);
    default: return prefill<128>(query, key_cache, value_cache, table, context_len, scale, out);
  }
#endif
}

}  // namespace structgen_cpu
