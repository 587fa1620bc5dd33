// Weight-only quantized product for a few rows on AVX2 (no AVX-512): y[M, N] = x[M, K] @ W^T from the packed
// Q4_1 / Q8_0 tiles of `cpu_woq_linear.cpp`, for fp32 or bf16 x and y. The same arithmetic as the VNNI GEMV
// (`cpu_woq_gemv.cpp`): x quantized to int16 per block of 32 (scale max|x| / 32767), integer dot products of the
// codes with x (VPMADDWD: pairs of int16 products summed into int32, which VPDPWSSD fuses with the add), each
// block's sums scaled once, y = sum_b dx_b (d_b sum q xq) + m_b sum x in fp32.
//
// Why: a CPU without AVX512-BF16 runs the model in fp32 (`"auto"` dtype), and a single stream's decode step is
// then one read of every fp32 weight: SmolLM2's 540 MB a token, where the GGUF's Q4_1 layers and Q8_0 lm_head
// are ~115 MB. Measured on a 2-core AVX2-only Zen 3 guest: BENCHMARKS.md, "AVX2 hosts".
//
// Layout (see `cpu_woq_linear.cpp`): tile (nb, kb) covers W[16 nb .. +15][32 kb .. +31]; its row r holds lanes
// l = 0..31 with lane l = W[16 nb + l / 2][32 kb + 2 r + l % 2]. 8 bits: 32 int8 a row, bytes 0-15 columns 0-7,
// bytes 16-31 columns 8-15. 4 bits: 16 bytes a row, byte b = lane b (low nibble, columns 0-7) and lane b + 16
// (high nibble, columns 8-15). So a row widened to int16 is, per half, one int32 lane per column for k-pair r:
// VPMADDWD against x's pair (x[2r], x[2r + 1]) broadcast gives that pair's products of eight columns.
#include <immintrin.h>

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

#define AVX2_TARGET STRUCTGEN_AVX2_TARGET
using avx2::load8;
using avx2::store8;

constexpr int kGroup = 32;  // weights per quantization block along K
constexpr int kTileN = 16;  // output columns per tile
constexpr int kPassRows = 3;  // rows of x per pass over a tile row (2 fp32 accumulators a row, 16 registers)
constexpr int kPrefetchBytes = 4096;  // how far ahead the codes are requested (as the VNNI kernel)
constexpr float kInt16Max = 32767.0f;
typedef int32_t __attribute__((may_alias)) AliasedInt32;  // two int16 codes read as one lane

// x as the products read it: int16 codes, and per row and block the scale dx and the exact sum of x (the Q4_1
// minimum multiplies it).
struct QuantizedRows {
  const int16_t* codes;  // [M, K]
  const float* scale;  // [M, K / 32]
  const float* sum;  // [M, K / 32]
  int64_t kb_count;

  // Row r's k-pair `pair` of block kb, as one int32 lane to broadcast.
  AVX2_TARGET inline __m256i pair(int r, int64_t kb, int p) const {
    const auto* block = reinterpret_cast<const AliasedInt32*>(codes + (r * kb_count + kb) * kGroup);
    return _mm256_set1_epi32(block[p]);
  }
};

template <typename T>
AVX2_TARGET void quantize_rows(const T* x, int64_t M, int64_t K, int16_t* codes, float* scale, float* sum) {
  const int64_t kb_count = K / kGroup;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const avx2::Block32 block = avx2::load_block(x + m * K + kb * kGroup);
      const __m256* v = block.v;
      const float amax = block.amax;
      const float inv = amax > 0.0f && std::isfinite(amax) ? kInt16Max / amax : 0.0f;
      scale[m * kb_count + kb] = amax / kInt16Max;
      sum[m * kb_count + kb] = block.sum;
      const __m256 vinv = _mm256_set1_ps(inv);
      int16_t* dst = codes + m * K + kb * kGroup;
      for (int i = 0; i < 4; i += 2) {
        // round to nearest even (the default mode), saturate to int16, and undo packs' per-half interleave
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], vinv));
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 * i), packed);
      }
    }
  }
}

AVX2_TARGET inline void prefetch_tiles(const void* tile, int tile_bytes, const uint16_t* d, const uint16_t* mins,
                                       int64_t kb) {
  const int ahead_tiles = kPrefetchBytes / tile_bytes;
  const char* ahead = reinterpret_cast<const char*>(tile) + ahead_tiles * tile_bytes;
  for (int line = 0; line < tile_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(d + (kb + ahead_tiles) * kTileN), _MM_HINT_T0);
  if (mins != nullptr) _mm_prefetch(reinterpret_cast<const char*>(mins + (kb + ahead_tiles) * kTileN), _MM_HINT_T0);
}

// Columns 16 nb .. 16 nb + 15 for rows 0..R-1 of x. `q`, `d`, `mins` (null at 8 bits) point at the tile row's
// first tile. S independent integer sums a row hide VPMADDWD's latency where few rows share the codes.
template <int Bits, int R, typename T, int S = (R == 1 ? 4 : R == 2 ? 2 : 1)>
AVX2_TARGET void tile_row(const uint8_t* q, const uint16_t* d, const uint16_t* mins, const QuantizedRows& x, T* y,
                          int64_t n_stride) {
  constexpr int kTileBytes = Bits == 4 ? 256 : 512;
  __m256 acc_lo[R], acc_hi[R];  // columns 0-7 and 8-15
  for (int r = 0; r < R; ++r) acc_lo[r] = acc_hi[r] = _mm256_setzero_ps();
  const __m256i low_nibble = _mm256_set1_epi16(0x0F);
  for (int64_t kb = 0; kb < x.kb_count; ++kb) {
    const uint8_t* tile = q + kb * kTileBytes;
    prefetch_tiles(tile, kTileBytes, d, mins, kb);
    __m256i dot_lo[R][S], dot_hi[R][S];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < S; ++c) dot_lo[r][c] = dot_hi[r][c] = _mm256_setzero_si256();
    for (int p = 0; p < 16; ++p) {  // k-pair p of the block, all 16 columns
      __m256i lo, hi;
      if constexpr (Bits == 4) {
        const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 16 * p)));
        lo = _mm256_and_si256(codes, low_nibble);
        hi = _mm256_srli_epi16(codes, 4);
      } else {
        lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 32 * p)));
        hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 32 * p + 16)));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xv = x.pair(r, kb, p);
        dot_lo[r][p % S] = _mm256_add_epi32(dot_lo[r][p % S], _mm256_madd_epi16(lo, xv));
        dot_hi[r][p % S] = _mm256_add_epi32(dot_hi[r][p % S], _mm256_madd_epi16(hi, xv));
      }
    }
    const uint16_t* dk = d + kb * kTileN;
    const __m256 d_lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dk)));
    const __m256 d_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dk + 8)));
    for (int r = 0; r < R; ++r) {
      for (int c = 1; c < S; ++c) {
        dot_lo[r][0] = _mm256_add_epi32(dot_lo[r][0], dot_lo[r][c]);
        dot_hi[r][0] = _mm256_add_epi32(dot_hi[r][0], dot_hi[r][c]);
      }
      const __m256 dx = _mm256_set1_ps(x.scale[r * x.kb_count + kb]);
      acc_lo[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lo[r][0]), _mm256_mul_ps(d_lo, dx), acc_lo[r]);
      acc_hi[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_hi[r][0]), _mm256_mul_ps(d_hi, dx), acc_hi[r]);
    }
    if constexpr (Bits == 4) {  // the blocks' minimum times the exact sum of x
      const uint16_t* mk = mins + kb * kTileN;
      const __m256 m_lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mk)));
      const __m256 m_hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mk + 8)));
      for (int r = 0; r < R; ++r) {
        const __m256 sx = _mm256_set1_ps(x.sum[r * x.kb_count + kb]);
        acc_lo[r] = _mm256_fmadd_ps(m_lo, sx, acc_lo[r]);
        acc_hi[r] = _mm256_fmadd_ps(m_hi, sx, acc_hi[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    store8(y + r * n_stride, acc_lo[r]);
    store8(y + r * n_stride + 8, acc_hi[r]);
  }
}

struct PackedWeight {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;
  int bits;
  int64_t kb_count;
};

// Rows 0 .. R - 1 of x (a pass's) against tile row nb.
template <int R, typename T>
AVX2_TARGET void pass(const PackedWeight& w, const QuantizedRows& x, int64_t nb, T* y, int64_t N) {
  const int64_t first = nb * w.kb_count;
  T* out = y + nb * kTileN;
  if (w.bits == 4) {
    tile_row<4, R>(w.q + first * 256, w.d + first * kTileN, w.m + first * kTileN, x, out, N);
  } else {
    tile_row<8, R>(w.q + first * 512, w.d + first * kTileN, nullptr, x, out, N);
  }
}

template <typename T>
AVX2_TARGET void woq_gemv_avx2_rows(const T* x, int64_t M, int64_t K, const PackedWeight& w, T* y, int64_t N) {
  const int64_t kb_count = K / kGroup;
  static thread_local std::vector<int16_t> codes;
  static thread_local std::vector<float> scales;
  codes.resize(M * K);
  scales.resize(2 * M * kb_count);
  // Pointers taken here: inside the parallel region each thread would see its own (empty) thread_local copies.
  int16_t* const xq = codes.data();
  float* const dx = scales.data();
  float* const sx = scales.data() + M * kb_count;
  quantize_rows(x, M, K, xq, dx, sx);
  const int64_t tiles = N / kTileN;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < tiles; ++nb) {
    // The tile row's codes stay in L1 between passes (<= 12 KB for K <= 1536 at 4 bits).
    for (int64_t r0 = 0; r0 < M; r0 += kPassRows) {
      const QuantizedRows xr{xq + r0 * K, dx + r0 * kb_count, sx + r0 * kb_count, kb_count};
      T* yr = y + r0 * N;
      switch (std::min<int64_t>(kPassRows, M - r0)) {
        case 1: pass<1>(w, xr, nb, yr, N); break;
        case 2: pass<2>(w, xr, nb, yr, N); break;
        default: pass<3>(w, xr, nb, yr, N); break;
      }
    }
  }
}

#endif  // STRUCTGEN_AVX2

}  // namespace

bool gemv_avx2_available() {
#if STRUCTGEN_AVX2
  return avx2::usable();
#else
  return false;
#endif
}

void woq_gemv_avx2(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                   int64_t bits, at::Tensor& out) {
  TORCH_CHECK(gemv_avx2_available(), "woq_gemv_avx2: this CPU (or kernel) cannot run AVX2 with FMA and F16C");
  check_woq_args("woq_gemv_avx2", x, qweight, scales, mins, bits, out, /*allow_fp32=*/true);
  const int64_t kb = qweight.size(1), M = x.size(0), K = x.size(1), N = qweight.size(0) * 16;
  if (M == 0) return;
#if STRUCTGEN_AVX2
  const PackedWeight w{reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                       reinterpret_cast<const uint16_t*>(scales.data_ptr()),
                       bits == 4 ? reinterpret_cast<const uint16_t*>(mins.data_ptr()) : nullptr, static_cast<int>(bits),
                       kb};
  if (x.scalar_type() == at::kFloat) {
    woq_gemv_avx2_rows(x.data_ptr<float>(), M, K, w, out.data_ptr<float>(), N);
  } else {
    woq_gemv_avx2_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, w,
                       reinterpret_cast<uint16_t*>(out.data_ptr()), N);
  }
#endif
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def("gemv_avx2_available() -> bool", &structgen_cpu::gemv_avx2_available);
  m.def("woq_gemv_avx2(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int bits, Tensor(a!) out) -> ()");
  m.impl("woq_gemv_avx2", c10::DispatchKey::CPU, &structgen_cpu::woq_gemv_avx2);
}
