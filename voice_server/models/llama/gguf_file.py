"""Fast, memory-mapped GGUF reader: metadata as plain Python values, tensors as numpy views.

NOTE: `gguf.GGUFReader` builds a numpy view per array element while parsing; for a 49k-token
vocabulary that alone took 6-10 s here, longer than dequantising every weight. This reader parses
the header with `struct` (about 0.1 s) and leaves the quantisation formats to `gguf.quants`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from voice_server.models.llama.dequant import dequantize_blocks_torch

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format (8 = string, 9 = array are handled separately).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    # ggml order: dims[0] is the contiguous (input) axis, so numpy's shape is reversed(dims).
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


class GGUFFile:
    """`metadata` (key -> str/int/float/bool/list) and `tensors` of one GGUF v2/v3 file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            self._buf = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (magic {self._buf[:4]!r})")
        self._pos = 4
        version, num_tensors, num_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (need >= 2)")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            num_dims = self._unpack("<I")
            dims = tuple(self._unpack("<Q") for _ in range(num_dims))
            infos.append(GGUFTensorInfo(name, dims, self._unpack("<I"), self._unpack("<Q")))
        self.tensors: list[GGUFTensorInfo] = infos
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self._data_start = -(-self._pos // alignment) * alignment

    @property
    def tensor_names(self) -> set[str]:
        return {info.name for info in self.tensors}

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The stored values: float arrays for F32/F16, else uint8 blocks [..., row_bytes]."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        qtype = GGMLQuantizationType(info.ggml_type)
        shape = tuple(reversed(info.dims))
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        num_bytes = int(np.prod(shape)) * type_size // block_size
        offset = self._data_start + info.offset
        if qtype == GGMLQuantizationType.F32:
            return np.frombuffer(self._buf, np.float32, num_bytes // 4, offset).reshape(shape)
        if qtype == GGMLQuantizationType.F16:
            return np.frombuffer(self._buf, np.float16, num_bytes // 2, offset).reshape(shape)
        data = np.frombuffer(self._buf, np.uint8, num_bytes, offset)
        return data.reshape(quant_shape_to_byte_shape(shape, qtype))

    def dequantize(self, info: GGUFTensorInfo) -> torch.Tensor:
        """fp32 values of shape reversed(dims), in fresh memory."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        raw = self.raw(info)
        fast = dequantize_blocks_torch(raw, info.ggml_type)
        if fast is not None:
            return fast
        return torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType(info.ggml_type)), dtype=np.float32))

    # -- header parsing ------------------------------------------------------------------------

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        size = self._unpack("<Q")
        text = self._buf[self._pos : self._pos + size].decode("utf-8", errors="replace")
        self._pos += size
        return text

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type == _STRING:
                return [self._string() for _ in range(count)]
            if item_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_type])
                items = np.frombuffer(self._buf, dtype, count, self._pos)
                self._pos += count * dtype.itemsize
                return [bool(x) for x in items] if item_type == 7 else items.tolist()
            return [self._value(item_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type} at byte {self._pos}")
        return self._unpack(_SCALAR_FORMATS[value_type])
