"""Loading the engine's model by name: the checkpoint, its tensor-parallel workers, and the CPU kernels attached."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from structgen.config import EngineConfig
    from structgen.distributed import TensorParallelGroup
    from structgen.tokenizer import Tokenizer


def load_engine_model(
    config: EngineConfig,
    device: torch.device,
    *,
    on_workers: Callable[[TensorParallelGroup], None],
) -> tuple[nn.Module, Tokenizer, Path]:
    """(model, tokenizer, checkpoint dir) of `config.model`. With tensor parallelism the workers start first and
    are handed to `on_workers` at once (the engine stops them if anything after fails), then load their shards
    while this process loads rank 0's. On one rank the CPU's quantized kernels and flat forward are attached."""
    from structgen.models.loader import load_model
    from structgen.models.registry import resolve_model

    model_dir = resolve_model(config.model)
    tp_size = config.tensor_parallel_size
    tp_group = None
    if tp_size > 1:
        from structgen.distributed import TensorParallelGroup

        tp_group = TensorParallelGroup.start(model_dir, config, device)
        on_workers(tp_group)
    model = load_model(
        model_dir,
        dtype=config.dtype,
        device=device,
        tp_size=tp_size,
        pack_cpu_weights_at_start=config.pack_cpu_weights_at_start,
    )
    if tp_size == 1:
        _attach_cpu_kernels(model, config.model, quantization=config.quantization)
    if tp_group is not None:
        tp_group.wait_ready()
    return model, load_tokenizer(model_dir), model_dir


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The tokenizer of `model_dir`, one object for every engine of the process that loads the same unchanged
    files (a draft model, engines built one after another): parsing a 100k-token `tokenizer.json` takes ~0.3 s,
    and a `Tokenizer` is not changed once built (its lazy tables only fill in)."""
    templates = model_dir / "chat_templates"
    files = [p for p in model_dir.iterdir() if p.is_file()]
    files += sorted(templates.iterdir()) if templates.is_dir() else []
    stats = [(str(p.relative_to(model_dir)), p.stat()) for p in files]
    signature = tuple(sorted((name, st.st_mtime_ns, st.st_size) for name, st in stats))
    return _tokenizer_of(str(model_dir.resolve()), signature)


@functools.lru_cache(maxsize=8)
def _tokenizer_of(model_dir: str, signature: tuple[tuple[str, int, int], ...]) -> Tokenizer:
    from structgen.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


def load_draft_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype,
    device: torch.device,
    quantization: str,
    pack_weights: bool = True,
) -> tuple[nn.Module, Tokenizer, Path]:
    """(model, tokenizer, checkpoint dir) of a speculative draft model: one rank, the CPU kernels as the
    engine's own model gets them."""
    from structgen.models.loader import load_model
    from structgen.models.registry import resolve_model

    model_dir = resolve_model(name_or_path)
    model = load_model(
        model_dir, dtype=dtype, device=device, tp_size=1, pack_cpu_weights_at_start=pack_weights
    )
    _attach_cpu_kernels(model, name_or_path, quantization=quantization)
    return model, load_tokenizer(model_dir), model_dir


def _attach_cpu_kernels(model: nn.Module, name_or_path: str | None, *, quantization: str) -> None:
    from structgen.models.cpu_linear import attach_int4
    from structgen.models.llama_flat import enable_flat_forward
    from structgen.models.registry import gguf_source

    attach_int4(model, quantization=quantization, gguf_path=gguf_source(name_or_path))
    enable_flat_forward(model)  # after the kernels: it binds them
