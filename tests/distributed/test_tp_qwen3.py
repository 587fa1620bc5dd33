"""A random Qwen3-style checkpoint (q/k RMSNorm, 4 query heads, 2 KV heads) sharded over 2 and 4 gloo ranks: at
TP 4 each KV head is replicated on two ranks. Greedy tokens must match the unsharded model."""

from __future__ import annotations

from pathlib import Path

import pytest
from tp_helpers import greedy_tokens, random_checkpoint

from structgen.config import CacheConfig, EngineConfig
from structgen.engine.llm_engine import LLMEngine

QWEN3 = {"head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": True}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_checkpoint("Qwen3ForCausalLM", QWEN3, tmp_path_factory.mktemp("qwen3"))


def _greedy(model_dir: Path, tp_size: int) -> list[list[int]]:
    config = EngineConfig(
        model=str(model_dir),
        device="cpu",
        dtype="float32",  # sharded partial sums must match the unsharded ones to fp32 accuracy
        tensor_parallel_size=tp_size,
        cache=CacheConfig(kv_cache_tokens=512),
    )
    engine = LLMEngine(config)
    try:
        if tp_size == 4:
            attention = engine.model.model.layers[0].self_attn  # type: ignore[union-attr]
            assert (attention.num_heads, attention.num_kv_heads) == (1, 1)
            assert attention.qkv_proj.num_kv_head_replicas == 2
        return greedy_tokens(engine)
    finally:
        engine.shutdown()


def test_tp2_and_tp4_give_the_greedy_tokens_of_tp1(qwen3_dir: Path) -> None:
    expected = _greedy(qwen3_dir, 1)
    assert len({token for tokens in expected for token in tokens}) > 3  # not a degenerate constant output
    assert _greedy(qwen3_dir, 2) == expected
    assert _greedy(qwen3_dir, 4) == expected
