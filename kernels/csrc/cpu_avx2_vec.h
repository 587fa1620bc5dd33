// What the two AVX2 weight-only kernels share (`cpu_woq_gemv_avx2.cpp`, x in int16 steps; `cpu_woq_q8_avx2.cpp`,
// x in int8 steps): the CPU check, eight fp32 lanes loaded from or stored to fp32 or bf16 rows, and a vector's
// horizontal max and sum. Functions carry a target attribute rather than the build relying on -mavx2, so the
// library still loads on a CPU without AVX2 (whose callers check `avx2::usable()` first).
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 9)
#define STRUCTGEN_AVX2 1
#define STRUCTGEN_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#else
#define STRUCTGEN_AVX2 0
#endif

#if STRUCTGEN_AVX2
namespace structgen_cpu::avx2 {

inline bool usable() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}

template <typename T>
STRUCTGEN_AVX2_TARGET inline __m256 load8(const T* p);

template <>
STRUCTGEN_AVX2_TARGET inline __m256 load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}

template <>
STRUCTGEN_AVX2_TARGET inline __m256 load8<uint16_t>(const uint16_t* p) {  // bf16
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

template <typename T>
STRUCTGEN_AVX2_TARGET inline void store8(T* p, __m256 v);

template <>
STRUCTGEN_AVX2_TARGET inline void store8<float>(float* p, __m256 v) {
  _mm256_storeu_ps(p, v);
}

// fp32 to bf16 bits, rounded to nearest even, NaN kept NaN (c10::BFloat16's rounding).
template <>
STRUCTGEN_AVX2_TARGET inline void store8<uint16_t>(uint16_t* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  // eight 32-bit lanes holding 16-bit values: pack within the 128-bit halves, then put the halves' quads together
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

STRUCTGEN_AVX2_TARGET inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

STRUCTGEN_AVX2_TARGET inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// One block of 32 values of a row: its four vectors, and the largest |x| and the sum (each kernel's scale and the
// Q4_1 minimum's factor).
struct Block32 {
  __m256 v[4];
  float amax;
  float sum;
};

template <typename T>
STRUCTGEN_AVX2_TARGET inline Block32 load_block(const T* src) {
  Block32 b;
  for (int i = 0; i < 4; ++i) b.v[i] = load8(src + 8 * i);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(b.v[0], abs_mask), _mm256_and_ps(b.v[1], abs_mask)),
                                    _mm256_max_ps(_mm256_and_ps(b.v[2], abs_mask), _mm256_and_ps(b.v[3], abs_mask)));
  b.amax = max8(amax);
  b.sum = sum8(_mm256_add_ps(_mm256_add_ps(b.v[0], b.v[1]), _mm256_add_ps(b.v[2], b.v[3])));
  return b;
}

}  // namespace structgen_cpu::avx2
#endif  // STRUCTGEN_AVX2
