"""store_kv under the interpreter against its reference: padding slots, strided inputs, dtype conversion."""

from __future__ import annotations

import pytest
import torch
from structgen.kernels.store_kv import store_kv, store_kv_reference


def _caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shape = (6, 4, 2, 8)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize(
    ("input_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)],
)
def test_matches_reference_with_padding_and_strided_inputs(
    input_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 3 * 16, generator=gen).to(
        input_dtype
    )  # k/v are strided views, as the model makes them
    key, value = qkv[:, 16:32].view(7, 2, 8), qkv[:, 32:].view(7, 2, 8)
    slots = torch.tensor([0, 5, -1, 23, 4, -1, 11])  # block boundaries (3|4, 23 = last slot), padding
    key_cache, value_cache = _caches(cache_dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    store_kv(key, value, key_cache, value_cache, slots)
    store_kv_reference(key, value, expected_k, expected_v, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)
    # Padding rows wrote nothing: the untouched slots keep their old contents.
    untouched = [s for s in range(24) if s not in {0, 5, 23, 4, 11}]
    assert torch.equal(key_cache.view(24, 2, 8)[untouched], _caches(cache_dtype)[0].view(24, 2, 8)[untouched])


def test_int32_slots_and_empty_batch() -> None:
    key_cache, value_cache = _caches(torch.float32)
    key = torch.ones(2, 2, 8)
    store_kv(key, key * 2, key_cache, value_cache, torch.tensor([3, 9], dtype=torch.int32))
    assert torch.equal(key_cache.view(24, 2, 8)[9], key[1])
    assert torch.equal(value_cache.view(24, 2, 8)[3], key[0] * 2)
    before = key_cache.clone()
    store_kv(key[:0], key[:0], key_cache, value_cache, torch.empty(0, dtype=torch.long))
    assert torch.equal(key_cache, before)


@pytest.mark.parametrize(
    ("key_shape", "slots", "message"),
    [
        ((2, 2, 4), [0, 1], "key must have shape"),
        ((2, 2, 8), [0, 1, 2], "slot_mapping must have shape"),
        ((2, 2, 8), [0.0, 1.0], "slot_mapping must be int32, int64"),
    ],
)
def test_bad_arguments_fail_clearly(key_shape: tuple[int, ...], slots: list[float], message: str) -> None:
    key_cache, value_cache = _caches(torch.float32)
    key = torch.zeros(key_shape)
    with pytest.raises(ValueError, match=message):
        store_kv(key, key, key_cache, value_cache, torch.tensor(slots))


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    key_cache, value_cache = _caches(torch.float32)
    key = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        store_kv(key, key, key_cache, value_cache, torch.tensor([0]))
