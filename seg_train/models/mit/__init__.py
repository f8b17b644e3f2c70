"""The Mix Transformer family (SegFormer's encoders MiT-B0..B5, encoder.py) under a per-pixel head, SegFormer's
all-MLP decoder first among them; keras-hub's MiT and SegFormer presets (presets.py). The family interface:
models/__init__.py."""

from __future__ import annotations

import keras

from seg_train.models.heads import HEADS
from seg_train.models.layer_choice import drop_path_rate, layer_choice
from seg_train.models.mit.encoder import mix_transformer
from seg_train.models.mit.presets import (
    check_mit_preset,
    check_segformer_preset,
    load_mit_preset,
    load_segformer_preset,
)
from seg_train.models.structure import backbone_of

OBJECTIVE = "per_pixel"


def build(cfg, num_classes: int) -> keras.Model:
    # No BN layers, no dilated form: the Mix Transformer's output stride is 32 (config/resolve.py refuses others).
    if cfg.output_stride != 32:
        raise ValueError(f"{cfg.backbone} has output stride 32, got {cfg.output_stride}")
    head = HEADS[cfg.head]
    backbone = mix_transformer(cfg.backbone, head.low_strides(cfg), drop_path_rate(cfg))
    return head.build(backbone, num_classes, cfg, layer_choice(cfg))


def check_weights(cfg, num_classes: int) -> None:
    if cfg.backbone_weights is not None:
        check_mit_preset(cfg.backbone_weights, cfg.backbone)
    if cfg.init_weights is not None:
        check_segformer_preset(cfg.init_weights, cfg.backbone, cfg.segformer_channels)


def load_weights(model: keras.Model, cfg) -> None:
    if cfg.backbone_weights is not None:
        load_mit_preset(backbone_of(model), cfg.backbone_weights, cfg.backbone)
    if cfg.init_weights is not None:
        load_segformer_preset(model, backbone_of(model), cfg.init_weights, cfg.backbone, model.output_shape[-1],
                              cfg.segformer_channels)


def backbone_levels(model: keras.Model) -> None:
    """No encoder levels (train.layer_decay is a ViT's)."""
    return None
