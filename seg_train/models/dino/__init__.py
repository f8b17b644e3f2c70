"""The DINO family: DINOv3 / DINOv2 ViT encoders (vit.py) under the DINO papers' linear head, or through ViTDet's
simple pyramid (neck.py) under any per-pixel head (models/heads/); their weights from keras-hub's DINO presets
(presets.py) or transformers' folders (transformers.py). The family interface: models/__init__.py."""

from __future__ import annotations

import keras

from seg_train.config.variants import VIT_VARIANTS, ViTVariant
from seg_train.models.dino.neck import SimplePyramid, linear_head
from seg_train.models.dino.presets import check_dino_preset, load_dino_preset
from seg_train.models.dino.transformers import (
    check_backbone_folder,
    configured_variant,
    is_transformers_folder,
    load_backbone_folder,
)
from seg_train.models.dino.vit import dino_encoder, encoder_parts
from seg_train.models.heads import HEADS
from seg_train.models.layer_choice import drop_path_rate, layer_choice
from seg_train.models.structure import backbone_of

OBJECTIVE = "per_pixel"
# model.neck: what turns the ViT's single-scale maps into a head's levels (the linear head takes the maps as they
# are: no neck).
NECKS = {"simple_pyramid": SimplePyramid}


def vit_of(cfg) -> ViTVariant | str:
    """The ViT model.backbone names, with model.position_grid / model.position_resize applied: its VIT_VARIANTS
    name when they change nothing (what keras-hub presets are checked against), else the changed ViTVariant."""
    spec = configured_variant(cfg.backbone, cfg.position_grid, cfg.position_resize)
    return cfg.backbone if spec == VIT_VARIANTS[cfg.backbone] else spec


def build(cfg, num_classes: int) -> keras.Model:
    choice = layer_choice(cfg)
    encoder = dino_encoder(vit_of(cfg), tuple(cfg.vit_layers), drop_path_rate(cfg), label=cfg.backbone)
    if cfg.neck is None:  # model.head linear (config/resolve.py pairs them)
        return linear_head(encoder, num_classes, choice, cfg.bn_momentum)
    head = HEADS[cfg.head]
    levels = NECKS[cfg.neck](encoder, head.low_strides(cfg) + (cfg.output_stride,), cfg.neck_channels)
    return head.build(levels, num_classes, cfg, choice)


def check_backbone_weights(cfg):
    """model.backbone_weights checked before building: a transformers folder (returned, to load) or a keras-hub
    preset (None)."""
    if cfg.backbone_weights is None:
        return None
    if is_transformers_folder(cfg.backbone_weights):
        spec = configured_variant(cfg.backbone, cfg.position_grid, cfg.position_resize)
        return check_backbone_folder(cfg.backbone_weights, spec, cfg.backbone)
    check_dino_preset(cfg.backbone_weights, vit_of(cfg))
    return None


def load_backbone_weights(encoder: keras.Model, cfg) -> None:
    """model.backbone_weights into the ViT `encoder`: a transformers folder or a keras-hub preset."""
    if cfg.backbone_weights is None:
        return
    folder = check_backbone_weights(cfg)
    if folder is not None:
        load_backbone_folder(encoder, folder)
    else:
        load_dino_preset(encoder, cfg.backbone_weights, vit_of(cfg))


def check_weights(cfg, num_classes: int) -> None:
    check_backbone_weights(cfg)


def load_weights(model: keras.Model, cfg) -> None:
    load_backbone_weights(backbone_of(model), cfg)


def backbone_levels(model: keras.Model) -> dict:
    """id(variable) -> its depth in the ViT (layer-wise decay's groups: vit.EncoderParts.levels)."""
    return encoder_parts(backbone_of(model)).levels()
