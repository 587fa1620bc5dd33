// Weight-only quantized product on AVX2 with x quantized to int8: y[M, N] = x[M, K] @ W^T from the packed Q4_1
// tiles of `cpu_woq_linear.cpp` (4 bits only), for fp32 or bf16 x and y, any M.
//
// The arithmetic is llama.cpp's for Q4_1 weights on CPUs (its Q8_1 activations): x quantized to int8 per block of
// 32 (scale max|x| / 127, round to nearest even), integer dot products of the 4-bit codes with x, each block's
// sums scaled once, y = sum_b dx_b d_b (sum q xq) + m_b (sum x) in fp32, the Q4_1 minimum times the exact sum of
// x. `kernels/cpu_woq.py: woq_q8_reference` is that arithmetic in torch.
//
// Why: the int16 GEMV (`cpu_woq_gemv_avx2.cpp`) is bound by VPMADDWD, which Zen 3 (and Intel client cores) issue
// once a cycle: 16 products a cycle a core, no more than fp32 FMA. VPMADDUBSW takes bytes, 32 products an
// instruction at the same rate, and 4-bit codes times int8 x summed over 8 k-pairs still fit int16
// (8 * 2 * 15 * 127 = 30,480), so one VPADDW accumulates them and widening to int32 happens once a block. The
// precision cost is x's: int8 codes carry ~1/254 of each block's max, small against the 4-bit weights' own error
// (1/30 of each block's range). Measured on a 2-core Zen 3: BENCHMARKS.md, "Session 33".
//
// Layout (see `cpu_woq_linear.cpp`): tile (nb, kb) covers W[16 nb .. +15][32 kb .. +31]; its row r (k-pair r)
// holds lanes l = 0..31, lane l = W[16 nb + l / 2][32 kb + 2 r + l % 2], as 16 bytes: byte b = lane b (low
// nibble) and lane b + 16 (high nibble). The row broadcast to both 128-bit halves, the upper shifted right by 4,
// masked to nibbles, is the 32 lanes in order; VPMADDUBSW against x's pair (x[2r], x[2r + 1]) broadcast gives
// one int16 lane per column, columns 0-15 in order.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_avx2_vec.h"
#include "cpu_kernels.h"
#include "cpu_woq_checks.h"

namespace structgen_cpu {
namespace {

#if STRUCTGEN_AVX2

#define Q8_TARGET STRUCTGEN_AVX2_TARGET
using avx2::store8;

constexpr int kGroup = 32;  // weights per quantization block along K
constexpr int kTileN = 16;  // output columns per tile
constexpr int kTileBytes = 256;  // a 4-bit tile: 16 k-pairs of 16 bytes
constexpr int kPassRows = 4;  // rows of x per pass over a tile row (two int16 sums a row in registers)
constexpr int kPrefetchBytes = 4096;  // how far ahead the codes are requested
constexpr int64_t kChunkBytes = 16 * 1024;  // x's pairs a chunk of rows: half of a 32 KB L1
constexpr float kInt8Max = 127.0f;

// x as the products read it: per row and block, 16 int32 lanes each holding the block's k-pair p twice (bytes
// x[2p], x[2p + 1], x[2p], x[2p + 1]) so one VPBROADCASTD loads a pair for every column; the scale dx and the
// exact sum of x (the Q4_1 minimum multiplies it).
struct QuantizedRows {
  const int32_t* pairs;  // [M, K / 2]
  const float* scale;  // [M, K / 32]
  const float* sum;  // [M, K / 32]
  int64_t kb_count;

  Q8_TARGET inline __m256i pair(int r, int64_t kb, int p) const {
    return _mm256_set1_epi32(pairs[(r * kb_count + kb) * (kGroup / 2) + p]);
  }
};

template <typename T>
Q8_TARGET void quantize_rows(const T* x, int64_t M, int64_t K, int32_t* pairs, float* scale, float* sum) {
  const int64_t kb_count = K / kGroup;
  // A prompt chunk's rows in parallel: ~15% of the product's time at 512 rows otherwise.
#pragma omp parallel for schedule(static) if (M >= 16)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const avx2::Block32 block = avx2::load_block(x + m * K + kb * kGroup);
      const __m256* v = block.v;
      const float amax = block.amax;
      const float inv = amax > 0.0f && std::isfinite(amax) ? kInt8Max / amax : 0.0f;
      scale[m * kb_count + kb] = amax / kInt8Max;
      sum[m * kb_count + kb] = block.sum;
      const __m256 vinv = _mm256_set1_ps(inv);
      __m256i q[4];  // int32 codes in -127..127 (|x| * 127 / max|x| <= 127), rounded to nearest even
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv));
      // int32 -> int16 -> int8 keeps order within 128-bit halves: pack, then undo the halves' interleave
      const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      // each 16-bit pair twice: lanes 0-7 from pairs 0-7 and lanes 8-15 from pairs 8-15
      const __m256i pairs_lo = _mm256_unpacklo_epi16(bytes, bytes), pairs_hi = _mm256_unpackhi_epi16(bytes, bytes);
      int32_t* dst = pairs + (m * kb_count + kb) * (kGroup / 2);
      // unpack works within halves: lo = pairs 0-3 | 8-11, hi = pairs 4-7 | 12-15
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(pairs_lo, pairs_hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8), _mm256_permute2x128_si256(pairs_lo, pairs_hi, 0x31));
    }
  }
}

// The int16 sums of rows 0..R-1 over k-pairs first..first+7 of a tile (8 k-pairs: 4-bit codes times int8 x cannot
// overflow int16 in 8), one register a row, columns 0-15 in order.
template <int R>
Q8_TARGET inline void half_block(const uint8_t* tile, int first, const QuantizedRows& x, int64_t kb, __m256i* dot) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i upper_by_4 = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int p = first; p < first + 8; ++p) {
    const __m256i row = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 16 * p)));
    const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(row, upper_by_4), nibble);
    for (int r = 0; r < R; ++r) dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(codes, x.pair(r, kb, p)));
  }
}

// Columns 16 nb .. 16 nb + 15 for rows 0..R-1 of x. `q`, `d`, `mins` point at the tile row's first tile. The fp32
// sums live in `acc` (L1) rather than registers: AVX2's 16 hold the loop's 2R int16 sums, the codes and x.
//
// A block's two int16 halves become int32 column sums in two steps: interleaving them (VPUNPCKLWD / HWD) puts
// each column's two halves side by side, and VPMADDWD by ones adds the pairs. The unpacks work within 128-bit
// halves, so the sums come out in the column order {0-3, 8-11} and {4-7, 12-15}; the scales are loaded in that
// order and the fp32 sums put back in order once, at the store.
template <int R, typename T>
Q8_TARGET void tile_row(const uint8_t* q, const uint16_t* d, const uint16_t* mins, const QuantizedRows& x, T* y,
                        int64_t n_stride) {
  alignas(32) float acc[R][kTileN] = {};  // per row: columns {0-3, 8-11}, then {4-7, 12-15}
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t kb = 0; kb < x.kb_count; ++kb) {
    const uint8_t* tile = q + kb * kTileBytes;
    constexpr int ahead = kPrefetchBytes / kTileBytes;
    for (int line = 0; line < kTileBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(tile) + ahead * kTileBytes + line, _MM_HINT_T0);
    }
    __m256i first[R], second[R];
    half_block<R>(tile, 0, x, kb, first);
    half_block<R>(tile, 8, x, kb, second);
    const __m128i d_lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + kb * kTileN));
    const __m128i d_hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + kb * kTileN + 8));
    const __m128i m_lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + kb * kTileN));
    const __m128i m_hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + kb * kTileN + 8));
    const __m256 d_a = _mm256_cvtph_ps(_mm_unpacklo_epi64(d_lo, d_hi));  // columns 0-3, 8-11
    const __m256 d_b = _mm256_cvtph_ps(_mm_unpackhi_epi64(d_lo, d_hi));  // columns 4-7, 12-15
    const __m256 m_a = _mm256_cvtph_ps(_mm_unpacklo_epi64(m_lo, m_hi));
    const __m256 m_b = _mm256_cvtph_ps(_mm_unpackhi_epi64(m_lo, m_hi));
    for (int r = 0; r < R; ++r) {
      const __m256i sum_a = _mm256_madd_epi16(_mm256_unpacklo_epi16(first[r], second[r]), ones);
      const __m256i sum_b = _mm256_madd_epi16(_mm256_unpackhi_epi16(first[r], second[r]), ones);
      const __m256 dx = _mm256_set1_ps(x.scale[r * x.kb_count + kb]);
      const __m256 sx = _mm256_set1_ps(x.sum[r * x.kb_count + kb]);
      // d dx times the integer sums, plus the blocks' minimum times the exact sum of x
      __m256 a = _mm256_fmadd_ps(m_a, sx, _mm256_load_ps(acc[r]));
      __m256 b = _mm256_fmadd_ps(m_b, sx, _mm256_load_ps(acc[r] + 8));
      _mm256_store_ps(acc[r], _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_a), _mm256_mul_ps(d_a, dx), a));
      _mm256_store_ps(acc[r] + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_b), _mm256_mul_ps(d_b, dx), b));
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 a = _mm256_load_ps(acc[r]), b = _mm256_load_ps(acc[r] + 8);
    store8(y + r * n_stride, _mm256_permute2f128_ps(a, b, 0x20));  // columns 0-3, 4-7
    store8(y + r * n_stride + 8, _mm256_permute2f128_ps(a, b, 0x31));  // columns 8-11, 12-15
  }
}

struct PackedWeight {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;
  int64_t kb_count;
};

template <int R, typename T>
Q8_TARGET void pass(const PackedWeight& w, const QuantizedRows& x, int64_t nb, T* y, int64_t N) {
  const int64_t first = nb * w.kb_count;
  tile_row<R>(w.q + first * kTileBytes, w.d + first * kTileN, w.m + first * kTileN, x, y + nb * kTileN, N);
}

template <typename T>
Q8_TARGET void woq_q8_rows(const T* x, int64_t M, int64_t K, const PackedWeight& w, T* y, int64_t N) {
  const int64_t kb_count = K / kGroup;
  static thread_local std::vector<int32_t> codes;
  static thread_local std::vector<float> scales;
  codes.resize(M * K / 2);
  scales.resize(2 * M * kb_count);
  // Pointers taken here: inside the parallel region each thread would see its own (empty) thread_local copies.
  int32_t* const xq = codes.data();
  float* const dx = scales.data();
  float* const sx = scales.data() + M * kb_count;
  quantize_rows(x, M, K, xq, dx, sx);
  const int64_t tiles = N / kTileN;
  // Each thread takes a contiguous share of the tile rows and passes it over chunks of x's rows small enough to
  // stay in L1 (x's pairs are broadcast once a k-pair and row); a tile row's codes stay in L1 for a chunk's passes.
  const int64_t chunk = std::max<int64_t>(kPassRows, (kChunkBytes / (2 * K)) / kPassRows * kPassRows);
#pragma omp parallel
  {
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const int64_t nb0 = tiles * thread / threads, nb1 = tiles * (thread + 1) / threads;
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t c1 = std::min(M, c0 + chunk);
      for (int64_t nb = nb0; nb < nb1; ++nb) {
        for (int64_t r0 = c0; r0 < c1; r0 += kPassRows) {
          const QuantizedRows xr{xq + r0 * K / 2, dx + r0 * kb_count, sx + r0 * kb_count, kb_count};
          T* yr = y + r0 * N;
          switch (std::min<int64_t>(kPassRows, c1 - r0)) {
            case 1: pass<1>(w, xr, nb, yr, N); break;
            case 2: pass<2>(w, xr, nb, yr, N); break;
            case 3: pass<3>(w, xr, nb, yr, N); break;
            default: pass<4>(w, xr, nb, yr, N); break;
          }
        }
      }
    }
  }
}

#endif  // STRUCTGEN_AVX2

}  // namespace

bool woq_q8_avx2_available() {
#if STRUCTGEN_AVX2
  return avx2::usable();
#else
  return false;
#endif
}

void woq_q8_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                 int64_t bits, at::Tensor& out) {
  TORCH_CHECK(woq_q8_avx2_available(), "woq_q8_avx2: this CPU (or kernel) cannot run AVX2 with FMA and F16C");
  check_woq_args("woq_q8_avx2", x, qweight, scales, mins, bits, out, /*allow_fp32=*/true);
  TORCH_CHECK(bits == 4, "woq_q8_avx2: only 4-bit (Q4_1) weights, got ", bits, " bits");
  const int64_t kb = qweight.size(1), M = x.size(0), K = x.size(1), N = qweight.size(0) * 16;
  if (M == 0) return;
#if STRUCTGEN_AVX2
  const PackedWeight w{reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                       reinterpret_cast<const uint16_t*>(scales.data_ptr()),
                       reinterpret_cast<const uint16_t*>(mins.data_ptr()), kb};
  if (x.scalar_type() == at::kFloat) {
    woq_q8_rows(x.data_ptr<float>(), M, K, w, out.data_ptr<float>(), N);
  } else {
    woq_q8_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, w, reinterpret_cast<uint16_t*>(out.data_ptr()),
                N);
  }
#endif
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def("woq_q8_avx2_available() -> bool", &structgen_cpu::woq_q8_avx2_available);
  m.def("woq_q8_avx2(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int bits, Tensor(a!) out) -> ()");
  m.impl("woq_q8_avx2", c10::DispatchKey::CPU, &structgen_cpu::woq_q8_avx2);
}
