"""`load_weights`: HF names into fused parameters, tied embeddings, and errors that name the tensor."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from structgen.errors import ModelLoadError
from structgen.models.architectures import create_model
from structgen.models.config import ModelConfig
from structgen.models.llama import LlamaForCausalLM

TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _hf_state_dict(architecture: str, **overrides: Any) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and state dict of a random transformers model, exactly as a checkpoint would hold them."""
    import transformers

    hf_config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**{**TINY, **overrides})
    torch.manual_seed(0)
    hf_model = getattr(transformers, architecture)(hf_config)
    state = {name: t.detach().clone() for name, t in hf_model.state_dict().items()}
    config = ModelConfig.from_hf_config({**hf_config.to_dict(), "architectures": [architecture]})
    return config, state


def _model(config: ModelConfig) -> LlamaForCausalLM:
    return create_model(config, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
        ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
        ("Qwen3ForCausalLM", {"head_dim": 16}),
        ("MistralForCausalLM", {"sliding_window": None}),
    ],
)
def test_hf_tensors_land_in_the_fused_parameters(architecture: str, overrides: dict[str, Any]) -> None:
    config, state = _hf_state_dict(architecture, **overrides)
    model = _model(config)
    model.load_weights(state.items())
    params = dict(model.named_parameters())
    for i in range(config.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        qkv = torch.cat([state[f"{attn}.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(params[f"{attn}.qkv_proj.weight"], qkv)
        if config.attention_bias:
            assert torch.equal(
                params[f"{attn}.qkv_proj.bias"], torch.cat([state[f"{attn}.{p}_proj.bias"] for p in "qkv"])
            )
        gate_up = torch.cat([state[f"{mlp}.gate_proj.weight"], state[f"{mlp}.up_proj.weight"]])
        assert torch.equal(params[f"{mlp}.gate_up_proj.weight"], gate_up)
    for name, tensor in state.items():
        if name in params:
            assert torch.equal(params[name], tensor), name
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert torch.equal(model.lm_head.weight, state["lm_head.weight"])


def test_tied_checkpoint_copy_of_lm_head_and_rotary_buffers_are_skipped() -> None:
    config, state = _hf_state_dict("LlamaForCausalLM", tie_word_embeddings=True)
    state["lm_head.weight"] = torch.zeros_like(state["model.embed_tokens.weight"])
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    model = _model(config)
    model.load_weights(state.items())
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])


def test_loading_casts_to_the_model_dtype() -> None:
    config, state = _hf_state_dict("LlamaForCausalLM")
    model = create_model(config, dtype=torch.bfloat16, device="cpu")
    model.load_weights(state.items())
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"].to(torch.bfloat16))


def test_wrong_shape_names_the_tensor_and_both_shapes() -> None:
    config, state = _hf_state_dict("LlamaForCausalLM")
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(24, 32)
    with pytest.raises(
        ModelLoadError,
        match=r"'model\.layers\.1\.self_attn\.k_proj\.weight': shape mismatch: expected \[16, 32\], got \[24, 32\]",
    ):
        _model(config).load_weights(state.items())
    config, state = _hf_state_dict("LlamaForCausalLM")
    state["model.norm.weight"] = torch.zeros(33)
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight'.*expected \[32\], got \[33\]"):
        _model(config).load_weights(state.items())
    config, state = _hf_state_dict("LlamaForCausalLM")
    state["model.embed_tokens.weight"] = torch.zeros(95, 32)
    with pytest.raises(
        ModelLoadError, match=r"'model\.embed_tokens\.weight'.*expected \[96, 32\], got \[95, 32\]"
    ):
        _model(config).load_weights(state.items())


def test_unknown_tensor_is_named() -> None:
    config, state = _hf_state_dict("LlamaForCausalLM")
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)  # a Qwen3 tensor in a Llama checkpoint
    with pytest.raises(
        ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"
    ):
        _model(config).load_weights(state.items())
    config, state = _hf_state_dict("LlamaForCausalLM")
    state["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(64, 32)  # already-fused export
    with pytest.raises(
        ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.qkv_proj\.weight'"
    ):
        _model(config).load_weights(state.items())


@pytest.mark.parametrize(
    "dropped",
    [
        "model.layers.1.mlp.up_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ],
)
def test_missing_tensor_is_named(dropped: str) -> None:
    config, state = _hf_state_dict("LlamaForCausalLM")
    del state[dropped]
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor\(s\): " + re.escape(dropped) + "$"):
        _model(config).load_weights(state.items())


def test_missing_bias_of_a_qwen2_checkpoint_is_named() -> None:
    config, state = _hf_state_dict("Qwen2ForCausalLM")
    del state["model.layers.0.self_attn.k_proj.bias"]
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias"):
        _model(config).load_weights(state.items())


def test_duplicate_tensor_is_refused() -> None:
    config, state = _hf_state_dict("LlamaForCausalLM")
    items = [
        *state.items(),
        ("model.layers.0.mlp.gate_proj.weight", state["model.layers.0.mlp.gate_proj.weight"]),
    ]
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' appears twice"):
        _model(config).load_weights(items)
