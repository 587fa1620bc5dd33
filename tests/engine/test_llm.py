"""The offline `LLM` API: prompt forms, order of results, per-prompt params, chat, the progress bar."""

from __future__ import annotations

import pytest

from structgen import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", device="cpu", kv_cache_tokens=4096, max_num_seqs=8)


def test_generate_forms_and_order(llm: LLM) -> None:
    prompts = ["The capital of France is", "1, 2, 3,", "Hello"]
    outs = llm.generate(prompts, GREEDY)
    assert [o.prompt for o in outs] == prompts
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    tokenizer = llm.get_tokenizer()
    for out in outs:
        assert out.prompt_token_ids == tokenizer.encode(out.prompt)
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids)
    # The same prompts alone, as token ids, and as a single string give the same tokens.
    alone = llm.generate(prompts[1], GREEDY)[0]
    by_ids = llm.generate({"prompt_token_ids": outs[1].prompt_token_ids}, GREEDY)[0]
    assert alone.outputs[0].token_ids == by_ids.outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert by_ids.prompt is None


def test_per_prompt_params(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 7, 4)]
    outs = llm.generate(["a", "b", "c"], params, use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 7, 4]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], params[:2])


def test_rejected_prompt_leaves_nothing_behind(llm: LLM) -> None:
    with pytest.raises(ValueError, match="model context"):
        llm.generate(["fine", "too long"], [GREEDY, SamplingParams(max_tokens=10**6)])
    assert not llm.engine.has_unfinished()


def test_chat(llm: LLM) -> None:
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    single = llm.chat(conversation, GREEDY)
    batch = llm.chat([conversation, [{"role": "user", "content": "Bye"}]], GREEDY)
    assert len(single) == 1 and len(batch) == 2
    assert single[0].prompt is not None and "<|im_start|>assistant" in single[0].prompt
    assert single[0].outputs[0].token_ids == batch[0].outputs[0].token_ids


def test_waiting_for_a_grammar_does_not_spin(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """While every request waits for its grammar the loop blocks on the compile instead of stepping: a spinning
    loop takes the CPU the compile needs (on 2 cores, with the compile thread niced)."""
    import time

    from structgen.structured import StructuredOutputsParams

    engine = llm.engine
    # The first grammar of an engine also builds its backends' vocabulary tables (seconds for tiny's 100k tokens,
    # unless another engine of the process built them): done here, so the compile below takes its 0.5 s.
    llm.generate(
        "n", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    )
    manager = engine.structured.ensure_manager()
    slow = manager._compile  # the one place where a compile can be made slow

    def compile_slowly(*args: object, **kwargs: object) -> object:
        time.sleep(0.5)
        return slow(*args, **kwargs)

    monkeypatch.setattr(manager, "_compile", compile_slowly)
    steps = 0
    step = engine.step

    def counted() -> list:
        nonlocal steps
        steps += 1
        return step()

    monkeypatch.setattr(engine, "step", counted)
    spec = StructuredOutputsParams(regex=r"[0-9]{3}x" + str(time.time_ns()))  # never seen: compiled now
    out = llm.generate("n", SamplingParams(max_tokens=4, structured_outputs=spec))[0]
    assert out.outputs[0].finish_reason in ("stop", "length")
    assert steps < 40  # 0.5 s of compile: a few waits of 50 ms, then the decode steps


def test_an_offline_llm_commits_its_cpu_kv_cache_as_it_fills(llm: LLM) -> None:
    # A script's LLM() should not spend a second committing a GiB it fills a few blocks of (`CacheConfig`);
    # the server commits at start (its engine config's default).
    from structgen.config import CacheConfig

    assert llm.engine.config.cache.commit_cpu_kv_at_start is False
    assert CacheConfig().commit_cpu_kv_at_start is True


def test_an_offline_llm_packs_its_cpu_weights_at_their_first_product(llm: LLM) -> None:
    # Where the AVX2 GEMV takes a script's batches, the reorder (~0.5 s for SmolLM2) is never needed.
    from structgen.config import EngineConfig

    assert llm.engine.config.pack_cpu_weights_at_start is False
    assert EngineConfig().pack_cpu_weights_at_start is True
