"""Session fixtures of the LoRA tests (built in `lora_helpers`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lora_helpers import Adapters, build_adapters, load_tiny_model


@pytest.fixture(scope="session")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    return build_adapters(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_model() -> tuple[Any, Any, Path]:
    return load_tiny_model()
