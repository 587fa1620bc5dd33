"""The `tiny-thinking` test model: a random-weight Qwen3 (q/k norm) with tiny's cl100k tokenizer, `<think>` and
`</think>` added, and a Qwen3-style thinking chat template.

No real reasoning model is available offline, so this one stands in for the reasoning tests and benchmarks: the
markers are added tokens that are *not* special (as in Qwen3's and DeepSeek-R1's tokenizers, so they survive
`skip_special_tokens` in decoded text), and the template follows Qwen3's: the assistant turn opens plainly
(the model writes `<think>` itself), `enable_thinking: false` writes an empty `<think>\n\n</think>\n\n` into the
generation prompt, and `reasoning_content` of earlier assistant turns is dropped from the history.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from structgen.models import tiny

# Bump whenever anything written below changes (weights, config, tokenizer ids, template): caches key on it.
TINY_THINKING_MODEL_VERSION = 1

SEED = 20261202
THINK_START = "<think>"
THINK_END = "</think>"
# Two of cl100k's reserved ids become the markers (tiny's other ids stay where they are).
THINK_START_ID = 100267
THINK_END_ID = 100268

# tiny's ChatML template with Qwen3's thinking parts: assistant history keeps only the answer, and the generation
# prompt closes an empty reasoning block when thinking is switched off.
CHAT_TEMPLATE = tiny.CHAT_TEMPLATE.replace(
    "{%- if message.content -%}{{- message.content -}}{%- endif -%}",
    "{%- if message.content -%}{{- (message.content.split('</think>') | last).lstrip('\\n') -}}{%- endif -%}",
).replace(
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}",
)
assert CHAT_TEMPLATE.count("enable_thinking") == 2 and "split('</think>')" in CHAT_TEMPLATE


def tiny_thinking_config() -> dict[str, Any]:
    config = tiny.tiny_config()
    for key in ("structgen_tiny_model_version", "mlp_bias"):
        config.pop(key)
    config.update(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        attention_bias=False,
        structgen_tiny_thinking_model_version=TINY_THINKING_MODEL_VERSION,
    )
    return config


def _weights() -> dict[str, Any]:
    import torch

    tensors = tiny._tiny_weights()
    generator = torch.Generator(device="cpu").manual_seed(SEED)
    for i in range(tiny.NUM_LAYERS):
        for name in ("q_norm", "k_norm"):
            # Random norm weights around 1, so a model that skipped the q/k norm would not pass as this one.
            weight = torch.rand((tiny.HEAD_DIM,), generator=generator, dtype=torch.float32) + 0.5
            tensors[f"model.layers.{i}.self_attn.{name}.weight"] = weight
    return tensors


def _tokenizer_json() -> str:
    from structgen.models.cl100k import build_cl100k_tokenizer_json

    spec = json.loads(build_cl100k_tokenizer_json())
    renamed = {THINK_START_ID: THINK_START, THINK_END_ID: THINK_END}
    for token in spec["added_tokens"]:
        if token["id"] in renamed:
            token["content"], token["special"] = renamed[token["id"]], False
    found = {t["id"] for t in spec["added_tokens"] if t["content"] in (THINK_START, THINK_END)}
    if found != set(renamed):
        raise RuntimeError(f"the reasoning markers did not replace reserved ids {sorted(renamed)}")
    return json.dumps(spec, ensure_ascii=False)


def build_tiny_thinking_model(target_dir: Path) -> None:
    """Write the model's HF checkpoint (config, weights, tokenizer, chat template) into `target_dir`."""
    from safetensors.torch import save

    target_dir = Path(target_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    tiny._write(target_dir / "config.json", tiny._dump(tiny_thinking_config()))
    tiny._write(
        target_dir / "generation_config.json",
        tiny._dump(
            {"bos_token_id": tiny.BOS_TOKEN_ID, "eos_token_id": [tiny.EOS_TOKEN_ID, tiny.BOS_TOKEN_ID]}
        ),
    )
    tiny._write(target_dir / "tokenizer.json", _tokenizer_json())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": tiny.MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    tiny._write(target_dir / "tokenizer_config.json", tiny._dump(tokenizer_config))
    tiny._write(target_dir / "model.safetensors", save(_weights(), metadata={"format": "pt"}))
