"""Zero-filled CPU tensors on 2 MB pages, for the paged KV cache.

Decode attention reads each sequence's context from 16-token blocks scattered over the cache (a few KB each), so
nearly every block is a new 4 KB page and a TLB miss, which under a hypervisor's nested paging costs a walk of
both page tables. Linux backs memory with 2 MB pages (transparent huge pages) when the mapping is marked
MADV_HUGEPAGE before it is first touched, but `torch.zeros` writes its memory before anyone can mark it, and
THP's default mode on many distributions is `madvise`. Measured on a 2-core Zen 5 guest (SmolLM2's heads, 32
sequences of 250-500 tokens): the decode attention ~5-10% faster a layer. Elsewhere (other systems, THP off, no
2 MB page free) the tensor is the same, on whatever pages the kernel gives.
"""

from __future__ import annotations

import logging
import math
import mmap
import sys

import torch

logger = logging.getLogger("structgen.attention")

HUGE_PAGE = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, *, commit: bool = True) -> torch.Tensor:
    """A contiguous zero-filled CPU tensor, on 2 MB pages where the OS gives them (else as `torch.zeros`).

    `commit`: the memory is written once here, so it is committed at allocation (as with `torch.zeros`): a cache
    that does not fit fails at start, not in the middle of serving. Committing costs a fault and a 2 MB zeroing
    a page, ~0.6-2.9 s a GiB on a fresh VM's memory (BENCHMARKS.md, start-up), which a one-shot run that fills a
    few blocks never repays. `commit=False` leaves the mapping untouched: it reads as zeros, and each page is
    committed (on 2 MB pages all the same) when the cache first writes to it."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    try:
        # One huge page more than asked, so that the tensor can start on a 2 MB boundary.
        buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as exc:
        logger.info("KV cache on the default pages (%s)", exc)
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)  # holds the mapping for as long as a view of it lives
    start = -raw.data_ptr() % HUGE_PAGE
    tensor = raw[start : start + nbytes].view(dtype).view(shape)
    if commit:
        tensor.zero_()  # commits the pages now (fresh anonymous memory reads as zero already)
    return tensor
