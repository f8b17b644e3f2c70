"""Lite R-ASPP (the MobileNetV3 paper's segmentation head), as torchvision's lraspp_mobilenet_v3_large.

The high-level features, gated per channel by a sigmoid of their global average, upsampled to stride 8;
logits = 1x1 conv of those + 1x1 conv of the stride-8 features. Every op has a TFLite builtin.
"""

from __future__ import annotations

import keras
from keras import layers

from seg_train.models.layer_choice import LayerChoice
from seg_train.models.layers import ResizeLike


def lraspp(backbone: keras.Model, num_classes: int, choice: LayerChoice, channels: int = 128,
           bn_momentum: float = 0.9) -> keras.Model:
    """Builds LR-ASPP on `backbone` (which returns [low-level at stride 8, high-level] features).

    Returns float32 logits at the input's resolution.
    """
    inp = keras.Input((None, None, 3), name="image")
    low, high = backbone(inp)
    x = layers.Conv2D(channels, 1, use_bias=False, name="lraspp_cbr_conv")(high)
    x = choice.batch_norm(bn_momentum, 1e-5, "lraspp_cbr_bn")(x)
    x = layers.ReLU(name="lraspp_cbr_relu")(x)
    scale = layers.GlobalAveragePooling2D(keepdims=True, name="lraspp_pool")(high)
    scale = layers.Conv2D(channels, 1, use_bias=False, name="lraspp_scale_conv")(scale)
    scale = layers.Activation("sigmoid", name="lraspp_scale_sigmoid")(scale)
    x = layers.Multiply(name="lraspp_scaled")([x, scale])
    x = ResizeLike(name="lraspp_upsample")(x, low)
    low_logits = layers.Conv2D(num_classes, 1, name="lraspp_low_logits")(low)
    high_logits = layers.Conv2D(num_classes, 1, name="lraspp_high_logits")(x)
    x = layers.Add(name="logits")([low_logits, high_logits])
    x = ResizeLike(name="logits_resize")(x, inp)
    # Softmax/cross-entropy in float32 even under a mixed-precision policy.
    x = layers.Activation("linear", dtype="float32", name="logits_float32")(x)
    return keras.Model(inp, x, name=f"lraspp_{backbone.name}")
