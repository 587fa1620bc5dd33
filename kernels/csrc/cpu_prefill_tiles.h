// The element-specific halves of the prompt attention (`cpu_prefill_attention.cpp`), one policy per dtype:
// how the context's keys and values are repacked, a tile of scores, the weighted sum of a tile's values, how the
// softmax weights are kept, and the output's store. bf16 multiplies on AVX512-BF16 (VDPBF16PS, pairs of bf16 into
// fp32, weights rounded to bf16); fp32 on AVX-512F (FMA, weights kept in fp32, the exact reference arithmetic up
// to summation order).
//
// Layouts, per KV head, keys padded to a multiple of 64 with zeros:
//   bf16 keys   [key group of 16][dim pair p][key j]  int32 = bf16 pair (k[2p], k[2p + 1]) of key 16 g + j
//   bf16 values [key pair kp][dim d][2]               bf16 v[2 kp][d], v[2 kp + 1][d]
//   fp32 keys   [key group of 16][dim d][key j]
//   fp32 values [key][dim d]
// Either way a tile of 64 keys spans 4 x 16 x kKeyWords key words and 64 x D value words.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include <ATen/Parallel.h>

namespace structgen_cpu {
namespace prefill {

#if defined(__AVX512F__)

constexpr int kKeyTile = 64;  // keys a tile: 4 vectors of 16 scores a row
constexpr int kScoreRows = 4;  // rows a score pass holds in registers: 4 rows x 4 key vectors = 16 accumulators
typedef int32_t __attribute__((may_alias)) AliasedInt32;  // a bf16 pair read as one broadcast lane

// Rows a value pass holds: 16 accumulators of 16 dims (8 rows of 32 dims, 4 of 64, 2 of 128).
template <int D>
constexpr int value_rows() {
  return 16 / (D / 16) > 8 ? 8 : 16 / (D / 16);
}

// Both policies walk the same tasks: (KV head, group of 16 keys), the key's row of the paged cache found through
// the block table. `put(kdst, vdst, j, k, v)` writes key j of the group (k, v null: a zero past the context).
template <typename Elem, typename Put>
void pack_groups(const Elem* kc, const Elem* vc, const int32_t* table, int64_t context_len, int64_t block_size,
                 int64_t kv_heads, int64_t head_dim, int64_t key_groups, Put put) {
  const int64_t slot_stride = kv_heads * head_dim;
  at::parallel_for(0, kv_heads * key_groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / key_groups, g = task % key_groups;
      for (int j = 0; j < 16; ++j) {
        const int64_t t = 16 * g + j;
        if (t >= context_len) {
          put(h, g, j, nullptr, nullptr);
          continue;
        }
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        put(h, g, j, kc + slot * slot_stride + h * head_dim, vc + slot * slot_stride + h * head_dim);
      }
    }
  });
}

// A score pass's sums, scaled, into s[row][64].
inline void store_scores(const __m512 (&acc)[kScoreRows][4], int rows, float scale, float* s) {
  const __m512 vs = _mm512_set1_ps(scale);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(s + r * kKeyTile + 16 * g, _mm512_mul_ps(acc[r][g], vs));
}

// A value pass's running sums o[row][D], in and out of registers.
template <int D, int R>
inline void load_sums(__m512 (&acc)[R][D / 16], int rows, const float* o) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < D / 16; ++c) acc[r][c] = _mm512_loadu_ps(o + r * D + 16 * c);
}

template <int D, int R>
inline void store_sums(const __m512 (&acc)[R][D / 16], int rows, float* o) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(o + r * D + 16 * c, acc[r][c]);
}

template <int D>
struct F32Tiles {
  using Elem = float;
  using KeyWord = float;
  using ValueWord = float;
  using WeightWord = float;
  static constexpr int kKeyWords = D;
  static constexpr int kWeightWords = kKeyTile;

  static void pack(const Elem* kc, const Elem* vc, const int32_t* table, int64_t context_len, int64_t block_size,
                   int64_t kv_heads, KeyWord* keys, ValueWord* values, int64_t key_groups) {
    pack_groups(kc, vc, table, context_len, block_size, kv_heads, D, key_groups,
                [&](int64_t h, int64_t g, int j, const float* k, const float* v) {
                  float* kdst = keys + (h * key_groups + g) * 16 * D;
                  float* vdst = values + ((h * key_groups + g) * 16 + j) * D;
                  for (int d = 0; d < D; ++d) {
                    kdst[d * 16 + j] = k ? k[d] : 0.0f;
                    vdst[d] = v ? v[d] : 0.0f;
                  }
                });
  }

  static inline void scores(const Elem* const* q, int rows, const KeyWord* keys, int64_t tile, float scale,
                            float* s) {
    __m512 acc[kScoreRows][4];
    for (int r = 0; r < kScoreRows; ++r)
      for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
    const float* k0 = keys + tile * 4 * D * 16;
    for (int d = 0; d < D; ++d) {
      __m512 kv[4];
      for (int g = 0; g < 4; ++g) kv[g] = _mm512_loadu_ps(k0 + (g * D + d) * 16);
      for (int r = 0; r < kScoreRows; ++r) {
        if (r >= rows) break;
        const __m512 qb = _mm512_set1_ps(q[r][d]);
        for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_fmadd_ps(qb, kv[g], acc[r][g]);
      }
    }
    store_scores(acc, rows, scale, s);
  }

  template <int R>
  static inline void add_values(const WeightWord* w, int rows, const ValueWord* values, int64_t tile, float* o) {
    constexpr int V = D / 16;
    __m512 acc[R][V];
    load_sums<D>(acc, rows, o);
    const float* v0 = values + tile * kKeyTile * D;
    for (int key = 0; key < kKeyTile; ++key) {
      __m512 vv[V];
      for (int c = 0; c < V; ++c) vv[c] = _mm512_loadu_ps(v0 + key * D + 16 * c);
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        const __m512 wb = _mm512_set1_ps(w[r * kWeightWords + key]);
        for (int c = 0; c < V; ++c) acc[r][c] = _mm512_fmadd_ps(wb, vv[c], acc[r][c]);
      }
    }
    store_sums<D>(acc, rows, o);
  }

  static inline void weights(const __m512 (&p)[4], WeightWord* w) {
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(w + 16 * g, p[g]);
  }

  static inline void store(const float* o, float inv, Elem* dst) {
    for (int c = 0; c < D / 16; ++c)
      _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), _mm512_set1_ps(inv)));
  }
};

#if defined(__AVX512BF16__)

template <int D>
struct Bf16Tiles {
  using Elem = uint16_t;
  using KeyWord = int32_t;
  using ValueWord = uint16_t;
  using WeightWord = int32_t;
  static constexpr int kKeyWords = D / 2;
  static constexpr int kWeightWords = kKeyTile / 2;

  static void pack(const Elem* kc, const Elem* vc, const int32_t* table, int64_t context_len, int64_t block_size,
                   int64_t kv_heads, KeyWord* keys, ValueWord* values, int64_t key_groups) {
    pack_groups(kc, vc, table, context_len, block_size, kv_heads, D, key_groups,
                [&](int64_t h, int64_t g, int j, const uint16_t* k, const uint16_t* v) {
                  int32_t* kdst = keys + (h * key_groups + g) * kKeyWords * 16;
                  uint16_t* vdst = values + (h * key_groups + g) * 16 * D;  // the group's 8 key pairs
                  const auto* kp = reinterpret_cast<const AliasedInt32*>(k);
                  for (int p = 0; p < kKeyWords; ++p) kdst[p * 16 + j] = k ? kp[p] : 0;
                  for (int d = 0; d < D; ++d) vdst[((j / 2) * D + d) * 2 + j % 2] = v ? v[d] : 0;
                });
  }

  static inline void scores(const Elem* const* q, int rows, const KeyWord* keys, int64_t tile, float scale,
                            float* s) {
    __m512 acc[kScoreRows][4];
    for (int r = 0; r < kScoreRows; ++r)
      for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
    const int32_t* k0 = keys + tile * 4 * kKeyWords * 16;
    for (int p = 0; p < kKeyWords; ++p) {
      __m512bh kv[4];
      for (int g = 0; g < 4; ++g) kv[g] = (__m512bh)_mm512_loadu_si512(k0 + (g * kKeyWords + p) * 16);
      for (int r = 0; r < kScoreRows; ++r) {
        if (r >= rows) break;
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const AliasedInt32*>(q[r])[p]);
        for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], qb, kv[g]);
      }
    }
    store_scores(acc, rows, scale, s);
  }

  template <int R>
  static inline void add_values(const WeightWord* w, int rows, const ValueWord* values, int64_t tile, float* o) {
    constexpr int V = D / 16;
    __m512 acc[R][V];
    load_sums<D>(acc, rows, o);
    const uint16_t* v0 = values + tile * kKeyTile * D;
    for (int kp = 0; kp < kKeyTile / 2; ++kp) {
      __m512bh vv[V];
      for (int c = 0; c < V; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v0 + (kp * D + 16 * c) * 2);
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        const __m512bh wb = (__m512bh)_mm512_set1_epi32(w[r * kWeightWords + kp]);
        for (int c = 0; c < V; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wb, vv[c]);
      }
    }
    store_sums<D>(acc, rows, o);
  }

  // bf16 weights, keys in order: cvtne2ps puts its second operand in the low half
  static inline void weights(const __m512 (&p)[4], WeightWord* w) {
    for (int g = 0; g < 2; ++g) _mm512_storeu_si512(w + 16 * g, (__m512i)_mm512_cvtne2ps_pbh(p[2 * g + 1], p[2 * g]));
  }

  static inline void store(const float* o, float inv, Elem* dst) {
    for (int c = 0; c < D / 16; ++c) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), _mm512_set1_ps(inv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), (__m256i)y);
    }
  }
};

#endif  // __AVX512BF16__
#endif  // __AVX512F__

}  // namespace prefill
}  // namespace structgen_cpu
