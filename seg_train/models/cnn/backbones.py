"""The conv backbones, returning low-level features (stride 2, 4 or 8) and high-level features at the output
stride; the head picks the low-level strides (DeepLabV3+: 4, optionally 2; LR-ASPP: 8).

keras.applications models are rebuilt with `keras.models.clone_model`: the last stages trade stride
for dilation (DeepLab's atrous backbone), and every BN layer gets the configured momentum and
`synchronized` flag (else the backbone's BN would stay per tower). Their ImageNet weights are loaded by
layer name afterwards (models/cnn/imagenet.py).
"""

from __future__ import annotations

import logging

import keras
import numpy as np
from keras import layers

from seg_train.models.layer_choice import LayerChoice

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
    #        the file's layer name -> the model's, layers of the published no-top file after the high-level layer)
    "mobilenetv2": (_app(keras.applications.MobileNetV2),
                    {2: "expanded_conv_project_BN", 4: "block_2_add", 8: "block_3_project_BN"},
                    "block_16_project_BN", _mobilenetv2_plan, _same, ("Conv_1", "Conv_1_bn")),
    "mobilenetv3_large": (_app(keras.applications.MobileNetV3Large, include_preprocessing=False),
                          {2: "expanded_conv_add", 4: "expanded_conv_2_add", 8: "expanded_conv_3_project_bn"},
                          None, _mobilenetv3_plan((1, 3, 6, 12), 15), _keras2_mobilenetv3_name, ()),
    # Small's first block is strided: its stride-2 features are the stem's BN output (the hard-swish
    # layer has no fixed name).
    "mobilenetv3_small": (_app(keras.applications.MobileNetV3Small, include_preprocessing=False),
                          {2: "conv_bn", 4: "expanded_conv_project_bn", 8: "expanded_conv_1_project_bn"}, None,
                          _mobilenetv3_plan((0, 1, 3, 8), 11), _keras2_mobilenetv3_name, ()),
    "resnet50": (_app(keras.applications.ResNet50),
                 {2: "conv1_relu", 4: "conv2_block3_out", 8: "conv3_block1_out"},
                 "conv5_block3_out", lambda os, base: _resnet_plan(os, (3, 4, 6, 3)), _same, ()),
    "resnet101": (_app(keras.applications.ResNet101),
                  {2: "conv1_relu", 4: "conv2_block3_out", 8: "conv3_block1_out"},
                  "conv5_block3_out", lambda os, base: _resnet_plan(os, (3, 4, 23, 3)), _same, ()),
}


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
              low_strides: tuple[int, ...] = (4,)) -> keras.Model:
    """A keras.applications backbone rebuilt as an atrous feature extractor with the configured BN (its ImageNet
    weights: models/cnn/imagenet.py, loaded by the family's load_weights)."""
    ctor, low_names, high_name, plan, _, _ = _APPS[name]
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
    inputs = model.input
    outputs = [model.get_layer(low_names[s]).output for s in low_strides] + [
        model.outputs[0] if high_name is None else model.get_layer(high_name).output]
    if name.startswith("resnet"):
        # Keras' ResNet ImageNet weights expect BGR ('caffe' preprocessing); the reader gives RGB.
        x = layers.Lambda(lambda t: t[..., ::-1], name="rgb_to_bgr")(inputs)
        return keras.Model(inputs, keras.Model(inputs, outputs)(x), name=name)
    return keras.Model(inputs, outputs, name=name)


def published_layout(name: str):
    """How keras-applications' ImageNet file for `name` is laid out against the backbone: (the file's layer name ->
    the backbone's, the file's layers after the backbone's high-level output)."""
    _, _, _, _, file_name, tail = _APPS[name]
    return file_name, tail


def build_backbone(name: str, output_stride: int, bn_momentum: float, choice: LayerChoice,
                   low_strides: tuple[int, ...] = (4,)) -> keras.Model:
    """The conv backbone `name` with the layer classes of `choice`: the features at each of `low_strides`, then the
    high-level ones at `output_stride`."""
    if name == "tiny":
        return tiny(output_stride, bn_momentum, choice, low_strides=low_strides)
    return keras_app(name, output_stride, bn_momentum, choice, low_strides)
