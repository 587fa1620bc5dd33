"""Tokenizer layer: HF tokenizer files + chat templates, streaming detokenization, stop strings."""

from structgen.tokenizer.chat_template import ChatTemplateError
from structgen.tokenizer.detokenizer import IncrementalDetokenizer
from structgen.tokenizer.hf import Tokenizer
from structgen.tokenizer.stop import StopChecker

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "StopChecker", "Tokenizer"]
