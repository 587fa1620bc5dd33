"""GGUF -> HF conversion: metadata mapping, dequantization and q/k un-permutation (the rebuilt tokenizer:
test_gguf_tokenizer.py).

Every conversion is checked against transformers' own GGUF load of the same file, and against the original
weights where the file was written losslessly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf_fixtures import (
    CHATML_TEMPLATE,
    add_byte_level_tokenizer,
    random_hf_model,
    write_model_gguf,
    write_tokenizer_gguf,
)
from safetensors import safe_open

from structgen.errors import ModelLoadError, UnsupportedArchitectureError
from structgen.models.gguf import convert_gguf_to_hf, gguf_to_hf_config, llama3_rope_scaling

Q = GGMLQuantizationType


def _safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return tensors


def _transformers_gguf_model(gguf_path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )


# --- metadata -> config.json ---------------------------------------------------------------------------------


def _metadata(arch: str, **extra: Any) -> dict[str, Any]:
    return {
        "general.architecture": arch,
        "general.name": "Some Model 7B",
        f"{arch}.block_count": 3,
        f"{arch}.context_length": 4096,
        f"{arch}.embedding_length": 256,
        f"{arch}.feed_forward_length": 512,
        f"{arch}.attention.head_count": 8,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 1e6,
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(1000)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **extra,
    }


def test_llama_metadata_maps_to_an_hf_config() -> None:
    config = gguf_to_hf_config(
        _metadata("llama", **{"llama.rope.dimension_count": 32}), ["token_embd.weight", "output.weight"]
    )
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (3, 256, 512)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 2, 32)
    assert config["max_position_embeddings"] == 4096
    assert config["rope_theta"] == 1e6 and config["rope_scaling"] is None
    assert config["rms_norm_eps"] == 1e-6
    assert config["vocab_size"] == 1000  # from the token list when the file states no vocab size
    assert config["tie_word_embeddings"] is False  # output.weight present
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["attention_bias"] is False


def test_family_specific_metadata() -> None:
    mistral = gguf_to_hf_config(_metadata("llama", **{"general.name": "Mistral 7B Instruct v0.3"}), [])
    assert mistral["architectures"] == ["MistralForCausalLM"] and mistral["sliding_window"] is None
    assert mistral["tie_word_embeddings"] is True  # no output.weight: tied

    qwen2 = gguf_to_hf_config(_metadata("qwen2", **{"qwen2.vocab_size": 1024}), ["blk.0.attn_q.bias"])
    assert qwen2["architectures"] == ["Qwen2ForCausalLM"] and qwen2["vocab_size"] == 1024
    assert qwen2["head_dim"] == 256 // 8

    qwen3 = gguf_to_hf_config(
        _metadata("qwen3", **{"qwen3.attention.key_length": 128}), ["blk.0.attn_q_norm.weight"]
    )
    assert qwen3["architectures"] == ["Qwen3ForCausalLM"] and qwen3["head_dim"] == 128

    linear = gguf_to_hf_config(
        _metadata("llama", **{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}), []
    )
    assert linear["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def test_bad_metadata_is_named() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="gemma2"):
        gguf_to_hf_config(_metadata("gemma2"), [])
    missing = _metadata("llama")
    del missing["llama.feed_forward_length"]
    with pytest.raises(ModelLoadError, match=r"llama\.feed_forward_length"):
        gguf_to_hf_config(missing, [])
    with pytest.raises(ModelLoadError, match="per-layer KV head"):
        gguf_to_hf_config(_metadata("llama", **{"llama.attention.head_count_kv": [2, 4, 2]}), [])
    with pytest.raises(ModelLoadError, match="rope scaling type 'longrope'"):
        gguf_to_hf_config(
            _metadata("llama", **{"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0}),
            [],
        )


@pytest.mark.parametrize(
    ("theta", "head_dim", "factor", "low", "high", "original"),
    [
        (500000.0, 128, 8.0, 1.0, 4.0, 8192),
        (500000.0, 64, 32.0, 1.0, 4.0, 8192),
        (10000.0, 64, 4.0, 2.0, 8.0, 2048),
    ],
)
def test_llama3_rope_freqs_become_an_equivalent_rope_scaling(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def inv_freq(rope_scaling: dict[str, Any]) -> torch.Tensor:
        config = LlamaConfig(
            hidden_size=head_dim * 4,
            num_attention_heads=4,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=131072,
        )
        return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0].double()

    reference = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
    base = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rope_freqs = (base / inv_freq(reference)).float().numpy()  # what llama.cpp stores
    recovered = llama3_rope_scaling(
        rope_freqs, rope_theta=theta, head_dim=head_dim, original_context=original
    )
    assert recovered is not None and recovered["rope_type"] == "llama3"
    torch.testing.assert_close(inv_freq(recovered), inv_freq(reference), rtol=1e-6, atol=0)
    assert (
        llama3_rope_scaling(np.ones(head_dim // 2), rope_theta=theta, head_dim=head_dim, original_context=8)
        is None
    )
    with pytest.raises(ModelLoadError, match="llama3"):
        noisy = rope_freqs * (1 + 0.05 * np.sin(np.arange(head_dim // 2)))
        llama3_rope_scaling(noisy, rope_theta=theta, head_dim=head_dim, original_context=original)


# --- weights ---------------------------------------------------------------------------------------------------


def test_lossless_llama_gguf_round_trips_to_the_original_weights(tmp_path: Path, vocab: Any) -> None:
    """F32 GGUF written like llama.cpp (q/k rows permuted) converts back to exactly the original tensors."""
    hf_model = random_hf_model(
        "llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False
    )
    gguf_path = write_model_gguf(tmp_path / "llama.gguf", hf_model, vocab)
    out = convert_gguf_to_hf(gguf_path, tmp_path / "hf")

    converted = _safetensors(out)
    original = hf_model.state_dict()
    assert set(converted) == set(original)
    for name, tensor in original.items():
        assert converted[name].dtype == torch.float32
        assert torch.equal(converted[name], tensor), name
    # transformers' own GGUF load undoes the permutation the same way
    reference = _transformers_gguf_model(gguf_path).state_dict()
    for name, tensor in converted.items():
        assert torch.equal(reference[name], tensor), name

    config = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert config[key] == getattr(hf_model.config, key), key
    assert config["tie_word_embeddings"] is False and config["dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] in (2, [2])
    assert (out / "chat_template.jinja").read_text() == CHATML_TEMPLATE


def _mixed_qtype(hf_name: str, array: np.ndarray) -> Any:
    """A different storage type per tensor kind, so every dequantizer and kept dtype gets exercised."""
    for part, kind in (
        ("q_proj", Q.Q8_0),
        ("k_proj", Q.Q4_0),
        ("v_proj", Q.Q4_1),
        ("o_proj", Q.Q5_0),
        ("gate_proj", Q.Q5_1),
        ("up_proj", Q.F16),
        ("down_proj", Q.BF16),
        ("embed_tokens", Q.Q8_0),
    ):
        if part in hf_name:
            return kind
    return Q.F32


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {"tie_word_embeddings": False}),
        # transformers reads no head_dim from a qwen3 GGUF (its config default, 128, applies): match it
        ("qwen3", {"tie_word_embeddings": True, "head_dim": 128}),
    ],
)
def test_quantized_gguf_matches_transformers_gguf_load(
    tmp_path: Path, vocab: Any, model_type: str, overrides: dict[str, Any]
) -> None:
    hf_model = random_hf_model(model_type, **overrides)
    gguf_path = write_model_gguf(tmp_path / f"{model_type}.gguf", hf_model, vocab, qtype=_mixed_qtype)
    out = convert_gguf_to_hf(gguf_path, tmp_path / "hf")
    converted = _safetensors(out)
    reference = _transformers_gguf_model(gguf_path).state_dict()
    if hf_model.config.tie_word_embeddings:
        reference.pop("lm_head.weight")
    assert set(converted) == set(reference)
    for name, tensor in converted.items():
        expected_dtype = (
            torch.float16 if "up_proj" in name else torch.bfloat16 if "down_proj" in name else torch.float32
        )
        assert tensor.dtype == expected_dtype, name  # fp16/bf16 are kept as stored, the rest dequantized
        assert torch.equal(tensor.float(), reference[name]), name
        # quantization error only: the conversion itself adds nothing
        assert (tensor.float() - hf_model.state_dict()[name]).abs().max() < 0.2, name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [type(hf_model).__name__]
    assert config["tie_word_embeddings"] is hf_model.config.tie_word_embeddings
    assert config["dtype"] == "float32"  # mixed storage: the widest


def _k_quant_qtype(hf_name: str, array: np.ndarray) -> Any:
    for part, kind in (
        ("q_proj", Q.Q4_K),
        ("k_proj", Q.Q6_K),
        ("v_proj", Q.Q5_K),
        ("o_proj", Q.Q3_K),
        ("gate_proj", Q.Q2_K),
        ("up_proj", Q.Q4_K),
        ("down_proj", Q.Q6_K),
    ):
        if part in hf_name:
            return kind
    return Q.Q8_0 if "embed" in hf_name else Q.F32


def test_k_quant_gguf_matches_transformers_gguf_load(tmp_path: Path, vocab: Any) -> None:
    # K-quant blocks span 256 columns, hence the wider model.
    hf_model = random_hf_model("llama", hidden_size=256, intermediate_size=256, tie_word_embeddings=True)
    gguf_path = write_model_gguf(tmp_path / "kq.gguf", hf_model, vocab, qtype=_k_quant_qtype)
    converted = _safetensors(convert_gguf_to_hf(gguf_path, tmp_path / "hf"))
    reference = _transformers_gguf_model(gguf_path).state_dict()
    for name, tensor in converted.items():
        assert tensor.dtype == torch.float32 and torch.isfinite(tensor).all(), name
        assert torch.equal(tensor, reference[name]), name
    assert converted["model.layers.0.self_attn.q_proj.weight"].abs().max() > 0


def test_converted_model_loads_and_matches_transformers_logits(tmp_path: Path, vocab: Any) -> None:
    from paged_harness import PagedRunner

    from structgen.models.loader import load_model

    hf_model = random_hf_model("llama", tie_word_embeddings=True)
    gguf_path = write_model_gguf(tmp_path / "llama.gguf", hf_model, vocab)
    single = convert_gguf_to_hf(gguf_path, tmp_path / "single")
    sharded = convert_gguf_to_hf(gguf_path, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (sharded / "model.safetensors").exists()

    tokens = list(range(5, 45))
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    for model_dir in (single, sharded):
        logits = PagedRunner(load_model(model_dir)).step({0: tokens})[0]
        assert (logits - expected).abs().max().item() < 1e-4


def test_gguf_conversion_errors_name_the_problem(tmp_path: Path, vocab: Any) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        convert_gguf_to_hf(tmp_path / "absent.gguf", tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match=r"junk\.gguf"):
        convert_gguf_to_hf(tmp_path / "junk.gguf", tmp_path / "out")

    writer = GGUFWriter(tmp_path / "gemma.gguf", "gemma2")
    add_byte_level_tokenizer(writer, vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match="'gemma2'"):
        convert_gguf_to_hf(tmp_path / "gemma.gguf", tmp_path / "out")

    hf_model = random_hf_model("llama", tie_word_embeddings=True)
    extra = {"blk.0.ffn_gate_exps.weight": np.zeros((4, 8), dtype=np.float32)}
    path = write_model_gguf(tmp_path / "moe.gguf", hf_model, vocab, extra_tensors=extra)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_gate_exps\.weight"):
        convert_gguf_to_hf(path, tmp_path / "out2")

    path = write_tokenizer_gguf(tmp_path / "pre.gguf", vocab, pre="mystery-pre")
    from structgen.models.gguf import gguf_metadata, read_gguf
    from structgen.models.gguf_tokenizer import build_tokenizer

    with pytest.raises(ModelLoadError, match="'mystery-pre'"):
        build_tokenizer(gguf_metadata(read_gguf(path)))
