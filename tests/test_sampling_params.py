import math

import pytest

from structgen.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert params.seed is None
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (params.max_tokens, params.min_tokens) == (16, 0)
    assert params.stop == [] and params.stop_token_ids == []
    assert params.ignore_eos is False and params.logprobs is None and params.prompt_logprobs is None
    assert params.skip_special_tokens is True and params.include_stop_str_in_output is False
    assert params.greedy is False


def test_stop_fields_are_normalised_to_lists() -> None:
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]
    stop = ["x"]
    params = SamplingParams(stop=stop)
    stop.append("y")  # the params keep their own list
    assert params.stop == ["x"]


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0, True), (0.0, True), (1e-6, True), (0.01, False), (1.5, False)]
)
def test_greedy_means_temperature_zero(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_clone_is_equal_and_independent() -> None:
    params = SamplingParams(n=2, temperature=0.3, stop=["a"], stop_token_ids=[1], seed=9, logprobs=3)
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("b")
    copy.stop_token_ids.append(2)
    assert params.stop == ["a"] and params.stop_token_ids == [1]


def test_slots_reject_unknown_attributes() -> None:
    with pytest.raises(AttributeError):
        SamplingParams().temprature = 0.5  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 1.0},
        {"top_p": 1e-9, "top_k": 1, "min_p": 0.0},
        {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1e-3},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0, "repetition_penalty": 5.0},
        {"max_tokens": None, "min_tokens": 10_000},
        {"max_tokens": 1, "min_tokens": 1},
        {"logprobs": 0},
        {"logprobs": 20},
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
        {"temperature": 7},  # vLLM allows any temperature >= 0; the OpenAI layer narrows it to [0, 2]
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, r"n must be >= 1, got 0"),
        ({"n": 1.0}, r"n must be an integer >= 1"),
        ({"n": True}, r"n must be an integer"),
        ({"temperature": -0.1}, r"temperature must be >= 0"),
        ({"temperature": math.nan}, r"temperature must be >= 0"),
        ({"temperature": math.inf}, r"temperature must be >= 0"),
        ({"temperature": "1"}, r"temperature must be a number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, r"top_k must be >= -1"),
        ({"top_k": 2.5}, r"top_k must be an integer"),
        ({"min_p": -0.01}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"seed": 2**64}, r"seed must be an integer in"),
        ({"seed": "7"}, r"seed must be an integer"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -2.01}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be > 0"),
        ({"repetition_penalty": -1.0}, r"repetition_penalty must be > 0"),
        ({"max_tokens": 0}, r"max_tokens must be >= 1 or None"),
        ({"min_tokens": -1}, r"min_tokens must be >= 0"),
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens must be <= max_tokens \(4\), got 5"),
        ({"stop": ""}, r"stop must not contain an empty string"),
        ({"stop": ["ok", 3]}, r"stop must be a string, a list of strings or None"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must be a list of integers >= 0"),
        ({"stop_token_ids": 5}, r"stop_token_ids must be a list"),
        ({"ignore_eos": "yes"}, r"ignore_eos must be a bool"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
        ({"logprobs": -1}, r"logprobs must be in \[0, 20\]"),
        ({"prompt_logprobs": 21}, r"prompt_logprobs must be in \[0, 20\]"),
        ({"prompt_logprobs": -1}, r"prompt_logprobs must be in \[0, 20\]"),
        ({"prompt_logprobs": True}, r"prompt_logprobs must be an integer"),
    ],
)
def test_invalid_values_name_the_field_and_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
