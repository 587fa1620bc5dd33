// Weight-only quantized matrix-vector product on AVX512-VNNI: y[M, N] = x[M, K] @ W^T for a few rows of x (a
// single stream's decode step), on the same packed 4-bit (Q4_1) / 8-bit (Q8_0) weights as `cpu_woq_linear.cpp`.
//
// Why: at one row a step is one read of every weight, and AMX tiles (16 rows of x) or torch's int4 kernel leave
// most of the memory bandwidth unused (measured on SmolLM2's shapes: 7-17 GB/s of the ~40 GB/s two cores can
// read). Here x is quantized to int16 per block of 32 (scale max|x| / 32767: an absolute error below 1/65534 of
// the block's largest value, far under bf16's own rounding of x), so the codes multiply x with integer
// dot products (VPDPWSSD: pairs of int16 products summed into int32) straight from the packed bytes, and each
// block's sums are scaled once: y = sum_b dx_b (d_b sum q xq) + m_b sum x, in fp32, rounded to bf16 at the end.
//
// Layout (see `cpu_woq_linear.cpp`): tile (nb, kb) covers W[16 nb .. +15][32 kb .. +31]; its row r holds lanes
// l = 0..31 with lane l = W[16 nb + l / 2][32 kb + 2 r + l % 2]. 8 bits: 32 int8 a row, so one row widened to
// int16 gives one int32 lane per column and k-pair r. 4 bits: 16 bytes a row (byte b = lane b low, lane b + 16
// high); two rows r, r + 1 widened together give, in their low nibbles, columns 0-7 for k-pairs r (lanes 0-7)
// and r + 1 (lanes 8-15), and in their high nibbles columns 8-15 the same way: x is laid out to match
// (`spread_pairs`) and the two halves of each accumulator are added at the end.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "cpu_woq_checks.h"

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define STRUCTGEN_VNNI 1
#else
#define STRUCTGEN_VNNI 0
#endif

namespace structgen_cpu {
namespace {

#if STRUCTGEN_VNNI

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

constexpr int kGroup = 32;  // weights per quantization block along K
constexpr int kTileN = 16;  // output columns per tile
constexpr int kPassRows = 4;  // rows of x per pass over a tile's K extent (accumulators: 5 zmm a row)
constexpr float kInt16Max = 32767.0f;
// How far ahead of the products the codes are pulled into L1. At one row a step is a stream of the weights from
// DRAM (SmolLM2: ~97 MB a token); the hardware prefetchers alone left it at ~13 GB/s of the VM's ~20-25, and
// 2-8 KB ahead all measured alike (BENCHMARKS.md, session 6).
constexpr int kPrefetchBytes = 4096;
typedef int32_t __attribute__((may_alias)) AliasedInt32;  // two int16 codes read as one VPDPWSSD lane

bool vnni_usable() {
  static const bool usable = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  }();
  return usable;
}

// x as the kernel reads it: int16 codes, and per row and block the scale dx and the exact sum of x (the Q4_1
// minimum multiplies it).
struct QuantizedX {
  const int16_t* codes;  // [M, K]
  const __m512i* pairs;  // 4 bits: [M, K / 32, 8] (`spread_pairs`)
  const float* scale;  // [M, K / 32]
  const float* sum;  // [M, K / 32]
  int64_t kb_count;
};

VNNI_TARGET inline __m512 load_bf16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// 4 bits: vector i of a block has k-pair 2i in lanes 0-7 and k-pair 2i + 1 in lanes 8-15.
VNNI_TARGET inline void spread_pairs(const int16_t* block, __m512i* out) {
  const __m512i pairs = _mm512_loadu_si512(block);  // 16 int32 lanes, lane p = k-pair p of the block
  for (int i = 0; i < 8; ++i) {
    const __m512i idx = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(2 * i), _mm512_set1_epi32(2 * i + 1));
    out[i] = _mm512_permutexvar_epi32(idx, pairs);
  }
}

VNNI_TARGET void quantize_x(const uint16_t* x, int64_t M, int64_t K, int bits, int16_t* codes, __m512i* pairs,
                            float* scale, float* sum) {
  const int64_t kb_count = K / kGroup;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const uint16_t* src = x + m * K + kb * kGroup;
      const __m512 a = load_bf16(src), b = load_bf16(src + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float inv = amax > 0.0f && std::isfinite(amax) ? kInt16Max / amax : 0.0f;
      scale[m * kb_count + kb] = amax / kInt16Max;
      sum[m * kb_count + kb] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
      const __m512 vinv = _mm512_set1_ps(inv);
      int16_t* dst = codes + m * K + kb * kGroup;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, vinv))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, vinv))));
      if (bits == 4) spread_pairs(dst, pairs + (m * kb_count + kb) * 8);
    }
  }
}

// fp32 to bf16 bits, rounded to nearest even (NaN stays NaN), without needing AVX512-BF16.
VNNI_TARGET inline void store_bf16(uint16_t* out, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(rounded));
}

// Columns 16 nb .. 16 nb + 15 of rows 0..R-1 of x (4 bits). `q`, `d`, `mins` point at the tile row's first tile.
template <int R, int S = (R == 1 ? 4 : R == 2 ? 2 : 1)>
VNNI_TARGET void tile_row_q4(const uint8_t* q, const uint16_t* d, const uint16_t* mins, const QuantizedX& x,
                             uint16_t* y, int64_t n_stride) {
  __m512 acc_lo[R], acc_hi[R], acc_min[R];
  for (int r = 0; r < R; ++r) acc_lo[r] = acc_hi[r] = acc_min[r] = _mm512_setzero_ps();
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  const __m512i lo_cols = _mm512_set_epi32(7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
  for (int64_t kb = 0; kb < x.kb_count; ++kb) {
    const uint8_t* tile = q + kb * 256;
    {
      const int ahead_tiles = kPrefetchBytes / 256;
      const char* ahead = reinterpret_cast<const char*>(tile) + ahead_tiles * 256;
      for (int line = 0; line < 256; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(d + (kb + ahead_tiles) * kTileN), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(mins + (kb + ahead_tiles) * kTileN), _MM_HINT_T0);
    }
    // S independent sums a row: VPDPWSSD's latency (~5 cycles) would otherwise chain the block's 8 products.
    __m512i dot_lo[R][S], dot_hi[R][S];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < S; ++c) dot_lo[r][c] = dot_hi[r][c] = _mm512_setzero_si512();
    }
    for (int p = 0; p < 8; ++p) {  // tile rows 2p, 2p + 1
      const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * p)));
      const __m512i lo = _mm512_and_si512(codes, low_nibble), hi = _mm512_srli_epi16(codes, 4);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_load_si512(x.pairs + (r * x.kb_count + kb) * 8 + p);
        dot_lo[r][p % S] = _mm512_dpwssd_epi32(dot_lo[r][p % S], lo, xv);
        dot_hi[r][p % S] = _mm512_dpwssd_epi32(dot_hi[r][p % S], hi, xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 1; c < S; ++c) {
        dot_lo[r][0] = _mm512_add_epi32(dot_lo[r][0], dot_lo[r][c]);
        dot_hi[r][0] = _mm512_add_epi32(dot_hi[r][0], dot_hi[r][c]);
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + kb * kTileN)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + kb * kTileN)));
    const __m512 d_lo = _mm512_permutexvar_ps(lo_cols, dv), d_hi = _mm512_permutexvar_ps(hi_cols, dv);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.scale[r * x.kb_count + kb]);
      acc_lo[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_lo[r][0]), _mm512_mul_ps(d_lo, dx), acc_lo[r]);
      acc_hi[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_hi[r][0]), _mm512_mul_ps(d_hi, dx), acc_hi[r]);
      acc_min[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x.sum[r * x.kb_count + kb]), acc_min[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    // lanes 0-7 and 8-15 of each half hold the same columns (even and odd k-pairs): add them
    const __m256 lo = _mm256_add_ps(_mm512_castps512_ps256(acc_lo[r]), _mm512_extractf32x8_ps(acc_lo[r], 1));
    const __m256 hi = _mm256_add_ps(_mm512_castps512_ps256(acc_hi[r]), _mm512_extractf32x8_ps(acc_hi[r], 1));
    const __m512 cols = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
    store_bf16(y + r * n_stride, _mm512_add_ps(cols, acc_min[r]));
  }
}

template <int R, int S = (R == 1 ? 4 : R == 2 ? 2 : 1)>
VNNI_TARGET void tile_row_q8(const int8_t* q, const uint16_t* d, const QuantizedX& x, uint16_t* y, int64_t n_stride) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < x.kb_count; ++kb) {
    const int8_t* tile = q + kb * 512;
    {
      const int ahead_tiles = kPrefetchBytes / 512;
      const char* ahead = reinterpret_cast<const char*>(tile) + ahead_tiles * 512;
      for (int line = 0; line < 512; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(d + (kb + ahead_tiles) * kTileN), _MM_HINT_T0);
    }
    __m512i dot[R][S];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < S; ++c) dot[r][c] = _mm512_setzero_si512();
    }
    for (int row = 0; row < 16; ++row) {  // k-pair `row` of the block, all 16 columns
      const __m512i codes = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * row)));
      for (int r = 0; r < R; ++r) {
        const int32_t pair = reinterpret_cast<const AliasedInt32*>(x.codes + r * x.kb_count * kGroup + kb * kGroup)[row];
        dot[r][row % S] = _mm512_dpwssd_epi32(dot[r][row % S], codes, _mm512_set1_epi32(pair));
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 1; c < S; ++c) dot[r][0] = _mm512_add_epi32(dot[r][0], dot[r][c]);
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + kb * kTileN)));
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(x.scale[r * x.kb_count + kb]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][0]), _mm512_mul_ps(dv, dx), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_bf16(y + r * n_stride, acc[r]);
}

struct PackedWeight {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;
  int bits;
  int64_t kb_count;
};

// Rows r0 .. r0 + R - 1 of x against tile row nb.
template <int R>
VNNI_TARGET void pass(const PackedWeight& w, const QuantizedX& x, int64_t nb, uint16_t* y, int64_t N) {
  const int64_t first = nb * w.kb_count;
  uint16_t* out = y + nb * kTileN;
  if (w.bits == 4) {
    tile_row_q4<R>(w.q + first * 256, w.d + first * kTileN, w.m + first * kTileN, x, out, N);
  } else {
    tile_row_q8<R>(reinterpret_cast<const int8_t*>(w.q) + first * 512, w.d + first * kTileN, x, out, N);
  }
}

VNNI_TARGET void woq_gemv_vnni(const uint16_t* x, int64_t M, int64_t K, const PackedWeight& w, uint16_t* y,
                               int64_t N) {
  const int64_t kb_count = K / kGroup;
  static thread_local std::vector<int16_t> codes;
  static thread_local std::vector<int32_t> pairs;  // as __m512i, 64-byte aligned below
  static thread_local std::vector<float> scales;
  codes.resize(M * K);
  pairs.resize((w.bits == 4 ? M * kb_count * 8 * 16 : 0) + 16);
  scales.resize(2 * M * kb_count);
  // Pointers taken here: inside the parallel region each thread would see its own (empty) thread_local copies.
  int16_t* const xq = codes.data();
  __m512i* const xp = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(pairs.data()) + 63) & ~uintptr_t(63));
  float* const dx = scales.data();
  float* const sx = scales.data() + M * kb_count;
  quantize_x(x, M, K, w.bits, xq, xp, dx, sx);
  const int64_t tiles = N / kTileN;
#pragma omp parallel for schedule(static)
  for (int64_t nb = 0; nb < tiles; ++nb) {
    // The tile row's codes stay in L1 between passes of 4 rows (<= 12 KB for K <= 1536 at 4 bits).
    for (int64_t r0 = 0; r0 < M; r0 += kPassRows) {
      const QuantizedX xr{xq + r0 * K, xp + (w.bits == 4 ? r0 * kb_count * 8 : 0), dx + r0 * kb_count,
                          sx + r0 * kb_count, kb_count};
      uint16_t* yr = y + r0 * N;
      switch (std::min<int64_t>(kPassRows, M - r0)) {
        case 1: pass<1>(w, xr, nb, yr, N); break;
        case 2: pass<2>(w, xr, nb, yr, N); break;
        case 3: pass<3>(w, xr, nb, yr, N); break;
        default: pass<4>(w, xr, nb, yr, N); break;
      }
    }
  }
}

#endif  // STRUCTGEN_VNNI

}  // namespace

bool gemv_available() {
#if STRUCTGEN_VNNI
  return vnni_usable();
#else
  return false;
#endif
}

void woq_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
              int64_t bits, at::Tensor& out) {
  TORCH_CHECK(gemv_available(), "woq_gemv: this CPU (or kernel) cannot run AVX512-VNNI");
  check_woq_args("woq_gemv", x, qweight, scales, mins, bits, out);
  const int64_t kb = qweight.size(1), M = x.size(0), K = x.size(1), N = qweight.size(0) * 16;
  if (M == 0) return;
#if STRUCTGEN_VNNI
  const PackedWeight w{reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                       reinterpret_cast<const uint16_t*>(scales.data_ptr()),
                       bits == 4 ? reinterpret_cast<const uint16_t*>(mins.data_ptr()) : nullptr, static_cast<int>(bits),
                       kb};
  woq_gemv_vnni(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, w, reinterpret_cast<uint16_t*>(out.data_ptr()),
                N);
#endif
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def("gemv_available() -> bool", &structgen_cpu::gemv_available);
  m.def("woq_gemv(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int bits, Tensor(a!) out) -> ()");
  m.impl("woq_gemv", c10::DispatchKey::CPU, &structgen_cpu::woq_gemv);
}
