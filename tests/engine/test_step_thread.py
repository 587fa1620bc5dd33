"""An offline `LLM` builds and steps its engine on a thread of its own (`structgen.engine.step_thread`): every
step runs there whichever thread calls, callers on several threads take turns, Ctrl-C in the caller aborts its
requests and leaves the LLM usable, and the thread ends with its LLM."""

from __future__ import annotations

import gc
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from structgen import LLM, SamplingParams
from structgen.engine.step_thread import StepThread

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The capital of France is", "1, 2, 3,", "Hello", "def main():"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", device="cpu", kv_cache_tokens=4096, max_num_seqs=8)


def _step_threads(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Records the name of each thread that steps `llm`'s engine, from now on."""
    names: set[str] = set()
    step = llm.engine.step

    def recorded() -> Any:
        names.add(threading.current_thread().name)
        return step()

    monkeypatch.setattr(llm.engine, "step", recorded)
    return names


def test_every_step_runs_on_the_llms_thread_whoever_calls(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    names = _step_threads(llm, monkeypatch)
    here = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    with ThreadPoolExecutor(1) as pool:
        there = [o.outputs[0].token_ids for o in pool.submit(llm.generate, PROMPTS, GREEDY).result()]
    assert here == there
    assert len(names) == 1 and next(iter(names)).startswith("structgen-llm")


def test_callers_on_several_threads_take_turns(llm: LLM) -> None:
    expected = [llm.generate(prompt, GREEDY)[0].outputs[0].token_ids for prompt in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(llm.generate, prompt, GREEDY) for prompt in PROMPTS]
        got = [future.result()[0].outputs[0].token_ids for future in futures]
    assert got == expected
    assert not llm.engine.has_unfinished()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
def test_ctrl_c_in_the_caller_aborts_its_requests(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    stepping = threading.Event()
    step = llm.engine.step
    steps = 0

    def noted() -> Any:
        nonlocal steps
        steps += 1
        stepping.set()
        time.sleep(0.01)  # so that the interrupt arrives mid-request
        return step()

    monkeypatch.setattr(llm.engine, "step", noted)
    main = threading.main_thread().ident
    assert main is not None

    def interrupt() -> None:
        stepping.wait(30)
        signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C, delivered to the thread waiting in generate

    timer = threading.Thread(target=interrupt)
    timer.start()
    long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, long)
    timer.join()
    assert steps < 1000  # aborted: the 2,000 tokens each were not all generated
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not llm._steps.cancelled.is_set()
    assert llm.generate("Hello", GREEDY)[0].outputs[0].token_ids  # still usable


def test_the_thread_ends_with_its_llm() -> None:
    def llm_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("structgen-llm")]

    before = set(llm_threads())
    llm = LLM("tiny", device="cpu", kv_cache_tokens=256)
    llm.generate("Hello", GREEDY)
    assert set(llm_threads()) - before
    del llm
    gc.collect()
    deadline = time.monotonic() + 10
    while set(llm_threads()) - before:
        assert time.monotonic() < deadline, "the step thread outlived its LLM"
        time.sleep(0.01)


def test_a_call_on_the_thread_itself_runs_in_place() -> None:
    steps = StepThread()
    try:
        inner = steps.call(lambda: steps.call(threading.get_ident))
        assert inner == steps.call(threading.get_ident) != threading.get_ident()
        with pytest.raises(ValueError, match="bad"):
            steps.call(int, "bad")
    finally:
        steps.shutdown()
