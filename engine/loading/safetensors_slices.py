"""A safetensors checkpoint tensor read lazily, so that a tensor-parallel rank reads only its slice.

SafetensorsFolder hands each weight_loader a SafetensorsSlice instead of a tensor. Its `narrow`,
integer index (one expert of a stacked tensor) and `to(dtype)` only record the region wanted; the
first torch op that needs the values (the loader's `param.copy_(loaded)`) reads just that region
through safe_open(...).get_slice, so weight_loaders work unchanged. Without tensor parallelism the
loaders take whole tensors, and whole tensors are read.
"""

from __future__ import annotations

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _stored_dtype(source) -> torch.dtype:
    name = source.get_dtype()
    if name in _DTYPES:
        return _DTYPES[name]
    # Any other type safetensors reads (float8 variants, ...): an empty region has it, at no cost.
    return source[tuple(slice(0, 0) for _ in source.get_shape())].dtype


class SafetensorsSlice:
    """A region of one checkpoint tensor: `index` holds, per stored dimension, a range (a slice
    with a step of 1) or an int (a dimension selected away). `on_read(tensor)` sees every read
    (SafetensorsFolder counts the bytes)."""

    def __init__(self, source, index: tuple | None = None, dtype: torch.dtype | None = None, on_read=None):
        self.source = source  # safetensors' PySafeSlice: safe_open(...).get_slice(name)
        self.index = index if index is not None else tuple(slice(0, n) for n in source.get_shape())
        self.stored_dtype = _stored_dtype(source)
        self.dtype = dtype or self.stored_dtype
        self.on_read = on_read
        self.shape = torch.Size(s.stop - s.start for s in self.index if isinstance(s, slice))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def _stored_dims(self) -> list[int]:
        """The stored dimension behind each dimension of this view."""
        return [d for d, s in enumerate(self.index) if isinstance(s, slice)]

    def _with(self, index: list) -> SafetensorsSlice:
        return SafetensorsSlice(self.source, tuple(index), self.dtype, self.on_read)

    def narrow(self, dim: int, start: int, length: int) -> SafetensorsSlice:
        dim = dim + self.ndim if dim < 0 else dim
        if not (0 <= dim < self.ndim and 0 <= start and length >= 0 and start + length <= self.shape[dim]):
            raise IndexError(f"narrow({dim}, {start}, {length}) is outside a tensor of shape {tuple(self.shape)}")
        index = list(self.index)
        d = self._stored_dims()[dim]
        index[d] = slice(index[d].start + start, index[d].start + start + length)
        return self._with(index)

    def __getitem__(self, key) -> SafetensorsSlice:
        keys = key if isinstance(key, tuple) else (key,)
        if len(keys) > self.ndim:
            raise IndexError(f"{len(keys)} indices for a tensor of {self.ndim} dimensions")
        index = list(self.index)
        for d, (k, n) in zip(self._stored_dims(), zip(keys, self.shape)):
            base = index[d].start
            if isinstance(k, int):
                if not -n <= k < n:
                    raise IndexError(f"index {k} is out of range for a dimension of {n}")
                index[d] = base + k % n
            elif isinstance(k, slice) and k.step in (None, 1):
                start, stop, _ = k.indices(n)
                index[d] = slice(base + start, base + max(start, stop))
            else:
                raise TypeError(f"a checkpoint tensor is indexed by ints and step-1 slices, not {k!r}")
        return self._with(index)

    def to(self, dtype: torch.dtype) -> SafetensorsSlice:
        return SafetensorsSlice(self.source, self.index, dtype, self.on_read)

    def read(self) -> torch.Tensor:
        """This region's values, read now (the stored dtype, cast to `dtype`)."""
        tensor = self.source[self.index]
        if self.on_read is not None:
            self.on_read(tensor)
        return tensor.to(self.dtype)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Any torch op on a slice (a loader's copy_ into its parameter) gets the values, read once.
        return func(*_read_all(args), **_read_all(kwargs or {}))

    def __repr__(self) -> str:
        return f"SafetensorsSlice(shape={tuple(self.shape)}, dtype={self.dtype}, index={self.index})"


def _read_all(value):
    """`value` with every SafetensorsSlice in it (in lists, tuples, dicts) read."""
    if isinstance(value, SafetensorsSlice):
        return value.read()
    if isinstance(value, (list, tuple)):
        return type(value)(_read_all(v) for v in value)
    if isinstance(value, dict):
        return {k: _read_all(v) for k, v in value.items()}
    return value
