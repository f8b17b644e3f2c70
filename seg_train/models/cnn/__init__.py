"""The conv family: a small test net, MobileNetV2 / V3 and ResNet-50 / 101 (keras.applications rebuilt atrous,
backbones.py) under a per-pixel head (models/heads/); ImageNet weights from keras-applications' files
(imagenet.py). The family interface: models/__init__.py."""

from __future__ import annotations

import keras

from seg_train.models.cnn import imagenet
from seg_train.models.cnn.backbones import build_backbone
from seg_train.models.heads import HEADS
from seg_train.models.layer_choice import layer_choice
from seg_train.models.structure import backbone_of

OBJECTIVE = "per_pixel"


def build(cfg, num_classes: int) -> keras.Model:
    choice, head = layer_choice(cfg), HEADS[cfg.head]
    backbone = build_backbone(cfg.backbone, cfg.output_stride, cfg.bn_momentum, choice, head.low_strides(cfg))
    return head.build(backbone, num_classes, cfg, choice)


def check_weights(cfg, num_classes: int) -> None:
    if cfg.backbone_weights is not None:
        imagenet.check_file(cfg.backbone, cfg.backbone_weights)


def load_weights(model: keras.Model, cfg) -> None:
    if cfg.backbone_weights is not None:
        imagenet.load(backbone_of(model), cfg.backbone, cfg.backbone_weights)


def backbone_levels(model: keras.Model) -> None:
    """No encoder levels (train.layer_decay is a ViT's)."""
    return None
