// Weight-only quantized linear on AMX: y[M, N] = x[M, K] @ W^T, x and y bf16, W in 4-bit (Q4_1: w = d q + m)
// or 8-bit (Q8_0: w = d q) blocks of 32 along K, each with fp16 d (and m).
//
// Why: at decode batch sizes (8-64 rows) a bf16 matmul reads every weight once per step and the step is bound by
// that read (SmolLM2: 270 MB of bf16 a step). Here the weights stay as the GGUF stores them (~5 bits each), and each
// 32 x 16 block is expanded to bf16 in L1 right before the AMX tile product (TDPBF16PS) that consumes it; the
// expanded strip of 32 output columns is reused for every 32-row chunk of x, so expansion costs once per step.
//
// Layout (made by `kernels/cpu_ops.py: pack_woq`): W is cut into 16-column x 32-deep tiles, tile (nb, kb) covering
// W[16 nb .. 16 nb + 15][32 kb .. 32 kb + 31]. Inside a tile, row r (0..15) holds the 32 bf16 lanes AMX wants for
// k-pair r: lane l is W[16 nb + l / 2][32 kb + 2 r + l % 2]. 8-bit: 32 int8 per row in lane order. 4-bit: 16 bytes
// per row, byte b holding lane b in its low nibble and lane b + 16 in its high one. d and m: [NB, KB, 16] fp16.
//
// Tiles: tmm0-3 accumulate C for rows 0-15 / 16-31 x columns 0-15 / 16-31 of a strip, tmm4-5 hold x, tmm6-7 W.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_woq_checks.h"

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define STRUCTGEN_AMX 1
#include <cpuid.h>
#else
#define STRUCTGEN_AMX 0
#endif

namespace structgen_cpu {
namespace {

#if STRUCTGEN_AMX

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,f16c,fma")))

constexpr int kGroup = 32;  // weights per quantization block along K = bf16 per AMX row of x (64 bytes)
constexpr int kTileN = 16;  // output columns per W tile
constexpr int kStripN = 32;  // output columns per strip (two W tiles)
constexpr int kChunkM = 32;  // rows of x per pass (two x tiles)
constexpr int kPrefetchAhead = 4;  // K blocks between a tile's prefetch and its expansion

// Linux hands out AMX's 8 KB of tile state only to processes that ask (ARCH_REQ_XCOMP_PERM for XTILEDATA).
bool amx_usable() {
  static const bool usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = edx & (1u << 24), bf16 = edx & (1u << 22);
    const bool avx512_bf16 = __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 5));
    if (!tile || !bf16 || !avx512_bf16) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Rows 0..rows0-1 of x in tile 4 (C in 0, 1), rows0..rows0+rows1-1 in tile 5 (C in 2, 3); rows1 may be 0.
AMX_TARGET void configure(int rows0, int rows1) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(rows0);
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = static_cast<uint8_t>(rows1);
  cfg.rows[6] = cfg.rows[7] = 16;
  if (rows1 == 0) cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[5] = 0;
  _tile_loadconfig(&cfg);
}

// Every tile 16 rows of 64 bytes (`strip16_fused`: C of four 16-row blocks x 16 columns, x and W tiles).
AMX_TARGET void configure_wide() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// d (and m) of a tile's 16 columns spread over the 32 lanes of a row: lanes 0-15 are columns 0-7, 16-31 are 8-15.
struct LaneScales {
  __m512 lo, hi;
};

AMX_TARGET inline LaneScales lane_scales(const uint16_t* half16) {
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half16)));
  const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
  return {_mm512_permutexvar_ps(lo_idx, v), _mm512_permutexvar_ps(hi_idx, v)};
}

AMX_TARGET inline void store_row(uint16_t* out, __m512 lo, __m512 hi) {
  _mm512_store_si512(reinterpret_cast<__m512i*>(out), reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
}

// One 16 x 32 tile of 4-bit codes (256 bytes) to bf16 (512 values, 1 KB, 64-byte aligned).
AMX_TARGET inline void expand_q4(const uint8_t* q, const uint16_t* d, const uint16_t* m, uint16_t* out) {
  const LaneScales ds = lane_scales(d), ms = lane_scales(m);
  const __m512i low_nibble = _mm512_set1_epi32(0x0F);
  for (int r = 0; r < 16; ++r) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * r)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low_nibble));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    store_row(out + 32 * r, _mm512_fmadd_ps(lo, ds.lo, ms.lo), _mm512_fmadd_ps(hi, ds.hi, ms.hi));
  }
}

// One 16 x 32 tile of int8 codes (512 bytes) to bf16.
AMX_TARGET inline void expand_q8(const int8_t* q, const uint16_t* d, uint16_t* out) {
  const LaneScales ds = lane_scales(d);
  for (int r = 0; r < 16; ++r) {
    const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * r)));
    const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * r + 16)));
    store_row(out + 32 * r, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), ds.lo), _mm512_mul_ps(_mm512_cvtepi32_ps(hi), ds.hi));
  }
}

// C (two or four 16 x 16 fp32 tiles in `acc`, row stride 32 floats) to rows of y, rounded to bf16.
AMX_TARGET inline void write_rows(const float* acc, int rows, uint16_t* y, int64_t n_stride) {
  for (int r = 0; r < rows; ++r) {
    const __m512 a = _mm512_load_ps(acc + 32 * r), b = _mm512_load_ps(acc + 32 * r + 16);
    _mm512_storeu_si512(reinterpret_cast<__m512i*>(y + r * n_stride),
                        reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
  }
}

// The C tiles of one 32-row chunk: zeroed before its K loop, written to `y` after it.
AMX_TARGET inline void zero_c(int rows1) {
  _tile_zero(0);
  _tile_zero(1);
  if (rows1) {
    _tile_zero(2);
    _tile_zero(3);
  }
}

AMX_TARGET inline void store_c(int rows0, int rows1, float* acc, uint16_t* y, int64_t N) {
  _tile_stored(0, acc, 128);
  _tile_stored(1, acc + 16, 128);
  if (rows1) {
    _tile_stored(2, acc + 16 * 32, 128);
    _tile_stored(3, acc + 16 * 32 + 16, 128);
  }
  write_rows(acc, rows0 + rows1, y, N);
}

// x tiles of one K block times the strip's two W tiles `wt` (1 KB each, contiguous), into C.
AMX_TARGET inline void products(const uint16_t* xk, int64_t x_stride, const uint16_t* wt, int rows1, int64_t K) {
  _tile_loadd(4, xk, x_stride);
  _tile_loadd(6, wt, 64);
  _tile_loadd(7, wt + 512, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if (rows1) {
    _tile_loadd(5, xk + 16 * K, x_stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

struct Weights {
  const uint8_t* q;
  const uint16_t* d;
  const uint16_t* m;
  int bits;
  int64_t kb_count;
  // Pulls tile (nb, kb)'s codes and scales toward L1 ahead of `expand`: the hardware prefetcher follows each
  // strip's two code streams, but not far enough ahead to hide the reads behind the tile products.
  AMX_TARGET inline void prefetch(int64_t nb, int64_t kb) const {
    const int64_t tile = nb * kb_count + kb;
    const int bytes = bits == 4 ? 256 : 512;
    const char* codes = reinterpret_cast<const char*>(q) + tile * bytes;
    for (int off = 0; off < bytes; off += 64) _mm_prefetch(codes + off, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(d + tile * kTileN), _MM_HINT_T0);
    if (bits == 4) _mm_prefetch(reinterpret_cast<const char*>(m + tile * kTileN), _MM_HINT_T0);
  }
  // Column tile nb, K block kb, expanded to bf16 at `out` (512 values).
  AMX_TARGET inline void expand(int64_t nb, int64_t kb, uint16_t* out) const {
    const int64_t tile = nb * kb_count + kb;
    if (bits == 4) {
      expand_q4(q + tile * 256, d + tile * kTileN, m + tile * kTileN, out);
    } else {
      expand_q8(reinterpret_cast<const int8_t*>(q) + tile * 512, d + tile * kTileN, out);
    }
  }
};

// M <= 32: each K block's two W tiles are expanded into L1 and consumed right after (x packed by `pack_x`). Two
// 2 KB buffers alternate, so the tiles of block kb are expanded while block kb - 1's products run: an AMX tile
// load cannot take its data from stores still in flight, and would wait for them.
AMX_TARGET void strip_fused(const uint16_t* x, int64_t M, int64_t K, const Weights& w, int64_t s, uint16_t* buf,
                            float* acc, uint16_t* y, int64_t N) {
  const int rows0 = static_cast<int>(std::min<int64_t>(M, 16)), rows1 = static_cast<int>(M) - rows0;
  zero_c(rows1);
  w.expand(2 * s, 0, buf);
  w.expand(2 * s + 1, 0, buf + 512);
  for (int64_t kb = 0; kb < w.kb_count; ++kb) {
    if (kb + kPrefetchAhead < w.kb_count) {
      w.prefetch(2 * s, kb + kPrefetchAhead);
      w.prefetch(2 * s + 1, kb + kPrefetchAhead);
    }
    uint16_t* current = buf + (kb & 1) * 1024;
    if (kb + 1 < w.kb_count) {
      uint16_t* next = buf + ((kb + 1) & 1) * 1024;
      w.expand(2 * s, kb + 1, next);
      w.expand(2 * s + 1, kb + 1, next + 512);
    }
    products(x + kb * kChunkM * kGroup, 64, current, rows1, kGroup);
  }
  store_c(rows0, rows1, acc, y + s * kStripN, N);
}

// 32 < M <= 64: strips of 16 columns, so that the C tiles of all four 16-row blocks fit (tmm0-3) beside one W
// tile (tmm6) and the x tiles (tmm4, 5, 7 in turn): each K block's W tile is expanded into L1 once and consumed
// by every row of x right after, as in `strip_fused`. Two 32-row passes would expand every weight twice, and
// the buffered path's round trip through L2 cost as much again: SmolLM2's layers took ~2x their 32-row time at
// 33-64 rows (the rows of a structured step: 32 decode rows and the tokens grammars forced). Tiles are 16 rows
// whatever M is: the rows of the last block past M come from the packed chunk's unset rows, and their C rows are
// not written out (each C row depends on its own x row only).
// One K block of `strip16_fused`: W (expanded at `wt`) in tile WT, x of rows 0-15 / 16-31 / 32-47 (/ 48-63)
// through tiles 4 and 5 in turn. (A macro: the tile intrinsics take their register numbers as literals.)
#define STRUCTGEN_WIDE_PRODUCTS(WT, xk, chunk, wt, four) \
  do {                                                   \
    _tile_loadd(WT, (wt), 64);                           \
    _tile_loadd(4, (xk), 64);                            \
    _tile_dpbf16ps(0, 4, WT);                            \
    _tile_loadd(5, (xk) + 512, 64);                      \
    _tile_dpbf16ps(1, 5, WT);                            \
    _tile_loadd(4, (xk) + (chunk), 64);                  \
    _tile_dpbf16ps(2, 4, WT);                            \
    if (four) {                                          \
      _tile_loadd(5, (xk) + (chunk) + 512, 64);          \
      _tile_dpbf16ps(3, 5, WT);                          \
    }                                                    \
  } while (0)

AMX_TARGET void strip16_fused(const uint16_t* x, int64_t M, const Weights& w, int64_t s, uint16_t* buf, float* acc,
                              uint16_t* y, int64_t N) {
  const bool four = M > 48;
  const int64_t chunk = w.kb_count * kChunkM * kGroup;  // x elements per 32-row chunk (`pack_x`)
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  if (four) _tile_zero(3);
  w.expand(s, 0, buf);
  for (int64_t kb = 0; kb < w.kb_count; ++kb) {
    if (kb + kPrefetchAhead < w.kb_count) w.prefetch(s, kb + kPrefetchAhead);
    const uint16_t* current = buf + (kb & 1) * 512;
    if (kb + 1 < w.kb_count) w.expand(s, kb + 1, buf + ((kb + 1) & 1) * 512);
    // W alternates between tiles 6 and 7, so the next block's W load need not wait for this block's products
    const uint16_t* xk = x + kb * kChunkM * kGroup;
    if (kb & 1) {
      STRUCTGEN_WIDE_PRODUCTS(7, xk, chunk, current, four);
    } else {
      STRUCTGEN_WIDE_PRODUCTS(6, xk, chunk, current, four);
    }
  }
  _tile_stored(0, acc, 64);
  _tile_stored(1, acc + 16 * 16, 64);
  _tile_stored(2, acc + 32 * 16, 64);
  if (four) _tile_stored(3, acc + 48 * 16, 64);
  for (int64_t r = 0; r < M; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N + s * kTileN),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(acc + 16 * r))));
  }
}

// M > 32: the strip's whole K extent is expanded once (K / 32 x 2 KB, in L2) and reused by every 32-row chunk
// of the packed x.
AMX_TARGET void strip_buffered(const uint16_t* x, int64_t M, int64_t K, const Weights& w, int64_t s, uint16_t* buf,
                               float* acc, uint16_t* y, int64_t N, int& configured) {
  for (int64_t kb = 0; kb < w.kb_count; ++kb) {
    w.expand(2 * s, kb, buf + kb * 1024);
    w.expand(2 * s + 1, kb, buf + kb * 1024 + 512);
  }
  for (int64_t m0 = 0; m0 < M; m0 += kChunkM) {
    const int rows = static_cast<int>(std::min<int64_t>(kChunkM, M - m0));
    const int rows0 = std::min(rows, 16), rows1 = rows - rows0;
    if (rows != configured) {
      configure(rows0, rows1);
      configured = rows;
    }
    zero_c(rows1);
    const uint16_t* xm = x + m0 * K;  // the packed chunk (`pack_x`)
    for (int64_t kb = 0; kb < w.kb_count; ++kb) {
      products(xm + kb * kChunkM * kGroup, 64, buf + kb * 1024, rows1, kGroup);
    }
    store_c(rows0, rows1, acc, y + m0 * N + s * kStripN, N);
  }
}

// x [M, K] as chunks of 32 rows, each K / 32 blocks of 32 rows x 32 values: every x tile is 1 KB of consecutive
// bytes (tile loads from strided rows of x measured ~2x slower). Rows past M in the last chunk are left unset:
// the tiles read only the chunk's real rows.
AMX_TARGET void pack_x(const uint16_t* x, int64_t M, int64_t K, uint16_t* packed) {
  const int64_t kb_count = K / kGroup, chunks = (M + kChunkM - 1) / kChunkM;
#pragma omp for schedule(static) collapse(2)
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t kb = 0; kb < kb_count; ++kb) {
      const int64_t rows = std::min<int64_t>(kChunkM, M - c * kChunkM);
      uint16_t* block = packed + (c * kb_count + kb) * kChunkM * kGroup;
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(block + r * kGroup, x + (c * kChunkM + r) * K + kb * kGroup, kGroup * 2);
      }
    }
  }
}

AMX_TARGET void woq_linear_amx(const uint16_t* x, int64_t M, int64_t K, const Weights& w, uint16_t* y, int64_t N) {
  const bool fused = M <= kChunkM, wide = !fused && M <= 2 * kChunkM;
  const int64_t strips = wide ? N / kTileN : N / kStripN;
  static thread_local std::vector<uint16_t> x_storage;
  x_storage.resize(((M + kChunkM - 1) / kChunkM) * kChunkM * K + 32);
  uint16_t* xp = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(x_storage.data()) + 63) & ~uintptr_t(63));
#pragma omp parallel
  {
    pack_x(x, M, K, xp);  // ends in the barrier of its omp for
    // Per thread: expanded weights (2 x 2 KB fused, the strip's K / 32 x 2 KB buffered) and the C staging area.
    static thread_local std::vector<uint16_t> storage;
    const int64_t buffer = fused || wide ? 2048 : w.kb_count * 1024;
    storage.resize(buffer + 64 * 16 * 2 + 64);
    uint16_t* buf = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
    float* acc = reinterpret_cast<float*>(buf + buffer);
    int configured = -1;
    if (fused) {
      configure(static_cast<int>(std::min<int64_t>(M, 16)), static_cast<int>(M - std::min<int64_t>(M, 16)));
    } else if (wide) {
      configure_wide();
    }
#pragma omp for schedule(static)
    for (int64_t s = 0; s < strips; ++s) {
      if (fused) {
        strip_fused(xp, M, K, w, s, buf, acc, y, N);
      } else if (wide) {
        strip16_fused(xp, M, w, s, buf, acc, y, N);
      } else {
        strip_buffered(xp, M, K, w, s, buf, acc, y, N, configured);
      }
    }
    _tile_release();
  }
}

#endif  // STRUCTGEN_AMX

bool amx_available() {
#if STRUCTGEN_AMX
  return amx_usable();
#else
  return false;
#endif
}

void woq_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                int64_t bits, at::Tensor& out) {
  TORCH_CHECK(amx_available(), "woq_linear: this CPU (or kernel) cannot run AMX bf16 tiles");
  check_woq_args("woq_linear", x, qweight, scales, mins, bits, out);
  const int64_t kb = qweight.size(1), M = x.size(0), K = x.size(1), N = qweight.size(0) * 16;
  TORCH_CHECK(N % 32 == 0, "woq_linear: N must be a multiple of 32, got ", N);
  if (M == 0) return;
#if STRUCTGEN_AMX
  const Weights w{reinterpret_cast<const uint8_t*>(qweight.data_ptr()),
                  reinterpret_cast<const uint16_t*>(scales.data_ptr()),
                  bits == 4 ? reinterpret_cast<const uint16_t*>(mins.data_ptr()) : nullptr, static_cast<int>(bits), kb};
  woq_linear_amx(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, w, reinterpret_cast<uint16_t*>(out.data_ptr()),
                 N);
#endif
}

}  // namespace
}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def("amx_available() -> bool", &structgen_cpu::amx_available);
  m.def("woq_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int bits, Tensor(a!) out) -> ()");
  m.impl("woq_linear", c10::DispatchKey::CPU, &structgen_cpu::woq_linear);
}
