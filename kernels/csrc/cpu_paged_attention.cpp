// paged_decode_attention: one new query token per sequence attends to its whole context, read from the paged
// KV cache in place (no gather into a padded copy, which is what the torch path pays for on every layer).
//
// One task per (sequence, KV head): the GQA group's query heads are loaded once, each cached key is converted to
// float once and dotted with every query head of the group, then an exact two-pass softmax (max, exp, sum) and
// the weighted sum of the values. Rows that read one context (a sequence's few new tokens, each seeing one more
// token than the one before) share a task: their query heads together, each with its own context length. Scores
// live in a per-thread buffer of the batch's longest context. Tasks are spread over torch's intra-op threads in
// runs of about equal cost (context lengths), not of equal counts. While a thread computes one run it requests
// the whole blocks of its next run into L2 (`ContextStager`): the scattered blocks' memory latency is then hidden
// behind the compute, ~1.9x faster a layer on SmolLM2's shapes. The reference is `paged_decode_attention` in the
// torch backend.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"
#include "cpu_context_stager.h"
#include "cpu_kernels.h"

namespace structgen_cpu {
namespace {

// Exact softmax of one head's scores, in float: the max subtracted first, then exp, sum and scale.
STRUCTGEN_VECTORIZE_EXP inline void softmax_in_place(float* __restrict sc, int64_t len) {
  float m = -INFINITY;
  for (int64_t t = 0; t < len; ++t) m = std::max(m, sc[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    const float e = fast_exp(sc[t] - m);
    sc[t] = e;
    sum += e;
  }
  const float inv = len > 0 ? 1.0f / sum : 0.f;
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) sc[t] *= inv;
}

// Each query vector's softmax over its own context (`qlen[g]` of the `len` scored): the scores past it are set
// to 0, so the value pass, which runs to `len` for every query, adds nothing for them.
inline void softmax_within(float* scores, int64_t len, const int64_t* qlen, int queries) {
  for (int g = 0; g < queries; ++g) {
    float* sc = scores + g * len;
    softmax_in_place(sc, qlen[g]);
    std::fill(sc + qlen[g], sc + len, 0.f);
  }
}

// The hot loop with the head size and the number of query vectors G (a GQA group, or the groups of a run's rows)
// known at compile time, so the per-token work (convert a key row, dot it with each query; convert a value row,
// accumulate it into each query's output) unrolls into registers. Measured on SmolLM2's shapes (64-dim heads,
// groups of 3): several times the generic loop's speed. Query g sees the first `qlen[g]` of the `len` tokens.
template <typename KVT, int D, int G>
void attend_fixed(const float* qf, const typename Elem<KVT>::storage* kc, const typename Elem<KVT>::storage* vc,
                  const int32_t* table, int64_t len, int64_t block_size, int64_t slot_stride, int64_t head_offset,
                  float scale, const int64_t* qlen, float* scores, float* out, ContextStager& stager) {
  using KE = Elem<KVT>;
  using KS = typename KE::storage;
  float q[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) q[g][d] = qf[g * D + d];
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t block = table[t0 / block_size];
    const int64_t n = std::min<int64_t>(block_size, len - t0);
    const KS* kb = kc + block * block_size * slot_stride + head_offset;
    stager.step();
    for (int64_t i = 0; i < n; ++i) {
      const KS* k = kb + i * slot_stride;
      float kf[D];
#pragma omp simd
      for (int d = 0; d < D; ++d) kf[d] = KE::load(k[d]);
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += q[g][d] * kf[d];
        scores[g * len + t0 + i] = dot * scale;
      }
    }
  }
  softmax_within(scores, len, qlen, G);
  float acc[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) acc[g][d] = 0.f;
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t block = table[t0 / block_size];
    const int64_t n = std::min<int64_t>(block_size, len - t0);
    const KS* vb = vc + block * block_size * slot_stride + head_offset;
    stager.step();
    for (int64_t i = 0; i < n; ++i) {
      const KS* v = vb + i * slot_stride;
      float vf[D];
#pragma omp simd
      for (int d = 0; d < D; ++d) vf[d] = KE::load(v[d]);
      for (int g = 0; g < G; ++g) {
        const float p = scores[g * len + t0 + i];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += p * vf[d];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d];
}


#if defined(__AVX512F__)
// The same task written with AVX-512 intrinsics (the build machine's ISA, -march=native): each key/value row is
// D/16 vectors, a score is D/16 fused multiply-adds (sixteen keys' sums then taken together), and the value
// accumulators of the whole group stay in registers. ~5x the compiler-vectorized loop on SmolLM2's shapes.
template <typename KVT>
inline __m512 load16(const typename Elem<KVT>::storage* p);

template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}

template <>
inline __m512 load16<c10::BFloat16>(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Sixteen accumulators (one key's dot product each) summed across their lanes into one vector whose lane j is
// accumulator j's total: a transpose-and-add tree (pairs of floats, pairs of pairs, then 128-bit lanes), 45
// shuffles and adds for what sixteen horizontal sums do in ~4x as many. Every total is summed in the same order
// whatever its position, so a score does not depend on which keys share its chunk.
inline __m512 sum_lanes16(const __m512 (&a)[16]) {
  __m512 pairs[8];
  for (int j = 0; j < 8; ++j)
    pairs[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  __m512 quads[4];
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(pairs[2 * j]), y = _mm512_castps_pd(pairs[2 * j + 1]);
    quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Each 128-bit lane of a quad holds its four keys' partial sums of that lane: add lanes 0+1 and 2+3, twice.
  __m512 halves[2];
  for (int j = 0; j < 2; ++j)
    halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * j], quads[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

template <typename KVT, int D, int G>
void attend_avx512(const float* qf, const typename Elem<KVT>::storage* kc, const typename Elem<KVT>::storage* vc,
                   const int32_t* table, int64_t len, int64_t block_size, int64_t slot_stride, int64_t head_offset,
                   float scale, const int64_t* qlen, float* scores, float* out, ContextStager& stager) {
  using KS = typename Elem<KVT>::storage;
  constexpr int V = D / 16;
#if defined(__AVX512BF16__)
  // bf16 keys: dot products straight from the cache with AVX512-BF16's pairwise dot (no conversion of the
  // keys, half the multiply instructions). Exact products, fp32 sums; the query is bf16 already whenever the
  // cache is (the model's dtype), so rounding it to bf16 loses nothing.
  constexpr bool kPairDot = std::is_same_v<KVT, c10::BFloat16>;
#else
  constexpr bool kPairDot = false;
#endif
  __m512 q[G][V];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) q[g][v] = _mm512_loadu_ps(qf + g * D + 16 * v);
#if defined(__AVX512BF16__)
  __m512bh qp[G][V / 2 > 0 ? V / 2 : 1];
  if constexpr (kPairDot) {
    for (int g = 0; g < G; ++g)
      for (int v = 0; v + 1 < V; v += 2) qp[g][v / 2] = _mm512_cvtne2ps_pbh(q[g][v + 1], q[g][v]);
  }
#endif
  // Scores sixteen keys at a time: each query's sixteen dot products summed across lanes by one tree
  // (`sum_lanes16`) and stored as one vector, where a horizontal sum per score cost ~3x the dot product itself.
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const KS* kb = kc + table[t0 / block_size] * block_size * slot_stride + head_offset;
    const int64_t n = std::min<int64_t>(block_size, len - t0);
    stager.step();
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, n - i0));
      const KS* k0 = kb + i0 * slot_stride;
      for (int g = 0; g < G; ++g) {
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) {
          if (j >= m) {
            acc[j] = _mm512_setzero_ps();
            continue;
          }
          const KS* k = k0 + j * slot_stride;
#if defined(__AVX512BF16__)
          if constexpr (kPairDot && V % 2 == 0) {
            __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qp[g][0], (__m512bh)_mm512_loadu_si512(k));
            for (int v = 1; v < V / 2; ++v)
              a = _mm512_dpbf16_ps(a, qp[g][v], (__m512bh)_mm512_loadu_si512(k + 32 * v));
            acc[j] = a;
            continue;
          }
#endif
          __m512 a = _mm512_mul_ps(q[g][0], load16<KVT>(k));
          for (int v = 1; v < V; ++v) a = _mm512_fmadd_ps(q[g][v], load16<KVT>(k + 16 * v), a);
          acc[j] = a;
        }
        const __m512 s = _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores + g * len + t0 + i0, static_cast<__mmask16>((1u << m) - 1u), s);
      }
    }
  }
  softmax_within(scores, len, qlen, G);
  // bf16 values: the accumulators hold even and odd dimensions apart (see the loop), put back in order at the end.
  constexpr bool kSplitValues = std::is_same_v<KVT, c10::BFloat16> && V % 2 == 0;
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) acc[g][v] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const KS* vb = vc + table[t0 / block_size] * block_size * slot_stride + head_offset;
    const int64_t n = std::min<int64_t>(block_size, len - t0);
    stager.step();
    for (int64_t i = 0; i < n; ++i) {
      const KS* row = vb + i * slot_stride;
      __m512 vv[V];
      if constexpr (kSplitValues) {
        // 32 bf16 values a load, widened in place: the even ones by a shift, the odd ones by a mask (two
        // one-cycle operations where widening 16 at a time is a cross-lane shuffle and a shift per 16).
        for (int c = 0; c < V / 2; ++c) {
          const __m512i raw = _mm512_loadu_si512(row + 32 * c);
          vv[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
          vv[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
        }
      } else {
        for (int v = 0; v < V; ++v) vv[v] = load16<KVT>(row + 16 * v);
      }
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * len + t0 + i]);
        for (int v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(p, vv[v], acc[g][v]);
      }
    }
  }
  if constexpr (kSplitValues) {
    // acc[g][2c] holds the even dimensions of the c-th 32, acc[g][2c + 1] the odd ones: interleaved back.
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < V / 2; ++c) {
        _mm512_storeu_ps(out + g * D + 32 * c, _mm512_permutex2var_ps(acc[g][2 * c], first, acc[g][2 * c + 1]));
        _mm512_storeu_ps(out + g * D + 32 * c + 16,
                         _mm512_permutex2var_ps(acc[g][2 * c], second, acc[g][2 * c + 1]));
      }
    return;
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + g * D + 16 * v, acc[g][v]);
}
#define STRUCTGEN_ATTEND attend_avx512
#else
#define STRUCTGEN_ATTEND attend_fixed
#endif

template <typename KVT>
using FixedTask = void (*)(const float*, const typename Elem<KVT>::storage*, const typename Elem<KVT>::storage*,
                           const int32_t*, int64_t, int64_t, int64_t, int64_t, float, const int64_t*, float*,
                           float*, ContextStager&);

template <typename KVT, int D>
FixedTask<KVT> fixed_for_group(int64_t group) {
  switch (group) {
    case 1: return &STRUCTGEN_ATTEND<KVT, D, 1>;
    case 2: return &STRUCTGEN_ATTEND<KVT, D, 2>;
    case 3: return &STRUCTGEN_ATTEND<KVT, D, 3>;
    case 4: return &STRUCTGEN_ATTEND<KVT, D, 4>;
    case 5: return &STRUCTGEN_ATTEND<KVT, D, 5>;
    case 6: return &STRUCTGEN_ATTEND<KVT, D, 6>;
    case 7: return &STRUCTGEN_ATTEND<KVT, D, 7>;
    case 8: return &STRUCTGEN_ATTEND<KVT, D, 8>;
    default: return nullptr;
  }
}

// The specialized task for this head size and group, or null (the generic loop then serves the call).
template <typename KVT>
FixedTask<KVT> fixed_task(int64_t head_dim, int64_t group) {
  // 32: small models (`tiny`'s 8 heads of 32), where the generic loop took ~0.5 ms a layer for 32 rows and
  // attended a forced run's rows one at a time.
  if (head_dim == 32) return fixed_for_group<KVT, 32>(group);
  if (head_dim == 64) return fixed_for_group<KVT, 64>(group);
  if (head_dim == 128) return fixed_for_group<KVT, 128>(group);
  return nullptr;
}

// The most query vectors one fixed-size task carries (its accumulators stay in registers: 8 x 64 dims is the
// 32 AVX-512 registers), so a run of one context's rows spans at most this many over the group size.
constexpr int64_t kMaxQueries = 8;

// Whether two block tables agree on the blocks that hold the first `len` tokens.
inline bool same_blocks(const int32_t* a, const int32_t* b, int64_t len, int64_t block_size) {
  for (int64_t i = 0; i * block_size < len; ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

template <typename QT, typename KVT>
void decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                      at::Tensor& out, const c10::optional<at::Tensor>& rows) {
  using QE = Elem<QT>;
  using KE = Elem<KVT>;
  using QS = typename QE::storage;
  using KS = typename KE::storage;
  const int64_t num_seqs = context_lens.size(0);
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_row_stride = query.stride(0), q_head_stride = query.stride(1);
  const int64_t o_row_stride = out.stride(0), o_head_stride = out.stride(1);
  const int64_t slot_stride = num_kv_heads * head_dim;
  const int64_t table_stride = block_tables.stride(0);
  const auto* q = reinterpret_cast<const QS*>(query.data_ptr());
  auto* o = reinterpret_cast<QS*>(out.data_ptr());
  const auto* kc = reinterpret_cast<const KS*>(key_cache.data_ptr());
  const auto* vc = reinterpret_cast<const KS*>(value_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* row_of = rows.has_value() ? rows->data_ptr<int32_t>() : nullptr;
  int64_t max_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) max_len = std::max<int64_t>(max_len, lens[s]);
  const float fscale = static_cast<float>(scale);
  std::atomic<bool> bad_block{false};
  // Table entries are checked once up front, so the hot loops index blocks without branches.
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t b = 0; b * block_size < lens[s]; ++b) {
      const int64_t block = tables[s * table_stride + b];
      TORCH_CHECK(block >= 0 && block < num_blocks,
                  "paged_decode_attention: a block table entry within a context is out of range");
    }
  }
  const FixedTask<KVT> fixed = fixed_task<KVT>(head_dim, group);
  // The fixed-size tasks scale each score (the query stays exactly as stored); the generic loop scales q once.
  const float qscale = fixed != nullptr ? 1.0f : fscale;

  // Entries that read one context are attended together: a sequence's new tokens fed as rows (the tokens a
  // grammar forced, a speculative proposal) each see one more token than the one before, through the same block
  // table, and each key and value of that context is then read once for all of them, not once a row (on a
  // structured batch those extra rows made the attention ~2.5x the plain decode step's). A run holds as many
  // entries as the fixed-size tasks have query vectors for (`kMaxQueries` / group); the generic loop takes one.
  const int64_t run_cap = fixed != nullptr ? std::max<int64_t>(1, kMaxQueries / group) : 1;
  std::vector<FixedTask<KVT>> fixed_for(run_cap + 1, nullptr);
  for (int64_t n = 1; n <= run_cap && fixed != nullptr; ++n) fixed_for[n] = fixed_task<KVT>(head_dim, n * group);
  std::vector<int64_t> run_start;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const bool joins = s > 0 && s - run_start.back() < run_cap && lens[s] == lens[s - 1] + 1 &&
                       same_blocks(tables + (s - 1) * table_stride, tables + s * table_stride, lens[s - 1],
                                   block_size);
    if (!joins) run_start.push_back(s);
  }
  const int64_t runs = static_cast<int64_t>(run_start.size());
  run_start.push_back(num_seqs);

  // A task (run, KV head) costs about its context length. at::parallel_for cuts [0, tasks) into equal counts
  // per thread, which on rows of unequal contexts (a structured batch: new requests beside long ones) left one
  // thread with most of the work: cut by cost instead. (A task's cost: its context, read once, a quarter of it
  // again for each further row's products, plus a fixed part for loading the queries, the softmax and the stores.)
  std::vector<int64_t> cost(runs * num_kv_heads);
  for (int64_t task = 0; task < runs * num_kv_heads; ++task) {
    const int64_t run = task / num_kv_heads, count = run_start[run + 1] - run_start[run];
    const int64_t len = lens[run_start[run + 1] - 1];
    cost[task] = len + (count - 1) * len / 4 + 16 * count;
  }
  const std::vector<int64_t> bounds = cost_balanced_bounds(cost, at::get_num_threads());
  const int64_t max_queries = run_cap * group;
  const int64_t budget = stage_budget_bytes(at::get_num_threads());  // (asked outside the parallel region)
  at::parallel_for(0, static_cast<int64_t>(bounds.size()) - 1, 1, [&](int64_t part_begin, int64_t part_end) {
    const int64_t begin = bounds[part_begin], end = bounds[part_end];
    std::vector<float> qf(max_queries * head_dim), acc(max_queries * head_dim), row(head_dim);
    std::vector<float> scores(max_queries * std::max<int64_t>(max_len, 1));
    std::vector<int64_t> qlen(max_queries);
    // Each run's context is staged into L2 while the run before it on this thread is computed (see
    // cpu_context_stager.h); a run not staged ahead (the thread's first) is requested a few blocks ahead of its
    // first pass.
    ContextStager stager;
    int64_t staged = -1, current = -1;
    const int64_t block_bytes = block_size * slot_stride * static_cast<int64_t>(sizeof(KS));
    const auto blocks_of = [&](int64_t length) { return (length + block_size - 1) / block_size; };
    for (int64_t task = begin; task < end; ++task) {
      const int64_t run = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t first = run_start[run], count = run_start[run + 1] - first;
      const int64_t last = first + count - 1, len = lens[last];
      if (run != current) {
        stager.begin(kc, vc, tables + last * table_stride, blocks_of(len), block_bytes, staged == run,
                     blocks_of(len), budget);
        current = run;
        const int64_t next = run + 1;
        staged = next < runs && next * num_kv_heads < end ? next : -1;
        if (staged >= 0) {
          // Spread over the passes left of this run on this thread: keys and values, a head each.
          const int64_t heads_left = std::min<int64_t>(num_kv_heads - h, end - task);
          const int64_t next_last = run_start[next + 1] - 1;
          stager.stage_next(kc, vc, tables + next_last * table_stride, blocks_of(lens[next_last]), block_bytes,
                            2 * heads_left * blocks_of(len), budget);
        }
      }
      for (int64_t e = 0; e < count; ++e) {
        const int64_t r = row_of ? row_of[first + e] : first + e;
        for (int64_t g = 0; g < group; ++g) {
          const QS* src = q + r * q_row_stride + (h * group + g) * q_head_stride;
          float* dst = qf.data() + (e * group + g) * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = QE::load(src[d]) * qscale;
          qlen[e * group + g] = lens[first + e];
        }
      }
      if (fixed != nullptr) {
        fixed_for[count](qf.data(), kc, vc, tables + last * table_stride, len, block_size, slot_stride,
                         h * head_dim, fscale, qlen.data(), scores.data(), acc.data(), stager);
        for (int64_t e = 0; e < count; ++e) {
          const int64_t r = row_of ? row_of[first + e] : first + e;
          for (int64_t g = 0; g < group; ++g) {
            QS* dst = o + r * o_row_stride + (h * group + g) * o_head_stride;
            const float* a = acc.data() + (e * group + g) * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = QE::store(a[d]);
          }
        }
        continue;
      }
      const int64_t s = first, r = row_of ? row_of[s] : s;  // the generic loop: one entry a run
      // Pass 1: scores of every cached token against every query head of the group.
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t block = tables[s * table_stride + t0 / block_size];
        if (block < 0 || block >= num_blocks) {
          bad_block.store(true, std::memory_order_relaxed);
          break;
        }
        const int64_t n = std::min<int64_t>(block_size, len - t0);
        stager.step();
        for (int64_t i = 0; i < n; ++i) {
          const KS* k = kc + (block * block_size + i) * slot_stride + h * head_dim;
          float* kf = row.data();
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) kf[d] = KE::load(k[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * kf[d];
            scores[g * len + t0 + i] = dot;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) softmax_in_place(scores.data() + g * len, len);
      // Pass 2: the weighted sum of the values.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t block = tables[s * table_stride + t0 / block_size];
        if (block < 0 || block >= num_blocks) break;
        const int64_t n = std::min<int64_t>(block_size, len - t0);
        stager.step();
        for (int64_t i = 0; i < n; ++i) {
          const KS* v = vc + (block * block_size + i) * slot_stride + h * head_dim;
          float* vf = row.data();
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) vf[d] = KE::load(v[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + t0 + i];
            float* a = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vf[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        QS* dst = o + r * o_row_stride + (h * group + g) * o_head_stride;
        const float* a = acc.data() + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = QE::store(a[d]);
      }
    }
  });
  TORCH_CHECK(!bad_block.load(), "paged_decode_attention: a block table entry within a context is out of range");
}

template <typename QT>
void dispatch_cache(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out,
                    const c10::optional<at::Tensor>& rows) {
  if (key_cache.scalar_type() == at::kFloat) {
    decode_attention<QT, float>(query, key_cache, value_cache, block_tables, context_lens, scale, out, rows);
  } else if (key_cache.scalar_type() == at::kBFloat16) {
    decode_attention<QT, c10::BFloat16>(query, key_cache, value_cache, block_tables, context_lens, scale, out,
                                        rows);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: the KV cache must be float32 or bfloat16");
  }
}

}  // namespace

// Shapes and dtypes are checked by the Python launcher (kernels/cpu_paged_attention.py); these checks only
// keep a bad direct call from reading out of bounds.
void paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            at::Tensor out, const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "paged_decode_attention: query must be [rows, heads, dim]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.scalar_type() == query.scalar_type(),
              "paged_decode_attention: out must match query");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes(),
              "paged_decode_attention: caches must be contiguous [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.size(3) == query.size(2) && query.size(1) % key_cache.size(2) == 0,
              "paged_decode_attention: cache shape does not fit the query");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
                  block_tables.stride(1) == 1 && context_lens.is_contiguous() &&
                  block_tables.size(0) == context_lens.size(0),
              "paged_decode_attention: block_tables [seqs, max_blocks] and context_lens [seqs] must be int32");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(),
              "paged_decode_attention: key and value caches must share a dtype");
  TORCH_CHECK(!rows.has_value() || (rows->scalar_type() == at::kInt && rows->numel() == context_lens.size(0) &&
                                    rows->is_contiguous()),
              "paged_decode_attention: rows must be int32 [seqs]");
  TORCH_CHECK(rows.has_value() || query.size(0) == context_lens.size(0),
              "paged_decode_attention: one query row per sequence unless rows are given");
  if (rows.has_value()) {
    const int32_t* r = rows->data_ptr<int32_t>();
    for (int64_t i = 0; i < rows->numel(); ++i) {
      TORCH_CHECK(r[i] >= 0 && r[i] < query.size(0), "paged_decode_attention: a row index is out of range");
    }
  }
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < context_lens.size(0); ++i) {
    TORCH_CHECK(lens[i] >= 0 && lens[i] <= block_tables.size(1) * key_cache.size(1),
                "paged_decode_attention: a context length is negative or longer than its block table");
  }
  if (query.scalar_type() == at::kFloat) {
    dispatch_cache<float>(query, key_cache, value_cache, block_tables, context_lens, scale, out, rows);
  } else if (query.scalar_type() == at::kBFloat16) {
    dispatch_cache<c10::BFloat16>(query, key_cache, value_cache, block_tables, context_lens, scale, out, rows);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: query must be float32 or bfloat16");
  }
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, Tensor(a!) out, Tensor? rows) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &structgen_cpu::paged_decode_attention);
}
