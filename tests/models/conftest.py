"""Fixtures shared by the GGUF tests."""

from __future__ import annotations

from typing import Any

import pytest
from gguf_fixtures import train_byte_level_vocab


@pytest.fixture(scope="module")
def vocab() -> Any:
    """A small byte-level BPE vocabulary trained once per module."""
    return train_byte_level_vocab()
