"""RotaryEmbedding against transformers' RoPE initializers and `apply_rotary_pos_emb`, for every scaling type."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from structgen.models.config import ModelConfig
from structgen.models.rotary import RotaryEmbedding

SCALINGS: dict[str, dict[str, Any] | None] = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 512,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "truncate": False,
    },
}
HEAD_DIM, THETA, MAX_POSITIONS = 64, 50000.0, 2048


def _hf_rotary(scaling: dict[str, Any] | None) -> Any:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_theta": THETA, **(scaling or {"rope_type": "default"})},
    )
    return LlamaRotaryEmbedding(config)


def _ours(scaling: dict[str, Any] | None) -> RotaryEmbedding:
    # Through ModelConfig, so the parsed spelling is what the layer receives.
    config = ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 8,
            "hidden_size": HEAD_DIM * 4,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "max_position_embeddings": MAX_POSITIONS,
            "rope_parameters": {"rope_theta": THETA, **(scaling or {})},
        }
    )
    return RotaryEmbedding(
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        max_position_embeddings=config.max_position_embeddings,
    )


@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_and_rotation_match_transformers(name: str) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf, ours = _hf_rotary(SCALINGS[name]), _ours(SCALINGS[name])
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq, atol=0, rtol=0)
    assert ours.attention_scaling == pytest.approx(hf.attention_scaling)

    positions = torch.tensor([0, 1, 7, 300, 1500, MAX_POSITIONS - 1])
    q = torch.randn(len(positions), 4, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    k = torch.randn(len(positions), 2, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    hf_cos, hf_sin = hf(q, positions[None])  # [1, n, head_dim]
    # HF wants [batch, heads, seq, dim]; ours is [tokens, heads, dim].
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    cos, sin = ours.cos_sin(positions, torch.float32)
    torch.testing.assert_close(RotaryEmbedding.apply(q, cos, sin), hf_q[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(RotaryEmbedding.apply(k, cos, sin), hf_k[0].transpose(0, 1), atol=0, rtol=0)


def test_scaling_changes_the_frequencies() -> None:
    default = _ours(None).inv_freq
    for name in ("linear", "llama3", "yarn"):
        assert not torch.equal(_ours(SCALINGS[name]).inv_freq, default), name
