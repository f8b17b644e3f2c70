"""Backbones returning low-level features (stride 2, 4 or 8) and high-level features at the output stride.

The Mix Transformers (mit_b0..mit_b5) are models/mit.py's, at a fixed output stride of 32.

The head picks the low-level strides (DeepLabV3+: 4, optionally 2; LR-ASPP: 8).

keras.applications models are rebuilt with `keras.models.clone_model`: the last stages trade stride
for dilation (DeepLab's atrous backbone), and every BN layer gets the configured momentum and
`synchronized` flag (else the backbone's BN would stay per tower). ImageNet weights are loaded by
layer name (`load_keras_h5`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import h5py
import keras
import numpy as np
from keras import layers

from seg_train.config import ConfigError, exception_text
from seg_train.config.backbones import MIT_BACKBONES
from seg_train.models.layer_choice import LayerChoice
from seg_train.models.mit import mix_transformer
from seg_train.models.presets import check_mit_preset, load_mit_preset

log = logging.getLogger("seg_train")


def tiny(output_stride: int, bn_momentum: float, choice: LayerChoice, width: int = 16,
         low_strides: tuple[int, ...] = (4,)) -> keras.Model:
    """A small conv net for tests and the demo: features at `low_strides`, then at stride 16 (or 8)."""
    inp = keras.Input((None, None, 3), name="image")

    def block(x, filters, stride, dilation, name):
        conv = choice.conv2d_class(dilation)  # dilated: fast and exact (models/atrous.py)
        x = conv(filters, 3, strides=stride, dilation_rate=dilation, padding="same", use_bias=False,
                 name=f"{name}_conv")(x)
        x = choice.batch_norm(bn_momentum, 1e-3, f"{name}_bn")(x)
        return layers.ReLU(name=f"{name}_relu")(x)

    x = block(inp, width, 2, 1, "stem")                       # /2
    found = {2: x}
    x = block(x, width * 2, 2, 1, "stage1")                   # /4
    x = found[4] = block(x, width * 2, 1, 1, "stage1b")
    x = found[8] = block(x, width * 4, 2, 1, "stage2")        # /8
    s3 = 1 if output_stride == 8 else 2
    d3 = 2 if output_stride == 8 else 1
    x = block(x, width * 8, s3, d3, "stage3")                 # /16 (or /8 dilated)
    x = block(x, width * 8, 1, 2 * d3, "stage3b")
    return keras.Model(inp, [found[s] for s in low_strides] + [x], name="tiny")


def _mobilenetv2_plan(output_stride, base=None):
    """layer name -> config changes turning MobileNetV2 into an atrous backbone."""
    changes = {}
    rate = 1
    # (block with the stride-2 depthwise, blocks that follow it until the next strided block)
    stages = [(6, range(7, 13)), (13, range(14, 17))]
    for block, following in stages:
        if (block == 6 and output_stride == 8) or block == 13:
            changes[f"block_{block}_pad"] = {"padding": ((rate, rate), (rate, rate))}
            changes[f"block_{block}_depthwise"] = {"strides": (1, 1), "dilation_rate": (rate, rate)}
            rate *= 2
        for b in following:
            changes[f"block_{b}_depthwise"] = {"dilation_rate": (rate, rate), "padding": "same"}
    return changes


def _mnv3_prefix(block: int) -> str:
    return "expanded_conv_" if block == 0 else f"expanded_conv_{block}_"


def _mobilenetv3_plan(strided: tuple[int, ...], num_blocks: int):
    """The MobileNetV2 plan for MobileNetV3: `strided` are the blocks with a stride-2 depthwise.

    Their explicit padding becomes symmetric, as 'same' at the new dilation (kernels are 3 or 5).
    """
    def plan(output_stride, base):
        changes, rate = {}, 1
        first = strided[-1] if output_stride == 16 else strided[-2]
        for b in range(first, num_blocks):
            prefix = _mnv3_prefix(b)
            if b in strided:
                pad = rate * (base.get_layer(f"{prefix}depthwise").kernel_size[0] // 2)
                changes[f"{prefix}depthwise_pad"] = {"padding": ((pad, pad), (pad, pad))}
                changes[f"{prefix}depthwise"] = {"strides": (1, 1), "dilation_rate": (rate, rate)}
                rate *= 2
            else:
                changes[f"{prefix}depthwise"] = {"dilation_rate": (rate, rate)}
        return changes
    return plan


def _resnet_plan(output_stride, blocks):
    """ResNet v1 (Keras): stride is on conv*_block1_{0,1}_conv; 3x3 convs are conv*_block*_2_conv."""
    changes, rate = {}, 1
    for stage, n in ((4, blocks[2]), (5, blocks[3])):
        if stage == 5 or output_stride == 8:
            changes[f"conv{stage}_block1_0_conv"] = {"strides": (1, 1)}
            changes[f"conv{stage}_block1_1_conv"] = {"strides": (1, 1)}
            rate *= 2
        if rate > 1:
            for b in range(1, n + 1):
                changes[f"conv{stage}_block{b}_2_conv"] = {"dilation_rate": (rate, rate)}
    return changes


def _keras2_mobilenetv3_name(name: str) -> str:
    """'expanded_conv_3/squeeze_excite/Conv_1' -> 'expanded_conv_3_squeeze_excite_conv_1'.

    The published files use Keras 2 names; Keras 3 forbids '/'. Keras 3 names map to themselves.
    """
    return name.replace("/BatchNorm", "_bn").replace("/", "_").lower()


def _same(name: str) -> str:
    return name


def _app(ctor, **kwargs):
    return lambda: ctor(input_shape=(None, None, 3), include_top=False, weights=None, **kwargs)


_APPS = {
    # name: (constructor, {low-level stride: layer}, high-level layer (None: the model's output), plan,
    #        the file's layer name -> the model's)
    "mobilenetv2": (_app(keras.applications.MobileNetV2),
                    {2: "expanded_conv_project_BN", 4: "block_2_add", 8: "block_3_project_BN"},
                    "block_16_project_BN", _mobilenetv2_plan, _same),
    "mobilenetv3_large": (_app(keras.applications.MobileNetV3Large, include_preprocessing=False),
                          {2: "expanded_conv_add", 4: "expanded_conv_2_add", 8: "expanded_conv_3_project_bn"},
                          None, _mobilenetv3_plan((1, 3, 6, 12), 15), _keras2_mobilenetv3_name),
    # Small's first block is strided: its stride-2 features are the stem's BN output (the hard-swish
    # layer has no fixed name).
    "mobilenetv3_small": (_app(keras.applications.MobileNetV3Small, include_preprocessing=False),
                          {2: "conv_bn", 4: "expanded_conv_project_bn", 8: "expanded_conv_1_project_bn"}, None,
                          _mobilenetv3_plan((0, 1, 3, 8), 11), _keras2_mobilenetv3_name),
    "resnet50": (_app(keras.applications.ResNet50),
                 {2: "conv1_relu", 4: "conv2_block3_out", 8: "conv3_block1_out"},
                 "conv5_block3_out", lambda os, base: _resnet_plan(os, (3, 4, 6, 3)), _same),
    "resnet101": (_app(keras.applications.ResNet101),
                  {2: "conv1_relu", 4: "conv2_block3_out", 8: "conv3_block1_out"},
                  "conv5_block3_out", lambda os, base: _resnet_plan(os, (3, 4, 23, 3)), _same),
}


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


def load_keras_h5(model: keras.Model, in_file: dict, path: Path, name: str) -> int:
    """Copies a Keras 2 legacy .h5 weights file (what keras-applications publishes) into `model`.

    `in_file`: `read_keras_h5`'s result. Not Keras 3's `load_weights`, which matches layers by
    position, so a file of another architecture with the same shapes loads silently. Here layers
    match by name, both ways (the classifier excepted), and every shape must match. Within a layer,
    arrays match by variable name, or in order. Returns the number of arrays loaded.
    """
    where, expected = str(path), _expected(name)
    in_model = {layer.name: layer for layer in model.layers if layer.weights}
    missing = [n for n in in_model if n not in in_file]
    extra = [n for n in in_file if n not in in_model and n not in _CLASSIFIER_LAYERS]
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


class HardSwish(layers.Layer):
    """Keras' hard_swish, x * relu6(x + 3) / 6, with the 1/6 as a per-channel constant: MobileNetV3's activation.

    For int8 TFLite files: the converter fuses Keras' form into one HARD_SWISH op, which XNNPACK has no
    int8 kernel for, splitting the graph (docs/DEPLOY.md); this form becomes an ADD with fused ReLU6
    and two MULs, which XNNPACK runs in int8. The product comes before the 1/6 because dividing first
    loses accuracy in int8. No weights: checkpoints are the same.
    """

    def call(self, x):
        # One 1/6 per channel: a scalar 1/6 would be matched by the converter's HARD_SWISH pattern again.
        sixth = np.full((x.shape[-1],), 1.0 / 6.0, np.float32)
        return (x * keras.ops.relu6(x + 3.0)) * keras.ops.cast(sixth, x.dtype)


def keras_app(name: str, output_stride: int, bn_momentum: float, choice: LayerChoice,
              weights: Path | None = None, low_strides: tuple[int, ...] = (4,)) -> keras.Model:
    """A keras.applications backbone rebuilt as an atrous feature extractor with the configured BN."""
    ctor, low_names, high_name, plan, file_name = _APPS[name]
    in_file = None
    if weights is not None:
        if not Path(weights).is_file():
            raise ConfigError("backbone weights not found", "model.backbone_weights",
                              f"expected a Keras ImageNet weights file ({WEIGHT_FILES[name]}), got {str(weights)!r}")
        in_file = {file_name(k): v for k, v in read_keras_h5(Path(weights), name).items()}
    base = ctor()
    changes = plan(output_stride, base)

    def clone(layer):
        cfg = layer.get_config()
        cfg.update(changes.get(layer.name, {}))
        if isinstance(layer, layers.BatchNormalization):
            cfg.update(momentum=bn_momentum, synchronized=choice.sync_batchnorm)
            # Rebuilt from the app's own config (its epsilon, axis, ...): fused where exact (models/fused_bn.py)
            return choice.batch_norm_class().from_config(cfg)
        if type(layer) is layers.Conv2D:
            # ResNet's dilated 3x3 convs: fast and exact (models/atrous.py)
            return choice.conv2d_class(cfg["dilation_rate"]).from_config(cfg)
        if isinstance(layer, layers.Activation) and cfg.get("activation") in ("hard_swish", "hard_silu"):
            return HardSwish(name=layer.name, dtype=layer.dtype_policy)  # int8 TFLite runs it in XNNPACK
        return layer.__class__.from_config(cfg)

    model = keras.models.clone_model(base, clone_function=clone)
    if weights is not None:
        n = load_keras_h5(model, in_file, Path(weights), name)
        log.info("loaded %d ImageNet weight arrays into the %s backbone from %s", n, name, weights)
    inputs = model.input
    outputs = [model.get_layer(low_names[s]).output for s in low_strides] + [
        model.outputs[0] if high_name is None else model.get_layer(high_name).output]
    if name.startswith("resnet"):
        # Keras' ResNet ImageNet weights expect BGR ('caffe' preprocessing); the reader gives RGB.
        x = layers.Lambda(lambda t: t[..., ::-1], name="rgb_to_bgr")(inputs)
        return keras.Model(inputs, keras.Model(inputs, outputs)(x), name=name)
    return keras.Model(inputs, outputs, name=name)


def build_backbone(name: str, output_stride: int, bn_momentum: float, choice: LayerChoice,
                   weights: Path | None = None, low_strides: tuple[int, ...] = (4,),
                   drop_path_rate: float = 0.0) -> keras.Model:
    """Builds the named backbone with the layer classes of `choice` (one dict maps names to builders).

    Returns the features at each of `low_strides`, then the high-level ones. `weights`:
    model.backbone_weights (a Keras ImageNet file, or a keras-hub MiT preset directory).
    `drop_path_rate`: the MiT's stochastic depth.
    """
    if name == "tiny":
        if weights is not None:
            raise ConfigError("no pretrained weights for this backbone", "model.backbone_weights",
                              "expected null for backbone 'tiny'")
        return tiny(output_stride, bn_momentum, choice, low_strides=low_strides)
    if name in MIT_BACKBONES:
        # No BN layers, no dilated form: the Mix Transformer's output stride is 32 (config/resolve.py refuses others).
        if output_stride != 32:
            raise ValueError(f"{name} has output stride 32, got {output_stride}")
        if weights is not None:
            check_mit_preset(name, weights)  # a wrong preset refused before the model is built
        model = mix_transformer(name, low_strides, drop_path_rate)
        if weights is not None:
            load_mit_preset(model, name, weights)
        return model
    return keras_app(name, output_stride, bn_momentum, choice, weights, low_strides)
