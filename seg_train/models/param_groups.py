"""Each trainable variable's learning-rate multiplier: the backbone's and the head's (train.backbone_lr_multiplier,
train.head_lr_multiplier) and, on a ViT, layer-wise decay (train.layer_decay).

Layer-wise decay as BEiT and EoMT fine-tune ViTs: with L blocks, block i (1-based) learns at decay^(L - i), the
patch embedding and the CLS / register tokens and position embeddings at decay^L (the lowest; EoMT's grouping
puts them with block 1), the final LayerNorm with the last block (decay^0, as EoMT's grouping:
tests/test_layer_decay_reference.py), everything outside the backbone at 1; the backbone multiplier applies
on top. L is the number of blocks built (blocks after the last one model.vit_layers names are not). Which
variable sits at which level the encoder declares (its family's `backbone_levels`), not its layer names.

The multipliers scale the learning rate, not the gradient: Adam would undo a scaled gradient.

Also here: which variables weight decay applies to (`decay_variables`), and its L2 value (`weight_decay`).
"""

from __future__ import annotations

import tensorflow as tf

from seg_train import models


def lr_multipliers(model, model_cfg, backbone_mult: float = 1.0, head_mult: float = 1.0,
                   layer_decay: float | None = None) -> list[float]:
    """One multiplier per variable of `model.trainable_variables`, in order. `model_cfg`: the config the model
    was built from; its family declares the encoder's levels (models/dino/vit.py EncoderParts.levels)."""
    in_backbone = models.backbone_variable_mask(model)
    variables = model.trainable_variables
    depth = None
    if layer_decay is not None:
        level_of = models.family(model_cfg).backbone_levels(model) or {}
        levels = [level_of.get(id(v)) if b else None for v, b in zip(variables, in_backbone)]
        depth = max((lv for lv in levels if lv is not None), default=0)
        if depth == 0:
            # The config refuses layer_decay without a ViT; a frozen backbone leaves nothing to decay.
            depth = None
    out = []
    for i, b in enumerate(in_backbone):
        if not b:
            out.append(head_mult)
            continue
        mult = backbone_mult
        if depth is not None:
            mult *= layer_decay ** (depth - levels[i])
        out.append(mult)
    return out


def decay_variables(model) -> list:
    """Conv and dense kernels (depthwise/pointwise included): what weight decay applies to."""
    names = ("kernel", "depthwise_kernel", "pointwise_kernel")
    return [v for v in model.trainable_variables if v.name in names]


def weight_decay(variables, coefficient: float):
    """coefficient * sum(l2_loss(kernel)) with l2_loss(x) = sum(x**2) / 2."""
    if not variables or coefficient == 0:
        return tf.constant(0.0, tf.float32)
    return coefficient * tf.add_n([tf.nn.l2_loss(tf.cast(v, tf.float32)) for v in variables])
