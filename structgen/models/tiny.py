"""The `tiny` test model: a ~28.6M-parameter random Llama with the real cl100k tokenizer and a ChatML template.

It keeps unit tests fast and gives mask benchmarks a realistic 100k vocabulary. `build_tiny_model` writes a
normal Hugging Face checkpoint directory (transformers loads it too), in a few seconds, from nothing but
the installed packages. The weights come from our own seeded initializer rather than transformers' (whose
init differs between versions), so two builds are byte-identical on a given torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from structgen.models.cl100k import CL100K_VOCAB_SIZE, ENDOFTEXT, IM_END, build_cl100k_tokenizer_json

# Bump whenever anything written below changes (weights, config, tokenizer ids, template): caches key on it.
TINY_MODEL_VERSION = 1

SEED = 20240601
INIT_STD = 0.02
HIDDEN_SIZE = 256
NUM_LAYERS = 4
NUM_HEADS = 8
NUM_KV_HEADS = 4
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
# SwiGLU's usual 8/3 * hidden, rounded up to a multiple of 16.
INTERMEDIATE_SIZE = 688
MAX_POSITIONS = 4096
# Embedding rows padded to a multiple of 64 (friendlier matmul shapes); ids past the tokenizer are never produced
# by it but a random model can sample them, so the engine must treat them as unknown.
VOCAB_SIZE = -(-CL100K_VOCAB_SIZE // 64) * 64

BOS_TOKEN_ID = 100257  # <|endoftext|>
EOS_TOKEN_ID = 100265  # <|im_end|>

# ChatML, with tools declared in the system turn and calls written as JSON inside <tool_call> tags (the format
# Qwen models use, so tool-call parsing written for those works here). Tool results go back in a user turn, one
# <tool_response> block per result. `arguments` may be a JSON string (OpenAI style) or an object.
CHAT_TEMPLATE = r"""{%- set conversation = messages -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_text = messages[0].content -%}
    {%- set conversation = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if system_text is defined -%}{{- system_text + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call one or more of these functions. Their JSON signatures are inside <tools></tools>:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nFor each call, reply with a JSON object holding the function name and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif system_text is defined -%}
    {{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in conversation -%}
    {%- if message.role == 'user' -%}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if message.content -%}{{- message.content -}}{%- endif -%}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if message.content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
            {%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- elif message.role == 'system' -%}
        {{- raise_exception('a system message may only come first') -}}
    {%- else -%}
        {{- raise_exception('unknown message role: ' + message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""


def tiny_config() -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": INIT_STD,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "dtype": "float32",
        "use_cache": True,
        "structgen_tiny_model_version": TINY_MODEL_VERSION,
    }


def _tensor_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """Every stored tensor, in the fixed order the generator fills them (lm_head is tied: not stored)."""
    kv = NUM_KV_HEADS * HEAD_DIM
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB_SIZE, HIDDEN_SIZE))]
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.input_layernorm.weight", (HIDDEN_SIZE,)),
            (f"{p}.self_attn.q_proj.weight", (NUM_HEADS * HEAD_DIM, HIDDEN_SIZE)),
            (f"{p}.self_attn.k_proj.weight", (kv, HIDDEN_SIZE)),
            (f"{p}.self_attn.v_proj.weight", (kv, HIDDEN_SIZE)),
            (f"{p}.self_attn.o_proj.weight", (HIDDEN_SIZE, NUM_HEADS * HEAD_DIM)),
            (f"{p}.post_attention_layernorm.weight", (HIDDEN_SIZE,)),
            (f"{p}.mlp.gate_proj.weight", (INTERMEDIATE_SIZE, HIDDEN_SIZE)),
            (f"{p}.mlp.up_proj.weight", (INTERMEDIATE_SIZE, HIDDEN_SIZE)),
            (f"{p}.mlp.down_proj.weight", (HIDDEN_SIZE, INTERMEDIATE_SIZE)),
        ]
    shapes.append(("model.norm.weight", (HIDDEN_SIZE,)))
    return shapes


def tiny_num_parameters() -> int:
    total = 0
    for _, shape in _tensor_shapes():
        size = 1
        for dim in shape:
            size *= dim
        total += size
    return total


def _tiny_weights() -> dict[str, Any]:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(SEED)
    tensors = {}
    for name, shape in _tensor_shapes():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(INIT_STD)
    return tensors


def _write(path: Path, data: str | bytes) -> None:
    # Write-then-rename so a crash never leaves a half-written file that looks complete.
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(data, str):
        tmp.write_text(data, encoding="utf-8")
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def build_tiny_model(target_dir: Path) -> None:
    """Write the tiny model's HF checkpoint (config, weights, tokenizer, chat template) into `target_dir`."""
    from safetensors.torch import save

    target_dir = Path(target_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    _write(target_dir / "config.json", _dump(tiny_config()))
    _write(
        target_dir / "generation_config.json",
        _dump({"bos_token_id": BOS_TOKEN_ID, "eos_token_id": [EOS_TOKEN_ID, BOS_TOKEN_ID]}),
    )
    _write(target_dir / "tokenizer.json", build_cl100k_tokenizer_json())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    _write(target_dir / "tokenizer_config.json", _dump(tokenizer_config))
    _write(target_dir / "model.safetensors", save(_tiny_weights(), metadata={"format": "pt"}))
