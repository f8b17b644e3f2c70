"""Backbones returning (low-level features at stride 4, high-level features at the output stride).

keras.applications models are built with plain strides (output stride 32) and their own BN layers
(momentum 0.999, unsynchronised). They are rebuilt here with `keras.models.clone_model`: the last
stages lose their stride and gain dilation (DeepLab's atrous backbone, so output_stride is real),
and every BatchNormalization layer gets the configured momentum and `synchronized` flag (setting it
on the head alone would leave the backbone's BN per tower). Cloning re-initialises the weights, so
ImageNet weights, if given, are copied over afterwards by layer name.
"""

from __future__ import annotations

from pathlib import Path

import keras
from keras import layers

from seg_train.config import ConfigError
from seg_train.models.atrous import conv2d_class
from seg_train.models.bn import bn_class


def _bn(name, momentum, sync):
    return bn_class(sync)(momentum=momentum, epsilon=1e-3, synchronized=sync, name=name)  # models/bn.py


def tiny(output_stride: int, bn_momentum: float, sync_bn: bool, width: int = 16) -> keras.Model:
    """A small conv net for tests and the demo: stride-4 low-level and stride-16/8 high-level features."""
    inp = keras.Input((None, None, 3), name="image")

    def block(x, filters, stride, dilation, name):
        conv = conv2d_class(dilation)  # dilated: fast and exact (models/atrous.py)
        x = conv(filters, 3, strides=stride, dilation_rate=dilation, padding="same", use_bias=False,
                 name=f"{name}_conv")(x)
        x = _bn(f"{name}_bn", bn_momentum, sync_bn)(x)
        return layers.ReLU(name=f"{name}_relu")(x)

    x = block(inp, width, 2, 1, "stem")                       # /2
    x = block(x, width * 2, 2, 1, "stage1")                   # /4
    low = block(x, width * 2, 1, 1, "stage1b")
    x = block(low, width * 4, 2, 1, "stage2")                 # /8
    s3 = 1 if output_stride == 8 else 2
    d3 = 2 if output_stride == 8 else 1
    x = block(x, width * 8, s3, d3, "stage3")                 # /16 (or /8 dilated)
    x = block(x, width * 8, 1, 2 * d3, "stage3b")
    return keras.Model(inp, [low, x], name="tiny")


def _mobilenetv2_plan(output_stride):
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


_APPS = {
    # name: (constructor, low-level layer, high-level layer, plan)
    "mobilenetv2": (lambda: keras.applications.MobileNetV2(input_shape=(None, None, 3), include_top=False, weights=None),
                    "block_2_add", "block_16_project_BN", _mobilenetv2_plan),
    "resnet50": (lambda: keras.applications.ResNet50(input_shape=(None, None, 3), include_top=False, weights=None),
                 "conv2_block3_out", "conv5_block3_out", lambda os: _resnet_plan(os, (3, 4, 6, 3))),
    "resnet101": (lambda: keras.applications.ResNet101(input_shape=(None, None, 3), include_top=False, weights=None),
                  "conv2_block3_out", "conv5_block3_out", lambda os: _resnet_plan(os, (3, 4, 23, 3))),
}


def keras_app(name: str, output_stride: int, bn_momentum: float, sync_bn: bool,
              weights: Path | None = None) -> keras.Model:
    """A keras.applications backbone rebuilt as an atrous feature extractor with the configured BN."""
    ctor, low_name, high_name, plan = _APPS[name]
    base = ctor()
    if weights is not None:
        if not Path(weights).is_file():
            raise ConfigError("backbone weights not found", "model.backbone_weights",
                              f"expected a Keras ImageNet weights file (no_top .h5), got {str(weights)!r}")
        try:
            base.load_weights(str(weights))
        except Exception as e:  # Keras raises several types for a wrong file; all mean the same to a user
            raise ConfigError("cannot load backbone weights", str(weights),
                              f"expected {name} include_top=False weights ({str(e).splitlines()[0][:200]})") from None
    changes = plan(output_stride)

    def clone(layer):
        cfg = layer.get_config()
        cfg.update(changes.get(layer.name, {}))
        if isinstance(layer, layers.BatchNormalization):
            cfg.update(momentum=bn_momentum, synchronized=sync_bn)
            return bn_class(sync_bn).from_config(cfg)  # fused where exact (models/fused_bn.py)
        if type(layer) is layers.Conv2D:
            # ResNet's dilated 3x3 convs: fast and exact (models/atrous.py)
            return conv2d_class(cfg["dilation_rate"]).from_config(cfg)
        return layer.__class__.from_config(cfg)

    model = keras.models.clone_model(base, clone_function=clone)
    if weights is not None:
        for src in base.layers:
            if src.weights:
                model.get_layer(src.name).set_weights(src.get_weights())
    inputs = model.input
    if name.startswith("resnet"):
        # Keras' ResNet ImageNet weights expect BGR ('caffe' preprocessing); the reader gives RGB minus
        # the RGB mean, so flip the channels here.
        x = layers.Lambda(lambda t: t[..., ::-1], name="rgb_to_bgr")(inputs)
        feats = keras.Model(inputs, [model.get_layer(low_name).output, model.get_layer(high_name).output])
        low, high = feats(x)
        return keras.Model(inputs, [low, high], name=name)
    return keras.Model(inputs, [model.get_layer(low_name).output, model.get_layer(high_name).output], name=name)


def build_backbone(name: str, output_stride: int, bn_momentum: float, sync_bn: bool,
                   weights: Path | None = None) -> keras.Model:
    """Builds the named backbone (one dict maps names to builders)."""
    if name == "tiny":
        if weights is not None:
            raise ConfigError("no pretrained weights for this backbone", "model.backbone_weights",
                              "expected null for backbone 'tiny'")
        return tiny(output_stride, bn_momentum, sync_bn)
    return keras_app(name, output_stride, bn_momentum, sync_bn, weights)

