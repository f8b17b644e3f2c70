"""The EoMT family: mask classification inside a DINO ViT (eomt.py), the queries in its last blocks; keras-hub's
DINO presets for its encoder (models/dino/presets.py). The family interface: models/__init__.py."""

from __future__ import annotations

import keras

from seg_train.models.dino.presets import check_dino_preset, load_dino_preset
from seg_train.models.dino.vit import encoder_parts
from seg_train.models.eomt.eomt import eomt
from seg_train.models.layer_choice import drop_path_rate

OBJECTIVE = "mask_classification"


def build(cfg, num_classes: int) -> keras.Model:
    return eomt(cfg.backbone, num_classes, cfg.num_queries, cfg.eomt_blocks, drop_path_rate=drop_path_rate(cfg))


def check_weights(cfg) -> None:
    if cfg.backbone_weights is not None:
        check_dino_preset(cfg.backbone_weights, cfg.backbone)


def load_weights(model: keras.Model, cfg) -> None:
    if cfg.backbone_weights is not None:
        load_dino_preset(model.backbone, cfg.backbone_weights, cfg.backbone)


def backbone_levels(model: keras.Model) -> dict:
    """id(variable) -> its depth in the ViT (layer-wise decay's groups: vit.EncoderParts.levels)."""
    return encoder_parts(model.backbone).levels()
