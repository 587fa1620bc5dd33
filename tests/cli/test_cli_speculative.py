"""`--speculative-config` on `serve` / `run-batch`: the JSON reaches the engine's config, and a bad one is refused
with one clear line and exit 2 before anything loads."""

from __future__ import annotations

import pytest

from structgen.cli import _build_parser, main
from structgen.commands.engine_args import engine_config
from structgen.config import SpeculativeConfig


def test_the_flag_reaches_the_engine_config() -> None:
    flag = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    config = engine_config(_build_parser().parse_args(["serve", "--speculative-config", flag]))
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3)
    assert engine_config(_build_parser().parse_args(["serve"])).speculative_config is None
    draft = '{"model": "tiny", "num_speculative_tokens": 3}'
    config = engine_config(_build_parser().parse_args(["serve", "--speculative-config", draft]))
    assert config.speculative_config == SpeculativeConfig(
        method="draft_model", model="tiny", num_speculative_tokens=3
    )


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        ("{nope", "speculative config is not valid JSON"),
        ('{"method": "eagle"}', "speculative method 'eagle' is not supported"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be in 1..15"),
        ('{"method": "draft_model"}', 'needs "model"'),
    ],
)
def test_a_bad_config_is_refused_before_loading_anything(
    flag: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--model", "tiny", "--speculative-config", flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith("structgen serve: ") and words in err, err


@pytest.mark.parametrize(
    ("draft", "words"),
    [
        ("tiny-thinking", "another vocabulary than the target model"),
        ("/nonexistent/draft", "unknown model '/nonexistent/draft'"),
    ],
)
def test_a_draft_the_target_cannot_use_is_one_line_and_exit_1(
    draft: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    flag = f'{{"model": "{draft}", "num_speculative_tokens": 3}}'
    assert main(["serve", "--model", "tiny", "--speculative-config", flag]) == 1
    err = capsys.readouterr().err
    assert err.startswith("structgen serve: ") and words in err and "Traceback" not in err, err
