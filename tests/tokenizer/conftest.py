"""Session fixtures: tokenizer directories and our loads of them, with transformers' loads as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizer_fixtures import build_sentencepiece_style_tokenizer

from structgen.models.tiny import build_tiny_model
from structgen.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny_model(out)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sentencepiece_style_tokenizer(tmp_path_factory.mktemp("sp") / "model")


@pytest.fixture(scope="session")
def sp_tokenizer(sp_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(sp_dir)


@pytest.fixture(scope="session")
def hf_tiny(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def hf_sp(sp_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(sp_dir)
