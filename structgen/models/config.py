"""`ModelConfig`: the architecture hyper-parameters of a checkpoint, parsed from a Hugging Face `config.json`.

One normalized record serves every supported family, so the model code never branches on `model_type` strings:
family quirks (Qwen2's qkv bias, Qwen3's q/k norm, per-family defaults) are resolved here, once.
Both the transformers 4 spelling (`rope_theta` + `rope_scaling`) and the transformers 5 one
(`rope_parameters: {"rope_type", "rope_theta", ...}`) are accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from structgen.errors import ModelLoadError, UnsupportedArchitectureError

# Defaults of the transformers config classes for keys a config.json may omit. Structural sizes (vocab, hidden,
# layers, heads) have no default on purpose: guessing them would load garbage instead of failing.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "MistralForCausalLM": {
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "head_dim": 128},
}
_MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
CONFIG_ARCHITECTURES: tuple[str, ...] = tuple(_FAMILY_DEFAULTS)
"""Architectures whose config this module understands (kept equal to `architectures.SUPPORTED_ARCHITECTURES`)."""

# Required keys of each RoPE scaling type, besides `rope_type` / `rope_theta`.
_ROPE_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE; otherwise the HF scaling dict normalized to carry `rope_type` (and the defaults
    # transformers fills in, such as `original_max_position_embeddings`).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (always on for Qwen2)
    o_proj_bias: bool = False  # bias on the attention output projection (Llama/Qwen3 `attention_bias`)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: torch.dtype | None = None  # the checkpoint's stored dtype, if it says

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else str(self.rope_scaling["rope_type"])

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Parse `path/config.json`; EOS ids listed in `generation_config.json` are added to the config's."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"no config.json in {path}: not a Hugging Face checkpoint directory")
        config = cls.from_hf_config(_read_json(config_file))
        generation_file = path / "generation_config.json"
        if generation_file.is_file():
            for token_id in _as_id_list(_read_json(generation_file).get("eos_token_id"), "eos_token_id"):
                if token_id not in config.eos_token_ids:
                    config.eos_token_ids.append(token_id)
        return config

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        architecture = _architecture_of(d)
        merged = {**_FAMILY_DEFAULTS[architecture], **d}
        # An explicit null means "unset" (derive or default it), except for sliding_window where it means "none".
        d = {k: v for k, v in merged.items() if v is not None}
        hidden_size = _positive_int(d, "hidden_size")
        num_heads = _positive_int(d, "num_attention_heads")
        num_kv_heads = _positive_int(d, "num_key_value_heads") if "num_key_value_heads" in d else num_heads
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        if "head_dim" in d:
            head_dim = _positive_int(d, "head_dim")
        elif hidden_size % num_heads:
            raise ModelLoadError(
                f"hidden_size ({hidden_size}) is not divisible by num_attention_heads ({num_heads}) "
                "and the config gives no head_dim"
            )
        else:
            head_dim = hidden_size // num_heads
        if head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ModelLoadError(f"hidden_act {hidden_act!r} is not supported (only 'silu' / SwiGLU)")

        max_positions = _positive_int(d, "max_position_embeddings")
        _check_sliding_window(architecture, merged, max_positions)
        rope_theta, rope_scaling = _parse_rope(d, max_positions)
        qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=architecture,
            model_type=str(d.get("model_type", "")),
            vocab_size=_positive_int(d, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_positive_int(d, "intermediate_size"),
            num_hidden_layers=_positive_int(d, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 hard-codes bias on q/k/v and none on o_proj; Mistral has no attention bias at all.
            attention_bias=qwen2 or (attention_bias and architecture != "MistralForCausalLM"),
            o_proj_bias=attention_bias and architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            mlp_bias=bool(d.get("mlp_bias", False)) and architecture == "LlamaForCausalLM",
            qk_norm=architecture == "Qwen3ForCausalLM",
            bos_token_id=_as_id_list(d.get("bos_token_id"), "bos_token_id")[0]
            if "bos_token_id" in d
            else None,
            eos_token_ids=_as_id_list(d.get("eos_token_id"), "eos_token_id"),
            torch_dtype=_parse_dtype(d.get("torch_dtype", d.get("dtype"))),
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _architecture_of(d: dict[str, Any]) -> str:
    architectures = d.get("architectures") or []
    if architectures:
        architecture = str(architectures[0])
    elif d.get("model_type") in _MODEL_TYPE_TO_ARCHITECTURE:
        architecture = _MODEL_TYPE_TO_ARCHITECTURE[d["model_type"]]
    else:
        raise ModelLoadError(
            f"config has no 'architectures' and an unknown model_type {d.get('model_type')!r}; "
            f"supported: {', '.join(CONFIG_ARCHITECTURES)}"
        )
    if architecture not in _FAMILY_DEFAULTS:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(CONFIG_ARCHITECTURES)}"
        )
    return architecture


def _positive_int(d: dict[str, Any], key: str) -> int:
    if key not in d:
        raise ModelLoadError(f"config is missing {key!r}")
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"config {key!r} must be a positive integer, got {value!r}")
    return value


def _as_id_list(value: Any, key: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(f"config {key!r} must be a token id or a list of them, got {value!r}")
    return list(values)


def _parse_dtype(value: Any) -> torch.dtype | None:
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ModelLoadError(f"config dtype {value!r} is not one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def _check_sliding_window(architecture: str, d: dict[str, Any], max_positions: int) -> None:
    """Refuse checkpoints whose sliding window would bite: the attention backends attend to the full context.

    A window at least as long as the context changes nothing (HF masks keys with q - k >= window), so those load.
    """
    window = d.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # Qwen only slides when asked to, and then only on layers >= max_window_layers.
        layer_types = d.get("layer_types")
        if layer_types is not None:
            sliding = "sliding_attention" in layer_types
        else:
            sliding = bool(d.get("use_sliding_window")) and d.get("max_window_layers", 28) < d.get(
                "num_hidden_layers", 0
            )
        if not sliding:
            return
    elif architecture != "MistralForCausalLM":
        return
    if window is not None and window < max_positions:
        raise ModelLoadError(
            f"sliding-window attention (sliding_window={window} < max_position_embeddings={max_positions}) "
            "is not supported; full-attention checkpoints of this family load fine"
        )


def _parse_rope(d: dict[str, Any], max_positions: int) -> tuple[float, dict[str, Any] | None]:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"rope parameters must be a JSON object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError("per-layer-type rope_parameters are not supported by these model families")
    params = dict(params)
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    if theta <= 0:
        raise ModelLoadError(f"rope_theta must be positive, got {theta}")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in _ROPE_REQUIRED_KEYS:
        raise ModelLoadError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(_ROPE_REQUIRED_KEYS)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial_rotary_factor != 1 is not supported by these model families")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", max_positions)
    missing = [k for k in _ROPE_REQUIRED_KEYS[rope_type] if params.get(k) is None]
    if missing:
        raise ModelLoadError(f"rope type {rope_type!r} needs {', '.join(missing)} in its rope parameters")
    return theta, {"rope_type": rope_type, **params}
