"""The structured-output layer wired into the engine: masks in the step loop, WAITING_FOR_GRAMMAR, compile
errors, jump-forward, validation reports, and real schemas on the default SmolLM2 model."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future
from typing import Any

import jsonschema
import pytest
from engine_helpers import EngineFactory, run_all
from shared_data import DATA

from structgen.engine.llm import LLM
from structgen.engine.sequence import SequenceStatus
from structgen.sampling_params import SamplingParams
from structgen.structured import (
    StructuredOutputConfig,
    StructuredOutputError,
    StructuredOutputsParams,
    compile_spec,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
# Long forced runs: the keys and every value but one choice are fixed by the schema.
FORCED = {
    "type": "object",
    "properties": {
        "a_rather_long_property_name_for_testing": {"enum": ["first value", "second value"]},
        "another_long_property_name_that_is_forced": {"const": "a constant string value"},
    },
    "required": ["a_rather_long_property_name_for_testing", "another_long_property_name_that_is_forced"],
    "additionalProperties": False,
}


def _structured(max_tokens: int = 40, temperature: float = 0.0, seed: int | None = None, **spec: Any):
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**spec),
    )


def test_sampling_params_rejects_a_bad_structured_field() -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_checking_tokens_instead_of_filling_masks_gives_the_same_outputs(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, temperature: float
) -> None:
    from structgen.structured.llguidance_backend import LLGuidanceGrammar

    def run() -> dict[str, list[int]]:
        engine = make_engine()
        for i, spec in enumerate([{"json": PERSON}, {"json": UNIQUE}, {"regex": r"[a-z]{3,12}"}] * 2):
            engine.add_request(f"r{i}", f"Item {i}:", _structured(24, temperature, seed=i, **spec))
        return {rid: out.outputs[0].token_ids for rid, out in run_all(engine).items()}

    deferred = run()
    monkeypatch.setattr(LLGuidanceGrammar, "checks_tokens_cheaply", False)  # every row filled ahead
    assert run() == deferred


def test_mixed_batch_leaves_unconstrained_rows_unchanged(make_engine: EngineFactory) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    alone = make_engine()
    for i, prompt in enumerate(prompts):
        alone.add_request(f"p{i}", prompt, plain)
    expected = {rid: out.outputs[0].token_ids for rid, out in run_all(alone).items()}

    mixed = make_engine()
    # Serve the regex with xgrammar and the choice with outlines (the JSON Schema with llguidance): seed the
    # compile cache with those backends' grammars, so one step's mask mixes all three.
    manager = mixed.structured.ensure_manager()
    for spec, backend in (
        (StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}").to_spec(), "xgrammar"),
        (StructuredOutputsParams(choice=["yes", "no", "maybe"]).to_spec(), "outlines"),
    ):
        seeded: Future[Any] = Future()
        seeded.set_result(compile_spec(spec, [manager.backend(backend)]))
        manager._cache[manager.cache_key(spec)] = seeded
    for i, prompt in enumerate(prompts):
        mixed.add_request(f"p{i}", prompt, plain)
    mixed.add_request("json", "A person:", _structured(json=PERSON))
    mixed.add_request("regex", "A date:", _structured(regex=r"\d{4}-\d{2}-\d{2}"))
    mixed.add_request("choice", "Yes or no?", _structured(choice=["yes", "no", "maybe"]))
    got = run_all(mixed)
    for rid, tokens in expected.items():
        assert got[rid].outputs[0].token_ids == tokens, rid
        assert got[rid].outputs[0].structured is None
    date = got["regex"].outputs[0]
    assert date.finish_reason == "stop" and re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.text)
    assert got["choice"].outputs[0].text in ("yes", "no", "maybe")
    assert (date.structured.backend, got["choice"].outputs[0].structured.backend) == ("xgrammar", "outlines")
    person = got["json"].outputs[0]
    if person.finish_reason == "stop":
        jsonschema.validate(json.loads(person.text), PERSON)
        assert person.structured is not None and person.structured.valid and person.structured.complete
    else:
        assert person.finish_reason == "length" and not person.structured.complete
    assert mixed.block_manager.num_free_blocks == mixed.block_manager.num_blocks


def test_slow_compile_does_not_stall_other_requests(make_engine: EngineFactory) -> None:
    engine = make_engine()
    manager = engine.structured.ensure_manager()
    release = threading.Event()
    compile_once = manager._compile

    def slow_compile(spec, limit):  # type: ignore[no-untyped-def]
        assert release.wait(30), "the test never released the compile"
        return compile_once(spec, limit)

    manager._compile = slow_compile  # type: ignore[method-assign]
    engine.add_request("slow", "A person:", _structured(json=PERSON, max_tokens=20))
    engine.add_request("plain", "Hello", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    finished: dict[str, Any] = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if "plain" in finished:
            break
    assert "plain" in finished and len(finished["plain"].outputs[0].token_ids) == 8
    assert engine.stats().num_waiting_for_grammar == 1
    slow = engine._requests["slow"].seqs[0]
    assert slow.status is SequenceStatus.WAITING_FOR_GRAMMAR and not slow.output_token_ids
    release.set()
    rest = run_all(engine)
    assert rest["slow"].outputs[0].finish_reason in ("stop", "length")


def test_compile_failure_fails_only_that_request(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.add_request("bad", "x", _structured(regex="(unclosed"))
    engine.add_request("plain", "Hello", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    done = run_all(engine)
    bad = done["bad"].outputs[0]
    assert bad.finish_reason == "error" and bad.error
    assert bad.structured is not None and bad.structured.valid is None
    assert done["plain"].outputs[0].finish_reason == "length"
    # The failure is cached: the same spec is now rejected synchronously, before it reaches the queue.
    with pytest.raises(StructuredOutputError):
        engine.add_request("bad2", "x", _structured(regex="(unclosed"))
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_while_compiling_and_running_frees_everything(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.add_request("a", "A person:", _structured(json=PERSON, max_tokens=30))
    engine.add_request("b", "A person:", _structured(json=FORCED, max_tokens=30))
    for _ in range(3):
        engine.step()
    engine.abort(["a", "b"])
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.structured._compiling == []


def test_jump_forward_saves_forwards(make_engine: EngineFactory) -> None:
    results = {}
    for jump in (True, False):
        engine = make_engine(structured=StructuredOutputConfig(jump_forward=jump))
        for i in range(2):
            engine.add_request(f"r{i}", f"Record {i}:", _structured(json=FORCED, max_tokens=60, seed=i))
        done = run_all(engine)
        texts = [done[f"r{i}"].outputs[0] for i in range(2)]
        for out in texts:
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(out.text), FORCED)
            assert out.structured.valid
        results[jump] = (engine.stats(), texts)
    with_jf, without = results[True][0], results[False][0]
    assert with_jf.num_jump_forward_tokens > 20 and without.num_jump_forward_tokens == 0
    assert with_jf.num_steps * 2 < without.num_steps
    assert all(o.structured.forced_tokens > 0 for o in results[True][1])


def test_n_greater_than_one_forks_the_grammar(make_engine: EngineFactory) -> None:
    engine = make_engine()
    params = SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=30, structured_outputs=StructuredOutputsParams(json=FORCED)
    )
    engine.add_request("n3", "Record:", params)
    out = run_all(engine)["n3"]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), FORCED)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_of_a_fully_forced_output(make_engine: EngineFactory, stream: bool) -> None:
    """A grammar that allows one output ends the request before the prompt runs: still `n` choices."""
    engine = make_engine()
    params = SamplingParams(n=3, max_tokens=5, structured_outputs=StructuredOutputsParams(regex="loop"))
    engine.add_request("forced", "x", params, stream=stream)
    out = run_all(engine)["forced"]
    assert [(o.index, o.text, o.finish_reason) for o in out.outputs] == [
        (i, "loop", "stop") for i in range(3)
    ]
    assert all(o.structured is not None and o.structured.valid for o in out.outputs)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_max_tokens_marks_the_output_incomplete(make_engine: EngineFactory) -> None:
    engine = make_engine()
    engine.add_request("short", "x", _structured(json=FORCED, max_tokens=3))
    out = run_all(engine)["short"].outputs[0]
    assert out.finish_reason == "length"
    assert out.structured is not None and not out.structured.complete and not out.structured.valid


# -- the default model on real schemas ----------------------------------------------------------------------


def _bench_schemas() -> list[tuple[str, Any]]:
    picked = []
    for subset, index in (("Github_easy", 0), ("Glaiveai2K", 0), ("JME", 1), ("BFCL_simple", 0)):
        with (DATA / "jsonschemabench" / f"{subset}.jsonl").open() as f:
            rows = [json.loads(line) for _, line in zip(range(index + 1), f, strict=False)]
        picked.append((subset, rows[index]["schema"]))
    samples = DATA / "vllm-samples"
    picked.append(("vllm-sample", json.loads((samples / "sample_json_schema.v1.json").read_text())))
    return picked


@pytest.fixture(scope="module")
def smollm() -> LLM:
    return LLM(kv_cache_tokens=8192, max_num_seqs=16)


def test_default_model_outputs_satisfy_real_specs(smollm: LLM) -> None:
    samples = DATA / "vllm-samples"
    schemas = _bench_schemas()
    ipv4 = (samples / "sample_ipv4.regex").read_text().strip()
    sql = (samples / "sample_sql.lark").read_text()
    choices = json.loads((samples / "sample_choices.json").read_text())
    tok = smollm.get_tokenizer()

    def chat(text: str) -> dict[str, Any]:
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return {"prompt": prompt, "prompt_token_ids": tok.encode(prompt, add_special_tokens=False)}

    prompts, params = [], []
    for i, (_, schema) in enumerate(schemas):
        prompts.append(chat("Reply with a short JSON example for this schema: " + json.dumps(schema)[:300]))
        params.append(_structured(max_tokens=48, temperature=1.0, seed=i, json=schema))
    prompts += [chat("An IPv4 address:"), chat("A SQL query:"), chat("Your favourite language?")]
    params += [
        _structured(max_tokens=24, temperature=1.0, seed=10, regex=ipv4),
        _structured(max_tokens=24, temperature=1.0, seed=11, grammar=sql),
        _structured(max_tokens=8, temperature=1.0, seed=12, choice=choices),
    ]
    outs = smollm.generate(prompts, params)
    num_json_finished = 0
    for (subset, schema), out in zip(schemas, outs, strict=False):
        completion = out.outputs[0]
        assert completion.finish_reason in ("stop", "length"), (subset, completion)
        if completion.finish_reason == "stop":
            num_json_finished += 1
            jsonschema.validate(json.loads(completion.text), schema)
            assert completion.structured.valid, (subset, completion.structured)
        else:
            assert not completion.structured.valid
    # Of the 5, the two short schemas usually finish within 48 tokens at temperature 1, the others invite long
    # outputs; which ones do varies with the batch each row decodes in (the CPU numerics differ between 1-4,
    # 5-32 and more rows, and the batches with the scheduling), so only one is required: enough that the
    # checks above are not vacuous. (Budget-aware closing, issue 17, would make all of them finish.)
    assert num_json_finished >= 1
    ip, query, language = (o.outputs[0] for o in outs[len(schemas) :])
    assert ip.finish_reason == "stop" and re.fullmatch(ipv4, ip.text)
    assert query.finish_reason == "stop"
    # The grammar's own matcher is the parser: the output's tokens walk it to an accepting end.
    manager = smollm.engine.structured.manager
    grammar = manager.compile(StructuredOutputsParams(grammar=sql).to_spec()).new_grammar()
    eos = manager.tokenizer.eos_token_ids[0]
    assert grammar.accept_tokens(tok.encode(query.text, add_special_tokens=False))
    assert grammar.is_terminated() or grammar.accept_tokens([eos])
    assert re.fullmatch(r"SELECT\s*col_[12]\s*from\s*table_[12]\s*where\s*col_[12]\s*=\s*[12]", query.text)
    assert language.finish_reason == "stop" and language.text in choices
    stats = smollm.engine.stats()
    assert stats.num_grammar_errors == 0 and stats.kv_blocks_used == 0


UNIQUE = {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 3, "maxItems": 3, "uniqueItems": True}


@pytest.mark.parametrize("strict", [False, True])
def test_relaxed_schema_is_validated_and_retried(make_engine: EngineFactory, strict: bool) -> None:
    engine = make_engine()
    for i in range(6):
        spec = StructuredOutputsParams(json=UNIQUE, strict=strict)
        engine.add_request(
            f"u{i}", "Three numbers:", SamplingParams(seed=i, max_tokens=20, structured_outputs=spec)
        )
    done = run_all(engine)
    retries = 0
    for i in range(6):
        out = done[f"u{i}"].outputs[0]
        report = out.structured
        assert report is not None and report.path == "relaxed"
        retries += report.retries
        if out.finish_reason == "stop":
            valid = len(set(json.loads(out.text))) == 3
            assert report.valid is valid and report.complete
            if not valid:  # presented flagged, never as valid, and only after every allowed retry
                assert not strict and report.retries == 3 and report.error
        elif out.finish_reason == "error":
            assert strict and report.retries == 3 and not report.valid and out.error
        else:
            assert out.finish_reason == "length" and not report.valid
    assert engine.stats().num_structured_retries == retries > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_relaxed_outputs_stream_only_once_final(make_engine: EngineFactory) -> None:
    """A retry takes back what was sampled: a streaming client gets a relaxed grammar's text in one final delta,
    while an exact grammar's text streams token by token."""
    engine = make_engine()
    # At least three sampled items, so the exact output cannot arrive in a single delta.
    exact = StructuredOutputsParams(
        json={"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 3, "maxItems": 5}
    )
    for i in range(4):
        spec = StructuredOutputsParams(json=UNIQUE) if i < 3 else exact
        engine.add_request(
            f"s{i}", "Three numbers:", SamplingParams(seed=i, max_tokens=20, structured_outputs=spec)
        )
    deltas: dict[str, list[str]] = {}
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out.outputs[0].delta_text)
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert engine.stats().num_structured_retries > 0  # some output was taken back
    for i in range(3):
        *before, last = deltas[f"s{i}"]
        assert not any(before) and last == finals[f"s{i}"].text
    assert sum(1 for d in deltas["s3"] if d) > 1 and "".join(deltas["s3"]) == finals["s3"].text


def test_cli_generate_with_a_choice(capsys: pytest.CaptureFixture[str]) -> None:
    from structgen.cli import main

    code = main(
        ["generate", "--model", "tiny", "--device", "cpu", "--raw", "--prompt", "Pick:", "--choice", "yes,no"]
    )
    captured = capsys.readouterr()
    assert code == 0 and captured.out.strip() in ("yes", "no")
    assert "valid=True" in captured.err


def test_mask_fills_overlap_the_forward_only_with_a_core_to_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from structgen.engine import structured

    monkeypatch.setattr("structgen.structured.backend.usable_cpus", lambda: 4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert not structured.overlap_fills(torch.device("cpu"))  # every core runs the forward
        assert structured.overlap_fills(torch.device("cuda"))  # the forward is on the accelerator
        torch.set_num_threads(3)
        assert structured.overlap_fills(torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
