"""The labelled MaskBench instances on a fixed sample of JSONSchemaBench schemas across every subset.

Each instance is serialized compact with `ensure_ascii=False` and walked through the grammar. Per backend
(exact and rewritten schemas only): no invalid instance may be accepted; for `auto`'s choice, an invalid
instance a relaxed grammar lets through must fail validation, so nothing invalid is presented as valid.
Rates are printed (`pytest -s`); BENCHMARKS.md has them over all schemas.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from shared_data import JSONSCHEMABENCH as DATA
from structured_helpers import accepts_text

from structgen.structured import (
    StructuredOutputError,
    StructuredOutputsParams,
    compile_spec,
    normalize_schema,
)
from structgen.structured.validate import validate_json

# xgrammar and outlines-core take about a second per compile on a 100k vocabulary: they get half the sample.
PER_SUBSET = {"llguidance": 4, "xgrammar": 2, "outlines": 2, "auto": 4}


def _sample(per_subset: int) -> list[dict[str, Any]]:
    """The same spread of labelled schemas every run: evenly spaced through each subset's file."""
    rows = []
    for path in sorted(DATA.glob("*.jsonl")):
        with path.open() as f:
            labelled = [r for r in map(json.loads, f) if r["tests"]]
        stride = max(1, len(labelled) // per_subset)
        rows.extend(labelled[::stride][:per_subset])
    assert len({r["subset"] for r in rows}) == 12
    return rows


def _instances(row: dict[str, Any]) -> list[tuple[bool, str]]:
    return [
        (t["valid"], json.dumps(t["data"], separators=(",", ":"), ensure_ascii=False)) for t in row["tests"]
    ]


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines"])
def test_each_backend_rejects_every_invalid_instance(backends, encode, info, backend: str) -> None:
    b = backends[backend]
    sample = _sample(PER_SUBSET[backend])
    eos = info.eos_token_ids[0]
    counts: Counter[str] = Counter()
    for row in sample:
        normalized = normalize_schema(row["schema"])
        if normalized.schema is False or b.find_unsupported(normalized.schema):
            counts["refused"] += 1
            continue
        try:
            grammar = b.compile(StructuredOutputsParams(json=normalized.schema).to_spec())
        except StructuredOutputError:
            counts["refused"] += 1
            continue
        counts["compiled"] += 1
        for valid, text in _instances(row):
            accepted = accepts_text(grammar, encode(text), eos)
            counts[f"{'valid' if valid else 'invalid'}"] += 1
            counts[f"{'valid' if valid else 'invalid'}_accepted"] += accepted
            assert not (accepted and not valid), (
                f"{backend} accepted an invalid instance of {row['id']}: {text[:200]}"
            )
    print(
        f"\n{backend}: compiled {counts['compiled']}/{len(sample)} schemas; valid instances accepted "
        f"{counts['valid_accepted']}/{counts['valid']}; invalid accepted {counts['invalid_accepted']}/{counts['invalid']}"
    )
    assert counts["compiled"] >= len(sample) // 4
    # Property order is fixed to the schema's, so an instance written in another order can be refused.
    assert counts["valid_accepted"] >= 0.85 * counts["valid"]


def test_auto_presents_no_invalid_instance_as_valid(backends, encode, info) -> None:
    sample = _sample(PER_SUBSET["auto"])
    chain = [backends[n] for n in ("llguidance", "xgrammar", "outlines")]
    eos = info.eos_token_ids[0]
    paths: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for row in sample:
        try:
            compiled = compile_spec(
                StructuredOutputsParams(json=row["schema"]).to_spec(), chain, time_limit_s=30
            )
        except StructuredOutputError:
            paths["not served"] += 1
            continue
        paths[compiled.serving_path] += 1
        for valid, text in _instances(row):
            accepted = accepts_text(compiled.prototype, encode(text), eos)
            key = "valid" if valid else "invalid"
            counts[key] += 1
            counts[f"{key}_accepted"] += accepted
            if not valid and accepted:
                assert compiled.needs_validation, (
                    f"{compiled.backend} silently accepted invalid {row['id']}: {text[:200]}"
                )
                assert not validate_json(text, row["schema"]).valid, (
                    f"invalid {row['id']} would be presented as valid"
                )
    print(f"\nauto: {dict(paths)}; instances {dict(counts)}")
    assert paths["not served"] <= len(sample) // 20
    assert counts["valid_accepted"] >= 0.9 * counts["valid"]


def test_normalization_keeps_every_verdict() -> None:
    """On real schemas the normalized (2020-12) schema judges each labelled instance as the original does."""
    import jsonschema

    from structgen.structured.validate import FORMAT_CHECKER, validate_instance

    checked = 0
    for row in _sample(40):
        normalized = normalize_schema(row["schema"])
        if not normalized.changes or normalized.schema is False:
            continue
        validator = jsonschema.Draft202012Validator(normalized.schema, format_checker=FORMAT_CHECKER)
        for test in row["tests"]:
            original = validate_instance(test["data"], row["schema"]).valid
            assert validator.is_valid(test["data"]) == original, (row["id"], test["data"])
            checked += 1
    assert checked > 200
