"""The `tiny` model directory: shape and size, byte-identical rebuilds, and transformers loads it as is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from structgen.models.tiny import (
    CHAT_TEMPLATE,
    TINY_MODEL_VERSION,
    build_tiny_model,
    tiny_num_parameters,
)
from structgen.tokenizer import Tokenizer

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-model") / "a"
    build_tiny_model(out)
    return out


def test_directory_layout_and_config(tiny_dir: Path) -> None:
    assert sorted(p.name for p in tiny_dir.iterdir()) == FILES
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 4, 32)
    assert config["intermediate_size"] == 688 and config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 4096 and config["rope_theta"] == 10000.0
    tokenizer = Tokenizer.from_dir(tiny_dir)
    assert config["vocab_size"] % 64 == 0 and 0 <= config["vocab_size"] - tokenizer.vocab_size < 64
    assert config["bos_token_id"] == tokenizer.bos_token_id
    assert config["eos_token_id"] in tokenizer.eos_token_ids
    assert config["structgen_tiny_model_version"] == TINY_MODEL_VERSION
    tokenizer_config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE


def test_parameter_count_and_init(tiny_dir: Path) -> None:
    import torch

    assert 25_000_000 <= tiny_num_parameters() <= 30_000_000
    total = 0
    with safe_open(tiny_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert "lm_head.weight" not in names  # tied to the embedding
        for name in names:
            tensor = f.get_tensor(name)
            assert tensor.dtype == torch.float32
            total += tensor.numel()
            if name.endswith("norm.weight"):
                assert torch.equal(tensor, torch.ones_like(tensor))
            elif tensor.numel() > 10_000:
                assert abs(tensor.std().item() - 0.02) < 0.001 and abs(tensor.mean().item()) < 0.001
    assert total == tiny_num_parameters()


def test_rebuild_is_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    build_tiny_model(tmp_path / "b")
    for name in FILES:
        assert (tmp_path / "b" / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_transformers_loads_model_and_tokenizer(tiny_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == tiny_num_parameters()
    # transformers used our weights (nothing re-initialized), and the head is the embedding.
    stored = load_file(tiny_dir / "model.safetensors")
    assert torch.equal(model.model.embed_tokens.weight, stored["model.embed_tokens.weight"])
    assert torch.equal(
        model.model.layers[3].mlp.down_proj.weight, stored["model.layers.3.mlp.down_proj.weight"]
    )
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[100264, 882, 198, 13347]])).logits
    assert logits.shape == (1, 4, 100288) and torch.isfinite(logits).all()

    ours, theirs = Tokenizer.from_dir(tiny_dir), AutoTokenizer.from_pretrained(tiny_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris? 🌧"},
        {
            "role": "assistant",
            "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "content": "rain"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, tools=tools) == expected
    assert ours.encode(expected, add_special_tokens=False) == theirs.encode(
        expected, add_special_tokens=False
    )
