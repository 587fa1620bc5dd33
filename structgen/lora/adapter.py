"""Reading a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) for a Llama-style model.

An adapter adds `scaling * B @ A` to some of the model's projections: q/k/v/o of attention and gate/up/down of
the MLP, each with its own rank and `lora_alpha` (`rank_pattern`, `alpha_pattern`), scaled `alpha / r` or, with
rsLoRA, `alpha / sqrt(r)`. The model fuses q/k/v and gate/up into one product each, so every adapter module is
filed under its fused projection and its part there (`TargetShapes`). The scaling is folded into B when loading:
the batched product then needs no per-adapter factor. Everything an adapter could get wrong (no such directory,
a bad config, a rank above the limit, a module or layer the model lacks, a tensor of the wrong shape) is a
`LoRAError` naming it, before anything touches the model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from structgen.lora.errors import LoRAError

# HF module name -> (the model's fused projection, part index within it).
MODULE_PARTS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
SUPPORTED_MODULES = tuple(MODULE_PARTS)
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])(?:\.\w+)?\.weight$"
)


@dataclass(frozen=True, slots=True)
class TargetShapes:
    """The projections an adapter may target, per fused projection: the (in, out) of each of its parts."""

    num_layers: int
    parts: dict[str, tuple[tuple[int, int], ...]]  # fused name -> ((in, out) of each part)

    @classmethod
    def from_config(cls, config: Any) -> TargetShapes:
        hidden, head_dim = config.hidden_size, config.head_dim
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        inter = config.intermediate_size
        return cls(
            num_layers=config.num_hidden_layers,
            parts={
                "qkv_proj": ((hidden, q), (hidden, kv), (hidden, kv)),
                "o_proj": ((q, hidden),),
                "gate_up_proj": ((hidden, inter), (hidden, inter)),
                "down_proj": ((inter, hidden),),
            },
        )


@dataclass(slots=True)
class LoRAModule:
    """One adapted part: `y[:, part] += x @ a.T @ b.T` (`a`: [rank, in]; `b`: [out, rank], scaling folded in)."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(slots=True)
class LoRAAdapter:
    """A loaded adapter: its modules keyed by (layer, fused projection, part), in the model's dtype on the CPU."""

    name: str
    path: str
    modules: dict[tuple[int, str, int], LoRAModule] = field(default_factory=dict)
    base_model_name: str | None = None

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def target_modules(self) -> list[str]:
        """The HF names of the projections it adapts (in any layer)."""
        adapted = {(fused, part) for _, fused, part in self.modules}
        return [name for name, target in MODULE_PARTS.items() if target in adapted]


def load_adapter(
    name: str,
    path: str | Path,
    shapes: TargetShapes,
    *,
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Read and check the PEFT adapter in directory `path`; raises `LoRAError` naming what is wrong."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise LoRAError(f"no LoRA adapter directory at {str(path)!r}", status=404)
    config = _read_config(directory)
    tensors = _read_tensors(directory)
    pairs: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    module_names: dict[tuple[int, str, int], str] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise LoRAError(
                f"adapter tensor {key!r} is not a LoRA weight of a projection structgen can adapt "
                f"({', '.join(SUPPORTED_MODULES)}); embeddings, lm_head and extra trained modules "
                "are not supported"
            )
        module_name, layer, module, which = (
            match.group(1),
            int(match.group(2)),
            match.group(3),
            match.group(4),
        )
        if module not in MODULE_PARTS:
            raise LoRAError(
                f"adapter targets {module!r}, which the model does not have; supported: {', '.join(SUPPORTED_MODULES)}"
            )
        if layer >= shapes.num_layers:
            raise LoRAError(f"adapter targets layer {layer}, but the model has {shapes.num_layers} layers")
        fused, part = MODULE_PARTS[module]
        pairs.setdefault((layer, fused, part), {})[which] = tensor
        module_names[(layer, fused, part)] = module_name
    if not pairs:
        raise LoRAError(f"adapter at {str(path)!r} has no LoRA weights")
    adapter = LoRAAdapter(
        name=name, path=str(directory), base_model_name=config.get("base_model_name_or_path")
    )
    for key, pair in sorted(pairs.items()):
        module_name = module_names[key]
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAError(f"adapter module {module_name} has no {missing} weight")
        a, b = pair["A"], pair["B"]
        in_features, out_features = shapes.parts[key[1]][key[2]]
        rank = a.shape[0]
        if (
            a.dim() != 2
            or b.dim() != 2
            or tuple(a.shape) != (rank, in_features)
            or tuple(b.shape) != (out_features, rank)
        ):
            raise LoRAError(
                f"adapter module {module_name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the "
                f"model's projection ({in_features} -> {out_features}); was it trained for another base model?"
            )
        if rank > max_rank:
            raise LoRAError(f"adapter module {module_name} has rank {rank}, above max_lora_rank {max_rank}")
        scaling = _scaling(config, module_name, rank)
        adapter.modules[key] = LoRAModule(
            a=a.to(dtype).contiguous(), b=(b.float() * scaling).to(dtype).contiguous()
        )
    return adapter


def _read_config(directory: Path) -> dict[str, Any]:
    config_path = directory / "adapter_config.json"
    if not config_path.is_file():
        raise LoRAError(f"{directory} has no adapter_config.json: not a PEFT adapter directory", status=404)
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LoRAError(f"{config_path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{config_path} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"adapter is {peft_type}, not LoRA")
    unsupported = {
        "use_dora": "DoRA adapters",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) adapters",
        "modules_to_save": "adapters with extra trained modules (modules_to_save)",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise LoRAError(f"{what} are not supported")
    if config.get("bias", "none") not in ("none", None):
        raise LoRAError(f"adapters with trained biases (bias={config['bias']!r}) are not supported")
    alpha = config.get("lora_alpha", config.get("r"))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"adapter_config.json: lora_alpha must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise LoRAError(f"adapter_config.json: {key} must be an object")
    return config


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    safetensors_path = directory / "adapter_model.safetensors"
    bin_path = directory / "adapter_model.bin"
    try:
        if safetensors_path.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_path))
        if bin_path.is_file():
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict):
                raise LoRAError(f"{bin_path} does not hold a state dict")
            return state
    except LoRAError:
        raise
    except Exception as error:  # a truncated or foreign file: whatever the reader raised, said plainly
        raise LoRAError(f"cannot read the adapter weights in {directory}: {error}") from None
    raise LoRAError(f"{directory} has no adapter_model.safetensors (or adapter_model.bin)", status=404)


def _pattern_value(patterns: dict[str, Any], module_name: str) -> Any:
    """PEFT's per-module override: the first key that is the module's name or a regex matching its tail."""
    for key, value in patterns.items():
        if (
            module_name == key
            or module_name.endswith("." + key)
            or re.fullmatch(rf"(.*\.)?(?:{key})", module_name)
        ):
            return value
    return None


def _scaling(config: dict[str, Any], module_name: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module_name)
    alpha = config.get("lora_alpha", config.get("r", rank)) if alpha is None else alpha
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)
