"""Write a GGUF file's quantized tensors as BF16 (float tensors and every metadata key as they are):
the same weights llama.cpp and pagewise serve from the quantized file, dequantized, for the bf16 rows
of the single-sequence comparison.

    python benchmarks/llamacpp/to_bf16_gguf.py IN.gguf OUT.gguf
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
from gguf.quants import dequantize, quantize
from tqdm import tqdm

FLOAT = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def main(src: str, dst: str) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch)
    rewritten = (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE)
    for field in reader.fields.values():
        if field.name in rewritten or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself, or below
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)  # what llama.cpp's logs and llama-bench call it
    tensors = []
    for t in tqdm(reader.tensors, desc="dequantizing"):
        if t.tensor_type in FLOAT:
            data, kind = np.asarray(t.data), t.tensor_type
        else:
            floats = dequantize(t.data, t.tensor_type)  # [.., rows, columns] in the file's order
            data, kind = quantize(floats, gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16
        tensors.append((t.name, data, kind))
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
