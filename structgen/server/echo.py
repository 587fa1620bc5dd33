"""`echo` of the legacy completions API: each choice's text starts with its prompt, and with `logprobs` its
logprobs object starts with the prompt's tokens; `max_tokens: 0` answers the prompt alone. Together they score a
text, as lm-evaluation-harness does (`echo=True, logprobs=1, max_tokens=0`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from structgen.engine.outputs import CompletionOutput
from structgen.server import protocol as p
from structgen.server.generation import Started, scored_prompt
from structgen.server.logprobs_body import prompt_completion_logprobs


@dataclass(slots=True)
class Echo:
    """What goes before each choice's own tokens, per prompt (choice `i` is prompt `i // n`'s)."""

    n: int
    texts: list[str]  # the prompt as text (token prompts decoded)
    logprobs: list[dict[str, Any]] | None  # the legacy object of the prompt's tokens; None without `logprobs`
    prompt_only: bool  # `max_tokens: 0`: each output goes through `prompt_only`

    @classmethod
    def of(cls, tokenizer: Any, body: p.CompletionRequest, started: list[Started], n: int) -> Echo | None:
        """The echo of `body` (None without `echo`)."""
        if not body.echo:
            return None
        texts = [
            first.prompt if first.prompt is not None else tokenizer.decode(first.prompt_token_ids)
            for _, first in started
        ]
        logprobs = None
        if body.logprobs is not None:
            logprobs = [
                prompt_completion_logprobs(
                    tokenizer, first.prompt_token_ids, scored_prompt(first), top=body.logprobs
                )
                for _, first in started
            ]
        return cls(n, texts, logprobs, body.scores_prompt_only)

    def text(self, choice: int) -> str:
        return self.texts[choice // self.n]

    def prompt_logprobs(self, choice: int) -> dict[str, Any] | None:
        return self.logprobs[choice // self.n] if self.logprobs is not None else None

    def output(self, output: CompletionOutput) -> CompletionOutput:
        """The output as the choice reports it."""
        return prompt_only(output) if self.prompt_only else output


def prompt_only(output: CompletionOutput) -> CompletionOutput:
    """The output of a `max_tokens: 0` request (`CompletionRequest.scores_prompt_only`), which OpenAI's legacy API
    and vLLM answer with the prompt alone. The engine cannot run a request that generates nothing, so it runs
    with `max_tokens` 1 (`CompletionRequest.to_sampling_params`) and this drops that token: no text, no token,
    no logprobs of its own (the echoed prompt's stay), "length" as the finish (what vLLM answers, whatever
    ended the token run), and no completion tokens in the usage. A failed output stays as it is."""
    if output.finish_reason == "error":
        return output
    return CompletionOutput(
        index=output.index,
        text="",
        token_ids=[],
        finish_reason="length" if output.finished else None,
        logprobs=[] if output.logprobs is not None else None,
    )
