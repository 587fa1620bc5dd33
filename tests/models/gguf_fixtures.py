"""Test helpers: write small GGUF files the way llama.cpp's converter does, from random transformers models.

The tensor names, the q/k row permutation and the metadata keys below are llama.cpp's (convert_hf_to_gguf.py),
written out independently of `structgen.models.gguf` so the converter is checked against them, not itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from paged_harness import randomize_weights_

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED_TOKENS = ["<think>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Maria is 34 years old and lives in Lisbon.",
    "def main():\n    print('hello world')\n    return 0\n\n",
    '{"name": "Maria", "age": 34, "city": "Lisbon", "tags": ["a", "b"]}',
    "Ünïcödé: héllo wörld — naïve café, 日本語のテキスト, Ελληνικά, русский текст 🤖🎉",
    "Numbers 1234567890 and 3.14159, -42, 1e10; they'll've been DON'T I'm",
    "   leading   spaces\ttabs\r\n\r\nnewlines\n\n\n  trailing   ",
]

GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@dataclass(slots=True)
class Vocab:
    tokens: list[str]
    types: list[int]  # llama.cpp token types: 1 normal, 3 control, 4 user-defined
    merges: list[str]


def train_byte_level_vocab(vocab_size: int = 400) -> Vocab:
    """A small byte-level BPE vocabulary trained on `CORPUS`, specials first like GPT-2-style vocabularies."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + USER_DEFINED_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    import json

    model = json.loads(tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIAL_TOKENS else 4 if t in USER_DEFINED_TOKENS else 1 for t in tokens]
    return Vocab(tokens, types, merges)


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A tiny Llama-2-style sentencepiece BPE vocabulary: <unk> <s> </s>, 256 byte pieces, then scored pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    pieces = [
        "▁",
        "e",
        "t",
        "a",
        "o",
        "h",
        "l",
        "r",
        "s",
        "n",
        "i",
        "d",
        "w",
        "T",
        "H",
        "c",
        "u",
        "!",
        ",",
        ".",
    ]
    merged = [
        "▁t",
        "he",
        "▁the",
        "▁a",
        "ll",
        "llo",
        "▁he",
        "▁hello",
        "or",
        "▁w",
        "▁wor",
        "ld",
        "▁world",
        "in",
    ]
    merged += ["▁s", "st", "▁test", "es", "ed", "er", "▁T", "▁The", "an", "▁an", "▁and", "at", "▁at"]
    for rank, piece in enumerate(pieces + merged):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    return tokens, scores, types


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: per head, rows go from two halves to interleaved rotary pairs."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_tensor_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    _, _, layer, part = stem.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[part]}.{kind}"


def add_byte_level_tokenizer(
    writer: Any, vocab: Vocab, *, pre: str = "smollm", bos: int = 1, eos: int = 2
) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(eos)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def write_tokenizer_gguf(path: Path, vocab: Vocab, *, pre: str = "smollm", arch: str = "llama") -> Path:
    """A GGUF holding only tokenizer metadata (what tokenizer tests need)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, arch)
    add_byte_level_tokenizer(writer, vocab, pre=pre)
    _finish(writer)
    return path


def default_qtype(hf_name: str, array: np.ndarray) -> Any:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType.F32


def write_model_gguf(
    path: Path,
    hf_model: Any,
    vocab: Vocab,
    *,
    qtype: Callable[[str, np.ndarray], Any] = default_qtype,
    name: str = "tiny test model",
    pre: str = "smollm",
    rope_freqs: np.ndarray | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """A GGUF of a transformers Llama/Qwen2/Qwen3 model, with tensors stored as `qtype(hf_name, array)` says."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    config = hf_model.config
    arch = config.model_type
    writer = GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    add_byte_level_tokenizer(writer, vocab, pre=pre)

    tensors: dict[str, np.ndarray] = {}
    for hf_name, tensor in hf_model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().to(torch.float32).numpy()
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        tensors[hf_name] = array
    for hf_name, array in tensors.items():
        kind = qtype(hf_name, array) if array.ndim == 2 else GGMLQuantizationType.F32
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_tensor_name(hf_name), array)
        elif kind == GGMLQuantizationType.F16:
            writer.add_tensor(gguf_tensor_name(hf_name), array.astype(np.float16))
        elif kind in K_QUANT_SCALES:
            # gguf-py cannot quantize K-quants: store random blocks (valid scales), the weights are lost
            raw = random_k_quant_blocks(array.shape, kind, seed=len(hf_name))
            writer.add_tensor(gguf_tensor_name(hf_name), raw, raw_dtype=kind)
        else:
            writer.add_tensor(gguf_tensor_name(hf_name), quantize(array, kind), raw_dtype=kind)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for gguf_name, array in (extra_tensors or {}).items():
        writer.add_tensor(gguf_name, array)
    _finish(writer)
    return path


def _k_quant_scales() -> dict[Any, tuple[int, ...]]:
    from gguf import GGMLQuantizationType as Q

    # byte offsets of each block's fp16 super-block scales (ggml's block_q*_K layouts)
    return {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


K_QUANT_SCALES = _k_quant_scales()


def random_k_quant_blocks(shape: tuple[int, ...], kind: Any, *, seed: int) -> np.ndarray:
    """Random K-quant data for a `[rows, cols]` tensor, with small finite fp16 scales so it dequantizes sanely."""
    from gguf import GGML_QUANT_SIZES

    block_elems, block_bytes = GGML_QUANT_SIZES[kind]
    rows, cols = shape
    assert cols % block_elems == 0, f"K-quant rows need a multiple of {block_elems} columns"
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_SCALES[kind]:
        scale = rng.uniform(0.001, 0.01, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block_elems * block_bytes)


def _finish(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_hf_model(model_type: str, *, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers model (weights scaled so logits are spread, norms randomized)."""
    import transformers

    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }
    config_name, model_name = classes[model_type]
    settings: dict[str, Any] = {
        "vocab_size": 400,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    return randomize_weights_(
        getattr(transformers, model_name)(getattr(transformers, config_name)(**settings)).eval()
    )
