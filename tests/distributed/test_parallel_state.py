"""The sharding rules: which head counts split over which tensor-parallel sizes, and the errors that name them."""

from __future__ import annotations

import pytest

from structgen.config import EngineConfig
from structgen.distributed import TensorParallelError, check_tensor_parallel
from structgen.engine.llm_engine import LLMEngine
from structgen.models.config import ModelConfig


def _config(heads: int, kv_heads: int, intermediate: int = 128) -> ModelConfig:
    return ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": heads * 8,
            "intermediate_size": intermediate,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
        }
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp_size"), [(8, 4, 2), (4, 2, 4), (8, 1, 8), (8, 8, 8), (9, 3, 1)]
)
def test_sizes_that_split(heads: int, kv_heads: int, tp_size: int) -> None:
    check_tensor_parallel(_config(heads, kv_heads), tp_size)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp_size", "message"),
    [
        (9, 3, 2, "does not divide the model's 9 attention heads (3 KV heads)"),
        (12, 6, 4, "and the model's 6 KV heads (12 attention heads) do not divide one another"),
        (8, 4, 3, "does not divide the model's 8 attention heads"),
    ],
)
def test_sizes_that_do_not_split_name_the_numbers_and_the_rule(
    heads: int, kv_heads: int, tp_size: int, message: str
) -> None:
    with pytest.raises(TensorParallelError, match="attention heads must be divisible") as info:
        check_tensor_parallel(_config(heads, kv_heads), tp_size)
    assert message in str(info.value)
    assert f"tensor_parallel_size {tp_size}" in str(info.value)


def test_intermediate_size_must_split_too() -> None:
    with pytest.raises(TensorParallelError, match="intermediate_size 130"):
        check_tensor_parallel(_config(8, 4, intermediate=130), 4)


def test_smollm2_with_tp2_fails_at_start_before_any_worker() -> None:
    # SmolLM2-135M: 9 attention heads, 3 KV heads. The check reads config.json only: nothing is spawned.
    with pytest.raises(TensorParallelError, match=r"2 does not divide the model's 9 attention heads \(3 KV"):
        LLMEngine(EngineConfig(model="smollm2-135m", device="cpu", tensor_parallel_size=2))


def test_config_refuses_a_size_below_one_and_a_preloaded_model_with_tp() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="pass no model"):
        LLMEngine(EngineConfig(tensor_parallel_size=2), model=object(), tokenizer=object())  # type: ignore[arg-type]
