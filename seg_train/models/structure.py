"""What every family's model is made of, read the same way for all: its one nested backbone, which trainable
variables are the backbone's, its BatchNormalization layers."""

from __future__ import annotations

import keras


def freeze_batchnorm(backbone: keras.Model) -> int:
    """Sets `trainable = False` on every BatchNormalization layer of `backbone`; returns how many.

    In Keras 3 such a layer is a fixed affine map: moving statistics even in training, no updates,
    gamma/beta not trainable (DeepLab's `fine_tune_batch_norm: false`). The backbone only: the
    head's BN layers have no loaded statistics, and freezing them would leave its bias-free convs
    with neither normalisation nor a bias.
    """
    layers = batchnorm_layers(backbone)
    for layer in layers:
        layer.trainable = False
    return len(layers)


def backbone_of(model: keras.Model) -> keras.Model:
    """The backbone inside a model from `build` (its only nested keras.Model)."""
    nested = [layer for layer in model.layers if isinstance(layer, keras.Model)]
    if len(nested) != 1:
        raise ValueError(f"expected one backbone model inside {model.name}, found {len(nested)}")
    return nested[0]


def backbone_variable_mask(model: keras.Model) -> list[bool]:
    """For each of `model.trainable_variables`, in order: whether it belongs to the backbone.

    What `train.backbone_lr_multiplier` scales. Compared by identity, so distributed variables work too.
    """
    backbone = {id(v) for v in backbone_of(model).trainable_variables}
    return [id(v) in backbone for v in model.trainable_variables]


def batchnorm_layers(model) -> list:
    """Every BatchNormalization layer of `model`, nested models included."""
    found, seen = [], set()

    def walk(layer):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        if isinstance(layer, keras.layers.BatchNormalization):
            found.append(layer)
        for child in getattr(layer, "layers", []) or []:
            walk(child)

    walk(model)
    return found
