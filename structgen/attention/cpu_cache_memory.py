"""Whether a CPU KV cache fits the machine's memory, checked before it is allocated.

A cache that does not fit fails badly either way it is allocated: committed at start (`structgen serve`), the
kernel's OOM killer ends the process while the cache is zeroed, without a word; committed as its blocks fill
(`LLM`, the one-shot commands), it maps fine and the process is killed later, once enough blocks are written.
Checked here against what Linux reports available (MemAvailable, which counts the page cache it can drop, plus
free swap: nothing that ran before is refused), such a cache is refused at start with the sizes and the setting
to lower. Elsewhere, or where /proc/meminfo cannot be read, nothing is checked. A container's memory limit is
not in /proc/meminfo, so a cache within the machine's memory but over the container's is not caught.
"""

from __future__ import annotations

from pathlib import Path

from structgen.errors import StructgenError

_MEMINFO = Path("/proc/meminfo")


def available_bytes() -> int | None:
    """MemAvailable plus SwapFree, in bytes; None where /proc/meminfo is missing or lacks them."""
    try:
        text = _MEMINFO.read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[name] = int(parts[0]) * 1024  # reported in kB
    if "MemAvailable" not in fields:
        return None
    return fields["MemAvailable"] + fields.get("SwapFree", 0)


class KVCacheTooLargeError(StructgenError, ValueError):
    """A CPU KV cache larger than the memory available (the commands print it on one line and exit 1)."""


def check_fits(nbytes: int) -> None:
    """Raise KVCacheTooLargeError when a CPU KV cache of `nbytes` exceeds the memory available (see the module)."""
    available = available_bytes()
    if available is not None and nbytes > available:
        raise KVCacheTooLargeError(
            f"the KV cache needs {nbytes / 2**30:.2f} GiB of memory and this machine has "
            f"{available / 2**30:.2f} GiB available; lower kv_cache_tokens (--kv-cache-tokens) or cpu_kv_cache_gib (--cpu-kv-cache-gib)"
        )
