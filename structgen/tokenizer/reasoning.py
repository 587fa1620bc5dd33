"""Reasoning parsers: which tokens open and close a model's reasoning, and where a request's output starts.

Reasoning models write `<think> … </think>` before their answer. A parser is a small class keyed by name
(`--reasoning-parser qwen3`); it reads its markers' ids from the tokenizer (a model that lacks them is refused at
start) and says, from the prompt, in which phase the output begins (`initial_phase`):

- the generation prompt opened the block (`…<think>\\n`, DeepSeek-R1's and the Qwen3 thinking-2507 templates):
  the output is reasoning until `</think>`;
- it opened and closed it (`<think>\\n\\n</think>\\n\\n`, Qwen3 with `enable_thinking: false`): the output is
  all answer;
- it did neither: Qwen3's hybrid template leaves the choice to the model (`PENDING`: reasoning when its first
  token is `<think>`, else all answer), while DeepSeek-R1 reasons from its first token, with or without the tag.

The engine does the rest by token id (`structgen.engine.reasoning`): the grammar of a structured request starts
after the end marker, and the two texts are decoded apart, so no marker ever lands in either.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from structgen.errors import StructgenError


class ReasoningParserError(StructgenError, ValueError):
    """An unknown parser name, or a model whose tokenizer lacks the parser's markers."""


class ReasoningPhase(enum.Enum):
    PENDING = (
        "pending"  # the first output token decides: the start marker opens reasoning, anything else answers
    )
    THINKING = "thinking"
    ANSWER = "answer"


@dataclass(frozen=True, slots=True)
class ReasoningMarkers:
    start_token_id: int
    end_token_id: int


class ReasoningParser:
    """Base class: `<think>` / `</think>` markers, each one token of the vocabulary."""

    name: ClassVar[str]
    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"
    # Where the prompt leaves the block unopened: does the model still reason from its first token?
    reasons_unopened: ClassVar[bool]

    def __init__(self, tokenizer: Any) -> None:
        ids = []
        for marker in (self.start_marker, self.end_marker):
            token_id = tokenizer.token_to_id(marker)
            if token_id is None or tokenizer.encode(marker, add_special_tokens=False) != [token_id]:
                raise ReasoningParserError(
                    f"reasoning parser {self.name!r} needs {marker!r} as one token of the vocabulary, and this "
                    "model's tokenizer has no such token: serve a reasoning model (Qwen3, DeepSeek-R1 and their "
                    "distillations) or drop --reasoning-parser"
                )
            ids.append(token_id)
        self.markers = ReasoningMarkers(start_token_id=ids[0], end_token_id=ids[1])
        self._tokenizer = tokenizer

    def initial_phase(self, prompt_token_ids: Sequence[int]) -> ReasoningPhase:
        """The phase the output starts in, read from the end of the prompt: the last marker counts only when
        nothing but whitespace follows it (an earlier turn's closed block is history, not this turn's state)."""
        markers = self.markers
        for index in range(len(prompt_token_ids) - 1, -1, -1):
            token = prompt_token_ids[index]
            if token == markers.start_token_id or token == markers.end_token_id:
                tail = self._tokenizer.decode(prompt_token_ids[index + 1 :], skip_special_tokens=False)
                if tail.strip():
                    break
                return ReasoningPhase.THINKING if token == markers.start_token_id else ReasoningPhase.ANSWER
        return ReasoningPhase.THINKING if self.reasons_unopened else ReasoningPhase.PENDING


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the hybrid template lets the model open `<think>` itself (or not, when it answers directly);
    `enable_thinking: false` closes an empty block in the prompt; the 2507 thinking models open it there."""

    name = "qwen3"
    reasons_unopened = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distillations: everything before `</think>` is reasoning, whether or not the model
    (or the template) wrote the opening tag."""

    name = "deepseek_r1"
    reasons_unopened = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def get_reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    """The parser `name` for this tokenizer; ReasoningParserError for an unknown name or missing markers."""
    try:
        parser_class = REASONING_PARSERS[name]
    except KeyError:
        raise ReasoningParserError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}"
        ) from None
    return parser_class(tokenizer)
