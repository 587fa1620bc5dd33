"""LoRA test helpers: two random PEFT adapters for `tiny` (made by peft), transformers' greedy references, and
engines on one shared model. `conftest.py` turns the first two into session fixtures."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from peft_adapters import greedy_reference, make_peft_adapter, merged_reference_model

from structgen.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from structgen.engine.llm_engine import LLMEngine
from structgen.lora import LoRARequest

# Ordinary token ids; the last two share their first 32 tokens (two full blocks) for prefix-cache hits. Each
# needs one more block while it decodes, so a small cache preempts.
_SHARED = [3000 + 17 * i for i in range(32)]
PROMPTS = [
    [1000 + 37 * i for i in range(29)],
    [5000 + 11 * i for i in range(13)],
    [*_SHARED, *range(800, 813)],
    [*_SHARED, *range(900, 914)],
]
MAX_TOKENS = 8


@dataclass(slots=True)
class Adapters:
    model_dir: Path
    paths: dict[str, Path]  # name -> adapter directory
    references: dict[str | None, list[list[int]]]  # adapter name (None: base) -> greedy outputs of PROMPTS

    def request(self, name: str) -> LoRARequest:
        return LoRARequest(name, list(self.paths).index(name) + 1, str(self.paths[name]))


def build_adapters(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    from structgen.models.registry import resolve_model

    model_dir = resolve_model("tiny")
    root = tmp_path_factory.mktemp("lora")
    paths = {
        # rank 8 on attention's q and v (PEFT's usual choice for Llama)
        "qv8": make_peft_adapter(
            model_dir, root / "qv8", r=8, target_modules=["q_proj", "v_proj"], lora_alpha=16, seed=1
        ),
        # rank 16 elsewhere, rsLoRA, with per-module rank and alpha overrides
        "mlp16": make_peft_adapter(
            model_dir,
            root / "mlp16",
            r=16,
            target_modules=["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            lora_alpha=8,
            seed=2,
            use_rslora=True,
            rank_pattern={"down_proj": 4},
            alpha_pattern={"o_proj": 32},
        ),
    }
    references: dict[str | None, list[list[int]]] = {}
    for name in [None, *paths]:
        model = merged_reference_model(model_dir, paths[name] if name else None)
        references[name] = [greedy_reference(model, prompt, MAX_TOKENS) for prompt in PROMPTS]
    return Adapters(model_dir=model_dir, paths=paths, references=references)


def load_tiny_model() -> tuple[Any, Any, Path]:
    from structgen.models.loader import load_model
    from structgen.models.registry import resolve_model
    from structgen.tokenizer import Tokenizer

    model_dir = resolve_model("tiny")
    return load_model(model_dir, dtype="float32", device="cpu"), Tokenizer.from_dir(model_dir), model_dir


def make_lora_engine(
    tiny_model: tuple[Any, Any, Path],
    *,
    max_loras: int = 4,
    max_lora_rank: int = 16,
    kv_cache_tokens: int = 4096,
    **scheduler: Any,
) -> LLMEngine:
    model, tokenizer, model_dir = tiny_model
    config = EngineConfig(
        model="tiny",
        device="cpu",
        cache=CacheConfig(kv_cache_tokens=kv_cache_tokens),
        scheduler=SchedulerConfig(**scheduler),
        lora=LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank),
    )
    return LLMEngine(config, model=model, tokenizer=tokenizer, model_dir=model_dir)
