"""The disk cache of the 4-bit kernels' weights (`structgen.models.packed_cache`): a second load reads what the
first built (the same weights, the same outputs), and a changed GGUF, a damaged file, a read-only directory or
the switch turned off build them again; old files are pruned."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_fixtures import random_hf_model, write_model_gguf
from paged_harness import load_structgen
from structgen.kernels import cpu_woq

from structgen.models import int4, packed_cache
from structgen.models.cpu_linear import QuantizedSmallBatches, attach_int4
from structgen.models.gguf import convert_gguf_to_hf

# bf16 where a bf16 4-bit kernel runs (AVX512-VNNI or AMX), else fp32 for the AVX2 GEMV: what "auto" loads.
BF16_KERNELS = cpu_woq.gemv_available() or cpu_woq.amx_available()
DTYPE = torch.bfloat16 if BF16_KERNELS else torch.float32
pytestmark = pytest.mark.skipif(
    not (BF16_KERNELS or cpu_woq.avx2_gemv_available()),
    reason="no 4-bit kernel runs on this CPU (AVX512-VNNI, AMX, or AVX2 with FMA): nothing is built to cache",
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("STRUCTGEN_CACHE_DIR", str(root))
    monkeypatch.delenv(packed_cache.ENV_SWITCH, raising=False)
    return root / "packed"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory, vocab: Any) -> tuple[Path, Path]:
    """(a small Q4_1 GGUF, its converted checkpoint)."""
    root = tmp_path_factory.mktemp("packed")
    path = write_model_gguf(
        root / "llama.gguf", random_hf_model("llama", tie_word_embeddings=True), vocab, qtype=q4_1_layers
    )
    return path, convert_gguf_to_hf(path, root / "hf")


def q4_1_layers(hf_name: str, array: Any) -> Any:
    """The GGUF's types as SmolLM2's: Q4_1 layers, a Q8_0 embedding (the tied head)."""
    return Q.Q8_0 if "embed_tokens" in hf_name else Q.Q4_1


def attached(gguf: tuple[Path, Path]) -> dict[str, QuantizedSmallBatches]:
    """A model of the checkpoint in `DTYPE` with the GGUF's 4-bit kernels attached: its dispatching layers by
    name."""
    path, checkpoint = gguf
    model = load_structgen(checkpoint, dtype=DTYPE)
    assert attach_int4(model, quantization="auto", gguf_path=path) > 0
    return {
        name: m.kernel
        for name, m in model.named_modules()
        if isinstance(getattr(m, "kernel", None), QuantizedSmallBatches)
    }


def outputs(layers: dict[str, QuantizedSmallBatches], rows: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    return {
        name: layer(torch.randn(rows, layer.weight.shape[1], generator=gen).to(DTYPE))
        for name, layer in layers.items()
    }


def packed_of(layer: QuantizedSmallBatches) -> cpu_woq.WoqWeight:
    return layer.gemv.weight if layer.gemv is not None else layer.woq  # type: ignore[return-value]


def forbid_building(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("built again instead of read from the cache")

    monkeypatch.setattr(int4, "load_gguf_int4_weights", refuse)


def test_a_second_load_reads_the_weights_the_first_built(
    cache: Path, gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = attached(gguf)
    (entry,) = cache.glob("llama-*.safetensors")
    assert oct(entry.stat().st_mode & 0o777) == "0o644"
    forbid_building(monkeypatch)
    second = attached(gguf)
    assert sorted(second) == sorted(first)
    for name, layer in first.items():
        for part in ("qweight", "scales", "mins"):
            torch.testing.assert_close(
                getattr(packed_of(second[name]), part), getattr(packed_of(layer), part), rtol=0, atol=0
            )
    for rows in (1, 3):
        for name, y in outputs(first, rows).items():
            torch.testing.assert_close(outputs(second, rows)[name], y, rtol=0, atol=0, msg=name)
    assert list(cache.iterdir()) == [entry]  # read, not written again


@pytest.mark.skipif(not BF16_KERNELS, reason="torch's int4 kernel is attached to bf16 models only")
def test_int4_values_are_kept_where_torchs_int4_kernel_takes_the_layers(
    cache: Path, gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the VNNI GEMV, torch's int4 kernel takes single streams: it needs the values, so the file holds them
    monkeypatch.setattr(cpu_woq, "gemv_available", lambda: False)
    first = attached(gguf)
    assert all(layer.int4 is not None for layer in first.values())
    forbid_building(monkeypatch)
    second = attached(gguf)
    assert all(layer.int4 is not None for layer in second.values())
    for name, y in outputs(first, 1).items():
        torch.testing.assert_close(outputs(second, 1)[name], y, rtol=0, atol=0, msg=name)


def test_a_changed_gguf_builds_again(
    cache: Path, gguf: tuple[Path, Path], tmp_path: Path, vocab: Any
) -> None:
    attached(gguf)
    other = write_model_gguf(
        tmp_path / "llama.gguf",
        random_hf_model("llama", seed=1, tie_word_embeddings=True),
        vocab,
        qtype=q4_1_layers,
    )
    attached((other, gguf[1]))  # the same layers' shapes, other blocks
    assert len(list(cache.glob("llama-*.safetensors"))) == 2


def test_a_damaged_file_is_built_again_and_rewritten(
    cache: Path, gguf: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    first = attached(gguf)
    (entry,) = cache.glob("llama-*.safetensors")
    size = entry.stat().st_size
    with entry.open("r+b") as handle:
        handle.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger="structgen.models.packed_cache"):
        second = attached(gguf)
    assert "unreadable" in caplog.text
    assert entry.stat().st_size == size
    for name, y in outputs(first, 2).items():
        torch.testing.assert_close(outputs(second, 2)[name], y, rtol=0, atol=0, msg=name)


def test_an_unwritable_cache_or_the_switch_off_builds_each_time(
    cache: Path, gguf: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(packed_cache.ENV_SWITCH, "0")
    attached(gguf)
    assert not cache.exists()
    monkeypatch.delenv(packed_cache.ENV_SWITCH)
    cache.parent.mkdir(parents=True)
    cache.write_bytes(b"")  # a file where the directory would be: no one, root included, can create it
    with caplog.at_level(logging.INFO, logger="structgen.models.packed_cache"):
        first = attached(gguf)
    assert "not cached" in caplog.text
    for name, y in outputs(first, 1).items():
        torch.testing.assert_close(outputs(attached(gguf), 1)[name], y, rtol=0, atol=0, msg=name)


def test_only_the_most_recently_used_files_of_a_gguf_and_no_abandoned_writes_are_kept(
    cache: Path, gguf: tuple[Path, Path]
) -> None:
    cache.mkdir(parents=True)
    stale = [cache / f"llama-{i:016x}.safetensors" for i in range(packed_cache.KEEP_PER_GGUF)]
    for age, path in enumerate(stale):
        path.write_bytes(b"old")
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
    unrelated = cache / "llama-v2-0000000000000000.safetensors"  # another GGUF whose name starts the same
    unrelated.write_bytes(b"other")
    os.utime(unrelated, (1, 1))
    abandoned, writing = cache / ".writing-dead.safetensors", cache / ".writing-live.safetensors"
    abandoned.write_bytes(b"half")  # a writer killed mid-write, long ago
    os.utime(abandoned, (1, 1))
    writing.write_bytes(b"half")  # another process writing now
    attached(gguf)
    left = {p.name for p in cache.iterdir()}
    assert stale[0].name not in left and unrelated.name in left
    assert abandoned.name not in left and writing.name in left
    assert len([n for n in left if n.rsplit("-", 1)[0] == "llama"]) == packed_cache.KEEP_PER_GGUF
