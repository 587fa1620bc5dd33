"""The `StructuredReport` a structured sequence's outputs carry (`structgen.engine.structured_report`; named apart from
tests/server/test_structured_report.py, which pytest would otherwise import as the same module)."""

from __future__ import annotations

import itertools

from engine_helpers import EngineFactory, wait_for_grammars

from structgen.sampling_params import SamplingParams
from structgen.structured import StructuredOutputsParams


def test_a_streamed_request_gets_a_new_report_only_when_it_changes(make_engine: EngineFactory) -> None:
    engine = make_engine()
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "maxItems": 3}},
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    engine.add_request(
        "s",
        "Record:",
        SamplingParams(
            temperature=0.0, seed=1, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)
        ),
        stream=True,
    )
    wait_for_grammars(engine)
    reports = []
    while engine.has_unfinished():
        reports += [o.outputs[0].structured for o in engine.step() if o.request_id == "s"]
    assert len(reports) > 3 and all(r is not None for r in reports)
    final = reports[-1]
    assert final.valid is True and final.complete and final.forced_tokens > 0
    assert all(r.valid is None and not r.complete for r in reports[:-1])
    for before, after in itertools.pairwise(reports):
        if after is not final and after.forced_tokens == before.forced_tokens:
            assert after is before  # nothing in it changed: the same object
        else:
            assert after is not before and after.forced_tokens >= before.forced_tokens
    assert len({id(r) for r in reports}) < len(reports)
