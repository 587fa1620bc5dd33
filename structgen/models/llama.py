"""The Llama-style decoder behind four families: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

The batch is flattened: `input_ids` and `positions` are `[num_tokens]` over every sequence of the step, and each
attention layer reads and writes its slice of the paged KV cache through the attention backend, which gets the
step's `AttentionMetadata`. Module and parameter names mirror Hugging Face's, except for the fused projections
(`qkv_proj`, `gate_up_proj`) that `load_weights` fills from the separate HF tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from structgen.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from structgen.errors import ModelLoadError
from structgen.models.config import ModelConfig
from structgen.models.cpu_kernels import native_ops
from structgen.models.layers import RMSNorm, SiluAndMul
from structgen.models.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from structgen.models.rotary import RotaryEmbedding

# (fused parameter infix, HF infix, shard id): HF checkpoints store these projections separately.
_STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
# Checkpoint entries that are not weights: non-persistent buffers some exporters still write.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, *, attn_backend: AttentionBackend, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=config.o_proj_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.scale = config.head_dim**-0.5
        self.attn_backend = attn_backend

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        ops = native_ops(q) if q.dtype == cos.dtype else None
        if ops is not None:
            ops.rotary_embedding_(q, k, cos, sin)  # in place: q and k are this step's own projections
        else:
            q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        out = self.attn_backend.forward(q, k, v, kv_cache, metadata, scale=self.scale)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, *, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=config.mlp_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=config.mlp_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, *, attn_backend: AttentionBackend, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend=attn_backend, tp_rank=tp_rank, tp_size=tp_size)
        self.mlp = LlamaMLP(config, tp_rank=tp_rank, tp_size=tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse "add the sublayer output" into itself.
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.forward_with_residual(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos, sin, kv_cache, metadata)
        hidden_states, residual = self.post_attention_layernorm.forward_with_residual(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, *, attn_backend: AttentionBackend, tp_rank: int, tp_size: int
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )
        self.rotary_emb = RotaryEmbedding(
            head_dim=config.head_dim,
            rope_theta=config.rope_theta,
            rope_scaling=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend=attn_backend, tp_rank=tp_rank, tp_size=tp_size)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # The same forward without module calls, on the CPU (`structgen.models.llama_flat`); set by the engine.
        self.flat_forward: Callable[..., torch.Tensor] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.flat_forward is not None:
            return self.flat_forward(input_ids, positions, kv_caches, metadata)
        hidden_states = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, hidden_states.dtype)  # once per step, shared by layers
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(hidden_states, residual, cos, sin, kv_cache, metadata)
        hidden_states, _ = self.norm.forward_with_residual(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """One class serves LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        attn_backend: AttentionBackend,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        self.config = config
        self.model = LlamaModel(config, attn_backend=attn_backend, tp_rank=tp_rank, tp_size=tp_size)
        shared = self.model.embed_tokens.weight if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size, shared_weight=shared
        )
        # The KV heads this rank caches: its share, or one replicated head when there are fewer than ranks.
        self.num_local_kv_heads: int = self.model.layers[0].self_attn.num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states `[num_tokens, hidden_size]` of the step's tokens; the cache is updated in place."""
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`[n, vocab_size]` float32 logits for the rows that sample (the caller selects them first); under
        tensor parallelism every rank must call it, and only rank 0 gets the full vocabulary."""
        return self.lm_head.compute_logits(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; every parameter must be covered exactly once and nothing unknown may appear."""
        params = dict(self.named_parameters())  # a tied lm_head is deduplicated away
        pending: dict[str, set[str | int | None]] = {name: _shard_ids(name) for name in params}
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some exporters write the tied copy too; the embedding is the one that is used
            name, shard_id = _fused_name(hf_name)
            param = params.get(name)
            if param is None or shard_id not in _shard_ids(name):
                raise ModelLoadError(
                    f"unexpected tensor {hf_name!r}: {self.config.architecture} has no such parameter"
                )
            if shard_id not in pending[name]:
                raise ModelLoadError(f"tensor {hf_name!r} appears twice in the checkpoint")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id)
            except ModelLoadError as e:
                raise ModelLoadError(f"tensor {hf_name!r}: {e}") from None
            pending[name].discard(shard_id)
        missing = [_hf_name(name, shard_id) for name, shard_ids in pending.items() for shard_id in shard_ids]
        if missing:
            shown = ", ".join(sorted(missing)[:8]) + (", ..." if len(missing) > 8 else "")
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def _shard_ids(param_name: str) -> set[str | int | None]:
    ids: set[str | int | None] = {sid for fused, _, sid in _STACKED_PARAMS if fused in param_name}
    return ids or {None}


def _fused_name(hf_name: str) -> tuple[str, str | int | None]:
    for fused, part, shard_id in _STACKED_PARAMS:
        if part in hf_name:
            return hf_name.replace(part, fused), shard_id
    return hf_name, None


def _hf_name(param_name: str, shard_id: str | int | None) -> str:
    for fused, part, sid in _STACKED_PARAMS:
        if fused in param_name and sid == shard_id:
            return param_name.replace(fused, part)
    return param_name
