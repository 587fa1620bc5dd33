"""GGUF file -> Hugging Face checkpoint directory.

llama.cpp's GGUF packs config, tokenizer and (often quantized) weights into one file under its own names. We
convert it once into a normal HF directory (`config.json`, safetensors, `tokenizer.json`, ...) so the rest of
structgen only ever loads one format. The header is read by `structgen.models.gguf_file`; weights are
dequantized with the `gguf` package; F16/BF16 tensors keep their dtype. llama.cpp stores llama-style q/k
projections with their rows permuted (its rotary pairs adjacent dimensions where HF pairs the two halves of a
head); that is undone here, exactly as transformers' own GGUF load does. Qwen2/Qwen3 GGUFs use the half-split (NEOX) rotary already and are not permuted.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from structgen.errors import ModelLoadError, UnsupportedArchitectureError
from structgen.models.gguf_file import open_gguf
from structgen.models.gguf_tokenizer import special_token_ids, write_tokenizer_files

if TYPE_CHECKING:
    from structgen.models.gguf_file import GGUFFile, GGUFTensor

# Bump when the converter's output changes, so cached conversions made by an older version are not reused.
GGUF_CONVERTER_VERSION = 1

_HF_CLASSES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# llama.cpp's llama converter (also used for Mistral GGUFs, which say architecture "llama") permutes q/k.
_PERMUTED_ARCHITECTURES = frozenset({"llama"})

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Precomputed rotary tables some old llama GGUFs carry; HF recomputes them from the config.
_SKIPPED_TENSORS = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?)$")
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def read_gguf(gguf_path: str | Path) -> GGUFFile:
    """Open a GGUF file (its header read, its tensors memory-mapped), with a clear error for a missing or
    unreadable file. The reading of an unchanged file is reused: loading the default model reads it for its
    4-bit and its 8-bit blocks."""
    path = Path(gguf_path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _open_gguf(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GGUFFile:
    try:
        return open_gguf(path)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot read {path} as a GGUF file: {exc}") from exc


def gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """Every key/value of the file as plain Python values (strings, numbers, lists); a copy, as the reading is
    shared."""
    return dict(reader.metadata)


def hf_architecture(metadata: dict[str, Any]) -> str:
    """The HF model family of a GGUF: its `general.architecture`, with Mistral told apart from Llama by name."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)} "
            "(Mistral GGUFs use 'llama')"
        )
    # llama.cpp writes Mistral models as "llama"; transformers' GGUF load tells them apart by name too.
    if arch == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
        return "mistral"
    return arch


def gguf_to_hf_config(
    metadata: dict[str, Any], tensor_names: list[str], *, rope_freqs: np.ndarray | None = None
) -> dict[str, Any]:
    """An HF `config.json` dict for a supported GGUF, from its metadata and the names of its tensors."""
    arch = metadata.get("general.architecture")
    family = hf_architecture(metadata)
    model_type, hf_class = _HF_CLASSES[family]

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks '{arch}.{name}', which the {family} config needs")
        return value

    num_heads = int(key("attention.head_count"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts; our models take one value
        if len(set(num_kv_heads)) != 1:
            raise ModelLoadError(
                f"GGUF has per-layer KV head counts {sorted(set(num_kv_heads))}; unsupported"
            )
        num_kv_heads = num_kv_heads[0]
    hidden_size = int(key("embedding_length"))
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None and family in ("llama", "mistral"):
        # For llama-style models the rotary width is the head width (transformers reads it the same way).
        head_dim = metadata.get(f"{arch}.rope.dimension_count")
    head_dim = int(head_dim) if head_dim is not None else hidden_size // num_heads
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = metadata.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else None)
    if vocab_size is None:
        raise ModelLoadError("GGUF metadata states neither a vocab size nor a token list")
    rope_theta = float(key("rope.freq_base", 10000.0))
    names = set(tensor_names)
    ids = special_token_ids(metadata)

    config: dict[str, Any] = {
        "architectures": [hf_class],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(metadata, arch, rope_theta, head_dim, rope_freqs),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos,
        "pad_token_id": ids.pad,
    }
    if family in ("llama", "mistral", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = False
    if family == "mistral":
        # llama.cpp runs Mistral GGUFs with full attention; the HF class would otherwise default a window.
        config["sliding_window"] = None
    if family == "qwen2":
        config["use_sliding_window"] = False
    return config


def _rope_scaling(
    metadata: dict[str, Any], arch: str, rope_theta: float, head_dim: int, rope_freqs: np.ndarray | None
) -> dict[str, Any] | None:
    scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if rope_freqs is not None:
        # Llama 3.x: llama.cpp bakes the "llama3" scaling into per-dimension frequency divisors.
        return llama3_rope_scaling(
            rope_freqs, rope_theta=rope_theta, head_dim=head_dim, original_context=int(original or 8192)
        )
    if scaling_type == "none" or factor in (None, 1.0):
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if scaling_type == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := metadata.get(f"{arch}.rope.scaling.{gguf_name}")) is not None:
                scaling[hf_name] = float(value)
        return scaling
    raise ModelLoadError(
        f"GGUF rope scaling type {scaling_type!r} is not supported (linear, yarn, llama3 are)"
    )


def llama3_factors(
    *, rope_theta: float, head_dim: int, factor: float, low: float, high: float, original_context: int
) -> np.ndarray:
    """llama3 rope scaling as per-dimension divisors of the base frequencies (llama.cpp's `rope_freqs`)."""
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_context / wavelen - low) / (high - low)
    scaled = np.where(wavelen < original_context / high, 1.0, 1.0 / ((1 - smooth) / factor + smooth))
    return np.where(wavelen > original_context / low, factor, scaled)


def llama3_rope_scaling(
    rope_freqs: np.ndarray, *, rope_theta: float, head_dim: int, original_context: int
) -> dict[str, Any] | None:
    """Recover HF's llama3 `rope_scaling` from llama.cpp's `rope_freqs` tensor.

    Only the ratios of (original context, low factor, high factor) are identifiable from the divisors, and any
    consistent choice gives identical frequencies, so the original context is taken from the metadata (8192,
    Llama 3's, when absent) and the two factors are fitted to the smooth band, then checked against every dim.
    """
    divisors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if divisors.shape[0] != head_dim // 2:
        raise ModelLoadError(
            f"GGUF rope_freqs has {divisors.shape[0]} entries, expected head_dim/2 = {head_dim // 2}"
        )
    if np.allclose(divisors, 1.0):
        return None
    factor = float(divisors.max())
    band = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if band.sum() < 2:
        raise ModelLoadError("GGUF rope_freqs has no smooth llama3 band; cannot recover its rope scaling")
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    # In the band, smooth = original/((high-low)*wavelen) - low/(high-low): linear in 1/wavelen.
    smooth = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_freq[band] / (2 * math.pi), smooth, 1)
    low = round(float(-intercept * original_context / slope), 4)
    high = round(float(low + original_context / slope), 4)
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original_context,
    }
    rebuilt = llama3_factors(
        rope_theta=rope_theta,
        head_dim=head_dim,
        factor=factor,
        low=low,
        high=high,
        original_context=original_context,
    )
    if not np.allclose(rebuilt, divisors, rtol=1e-4, atol=1e-5):
        raise ModelLoadError("GGUF rope_freqs does not follow llama3 rope scaling; cannot convert it")
    return scaling


def hf_tensor_name(gguf_name: str) -> str:
    """HF parameter name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    if match := _LAYER_NAME.match(gguf_name):
        layer, part, kind = match.groups()
        if part in _LAYER_TENSORS:
            return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    elif (match := _GLOBAL_NAME.match(gguf_name)) and match.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[match.group(1)]}.{match.group(2)}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no counterpart in the supported model families")


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (per head: interleaved rotary pairs -> two halves)."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"cannot un-permute a q/k tensor of {rows} rows over {num_heads} heads")
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape).contiguous()


def dequantize_tensor(tensor: GGUFTensor) -> torch.Tensor:
    """One GGUF tensor as a torch tensor in HF layout: fp16/bf16 kept, everything else dequantized to fp32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
    qtype = tensor.tensor_type
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(np.array(tensor.data, dtype=np.float16).reshape(shape))
    if qtype == GGMLQuantizationType.BF16:
        raw = np.array(tensor.data).view(np.int16).reshape(shape)
        return torch.from_numpy(raw).view(torch.bfloat16)
    try:
        values = dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name!r} uses {qtype.name}, which gguf cannot dequantize"
        ) from exc
    return torch.from_numpy(np.require(values, dtype=np.float32, requirements=["C", "W"]).reshape(shape))


def iter_hf_tensors(reader: GGUFFile, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight of the file, one tensor in memory at a time."""
    permute = reader.metadata.get("general.architecture") in _PERMUTED_ARCHITECTURES
    for tensor in reader.tensors:
        if _SKIPPED_TENSORS.match(tensor.name):
            continue
        name = hf_tensor_name(tensor.name)
        value = dequantize_tensor(tensor)
        if permute and (".q_proj." in name or ".k_proj." in name):
            heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
            value = unpermute_rows(value, heads)
        yield name, value


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, *, max_shard_bytes: int = 2 << 30) -> Path:
    """Write the HF checkpoint directory equivalent of a GGUF file into `out_dir` (created if missing).

    Tensors are written in safetensors shards of at most `max_shard_bytes` (one `model.safetensors` when they
    fit), so memory holds one shard at a time even for large files.
    """
    from structgen.models.loader import ShardWriter

    reader = read_gguf(gguf_path)
    metadata = gguf_metadata(reader)
    if int(metadata.get("split.count", 1)) > 1:
        raise ModelLoadError(
            f"{gguf_path} is one part of a split GGUF; merge it first (llama-gguf-split --merge)"
        )
    hf_architecture(metadata)  # unsupported architecture -> clear error before any work
    tensor_names = [tensor.name for tensor in reader.tensors]
    rope_freqs = next((np.array(t.data) for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    config = gguf_to_hf_config(metadata, tensor_names, rope_freqs=rope_freqs)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    matrix_dtypes: set[torch.dtype] = set()
    with ShardWriter(out, max_shard_bytes=max_shard_bytes) as writer:
        for name, tensor in iter_hf_tensors(reader, config):
            if tensor.dim() == 2:
                matrix_dtypes.add(tensor.dtype)
            writer.add(name, tensor)
    # The dtype the weights were stored in: fp16/bf16 only if every matrix kept it, else fp32.
    dtype = matrix_dtypes.pop() if len(matrix_dtypes) == 1 else torch.float32
    config["dtype"] = str(dtype).removeprefix("torch.")
    _write_json(out / "config.json", config)

    ids = special_token_ids(metadata)
    generation = {"bos_token_id": ids.bos, "eos_token_id": ids.eos_ids or ids.eos, "pad_token_id": ids.pad}
    _write_json(out / "generation_config.json", {k: v for k, v in generation.items() if v is not None})
    write_tokenizer_files(metadata, out, model_max_length=config["max_position_embeddings"])
    return out


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
