"""keras-hub preset directories, as users download them, read without keras-hub: the one reader every model
family's preset mapping uses (models/mit/presets.py, models/dino/presets.py).

A preset directory holds config.json and model.weights.h5 (a task such as a segmenter adds task.json and
task.weights.h5). Keras 3's .weights.h5 has `<path>/vars/<i>` arrays per layer, a container's layers named by class
with a counter (`indexed`), sub-layers by attribute. A family maps those paths onto its own layers; here: the
directory and JSON checks, the weights file read group by group with what was left unread, the (variable, array)
pairs with their shapes checked, and the assignment, made only once every array has been checked, so a preset of
another model is refused and never half-loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import keras
import numpy as np

from seg_train.config import ConfigError

# The order of each layer kind's arrays in a Keras 3 weights file (the order the layer creates them).
ARRAY_NAMES = {
    keras.layers.LayerNormalization: ("gamma", "beta"),
    keras.layers.BatchNormalization: ("gamma", "beta", "moving_mean", "moving_variance"),
    keras.layers.DepthwiseConv2D: ("kernel", "bias"),
    keras.layers.Conv2D: ("kernel", "bias"),
    keras.layers.Dense: ("kernel", "bias"),
}

def indexed(name: str, i: int) -> str:
    """Keras' unique names in a container: 'dense', 'dense_1', 'dense_2', ..."""
    return name if i == 0 else f"{name}_{i}"


def read_json(directory: Path, file: str, key: str, wanted: str) -> dict:
    path = directory / file
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("not a keras-hub preset", str(path),
                          f"expected the {file} of a keras-hub {wanted} preset ({key} takes the unpacked preset "
                          "directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError("unreadable preset file", str(path), f"the JSON keras-hub writes ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("config"), dict):
        raise ConfigError("not a keras-hub preset", str(path), f"a keras-hub {wanted} config (class_name, config)")
    return raw


def check_class(raw: dict, path: Path, wanted: str, hint: str = "") -> dict:
    got = raw.get("class_name")
    if got != wanted:
        raise ConfigError("preset of another model", str(path), f"expected a keras-hub {wanted}, got {got!r}{hint}")
    return raw["config"]


class WeightsFile:
    """The arrays of a Keras 3 .weights.h5 file by group, remembering which were taken."""

    def __init__(self, path: Path, wanted: str):
        self.path, self.wanted = path, wanted
        try:
            self.file = h5py.File(path, "r")
        except (OSError, FileNotFoundError) as e:
            raise ConfigError("cannot read preset weights", str(path),
                              f"the {path.name} of a keras-hub {wanted} preset, an HDF5 file ({e})") from None
        self.unread = set()
        self.file.visititems(lambda name, obj: self.unread.add(name) if isinstance(obj, h5py.Dataset) else None)
        # What the segmenter's training saved beside its weights (the optimizer's counters).
        self.unread = {n for n in self.unread if not n.startswith("optimizer/")}

    def arrays(self, group: str) -> list[np.ndarray]:
        vars_group = self.file.get(f"{group}/vars")
        if not isinstance(vars_group, h5py.Group) or not len(vars_group):
            raise ConfigError("preset weights do not match", str(self.path),
                              f"expected keras-hub's {self.wanted} layout: no arrays at '{group}'")
        try:
            out = [np.asarray(vars_group[str(i)]) for i in range(len(vars_group))]
        except (KeyError, OSError, ValueError) as e:
            raise ConfigError("corrupt preset weights", str(self.path), f"readable arrays at '{group}' ({e})") from None
        self.unread -= {f"{group}/vars/{i}" for i in range(len(out))}
        return out

    def check_all_read(self) -> None:
        if self.unread:
            left = sorted(self.unread)
            raise ConfigError("preset weights do not match", str(self.path),
                              f"expected keras-hub's {self.wanted} layout with nothing else; "
                              f"{len(left)} arrays not of this model, e.g. '{left[0]}'")

    def close(self) -> None:
        self.file.close()


def layer_pairs(layer, arrays: list[np.ndarray], group: str, path: Path) -> list[tuple]:
    """(variable, array) for each of the layer's weights, shapes checked."""
    kind = next(k for k in ARRAY_NAMES if isinstance(layer, k))
    names = ARRAY_NAMES[kind][:len(layer.weights)]
    variables = {v.name: v for v in layer.weights}
    if len(arrays) != len(variables) or set(names) != set(variables):
        raise ConfigError("preset weights do not match", str(path),
                          f"expected {len(variables)} arrays for {layer.name} at '{group}', got {len(arrays)}")
    out = []
    for n, a in zip(names, arrays):
        v = variables[n]
        if tuple(a.shape) != tuple(v.shape):
            raise ConfigError("preset weights do not match", str(path),
                              f"expected {layer.name}/{n} of shape {tuple(v.shape)} at '{group}/vars', "
                              f"got {tuple(a.shape)}")
        out.append((v, a))
    return out


def assign(pairs: list[tuple]) -> int:
    for v, a in pairs:
        v.assign(a.astype(v.dtype))
    return len(pairs)


def preset_directory(directory, key: str, wanted: str) -> Path:
    d = Path(directory)
    if not d.is_dir():
        raise ConfigError("preset not found", key,
                          f"expected the directory of a keras-hub {wanted} preset (config.json, model.weights.h5), "
                          f"got {str(directory)!r}")
    return d
