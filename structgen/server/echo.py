"""`echo` of the legacy completions API: each choice's text starts with its prompt, and with `logprobs` its
logprobs object starts with the prompt's tokens; `max_tokens: 0` answers the prompt alone. Together they score a
text, as lm-evaluation-harness does (`echo=True, logprobs=1, max_tokens=0`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from structgen.engine.outputs import CompletionOutput
from structgen.server import protocol as p
from structgen.server.generation import Started, scored_prompt
from structgen.server.logprobs_body import prompt_completion_logprobs, prompt_offsets


@dataclass(slots=True)
class Echo:
    """What goes before each choice's own tokens, per prompt (choice `i` is prompt `i // n`'s)."""

    n: int
    texts: list[str]  # the prompt as text (`prompt_text`)
    logprobs: list[dict[str, Any]] | None  # the legacy object of the prompt's tokens; None without `logprobs`
    prompt_only: bool  # `max_tokens: 0`: each output goes through `prompt_only`

    @classmethod
    def of(cls, tokenizer: Any, body: p.CompletionRequest, started: list[Started], n: int) -> Echo | None:
        """The echo of `body` (None without `echo`)."""
        if not body.echo:
            return None
        texts = [prompt_text(tokenizer, first.prompt, first.prompt_token_ids) for _, first in started]
        logprobs = None
        if body.logprobs is not None:
            logprobs = [
                prompt_completion_logprobs(
                    tokenizer,
                    first.prompt_token_ids,
                    scored_prompt(first),
                    prompt_offsets(tokenizer, first.prompt_token_ids, text),
                    top=body.logprobs,
                )
                for (_, first), text in zip(started, texts, strict=True)
            ]
        return cls(n, texts, logprobs, body.scores_prompt_only)

    def text(self, choice: int) -> str:
        return self.texts[choice // self.n]

    def prompt_logprobs(self, choice: int) -> dict[str, Any] | None:
        return self.logprobs[choice // self.n] if self.logprobs is not None else None

    def output(self, output: CompletionOutput) -> CompletionOutput:
        """The output as the choice reports it."""
        return prompt_only(output) if self.prompt_only else output


def prompt_text(tokenizer: Any, prompt: str | None, token_ids: list[int]) -> str:
    """The echoed text of a prompt: the request's text, or a token prompt decoded with its special tokens (a BOS
    is part of the prompt; vLLM decodes it so too), so that each of its tokens has its place in the text. Ids
    past the tokenizer (a model's padded embedding rows, which the engine accepts) have no text."""
    if prompt is not None:
        return prompt
    known = [t for t in token_ids if 0 <= t < tokenizer.vocab_size]
    return tokenizer.decode(known, skip_special_tokens=False)


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
