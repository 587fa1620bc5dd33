"""Keeping freed host memory for the next step (glibc's malloc), so CPU steps do not fault their buffers in anew.

A CPU step allocates and frees the same large tensors every time: the logits (32 rows x 100,288 tokens x 4
bytes = 12.8 MB on cl100k), the sampler's probabilities and CDFs beside them. glibc gives freed memory at the
top of a heap back to the kernel once it exceeds the trim threshold, and maps allocations above the mmap
threshold afresh; both thresholds adapt to the sizes freed so far. Depending on what an earlier step left
where, the same buffers then either come from the heap or are unmapped and faulted in again page by page
(zeroed by the kernel) at every step. Measured on `tiny` through the server, the same workload alternated
between windows of 44 ms steps with 3.5M page faults and windows of 24 ms with 0.2M; the logits product and the
pick took twice as long in the slow ones. Fixing the mmap threshold at glibc's maximum (32 MiB: larger
buffers are rare and mapped as before) and the trim threshold far above a step's buffers makes every step take
the fast path; the memory a step needed stays resident between steps, as it would with jemalloc or tcmalloc
(what vLLM's CPU backend preloads for the same reason).

Other C libraries (musl, macOS) are left alone; `STRUCTGEN_MALLOC_TUNING=0` leaves glibc alone too.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

logger = logging.getLogger(__name__)

# mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's upper limit for it on 64-bit systems
TRIM_THRESHOLD = 1 << 30
_ENV = "STRUCTGEN_MALLOC_TUNING"


@functools.cache  # process-wide: applied at most once, later calls return the first answer
def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module); True if they are set. Safe to call
    again (a no-op then) and where glibc is absent (False)."""
    return _apply()


def _apply() -> bool:
    if os.environ.get(_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        logger.info("%s=0: glibc's malloc thresholds left as they are", _ENV)
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False  # not glibc: nothing to tune
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        logger.info("mallopt refused the thresholds: CPU steps may fault their buffers in at every step")
        return False
    return True
