"""SegFormer's all-MLP decoder (Xie et al., NeurIPS 2021) on any backbone with stride-4 first features.

Each level projected to C channels and upsampled to stride 4; the levels concatenated deepest first
(keras-hub's order, which the fuse conv's weights depend on) -> 1x1 conv + BN + ReLU -> channel
dropout (drawn per sample, models/stochastic.py) -> classifier. Every op a TFLite builtin.
"""

from __future__ import annotations

import keras
from keras import layers

from seg_train.models.layer_choice import LayerChoice
from seg_train.models.layers import ResizeLike
from seg_train.models.stochastic import ChannelDropout


def segformer(backbone: keras.Model, num_classes: int, choice: LayerChoice, channels: int = 256,
              bn_momentum: float = 0.9, dropout: float = 0.0) -> keras.Model:
    """Builds the SegFormer head on `backbone` (which returns its features shallowest first, the first at
    stride 4). `dropout`: the channel dropout's rate (no layer at 0). Returns float32 logits at input size."""
    inp = keras.Input((None, None, 3), name="image")
    features = backbone(inp)
    first = features[0]
    projected = []
    for i, f in enumerate(features, 1):
        x = layers.Dense(channels, name=f"segformer_linear{i}")(f)
        projected.append(x if i == 1 else ResizeLike(name=f"segformer_upsample{i}")(x, first))
    x = layers.Concatenate(name="segformer_concat")(projected[::-1])
    x = layers.Conv2D(channels, 1, use_bias=False, name="segformer_fuse_conv")(x)
    x = choice.batch_norm(bn_momentum, 1e-5, "segformer_fuse_bn")(x)
    x = layers.ReLU(name="segformer_fuse_relu")(x)
    if dropout:
        x = ChannelDropout(dropout, name="segformer_dropout")(x)
    x = layers.Conv2D(num_classes, 1, name="logits")(x)
    x = ResizeLike(name="logits_resize")(x, inp)
    # Softmax/cross-entropy in float32 even under a mixed-precision policy.
    x = layers.Activation("linear", dtype="float32", name="logits_float32")(x)
    return keras.Model(inp, x, name=f"segformer_{backbone.name}")
