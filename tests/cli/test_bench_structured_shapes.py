"""`structgen bench structured --parts s`: the shapes are the closed schemas the issue asks for, the phase timer
counts exclusive time and puts every function back, and small runs on `tiny` (in process with the breakdown,
and through HTTP) report every field. The numbers themselves mean nothing at these sizes."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from structgen.bench import structured_http
from structgen.bench import structured_phases as phases
from structgen.bench.structured_engine import SHAPE_NAMES
from structgen.bench.structured_shape_schemas import SHAPES, validator
from structgen.bench.structured_shapes import Tally, make_sides, settle_steps
from structgen.cli import main

RATES = ("unconstrained_tok_s", "constrained_sampled_tok_s", "ratio_sampled", "constrained_total_tok_s")


def _objects(schema: Any) -> list[dict[str, Any]]:
    found = []
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            found.append(schema)
        for value in schema.values():
            found += _objects(value)
    elif isinstance(schema, list):
        for value in schema:
            found += _objects(value)
    return found


def test_shapes_are_closed_schemas_named_in_the_cli() -> None:
    assert tuple(SHAPES) == SHAPE_NAMES
    for name, schema in SHAPES.items():
        jsonschema.validators.validator_for(schema).check_schema(schema)
        if name != "in_string":  # part (a)'s schema, kept as it is
            for obj in _objects(schema):
                assert obj["additionalProperties"] is False and obj["required"], (name, obj)
    assert SHAPES["items"]["properties"]["items"]["minItems"] == 40


def test_tally_counts_only_complete_outputs_as_valid_or_not() -> None:
    tally, check = Tally(), validator(SHAPES["nested"])
    good = {
        "name": "A",
        "age": 3,
        "address": {"street": "s", "city": "c", "zip": "12345"},
        "contact": {"email": "a@b.io", "phone": "1234567"},
    }
    tally.count(json.dumps(good), "stop", check)
    tally.count(json.dumps({**good, "age": 500}), "stop", check)
    tally.count('{"name": "A', "length", check)
    tally.count("not json", "stop", check)
    assert (tally.finished, tally.stop, tally.length, tally.valid, tally.invalid) == (4, 3, 1, 1, 2)


class _Recorder:
    """An engine that only records the requests it is given."""

    def __init__(self) -> None:
        self.budgets: list[int] = []

    def add_request(self, request_id: str, prompt: str, params: Any) -> None:
        self.budgets.append(params.max_tokens)


def test_both_first_waves_are_staggered_and_counted_once_ended() -> None:
    """Settling (the default): both sides' first waves end one request every 8 steps, and the window opens
    after the budget's steps, when every first-wave request has ended and the replacements started at every
    age. Without it (the measure before session 27) only the unconstrained side is staggered, 5 steps in."""
    for settle, json_budgets in ((True, [8 * (i + 1) for i in range(32)]), (False, [256] * 32)):
        engines = (_Recorder(), _Recorder())
        sides = make_sides(engines, "items", concurrency=32, max_tokens=256, tag="t", settle=settle)  # type: ignore[arg-type]
        for _ in range(34):
            for side in sides:
                side.add()
        assert engines[0].budgets == [8 * (i + 1) for i in range(32)] + [256, 256]
        assert engines[1].budgets == [*json_budgets, 256, 256]
        assert settle_steps(256, settle=settle) == (5 + 256 if settle else 5)
        assert settle_steps(256, settle=settle) > max(engines[1].budgets[:32]) or not settle


class _Clock:
    """A fake `time` for the phase timer: the wrapped methods below advance it by whole seconds."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


class _Leaf:
    def inner(self) -> None:
        _Clock.now += 2


class _Root:
    def outer(self, leaf: _Leaf) -> None:
        _Clock.now += 1
        leaf.inner()
        leaf.inner()


def test_phase_timer_reports_exclusive_time_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    targets = (("outer", f"{__name__}:_Root.outer"), ("inner", f"{__name__}:_Leaf.inner"))
    targets += (("gone", f"{__name__}:_Root.renamed"),)
    monkeypatch.setattr(phases, "TARGETS", targets)
    monkeypatch.setattr(phases, "time", _Clock)
    original = _Root.outer
    timer = phases.PhaseTimer()
    with timer.installed([]):
        assert _Root.outer is not original
        _Root().outer(_Leaf())
    assert _Root.outer is original and "inner" in vars(_Leaf)
    assert timer.current.seconds == {"outer": 1.0, "inner": 4.0}  # outer without inner's time
    assert timer.missing == [f"{__name__}:_Root.renamed"]


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "s.json"
    common = ["--model", "tiny", "--parts", "s", "--concurrency", "4", "--max-tokens", "16"]
    assert main(["bench", "structured", *common, *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())["s_shapes"]


def _check_rates(row: dict[str, Any]) -> None:
    for key in (*RATES, "ratio_total"):
        assert isinstance(row[key], float) and row[key] > 0, (key, row)
    assert 0 < row["forced_share"] < 1  # every shape starts with a forced `{"`
    c = row["constrained"]
    assert c["finished"] > 0 and c["finished"] == c["stop"] + c["length"] + c["errors"]
    assert c["valid"] + c["invalid"] == c["stop"] and c["forced"] > 0


def test_in_process_with_breakdown_on_tiny(tmp_path: Path) -> None:
    report = _run(tmp_path, "--shapes", "enums,in_string", "--steps", "12", "--breakdown")
    assert (report["concurrency"], report["max_tokens"], report["steps"]) == (4, 16, 12)
    assert set(report["in_process"]) == {"enums", "in_string"} and "http" not in report
    for row in report["in_process"].values():
        _check_rates(row)
        assert row["unconstrained"]["steps"] == row["constrained"]["steps"] == 12
        assert "breakdown_missing" not in row  # a renamed engine function: update structured_phases.TARGETS
        table = row["breakdown_ms_per_step"]
        for side in ("unconstrained", "json"):
            assert table[side]["forward"] > 0 and table[side]["step"] > 0
            named = sum(v for k, v in table[side].items() if k != "step")
            assert named == pytest.approx(table[side]["step"], abs=0.01)  # exclusive phases add up
        assert table["json"]["accept"] > 0 and table["unconstrained"]["accept"] == 0
        assert row["breakdown_split"] == phases.model_work_split(table["unconstrained"], table["json"])


def test_model_work_split_separates_the_forward_from_the_structured_work() -> None:
    plain = {"forward": 60.0, "logits": 15.0, "pick": 5.0, "step": 80.0}
    # Forced runs add 30 ms of forward, narrow rows save 5 of lm_head, the structured phases add 3.
    json = {"forward": 90.0, "logits": 10.0, "pick": 4.0, "accept": 2.0, "mask wait": 2.0, "step": 108.0}
    split = phases.model_work_split(plain, json)
    assert split == {"model_ms": 25.0, "rest_ms": 3.0, "ratio_forward_equal": round(80 / 78, 3)}
    line = phases.format_table({"unconstrained": plain, "json": json}).splitlines()[-1]
    assert "+25.000" in line and "+3.000" in line and "1.026" in line
    assert "model" not in phases.format_table({"unconstrained": plain})  # one side: no split


def test_through_http_on_tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built_on: list[str] = []
    make_engine = structured_http.make_engine

    def spy(*args: Any, **kwargs: Any) -> Any:
        built_on.append(threading.current_thread().name)
        return make_engine(*args, **kwargs)

    monkeypatch.setattr(structured_http, "make_engine", spy)
    args = ("--shapes", "nested", "--steps", "0", "--http", "--http-steps", "40", "--passes", "2")
    report = _run(tmp_path, *args)
    # Built on the thread that steps it, as the server does (one OpenMP team: see `run_http`).
    assert built_on == ["structgen-engine"]
    assert report["http_steps"] == 40 and report["http_passes"] == 2 and "in_process" not in report
    row = report["http"]["nested"]
    _check_rates(row)
    # Each side's two windows of 40 steps, counted between step boundaries off the engine's own counters.
    assert row["unconstrained"]["steps"] == row["constrained"]["steps"] == 80
    # Each side's windows in order, and the ratio of their medians (two windows: the mean of the two).
    plain, constrained = row["unconstrained"]["window_tok_s"], row["constrained"]["window_tok_s"]
    assert len(plain) == len(constrained) == 2
    assert row["ratio_sampled_window_median"] == pytest.approx(sum(constrained) / sum(plain), abs=2e-3)
    assert row["unconstrained"]["forced"] == 0 and row["unconstrained"]["finished"] > 0
    # Closed loop: 4 requests in flight on every counted step, one sampled token each (16-token outputs that
    # finish are replaced at once; a step may also be a new request's prefill).
    assert 0.5 * 80 * 4 <= row["unconstrained"]["sampled"] <= 80 * 4


def test_threads_below_one_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "structured", "--model", "tiny", "--parts", "s", "--threads", "0"])
    assert exit_info.value.code == 2 and "--threads must be >= 1" in capsys.readouterr().err
