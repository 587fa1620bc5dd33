"""Settings for the whole suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_torch_thread() -> Iterator[None]:
    # The test models are tiny: a second intra-op thread buys little, and on a shared 2-core machine (CI, or a
    # developer running other work) spin-waiting threads make each forward 10-20x slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
