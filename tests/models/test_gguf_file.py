"""structgen's GGUF header reader gives what the `gguf` package's `GGUFReader` gives: the same metadata values
(as structgen decoded the package's fields before: `structgen.bench.startup.gguf_package_reader`) and the same
tensors, views of the same bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFWriter
from gguf.quants import quantize

from structgen.bench.startup import gguf_package_reader
from structgen.models.gguf_file import open_gguf
from structgen.models.registry import smollm2_gguf_path

Q = GGMLQuantizationType


def _assert_same(path: Path) -> None:
    reference, ours = gguf_package_reader(path), open_gguf(path)
    # less the package reader's own counters, which are not key/values of the file
    assert ours.metadata == {k: v for k, v in reference.metadata.items() if not k.startswith("GGUF.")}
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for theirs, mine in zip(reference.tensors, ours.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape.tolist() == theirs.shape.tolist(), mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.asarray(mine.data).tobytes() == np.asarray(theirs.data).tobytes(), mine.name


def _write(path: Path, *, endianess: GGUFEndian = GGUFEndian.LITTLE, alignment: int | None = None) -> Path:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama", endianess=endianess)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "naïve ✓ \u4e2d")
    writer.add_string("t.empty", "")
    writer.add_array("t.strings", ["a", "", "Ġthe", "<|im_end|>", "\u00e9\u00e8"] * 50)
    writer.add_array("t.ints", list(range(-3, 300)))
    writer.add_array("t.floats", [0.5, -1.25, 3.0])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.none", [])
    writer.add_tensor("f32", rng.normal(size=(3, 40)).astype(np.float32))
    writer.add_tensor("f16", rng.normal(size=(2, 3, 8)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.BF16):
        values = rng.normal(size=(4, 64)).astype(np.float32)
        writer.add_tensor(f"q.{qtype.name}", quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_type_reads_as_gguf_reads_it(
    tmp_path: Path, alignment: int | None
) -> None:
    _assert_same(_write(tmp_path / "all.gguf", alignment=alignment))


def test_a_big_endian_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "big.gguf", endianess=GGUFEndian.BIG)
    ours = open_gguf(path)
    assert ours.metadata["t.u32"] == 4_000_000_000 and ours.metadata["t.ints"][:3] == [-3, -2, -1]
    assert ours.tensors[0].data.dtype.byteorder == ">"
    _assert_same(path)


def test_the_default_model_file() -> None:
    path = smollm2_gguf_path()
    ours = open_gguf(path)
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    _assert_same(path)


def test_broken_files_are_value_errors(tmp_path: Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all, not at all")
    with pytest.raises(ValueError, match="magic"):
        open_gguf(tmp_path / "junk.gguf")
    whole = _write(tmp_path / "whole.gguf").read_bytes()
    for cut in (30, 200, len(whole) - 100):
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=r"past the end|ends before"):
            open_gguf(tmp_path / "cut.gguf")
    future = bytearray(whole)
    future[4:8] = (9).to_bytes(4, "little")
    (tmp_path / "v9.gguf").write_bytes(bytes(future))
    with pytest.raises(ValueError, match="version 9"):
        open_gguf(tmp_path / "v9.gguf")
