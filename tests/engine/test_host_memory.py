"""`structgen.engine.host_memory`: glibc keeps a freed step buffer for the next step instead of faulting it in
again. Checked in fresh interpreters (the setting is process-wide): a 20 MB buffer allocated, written and freed
twice costs page faults the second time only without the tuning."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's malloc only")

_PROBE = """
import ctypes, resource
from structgen.engine.host_memory import keep_freed_memory
print(keep_freed_memory(), keep_freed_memory())
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = 20 << 20
for _ in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _probe(**env: str) -> tuple[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    applied, faults = done.stdout.strip().splitlines()
    return applied, int(faults)


def test_a_freed_step_buffer_is_reused_without_page_faults() -> None:
    applied, faults = _probe()
    assert applied == "True True"  # set, and a second call is a no-op that says so
    assert faults < 500  # the second 20 MB buffer comes back resident (5,120 pages untuned)


def test_the_tuning_can_be_switched_off() -> None:
    applied, faults = _probe(STRUCTGEN_MALLOC_TUNING="0")
    assert applied == "False False"
    assert faults > 2500  # glibc's own thresholds: the buffer is faulted in again
