"""Narrow logits: rows whose structured mask allows few tokens get logits for those tokens alone (-inf elsewhere),
equal to the lm_head's full product there; the engine takes that path on the CPU and its outputs stay valid
(greedy ones the same as with every row computed whole); the batched pick among allowed tokens is the row-by-row
one."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch
from engine_helpers import EngineFactory, run_all

from structgen.engine import narrow_logits as narrow_module
from structgen.engine.fast_picks import pick_among, pick_among_rows
from structgen.engine.narrow_logits import narrow_logits, supports_narrow_logits
from structgen.models.cpu_linear import PackedLinear
from structgen.models.linear import ParallelLMHead
from structgen.sampling_params import SamplingParams
from structgen.structured import StructuredOutputsParams

TASKS = {
    "type": "object",
    "properties": {
        "tasks": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "status": {"enum": ["todo", "in_progress", "blocked", "done"]},
                    "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                    "ok": {"type": "boolean"},
                },
                "required": ["status", "priority", "ok"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        }
    },
    "required": ["tasks"],
    "additionalProperties": False,
}


def _head(dtype: torch.dtype, *, packed: bool, vocab: int = 5000, hidden: int = 64) -> ParallelLMHead:
    head = ParallelLMHead(vocab, hidden, tp_rank=0, tp_size=1)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(1)) * 0.1)
    head = head.to(dtype)
    if packed:
        head.kernel = PackedLinear.from_weight(head.weight.data)
    return head


@pytest.mark.parametrize(
    ("dtype", "packed"), [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)]
)
def test_narrow_rows_hold_the_full_products_of_their_allowed_tokens(dtype: torch.dtype, packed: bool) -> None:
    head = _head(dtype, packed=packed)
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    narrow = {
        1: torch.tensor([0, 17, 4999]),
        3: torch.tensor([17]),
        4: torch.arange(100, 900, 3),
    }
    full = head.compute_logits(hidden).float()
    out = narrow_logits(head, hidden, narrow)
    assert out.shape == full.shape and out.dtype == torch.float32
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    for row in range(6):
        if row not in narrow:
            torch.testing.assert_close(out[row], full[row], **tolerance)
            continue
        ids = narrow[row]
        torch.testing.assert_close(out[row, ids], full[row, ids], **tolerance)
        rest = torch.ones(out.shape[1], dtype=torch.bool)
        rest[ids] = False
        assert torch.isneginf(out[row, rest]).all()


def test_bad_rows_are_refused() -> None:
    head = _head(torch.float32, packed=False)
    with pytest.raises(ValueError, match="narrow rows"):
        narrow_logits(head, torch.randn(2, 64), {5: torch.tensor([1])})


def test_only_a_one_rank_cpu_head_supports_it() -> None:
    assert supports_narrow_logits(_head(torch.float32, packed=False))
    assert not supports_narrow_logits(None)
    sharded = ParallelLMHead(5000, 64, tp_rank=0, tp_size=2)
    assert not supports_narrow_logits(sharded)


def test_batched_pick_among_allowed_equals_row_by_row() -> None:
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randn(k, generator=gen) * 3 for k in (1, 5, 40, 7, 2, 3)]
    rows[3][:] = float("-inf")  # nothing possible
    rows[4][1] = rows[4][0]  # a tie: the first one
    uniforms = torch.rand(len(rows), dtype=torch.float64, generator=gen)
    uniforms[[1, 4]] = float("nan")  # greedy rows
    values = torch.full((len(rows), 40), float("-inf"))
    for j, row in enumerate(rows):
        values[j, : len(row)] = row
    index, possible = pick_among_rows(values, uniforms)
    for j, row in enumerate(rows):
        greedy = bool(torch.isnan(uniforms[j]))
        expected, ok = pick_among(row, uniform=None if greedy else uniforms[j])
        assert bool(possible[j]) == ok
        if ok:
            assert int(index[j]) == expected
    all_greedy, _ = pick_among_rows(values, None)
    assert all_greedy.tolist()[:3] == [int(r.argmax()) for r in rows[:3]]


def _run(make_engine: EngineFactory, *, narrow: bool, temperature: float) -> dict[str, Any]:
    engine = make_engine(max_num_seqs=8)
    if not narrow:
        engine.runner.narrow_limit = 0
    for i in range(8):
        params = SamplingParams(
            temperature=temperature,
            seed=i,
            max_tokens=120,
            structured_outputs=StructuredOutputsParams(json=TASKS),
        )
        engine.add_request(f"r{i}", f"Tasks {i}:", params)
    return run_all(engine)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_outputs_with_narrow_logits(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, temperature: float
) -> None:
    calls: list[int] = []
    real = narrow_module.narrow_logits

    def counting(lm_head: Any, hidden: torch.Tensor, narrow: dict[int, torch.Tensor]) -> torch.Tensor:
        calls.append(len(narrow))
        return real(lm_head, hidden, narrow)

    monkeypatch.setattr("structgen.engine.model_runner.narrow_logits", counting)
    outputs = _run(make_engine, narrow=True, temperature=temperature)
    assert sum(calls) > 20  # enum starts, digits, booleans and separators were computed narrow
    for out in outputs.values():
        first = out.outputs[0]
        if first.finish_reason == "stop":
            jsonschema.validate(json.loads(first.text), TASKS)
    if temperature == 0.0:  # the same greedy picks as with every row's logits whole
        calls.clear()
        whole = _run(make_engine, narrow=False, temperature=temperature)
        assert not calls
        assert {k: v.outputs[0].token_ids for k, v in outputs.items()} == {
            k: v.outputs[0].token_ids for k, v in whole.items()
        }


def test_rows_that_return_logprobs_stay_whole(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their logprobs describe the whole distribution (as without a mask on the lm_head): never narrowed."""
    calls: list[int] = []
    real = narrow_module.narrow_logits
    monkeypatch.setattr(
        "structgen.engine.model_runner.narrow_logits",
        lambda lm_head, hidden, narrow: calls.append(len(narrow)) or real(lm_head, hidden, narrow),
    )
    engine = make_engine(max_num_seqs=4)
    for i in range(4):
        params = SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=60,
            logprobs=2,
            structured_outputs=StructuredOutputsParams(json=TASKS),
        )
        engine.add_request(f"r{i}", f"Tasks {i}:", params)
    outputs = run_all(engine)
    assert not calls
    assert all(out.outputs[0].logprobs for out in outputs.values())
