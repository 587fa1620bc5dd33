"""Streaming detokenization: text deltas per generated token, never a broken UTF-8 character.

A character can span tokens (byte-level BPE splits emoji and CJK into byte tokens; sentencepiece falls back
to `<0xNN>` tokens), and some decoders depend on the neighbouring tokens (sentencepiece drops the first
leading space of a decode). So each step decodes a small window, like vLLM's prefix/read offsets: the tokens
shown by the last step, kept as context, then `read_offset`, then the tokens not shown yet. The delta is the
window's text beyond the text of its shown part; while that text ends in U+FFFD (the bytes of a character
not complete yet) nothing is emitted and the tokens stay unread. The window holds the last emitted step
plus anything held back, so a step costs O(1) in the length of the output.
"""

from __future__ import annotations

from collections.abc import Sequence

from structgen.tokenizer.hf import Tokenizer

# How many prompt tokens serve as decoding context for the first generated token (vLLM uses 5 too).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Push generated token ids, get the new text. Concatenated deltas plus `flush()` equal the text of
    `prompt_ids + pushed ids` beyond the text of `prompt_ids` (just `decode(pushed ids)` with no prompt)."""

    __slots__ = ("_ids", "_read_offset", "_skip_special_tokens", "_tokenizer")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Prompt ids past the tokenizer (a model's padded embedding rows) have no text: leave them out.
        context = prompt_ids[-_PROMPT_CONTEXT_TOKENS:] if prompt_ids else []
        # The window: shown tokens kept as context (`_ids[:_read_offset]`), then the ones not shown yet.
        self._ids: list[int] = [i for i in context if 0 <= i < tokenizer.vocab_size]
        self._read_offset = len(self._ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens pushed but not yet shown (an incomplete character)."""
        return len(self._ids) - self._read_offset

    def push(self, token_ids: Sequence[int] | int) -> str:
        """Add generated tokens; returns the text that is now complete (possibly "")."""
        if isinstance(token_ids, int):
            self._ids.append(token_ids)
        else:
            self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (a character the output ended in the middle of, as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        skip = self._skip_special_tokens
        shown = self._tokenizer.decode(self._ids[: self._read_offset], skip_special_tokens=skip)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=skip)
        if not final and (len(text) <= len(shown) or text.endswith(_REPLACEMENT)):
            # A character still incomplete, or only skipped special tokens so far: keep the tokens unread.
            return ""
        # The tokens shown now become the next window's context; older ones are dropped (bounded memory).
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return text[len(shown) :]
