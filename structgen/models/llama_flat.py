"""The Llama decoder's forward as one loop over prebound kernels: the CPU's single-stream fast path.

A SmolLM2 decode step is ~300 small calls. Through `nn.Module` each pays `__call__`'s hook machinery and a
`Module.__getattr__` lookup per submodule (cProfile: ~250 module calls and ~400 lookups a step, ~2 ms of a
~15 ms single-stream step). `FlatLlamaForward` resolves every layer's weights, kernels and sizes once, then runs
the same ops in the same order as `LlamaModel.forward` with the native CPU kernels, so its outputs are the
module path's, bit for bit (tests/models/test_llama_flat.py).

It applies on the CPU with the native kernels loaded, one rank, and a plain Llama layer (no q/k norm, no biases:
Llama, Mistral, SmolLM2); `enable_flat_forward` says whether it was set. Build it after the layers' kernels are
attached (`prepare_cpu_linears`, `attach_int4`): it keeps the kernels it found.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from structgen.attention.backend import AttentionMetadata, KVCache

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class _FlatLayer:
    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: Linear
    o_proj: Linear
    gate_up: Linear
    down: Linear
    splits: list[int]  # q, k, v widths of the fused projection
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float


class FlatLlamaForward:
    """`LlamaModel.forward(input_ids, positions, kv_caches, metadata)` without the module calls."""

    def __init__(self, model: nn.Module, ops: ModuleType) -> None:
        self.ops = ops
        self.embed = model.embed_tokens.weight
        self.rotary = model.rotary_emb
        self.norm, self.norm_eps = model.norm.weight, model.norm.eps
        self.attend = model.layers[0].self_attn.attn_backend.forward
        self.layers = [_flat_layer(layer) for layer in model.layers]
        self.native_decode = NativeDecodeStep.build(model, self.layers)  # None where it does not apply
        # With LoRA adapters attached (`structgen.lora.layers`): steps with adapter rows take the loop below,
        # whose projections add them; the all-native decode call knows only the base weights.
        self.lora_step: Any = None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        ops, attend = self.ops, self.attend
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        native = self.native_decode
        if native is not None and 0 < hidden.shape[0] <= native.max_rows:
            lora = self.lora_step
            slots = lora.token_slots if lora is not None else None
            if slots is None or native.lora:  # adapter rows only where the native step has their weights
                if metadata.is_decode:
                    return native(hidden, cos, sin, kv_caches, metadata, lora_slots=slots)
                rows = _decode_rows_only(metadata)
                if (
                    rows is not None
                ):  # a few new tokens per sequence (forced tokens, proposals): decode rows all
                    return native(hidden, cos, sin, kv_caches, metadata, rows=rows, lora_slots=slots)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            if residual is None:
                residual, hidden = hidden, ops.rms_norm(hidden, layer.input_norm, eps=layer.input_eps)
            else:
                hidden, residual = ops.fused_add_rms_norm(
                    hidden, residual, layer.input_norm, eps=layer.input_eps
                )
            q, k, v = layer.qkv(hidden).split(layer.splits, dim=-1)
            q = q.view(-1, layer.num_heads, layer.head_dim)
            k = k.view(-1, layer.num_kv_heads, layer.head_dim)
            v = v.view(-1, layer.num_kv_heads, layer.head_dim)
            ops.rotary_embedding_(q, k, cos, sin)
            out = attend(q, k, v, kv_cache, metadata, scale=layer.scale)
            hidden = layer.o_proj(out.reshape(-1, layer.num_heads * layer.head_dim))
            hidden, residual = ops.fused_add_rms_norm(hidden, residual, layer.post_norm, eps=layer.post_eps)
            hidden = layer.down(ops.silu_and_mul(layer.gate_up(hidden)))
        hidden, _ = ops.fused_add_rms_norm(hidden, residual, self.norm, eps=self.norm_eps)
        return hidden


@dataclass(slots=True)
class NativeDecodeStep:
    """All layers of a decode step as one native call; `max_rows` rows at most (the GEMV's)."""

    weights: list[torch.Tensor]  # per layer: 2 norms, then (qweight, scales, mins) of qkv, o, gate_up, down
    bits: list[int]
    eps: list[float]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    max_rows: int
    # The LoRA slots of every projection (`structgen.lora.layers.LoRALinear`: a, ranks, ka, kb per part, in the
    # weights' order), empty without adapters: steps with adapter rows add them inside the native call.
    lora: list[torch.Tensor]
    _caches: tuple[object, list[torch.Tensor], list[torch.Tensor]] | None = None

    @classmethod
    def build(cls, model: nn.Module, layers: list[_FlatLayer] | None = None) -> NativeDecodeStep | None:
        """For a decoder (`LlamaModel`) whose flat forward applies (its `layers` as that forward resolved them),
        or None: it needs the CPU attention backend and the GEMV on every projection, bf16 (the VNNI one) or fp32
        (the AVX2 one: what `attach_int4` gives each dtype)."""
        from structgen.attention.cpu_backend import CpuAttentionBackend
        from structgen.kernels.cpu_woq import WoqGemv
        from structgen.models.cpu_linear import QuantizedSmallBatches

        if not isinstance(
            model.layers[0].self_attn.attn_backend, CpuAttentionBackend
        ) or model.embed_tokens.weight.dtype not in (torch.bfloat16, torch.float32):
            return None
        layers = layers if layers is not None else [_flat_layer(layer) for layer in model.layers]
        first = layers[0]
        shape = (first.num_heads, first.num_kv_heads, first.head_dim, first.scale)
        weights: list[torch.Tensor] = []
        bits: list[int] = []
        eps: list[float] = []
        max_rows = 1 << 30
        lora: list[torch.Tensor] = []
        wrapped = 0
        for layer in layers:
            if (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale) != shape:
                return None
            weights += [layer.input_norm, layer.post_norm]
            eps += [layer.input_eps, layer.post_eps]
            for kernel in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                if hasattr(
                    kernel, "ranks"
                ):  # a LoRA wrapper (structgen.lora.layers): its slots, then its kernel
                    lora += [kernel.a, kernel.ranks, kernel.ka, *kernel.kb]
                    kernel = kernel.base
                    wrapped += 1
                if not isinstance(kernel, QuantizedSmallBatches) or not isinstance(kernel.gemv, WoqGemv):
                    return None
                packed = kernel.gemv.weight
                weights += [packed.qweight, packed.scales, packed.mins]
                bits.append(packed.bits)
                max_rows = min(max_rows, kernel.gemv_rows)
        weights.append(model.norm.weight)
        eps.append(model.norm.eps)
        if wrapped not in (0, 4 * len(layers)):
            return None  # some projections wrapped, others not: the native step takes all or none
        return cls(weights, bits, eps, *shape, max_rows, lora)

    def __call__(
        self,
        embedded: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        *,
        rows: tuple[torch.Tensor, torch.Tensor] | None = None,
        lora_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`rows`: (block table, context length) of each row where a sequence has several (each new token a
        decode row that sees the context up to itself, as the CPU attention backend runs them)."""
        if self._caches is None or self._caches[0] is not kv_caches:  # the runner keeps one list for its life
            self._caches = (kv_caches, [k for k, _ in kv_caches], [v for _, v in kv_caches])
        _, keys, values = self._caches
        tables, lens = rows if rows is not None else (metadata.block_tables, metadata.context_lens)
        return torch.ops.structgen_cpu.decode_layers(
            embedded,
            cos,
            sin,
            metadata.slot_mapping,
            tables,
            lens,
            keys,
            values,
            self.weights,
            self.bits,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.scale,
            self.eps,
            self.lora if lora_slots is not None else [],
            lora_slots,
        )


def _linear(module: nn.Module) -> Linear:
    """What the layer's forward computes (no bias, one rank): its kernel, else `F.linear` on its weight."""
    if module.kernel is not None:
        return module.kernel
    return functools.partial(F.linear, weight=module.weight)


def _flat_layer(layer: nn.Module) -> _FlatLayer:
    attn, mlp = layer.self_attn, layer.mlp
    return _FlatLayer(
        input_norm=layer.input_layernorm.weight,
        input_eps=layer.input_layernorm.eps,
        post_norm=layer.post_attention_layernorm.weight,
        post_eps=layer.post_attention_layernorm.eps,
        qkv=_linear(attn.qkv_proj),
        o_proj=_linear(attn.o_proj),
        gate_up=_linear(mlp.gate_up_proj),
        down=_linear(mlp.down_proj),
        splits=[attn.q_size, attn.kv_size, attn.kv_size],
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        scale=attn.scale,
    )


def flat_forward_blocker(model: nn.Module) -> str | None:
    """Why `model` (a `LlamaForCausalLM`) cannot take the flat forward, or None."""
    from structgen.models.cpu_kernels import native_ops
    from structgen.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not the Llama decoder"
    decoder = model.model
    weight = decoder.embed_tokens.weight
    if native_ops(weight) is None:
        return "no native CPU kernels for this device and dtype"
    if decoder.embed_tokens.tp_size != 1:
        return "tensor parallel"
    backend = decoder.layers[0].self_attn.attn_backend
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.attn_backend is not backend:
            return "layers with different attention backends"
        if attn.qk_norm:
            return "q/k norm"
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(m.bias is not None for m in linears):
            return "biased projections"
        params = (
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            *(m.weight for m in linears),
        )
        if any(p.dtype != weight.dtype for p in params):
            return "mixed dtypes"
    return None


def enable_flat_forward(model: nn.Module) -> bool:
    """Make `model.model.forward` take the flat path when it applies; returns whether it does."""
    if flat_forward_blocker(model) is not None:
        return False
    from structgen.kernels import cpu_ops

    model.model.flat_forward = FlatLlamaForward(model.model, cpu_ops)
    return True


def _decode_rows_only(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(block table, context length) per row when every sequence's new tokens are decode rows for the CPU
    attention (`cpu_backend._decode_rows`: one token, or a few on a cached context), else None."""
    from structgen.attention.cpu_backend import decode_rows

    seqs, _, tables, lens = decode_rows(metadata)
    if len(seqs) != metadata.num_seqs:
        return None
    return tables, lens
