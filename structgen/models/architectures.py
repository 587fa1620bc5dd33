"""Architecture name → model class, and `create_model`, which builds a model directly on its device and dtype."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from structgen.attention import AttentionBackend, get_attention_backend
from structgen.errors import ModelLoadError, UnsupportedArchitectureError
from structgen.models.config import ModelConfig
from structgen.models.llama import LlamaForCausalLM

_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODEL_CLASSES)
_MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return _MODEL_CLASSES[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def create_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_backend: AttentionBackend | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> LlamaForCausalLM:
    """An uninitialized model (parameters allocated with `torch.empty` on `device`); call `load_weights` next."""
    if dtype not in _MODEL_DTYPES:
        raise ModelLoadError(f"model dtype must be one of {', '.join(map(str, _MODEL_DTYPES))}, got {dtype}")
    model_class = get_model_class(config.architecture)
    device = torch.device(device)
    backend = attn_backend if attn_backend is not None else get_attention_backend(device)
    # Layers allocate with torch.empty under the default device/dtype, so nothing is initialized and then copied.
    with torch.device(device), _default_dtype(dtype):
        model = model_class(config, attn_backend=backend, tp_rank=tp_rank, tp_size=tp_size)
    return model.eval()
