"""Test helpers: drive a structgen model over a paged KV cache the way the engine does, and build HF references.

`PagedRunner` owns a block pool and per-sequence block tables; each `step` takes any mix of sequences with new
tokens (prefill, chunked prefill, decode), builds the flattened `AttentionMetadata`, runs the model and returns
each sequence's logits. `hf_tiny_model` builds a random transformers model of a family, saved as safetensors.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from structgen.attention import AttentionMetadata, allocate_kv_cache
from structgen.models.llama import LlamaForCausalLM

TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}

# One random tiny config per family variant the parity tests cover.
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-llama3-rope-tied": (
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-mha-linear-rope-bias": (
        "LlamaForCausalLM",
        {
            "num_key_value_heads": 4,
            "attention_bias": True,
            "mlp_bias": True,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ),
    "mistral-untied": ("MistralForCausalLM", {"sliding_window": None, "rope_theta": 1e6}),
    "qwen2-qkv-bias-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {"head_dim": 32, "attention_bias": True}),
}


def randomize_weights_(model: Any) -> Any:
    """Weights with a spread that makes parity tests meaningful (HF's tiny init leaves logits nearly flat)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
            else:
                param.normal_(0.0, 1.0 / param.shape[-1] ** 0.5)
    return model


def hf_tiny_model(architecture: str, overrides: dict[str, Any], out_dir: Path, *, seed: int = 0) -> Any:
    """A random transformers model of the family, saved with `save_pretrained` (safetensors) into `out_dir`.

    Weights are redrawn larger than HF's init (std 0.02 makes every logit nearly equal, so greedy decoding would
    hinge on float noise), and norm weights are randomized so a mix-up between norms cannot go unnoticed.
    """
    import transformers

    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    config = config_class(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = randomize_weights_(getattr(transformers, architecture)(config).eval())
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def random_structgen_model(
    architecture: str = "LlamaForCausalLM",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> LlamaForCausalLM:
    """A structgen model of a tiny config with seeded random weights (no checkpoint, no transformers)."""
    from structgen.models.architectures import create_model
    from structgen.models.config import ModelConfig

    config = ModelConfig.from_hf_config({"architectures": [architecture], **TINY, **overrides})
    model = create_model(config, dtype=dtype, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    return model


def load_structgen(model_dir: Path, *, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    from structgen.models.loader import load_model

    return load_model(model_dir, dtype=dtype, device="cpu")


class PagedRunner:
    """Block allocation + metadata building for a set of sequences over one model's paged KV cache."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        block_size: int = 16,
        num_blocks: int = 128,
        shuffle_seed: int | None = None,
    ) -> None:
        config = model.config
        dtype = model.model.embed_tokens.weight.dtype
        self.model, self.block_size = model, block_size
        self.kv_caches = allocate_kv_cache(
            num_layers=config.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=dtype,
            device="cpu",
        )
        self.free_blocks = list(range(num_blocks))
        if shuffle_seed is not None:  # scatter each sequence's blocks over the pool in random order
            random.Random(shuffle_seed).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def share_prefix(self, seq: int, source: int, num_blocks: int) -> None:
        """Start `seq` on the first `num_blocks` full blocks of `source`, as a prefix-cache hit does."""
        assert self.lengths[source] >= num_blocks * self.block_size
        self.block_tables[seq] = self.block_tables[source][:num_blocks]
        self.lengths[seq] = num_blocks * self.block_size

    def step(self, batch: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Append `batch[seq]` to each sequence (any lengths ≥ 1) in one forward; logits `[new_tokens, vocab]`."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        for seq, tokens in batch.items():
            start = self.lengths.get(seq, 0)
            table = self.block_tables.setdefault(seq, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            context_lens.append(end)
            self.lengths[seq] = end

        width = max(len(self.block_tables[seq]) for seq in batch)
        tables = [self.block_tables[seq] + [-1] * (width - len(self.block_tables[seq])) for seq in batch]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            context_lens=torch.tensor(context_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(query_lens),
            max_context_len=max(context_lens),
            block_size=self.block_size,
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64),
                self.kv_caches,
                metadata,
            )
            logits = self.model.compute_logits(hidden)
        return dict(zip(batch, logits.split(query_lens), strict=True))

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Prefill every prompt in one step, then decode all sequences together, one token each per step."""
        logits = self.step({seq: prompt for seq, prompt in enumerate(prompts)})
        outputs = [[int(logits[seq][-1].argmax())] for seq in range(len(prompts))]
        for _ in range(max_new_tokens - 1):
            logits = self.step({seq: [out[-1]] for seq, out in enumerate(outputs)})
            for seq, out in enumerate(outputs):
                out.append(int(logits[seq][-1].argmax()))
        return outputs
