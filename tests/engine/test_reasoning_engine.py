"""The engine with a reasoning parser, on `tiny-thinking` (a random Qwen3 with `<think>` / `</think>`): reasoning runs
free, the grammar starts after the end marker, the budget forces it, and the two texts never carry a marker.

The random model never writes `</think>` by itself in practice, so the budget ends reasoning, and a scripted
sampler (`Scripted`) stands in for a model that ends it (or opens it) itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from engine_helpers import run_all

from structgen.config import CacheConfig, EngineConfig, SchedulerConfig
from structgen.engine.llm_engine import LLMEngine
from structgen.models.tiny_thinking import THINK_END_ID, THINK_START_ID
from structgen.sampling_params import SamplingParams
from structgen.structured.spec import StructuredOutputsParams
from structgen.tokenizer.reasoning import ReasoningParserError, ReasoningPhase

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
MARKERS = (THINK_START_ID, THINK_END_ID)


@pytest.fixture(scope="module")
def thinking() -> tuple[torch.nn.Module, Any, Path]:
    from structgen.models.loader import load_model
    from structgen.models.registry import resolve_model
    from structgen.tokenizer import Tokenizer

    model_dir = resolve_model("tiny-thinking")
    return load_model(model_dir, dtype="float32", device="cpu"), Tokenizer.from_dir(model_dir), model_dir


def _engine(thinking: tuple[Any, Any, Path], parser: str = "qwen3", **overrides: Any) -> LLMEngine:
    model, tokenizer, model_dir = thinking
    cache = CacheConfig(kv_cache_tokens=overrides.pop("kv_cache_tokens", 4096))
    config = EngineConfig(
        model="tiny-thinking",
        device="cpu",
        reasoning_parser=parser,
        cache=cache,
        scheduler=SchedulerConfig(max_num_seqs=overrides.pop("max_num_seqs", 16)),
        **overrides,
    )
    return LLMEngine(config, model=model, tokenizer=tokenizer, model_dir=model_dir)


def _prompt(tokenizer: Any, *, opened: bool = False, **template_kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a thing, and say whether it is ok. " * 3}], **template_kwargs
    )
    return text + "<think>\n" if opened else text


def _schema_params(**kwargs: Any) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA), **kwargs)


def _check_split(output: Any, tokenizer: Any) -> None:
    """The answer validates, no marker in either text, and the answer's tokens follow the end marker."""
    jsonschema.validate(json.loads(output.text), SCHEMA)
    for text in (output.text, output.reasoning or ""):
        assert "<think>" not in text and "</think>" not in text
    answer_ids = output.token_ids[output.num_reasoning_tokens :]
    assert not set(answer_ids) & set(MARKERS)
    if output.reasoning is not None:
        assert output.token_ids[output.num_reasoning_tokens - 1] == THINK_END_ID
    assert tokenizer.decode(answer_ids) == output.text


class Scripted:
    """Wraps the engine's sampler: row 0 takes `script[step]` instead of its own pick while the script lasts."""

    def __init__(self, sampler: Any, script: list[int]) -> None:
        self.sampler, self.script, self.step = sampler, script, 0

    def __call__(self, logits: torch.Tensor, rows: Any, *, mask: Any = None) -> Any:
        out = self.sampler(logits, rows, mask=mask)
        if self.step < len(self.script):
            out.token_ids[0] = self.script[self.step]
        self.step += 1
        return out


def test_parser_reads_the_phase_from_the_end_of_the_prompt(thinking: tuple[Any, Any, Path]) -> None:
    from structgen.tokenizer.reasoning import get_reasoning_parser

    tokenizer = thinking[1]
    qwen3, r1 = get_reasoning_parser("qwen3", tokenizer), get_reasoning_parser("deepseek_r1", tokenizer)
    plain = tokenizer.encode(_prompt(tokenizer))
    opened = tokenizer.encode(_prompt(tokenizer, opened=True))
    closed = tokenizer.encode(_prompt(tokenizer, enable_thinking=False))
    # An earlier turn's closed block is history: this turn is open again.
    history = tokenizer.encode(
        "<|im_start|>assistant\n<think>\nx\n</think>\n\nanswer<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert qwen3.initial_phase(plain) is ReasoningPhase.PENDING
    assert r1.initial_phase(plain) is ReasoningPhase.THINKING
    for parser in (qwen3, r1):
        assert parser.initial_phase(opened) is ReasoningPhase.THINKING
        assert parser.initial_phase(closed) is ReasoningPhase.ANSWER
    assert qwen3.initial_phase(history) is ReasoningPhase.PENDING


def test_a_model_without_the_markers_is_refused(tiny: tuple[Any, Any, Path]) -> None:
    model, tokenizer, model_dir = tiny
    config = EngineConfig(model="tiny", device="cpu", reasoning_parser="qwen3")
    with pytest.raises(ReasoningParserError, match="'<think>' as one token"):
        LLMEngine(config, model=model, tokenizer=tokenizer, model_dir=model_dir)
    with pytest.raises(ReasoningParserError, match="unknown reasoning parser 'nope'; choose one of"):
        LLMEngine(
            EngineConfig(model="tiny", device="cpu", reasoning_parser="nope"),
            model=model,
            tokenizer=tokenizer,
            model_dir=model_dir,
        )


@pytest.mark.parametrize("budget", [0, 5, 17])
def test_the_budget_ends_reasoning_and_the_answer_validates(
    thinking: tuple[Any, Any, Path], budget: int
) -> None:
    engine = _engine(thinking)
    prompt = _prompt(engine.tokenizer, opened=True)
    for seed in range(4):
        engine.add_request(
            f"s{seed}", prompt, _schema_params(max_tokens=120, seed=seed, thinking_token_budget=budget)
        )
    for out in run_all(engine).values():
        output = out.outputs[0]
        assert output.finish_reason == "stop", output
        assert output.structured.valid
        # Exactly `budget` reasoning tokens, then the forced end marker (the prompt opened the block).
        assert output.num_reasoning_tokens == budget + 1
        assert output.reasoning is not None
        _check_split(output, engine.tokenizer)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_streamed_and_whole_outputs_agree(thinking: tuple[Any, Any, Path]) -> None:
    engine = _engine(thinking)
    prompt = _prompt(engine.tokenizer, opened=True)
    results = []
    for stream in (False, True):
        engine.add_request(
            "r", prompt, _schema_params(max_tokens=80, seed=7, thinking_token_budget=12), stream=stream
        )
        text = reasoning = ""
        final = None
        while engine.has_unfinished():
            for out in engine.step():
                text += out.outputs[0].delta_text
                reasoning += out.outputs[0].delta_reasoning
                final = out.outputs[0]
        assert final is not None and (text, reasoning) == (final.text, final.reasoning)
        results.append((final.text, final.reasoning, final.token_ids))
    assert results[0] == results[1]


def test_thinking_switched_off_in_the_prompt_answers_at_once(thinking: tuple[Any, Any, Path]) -> None:
    engine = _engine(thinking)
    prompt = _prompt(engine.tokenizer, enable_thinking=False)
    engine.add_request("r", prompt, _schema_params(max_tokens=60, seed=3, thinking_token_budget=10))
    output = run_all(engine)["r"].outputs[0]
    assert output.reasoning is None and output.num_reasoning_tokens == 0
    assert output.text.startswith("{")
    _check_split(output, engine.tokenizer)


def test_the_model_ends_its_reasoning_itself(thinking: tuple[Any, Any, Path]) -> None:
    engine = _engine(thinking)
    words = engine.tokenizer.encode(" I think so")
    # The model opens the block itself (qwen3's hybrid template leaves it to the model), thinks, closes it.
    engine.runner.sampler = Scripted(engine.runner.sampler, [THINK_START_ID, *words, THINK_END_ID])
    engine.add_request("r", _prompt(engine.tokenizer), _schema_params(max_tokens=60, seed=1), stream=True)
    output = run_all(engine)["r"].outputs[0]
    assert output.reasoning == " I think so"
    assert output.num_reasoning_tokens == len(words) + 2
    _check_split(output, engine.tokenizer)


def test_a_pending_output_that_answers_at_once_has_no_reasoning(thinking: tuple[Any, Any, Path]) -> None:
    engine = _engine(thinking)
    brace = engine.tokenizer.encode("{")
    engine.runner.sampler = Scripted(engine.runner.sampler, brace)
    engine.add_request("r", _prompt(engine.tokenizer), _schema_params(max_tokens=60, seed=1))
    output = run_all(engine)["r"].outputs[0]
    assert output.reasoning is None and output.num_reasoning_tokens == 0
    _check_split(output, engine.tokenizer)


def test_the_first_token_of_a_pending_structured_output_may_open_reasoning(
    thinking: tuple[Any, Any, Path],
) -> None:
    engine = _engine(thinking)
    seen: list[Any] = []
    sampler = engine.runner.sampler

    def spy(logits: torch.Tensor, rows: Any, *, mask: Any = None) -> Any:
        if mask is not None and not seen:
            # Both ways a pick is checked: the one-token check of a row left unfilled, and the filled row.
            ids = torch.tensor([THINK_START_ID, THINK_END_ID, engine.tokenizer.encode('{"')[0]])
            seen.append(mask.allows([0, 0, 0], ids) if 0 in mask.unfilled else None)
            mask.ensure_filled([0])
            seen.append(mask.bitmask[0].clone())
        return sampler(logits, rows, mask=mask)

    engine.runner.sampler = spy
    engine.add_request("r", _prompt(engine.tokenizer), _schema_params(max_tokens=30, seed=2, temperature=0.0))
    run_all(engine)
    assert seen[0] in (None, [True, False, True])
    words = seen[1]
    allowed = [t for t in range(32 * len(words)) if int(words[t // 32]) >> (t % 32) & 1]
    assert THINK_START_ID in allowed and engine.tokenizer.encode('{"')[0] in allowed
    assert THINK_END_ID not in allowed


def test_deepseek_r1_reasons_from_the_first_token_and_drops_a_written_tag(
    thinking: tuple[Any, Any, Path],
) -> None:
    engine = _engine(thinking, parser="deepseek_r1")
    words = engine.tokenizer.encode(" hmm")
    engine.runner.sampler = Scripted(engine.runner.sampler, [THINK_START_ID, *words, THINK_END_ID])
    engine.add_request("r", _prompt(engine.tokenizer), _schema_params(max_tokens=60, seed=1))
    output = run_all(engine)["r"].outputs[0]
    assert output.reasoning == " hmm"
    _check_split(output, engine.tokenizer)


def test_max_tokens_leaves_the_answer_room_without_a_budget(thinking: tuple[Any, Any, Path]) -> None:
    engine = _engine(thinking)
    prompt = _prompt(engine.tokenizer, opened=True)
    for seed in range(4):
        engine.add_request(f"s{seed}", prompt, _schema_params(max_tokens=48, seed=seed))
    for out in run_all(engine).values():
        output = out.outputs[0]
        assert output.finish_reason == "stop" and output.structured.valid, output
        assert 0 < output.num_reasoning_tokens < 48
        _check_split(output, engine.tokenizer)


def test_unconstrained_outputs_split_too(thinking: tuple[Any, Any, Path]) -> None:
    engine = _engine(thinking, thinking_token_budget=6)  # the engine's default budget
    prompt = _prompt(engine.tokenizer, opened=True)
    engine.add_request("r", prompt, SamplingParams(max_tokens=20, seed=0), stream=True)
    output = run_all(engine)["r"].outputs[0]
    assert output.num_reasoning_tokens == 7 and output.finish_reason == "length"
    assert output.token_ids[6] == THINK_END_ID
    assert not set(output.token_ids[7:]) & set(MARKERS)
    assert output.text == engine.tokenizer.decode(output.token_ids[7:])
    assert output.reasoning == engine.tokenizer.decode(output.token_ids[:6])


def test_a_raw_request_has_no_reasoning_phase(thinking: tuple[Any, Any, Path]) -> None:
    engine = _engine(thinking)
    prompt = _prompt(engine.tokenizer, opened=True)
    engine.add_request("r", prompt, _schema_params(max_tokens=60, seed=1), reasoning=False)
    output = run_all(engine)["r"].outputs[0]
    assert output.reasoning is None and output.text.startswith("{")
    jsonschema.validate(json.loads(output.text), SCHEMA)


def test_n_samples_preemption_and_prefix_cache_keep_both_phases_right(
    thinking: tuple[Any, Any, Path],
) -> None:
    prompt = _prompt(thinking[1], opened=True)

    def run(**overrides: Any) -> tuple[dict[str, list[list[int]]], LLMEngine]:
        engine = _engine(thinking, **overrides)
        for i in range(6):
            params = _schema_params(max_tokens=64, seed=i, n=2, thinking_token_budget=8 + i)
            engine.add_request(f"r{i}", prompt, params)
        outputs = run_all(engine)
        # Once more, reading the prompt from the prefix cache: the same first sample.
        engine.add_request("again", prompt, _schema_params(max_tokens=64, seed=0, thinking_token_budget=8))
        again = run_all(engine)["again"].outputs[0]
        assert engine.stats().prefix_cache_hit_tokens > 0
        assert again.token_ids == outputs["r0"].outputs[0].token_ids
        for out in outputs.values():
            for output in out.outputs:
                assert output.finish_reason == "stop" and output.structured.valid
                _check_split(output, engine.tokenizer)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return {rid: [o.token_ids for o in out.outputs] for rid, out in outputs.items()}, engine

    roomy, _ = run()
    cramped, cramped_engine = run(kv_cache_tokens=160)
    assert cramped_engine.stats().num_preemptions > 0, "the cache was meant to be too small for the batch"
    assert cramped == roomy


def test_speculation_keeps_both_phases_exact(thinking: tuple[Any, Any, Path]) -> None:
    prompt = _prompt(thinking[1], opened=True) + "so so so so so so so so"
    results = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3}):
        engine = _engine(thinking, speculative_config=spec)
        engine.add_request(
            "r", prompt, _schema_params(max_tokens=80, temperature=0.0, thinking_token_budget=12)
        )
        output = run_all(engine)["r"].outputs[0]
        _check_split(output, engine.tokenizer)
        results.append((output.token_ids, output.reasoning, output.text))
        if spec is not None:
            assert engine.stats().num_spec_proposed_tokens > 0
    assert results[0] == results[1]
