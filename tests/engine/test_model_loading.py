"""The engine's tokenizer is loaded once per unchanged model directory and shared by the process's engines."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from structgen.config import CacheConfig, EngineConfig
from structgen.engine.llm_engine import LLMEngine
from structgen.engine.model_loading import load_tokenizer
from structgen.models.registry import resolve_model


def _copy_without_weights(source: Path, target: Path) -> Path:
    target.mkdir()
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy2(path, target / path.name)
    return target


def test_unchanged_files_give_the_same_tokenizer_and_a_change_a_new_one(tmp_path: Path) -> None:
    model_dir = _copy_without_weights(resolve_model("tiny"), tmp_path / "tiny")
    first = load_tokenizer(model_dir)
    assert load_tokenizer(model_dir) is first
    assert (
        load_tokenizer(_copy_without_weights(model_dir, tmp_path / "other")) is not first
    )  # another directory

    config = model_dir / "tokenizer_config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    changed = load_tokenizer(model_dir)
    assert changed is not first and load_tokenizer(model_dir) is changed
    assert changed.encode("hello world") == first.encode("hello world")


def test_engines_of_one_model_share_its_tokenizer() -> None:
    config = EngineConfig(model="tiny", device="cpu", cache=CacheConfig(kv_cache_tokens=256))
    one, two = LLMEngine(config), LLMEngine(config)
    try:
        assert one.tokenizer is two.tokenizer
    finally:
        one.shutdown()
        two.shutdown()
