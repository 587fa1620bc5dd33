"""Load a Hugging Face checkpoint directory (config.json + safetensors) into one of our model families.

Weights stream shard by shard through `safe_open`, so peak host memory is the model plus one tensor, never a
whole shard dict. `ShardWriter` is the other direction: the GGUF converter writes HF shards with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from structgen.errors import ModelLoadError

if TYPE_CHECKING:
    from torch import nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_SUPPORTED_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})


def resolve_dtype(
    dtype: torch.dtype | str, *, checkpoint_dtype: torch.dtype | None, device: torch.device | str
) -> torch.dtype:
    """The compute dtype for a `dtype` request: a torch dtype, a name (`"bf16"`, `"float32"`...) or `"auto"`.

    `"auto"` means the checkpoint's own dtype (fp32 when it does not say), except on CPU: bf16 where the CPU
    computes bf16 in hardware (AVX512-BF16 / AMX: bf16 matmuls run ~3x faster than fp32 and the weights and KV
    cache read half the bytes), fp32 elsewhere (CPU fp16 matmuls are slow or unsupported, emulated bf16 too).
    """
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif not isinstance(dtype, str):
        raise ModelLoadError(f"dtype must be a torch.dtype or a name, got {dtype!r}")
    elif dtype.lower() == "auto":
        resolved = checkpoint_dtype or torch.float32
        if torch.device(device).type == "cpu":
            from structgen.models.cpu_linear import cpu_has_native_bf16

            resolved = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    else:
        name = dtype.lower().removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise ModelLoadError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPE_NAMES)}")
        resolved = _DTYPE_NAMES[name]
    if resolved not in _SUPPORTED_DTYPES:
        raise ModelLoadError(f"dtype {resolved} is not supported; use float32, bfloat16 or float16")
    return resolved


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards named by the index, or the single file.

    Raises naming a shard the index lists but the directory lacks, or when the directory holds no weights.
    """
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            shard_names = sorted(set(weight_map.values()))
            files = [model_dir / name for name in shard_names]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"cannot read the shard index {index_path}: {exc!r}") from exc
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise ModelLoadError(
                f"checkpoint shard(s) missing from {model_dir}: {', '.join(missing)} (listed in {INDEX_FILE})"
            )
        if not files:
            raise ModelLoadError(f"{index_path} lists no tensors")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    others = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
    hint = (
        f" (found {', '.join(others)}: only safetensors are loaded; pass a .gguf file path itself)"
        if others
        else ""
    )
    raise ModelLoadError(f"no *.safetensors weights in {model_dir}{hint}")


def iter_checkpoint_tensors(
    files: list[Path], *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, read lazily; floating tensors cast to `dtype`."""
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read safetensors file {path}: {exc}") from exc
        with handle:
            for name in handle.keys():  # noqa: SIM118  (safe_open handles are not iterable)
                tensor = handle.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                yield name, tensor.to(device)


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype | str = "float32",
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    pack_cpu_weights_at_start: bool = True,
) -> nn.Module:
    """Build the model a checkpoint directory describes and load its weights, in eval mode. On the CPU its
    linear layers get oneDNN's packed products (`prepare_cpu_linears`), reordered now or, with
    `pack_cpu_weights_at_start` False, at each layer's first product on them.

    Raises `ModelLoadError` (or `UnsupportedArchitectureError`) naming what is wrong: a path that is not a
    directory, a missing config.json, an unknown architecture, a missing shard, or a tensor whose name or
    shape does not fit the model.
    """
    from structgen.models.architectures import create_model
    from structgen.models.config import ModelConfig

    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        raise ModelLoadError(
            f"model path {model_dir} is not a directory (GGUF files go through resolve_model)"
        )
    config = ModelConfig.from_dir(model_dir)
    files = checkpoint_files(model_dir)  # fail on missing weights before allocating the model
    torch_dtype = resolve_dtype(dtype, checkpoint_dtype=config.torch_dtype, device=device)
    model = create_model(config, dtype=torch_dtype, device=device, tp_rank=tp_rank, tp_size=tp_size)
    model.load_weights(iter_checkpoint_tensors(files, dtype=torch_dtype, device=device))
    if torch.device(device).type == "cpu":
        from structgen.models.cpu_linear import prepare_cpu_linears

        prepare_cpu_linears(model, lazy=not pack_cpu_weights_at_start)
    return model.eval()


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_shard_bytes`, HF-style.

    One shard becomes `model.safetensors`; several become `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json`. Only the current shard is held in memory.
    """

    def __init__(self, out_dir: str | Path, *, max_shard_bytes: int = 2 << 30) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._shards):
            raise ModelLoadError(f"tensor {name!r} written twice")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self._total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out_dir / f".shard-{len(self._shards) + 1}.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        if len(self._shards) == 1:
            os.replace(self._shards[0][0], self.out_dir / SINGLE_FILE)
            return
        count = len(self._shards)
        weight_map: dict[str, str] = {}
        for number, (path, names) in enumerate(self._shards, start=1):
            final = f"model-{number:05d}-of-{count:05d}.safetensors"
            os.replace(path, self.out_dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
