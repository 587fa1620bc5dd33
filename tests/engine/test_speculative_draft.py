"""Draft-model speculative decoding: greedy outputs token for token those without it (the target drafting for
itself, and a one-layer draft that mostly disagrees), under grammars, chunked, preempted, after prefix-cache
hits; the draft's own KV blocks all returned; sampled outputs keep their distribution; drafts with another
vocabulary refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import EngineFactory, run_all
from test_speculative import SETTINGS, _letters, _run

from structgen.config import EngineConfig, SpeculativeConfig
from structgen.engine.draft_model import DraftModelError
from structgen.engine.llm_engine import LLMEngine
from structgen.models.registry import resolve_model
from structgen.models.truncate import write_truncated_checkpoint
from structgen.sampling_params import SamplingParams
from structgen.structured.spec import StructuredOutputsParams

DRAFT = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3, "max_batch_size": 4}


@pytest.fixture(scope="module")
def without(make_engine: EngineFactory) -> list[list[list[int]]]:
    return _run(make_engine())


@pytest.fixture(scope="module")
def one_layer_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(
        write_truncated_checkpoint(resolve_model("tiny"), tmp_path_factory.mktemp("draft"), num_layers=1)
    )


def _draft_returned_everything(engine: LLMEngine) -> None:
    engine.step()  # nothing runs: the draft forgets the finished sequences
    draft = engine.speculator.proposer  # type: ignore[union-attr]
    assert draft.num_held == 0
    assert draft.num_free_blocks == draft.runner.num_blocks


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_target_drafting_for_itself_changes_nothing_and_is_accepted(
    make_engine: EngineFactory, without: list[list[list[int]]], setting: dict[str, Any]
) -> None:
    engine = make_engine(speculative_config=DRAFT, **setting)
    assert engine.speculator is not None and engine.speculator.proposer.runner.model is engine.model  # type: ignore[union-attr]
    assert _run(engine) == without
    stats = engine.stats()
    # The same model agrees with its own greedy picks, except where the request's repetition penalty (which the
    # draft does not apply) or a stop string or the end of an output cuts in.
    assert stats.num_spec_accepted_tokens >= 0.75 * stats.num_spec_proposed_tokens > 0
    if "kv_cache_tokens" in setting:
        assert stats.num_preemptions > 0
    _draft_returned_everything(engine)


def test_a_draft_that_mostly_disagrees_changes_nothing(
    make_engine: EngineFactory, without: list[list[list[int]]], one_layer_draft: str
) -> None:
    engine = make_engine(speculative_config={**DRAFT, "model": one_layer_draft})
    assert engine.speculator.proposer.runner.model is not engine.model  # type: ignore[union-attr]
    assert _run(engine) == without
    assert _run(engine, alone=True) == without  # again, the prompts from the prefix cache
    assert engine.stats().num_spec_proposed_tokens > 0
    _draft_returned_everything(engine)


def test_proposals_follow_the_grammar(make_engine: EngineFactory, one_layer_draft: str) -> None:
    """The draft proposes its best token the grammar allows: under a digits-only grammar every proposal is a
    digit, and the output is the one without speculation."""
    params = SamplingParams(
        temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{24}")
    )
    outputs = []
    for spec in (None, {**DRAFT, "model": one_layer_draft}):
        engine = make_engine(speculative_config=spec)
        engine.add_request("r", "abc abc abc abc abc abc", params)
        outputs.append(run_all(engine)["r"].outputs[0])
    assert outputs[0].token_ids == outputs[1].token_ids
    assert len(outputs[1].text) == 24 and outputs[1].text.isdigit()
    assert engine.stats().num_spec_proposed_tokens > 0


def test_sampled_outputs_keep_their_distribution(make_engine: EngineFactory) -> None:
    """As for n-gram proposals (test_speculative.py): a draft's greedy proposal is one token for sure, so keeping
    it only when the request's own draw equals it is rejection sampling."""
    count = 300
    plain, _ = _letters(make_engine, None, count)
    spec, stats = _letters(make_engine, {**DRAFT, "max_batch_size": 64}, count)
    assert stats.num_spec_accepted_tokens > count
    statistic = sum((plain[o] - spec[o]) ** 2 / (plain[o] + spec[o]) for o in set(plain) | set(spec))
    assert statistic < 24.32, (statistic, plain, spec)  # chi-square, 7 degrees of freedom, 0.1%


@pytest.mark.parametrize("commit", [True, False])
def test_the_draft_commits_its_kv_cache_as_the_target_does(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch, commit: bool
) -> None:
    from structgen.engine.model_runner import ModelRunner

    commits: list[bool] = []
    allocate = ModelRunner.allocate_kv_cache

    def recording(self: ModelRunner, num_blocks: int, *, commit: bool = True) -> None:
        commits.append(commit)
        allocate(self, num_blocks, commit=commit)

    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", recording)
    engine = make_engine(speculative_config=DRAFT, commit_cpu_kv_at_start=commit)
    assert engine.speculator is not None
    assert commits == [commit, commit]  # the target's cache, then the draft's


def test_a_draft_with_another_vocabulary_is_refused(make_engine: EngineFactory) -> None:
    with pytest.raises(DraftModelError, match="another vocabulary"):
        make_engine(speculative_config={**DRAFT, "model": "tiny-thinking"})


def test_a_missing_draft_is_refused(make_engine: EngineFactory, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model"):
        make_engine(speculative_config={**DRAFT, "model": str(tmp_path / "nothing")})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "draft_model"}, 'needs "model"'),
        ({"method": "ngram", "model": "tiny"}, "takes none"),
        ({"model": "tiny", "quantization": "fp8"}, "quantization must be"),
        ({"method": "eagle", "model": "tiny"}, "not supported"),
    ],
)
def test_bad_draft_configs_are_refused(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=config)


def test_a_model_alone_means_the_draft_model_method() -> None:
    config = EngineConfig(
        speculative_config='{"model": "tiny", "num_speculative_tokens": 4}'
    ).speculative_config
    assert config == SpeculativeConfig(method="draft_model", model="tiny", num_speculative_tokens=4)
