// write_kv_cache: scatters the step's new keys and values into their flat cache slots (slot -1 marks a padding
// row that is not stored), converting to the cache dtype. One op instead of a mask, two index_copy_ calls and
// a host sync per layer. The reference is `write_kv_cache` in structgen/attention/torch_backend.py.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <atomic>

#include "cpu_common.h"
#include "cpu_kernels.h"

namespace structgen_cpu {
namespace {

// One head's key and value rows into their slot; restrict lets the conversion loop vectorize.
template <typename IT, typename CT>
inline void store_rows(const typename Elem<IT>::storage* __restrict ks, const typename Elem<IT>::storage* __restrict vs,
                       typename Elem<CT>::storage* __restrict kd, typename Elem<CT>::storage* __restrict vd,
                       int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) {
    kd[d] = Elem<CT>::store(Elem<IT>::load(ks[d]));
    vd[d] = Elem<CT>::store(Elem<IT>::load(vs[d]));
  }
}

template <typename IT, typename CT>
void scatter(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
             const at::Tensor& slot_mapping) {
  using IS = typename Elem<IT>::storage;
  using CS = typename Elem<CT>::storage;
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const auto* k = reinterpret_cast<const IS*>(key.data_ptr());
  const auto* v = reinterpret_cast<const IS*>(value.data_ptr());
  auto* kc = reinterpret_cast<CS*>(key_cache.data_ptr());
  auto* vc = reinterpret_cast<CS*>(value_cache.data_ptr());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  std::atomic<bool> bad_slot{false};
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      if (slot >= num_slots) {
        bad_slot.store(true, std::memory_order_relaxed);
        continue;
      }
      for (int64_t h = 0; h < heads; ++h) {
        const IS* ks = k + t * key.stride(0) + h * key.stride(1);
        const IS* vs = v + t * value.stride(0) + h * value.stride(1);
        store_rows<IT, CT>(ks, vs, kc + (slot * heads + h) * dim, vc + (slot * heads + h) * dim, dim);
      }
    }
  });
  TORCH_CHECK(!bad_slot.load(), "write_kv_cache: a slot is past the end of the cache");
}

template <typename IT>
void dispatch_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                    const at::Tensor& slot_mapping) {
  if (key_cache.scalar_type() == at::kFloat) {
    scatter<IT, float>(key, value, key_cache, value_cache, slot_mapping);
  } else if (key_cache.scalar_type() == at::kBFloat16) {
    scatter<IT, c10::BFloat16>(key, value, key_cache, value_cache, slot_mapping);
  } else {
    TORCH_CHECK(false, "write_kv_cache: the cache must be float32 or bfloat16");
  }
}

}  // namespace

// key/value [tokens, kv_heads, dim] (strided rows fine), caches [blocks, block_size, kv_heads, dim] contiguous,
// slot_mapping [tokens] int64.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.stride(2) == 1 && value.stride(2) == 1 &&
                  key.scalar_type() == value.scalar_type(),
              "write_kv_cache: key/value must be matching [tokens, kv_heads, dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4 &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.size(2) == key.size(1) &&
                  key_cache.size(3) == key.size(2) && key_cache.scalar_type() == value_cache.scalar_type(),
              "write_kv_cache: caches must be contiguous [blocks, block_size, kv_heads, dim] matching key");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "write_kv_cache: slot_mapping must be int64 [tokens]");
  if (key.scalar_type() == at::kFloat) {
    dispatch_cache<float>(key, value, key_cache, value_cache, slot_mapping);
  } else if (key.scalar_type() == at::kBFloat16) {
    dispatch_cache<c10::BFloat16>(key, value, key_cache, value_cache, slot_mapping);
  } else {
    TORCH_CHECK(false, "write_kv_cache: key/value must be float32 or bfloat16");
  }
}

}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.impl("write_kv_cache", c10::DispatchKey::CPU, &structgen_cpu::write_kv_cache);
}
