"""The EoMT family: mask classification inside a DINO ViT (eomt.py), the queries in its last blocks; its encoder's
weights as the DINO family's (keras-hub presets, transformers folders), a whole EoMT from a transformers folder
(model.init_weights, models/dino/transformers.py). The family interface: models/__init__.py."""

from __future__ import annotations

import keras

from seg_train.models.dino import check_backbone_weights, load_backbone_weights, vit_of
from seg_train.models.dino.transformers import check_eomt_folder, configured_variant, load_eomt_folder
from seg_train.models.dino.vit import encoder_parts
from seg_train.models.eomt.eomt import eomt
from seg_train.models.layer_choice import drop_path_rate

OBJECTIVE = "mask_classification"


def build(cfg, num_classes: int) -> keras.Model:
    return eomt(vit_of(cfg), num_classes, cfg.num_queries, cfg.eomt_blocks, drop_path_rate=drop_path_rate(cfg),
                label=cfg.backbone)


def _eomt_folder(cfg, num_classes: int):
    spec = configured_variant(cfg.backbone, cfg.position_grid, cfg.position_resize)
    return check_eomt_folder(cfg.init_weights, spec, cfg.backbone, cfg.num_queries, cfg.eomt_blocks, num_classes)


def check_weights(cfg, num_classes: int) -> None:
    check_backbone_weights(cfg)
    if cfg.init_weights is not None:
        _eomt_folder(cfg, num_classes)


def load_weights(model: keras.Model, cfg) -> None:
    load_backbone_weights(model.backbone, cfg)
    if cfg.init_weights is not None:
        load_eomt_folder(model, _eomt_folder(cfg, model.num_classes))


def backbone_levels(model: keras.Model) -> dict:
    """id(variable) -> its depth in the ViT (layer-wise decay's groups: vit.EncoderParts.levels)."""
    return encoder_parts(model.backbone).levels()
