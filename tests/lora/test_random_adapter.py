"""`write_random_adapter`: PEFT itself loads what it writes, tensor for tensor, and the engine serves it as PEFT's
merged model computes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft_adapters import greedy_reference, merged_reference_model
from safetensors.torch import load_file

from structgen import LLM, LoRARequest, SamplingParams
from structgen.lora.random_adapter import write_random_adapter
from structgen.models.registry import resolve_model

MAX_TOKENS = 6
PROMPTS = [[1000 + 37 * i for i in range(12)], [5000 + 11 * i for i in range(7)]]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Every supported module, rsLoRA: the config fields a reader could get wrong. b_scale moves the random
    # `tiny` model's greedy picks, so the comparison below sees the adapter at all.
    return write_random_adapter(
        tmp_path_factory.mktemp("random") / "all7",
        resolve_model("tiny"),
        rank=8,
        alpha=16,
        seed=5,
        use_rslora=True,
        b_scale=8.0,
    )


def test_peft_loads_it_tensor_for_tensor(adapter_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    written = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert len(written) == 4 * 7 * 2  # tiny's 4 layers, 7 projections, A and B
    assert "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight" in written
    base = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir)
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.use_rslora) == (8, 16, True)
    assert set(config.target_modules) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    loaded = {
        name.replace(".default", ""): p.detach() for name, p in model.named_parameters() if "lora_" in name
    }
    assert loaded.keys() == written.keys()
    for name, tensor in written.items():
        assert torch.equal(loaded[name], tensor), name


def test_the_same_seed_writes_the_same_adapter(adapter_dir: Path, tmp_path: Path) -> None:
    config = json.loads((resolve_model("tiny") / "config.json").read_text())
    again = write_random_adapter(
        tmp_path / "again", config, rank=8, alpha=16, seed=5, use_rslora=True, b_scale=8.0
    )
    first = load_file(str(adapter_dir / "adapter_model.safetensors"))
    second = load_file(str(again / "adapter_model.safetensors"))
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = write_random_adapter(tmp_path / "other", config, rank=8, target_modules=["q_proj"], seed=6)
    assert len(load_file(str(other / "adapter_model.safetensors"))) == 4 * 2


def test_the_engine_serves_it_as_peft_merges_it(adapter_dir: Path) -> None:
    model_dir = resolve_model("tiny")
    llm = LLM("tiny", dtype="float32", device="cpu", kv_cache_tokens=1024, max_num_seqs=4, enable_lora=True)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request = LoRARequest("random", 1, str(adapter_dir))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=[request, None])
    merged, base = merged_reference_model(model_dir, adapter_dir), merged_reference_model(model_dir, None)
    assert list(outs[0].outputs[0].token_ids) == greedy_reference(merged, PROMPTS[0], MAX_TOKENS)
    assert list(outs[1].outputs[0].token_ids) == greedy_reference(base, PROMPTS[1], MAX_TOKENS)
    assert greedy_reference(merged, PROMPTS[0], MAX_TOKENS) != greedy_reference(base, PROMPTS[0], MAX_TOKENS)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="embed_tokens"):
        write_random_adapter(tmp_path / "x", resolve_model("tiny"), target_modules=["embed_tokens"])
    with pytest.raises(ValueError, match="rank must be >= 1"):
        write_random_adapter(tmp_path / "x", resolve_model("tiny"), rank=0)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        write_random_adapter(tmp_path / "x", tmp_path)
