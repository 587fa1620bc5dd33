"""A CPU KV cache larger than the memory available is refused at start with its size, through `LLM`, `structgen
generate` and `structgen serve` alike (one line, exit 1), instead of an OOM kill (at start, or later as its blocks fill)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from structgen.attention import allocate_kv_cache, cpu_cache_memory
from structgen.cli import main

MEMINFO = """MemTotal:       24000000 kB
MemFree:         1000000 kB
MemAvailable:    2000000 kB
SwapTotal:       1000000 kB
SwapFree:         500000 kB
"""


def test_available_memory_is_mem_available_plus_free_swap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    monkeypatch.setattr(cpu_cache_memory, "_MEMINFO", meminfo)
    assert cpu_cache_memory.available_bytes() == (2000000 + 500000) * 1024
    meminfo.write_text("MemTotal: 24000000 kB\n")  # an old kernel without MemAvailable: nothing is checked
    assert cpu_cache_memory.available_bytes() is None
    monkeypatch.setattr(cpu_cache_memory, "_MEMINFO", tmp_path / "missing")
    assert cpu_cache_memory.available_bytes() is None
    cpu_cache_memory.check_fits(1 << 50)  # unknown: allowed


@pytest.fixture
def little_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_cache_memory, "available_bytes", lambda: 8 << 20)  # 8 MiB


def test_a_cache_larger_than_the_memory_available_is_refused(little_memory: None) -> None:
    shape = {"block_size": 16, "num_kv_heads": 4, "head_dim": 64, "dtype": torch.float32, "device": "cpu"}
    caches = allocate_kv_cache(num_layers=2, num_blocks=64, **shape)  # 2 x 2 x 1 MiB: fits
    assert len(caches) == 2
    with pytest.raises(
        cpu_cache_memory.KVCacheTooLargeError,
        match=r"needs 0\.03 GiB .* 0\.01 GiB available; lower kv_cache_tokens",
    ):
        allocate_kv_cache(num_layers=2, num_blocks=512, **shape)  # 2 x 2 x 8 MiB


def test_the_llm_and_the_commands_say_so_in_one_line_and_exit_1(
    little_memory: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from structgen import LLM

    with pytest.raises(ValueError, match="the KV cache needs"):
        LLM("tiny", device="cpu", kv_cache_tokens=65536)
    for argv in (
        ["generate", "--model", "tiny", "--prompt", "hi"],
        ["serve", "--model", "tiny", "--port", "0", "--kv-cache-tokens", "65536"],
    ):
        assert main(argv) == 1  # as the commands' other refusals at start (structgen.errors.StructgenError)
        err = capsys.readouterr().err
        assert f"structgen {argv[0]}: the KV cache needs" in err and "Traceback" not in err, err
