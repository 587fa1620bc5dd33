"""Random PEFT LoRA adapters for the `tiny` model, made with `peft` itself, and `transformers` references for them.

`init_lora_weights=False` gives both A and B random values (PEFT's default B is zero, an adapter that changes
nothing); `lora_scale` multiplies B afterwards so the adapters move the random model's greedy picks visibly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_peft_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    r: int,
    target_modules: list[str],
    lora_alpha: int,
    seed: int,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, int] | None = None,
    lora_scale: float = 8.0,
) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=target_modules,
        init_lora_weights=False,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(lora_scale)
    peft_model.save_pretrained(out_dir)
    return out_dir


def merged_reference_model(model_dir: Path, adapter_dir: Path | None) -> Any:
    """`transformers` on `model_dir` with the adapter merged into its weights (None: the base model), fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return model.eval()


def greedy_reference(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation by full forwards (no cache), the plainest possible reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]
