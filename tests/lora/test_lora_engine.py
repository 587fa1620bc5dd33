"""Adapters served by the engine: each request's greedy output is transformers + peft's with its adapter merged,
whatever else shares the batch (other adapters, the base model), under chunked prefill, preemption, prefix-cache
hits, slot eviction and speculation."""

from __future__ import annotations

from typing import Any

import pytest
from lora_helpers import MAX_TOKENS, PROMPTS, Adapters, make_lora_engine

from structgen.engine.llm_engine import LLMEngine
from structgen.lora import LoRAError, LoRARequest
from structgen.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run(engine: LLMEngine, requests: dict[str, tuple[int, LoRARequest | None]]) -> dict[str, list[int]]:
    """Add every request at once, step until all finish; {request id: output tokens}."""
    for request_id, (prompt, lora) in requests.items():
        engine.add_request(request_id, PROMPTS[prompt], GREEDY, lora_request=lora)
    outputs: dict[str, list[int]] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outputs


def mixed(adapters: Adapters) -> dict[str, tuple[int, LoRARequest | None]]:
    """Every prompt on the base model and on each adapter, interleaved so each step mixes all three."""
    requests: dict[str, tuple[int, LoRARequest | None]] = {}
    for i in range(len(PROMPTS)):
        requests[f"base-{i}"] = (i, None)
        for name in adapters.paths:
            requests[f"{name}-{i}"] = (i, adapters.request(name))
    return requests


def check(adapters: Adapters, outputs: dict[str, list[int]]) -> None:
    for request_id, tokens in outputs.items():
        name, i = request_id.rsplit("-", 1)
        expected = adapters.references[None if name == "base" else name][int(i)]
        assert tokens == expected, request_id


def test_adapters_change_the_output(adapters: Adapters) -> None:
    refs = adapters.references
    for name in adapters.paths:
        assert refs[name] != refs[None], f"adapter {name} must change the random model's greedy picks"


SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "preempts": {"kv_cache_tokens": 80},
    "one-slot-evicts": {"max_loras": 1},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_mixed_batch_equals_merged_references(tiny_model: Any, adapters: Adapters, setting: str) -> None:
    engine = make_lora_engine(tiny_model, **SETTINGS[setting])
    outputs = run(engine, mixed(adapters))
    assert len(outputs) == 3 * len(PROMPTS)
    check(adapters, outputs)
    manager = engine.lora
    assert manager is not None
    if setting == "preempts":
        assert engine.stats().num_preemptions > 0
    if setting == "one-slot-evicts":
        # One slot for two adapters: they take turns, each swapped back in after the other ran.
        assert manager.num_evictions >= 1 and manager.num_slot_loads >= 2
    else:
        assert manager.num_evictions == 0


def test_prefix_cache_is_kept_apart_per_adapter(tiny_model: Any, adapters: Adapters) -> None:
    engine = make_lora_engine(tiny_model)
    bm = engine.block_manager
    qv8, mlp16 = adapters.request("qv8"), adapters.request("mlp16")
    # Prompts 2 and 3 share two full blocks. The same adapter hits them, another adapter and the base do not.
    run(engine, {"qv8-2": (2, qv8)})
    hits = bm.num_hit_tokens
    outputs = run(engine, {"mlp16-3": (3, mlp16), "base-3": (3, None)})
    assert bm.num_hit_tokens == hits, "blocks computed under one adapter served to another or to the base"
    outputs |= run(engine, {"qv8-3": (3, qv8)})
    assert bm.num_hit_tokens == hits + 32
    check(adapters, outputs)


def test_adapter_reloaded_under_the_same_name_shares_no_blocks(tiny_model: Any, adapters: Adapters) -> None:
    engine = make_lora_engine(tiny_model)
    manager = engine.lora
    assert manager is not None
    run(engine, {"qv8-2": (2, LoRARequest("x", 1, str(adapters.paths["qv8"])))})
    manager.remove("x")
    hits = engine.block_manager.num_hit_tokens
    # Another adapter under the old name: the old name's cached blocks must not come back.
    outputs = run(engine, {"mlp16-3": (3, LoRARequest("x", 1, str(adapters.paths["mlp16"])))})
    assert engine.block_manager.num_hit_tokens == hits
    check(adapters, outputs)


def test_unload_while_running_finishes_the_request(tiny_model: Any, adapters: Adapters) -> None:
    engine = make_lora_engine(tiny_model)
    manager = engine.lora
    assert manager is not None
    engine.add_request("qv8-0", PROMPTS[0], GREEDY, lora_request=adapters.request("qv8"))
    engine.step()
    manager.remove("qv8")
    outputs = run(engine, {"base-1": (1, None)})
    while engine.has_unfinished():
        outputs |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    check(adapters, outputs)
    with pytest.raises(LoRAError, match="no LoRA adapter named 'qv8'") as error:
        engine.add_request("again", PROMPTS[0], GREEDY, lora_request=LoRARequest("qv8", 1))
    assert error.value.status == 404
    assert [s.name for s in manager.registered()] == []


def test_scheduler_runs_no_more_adapters_than_slots(tiny_model: Any, adapters: Adapters) -> None:
    engine = make_lora_engine(tiny_model, max_loras=1)
    seen: list[set[str]] = []
    for name in adapters.paths:
        for i in range(2):
            engine.add_request(f"{name}-{i}", PROMPTS[i], GREEDY, lora_request=adapters.request(name))
    engine.add_request("base-0", PROMPTS[0], GREEDY)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        seen.append({s.lora.name for s in engine.scheduler.running if s.lora is not None})
    assert max(len(s) for s in seen) == 1
    assert {"qv8", "mlp16"} <= set().union(*seen)
    check(adapters, outputs)


def test_speculation_keeps_adapter_outputs(tiny_model: Any, adapters: Adapters) -> None:
    model, tokenizer, model_dir = tiny_model
    from structgen.config import CacheConfig, EngineConfig, LoRAConfig

    config = EngineConfig(
        model="tiny",
        device="cpu",
        cache=CacheConfig(kv_cache_tokens=4096),
        lora=LoRAConfig(),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    engine = LLMEngine(config, model=model, tokenizer=tokenizer, model_dir=model_dir)
    requests = {f"qv8-{i}": (i, adapters.request("qv8")) for i in range(len(PROMPTS))}
    check(adapters, run(engine, requests))


def test_requests_name_adapters_only_when_enabled(tiny_model: Any, adapters: Adapters) -> None:
    model, tokenizer, model_dir = tiny_model
    from structgen.config import CacheConfig, EngineConfig

    engine = LLMEngine(
        EngineConfig(model="tiny", device="cpu", cache=CacheConfig(kv_cache_tokens=1024)),
        model=model,
        tokenizer=tokenizer,
        model_dir=model_dir,
    )
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        engine.add_request("r", PROMPTS[0], GREEDY, lora_request=adapters.request("qv8"))
    assert not engine.has_unfinished()


def test_bad_adapter_fails_the_request_alone(tiny_model: Any, adapters: Adapters, tmp_path: Any) -> None:
    engine = make_lora_engine(tiny_model, max_lora_rank=8)
    with pytest.raises(LoRAError, match="rank 16, above max_lora_rank 8"):
        engine.add_request("r", PROMPTS[0], GREEDY, lora_request=adapters.request("mlp16"))
    with pytest.raises(LoRAError, match="no LoRA adapter directory") as missing:
        engine.add_request("r", PROMPTS[0], GREEDY, lora_request=LoRARequest("m", 1, str(tmp_path / "nope")))
    assert missing.value.status == 404
    check(adapters, run(engine, {"qv8-0": (0, adapters.request("qv8")), "base-0": (0, None)}))


def test_tensor_parallel_is_refused_with_lora() -> None:
    from structgen.config import EngineConfig, LoRAConfig

    with pytest.raises(ValueError, match="LoRA adapters are not served with tensor_parallel_size > 1"):
        EngineConfig(model="tiny", tensor_parallel_size=2, lora=LoRAConfig())
    with pytest.raises(ValueError, match="max_cpu_loras \\(2\\) must be >= max_loras \\(4\\)"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)


def test_stats_name_the_adapters_of_running_and_waiting_requests(tiny_model: Any, adapters: Adapters) -> None:
    engine = make_lora_engine(tiny_model, max_loras=1)
    engine.add_request("qv8-0", PROMPTS[0], GREEDY, lora_request=adapters.request("qv8"))
    engine.add_request("mlp16-0", PROMPTS[0], GREEDY, lora_request=adapters.request("mlp16"))
    engine.step()  # one slot: qv8 runs, mlp16 waits for it
    stats = engine.stats()
    assert (stats.lora_running, stats.lora_waiting) == (("qv8",), ("mlp16",))
    assert (stats.max_loras, stats.num_loras_registered, stats.num_lora_slot_loads) == (1, 2, 1)
    run(engine, {})
    stats = engine.stats()
    assert stats.lora_running == stats.lora_waiting == () and stats.num_lora_evictions == 1
