"""A disk cache of the CPU kernels' 4-bit weights built from a GGUF's blocks, so that a process loads them
instead of building them again.

Building them is most of an `LLM()`'s start on the CPU: the GGUF's Q4_1 blocks unpacked to one byte a weight,
then repacked into the kernels' tiles (SmolLM2: ~1.2 s of 2.9 on a 2-core Zen 5, ~1.7 s of 5.6 on a Zen 3; the
model's own load is ~0.6 s). What they become depends only on the file, the model's layers and which kernels
this CPU runs, so the result is written once per such combination under `$STRUCTGEN_CACHE_DIR/packed/` (a
safetensors file, ~the GGUF's size) and read back by later processes (BENCHMARKS.md, "Start-up").

The key holds the GGUF's content digest, the layers' names and shapes, the model's dtype, the kernels this CPU
can run, torch's version and the source of the code that builds the weights, so an edit there (a new tile
layout) builds again rather than reading stale tiles. A file that cannot be read is built again and rewritten;
a cache directory that cannot be written leaves the weights built each time. `STRUCTGEN_PACKED_CACHE=0`
switches the cache off. The few most recently used files per GGUF are kept, and what a writer killed mid-write
left is removed an hour later.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from structgen.kernels.cpu_woq import WoqWeight
    from structgen.models.int4 import Int4Values

logger = logging.getLogger(__name__)

ENV_SWITCH = "STRUCTGEN_PACKED_CACHE"
# Files kept per GGUF (one per dtype and CPU kind that loaded it; the test suite loads SmolLM2 in two dtypes).
KEEP_PER_GGUF = 4
# A temporary file older than this was left by a writer that died (a write takes about a second).
ABANDONED_S = 3600.0
# Bumped by hand when the file's layout changes (the builders' source is in the key already).
FORMAT = "1"
# The modules whose code decides what the built weights are.
_BUILDERS = ("structgen.models.int4", "structgen.models.woq", "structgen.kernels.cpu_woq")

FourBitWeights = tuple[dict[str, "Int4Values"], dict[str, "WoqWeight"]]


def four_bit_weights(
    gguf_path: Path,
    model: nn.Module,
    *,
    build: Callable[[], FourBitWeights],
    values_needed: Callable[[dict[str, Int4Values], dict[str, WoqWeight]], set[str]],
) -> FourBitWeights:
    """(int4 values by HF name, the kernels' packed weights by module name), as `build()` returns them, read from
    the cache where this GGUF, model and CPU were built before. `values_needed(values, packed)` names the int4
    values the caller will use (torch's int4 kernel, where the GEMV does not run); only those are stored, and a
    cache hit returns only those."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return build()
    from structgen.models.linear import kernel_layers

    shapes = {name: tuple(module.weight.shape) for name, module in kernel_layers(model)}
    path = _entry_path(gguf_path, model, shapes)
    cached = _read(path, shapes)
    if cached is not None:
        return cached
    values, packed = build()
    kept = {name: values[name] for name in values_needed(values, packed) if name in values}
    if packed or kept:  # a GGUF with no 4-bit blocks, or a CPU with no kernel for them: nothing worth a file
        _write(path, kept, packed)
    return values, packed


def cache_files() -> list[Path]:
    """The files in the cache (for a benchmark that reads them into the page cache first)."""
    from structgen.models.registry import cache_dir

    root = cache_dir() / "packed"
    return sorted(root.glob("*.safetensors")) if root.is_dir() else []


def _entry_path(gguf_path: Path, model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> Path:
    from structgen.kernels import cpu_woq
    from structgen.models.registry import cache_dir, file_digest

    kernels = (cpu_woq.amx_available(), cpu_woq.gemv_available(), cpu_woq.avx2_gemv_available())
    dtype = next(model.parameters()).dtype
    parts = [FORMAT, file_digest(gguf_path), repr(sorted(shapes.items())), str(dtype), repr(kernels)]
    parts += [torch.__version__, _builders_digest()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / "packed" / f"{gguf_path.stem}-{key}.safetensors"


def _builders_digest() -> str:
    import importlib

    digest = hashlib.sha256()
    for name in _BUILDERS:
        digest.update(Path(importlib.import_module(name).__file__ or name).read_bytes())
    return digest.hexdigest()


def _read(path: Path, shapes: dict[str, tuple[int, ...]]) -> FourBitWeights | None:
    if not path.is_file():
        return None
    from safetensors import safe_open

    from structgen.kernels.cpu_woq import WoqWeight
    from structgen.models.int4 import Int4Values

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            layout = json.loads(handle.metadata()["layout"])
            packed = {
                name: WoqWeight(*(handle.get_tensor(f"packed.{name}.{part}") for part in _PACKED_PARTS), bits)
                for name, bits in layout["packed"].items()
            }
            values = {
                name: Int4Values(
                    *(handle.get_tensor(f"values.{name}.{part}") for part in _VALUE_PARTS), group
                )
                for name, group in layout["values"].items()
            }
        for name, weight in packed.items():  # the key holds the shapes: only a damaged file fails here
            if shapes.get(name) != (weight.out_features, weight.in_features):
                raise ValueError(
                    f"{name}: [{weight.out_features}, {weight.in_features}] against {shapes.get(name)}"
                )
    except Exception as exc:  # a truncated or foreign file: build again, and overwrite it
        logger.warning("packed-weight cache %s unreadable (%s): building the weights again", path, exc)
        return None
    with contextlib.suppress(OSError):  # a read-only cache: nothing is pruned there either
        os.utime(path)  # most recently used: kept by the pruning
    logger.debug("packed weights read from %s", path)
    return values, packed


_PACKED_PARTS = ("qweight", "scales", "mins")
_VALUE_PARTS = ("q", "scales", "zeros")


def _write(path: Path, values: Mapping[str, Int4Values], packed: Mapping[str, WoqWeight]) -> None:
    from safetensors.torch import save_file

    tensors = {
        f"packed.{name}.{part}": getattr(weight, part).contiguous()
        for name, weight in packed.items()
        for part in _PACKED_PARTS
    }
    tensors |= {
        f"values.{name}.{part}": getattr(value, part).contiguous()
        for name, value in values.items()
        for part in _VALUE_PARTS
    }
    layout = {
        "packed": {name: weight.bits for name, weight in packed.items()},
        "values": {name: value.group_size for name, value in values.items()},
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A file of its own, renamed into place: a process reading, or another writing, never sees half of one.
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".writing-", suffix=".safetensors")
        os.close(handle)
        try:
            save_file(tensors, temporary, metadata={"layout": json.dumps(layout)})
            os.chmod(temporary, 0o644)  # as other cache files (mkstemp's are the owner's alone)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except (OSError, ValueError, RuntimeError) as exc:  # no room, no rights; safetensors' own refusals
        logger.info("packed weights not cached (%s): built again by each process", exc)
        return
    logger.info("packed weights cached in %s", path)
    _prune(path)


def _prune(written: Path) -> None:
    """Keep the `KEEP_PER_GGUF` most recently used files of this GGUF (keys of older code, other dtypes), and
    remove what a writer killed mid-write left (a temporary file untouched for `ABANDONED_S`)."""
    now = time.time()
    for temporary in written.parent.glob(".writing-*.safetensors"):
        with contextlib.suppress(OSError):  # another process's, renamed or removed meanwhile
            if now - temporary.stat().st_mtime > ABANDONED_S:
                temporary.unlink()
    stem = written.name.rsplit("-", 1)[0]
    entries = []
    for entry in written.parent.glob(f"{stem}-*.safetensors"):
        if entry.name.rsplit("-", 1)[0] != stem:  # another GGUF's, whose name starts with this one's
            continue
        try:
            entries.append((entry.stat().st_mtime_ns, entry))
        except OSError:  # removed meanwhile by another process's pruning
            continue
    for _, entry in sorted(entries, reverse=True)[KEEP_PER_GGUF:]:
        entry.unlink(missing_ok=True)
