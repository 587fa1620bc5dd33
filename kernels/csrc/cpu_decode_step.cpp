// A Llama decoder's layers for one decode step of a few rows, as one call: the single stream's fast path.
//
// Why: a single-stream SmolLM2 step is ~12 small kernels a layer, 30 layers, and each call from Python (the flat
// forward, `structgen/models/llama_flat.py`) costs a few microseconds of interpreter and dispatcher time: ~2 ms of
// a ~12 ms step once the weight reads were fast. Here the same kernels run in the same order on the same tensors,
// called directly (`cpu_kernels.h`), so the outputs are the flat forward's bit for bit
// (tests/models/test_llama_flat.py).
//
// Arguments: `embedded` [rows, hidden] bf16 or fp32 (the model's dtype: the embedding rows, also the first
// residual, updated in place), cos and sin as the rotary kernel takes them, the attention metadata of a pure
// decode step, each layer's key and value cache, and per layer `kWeightsPerLayer` tensors: the input and
// post-attention norm weights, then (qweight, scales, mins) of the fused qkv, o, fused gate_up and down
// projections packed for `woq_gemv` (bf16; `woq_gemv_avx2` for fp32), with their bit widths in `bits` (4 a
// layer); the final norm's weight last. `eps`: the two norms' epsilon of each layer, then the final norm's.
// Returns the final norm's output [rows, hidden].
//
// With LoRA adapters (`structgen/lora/layers.py`) in the step: `lora` holds, for each layer and linear in the
// order above, the slots' `a` [slots, parts, rank, in], their `ranks` [slots, parts], `a` by input pairs (or an
// empty tensor) and one `b` per part, and
// `lora_slots` each row's slot (-1: none); each projection then adds its rows' adapters (`lora_add`) as the flat
// forward's wrappers do. Empty `lora`: the base model alone.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "cpu_kernels.h"

namespace structgen_cpu {
namespace {

constexpr int64_t kWeightsPerLayer = 14;
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down

// Where each linear's LoRA tensors start in `lora`: (a, ranks, b per part) one linear after another.
std::vector<int64_t> lora_starts(at::TensorList lora, int64_t linears) {
  std::vector<int64_t> starts;
  if (lora.empty()) return starts;
  int64_t at = 0;
  for (int64_t i = 0; i < linears; ++i) {
    TORCH_CHECK(at < static_cast<int64_t>(lora.size()) && lora[at].dim() == 4, "decode_layers: bad lora list");
    starts.push_back(at);
    at += 3 + lora[at].size(1);
  }
  TORCH_CHECK(at == static_cast<int64_t>(lora.size()), "decode_layers: bad lora list length");
  return starts;
}

struct Step {
  at::TensorList weights;
  at::IntArrayRef bits;
  int64_t rows;
  at::TensorList lora;
  std::vector<int64_t> lora_at;
  c10::optional<at::Tensor> lora_slots;
  int64_t q_size, kv_size;

  // x @ W^T for linear `which` of layer `layer`, through the GEMV on its packed blocks, plus the rows' adapters.
  at::Tensor linear(const at::Tensor& x, int64_t layer, int64_t which) const {
    const int64_t first = layer * kWeightsPerLayer + 2 + 3 * which;
    const at::Tensor& qweight = weights[first];
    at::Tensor out = at::empty({rows, qweight.size(0) * 16}, x.options());
    // bf16 rows: the VNNI GEMV (what `attach_int4` gives bf16 layers); fp32 rows: the AVX2 one (fp32 layers').
    const auto gemv = x.scalar_type() == at::kFloat ? &woq_gemv_avx2 : &woq_gemv;
    gemv(x, qweight, weights[first + 1], weights[first + 2], bits[layer * kLinearsPerLayer + which], out);
    if (!lora_at.empty()) {
      const int64_t at = lora_at[layer * kLinearsPerLayer + which];
      const at::Tensor& a = lora[at];
      const int64_t parts = a.size(1);
      // Where each part starts: q, k, v of the fused qkv; gate, up of the fused gate_up; one part otherwise.
      std::vector<int64_t> offsets{0};
      if (parts == 3) offsets = {0, q_size, q_size + kv_size};
      if (parts == 2) offsets = {0, out.size(1) / 2};
      lora_add(x, out, a, lora.slice(at + 3, parts), offsets, *lora_slots, lora[at + 1], lora[at + 2]);
    }
    return out;
  }
};

at::Tensor decode_layers(const at::Tensor& embedded, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, at::TensorList key_caches, at::TensorList value_caches,
                         at::TensorList weights, at::IntArrayRef bits, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, double scale, at::ArrayRef<double> eps, at::TensorList lora,
                         const c10::optional<at::Tensor>& lora_slots) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(value_caches.size()) == layers,
              "decode_layers: one key and one value cache a layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer + 1,
              "decode_layers: expected ", layers * kWeightsPerLayer + 1, " weights for ", layers, " layers, got ",
              weights.size());
  TORCH_CHECK(static_cast<int64_t>(bits.size()) == layers * kLinearsPerLayer &&
                  static_cast<int64_t>(eps.size()) == 2 * layers + 1,
              "decode_layers: bits must hold 4 widths a layer and eps 2 values a layer plus the final norm's");
  TORCH_CHECK(embedded.dim() == 2 && embedded.is_contiguous() &&
                  (embedded.scalar_type() == at::kBFloat16 || embedded.scalar_type() == at::kFloat),
              "decode_layers: the embedded rows must be a contiguous bf16 or fp32 [rows, hidden]");
  const int64_t rows = embedded.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(lora.empty() || lora_slots.has_value(), "decode_layers: lora weights need lora_slots");
  const Step step{weights, bits, rows, lora, lora_starts(lora, layers * kLinearsPerLayer), lora_slots,
                  q_size, kv_size};

  at::Tensor residual = embedded;  // updated in place by each fused add + norm, as in the flat forward
  at::Tensor hidden;
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor& input_norm = weights[layer * kWeightsPerLayer];
    const at::Tensor& post_norm = weights[layer * kWeightsPerLayer + 1];
    at::Tensor normed = at::empty_like(residual);
    if (layer == 0) {
      rms_norm(residual, input_norm, eps[0], normed);
    } else {
      fused_add_rms_norm(hidden, residual, input_norm, eps[2 * layer], normed);
    }
    const at::Tensor qkv = step.linear(normed, layer, 0);
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "decode_layers: layer ", layer,
                "'s qkv projection does not match the head sizes");
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads, head_dim});
    rotary_embedding(q, k, cos, sin);
    write_kv_cache(k, v, key_caches[layer], value_caches[layer], slot_mapping);
    at::Tensor attended = at::empty({rows, num_heads, head_dim}, normed.options());
    paged_decode_attention(q, key_caches[layer], value_caches[layer], block_tables, context_lens, scale, attended,
                           c10::nullopt);
    const at::Tensor projected = step.linear(attended.view({rows, q_size}), layer, 1);
    at::Tensor mlp_in = at::empty_like(projected);
    fused_add_rms_norm(projected, residual, post_norm, eps[2 * layer + 1], mlp_in);
    const at::Tensor gate_up = step.linear(mlp_in, layer, 2);
    at::Tensor activated = at::empty({rows, gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul(gate_up, activated);
    hidden = step.linear(activated, layer, 3);
  }
  at::Tensor out = at::empty_like(hidden);
  fused_add_rms_norm(hidden, residual, weights[layers * kWeightsPerLayer], eps[2 * layers], out);
  return out;
}

}  // namespace
}  // namespace structgen_cpu

TORCH_LIBRARY_FRAGMENT(structgen_cpu, m) {
  m.def(
      "decode_layers(Tensor(a!) embedded, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, "
      "Tensor context_lens, Tensor(b!)[] key_caches, Tensor(c!)[] value_caches, Tensor[] weights, int[] bits, "
      "int num_heads, int num_kv_heads, int head_dim, float scale, float[] eps, Tensor[] lora, Tensor? lora_slots) "
      "-> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, &structgen_cpu::decode_layers);
}
