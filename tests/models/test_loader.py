"""Loading HF checkpoint directories: sharded safetensors, dtype selection, and errors that name the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_fixtures import random_hf_model
from paged_harness import PagedRunner
from safetensors.torch import load_file, save_file

from structgen.errors import ModelLoadError, UnsupportedArchitectureError
from structgen.models.cpu_linear import cpu_has_native_bf16
from structgen.models.loader import (
    ShardWriter,
    checkpoint_files,
    iter_checkpoint_tensors,
    load_model,
    resolve_dtype,
)

TOKENS = list(range(3, 40))


@pytest.fixture(scope="module")
def hf_llama() -> Any:
    return random_hf_model("llama", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def single_dir(hf_llama: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("single")
    hf_llama.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def sharded_dir(hf_llama: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    hf_llama.save_pretrained(out, max_shard_size="60KB")
    return out


def _hf_logits(hf_model: Any) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([TOKENS])).logits[0]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_shard_by_shard(hf_llama: Any, sharded_dir: Path) -> None:
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3, shards  # the fixture really is sharded
    assert [p.name for p in checkpoint_files(sharded_dir)] == shards

    model = load_model(sharded_dir)
    assert not model.training
    logits = PagedRunner(model).step({0: TOKENS})[0]
    assert (logits - _hf_logits(hf_llama)).abs().max().item() < 1e-4


def test_tensors_stream_lazily_in_shard_order(sharded_dir: Path) -> None:
    files = checkpoint_files(sharded_dir)
    stream = iter_checkpoint_tensors(files, dtype=torch.bfloat16)
    name, tensor = next(stream)  # nothing is read until asked for
    assert name in load_file(str(files[0])) and tensor.dtype == torch.bfloat16
    names = [name] + [n for n, _ in stream]
    per_file = [sorted(load_file(str(path))) for path in files]
    assert names == [n for file_names in per_file for n in file_names]


def test_single_file_checkpoint(hf_llama: Any, single_dir: Path) -> None:
    assert [p.name for p in checkpoint_files(single_dir)] == ["model.safetensors"]
    logits = PagedRunner(load_model(single_dir, dtype="fp32")).step({0: TOKENS})[0]
    assert (logits - _hf_logits(hf_llama)).abs().max().item() < 1e-4


CPU_AUTO = torch.bfloat16 if cpu_has_native_bf16() else torch.float32


@pytest.mark.parametrize(
    ("requested", "expected"),
    [
        ("float32", torch.float32),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("fp16", torch.float16),
        (torch.float16, torch.float16),
        ("auto", CPU_AUTO),  # on the CPU: bf16 where the CPU computes it natively, else fp32
    ],
)
def test_dtype_selection(single_dir: Path, requested: Any, expected: torch.dtype) -> None:
    model = load_model(single_dir, dtype=requested)
    assert {p.dtype for p in model.parameters()} == {expected}


def test_low_precision_logits_stay_close(hf_llama: Any, single_dir: Path) -> None:
    logits = PagedRunner(load_model(single_dir, dtype="bfloat16")).step({0: TOKENS})[0]
    reference = _hf_logits(hf_llama)
    assert (logits - reference).abs().max().item() < 0.1 * reference.abs().max().item()


def test_auto_dtype_follows_the_checkpoint_except_on_cpu(hf_llama: Any, tmp_path: Path) -> None:
    hf_llama.to(torch.bfloat16).save_pretrained(tmp_path)
    hf_llama.to(torch.float32)
    assert json.loads((tmp_path / "config.json").read_text()).get("dtype") == "bfloat16"
    model = load_model(tmp_path, dtype="auto")  # CPU: whatever the checkpoint says, the CPU's fast dtype
    assert {p.dtype for p in model.parameters()} == {CPU_AUTO}
    assert resolve_dtype("auto", checkpoint_dtype=torch.bfloat16, device="cuda") == torch.bfloat16
    assert resolve_dtype("auto", checkpoint_dtype=None, device="cuda:0") == torch.float32
    assert resolve_dtype("AUTO", checkpoint_dtype=torch.float16, device="cpu") == CPU_AUTO


def test_cpu_auto_dtype_is_bf16_only_with_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from structgen.models import cpu_linear

    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16", lambda native=native: native)
        assert resolve_dtype("auto", checkpoint_dtype=torch.float32, device="cpu") == expected


def test_bad_dtypes_are_rejected(single_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="'int8'"):
        load_model(single_dir, dtype="int8")
    with pytest.raises(ModelLoadError, match="float64"):
        resolve_dtype(torch.float64, checkpoint_dtype=None, device="cpu")


def test_missing_shard_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    broken = _copy(sharded_dir, tmp_path / "broken")
    victim = sorted(broken.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=victim.name):
        load_model(broken)


def test_missing_config_and_bad_paths(single_dir: Path, tmp_path: Path) -> None:
    no_config = _copy(single_dir, tmp_path / "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(no_config)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model(single_dir / "model.safetensors")


def test_no_weights_is_an_error(single_dir: Path, tmp_path: Path) -> None:
    empty = _copy(single_dir, tmp_path / "empty")
    (empty / "model.safetensors").rename(empty / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_model(empty)


def test_unknown_architecture_is_named(single_dir: Path, tmp_path: Path) -> None:
    other = _copy(single_dir, tmp_path / "gpt2")
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        load_model(other)


def test_wrong_tensor_shape_is_named(single_dir: Path, tmp_path: Path) -> None:
    bad = _copy(single_dir, tmp_path / "bad_shape")
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(127, 64)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(bad)


def test_unknown_and_missing_tensors_are_named(single_dir: Path, tmp_path: Path) -> None:
    extra = _copy(single_dir, tmp_path / "extra")
    tensors = load_file(str(extra / "model.safetensors"))
    tensors["model.layers.0.mlp.experts.0.weight"] = torch.zeros(4)
    save_file(tensors, str(extra / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.experts\.0\.weight"):
        load_model(extra)

    missing = _copy(single_dir, tmp_path / "missing")
    tensors = load_file(str(missing / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(missing / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight"):
        load_model(missing)


def test_corrupt_index_and_shard_are_errors(sharded_dir: Path, tmp_path: Path) -> None:
    bad_index = _copy(sharded_dir, tmp_path / "bad_index")
    (bad_index / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"index"):
        load_model(bad_index)
    bad_shard = _copy(sharded_dir, tmp_path / "bad_shard")
    sorted(bad_shard.glob("model-*.safetensors"))[0].write_bytes(b"\x00garbage")
    with pytest.raises(ModelLoadError, match=r"model-00001"):
        load_model(bad_shard)


def test_shard_writer_splits_and_indexes(tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each
    with ShardWriter(tmp_path / "many", max_shard_bytes=2048) as writer:
        (tmp_path / "many").mkdir()
        for name, tensor in tensors.items():
            writer.add(name, tensor)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    assert index["metadata"]["total_size"] == 5 * 1024
    loaded = dict(iter_checkpoint_tensors(checkpoint_files(tmp_path / "many")))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())

    (tmp_path / "one").mkdir()
    with ShardWriter(tmp_path / "one") as writer:
        writer.add("only", torch.ones(3))
        with pytest.raises(ModelLoadError, match="'only'"):
            writer.add("only", torch.ones(3))
    assert [p.name for p in checkpoint_files(tmp_path / "one")] == ["model.safetensors"]


def test_tensor_parallel_ranks_load_their_shards(single_dir: Path) -> None:
    full = load_model(single_dir)
    ranks = [load_model(single_dir, tp_rank=rank, tp_size=2) for rank in (0, 1)]
    name = "model.embed_tokens.weight"
    shards = [dict(model.named_parameters())[name] for model in ranks]
    assert shards[0].shape[0] == shards[1].shape[0] == full.config.vocab_size // 2
    assert torch.equal(torch.cat(shards), dict(full.named_parameters())[name])
