"""model.backbone_weights for the conv backbones: the ImageNet weight files keras-applications publishes (Keras 2
legacy .h5), read with h5py and matched to the backbone layer by layer, by name."""

from __future__ import annotations

import logging
from pathlib import Path

import h5py
import keras
import numpy as np

from seg_train.config import ConfigError, exception_text
from seg_train.models.cnn.backbones import published_layout

log = logging.getLogger("seg_train")

# The include_top=False ImageNet files keras.applications downloads (Keras 2 legacy .h5).
WEIGHT_FILES = {
    "mobilenetv2": "mobilenet_v2_weights_tf_dim_ordering_tf_kernels_1.0_224_no_top.h5",
    "mobilenetv3_large": "weights_mobilenet_v3_large_224_1.0_float_no_top_v2.h5",
    "mobilenetv3_small": "weights_mobilenet_v3_small_224_1.0_float_no_top_v2.h5",
    "resnet50": "resnet50_weights_tf_dim_ordering_tf_kernels_notop.h5",
    "resnet101": "resnet101_weights_tf_dim_ordering_tf_kernels_notop.h5",
}
# The classifier layers of include_top=True files: skipped when a user gives such a file.
_CLASSIFIER_LAYERS = {"Logits", "predictions", "probs", "conv_2", "logits"}


def _h5_names(group, attr: str) -> list[str]:
    """A list attribute of a Keras legacy h5 group; Keras splits long ones into attr0, attr1, ..."""
    if attr in group.attrs:
        values = list(group.attrs[attr])
    else:
        values, i = [], 0
        while f"{attr}{i}" in group.attrs:
            values.extend(group.attrs[f"{attr}{i}"])
            i += 1
    return [v.decode("utf8") if isinstance(v, bytes) else str(v) for v in values]


def _short_name(weight_name: str) -> str:
    """'block_1_depthwise/depthwise_kernel:0' -> 'kernel': the variable's name as Keras 3 gives it."""
    short = weight_name.split("/")[-1].split(":")[0]
    return "kernel" if short == "depthwise_kernel" else short


def read_keras_h5(path: Path, name: str) -> dict[str, list[tuple[str, np.ndarray]]]:
    """layer name -> [(weight name, array)] of a Keras 2 legacy .h5 weights file (layers with weights)."""
    where = str(path)
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise ConfigError("cannot read backbone weights", where,
                          f"{_expected(name)}, an HDF5 file ({exception_text(e)})") from None
    with f:
        group = f["model_weights"] if "model_weights" in f else f  # a whole model saved with model.save()
        if "layer_names" not in group.attrs and "layer_names0" not in group.attrs:
            raise ConfigError("not a Keras 2 weights file", where,
                              f"{_expected(name)}: a legacy Keras .h5 file with a 'layer_names' attribute "
                              "(Keras 3 '.weights.h5' files have another layout)")
        in_file = {}
        try:
            for layer_name in _h5_names(group, "layer_names"):
                layer_group = group[layer_name]
                weight_names = _h5_names(layer_group, "weight_names")
                if weight_names:
                    in_file[layer_name] = [(w, np.asarray(layer_group[w])) for w in weight_names]
        except (KeyError, OSError, ValueError) as e:  # a listed layer or array missing, a truncated file
            raise ConfigError("corrupt backbone weights file", where,
                              f"{_expected(name)} ({exception_text(e)})") from None
    return in_file


def _expected(name: str) -> str:
    return f"expected the {name} ImageNet weights of keras-applications ({WEIGHT_FILES[name]})"


def _layers_with_weights(model) -> dict:
    """name -> layer for every layer with weights of `model`, nested models included (ResNet's BGR wrapper)."""
    found = {}
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            found.update(_layers_with_weights(layer))
        elif layer.weights:
            found[layer.name] = layer
    return found


def load_keras_h5(backbone: keras.Model, in_file: dict, path: Path, name: str, tail=()) -> int:
    """Copies a Keras 2 legacy .h5 weights file (what keras-applications publishes) into `backbone`.

    `in_file`: `read_keras_h5`'s result, its layer names mapped to the backbone's. Not Keras 3's `load_weights`,
    which matches layers by position, so a file of another architecture with the same shapes loads silently.
    Here layers match by name, both ways (the classifier and `tail`, the architecture's layers after the
    backbone's high-level output, excepted), and every shape must match. Within a layer, arrays match by variable
    name, or in order. Returns the number of arrays loaded.
    """
    where, expected = str(path), _expected(name)
    in_model = _layers_with_weights(backbone)
    missing = [n for n in in_model if n not in in_file]
    extra = [n for n in in_file if n not in in_model and n not in _CLASSIFIER_LAYERS and n not in tail]
    if missing or extra:
        problems = []
        if missing:
            problems.append(f"{len(missing)} of the backbone's {len(in_model)} layers are not in the file "
                            f"(e.g. {', '.join(missing[:3])})")
        if extra:
            problems.append(f"the file has {len(extra)} layers the backbone has not (e.g. {', '.join(extra[:3])})")
        raise ConfigError("weights file does not match the backbone", where, f"{expected}; {'; '.join(problems)}")
    pairs = []
    for layer_name, layer in in_model.items():
        variables, arrays = list(layer.weights), in_file[layer_name]
        if len(arrays) != len(variables):
            raise ConfigError("weights file does not match the backbone", where,
                              f"{expected}; layer {layer_name} has {len(variables)} weights, "
                              f"the file {len(arrays)}")
        by_name = {_short_name(w): a for w, a in arrays}
        if len(by_name) == len(arrays) and set(by_name) == {v.name for v in variables}:
            matched = [(v, by_name[v.name]) for v in variables]
        else:
            matched = list(zip(variables, (a for _, a in arrays)))
        for v, a in matched:
            if tuple(a.shape) != tuple(v.shape):
                raise ConfigError("weights file does not match the backbone", where,
                                  f"{expected}; {layer_name}/{v.name} has shape {tuple(v.shape)}, "
                                  f"the file {tuple(a.shape)}")
        pairs.extend(matched)
    for v, a in pairs:
        v.assign(a.astype(v.dtype))
    return len(pairs)


def check_file(name: str, path) -> None:
    """model.backbone_weights for the conv backbone `name`, checked before the model is built: a published file."""
    if name not in WEIGHT_FILES:
        raise ConfigError("no pretrained weights for this backbone", "model.backbone_weights",
                          f"expected null for backbone {name!r}")
    if not Path(path).is_file():
        raise ConfigError("backbone weights not found", "model.backbone_weights",
                          f"expected a Keras ImageNet weights file ({WEIGHT_FILES[name]}), got {str(path)!r}")


def load(backbone: keras.Model, name: str, path) -> int:
    """The ImageNet file `path` into the conv backbone `name` (built by models/cnn/backbones.py). Returns the
    number of arrays loaded."""
    check_file(name, path)
    file_name, tail = published_layout(name)
    in_file = {file_name(k): v for k, v in read_keras_h5(Path(path), name).items()}
    n = load_keras_h5(backbone, in_file, Path(path), name, tail)
    log.info("loaded %d ImageNet weight arrays into the %s backbone from %s", n, name, path)
    return n
