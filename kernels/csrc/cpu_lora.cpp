// lora_add: the LoRA products of a step's tokens added into a projection's output, each token with its own
// adapter (segmented by slot, as punica's SGMV does on GPUs): y[t, part p] += B[s, p] (A[s, p] x[t]) for the
// slot s of token t, nothing for tokens of the base model (slot -1). Each token reads only its own adapter's
// weights, and only the first `ranks[s, p]` rank rows of them (the slots are zero-padded to the widest rank), so
// a step's cost is its tokens' own ranks, not the slots' count times the widest rank as a dense product over all
// slots would be. Accumulates in float, the shrunk values rounded to the model's dtype before the expand (as a
// bf16 model's own product rounds them); y is rounded once. Launcher and reference: `kernels/cpu_lora.py`.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_kernels.h"

namespace structgen_cpu {
namespace {

// The most parts x rank columns the pair-wise shrink keeps on the stack per token (3 parts of rank 64).
constexpr int64_t kMaxColumns = 192;

// Tokens are grouped by slot and taken in tiles of up to kTile tokens of one slot: a tile reads its adapter's
// weights once for all its tokens (each weight row feeds kTile accumulators), which is what makes the product
// compute-bound instead of a stream of weight reloads per token.
constexpr int kTile = 8;

struct Tile {
  int32_t slot;
  int32_t count;
  const int64_t* tokens;  // `count` token indices, all of slot `slot`
};

template <typename T>
inline void to_float(const typename Elem<T>::storage* __restrict src, float* __restrict dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = Elem<T>::load(src[i]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

template <typename T>
inline __m512 load16(const typename Elem<T>::storage* p, __mmask16 m);

template <>
inline __m512 load16<float>(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}

template <>
inline __m512 load16<c10::BFloat16>(const uint16_t* p, __mmask16 m) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <typename T>
inline void store16(typename Elem<T>::storage* p, __m512 v, __mmask16 m);

template <>
inline void store16<float>(float* p, __m512 v, __mmask16 m) {
  _mm512_mask_storeu_ps(p, m, v);
}

template <>
inline void store16<c10::BFloat16>(uint16_t* p, __m512 v, __mmask16 m) {
  // Round to nearest even, NaN kept NaN: Elem<BFloat16>::store, 16 lanes at once.
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(rounded));
}

inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u); }

// shrunk[t * max_rank + r] = A[r] . x[t] for the tile's N tokens (xf: N float rows of `in`).
template <typename T, int N>
inline void shrink(const typename Elem<T>::storage* a, int32_t rank, int64_t in, const float* xf, float* shrunk,
                   int64_t max_rank) {
  for (int32_t r = 0; r < rank; ++r) {
    __m512 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm512_setzero_ps();
    const typename Elem<T>::storage* row = a + r * in;
    for (int64_t k = 0; k < in; k += 16) {
      const __mmask16 m = lanes(in - k);
      const __m512 av = load16<T>(row + k, m);
      for (int t = 0; t < N; ++t) acc[t] = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, xf + t * in + k), acc[t]);
    }
    for (int t = 0; t < N; ++t) shrunk[t * max_rank + r] = _mm512_reduce_add_ps(acc[t]);
  }
}

// y[token t, columns] += sum_r shrunk[t, r] B[r, columns], rounded once.
template <typename T, int N>
inline void expand(const typename Elem<T>::storage* b, int32_t rank, int64_t width, const float* shrunk,
                   int64_t max_rank, typename Elem<T>::storage* const* y_rows) {
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 m = lanes(width - j);
    __m512 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm512_setzero_ps();
    const typename Elem<T>::storage* block = b + (j / 16) * max_rank * 16;
    for (int32_t r = 0; r < rank; ++r) {
      const __m512 bv = load16<T>(block + r * 16, __mmask16(0xffff));
      for (int t = 0; t < N; ++t) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(shrunk[t * max_rank + r]), bv, acc[t]);
    }
    for (int t = 0; t < N; ++t) {
      typename Elem<T>::storage* out = y_rows[t] + j;
      store16<T>(out, _mm512_add_ps(load16<T>(out, m), acc[t]), m);
    }
  }
}

#if defined(__AVX512BF16__)
#define STRUCTGEN_LORA_BF16_DOT 1

// How far ahead of the products the adapter's weights are pulled into L1 (A: rows; B: blocks of 16 columns).
constexpr int64_t kPrefetchRows = 4;
constexpr int64_t kPrefetchBlocks = 4;
constexpr int64_t kPrefetchPairs = 8;

inline __mmask32 lanes32(int64_t left) { return left >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << left) - 1u); }

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
}

// bf16 with AVX512-BF16: the products of bf16 pairs straight into float sums, two per lane and instruction, with
// no conversion of either side. shrunk[t, r] = A[r] . x[t], from the tile's own bf16 rows.
template <int N>
inline void shrink_bf16(const uint16_t* a, int32_t rank, int64_t in, const uint16_t* const* x_rows, float* shrunk,
                        int64_t max_rank) {
  for (int32_t r = 0; r < rank; ++r) {
    __m512 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm512_setzero_ps();
    const uint16_t* row = a + r * in;
    for (int64_t k = 0; k < in; k += 32) {
      const __mmask32 m = lanes32(in - k);
      // The slot's A streams from memory (a step reads every adapter once): ask for the rows ahead early.
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchRows * in + k), _MM_HINT_T0);
      const __m512i av = _mm512_maskz_loadu_epi16(m, row + k);
      for (int t = 0; t < N; ++t) acc[t] = dot_pairs(acc[t], av, _mm512_maskz_loadu_epi16(m, x_rows[t] + k));
    }
    for (int t = 0; t < N; ++t) shrunk[t * max_rank + r] = _mm512_reduce_add_ps(acc[t]);
  }
}

// The shrink of all parts at once from A laid out by input pairs (`a_pairs`: [in / 2, parts x rank, 2], a rank
// column's two inputs side by side): per input pair, the tokens' two x values broadcast against 16 rank columns a
// register. Sums stay in lanes (no horizontal reduction per row) and each weight load feeds every token of the
// tile. out[t, c] = A[c] . x[t] for the parts x rank columns c; NB blocks of 16 columns per pass.
template <int N, int NB>
inline void shrink_pairs_pass(const uint16_t* a_pairs, int64_t in_pairs, int64_t columns, int64_t first_block,
                              const uint16_t* const* x_rows, float* out) {
  __m512 acc[N][NB];
  __mmask16 m[NB];
  for (int k = 0; k < NB; ++k) m[k] = lanes(columns - (first_block + k) * 16);
  for (int t = 0; t < N; ++t)
    for (int k = 0; k < NB; ++k) acc[t][k] = _mm512_setzero_ps();
  const uint16_t* start = a_pairs + first_block * 32;
  for (int64_t i = 0; i < in_pairs; ++i) {
    const uint16_t* pair_row = start + i * columns * 2;
    _mm_prefetch(reinterpret_cast<const char*>(pair_row + kPrefetchPairs * columns * 2), _MM_HINT_T0);
    __m512i av[NB];
    for (int k = 0; k < NB; ++k) av[k] = _mm512_maskz_loadu_epi32(m[k], pair_row + k * 32);
    for (int t = 0; t < N; ++t) {
      int32_t pair;
      std::memcpy(&pair, x_rows[t] + 2 * i, sizeof(pair));
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int k = 0; k < NB; ++k) acc[t][k] = dot_pairs(acc[t][k], xv, av[k]);
    }
  }
  for (int t = 0; t < N; ++t)
    for (int k = 0; k < NB; ++k) _mm512_mask_storeu_ps(out + t * columns + (first_block + k) * 16, m[k], acc[t][k]);
}

template <int N>
inline void shrink_pairs(const uint16_t* a_pairs, int64_t in, int64_t columns, const uint16_t* const* x_rows,
                         float* out) {
  const int64_t blocks = (columns + 15) / 16;
  for (int64_t first = 0; first < blocks; first += 3) {
    switch (std::min<int64_t>(3, blocks - first)) {
      case 1: shrink_pairs_pass<N, 1>(a_pairs, in / 2, columns, first, x_rows, out); break;
      case 2: shrink_pairs_pass<N, 2>(a_pairs, in / 2, columns, first, x_rows, out); break;
      default: shrink_pairs_pass<N, 3>(a_pairs, in / 2, columns, first, x_rows, out); break;
    }
  }
}

// y[t, columns] += sum_r shrunk[t, r] B[r, columns]: the shrunk values rounded to bf16 (as a bf16 model's own
// LoRA product rounds them), rank pairs (r, r + 1) as one dot product: B's two rows interleaved per column.
template <int N>
inline void expand_bf16(const uint16_t* b, int32_t rank, int64_t width, const float* shrunk, int64_t max_rank,
                        uint16_t* const* y_rows) {
  using E = Elem<c10::BFloat16>;
  const int32_t num_pairs = (rank + 1) / 2;
  std::vector<int32_t> pairs(N * num_pairs);
  for (int t = 0; t < N; ++t)
    for (int32_t i = 0; i < num_pairs; ++i) {
      const uint32_t lo = E::store(shrunk[t * max_rank + 2 * i]);
      const uint32_t hi = 2 * i + 1 < rank ? E::store(shrunk[t * max_rank + 2 * i + 1]) : 0u;
      pairs[t * num_pairs + i] = static_cast<int32_t>(lo | (hi << 16));
    }
  alignas(64) int16_t order[32];
  for (int i = 0; i < 16; ++i) {
    order[2 * i] = static_cast<int16_t>(i);
    order[2 * i + 1] = static_cast<int16_t>(16 + i);
  }
  const __m512i interleave = _mm512_load_si512(order);
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 m = lanes(width - j);
    __m512 acc[N];
    for (int t = 0; t < N; ++t) acc[t] = _mm512_setzero_ps();
    const uint16_t* block = b + (j / 16) * max_rank * 16;  // this column block's rank rows, 16 columns each
    for (int32_t i = 0; i < num_pairs; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBlocks * max_rank * 16 + 2 * i * 16), _MM_HINT_T0);
      // Rows 2i and 2i + 1 side by side in memory, interleaved column by column into bf16 pairs.
      const __mmask32 both = 2 * i + 1 < rank ? __mmask32(0xffffffffu) : __mmask32(0xffffu);
      const __m512i bv = _mm512_permutexvar_epi16(interleave, _mm512_maskz_loadu_epi16(both, block + 2 * i * 16));
      for (int t = 0; t < N; ++t) acc[t] = dot_pairs(acc[t], _mm512_set1_epi32(pairs[t * num_pairs + i]), bv);
    }
    for (int t = 0; t < N; ++t) {
      uint16_t* out = y_rows[t] + j;
      store16<c10::BFloat16>(out, _mm512_add_ps(load16<c10::BFloat16>(out, m), acc[t]), m);
    }
  }
}
#endif

#else  // portable loops: one token at a time, vectorized by the compiler where it can

template <typename T, int N>
inline void shrink(const typename Elem<T>::storage* a, int32_t rank, int64_t in, const float* xf, float* shrunk,
                   int64_t max_rank) {
  for (int t = 0; t < N; ++t)
    for (int32_t r = 0; r < rank; ++r) {
      const typename Elem<T>::storage* row = a + r * in;
      const float* x = xf + t * in;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < in; ++k) acc += Elem<T>::load(row[k]) * x[k];
      shrunk[t * max_rank + r] = acc;
    }
}

template <typename T, int N>
inline void expand(const typename Elem<T>::storage* b, int32_t rank, int64_t width, const float* shrunk,
                   int64_t max_rank, typename Elem<T>::storage* const* y_rows) {
  std::vector<float> acc(width);
  for (int t = 0; t < N; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int32_t r = 0; r < rank; ++r) {
      const float s = shrunk[t * max_rank + r];
      for (int64_t j = 0; j < width; ++j) acc[j] += s * Elem<T>::load(b[((j / 16) * max_rank + r) * 16 + j % 16]);
    }
    typename Elem<T>::storage* out = y_rows[t];
    for (int64_t j = 0; j < width; ++j) out[j] = Elem<T>::store(Elem<T>::load(out[j]) + acc[j]);
  }
}

#endif

// Whether tiles of T run the AVX512-BF16 path (which reads bf16 x rows as they are).
template <typename T>
constexpr bool bf16_dot() {
#ifdef STRUCTGEN_LORA_BF16_DOT
  return std::is_same_v<T, c10::BFloat16>;
#else
  return false;
#endif
}

struct Problem {
  int64_t in, num_parts, max_rank, x_stride, y_stride;
  const void* a;
  std::vector<const void*> b;
  std::vector<int64_t> widths, offsets, b_slot_stride;
  const int32_t* ranks;
  // A by input pairs ([slots, in / 2, parts x rank, 2]) for the BF16 path's shrink; null: A's rows are used.
  const void* a_pairs = nullptr;
};

template <typename T, int N>
void run_tile(const Problem& pr, const Tile& tile, const typename Elem<T>::storage* xs,
              typename Elem<T>::storage* ys, float* xf, float* shrunk) {
  using S = typename Elem<T>::storage;
  S* y_rows[N];
#ifdef STRUCTGEN_LORA_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const S* x_rows[N];
    for (int t = 0; t < N; ++t) x_rows[t] = xs + tile.tokens[t] * pr.x_stride;
    const int64_t columns = pr.num_parts * pr.max_rank;
    const bool by_pairs = pr.a_pairs != nullptr;
    float all[N * kMaxColumns];
    if (by_pairs) {
      const S* a_pairs = static_cast<const S*>(pr.a_pairs) + tile.slot * (pr.in / 2) * columns * 2;
      shrink_pairs<N>(a_pairs, pr.in, columns, x_rows, all);
    }
    for (int64_t p = 0; p < pr.num_parts; ++p) {
      const int32_t rank = pr.ranks[tile.slot * pr.num_parts + p];
      if (rank == 0) continue;
      const S* a = static_cast<const S*>(pr.a) + (tile.slot * pr.num_parts + p) * pr.max_rank * pr.in;
      if (by_pairs) {
        for (int t = 0; t < N; ++t)
          for (int32_t r = 0; r < rank; ++r) shrunk[t * pr.max_rank + r] = all[t * columns + p * pr.max_rank + r];
      } else {
        shrink_bf16<N>(a, rank, pr.in, x_rows, shrunk, pr.max_rank);
      }
      const int64_t width = pr.widths[p];
      const S* b = static_cast<const S*>(pr.b[p]) + tile.slot * pr.b_slot_stride[p];
      for (int t = 0; t < N; ++t) y_rows[t] = ys + tile.tokens[t] * pr.y_stride + pr.offsets[p];
      expand_bf16<N>(b, rank, width, shrunk, pr.max_rank, y_rows);
    }
    return;
  }
#endif
  for (int t = 0; t < N; ++t) to_float<T>(xs + tile.tokens[t] * pr.x_stride, xf + t * pr.in, pr.in);
  for (int64_t p = 0; p < pr.num_parts; ++p) {
    const int32_t rank = pr.ranks[tile.slot * pr.num_parts + p];
    if (rank == 0) continue;
    const S* a = static_cast<const S*>(pr.a) + (tile.slot * pr.num_parts + p) * pr.max_rank * pr.in;
    shrink<T, N>(a, rank, pr.in, xf, shrunk, pr.max_rank);
    for (int t = 0; t < N; ++t)  // rounded to the model's dtype before the expand, as on the BF16 path
      for (int32_t r = 0; r < rank; ++r) shrunk[t * pr.max_rank + r] = Elem<T>::round(shrunk[t * pr.max_rank + r]);
    const int64_t width = pr.widths[p];
    const S* b = static_cast<const S*>(pr.b[p]) + tile.slot * pr.b_slot_stride[p];
    for (int t = 0; t < N; ++t) y_rows[t] = ys + tile.tokens[t] * pr.y_stride + pr.offsets[p];
    expand<T, N>(b, rank, width, shrunk, pr.max_rank, y_rows);
  }
}

template <typename T>
void lora_rows(const at::Tensor& x, at::Tensor& y, const Problem& pr, const int32_t* slots, int64_t num_slots) {
  using S = typename Elem<T>::storage;
  const int64_t tokens = x.size(0);
  // Counting sort of the tokens by slot, then tiles of up to kTile tokens of one slot.
  std::vector<int64_t> start(num_slots + 1, 0), order(tokens);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) ++start[slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= 0) order[fill[slots[t]]++] = t;
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < num_slots; ++s)
    for (int64_t i = start[s]; i < start[s + 1]; i += kTile)
      tiles.push_back({static_cast<int32_t>(s), static_cast<int32_t>(std::min<int64_t>(kTile, start[s + 1] - i)),
                       order.data() + i});
  const S* xs = reinterpret_cast<const S*>(x.data_ptr());
  S* ys = reinterpret_cast<S*>(y.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    // Scratch, not zeroed: every value is written before it is read. The float copies of x rows are only for
    // the paths that shrink from them (not the BF16 path).
    const bool float_rows = !bf16_dot<T>();
    std::unique_ptr<float[]> xf(new float[float_rows ? kTile * pr.in : 1]);
    std::unique_ptr<float[]> shrunk(new float[kTile * pr.max_rank]);
    for (int64_t i = begin; i < end; ++i) {
      const Tile& tile = tiles[i];
      switch (tile.count) {
        case 1: run_tile<T, 1>(pr, tile, xs, ys, xf.get(), shrunk.get()); break;
        case 2: run_tile<T, 2>(pr, tile, xs, ys, xf.get(), shrunk.get()); break;
        case 3: run_tile<T, 3>(pr, tile, xs, ys, xf.get(), shrunk.get()); break;
        case 4: run_tile<T, 4>(pr, tile, xs, ys, xf.get(), shrunk.get()); break;
        case 5: run_tile<T, 5>(pr, tile, xs, ys, xf.get(), shrunk.get()); break;
        case 6: run_tile<T, 6>(pr, tile, xs, ys, xf.get(), shrunk.get()); break;
        case 7: run_tile<T, 7>(pr, tile, xs, ys, xf.get(), shrunk.get()); break;
        default: run_tile<T, kTile>(pr, tile, xs, ys, xf.get(), shrunk.get()); break;
      }
    }
  });
}

}  // namespace

// x [tokens, in]; y [tokens, out] (written in place; rows contiguous); a [slots, parts, max_rank, in]; b: per part
// [slots, ceil(width_p / 16), max_rank, 16] (blocks of 16 columns, each block's rank rows side by side, zero past
// the width: a block of columns is one contiguous read); offsets: each part's first column in y, the parts
// covering y's columns in order; slots [tokens] int32 (-1: none);
// ranks [slots, parts] int32 (0: the slot leaves that part alone). One dtype (float32 or bfloat16) for all.
void lora_add(const at::Tensor& x, at::Tensor y, const at::Tensor& a, at::TensorList b, at::IntArrayRef offsets,
              const at::Tensor& slots, const at::Tensor& ranks, const c10::optional<at::Tensor>& a_pairs) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_add: x [tokens, in], y [tokens, out]");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_add: x and y rows must be contiguous");
  TORCH_CHECK(a.dim() == 4 && a.is_contiguous() && a.size(3) == x.size(1),
              "lora_add: a must be contiguous [slots, parts, rank, in]");
  const int64_t num_slots = a.size(0), num_parts = a.size(1), max_rank = a.size(2);
  TORCH_CHECK(static_cast<int64_t>(b.size()) == num_parts && static_cast<int64_t>(offsets.size()) == num_parts,
              "lora_add: one b and one offset per part");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(y.scalar_type() == dtype && a.scalar_type() == dtype, "lora_add: x, y and a must share a dtype");
  std::vector<at::Tensor> parts;
  std::vector<int64_t> offs, widths;
  for (int64_t p = 0; p < num_parts; ++p) {
    const at::Tensor& bp = b[p];
    // Part p spans y's columns from its offset to the next part's (the last one to y's end).
    const int64_t end = p + 1 < num_parts ? offsets[p + 1] : y.size(1);
    const int64_t width = end - offsets[p];
    TORCH_CHECK(offsets[p] >= 0 && width > 0 && end <= y.size(1), "lora_add: a part falls outside y");
    TORCH_CHECK(bp.dim() == 4 && bp.is_contiguous() && bp.size(0) == num_slots && bp.size(1) == (width + 15) / 16 &&
                    bp.size(2) == max_rank && bp.size(3) == 16 && bp.scalar_type() == dtype,
                "lora_add: each b must be contiguous [slots, ceil(width / 16), rank, 16] of x's dtype");
    parts.push_back(bp);
    offs.push_back(offsets[p]);
    widths.push_back(width);
  }
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kInt &&
                  slots.is_contiguous(),
              "lora_add: slots must be contiguous int32 [tokens]");
  TORCH_CHECK(ranks.dim() == 2 && ranks.size(0) == num_slots && ranks.size(1) == num_parts &&
                  ranks.scalar_type() == at::kInt && ranks.is_contiguous(),
              "lora_add: ranks must be contiguous int32 [slots, parts]");
  const int32_t* slot_ptr = slots.data_ptr<int32_t>();
  const int32_t* rank_ptr = ranks.data_ptr<int32_t>();
  for (int64_t t = 0; t < x.size(0); ++t)
    TORCH_CHECK(slot_ptr[t] >= -1 && slot_ptr[t] < num_slots, "lora_add: slot out of range");
  for (int64_t i = 0; i < num_slots * num_parts; ++i)
    TORCH_CHECK(rank_ptr[i] >= 0 && rank_ptr[i] <= max_rank, "lora_add: rank out of range");
  Problem pr{x.size(1), num_parts, max_rank, x.stride(0), y.stride(0), a.data_ptr(), {}, widths, offs, {}, rank_ptr};
  for (const at::Tensor& bp : parts) {
    pr.b.push_back(bp.data_ptr());
    pr.b_slot_stride.push_back(bp.size(1) * max_rank * 16);
  }
  if (a_pairs.has_value() && a_pairs->numel() > 0) {
    const at::Tensor& ap = *a_pairs;
    TORCH_CHECK(ap.dim() == 4 && ap.is_contiguous() && ap.size(0) == num_slots && ap.size(1) * 2 == x.size(1) &&
                    ap.size(2) == num_parts * max_rank && ap.size(3) == 2 && ap.scalar_type() == dtype,
                "lora_add: a_pairs must be contiguous [slots, in / 2, parts * rank, 2] of x's dtype");
    // Only the BF16 path reads it, and only up to kMaxColumns columns; elsewhere A's rows serve.
    if (dtype == at::kBFloat16 && num_parts * max_rank <= kMaxColumns) pr.a_pairs = ap.data_ptr();
  }
  if (dtype == at::kFloat) {
    lora_rows<float>(x, y, pr, slot_ptr, num_slots);
  } else if (dtype == at::kBFloat16) {
    lora_rows<c10::BFloat16>(x, y, pr, slot_ptr, num_slots);
  } else {
    TORCH_CHECK(false, "lora_add: float32 or bfloat16 only");
  }
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def(
      "lora_add(Tensor x, Tensor(a!) y, Tensor a, Tensor[] b, int[] offsets, Tensor slots, Tensor ranks, "
      "Tensor? a_pairs=None) -> ()");
  m.impl("lora_add", c10::DispatchKey::CPU, &structgen_cpu::lora_add);
}
