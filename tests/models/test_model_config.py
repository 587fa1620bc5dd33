"""ModelConfig parsing of HF config.json dicts (transformers 4 and 5 spellings), family quirks, and errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from structgen.errors import ModelLoadError, UnsupportedArchitectureError
from structgen.models.architectures import SUPPORTED_ARCHITECTURES, create_model, get_model_class
from structgen.models.config import CONFIG_ARCHITECTURES, ModelConfig
from structgen.models.llama import LlamaForCausalLM

BASE = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def _config(architecture: str = "LlamaForCausalLM", **overrides: Any) -> ModelConfig:
    return ModelConfig.from_hf_config({"architectures": [architecture], **BASE, **overrides})


def test_llama_defaults_and_derived_fields() -> None:
    c = _config(model_type="llama", eos_token_id=[2, 7], bos_token_id=1, torch_dtype="bfloat16")
    assert (c.architecture, c.model_type) == ("LlamaForCausalLM", "llama")
    assert c.num_key_value_heads == 4  # absent means MHA
    assert c.head_dim == 16
    assert (c.rope_theta, c.rope_scaling, c.rope_type) == (10000.0, None, "default")
    assert c.max_position_embeddings == 2048
    assert (c.attention_bias, c.o_proj_bias, c.mlp_bias, c.qk_norm) == (False, False, False, False)
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2, 7])
    assert c.torch_dtype is torch.bfloat16
    assert c.rms_norm_eps == 1e-6 and c.tie_word_embeddings is False


def test_transformers4_rope_spelling() -> None:
    c = _config(
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        torch_dtype="float16",
    )
    assert c.rope_theta == 500000.0
    assert c.rope_type == "llama3"
    assert c.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert c.torch_dtype is torch.float16


def test_transformers5_rope_parameters_spelling() -> None:
    c = _config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, dtype="float32")
    assert (c.rope_theta, c.rope_scaling) == (1e6, None)
    assert c.torch_dtype is torch.float32
    c = _config(
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
    )
    # transformers fills original_max_position_embeddings from max_position_embeddings; so do we.
    assert c.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    assert (
        _config(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}).rope_type
        == "linear"
    )
    assert _config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}).rope_type == "dynamic"


def test_family_quirks() -> None:
    qwen2 = _config("Qwen2ForCausalLM", num_key_value_heads=2)
    assert (qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)
    assert qwen2.max_position_embeddings == 32768
    qwen3 = _config("Qwen3ForCausalLM", num_key_value_heads=2, attention_bias=True)
    assert (qwen3.attention_bias, qwen3.o_proj_bias, qwen3.qk_norm) == (True, True, True)
    assert qwen3.head_dim == 128  # transformers' Qwen3 default, not hidden / heads
    llama = _config(attention_bias=True, mlp_bias=True)
    assert (llama.attention_bias, llama.o_proj_bias, llama.mlp_bias) == (True, True, True)
    mistral = _config("MistralForCausalLM", sliding_window=None, hidden_size=512, num_attention_heads=32)
    assert (mistral.num_key_value_heads, mistral.attention_bias) == (
        8,
        False,
    )  # transformers' Mistral defaults
    # Qwen's sliding window only counts when enabled, and a window as long as the context changes nothing.
    assert _config("Qwen2ForCausalLM", sliding_window=4096, use_sliding_window=False).architecture
    assert _config("MistralForCausalLM", num_key_value_heads=2, sliding_window=1 << 20).architecture


def test_architecture_inferred_from_model_type() -> None:
    c = ModelConfig.from_hf_config({"model_type": "qwen3", **BASE, "head_dim": 16})
    assert c.architecture == "Qwen3ForCausalLM"


def test_config_and_model_registries_agree() -> None:
    assert set(CONFIG_ARCHITECTURES) == set(SUPPORTED_ARCHITECTURES)
    for architecture in SUPPORTED_ARCHITECTURES:
        assert get_model_class(architecture) is LlamaForCausalLM


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"num_key_value_heads": 3},
            r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
        ),
        ({"hidden_size": 66}, r"hidden_size \(66\) is not divisible by num_attention_heads \(4\)"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"vocab_size": 0}, "'vocab_size' must be a positive integer"),
        ({"num_hidden_layers": "2"}, "'num_hidden_layers' must be a positive integer"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "longrope"}}, "rope type 'longrope' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs low_freq_factor, high_freq_factor"),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs factor"),
        ({"torch_dtype": "int8"}, "config dtype 'int8'"),
        ({"eos_token_id": "x"}, "'eos_token_id' must be a token id"),
    ],
)
def test_invalid_configs_name_the_problem(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        _config(**overrides)


def test_missing_field_is_named() -> None:
    d = {"architectures": ["LlamaForCausalLM"], **BASE}
    del d["intermediate_size"]
    with pytest.raises(ModelLoadError, match="missing 'intermediate_size'"):
        ModelConfig.from_hf_config(d)


def test_unsupported_architecture_names_it_and_lists_supported() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="'GPT2LMHeadModel'") as info:
        ModelConfig.from_hf_config({"architectures": ["GPT2LMHeadModel"], "n_embd": 64})
    for architecture in SUPPORTED_ARCHITECTURES:
        assert architecture in str(info.value)
    with pytest.raises(UnsupportedArchitectureError, match=r"'MixtralForCausalLM'.*LlamaForCausalLM"):
        get_model_class("MixtralForCausalLM")
    with pytest.raises(ModelLoadError, match="no 'architectures' and an unknown model_type 'gpt2'"):
        ModelConfig.from_hf_config({"model_type": "gpt2", **BASE})


def test_sliding_window_shorter_than_context_is_refused() -> None:
    # transformers' Mistral default window (4096) is shorter than its default context (131072).
    with pytest.raises(ModelLoadError, match="sliding_window=4096 < max_position_embeddings=131072"):
        _config("MistralForCausalLM", num_key_value_heads=2)
    with pytest.raises(ModelLoadError, match="sliding-window attention"):
        _config("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=256, max_window_layers=0)
    with pytest.raises(ModelLoadError, match="sliding-window attention"):
        _config("Qwen3ForCausalLM", sliding_window=256, layer_types=["full_attention", "sliding_attention"])


def test_from_dir_merges_generation_config_eos(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Qwen2ForCausalLM"], **BASE, "eos_token_id": 5})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [6, 5]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == [5, 6]


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json in"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        ModelConfig.from_dir(tmp_path)


def test_create_model_allocates_on_dtype_and_validates() -> None:
    config = _config(num_key_value_heads=2, tie_word_embeddings=True)
    model = create_model(config, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.get_default_dtype() == torch.float32  # restored
    assert not model.training
    with pytest.raises(ModelLoadError, match="model dtype must be one of"):
        create_model(config, dtype=torch.int8, device="cpu")
    with pytest.raises(
        ModelLoadError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size"
    ):
        create_model(config, dtype=torch.float32, device="cpu", tp_size=3, tp_rank=0)
