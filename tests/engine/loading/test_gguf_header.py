"""engine/loading/gguf_header.py against its oracle, the gguf package's GGUFReader: every field's types and
contents, every tensor's record and data, on a file written with every metadata value type and
several tensor types at a non-default alignment, and on the default model's GGUF; layouts it
leaves to GGUFReader fall back to it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from engine.loading.gguf_header import GGUFHeader, open_gguf
from tests.kernels.gguf_blocks import quantize


def assert_same(header, reader) -> None:
    assert list(header.fields) == list(reader.fields)
    for key, want in reader.fields.items():
        got = header.fields[key]
        assert got.types == want.types, key
        assert got.contents() == want.contents(), key
    assert len(header.tensors) == len(reader.tensors)
    for a, b in zip(header.tensors, reader.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset), b.name
        assert a.shape.dtype == b.shape.dtype and np.array_equal(a.shape, b.shape), b.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, b.name
        assert a.data.tobytes() == b.data.tobytes(), b.name


def test_every_value_type_and_tensor_type(tmp_path):
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo\u2603")
    w.add_string("t.empty_str", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ünï", "<|im_end|>"])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(9).astype(np.float32))
    for fmt in ("Q8_0", "Q4_1"):
        x = rng.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor(fmt.lower(), quantize(x, fmt), raw_shape=quantize(x, fmt).shape,
                     raw_dtype=gguf.GGMLQuantizationType[fmt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = GGUFHeader(path)
    assert header.fields["t.strs"].types == [GGUFValueType.ARRAY, GGUFValueType.STRING]
    assert header.fields["t.u64"].contents() == 2**63 + 5
    assert_same(header, GGUFReader(path))


def test_the_default_models_file():
    from engine.loading.default_model import DefaultModelMissingError, default_gguf_path

    try:
        path = default_gguf_path()
    except DefaultModelMissingError as e:
        pytest.skip(str(e))
    header = GGUFHeader(path)
    assert len(header.fields["tokenizer.ggml.tokens"].contents()) == 49152
    assert_same(header, GGUFReader(path))


def test_arrays_of_arrays_are_left_to_ggufreader(tmp_path):
    path = tmp_path / "nested.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("x", np.zeros((2, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert isinstance(open_gguf(path), GGUFReader)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="magic"):
        open_gguf(path)


@pytest.mark.parametrize("keep", [100, 1200])  # cut inside the metadata, or inside the tensor data (1,664 bytes whole)
def test_a_truncated_file_is_a_clear_error(tmp_path, keep):
    path = tmp_path / "whole.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("t.strs", ["x" * 40] * 10)
    w.add_tensor("x", np.zeros((16, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        open_gguf(cut)
