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

import logging
from pathlib import Path

import keras

from seg_train.config import ConfigError
from seg_train.config.variants import MIT_VARIANTS
from seg_train.models.keras_hub import (
    WeightsFile,
    assign,
    check_class,
    indexed,
    layer_pairs,
    preset_directory,
    read_json,
)

log = logging.getLogger("seg_train")

# config.json's MiTBackbone hyperparameters -> models/mit/encoder.py's Variant fields.
_MIT_KEYS = {"hidden_dims": "widths", "layerwise_depths": "depths", "layerwise_num_heads": "heads",
             "layerwise_sr_ratios": "sr_ratios", "layerwise_patch_sizes": "patch_sizes",
             "layerwise_strides": "patch_strides"}


def _size_of(mit_config: dict) -> str | None:
    """The MiT size (mit_b0..mit_b5) a MiTBackbone config describes, or None."""
    for name, spec in MIT_VARIANTS.items():
        if all(list(mit_config.get(k) or []) == list(getattr(spec, f)) for k, f in _MIT_KEYS.items()):
            return name
    return None


def _check_mit(mit_config: dict, name: str, path: Path) -> None:
    got = _size_of(mit_config)
    if got != name:
        spec = MIT_VARIANTS[name]
        described = f"{got}'s" if got else f"hidden_dims {mit_config.get('hidden_dims')}, layerwise_depths " \
                                          f"{mit_config.get('layerwise_depths')}"
        raise ConfigError("preset of another model size", str(path),
                          f"expected {name} (hidden_dims {list(spec.widths)}, layerwise_depths {list(spec.depths)}: "
                          f"model.backbone), got {described}")


def _mit_pairs(backbone: keras.Model, name: str, weights: WeightsFile, prefix: str) -> list[tuple]:
    spec, pairs, g = MIT_VARIANTS[name], [], 0

    def take(ours: str, group: str):
        group = prefix + group
        pairs.extend(layer_pairs(backbone.get_layer(ours), weights.arrays(group), group, weights.path))

    for i in range(4):
        s = f"stage{i + 1}"
        embed = f"layers/{indexed('overlapping_patching_and_embedding', i)}"
        take(f"{s}_embed_conv", f"{embed}/proj")
        take(f"{s}_embed_norm", f"{embed}/norm")
        for j in range(spec.depths[i]):
            block, ours = f"layers/{indexed('hierarchical_transformer_encoder', g)}", f"{s}_block{j + 1}"
            g += 1
            for mine, theirs in (("norm1", "norm1"), ("attn_q", "attn/q"), ("attn_k", "attn/k"), ("attn_v", "attn/v"),
                                 ("attn_proj", "attn/proj"), ("norm2", "norm2"), ("ffn_fc1", "mlp/fc1"),
                                 ("ffn_dwconv", "mlp/dwconv"), ("ffn_fc2", "mlp/fc2")):
                take(f"{ours}_{mine}", f"{block}/{theirs}")
            if spec.sr_ratios[i] > 1:
                take(f"{ours}_attn_sr", f"{block}/attn/sr")
                take(f"{ours}_attn_sr_norm", f"{block}/attn/norm")
        take(f"{s}_norm", f"layers/{indexed('layer_normalization', i)}")
    return pairs


def check_mit_preset(directory, name: str) -> Path:
    """The preset directory of model.backbone_weights, its config.json checked to be a keras-hub MiTBackbone
    of size `name` (cheap: before the model is built)."""
    key = "model.backbone_weights"
    d = preset_directory(directory, key, "MiTBackbone")
    raw = read_json(d, "config.json", key, "MiTBackbone")
    hint = " (a SegFormer preset goes in model.init_weights)" if raw.get("class_name") == "SegFormerBackbone" else ""
    _check_mit(check_class(raw, d / "config.json", "MiTBackbone", hint), name, d / "config.json")
    return d


def load_mit_preset(backbone: keras.Model, directory, name: str) -> int:
    """model.backbone_weights: a keras-hub MiTBackbone preset into the MiT `backbone` (mit.mix_transformer)
    of size `name`. Returns the number of arrays loaded."""
    d = check_mit_preset(directory, name)
    weights = WeightsFile(d / "model.weights.h5", f"MiTBackbone ({name})")
    try:
        pairs = _mit_pairs(backbone, name, weights, "")
        weights.check_all_read()
    finally:
        weights.close()
    n = assign(pairs)
    log.info("loaded %d arrays of the keras-hub preset %s into the %s backbone", n, d, name)
    return n


def check_segformer_preset(directory, name: str, channels: int) -> tuple[Path, object]:
    """The preset directory of model.init_weights and its class count, its config.json and task.json
    checked to be a keras-hub SegFormer segmenter on MiT `name`, `channels` wide (before the model is built)."""
    key = "model.init_weights"
    d = preset_directory(directory, key, "SegFormerImageSegmenter")
    raw = read_json(d, "config.json", key, "SegFormer")
    hint = " (an encoder-only MiT preset goes in model.backbone_weights)" if raw.get("class_name") == "MiTBackbone" \
        else ""
    config = check_class(raw, d / "config.json", "SegFormerBackbone", hint)
    encoder = config.get("image_encoder")
    if not isinstance(encoder, dict) or not isinstance(encoder.get("config"), dict):
        raise ConfigError("not a keras-hub preset", str(d / "config.json"),
                          "a SegFormerBackbone config with its image_encoder (a MiTBackbone)")
    _check_mit(check_class(encoder, d / "config.json", "MiTBackbone"), name, d / "config.json")
    if config.get("projection_filters") != channels:
        raise ConfigError("preset of another width", str(d / "config.json"),
                          f"expected projection_filters {channels} (model.segformer_channels), got "
                          f"{config.get('projection_filters')}: set model.segformer_channels to the preset's")
    task = check_class(read_json(d, "task.json", key, "SegFormerImageSegmenter"), d / "task.json",
                        "SegFormerImageSegmenter")
    return d, task.get("num_classes")


def load_segformer_preset(model: keras.Model, backbone: keras.Model, directory, name: str, num_classes: int,
                          channels: int) -> int:
    """model.init_weights: a keras-hub SegFormerImageSegmenter preset into `model` (on the MiT `backbone`).
    The classifier is loaded only when the preset has `num_classes` classes. Returns the arrays loaded."""
    d, preset_classes = check_segformer_preset(directory, name, channels)
    spec = MIT_VARIANTS[name]
    weights = WeightsFile(d / "model.weights.h5", f"SegFormerBackbone ({name})")
    try:
        pairs = _mit_pairs(backbone, name, weights, "layers/functional/")
        levels = set()
        for i in range(len(spec.widths)):
            group = f"layers/{indexed('dense', i)}"
            arrays = weights.arrays(group)
            width = arrays[0].shape[0] if arrays and arrays[0].ndim == 2 else None
            if width not in spec.widths or spec.widths.index(width) in levels:
                raise ConfigError("preset weights do not match", str(weights.path),
                                  f"expected a projection of one of the widths {list(spec.widths)} at '{group}', "
                                  f"got kernel shape {tuple(arrays[0].shape) if arrays else None}")
            level = spec.widths.index(width)
            levels.add(level)
            pairs += layer_pairs(model.get_layer(f"segformer_linear{level + 1}"), arrays, group, weights.path)
        for ours, group in (("segformer_fuse_conv", "layers/sequential/layers/conv2d"),
                            ("segformer_fuse_bn", "layers/sequential/layers/batch_normalization")):
            pairs += layer_pairs(model.get_layer(ours), weights.arrays(group), group, weights.path)
        weights.check_all_read()
    finally:
        weights.close()

    classifier = WeightsFile(d / "task.weights.h5", "SegFormerImageSegmenter")
    try:
        arrays = classifier.arrays("layers/conv2d")
        classifier.check_all_read()
    finally:
        classifier.close()
    if preset_classes == num_classes:
        pairs += layer_pairs(model.get_layer("logits"), arrays, "layers/conv2d", classifier.path)
    n = assign(pairs)
    log.info("loaded %d arrays of the keras-hub SegFormer preset %s (encoder, head%s)", n, d,
             ", classifier" if preset_classes == num_classes else "")
    if preset_classes != num_classes:
        log.info("model.init_weights: classifier not loaded: the preset has %s classes, data.num_classes is %d "
                 "(it starts from its initial weights)", preset_classes, num_classes)
    return n
