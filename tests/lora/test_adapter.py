"""Reading PEFT adapters: what is served, and a clear LoRAError (with its HTTP status) for what is not."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lora_helpers import Adapters
from safetensors.torch import load_file, save_file

from structgen.lora.adapter import LoRAError, TargetShapes, load_adapter
from structgen.models.config import ModelConfig


@pytest.fixture(scope="module")
def shapes(adapters: Adapters) -> TargetShapes:
    return TargetShapes.from_config(ModelConfig.from_dir(adapters.model_dir))


def load(path: Path, shapes: TargetShapes, max_rank: int = 16):
    return load_adapter("a", path, shapes, max_rank=max_rank, dtype=torch.float32)


def test_modules_ranks_and_scaling(adapters: Adapters, shapes: TargetShapes) -> None:
    qv8 = load(adapters.paths["qv8"], shapes)
    assert qv8.target_modules == ["q_proj", "v_proj"] and qv8.max_rank == 8
    assert {(fused, part) for _, fused, part in qv8.modules} == {("qkv_proj", 0), ("qkv_proj", 2)}
    raw = load_file(str(adapters.paths["qv8"] / "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert torch.allclose(qv8.modules[(1, "qkv_proj", 2)].b, b * (16 / 8))  # alpha / r folded into B
    mlp16 = load(adapters.paths["mlp16"], shapes)
    assert mlp16.target_modules == ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert mlp16.modules[(0, "down_proj", 0)].rank == 4  # rank_pattern
    raw = load_file(str(adapters.paths["mlp16"] / "adapter_model.safetensors"))
    for module, key, scaling in [
        ("o_proj", (0, "o_proj", 0), 32 / math.sqrt(16)),  # alpha_pattern, rsLoRA
        ("k_proj", (0, "qkv_proj", 1), 8 / math.sqrt(16)),
        ("down_proj", (0, "down_proj", 0), 8 / math.sqrt(4)),
    ]:
        block = "mlp" if module == "down_proj" else "self_attn"
        b = raw[f"base_model.model.model.layers.0.{block}.{module}.lora_B.weight"]
        assert torch.allclose(mlp16.modules[key].b, b * scaling), module


def edited(src: Path, dst: Path, *, config: Callable[[dict], None] | None = None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        data = json.loads((dst / "adapter_config.json").read_text())
        config(data)
        (dst / "adapter_config.json").write_text(json.dumps(data))
    if tensors is not None:
        data = load_file(str(dst / "adapter_model.safetensors"))
        tensors(data)
        save_file(data, str(dst / "adapter_model.safetensors"))
    return dst


def _rename(old: str, new: str) -> Callable[[dict], None]:
    def edit(t: dict) -> None:
        for key in [k for k in t if old in k]:
            t[key.replace(old, new)] = t.pop(key)

    return edit


def _drop_b(t: dict) -> None:
    for key in [k for k in t if "lora_B" in k and "layers.0." in k]:
        del t[key]


def _widen(t: dict) -> None:
    key = next(k for k in t if "lora_A" in k)
    t[key] = torch.zeros(t[key].shape[0], t[key].shape[1] + 8)


BAD = {
    "dora": ({"config": lambda c: c.update(use_dora=True)}, "DoRA adapters are not supported"),
    "bias": ({"config": lambda c: c.update(bias="all")}, "trained biases"),
    "modules_to_save": ({"config": lambda c: c.update(modules_to_save=["lm_head"])}, "modules_to_save"),
    "not lora": ({"config": lambda c: c.update(peft_type="PREFIX_TUNING")}, "not LoRA"),
    "lm_head": (
        {"tensors": _rename("model.layers.0.self_attn.q_proj", "lm_head")},
        "not a LoRA weight of a projection",
    ),
    "unknown module": ({"tensors": _rename("q_proj", "w_pack")}, "'w_pack', which the model does not have"),
    "layer beyond": ({"tensors": _rename("layers.3.", "layers.7.")}, "layer 7, but the model has 4 layers"),
    "missing B": ({"tensors": _drop_b}, "has no lora_B weight"),
    "shape": ({"tensors": _widen}, "do not fit the model's projection"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapters_are_refused(
    adapters: Adapters, shapes: TargetShapes, tmp_path: Path, case: str
) -> None:
    edits, message = BAD[case]
    path = edited(adapters.paths["qv8"], tmp_path / "a", **edits)
    with pytest.raises(LoRAError, match=message) as error:
        load(path, shapes)
    assert error.value.status == 400


def test_missing_and_unreadable(adapters: Adapters, shapes: TargetShapes, tmp_path: Path) -> None:
    for path, message, status in [
        (tmp_path / "nope", "no LoRA adapter directory", 404),
        (tmp_path, "has no adapter_config.json", 404),
    ]:
        with pytest.raises(LoRAError, match=message) as error:
            load(path, shapes)
        assert error.value.status == status
    broken = edited(adapters.paths["qv8"], tmp_path / "broken")
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="not valid JSON"):
        load(broken, shapes)
    truncated = edited(adapters.paths["qv8"], tmp_path / "truncated")
    (truncated / "adapter_model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(LoRAError, match="cannot read the adapter weights"):
        load(truncated, shapes)
    (truncated / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAError, match=r"has no adapter_model\.safetensors") as error:
        load(truncated, shapes)
    assert error.value.status == 404
    with pytest.raises(LoRAError, match="rank 8, above max_lora_rank 4"):
        load(adapters.paths["qv8"], shapes, max_rank=4)
