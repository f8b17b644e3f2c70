"""The model, built from the config: one table maps the model family of `model.backbone` / `model.head`
(config/variants.py family_of) to its module, and every family module has the same entries:

  build(cfg, num_classes) -> keras.Model    the model with its initial weights (seeded by the caller)
  check_weights(cfg, num_classes)           the weight files the config names, checked before anything is built
  load_weights(model, cfg)                  those files into the built model (backbone presets, whole-model starts)
  backbone_levels(model)                    id(variable) -> depth in the encoder (layer-wise decay), or None
  OBJECTIVE                                 the objective it trains with (objectives/: per_pixel, mask_classification)

  cnn/    tiny, MobileNetV2 / V3, ResNet under DeepLabV3+, LR-ASPP or SegFormer's decoder (heads/)
  mit/    the Mix Transformers under the same heads, SegFormer first
  dino/   DINOv3 / DINOv2 ViTs under the linear head, or the simple pyramid and any head
  eomt/   EoMT: mask classification inside a DINO ViT

Shared by the families: layers.py (LayerNorm, resize, Dense), keras_hub.py (the preset reader), heads/, the BN
classes (bn.py, sync_bn.py, fused_bn.py) and layer_choice.py, atrous.py, stochastic.py; structure.py reads any
family's model the same way; param_groups.py groups its variables for the optimizer.
"""

from __future__ import annotations

import keras

from seg_train.config import ModelConfig
from seg_train.config.resolve import model_defaults
from seg_train.config.variants import family_of
from seg_train.models import cnn, dino, eomt, mit
from seg_train.models.dino.neck import PatchPairPool
from seg_train.models.dino.vit import PatchGrid, ViTEncoder
from seg_train.models.layers import ResizeLike
from seg_train.models.structure import backbone_of, backbone_variable_mask, batchnorm_layers, freeze_batchnorm

__all__ = ["build", "family", "objective_of", "set_recompute", "FAMILIES", "ResizeLike", "backbone_of",
           "backbone_variable_mask", "batchnorm_layers", "freeze_batchnorm", "input_multiple"]

FAMILIES = {"cnn": cnn, "mit": mit, "dino": dino, "eomt": eomt}


def family(cfg: ModelConfig):
    """The family module that builds the model `cfg` describes."""
    return FAMILIES[family_of(cfg.backbone, cfg.head)]


def objective_of(cfg: ModelConfig) -> str:
    """The objective the model `cfg` describes trains with (objectives/__init__.py)."""
    return family(cfg).OBJECTIVE


def build(cfg: ModelConfig, num_classes: int, seed: int = 0) -> keras.Model:
    """The model `cfg` describes, with `num_classes` classes; call inside `strategy.scope()` for one set of
    variables.

    The seed fixes the initial weights; the weight files the config names (model.backbone_weights,
    model.init_weights) then overwrite theirs, each checked before anything is built. With
    `cfg.freeze_batchnorm` the backbone's BN layers are frozen, with `cfg.freeze_backbone` the whole backbone,
    before anything reads `model.trainable_variables`. Keys a config resolves are filled in by model_defaults.
    """
    cfg = model_defaults(cfg)
    fam = family(cfg)
    fam.check_weights(cfg, num_classes)  # a wrong file refused before building
    keras.utils.set_random_seed(seed)
    model = fam.build(cfg, num_classes)
    fam.load_weights(model, cfg)
    if cfg.freeze_batchnorm:
        freeze_batchnorm(backbone_of(model))
    if cfg.freeze_backbone:
        # Its variables leave model.trainable_variables: no gradient, no optimizer slot, no update; its BN
        # layers run on their moving statistics (Keras 3's frozen BN).
        backbone_of(model).trainable = False
    return model


def set_recompute(model: keras.Model, mode: str) -> None:
    """train.recompute on a built model: "blocks" has the training calls of its ViT (dino/vit.py ViTEncoder, which
    EoMT runs block by block too) recompute each block's activations in the backward pass (models/recompute.py);
    "none" stores them. Only the ViTs have blocks to recompute (config/resolve.py refuses the key for the others)."""
    if mode == "none":
        return
    backbone = backbone_of(model)
    if not isinstance(backbone, ViTEncoder):
        raise ValueError(f"recompute {mode!r}: expected a ViT backbone, got {backbone.name}")
    backbone.recompute = mode


def input_multiple(model: keras.Model) -> int:
    """What every input side must be a multiple of: a ViT's patch size p, 2p under the simple pyramid's
    stride-2p level (an even patch grid, so each of its cells pools a whole pair of patches: neck.PatchPairPool),
    else 32 (the conv backbones' and MiT's deepest stride, so whole images keep their features aligned);
    inference pads to it."""
    grids = [layer.patch for layer in backbone_of(model).layers if isinstance(layer, PatchGrid)]
    if grids and any(isinstance(layer, PatchPairPool) for layer in model.layers):
        return 2 * grids[0]
    return grids[0] if grids else 32
