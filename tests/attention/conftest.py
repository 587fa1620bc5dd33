"""Shared settings of the attention tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _single_torch_thread() -> Iterator[None]:
    # The tensors here are tiny: a second intra-op thread buys nothing, and on a shared 2-core machine the
    # threads' spin-waiting makes each forward 10-20x slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
