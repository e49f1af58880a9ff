"""A GGUF file's metadata and tensor table, read in milliseconds: what engine/loading/gguf_loader.py asks of
the gguf package's GGUFReader, without its cost.

GGUFReader builds a numpy view for every part of every metadata value, so the default model's
49,152-token vocabulary and 48,900 merges become ~300,000 views: 4.7 s and 160 MB per parse on the
AVX2 machine, and a start-up parsed the file twice (resolve_model, then the weight loader), 9 of
its 25 s. Here arrays are skipped by their lengths as the header is walked and decoded only when
asked for; tensors are gguf's own ReaderTensor records over one read-only memmap of the file,
their data views made as GGUFReader makes them (tests/engine/loading/test_gguf_header.py holds the two
equal, field by field and byte by byte). Byte-swapped (big-endian) files and arrays of arrays,
which no supported model writes, are left to GGUFReader (`open_gguf`).
"""

from __future__ import annotations

import os
import struct

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = 0x46554747  # "GGUF" little-endian
DEFAULT_ALIGNMENT = 32
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
          GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
          GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
          GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64}
# Tensor types GGUFReader presents as typed elements; the rest as bytes in rows of blocks.
_ELEMENT_TYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


class _Unsupported(Exception):
    """A layout this reader leaves to GGUFReader."""


class HeaderField:
    """One metadata value: `types` as GGUFReader's ([type], or [ARRAY, element type]) and
    `contents()` as its ReaderField.contents() gives (scalars, strings, lists)."""

    def __init__(self, buf, types: list[GGUFValueType], offset: int, count: int = 1):
        self._buf, self.types, self._offset, self._count = buf, types, offset, count

    def contents(self):
        kind = self.types[-1]
        if self.types[0] != GGUFValueType.ARRAY:
            if kind == GGUFValueType.STRING:
                return _string_at(self._buf, self._offset)[0]
            return struct.unpack_from(_SCALARS[kind], self._buf, self._offset)[0]
        if kind == GGUFValueType.STRING:
            out, off = [], self._offset
            for _ in range(self._count):
                s, off = _string_at(self._buf, off)
                out.append(s)
            return out
        return np.frombuffer(self._buf, dtype=_NUMPY[kind], count=self._count, offset=self._offset).tolist()


def _string_at(buf, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    return bytes(buf[off + 8:off + 8 + n]).decode("utf-8"), off + 8 + n


def _skip_value(buf, off: int, kind: GGUFValueType) -> int:
    if kind == GGUFValueType.STRING:
        return off + 8 + struct.unpack_from("<Q", buf, off)[0]
    return off + struct.calcsize(_SCALARS[kind])


class GGUFHeader:
    """`fields` (key -> HeaderField) and `tensors` (gguf ReaderTensor records, `field` None) of a
    little-endian GGUF file, as GGUFReader(path) has them."""

    def __init__(self, path: str | os.PathLike):
        self.data = np.memmap(path, mode="r")
        try:
            self._read(self.data)
        except (struct.error, ValueError) as e:  # a length or offset past the end of the file, say
            if isinstance(e, ValueError) and "GGUF" in str(e):
                raise
            raise ValueError(f"{os.fspath(path)}: not a readable GGUF file (truncated or corrupt: {e})") from None

    def _read(self, buf) -> None:
        magic, version = struct.unpack_from("<II", buf, 0)
        if magic != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        if version & 0xFFFF == 0 or version not in (2, 3):
            raise _Unsupported(f"GGUF version word {version:#x}")  # byte-swapped, or a version GGUFReader judges
        tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
        off = 24
        self.fields: dict[str, HeaderField] = {  # GGUFReader's pseudo-fields for the header words
            "GGUF.version": HeaderField(buf, [GGUFValueType.UINT32], 4),
            "GGUF.tensor_count": HeaderField(buf, [GGUFValueType.UINT64], 8),
            "GGUF.kv_count": HeaderField(buf, [GGUFValueType.UINT64], 16),
        }
        for _ in range(kv_count):
            key, off = _string_at(buf, off)
            (raw,) = struct.unpack_from("<I", buf, off)
            off += 4
            kind = GGUFValueType(raw)
            if kind != GGUFValueType.ARRAY:
                self.fields[key] = HeaderField(buf, [kind], off)
                off = _skip_value(buf, off, kind)
                continue
            elem_raw, count = struct.unpack_from("<IQ", buf, off)
            off += 12
            elem = GGUFValueType(elem_raw)
            if elem == GGUFValueType.ARRAY:
                raise _Unsupported(f"{key}: an array of arrays")
            self.fields[key] = HeaderField(buf, [GGUFValueType.ARRAY, elem], off, count)
            if elem == GGUFValueType.STRING:
                for _ in range(count):
                    off += 8 + struct.unpack_from("<Q", buf, off)[0]
            else:
                off += count * struct.calcsize(_SCALARS[elem])
        infos = []
        for _ in range(tensor_count):
            name, off = _string_at(buf, off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = np.array(struct.unpack_from(f"<{n_dims}Q", buf, off + 4), dtype=np.uint64)
            raw_type, rel = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            infos.append((name, dims, GGMLQuantizationType(raw_type), rel))
        align = self.fields.get("general.alignment")
        alignment = align.contents() if align is not None else DEFAULT_ALIGNMENT
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"GGUF general.alignment {alignment} is not a power of two")
        start = -(-off // alignment) * alignment
        self.tensors = []
        seen = set()
        for name, dims, ggml_type, rel in infos:
            if name in seen:
                raise ValueError(f"Found duplicated tensor with name {name}")
            seen.add(name)
            n_elems = int(np.prod(dims))
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elems * type_size // block_size
            np_dims = tuple(reversed(dims.tolist()))
            item_type = _ELEMENT_TYPES.get(ggml_type)
            if item_type is None:
                item_type, count = np.uint8, n_bytes
                np_dims = quant_shape_to_byte_shape(np_dims, ggml_type)
            else:
                count = n_elems
            data_offs = start + rel
            data = buf[data_offs:data_offs + count * np.dtype(item_type).itemsize].view(item_type).reshape(np_dims)
            self.tensors.append(ReaderTensor(name=name, tensor_type=ggml_type, shape=dims, n_elements=n_elems,
                                             n_bytes=n_bytes, data_offset=data_offs, data=data, field=None))


def open_gguf(path: str | os.PathLike) -> GGUFHeader | GGUFReader:
    """GGUFHeader(path), or GGUFReader(path) for a layout GGUFHeader does not read."""
    try:
        return GGUFHeader(path)
    except _Unsupported:
        return GGUFReader(path)
