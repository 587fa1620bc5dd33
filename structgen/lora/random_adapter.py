"""Random LoRA adapters in PEFT's on-disk format, written without `peft`: for benchmarks and demos.

`write_random_adapter` fills every targeted projection of every layer with random A and B and saves them as PEFT
saves a LoRA (`adapter_config.json` + `adapter_model.safetensors`, tensors named
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`), so PEFT, vLLM and structgen all read the
result. The values are what `LoraConfig(init_lora_weights=False)` leaves: both matrices in `nn.Linear`'s default
init (uniform in +-1/sqrt(fan_in)), unlike PEFT's default zero B, which would make an adapter that changes
nothing and so hide a broken product. Only the shapes need the base model: its `config.json` (or config object).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from structgen.lora.adapter import MODULE_PARTS, SUPPORTED_MODULES, TargetShapes

# Which block of a decoder layer holds each projection, in PEFT's (HF's) module names.
_BLOCKS = {
    **dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), "self_attn"),
    **dict.fromkeys(("gate_proj", "up_proj", "down_proj"), "mlp"),
}


def write_random_adapter(
    out_dir: str | os.PathLike[str],
    model: str | os.PathLike[str] | Mapping[str, Any] | Any,
    *,
    rank: int = 16,
    target_modules: Sequence[str] = SUPPORTED_MODULES,
    alpha: float = 32,
    seed: int = 0,
    use_rslora: bool = False,
    b_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write a random rank-`rank` adapter on `target_modules` of every layer into `out_dir` (created) and
    return it.

    `model`: an HF checkpoint directory (its `config.json` is read), that config as a dict, or a config object
    (`model.config`). `b_scale` multiplies B: larger moves a model's outputs further from the base model's.
    The same `seed` and shapes give the same tensors.
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    unknown = sorted(set(target_modules) - set(SUPPORTED_MODULES))
    if unknown or not target_modules:
        raise ValueError(
            f"target_modules must name some of {', '.join(SUPPORTED_MODULES)}; got {unknown or []}"
        )
    if base_model_name_or_path is None and isinstance(model, (str, os.PathLike)):
        base_model_name_or_path = str(model)
    shapes = TargetShapes.from_config(_config(model))
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shapes.num_layers):
        for module in SUPPORTED_MODULES:  # a fixed order: the seed alone decides the values
            if module not in target_modules:
                continue
            fused, part = MODULE_PARTS[module]
            in_features, out_features = shapes.parts[fused][part]
            prefix = f"base_model.model.model.layers.{layer}.{_BLOCKS[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = _uniform(rank, in_features, generator, dtype)
            tensors[f"{prefix}.lora_B.weight"] = _uniform(out_features, rank, generator, dtype, scale=b_scale)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": False,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": use_rslora,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    from safetensors.torch import save_file

    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out


def _config(model: str | os.PathLike[str] | Mapping[str, Any] | Any) -> Any:
    """The model config as `TargetShapes` reads it, `head_dim` filled in where config.json leaves it out."""
    if isinstance(model, (str, os.PathLike)):
        path = Path(model).expanduser()
        config_path = path / "config.json" if path.is_dir() else path
        if not config_path.is_file():
            raise FileNotFoundError(f"no model config.json at {str(model)!r}")
        model = json.loads(config_path.read_text())
    values = dict(model) if isinstance(model, Mapping) else dict(vars(model))
    if values.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    return SimpleNamespace(**values)


def _uniform(
    rows: int, cols: int, generator: torch.Generator, dtype: torch.dtype, *, scale: float = 1.0
) -> torch.Tensor:
    """`nn.Linear`'s default init of a [rows, cols] weight (uniform in +-1/sqrt(cols)), times `scale`."""
    bound = scale / math.sqrt(cols)
    values = torch.rand(rows, cols, generator=generator, dtype=torch.float32) * (2 * bound) - bound
    return values.to(dtype).contiguous()
