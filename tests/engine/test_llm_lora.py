"""`LLM` with LoRA adapters, vLLM-style: `enable_lora=True` and a `lora_request` per call or per prompt. Every
greedy output equals transformers' on the base model with that adapter merged by PEFT itself."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# The LoRA tests' helpers (`tests/lora/peft_adapters.py`), imported by bare name like each folder's own.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "lora"))

from peft_adapters import greedy_reference, make_peft_adapter, merged_reference_model

from structgen import LLM, LoRARequest, SamplingParams
from structgen.lora import LoRAError

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[1000 + 37 * i for i in range(12)], [5000 + 11 * i for i in range(7)], [700, 701, 702, 703, 704]]
CONVERSATION = [{"role": "user", "content": "Extract the city from: I live in Lisbon."}]


@dataclass(slots=True)
class Setup:
    llm: LLM
    model_dir: Path
    adapters: dict[str, LoRARequest]

    def reference(self, name: str | None, prompt: list[int]) -> list[int]:
        adapter = Path(self.adapters[name].lora_path) if name is not None else None
        return greedy_reference(merged_reference_model(self.model_dir, adapter), prompt, MAX_TOKENS)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    from structgen.models.registry import resolve_model

    model_dir = resolve_model("tiny")
    root = tmp_path_factory.mktemp("llm-lora")
    qv = make_peft_adapter(
        model_dir, root / "qv", r=8, target_modules=["q_proj", "v_proj"], lora_alpha=16, seed=3
    )
    mlp = make_peft_adapter(
        model_dir,
        root / "mlp",
        r=4,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        lora_alpha=8,
        seed=4,
    )
    llm = LLM("tiny", dtype="float32", device="cpu", kv_cache_tokens=4096, max_num_seqs=8, enable_lora=True)
    adapters = {"qv": LoRARequest("qv", 1, str(qv)), "mlp": LoRARequest("mlp", 2, str(mlp))}
    yield Setup(llm=llm, model_dir=model_dir, adapters=adapters)
    llm.shutdown()


def test_one_adapter_per_prompt_mixed_with_the_base_model(setup: Setup) -> None:
    names = ["qv", None, "mlp", "qv"]
    prompts = [*PROMPTS, PROMPTS[1]]
    requests = [setup.adapters[n] if n is not None else None for n in names]
    outs = setup.llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=requests)
    got = [list(o.outputs[0].token_ids) for o in outs]
    want = [setup.reference(n, p) for n, p in zip(names, prompts, strict=True)]
    assert got == want
    # The adapters move the model: the same prompt gives another continuation with the base model.
    assert got[1] != got[3]


def test_one_adapter_for_every_prompt(setup: Setup) -> None:
    outs = setup.llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, lora_request=setup.adapters["mlp"]
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == [setup.reference("mlp", p) for p in PROMPTS[:2]]


def test_chat_with_an_adapter(setup: Setup) -> None:
    out = setup.llm.chat(CONVERSATION, GREEDY, lora_request=setup.adapters["qv"])[0]
    assert out.prompt is not None and "<|im_start|>assistant" in out.prompt
    assert list(out.outputs[0].token_ids) == setup.reference("qv", list(out.prompt_token_ids))
    base = setup.llm.chat(CONVERSATION, GREEDY)[0]
    assert base.outputs[0].token_ids != out.outputs[0].token_ids


def test_bad_lora_requests_queue_nothing(setup: Setup, tmp_path: Path) -> None:
    llm = setup.llm
    with pytest.raises(ValueError, match="2 LoRA requests for 3 prompts"):
        llm.generate(["a", "b", "c"], GREEDY, lora_request=[setup.adapters["qv"], None])
    with pytest.raises(TypeError, match="LoRARequest or None, got str"):
        llm.generate(["a"], GREEDY, lora_request=["qv"])  # type: ignore[list-item]
    # An adapter that cannot be read: the prompts before it are taken back too.
    missing = LoRARequest("missing", 3, str(tmp_path / "nothing-here"))
    with pytest.raises(LoRAError, match="no LoRA adapter directory"):
        llm.generate(["a", "b"], GREEDY, lora_request=[setup.adapters["qv"], missing])
    assert not llm.engine.has_unfinished()


def test_a_lora_request_needs_enable_lora() -> None:
    llm = LLM("tiny", dtype="float32", device="cpu", kv_cache_tokens=1024, max_num_seqs=2)
    request = LoRARequest("any", 1, "/nowhere")
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate("hello", GREEDY, lora_request=request)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.chat(CONVERSATION, GREEDY, lora_request=[request])
    assert not llm.engine.has_unfinished()
    assert llm.generate("hello", GREEDY, lora_request=[None])[0].finished
