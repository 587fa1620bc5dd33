"""The manager: compile futures, the LRU cache, the compile time limit, and batched mask fills on worker
threads that equal row-by-row fills."""

from __future__ import annotations

import json
import time

import pytest
import torch
from shared_data import VLLM_SAMPLES as SAMPLES

from structgen.structured import (
    CompileTimeoutError,
    StructuredOutputConfig,
    StructuredOutputManager,
    StructuredOutputsParams,
    UnsupportedSchemaError,
    apply_token_bitmask_,
)


def _spec(i: int):
    return StructuredOutputsParams(
        json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
    ).to_spec()


@pytest.fixture()
def manager(info, backends):
    m = StructuredOutputManager(
        info, StructuredOutputConfig(cache_size=3), backends={"llguidance": backends["llguidance"]}
    )
    yield m
    m.shutdown()


def test_futures_cache_hits_and_lru(manager) -> None:
    first = manager.submit(_spec(0))
    again = manager.submit(_spec(0))
    assert again is first  # an in-flight compile is shared
    compiled = first.result(timeout=60)
    assert compiled.backend == "llguidance" and compiled.serving_path == "exact"
    hit = manager.submit(_spec(0))
    assert hit.done() and hit.result() is compiled
    assert manager.stats.hits == 2 and manager.stats.misses == 1 and manager.stats.compiles == 1
    for i in (1, 2, 3):
        manager.compile(_spec(i))
    assert manager.cache_len() == 3
    assert manager.submit(_spec(0)) is not first  # evicted (least recently used)
    # Each request gets its own grammar state.
    a, b = compiled.new_grammar(), compiled.new_grammar()
    assert a is not b and a.accept_tokens([90])  # "{"
    assert b.validate_tokens([90]) == 1


def test_errors_reach_the_future_and_are_cached(manager) -> None:
    spec = StructuredOutputsParams(json={"type": "string", "pattern": "(?<a>x)\\k<a>"}).to_spec()
    with pytest.raises(UnsupportedSchemaError, match="pattern"):
        manager.compile(spec)
    assert manager.submit(spec).done()  # not compiled again


def test_compile_time_limit_fails_the_request_clearly(info, backends) -> None:
    config = StructuredOutputConfig(backend="outlines", compile_timeout_s=0.05)
    manager = StructuredOutputManager(info, config, backends={"outlines": backends["outlines"]})
    try:
        schema = json.loads((SAMPLES / "sample_json_schema.v1.json").read_text())
        future = manager.submit(StructuredOutputsParams(json=schema).to_spec())
        with pytest.raises(CompileTimeoutError, match=r"exceeded the 0\.05 s limit"):
            future.result(timeout=60)
        assert manager.stats.timeouts == 1
    finally:
        manager.shutdown()


def test_batched_fill_equals_row_by_row(info, backends, encode) -> None:
    manager = StructuredOutputManager(
        info, backends={n: backends[n] for n in ("llguidance", "xgrammar", "outlines")}
    )
    try:
        specs = [
            ("llguidance", StructuredOutputsParams(json={"type": "object"}).to_spec(), '{"a":'),
            ("llguidance", StructuredOutputsParams(regex=r"[a-z]+@[a-z]+\.com").to_spec(), "bob@"),
            ("xgrammar", StructuredOutputsParams(choice=["red", "green", "blue"]).to_spec(), "g"),
            (
                "xgrammar",
                StructuredOutputsParams(json={"type": "array", "items": {"type": "number"}}).to_spec(),
                "[1,",
            ),
            ("outlines", StructuredOutputsParams(regex=r"(ab|cd)[0-9]{2,3}").to_spec(), "ab1"),
        ]
        grammars = []
        for name, spec, prefix in specs:
            prototype = backends[name].compile(spec)
            ids = encode(prefix)
            for k in range(4):  # 20 rows, in different states
                g = prototype.clone()
                assert g.accept_tokens(ids[: k % (len(ids) + 1)])
                grammars.append(g)
        rows = list(range(1, 2 * len(grammars), 2))  # every other row: the rest are unconstrained
        batched = manager.allocate_bitmask(2 * len(grammars) + 1)
        items = list(zip(grammars, rows, strict=True))
        assert manager.on_mask_thread(manager.fill_bitmask, items, batched).result(timeout=60) == []
        single = manager.allocate_bitmask(2 * len(grammars) + 1)
        for g, row in zip(grammars, rows, strict=True):
            g.fill_bitmask(single, row)
        assert torch.equal(batched, single)
        assert (batched[0] == -1).all() and (batched[2] == -1).all()  # untouched rows stay all-allowed

        logits = torch.randn(batched.shape[0], info.vocab_size)
        masked = logits.clone()
        apply_token_bitmask_(masked, batched, rows=rows)
        unconstrained = [r for r in range(batched.shape[0]) if r not in rows]
        assert torch.equal(masked[unconstrained], logits[unconstrained])
        assert torch.isinf(masked[rows]).all(dim=1).logical_not().all()  # each constrained row keeps a token
    finally:
        manager.shutdown()


def test_submit_does_not_block(info, backends) -> None:
    manager = StructuredOutputManager(
        info, StructuredOutputConfig(backend="outlines"), backends={"outlines": backends["outlines"]}
    )
    try:
        start = time.perf_counter()
        future = manager.submit(StructuredOutputsParams(regex=r"[a-z]{1,8}@example\.com").to_spec())
        assert time.perf_counter() - start < 0.05 and not future.done()
        assert future.result(timeout=60).backend == "outlines"
    finally:
        manager.shutdown()


def test_bad_config_is_named() -> None:
    with pytest.raises(ValueError, match="structured backend must be"):
        StructuredOutputConfig(backend="guidance")
    with pytest.raises(ValueError, match="compile_timeout_s"):
        StructuredOutputConfig(compile_timeout_s=0)
