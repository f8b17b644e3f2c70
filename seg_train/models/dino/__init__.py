"""The DINO family: DINOv3 / DINOv2 ViT encoders (vit.py) under the DINO papers' linear head, or through ViTDet's
simple pyramid (neck.py) under any per-pixel head (models/heads/); keras-hub's DINO presets (presets.py). The
family interface: models/__init__.py."""

from __future__ import annotations

import keras

from seg_train.models.dino.neck import SimplePyramid, linear_head
from seg_train.models.dino.presets import check_dino_preset, load_dino_preset
from seg_train.models.dino.vit import dino_encoder, encoder_parts
from seg_train.models.heads import HEADS
from seg_train.models.layer_choice import drop_path_rate, layer_choice
from seg_train.models.structure import backbone_of

OBJECTIVE = "per_pixel"
# model.neck: what turns the ViT's single-scale maps into a head's levels (the linear head takes the maps as they
# are: no neck).
NECKS = {"simple_pyramid": SimplePyramid}


def build(cfg, num_classes: int) -> keras.Model:
    choice = layer_choice(cfg)
    encoder = dino_encoder(cfg.backbone, tuple(cfg.vit_layers), drop_path_rate(cfg))
    if cfg.neck is None:  # model.head linear (config/resolve.py pairs them)
        return linear_head(encoder, num_classes, choice, cfg.bn_momentum)
    head = HEADS[cfg.head]
    levels = NECKS[cfg.neck](encoder, head.low_strides(cfg) + (cfg.output_stride,), cfg.neck_channels)
    return head.build(levels, num_classes, cfg, choice)


def check_weights(cfg) -> None:
    if cfg.backbone_weights is not None:
        check_dino_preset(cfg.backbone_weights, cfg.backbone)


def load_weights(model: keras.Model, cfg) -> None:
    if cfg.backbone_weights is not None:
        load_dino_preset(backbone_of(model), cfg.backbone_weights, cfg.backbone)


def backbone_levels(model: keras.Model) -> dict:
    """id(variable) -> its depth in the ViT (layer-wise decay's groups: vit.EncoderParts.levels)."""
    return encoder_parts(backbone_of(model)).levels()
