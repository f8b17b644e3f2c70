"""keras-hub's MiT and SegFormer presets, as users download them, loaded without keras-hub.

A preset directory holds config.json and model.weights.h5 (a SegFormer segmenter adds task.json and
task.weights.h5, its classifier). Keras 3's .weights.h5 has `<path>/vars/<i>` arrays per layer, a
container's layers named by class with a counter, sub-layers by attribute. Mapped here by name:

  MiT (the MiTBackbone file at the root; a SegFormer file under layers/functional/, its feature extractor)
    layers/overlapping_patching_and_embedding[_i]/{proj, norm}  -> stage<i+1>_embed_{conv, norm}
    layers/hierarchical_transformer_encoder[_g]/...              -> stage<i+1>_block<j+1>_..., g counting the
        {norm1, attn/{q, k, v, proj, sr, norm}, norm2,              blocks of all stages in order
         mlp/{fc1, dwconv, fc2}}
    layers/layer_normalization[_i]                               -> stage<i+1>_norm
  SegFormer head (model.weights.h5)
    layers/dense[_n]                                             -> segformer_linear<level> (the level by the
                                                                    kernel's input width: the file's order is
                                                                    the graph's, deepest level first)
    layers/sequential/layers/{conv2d, batch_normalization}       -> segformer_fuse_{conv, bn}
  classifier (task.weights.h5)
    layers/conv2d                                                -> logits

Every array is checked (shape, nothing left over) before any is assigned, so a preset of another model
is refused and never half-loaded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import h5py
import keras
import numpy as np

from seg_train.config import ConfigError
from seg_train.models.mit import VARIANTS

log = logging.getLogger("seg_train")

# The order of each layer kind's arrays in a Keras 3 weights file (the order the layer creates them).
_ARRAY_NAMES = {
    keras.layers.LayerNormalization: ("gamma", "beta"),
    keras.layers.BatchNormalization: ("gamma", "beta", "moving_mean", "moving_variance"),
    keras.layers.DepthwiseConv2D: ("kernel", "bias"),
    keras.layers.Conv2D: ("kernel", "bias"),
    keras.layers.Dense: ("kernel", "bias"),
}

# config.json's MiTBackbone hyperparameters -> models/mit.py's Variant fields.
_MIT_KEYS = {"hidden_dims": "widths", "layerwise_depths": "depths", "layerwise_num_heads": "heads",
             "layerwise_sr_ratios": "sr_ratios", "layerwise_patch_sizes": "patch_sizes",
             "layerwise_strides": "patch_strides"}


def _indexed(name: str, i: int) -> str:
    """Keras' unique names in a container: 'dense', 'dense_1', 'dense_2', ..."""
    return name if i == 0 else f"{name}_{i}"


def _read_json(directory: Path, file: str, key: str, wanted: str) -> dict:
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


def _check_class(raw: dict, path: Path, wanted: str, hint: str = "") -> dict:
    got = raw.get("class_name")
    if got != wanted:
        raise ConfigError("preset of another model", str(path), f"expected a keras-hub {wanted}, got {got!r}{hint}")
    return raw["config"]


def _size_of(mit_config: dict) -> str | None:
    """The MiT size (mit_b0..mit_b5) a MiTBackbone config describes, or None."""
    for name, spec in VARIANTS.items():
        if all(list(mit_config.get(k) or []) == list(getattr(spec, f)) for k, f in _MIT_KEYS.items()):
            return name
    return None


def _check_mit(mit_config: dict, name: str, path: Path) -> None:
    got = _size_of(mit_config)
    if got != name:
        spec = VARIANTS[name]
        described = f"{got}'s" if got else f"hidden_dims {mit_config.get('hidden_dims')}, layerwise_depths " \
                                          f"{mit_config.get('layerwise_depths')}"
        raise ConfigError("preset of another model size", str(path),
                          f"expected {name} (hidden_dims {list(spec.widths)}, layerwise_depths {list(spec.depths)}: "
                          f"model.backbone), got {described}")


class _WeightsFile:
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


def _pairs(layer, arrays: list[np.ndarray], group: str, path: Path) -> list[tuple]:
    """(variable, array) for each of the layer's weights, shapes checked."""
    kind = next(k for k in _ARRAY_NAMES if isinstance(layer, k))
    names = _ARRAY_NAMES[kind][:len(layer.weights)]
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


def _mit_pairs(backbone: keras.Model, name: str, weights: _WeightsFile, prefix: str) -> list[tuple]:
    spec, pairs, g = VARIANTS[name], [], 0

    def take(ours: str, group: str):
        group = prefix + group
        pairs.extend(_pairs(backbone.get_layer(ours), weights.arrays(group), group, weights.path))

    for i in range(4):
        s = f"stage{i + 1}"
        embed = f"layers/{_indexed('overlapping_patching_and_embedding', i)}"
        take(f"{s}_embed_conv", f"{embed}/proj")
        take(f"{s}_embed_norm", f"{embed}/norm")
        for j in range(spec.depths[i]):
            block, ours = f"layers/{_indexed('hierarchical_transformer_encoder', g)}", f"{s}_block{j + 1}"
            g += 1
            for mine, theirs in (("norm1", "norm1"), ("attn_q", "attn/q"), ("attn_k", "attn/k"), ("attn_v", "attn/v"),
                                 ("attn_proj", "attn/proj"), ("norm2", "norm2"), ("ffn_fc1", "mlp/fc1"),
                                 ("ffn_dwconv", "mlp/dwconv"), ("ffn_fc2", "mlp/fc2")):
                take(f"{ours}_{mine}", f"{block}/{theirs}")
            if spec.sr_ratios[i] > 1:
                take(f"{ours}_attn_sr", f"{block}/attn/sr")
                take(f"{ours}_attn_sr_norm", f"{block}/attn/norm")
        take(f"{s}_norm", f"layers/{_indexed('layer_normalization', i)}")
    return pairs


def _assign(pairs: list[tuple]) -> int:
    for v, a in pairs:
        v.assign(a.astype(v.dtype))
    return len(pairs)


def _directory(directory, key: str, wanted: str) -> Path:
    d = Path(directory)
    if not d.is_dir():
        raise ConfigError("preset not found", key,
                          f"expected the directory of a keras-hub {wanted} preset (config.json, model.weights.h5), "
                          f"got {str(directory)!r}")
    return d


def check_mit_preset(name: str, directory) -> Path:
    """The preset directory of model.backbone_weights, its config.json checked to be a keras-hub MiTBackbone
    of size `name` (cheap: before the model is built)."""
    key = "model.backbone_weights"
    d = _directory(directory, key, "MiTBackbone")
    raw = _read_json(d, "config.json", key, "MiTBackbone")
    hint = " (a SegFormer preset goes in model.init_weights)" if raw.get("class_name") == "SegFormerBackbone" else ""
    _check_mit(_check_class(raw, d / "config.json", "MiTBackbone", hint), name, d / "config.json")
    return d


def load_mit_preset(backbone: keras.Model, name: str, directory) -> int:
    """model.backbone_weights: a keras-hub MiTBackbone preset into the MiT `backbone` (mit.mix_transformer)
    of size `name`. Returns the number of arrays loaded."""
    d = check_mit_preset(name, directory)
    weights = _WeightsFile(d / "model.weights.h5", f"MiTBackbone ({name})")
    try:
        pairs = _mit_pairs(backbone, name, weights, "")
        weights.check_all_read()
    finally:
        weights.close()
    n = _assign(pairs)
    log.info("loaded %d arrays of the keras-hub preset %s into the %s backbone", n, d, name)
    return n


def check_segformer_preset(name: str, directory, channels: int) -> tuple[Path, object]:
    """The preset directory of model.init_weights and its class count, its config.json and task.json
    checked to be a keras-hub SegFormer segmenter on MiT `name`, `channels` wide (before the model is built)."""
    key = "model.init_weights"
    d = _directory(directory, key, "SegFormerImageSegmenter")
    raw = _read_json(d, "config.json", key, "SegFormer")
    hint = " (an encoder-only MiT preset goes in model.backbone_weights)" if raw.get("class_name") == "MiTBackbone" \
        else ""
    config = _check_class(raw, d / "config.json", "SegFormerBackbone", hint)
    encoder = config.get("image_encoder")
    if not isinstance(encoder, dict) or not isinstance(encoder.get("config"), dict):
        raise ConfigError("not a keras-hub preset", str(d / "config.json"),
                          "a SegFormerBackbone config with its image_encoder (a MiTBackbone)")
    _check_mit(_check_class(encoder, d / "config.json", "MiTBackbone"), name, d / "config.json")
    if config.get("projection_filters") != channels:
        raise ConfigError("preset of another width", str(d / "config.json"),
                          f"expected projection_filters {channels} (model.segformer_channels), got "
                          f"{config.get('projection_filters')}: set model.segformer_channels to the preset's")
    task = _check_class(_read_json(d, "task.json", key, "SegFormerImageSegmenter"), d / "task.json",
                        "SegFormerImageSegmenter")
    return d, task.get("num_classes")


def load_segformer_preset(model: keras.Model, backbone: keras.Model, name: str, directory, num_classes: int,
                          channels: int) -> int:
    """model.init_weights: a keras-hub SegFormerImageSegmenter preset into `model` (on the MiT `backbone`).
    The classifier is loaded only when the preset has `num_classes` classes. Returns the arrays loaded."""
    d, preset_classes = check_segformer_preset(name, directory, channels)
    spec = VARIANTS[name]
    weights = _WeightsFile(d / "model.weights.h5", f"SegFormerBackbone ({name})")
    try:
        pairs = _mit_pairs(backbone, name, weights, "layers/functional/")
        levels = set()
        for i in range(len(spec.widths)):
            group = f"layers/{_indexed('dense', i)}"
            arrays = weights.arrays(group)
            width = arrays[0].shape[0] if arrays and arrays[0].ndim == 2 else None
            if width not in spec.widths or spec.widths.index(width) in levels:
                raise ConfigError("preset weights do not match", str(weights.path),
                                  f"expected a projection of one of the widths {list(spec.widths)} at '{group}', "
                                  f"got kernel shape {tuple(arrays[0].shape) if arrays else None}")
            level = spec.widths.index(width)
            levels.add(level)
            pairs += _pairs(model.get_layer(f"segformer_linear{level + 1}"), arrays, group, weights.path)
        for ours, group in (("segformer_fuse_conv", "layers/sequential/layers/conv2d"),
                            ("segformer_fuse_bn", "layers/sequential/layers/batch_normalization")):
            pairs += _pairs(model.get_layer(ours), weights.arrays(group), group, weights.path)
        weights.check_all_read()
    finally:
        weights.close()

    classifier = _WeightsFile(d / "task.weights.h5", "SegFormerImageSegmenter")
    try:
        arrays = classifier.arrays("layers/conv2d")
        classifier.check_all_read()
    finally:
        classifier.close()
    if preset_classes == num_classes:
        pairs += _pairs(model.get_layer("logits"), arrays, "layers/conv2d", classifier.path)
    n = _assign(pairs)
    log.info("loaded %d arrays of the keras-hub SegFormer preset %s (encoder, head%s)", n, d,
             ", classifier" if preset_classes == num_classes else "")
    if preset_classes != num_classes:
        log.info("model.init_weights: classifier not loaded: the preset has %s classes, data.num_classes is %d "
                 "(it starts from its initial weights)", preset_classes, num_classes)
    return n
