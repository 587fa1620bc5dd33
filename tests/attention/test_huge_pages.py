"""The KV cache's CPU tensors on 2 MB pages: zeroed, contiguous, aligned, writable, alive as long as a view is,
and plain `torch.zeros` wherever the mapping cannot be made."""

from __future__ import annotations

import gc
import mmap
import sys

import pytest
import torch

from structgen.attention import allocate_kv_cache, huge_pages
from structgen.attention.huge_pages import HUGE_PAGE, zeros_on_huge_pages

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_HUGEPAGE is Linux's")


@linux_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_tensor_is_zeroed_contiguous_and_starts_on_a_huge_page(dtype: torch.dtype) -> None:
    shape = (300, 16, 3, 64)  # 3.7 / 1.8 MB (bf16 falls under one huge page: the plain path)
    tensor = zeros_on_huge_pages(shape, dtype)
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert not tensor.any()
    if tensor.numel() * tensor.element_size() >= HUGE_PAGE:
        assert tensor.data_ptr() % HUGE_PAGE == 0


@linux_only
def test_the_mapping_lives_as_long_as_a_view_of_it() -> None:
    tensor = zeros_on_huge_pages((64, 16, 8, 64), torch.float32)
    view = tensor[10:20]
    del tensor
    gc.collect()
    view.fill_(2.5)  # would fault if the mapping had been closed under it
    garbage = [torch.randn(1 << 20) for _ in range(4)]  # reuse freed memory, if any was freed
    assert float(view.sum()) == 2.5 * view.numel() and len(garbage) == 4


def test_small_tensors_and_failed_mappings_fall_back_to_torch_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    small = zeros_on_huge_pages((4, 16, 2, 8), torch.float32)
    assert small.shape == (4, 16, 2, 8) and not small.any()

    def refuse(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    tensor = zeros_on_huge_pages((256, 16, 4, 64), torch.bfloat16)
    assert tensor.shape == (256, 16, 4, 64) and tensor.is_contiguous() and not tensor.any()


def test_the_cpu_kv_cache_is_allocated_on_huge_pages_and_pairs_do_not_share_memory() -> None:
    caches = allocate_kv_cache(
        num_layers=2,
        num_blocks=128,
        block_size=16,
        num_kv_heads=4,
        head_dim=64,
        dtype=torch.float32,
        device="cpu",
    )
    assert len(caches) == 2
    tensors = [t for pair in caches for t in pair]
    assert all(t.shape == (128, 16, 4, 64) and not t.any() for t in tensors)
    tensors[0].fill_(1.0)
    assert all(not t.any() for t in tensors[1:])
    if sys.platform.startswith("linux"):
        assert all(t.data_ptr() % HUGE_PAGE == 0 for t in tensors)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


@linux_only
def test_an_uncommitted_tensor_takes_memory_only_where_it_is_written() -> None:
    shape = (1024, 16, 4, 64)  # 16 MB a tensor, 8 tensors: 128 MB
    before = _resident_bytes()
    lazy = [zeros_on_huge_pages(shape, torch.float32, commit=False) for _ in range(8)]
    grown = _resident_bytes() - before
    assert grown < 32 << 20, f"{grown / 2**20:.0f} MB resident for 128 MB not written"
    for tensor in lazy:
        assert tensor.data_ptr() % HUGE_PAGE == 0 and tensor.is_contiguous() and not tensor.any()
        tensor[100].fill_(1.5)  # one block written: its page comes now
        assert float(tensor.sum()) == 1.5 * tensor[100].numel()
    before = _resident_bytes()
    committed = [zeros_on_huge_pages(shape, torch.float32) for _ in range(8)]
    assert _resident_bytes() - before >= 120 << 20  # the default commits every page at once
    assert not any(t.any() for t in committed)


def test_an_engine_that_commits_its_cache_as_it_fills_generates_the_same_tokens() -> None:
    from structgen.config import CacheConfig, EngineConfig
    from structgen.engine.llm_engine import LLMEngine
    from structgen.sampling_params import SamplingParams

    tokens = {}
    for commit in (True, False):
        config = EngineConfig(
            model="tiny", device="cpu", cache=CacheConfig(kv_cache_tokens=8192, commit_cpu_kv_at_start=commit)
        )
        engine = LLMEngine(config)
        try:
            key = engine.runner.kv_caches[0][0]
            assert (
                key.numel() * key.element_size() >= HUGE_PAGE
            )  # on the mapped path (small ones are torch.zeros)
            params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            for i in range(3):
                engine.add_request(f"r{i}", f"request {i}: count to ten", params)
            outputs = {}
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out.outputs[0].token_ids
            tokens[commit] = outputs
        finally:
            engine.shutdown()
    assert tokens[True] == tokens[False] and len(tokens[False]) == 3
