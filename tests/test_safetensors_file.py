"""models/safetensors_file.py (safetensors read by hand) held to files the `safetensors` package writes: every
dtype seg-train reads (BF16 through ml_dtypes' bfloat16, which the package stores as BF16), a scalar and an empty
tensor, a sharded checkpoint (shards by the package, the index as transformers writes it), and the sharded folder
transformers itself saved (tests/fixtures/transformers/dinov2_registers, read by the package's own reader). Then
the malformed files, each refused in one line.
"""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from seg_train.config import ConfigError
from seg_train.models.safetensors_file import Checkpoint, SafetensorsFile
from tests.helpers import TRANSFORMERS_FIXTURES


def _arrays(rng):
    return {"f32": rng.normal(size=(3, 5)).astype(np.float32),
            "f16": rng.normal(size=(4, 2)).astype(np.float16),
            "bf16": rng.normal(size=(2, 3, 4)).astype(ml_dtypes.bfloat16),
            "f64": rng.normal(size=(7,)),
            "i64": rng.integers(-9, 9, (2, 2)).astype(np.int64),
            "u8": rng.integers(0, 255, (5,)).astype(np.uint8),
            "scalar": np.array(2.5, np.float32),
            "empty": np.zeros((0, 3), np.float32)}


def test_every_dtype_reads_back_as_the_package_wrote_it(tmp_path):
    """Fails for: BF16 widened wrongly (read as F16, shifted the other way, its bytes swapped), F16 not widened,
    offsets counted from the file's start instead of the buffer's, the header length read in 4 bytes or big-endian,
    a scalar's or an empty tensor's shape lost."""
    arrays = _arrays(np.random.default_rng(0))
    save_file(arrays, tmp_path / "x.safetensors", metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert {k: d for k, (d, _) in f.tensors.items()} == {
        "f32": "F32", "f16": "F16", "bf16": "BF16", "f64": "F64", "i64": "I64", "u8": "U8", "scalar": "F32",
        "empty": "F32"}
    for name, a in arrays.items():
        got = f.read(name)
        assert got.dtype == np.float32 and got.shape == a.shape, name
        np.testing.assert_array_equal(got, a.astype(np.float32))  # bf16 -> f32 by ml_dtypes: exact
        assert f.tensors[name][1] == a.shape
    np.testing.assert_array_equal(f.read("i64", np.int64), arrays["i64"])


def test_sharded_checkpoint_reads_every_shard(tmp_path):
    """model.safetensors.index.json + shards (the package writes the shards): every tensor from its own shard.
    Fails for: one shard read for all, the weight_map ignored, a tensor of another shard taken."""
    rng = np.random.default_rng(1)
    shards = {"model-00001-of-00002.safetensors": {"a": rng.normal(size=(2, 2)).astype(np.float32),
                                                   "b": rng.normal(size=(3,)).astype(ml_dtypes.bfloat16)},
              "model-00002-of-00002.safetensors": {"c": rng.normal(size=(4, 1)).astype(np.float32)}}
    for name, arrays in shards.items():
        save_file(arrays, tmp_path / name, metadata={"format": "pt"})
    weight_map = {k: shard for shard, arrays in shards.items() for k in arrays}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 42},
                                                                      "weight_map": weight_map}))
    ckpt = Checkpoint(tmp_path)
    assert sorted(ckpt.tensors) == ["a", "b", "c"]
    for shard, arrays in shards.items():
        for k, a in arrays.items():
            np.testing.assert_array_equal(ckpt.read(k), a.astype(np.float32))
            assert ckpt.file_of(k).name == shard


def test_transformers_sharded_folder_is_the_packages_reading():
    """The folder transformers' save_pretrained sharded (5 shards): each tensor as the package's reader gives it."""
    folder = TRANSFORMERS_FIXTURES / "dinov2_registers"
    ckpt = Checkpoint(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 5 and sorted(ckpt.tensors) == sorted(index)
    for name, shard in index.items():
        with safe_open(folder / shard, "numpy") as f:
            np.testing.assert_array_equal(ckpt.read(name), f.get_tensor(name))


def _error(path, cls=SafetensorsFile):
    with pytest.raises(ConfigError) as e:
        cls(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_malformed_files_refused_in_one_line(tmp_path):
    """Fails for: a truncated buffer, a header longer than the file, a header that is not JSON or whose offsets
    do not fit the dtype and shape, read on as if whole (garbage weights or an exception's traceback)."""
    good = tmp_path / "good.safetensors"
    save_file({"w": np.ones((4, 4), np.float32)}, good)
    raw = good.read_bytes()
    cases = {"truncated": raw[:-8], "long header": struct.pack("<Q", len(raw)) + raw[8:], "short": raw[:5],
             "not json": struct.pack("<Q", 4) + b"{{{{" + raw[8:]}
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    header["w"]["shape"] = [4, 5]
    text = json.dumps(header).encode()
    cases["offsets"] = struct.pack("<Q", len(text)) + text + b"\0" * 64
    for name, data in cases.items():
        (tmp_path / f"{name}.safetensors").write_bytes(data)
        message = _error(tmp_path / f"{name}.safetensors")
        assert message.startswith("not a safetensors file ("), (name, message)


def test_inconsistent_shards_refused_in_one_line(tmp_path):
    """Fails for: a shard the index names but the folder lacks, a tensor the index maps to a shard that does not
    hold it, or a shard holding a tensor the index does not map there, accepted."""
    save_file({"a": np.ones(2, np.float32)}, tmp_path / "s1.safetensors")
    index = tmp_path / "model.safetensors.index.json"

    def refused(weight_map):
        index.write_text(json.dumps({"weight_map": weight_map}))
        return _error(tmp_path, Checkpoint)

    assert refused({"a": "s1.safetensors", "b": "s2.safetensors"}).startswith("shard not found (")
    assert "'b', which model.safetensors.index.json maps" in refused({"a": "s1.safetensors", "b": "s1.safetensors"})
    assert "only the tensors model.safetensors.index.json maps to s1.safetensors, found 'a'" in refused(
        {"b": "s1.safetensors"})
    index.write_text("[]")
    assert _error(tmp_path, Checkpoint).startswith("not a sharded checkpoint index (")
    index.unlink()
    assert _error(tmp_path, Checkpoint).startswith("no safetensors weights (")
