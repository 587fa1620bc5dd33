"""A GGUF file's header read into plain values, and its tensors as views of the memory-mapped file.

The `gguf` package's `GGUFReader` keeps every metadata value as numpy views, one per string: the default
model's header (a 49k-token vocabulary and 49k merges, ~250k small views) took ~5 s to open, most of every
`structgen serve` start. This reads the same header with `struct` into Python values (strings decoded, arrays
as lists, as `gguf_metadata` gave them before) in well under a second, and gives each tensor the `data` view
`GGUFReader` gives (its element type for float and integer tensors, bytes shaped [..., row bytes] for
quantized ones), so `gguf.quants.dequantize` and the int4 decoders take them unchanged. Format: llama.cpp's
docs/gguf.md, versions 2 and 3, either byte order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = 0x46554747  # b"GGUF" read as a little-endian uint32
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: (struct code, numpy dtype) of the fixed-size ones.
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "u1"),
    1: ("b", "i1"),
    2: ("H", "u2"),
    3: ("h", "i2"),
    4: ("I", "u4"),
    5: ("i", "i4"),
    6: ("f", "f4"),
    7: ("?", "?"),
    10: ("Q", "u8"),
    11: ("q", "i8"),
    12: ("d", "f8"),
}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor: `shape` lists dims innermost first (as the file and `GGUFReader` do); `data` views the file."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]


class _Header:
    """A cursor over the header's bytes in the file's byte order."""

    __slots__ = ("buffer", "offset", "order")

    def __init__(self, buffer: np.ndarray, order: str) -> None:
        self.buffer = buffer
        self.offset = 0
        self.order = order

    def scalar(self, code: str) -> Any:
        size = struct.calcsize(code)
        if self.offset + size > len(self.buffer):
            raise ValueError("the header ends before its last field")
        (value,) = struct.unpack_from(self.order + code, self.buffer, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (the vocabulary and merges are ~100k of them: one tight loop)."""
        unpack, view, offset, size = (
            struct.Struct(self.order + "Q").unpack_from,
            memoryview(self.buffer),
            self.offset,
            len(self.buffer),
        )
        out = []
        for _ in range(count):
            if offset + 8 > size:
                raise ValueError("a string array runs past the end of the file")
            (length,) = unpack(view, offset)
            offset += 8
            out.append(str(view[offset : offset + length], "utf-8"))
            offset += length
        if offset > size:
            raise ValueError("a string array runs past the end of the file")
        self.offset = offset
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind][0])
        if kind == _ARRAY:
            item_kind, count = self.scalar("I"), self.scalar("Q")
            if item_kind == _ARRAY:
                raise ValueError("nested metadata arrays are not supported")
            if item_kind == _STRING:
                return self.strings(count)
            if item_kind not in _SCALARS:
                raise ValueError(f"unknown metadata value type {item_kind}")
            dtype = np.dtype(_SCALARS[item_kind][1]).newbyteorder(self.order)
            end = self.offset + count * dtype.itemsize
            if end > len(self.buffer):
                raise ValueError("an array runs past the end of the file")
            values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset).tolist()
            self.offset = end
            return values
        raise ValueError(f"unknown metadata value type {kind}")


def open_gguf(path: str | Path) -> GGUFFile:
    """Read `path`'s header; the tensors' data stay in the file (read-only memory map). ValueError if it is not
    a GGUF file this reads, or is cut short."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    buffer = np.memmap(path, mode="r")
    if len(buffer) < 24 or struct.unpack_from("<I", buffer, 0)[0] != GGUF_MAGIC:
        raise ValueError("GGUF magic invalid")
    (version,) = struct.unpack_from("<I", buffer, 4)
    order = "<"
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        order, version = ">", struct.unpack_from(">I", buffer, 4)[0]
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"GGUF version {version} is not supported ({', '.join(map(str, SUPPORTED_VERSIONS))} are)"
        )
    header = _Header(buffer, order)
    header.offset = 8
    tensor_count, kv_count = header.scalar("Q"), header.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = header.string()
        metadata[key] = header.value(header.scalar("I"))
    infos = []
    for _ in range(tensor_count):
        name = header.string()
        dims = [header.scalar("Q") for _ in range(header.scalar("I"))]
        infos.append((name, dims, header.scalar("I"), header.scalar("Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid general.alignment {alignment!r}: must be a power of two")
    data_start = -(-header.offset // alignment) * alignment

    tensors: list[GGUFTensor] = []
    seen: set[str] = set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise ValueError(f"duplicated tensor {name!r}")
        seen.add(name)
        qtype = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
        elements = int(np.prod(dims, dtype=np.int64))
        shape = tuple(reversed(dims))  # numpy order: outermost first
        item = _ELEMENT_TYPES.get(qtype.name)
        if item is None:  # quantized: rows of blocks, as bytes
            if shape[-1] % block:
                raise ValueError(f"tensor {name!r}: {shape[-1]} columns are not whole {qtype.name} blocks")
            item, shape, count = (
                "u1",
                (*shape[:-1], shape[-1] // block * type_size),
                elements // block * type_size,
            )
        else:
            count = elements
        dtype = np.dtype(item).newbyteorder(order)  # bytes have no order: u1 stays as it is
        start = data_start + offset
        if start + count * dtype.itemsize > len(buffer):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = np.ndarray(shape, dtype=dtype, buffer=buffer, offset=start)
        tensors.append(GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), data))
    return GGUFFile(Path(path), version, metadata, tensors)


# Tensor types stored as plain elements (GGUFReader's choice); every other type is blocks of bytes.
_ELEMENT_TYPES = {"F16": "f2", "F32": "f4", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}
