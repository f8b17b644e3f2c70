"""DeepLabV3+: ASPP (with image pooling) on a backbone, and a decoder with low-level features."""

from __future__ import annotations

import keras
from keras import layers

from seg_train.models.layer_choice import LayerChoice
from seg_train.models.layers import ResizeLike


def _conv_bn_relu(x, filters, kernel, name, choice: LayerChoice, momentum: float, dilation=1):
    conv = choice.conv2d_class(dilation)  # dilated: fast and exact (models/atrous.py)
    x = conv(filters, kernel, padding="same", dilation_rate=dilation, use_bias=False, name=f"{name}_conv")(x)
    x = choice.batch_norm(momentum, 1e-5, f"{name}_bn")(x)
    return layers.ReLU(name=f"{name}_relu")(x)


def deeplabv3plus(backbone: keras.Model, num_classes: int, output_stride: int, choice: LayerChoice,
                  aspp_channels: int = 256, decoder_channels: int = 256, low_level_channels: int = 48,
                  bn_momentum: float = 0.9, fine: tuple[int, int] | None = None) -> keras.Model:
    """Builds DeepLabV3+ on `backbone` (which returns [low-level, high-level] features, or with `fine`
    [stride-2, stride-4, high-level] features).

    ASPP rates follow the output stride (6, 12, 18 at 16; doubled at 8; halved at 32).
    `fine` = (projection channels, conv channels) adds a stride-2 decoder stage
    (`model.decoder_stride: 2`): stride-4 logits cannot draw 1-3 pixel wide objects (docs/ACCURACY.md).
    Returns float32 logits at the input's resolution.
    """
    kw = dict(choice=choice, momentum=bn_momentum)
    inp = keras.Input((None, None, 3), name="image")
    if fine is None:
        low, high = backbone(inp)
    else:
        fine_low, low, high = backbone(inp)
    rates = {8: (12, 24, 36), 16: (6, 12, 18), 32: (3, 6, 9)}[output_stride]

    branches = [_conv_bn_relu(high, aspp_channels, 1, "aspp0", **kw)]
    for i, r in enumerate(rates, 1):
        branches.append(_conv_bn_relu(high, aspp_channels, 3, f"aspp{i}", dilation=r, **kw))
    pool = layers.GlobalAveragePooling2D(keepdims=True, name="aspp_pool")(high)
    pool = _conv_bn_relu(pool, aspp_channels, 1, "aspp_pool", **kw)
    branches.append(ResizeLike(name="aspp_pool_resize")(pool, high))
    x = layers.Concatenate(name="aspp_concat")(branches)
    x = _conv_bn_relu(x, aspp_channels, 1, "aspp_proj", **kw)

    low = _conv_bn_relu(low, low_level_channels, 1, "decoder_low", **kw)
    x = ResizeLike(name="decoder_upsample")(x, low)
    x = layers.Concatenate(name="decoder_concat")([x, low])
    x = _conv_bn_relu(x, decoder_channels, 3, "decoder_conv1", **kw)
    x = _conv_bn_relu(x, decoder_channels, 3, "decoder_conv2", **kw)
    if fine is not None:
        fine_low = _conv_bn_relu(fine_low, fine[0], 1, "decoder_fine_low", **kw)
        x = ResizeLike(name="decoder_fine_upsample")(x, fine_low)
        x = layers.Concatenate(name="decoder_fine_concat")([x, fine_low])
        x = _conv_bn_relu(x, fine[1], 3, "decoder_fine_conv1", **kw)
        x = _conv_bn_relu(x, fine[1], 3, "decoder_fine_conv2", **kw)
    x = layers.Conv2D(num_classes, 1, name="logits")(x)
    x = ResizeLike(name="logits_resize")(x, inp)
    # Softmax/cross-entropy in float32 even under a mixed-precision policy.
    x = layers.Activation("linear", dtype="float32", name="logits_float32")(x)
    return keras.Model(inp, x, name=f"deeplabv3plus_{backbone.name}")
