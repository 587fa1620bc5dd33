"""Per-request sampling options, with vLLM's names and defaults so vLLM users can switch without changes.

Every field is validated on construction: a bad value raises a `ValueError` that names the field and the
range it must lie in, so the server can turn it into a 400 without knowing the rules itself.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from structgen.structured.spec import StructuredOutputsParams

# Temperatures below this count as 0 (greedy), as in vLLM: dividing logits by a near-zero temperature only
# adds overflow risk for a distribution that is already a point mass.
GREEDY_TEMPERATURE_EPS = 1e-5
# OpenAI allows at most 20 top logprobs per token; vLLM's default `max_logprobs` is the same.
MAX_LOGPROBS = 20
# The seed range torch.Generator.manual_seed accepts (int64 and uint64 values).
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


@dataclass(slots=True)
class SamplingParams:
    """How to pick the tokens of one request. Field names, defaults and meanings follow vLLM."""

    n: int = 1
    temperature: float = 1.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 → off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None → up to the context limit
    min_tokens: int = 0
    stop: list[str] | str | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per sampled token (0 = only the sampled token's own)
    # Logprobs of the prompt's own tokens (each given the tokens before it) and this many alternatives per
    # position: 0 = only the prompt token's own. Costs a logits row per prompt token and bypasses the prefix
    # cache for the request's first prefill (cached blocks have no hidden states to score).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # JSON Schema / json_object / regex / grammar / choice constraint (structgen.structured).
    structured_outputs: StructuredOutputsParams | None = None
    # With a reasoning parser on the engine: at most this many tokens of reasoning, then the end marker is forced
    # and the answer begins (None: the engine's default, `EngineConfig.thinking_token_budget`).
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, low=1)
        self.temperature = _check_float("temperature", self.temperature, ">= 0 (0 means greedy)", low=0.0)
        self.top_p = _check_float("top_p", self.top_p, "in (0, 1]", low=0.0, low_open=True, high=1.0)
        _check_int("top_k", self.top_k, low=-1, what=">= -1 (0 or -1 disable it)")
        self.min_p = _check_float("min_p", self.min_p, "in [0, 1]", low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=_SEED_MIN, high=_SEED_MAX, what="an integer in [-2**63, 2**64)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name), "in [-2, 2]", low=-2.0, high=2.0)
            setattr(self, name, value)
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, "> 0 (1 means no penalty)", low=0.0, low_open=True
        )
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1, what=">= 1 or None (up to the context limit)")
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            _check_int(
                "logprobs", self.logprobs, low=0, high=MAX_LOGPROBS, what=f"in [0, {MAX_LOGPROBS}] or None"
            )
        if self.structured_outputs is not None:
            from structgen.structured.spec import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    "structured_outputs must be a StructuredOutputsParams or None, "
                    f"got {type(self.structured_outputs).__name__}"
                )
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, low=0, what=">= 0 or None")
        if self.prompt_logprobs is not None:
            _check_int(
                "prompt_logprobs",
                self.prompt_logprobs,
                low=0,
                high=MAX_LOGPROBS,
                what=f"in [0, {MAX_LOGPROBS}] or None",
            )

    @property
    def greedy(self) -> bool:
        """True when the request takes the most likely token every step (temperature 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def clone(self) -> SamplingParams:
        """An independent copy: the list fields are copied too, so editing one does not change the other."""
        return dataclasses.replace(self)


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `n=True` is a mistake worth reporting rather than reading as 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(
    name: str, value: object, *, low: int, high: int | None = None, what: str | None = None
) -> None:
    if what is None:
        what = f">= {low}" if high is None else f"in [{low}, {high}]"
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer {what}, got {value!r}")
    assert isinstance(value, int)
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be {what}, got {value}")


def _check_float(
    name: str,
    value: object,
    what: str,
    *,
    low: float,
    high: float | None = None,
    low_open: bool = False,
) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number {what}, got {value!r}")
    number = float(value)
    too_low = number <= low if low_open else number < low
    if not math.isfinite(number) or too_low or (high is not None and number > high):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return number


def _normalise_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
    if any(not s for s in stop):
        raise ValueError("stop must not contain an empty string")
    return list(stop)


def _normalise_stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"stop_token_ids must be a list of integers >= 0 or None, got {ids!r}")
    return list(ids)
