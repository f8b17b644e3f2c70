"""safetensors files read with NumPy alone: one model.safetensors, or the shards a model.safetensors.index.json
names (transformers' sharded checkpoints, e.g. a ViT-L or ViT-g).

The format by hand rather than the `safetensors` package: a file is an 8-byte little-endian header length N,
N bytes of JSON ({name: {"dtype", "shape", "data_offsets": [begin, end]}}, plus an optional "__metadata__"),
then one little-endian buffer the offsets index. That is a few dozen lines over np.memmap, while the package
would be a new dependency of every install whose NumPy API cannot return BF16 (NumPy has no such type; its
`safe_open(..., "numpy")` refuses the dtype, in which save_pretrained writes a model held in bfloat16, as large
checkpoints often are). BF16 is widened here by hand
(its 16 bits are a float32's upper half), F16 by NumPy. tests/test_safetensors_file.py holds this reader to
files the `safetensors` package writes (BF16, F16, F32, integer and sharded ones).

Everything is checked on the header before any tensor is read: a malformed file is one ConfigError line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from seg_train.config import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# safetensors dtype -> NumPy little-endian storage type (BF16: its raw 16 bits, widened in `read`).
_STORAGE = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
            "I8": "i1", "U8": "u1", "BOOL": "?"}
FLOATS = ("F64", "F32", "F16", "BF16")
# A header is JSON of a few hundred bytes per tensor; anything far larger is not a safetensors file.
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One .safetensors file: `tensors` {name: (dtype, shape)} from its header; `read(name)` the array."""

    def __init__(self, path):
        self.path = Path(path)
        where = str(self.path)
        expected = "a safetensors file: an 8-byte little-endian header length, a JSON header, a buffer"
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if not 0 < n <= min(size - 8, _MAX_HEADER):
                    raise ConfigError("not a safetensors file", where, expected)
                header = json.loads(f.read(n))
        except OSError as e:
            raise ConfigError("weights file unreadable", where, f"a readable safetensors file ({e.strerror})") \
                from None
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ConfigError("not a safetensors file", where, expected) from None
        if not isinstance(header, dict):
            raise ConfigError("not a safetensors file", where, expected)
        self._start, buffer = 8 + n, size - 8 - n
        self.tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._offsets: dict[str, tuple[int, int]] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
                ok = all(isinstance(d, int) and d >= 0 for d in shape) and 0 <= begin <= end <= buffer
            except (TypeError, KeyError, ValueError):
                ok = False
            if not ok:
                raise ConfigError("not a safetensors file", where,
                                  f"{expected}; tensor {name!r} has a malformed entry ({entry!r:.80})")
            if dtype in _STORAGE and end - begin != np.dtype(_STORAGE[dtype]).itemsize * int(np.prod(shape)):
                raise ConfigError("not a safetensors file", where,
                                  f"{expected}; tensor {name!r} ({dtype} {list(shape)}) spans {end - begin} bytes")
            self.tensors[name] = (dtype, shape)
            self._offsets[name] = (begin, end)

    def read(self, name: str, dtype=np.float32) -> np.ndarray:
        """Tensor `name` as a new array of `dtype` (floats widened exactly; BF16 by its bits)."""
        kind, shape = self.tensors[name]
        if kind not in _STORAGE:
            raise ConfigError("tensor of an unsupported dtype", str(self.path),
                              f"one of {', '.join(_STORAGE)} for {name!r}, got {kind}")
        begin, end = self._offsets[name]
        raw = np.fromfile(self.path, dtype=np.uint8, count=end - begin, offset=self._start + begin)
        values = raw.view(_STORAGE[kind])
        if kind == "BF16":  # a bfloat16 is the upper 16 bits of the float32 of the same value
            values = (values.astype(np.uint32) << 16).view(np.float32)
        return values.reshape(shape).astype(dtype)


class Checkpoint:
    """The safetensors weights of a transformers folder: model.safetensors, or model.safetensors.index.json and
    the shards its weight_map names. `tensors` {name: (dtype, shape)} over all of them; `read(name)`."""

    def __init__(self, directory):
        d = Path(directory)
        self.directory = d
        if (d / SINGLE).is_file():
            self.files = {SINGLE: SafetensorsFile(d / SINGLE)}
            self._where = {name: SINGLE for name in self.files[SINGLE].tensors}
            self.path = d / SINGLE
        elif (d / INDEX).is_file():
            self.path = d / INDEX
            self._where = self._read_index()
            self.files = {shard: SafetensorsFile(d / shard) for shard in sorted(set(self._where.values()))}
            for shard, file in self.files.items():
                for name in file.tensors:
                    if self._where.get(name) != shard:
                        raise ConfigError("sharded checkpoint inconsistent", str(file.path),
                                          f"only the tensors {INDEX} maps to {shard}, found {name!r}")
            for name, shard in self._where.items():
                if name not in self.files[shard].tensors:
                    raise ConfigError("sharded checkpoint inconsistent", str(self.files[shard].path),
                                      f"tensor {name!r}, which {INDEX} maps to this shard")
        else:
            raise ConfigError("no safetensors weights", str(d),
                              f"{SINGLE} or {INDEX} with its shards (a pytorch_model.bin is not read: save the "
                              f"model again with transformers' save_pretrained, which writes safetensors)")
        self.tensors = {name: self.files[shard].tensors[name] for name, shard in self._where.items()}

    def _read_index(self) -> dict[str, str]:
        try:
            index = json.loads(self.path.read_text())
            weight_map = index["weight_map"]
            ok = isinstance(weight_map, dict) and all(isinstance(v, str) and "/" not in v and v.endswith(
                ".safetensors") for v in weight_map.values())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError):
            ok = False
        if not ok:
            raise ConfigError("not a sharded checkpoint index", str(self.path),
                              'JSON with a "weight_map" of tensor names to .safetensors files in its folder')
        missing = sorted({v for v in weight_map.values() if not (self.directory / v).is_file()})
        if missing:
            raise ConfigError("shard not found", str(self.directory / missing[0]),
                              f"every shard {INDEX} names ({len(set(weight_map.values()))} files)")
        return dict(weight_map)

    def file_of(self, name: str) -> Path:
        """The file holding tensor `name`."""
        return self.files[self._where[name]].path

    def read(self, name: str, dtype=np.float32) -> np.ndarray:
        return self.files[self._where[name]].read(name, dtype)
