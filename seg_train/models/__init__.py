"""Model construction from the config: one place maps `model.backbone` and `model.head` to builders."""

from __future__ import annotations

import keras

from seg_train.config import ModelConfig
from seg_train.config.backbones import DINO_BACKBONES
from seg_train.config.resolve import model_defaults
from seg_train.models.backbones import build_backbone
from seg_train.models.deeplabv3plus import ResizeLike, deeplabv3plus
from seg_train.models.eomt import eomt
from seg_train.models.layer_choice import LayerChoice
from seg_train.models.lraspp import lraspp
from seg_train.models.neck import SimplePyramid, linear_head
from seg_train.models.presets import check_segformer_preset, load_segformer_preset
from seg_train.models.presets_vit import check_dino_preset, load_dino_preset
from seg_train.models.segformer import segformer
from seg_train.models.vit import PatchGrid, dino_encoder

__all__ = ["build", "ResizeLike", "backbone_of", "backbone_variable_mask", "batchnorm_layers", "freeze_batchnorm",
           "input_multiple"]


def build(cfg: ModelConfig, num_classes: int, seed: int = 0) -> keras.Model:
    """The configured head (DeepLabV3+, LR-ASPP, SegFormer or linear) on the configured backbone (a DINO ViT
    under a per-pixel head through the simple pyramid, models/neck.py); call inside `strategy.scope()` for one
    set of variables.

    The seed fixes the initial weights; `cfg.init_weights` (a keras-hub SegFormer preset) then
    overwrites them. With `cfg.freeze_batchnorm` the backbone's BN layers are frozen before anything
    reads `model.trainable_variables`. Keys a config resolves are filled in by model_defaults.
    """
    cfg = model_defaults(cfg)
    choice = LayerChoice(sync_batchnorm=cfg.sync_batchnorm, fused_batchnorm=cfg.fused_batchnorm,
                         fast_atrous=cfg.fast_atrous)
    channels = cfg.segformer_channels
    if cfg.init_weights is not None:
        check_segformer_preset(cfg.backbone, cfg.init_weights, channels)  # a wrong preset refused before building
    keras.utils.set_random_seed(seed)
    output_stride = cfg.output_stride
    if cfg.head == "lraspp":
        low_strides = (8,)
    elif cfg.head == "segformer":
        low_strides = tuple(s for s in (4, 8, 16) if s < output_stride)
    else:
        low_strides = (2, 4) if cfg.decoder_stride == 2 else (4,)
    # A frozen backbone runs as in inference: no residual branch dropped (config/resolve.py refuses a rate).
    drop_path = 0.0 if cfg.freeze_backbone else (cfg.drop_path_rate or 0.0)
    dino = cfg.backbone in DINO_BACKBONES
    if dino and cfg.backbone_weights is not None:
        check_dino_preset(cfg.backbone_weights, cfg.backbone)  # a wrong preset refused before building
    if cfg.head == "eomt":
        model = eomt(cfg.backbone, num_classes, cfg.num_queries, cfg.eomt_blocks, drop_path_rate=drop_path,
                     attention=cfg.attention)
    elif dino:
        encoder = dino_encoder(cfg.backbone, tuple(cfg.vit_layers), drop_path, attention=cfg.attention)
        backbone = encoder if cfg.head == "linear" else \
            SimplePyramid(encoder, low_strides + (output_stride,), cfg.neck_channels)
    else:
        backbone = build_backbone(cfg.backbone, output_stride, cfg.bn_momentum, choice, cfg.backbone_weights,
                                  low_strides, drop_path)
    if cfg.head == "linear":
        model = linear_head(backbone, num_classes, choice, cfg.bn_momentum)
    elif cfg.head == "lraspp":
        model = lraspp(backbone, num_classes, choice, cfg.lraspp_channels, cfg.bn_momentum)
    elif cfg.head == "segformer":
        dropout = cfg.head_dropout
        model = segformer(backbone, num_classes, choice, channels, cfg.bn_momentum, dropout)
    elif cfg.head == "deeplabv3plus":  # (eomt: built above, on the ViT itself)
        fine = (cfg.fine_low_level_channels, cfg.fine_channels) if cfg.decoder_stride == 2 else None
        model = deeplabv3plus(backbone, num_classes, output_stride, choice, cfg.aspp_channels,
                              cfg.decoder_channels, cfg.low_level_channels, cfg.bn_momentum, fine)
    if dino and cfg.backbone_weights is not None:
        load_dino_preset(backbone_of(model), cfg.backbone_weights, cfg.backbone)
    if cfg.init_weights is not None:
        load_segformer_preset(model, backbone, cfg.backbone, cfg.init_weights, num_classes, channels)
    if cfg.freeze_batchnorm:
        freeze_batchnorm(backbone_of(model))
    if cfg.freeze_backbone:
        # Its variables leave model.trainable_variables: no gradient, no optimizer slot, no update; its BN
        # layers run on their moving statistics (Keras 3's frozen BN).
        backbone_of(model).trainable = False
    return model


def input_multiple(model: keras.Model) -> int:
    """What every input side must be a multiple of: a ViT's patch size, else 32 (the conv backbones' and
    MiT's deepest stride, so whole images keep their features aligned); inference pads to it."""
    grids = [layer.patch for layer in backbone_of(model).layers if isinstance(layer, PatchGrid)]
    return grids[0] if grids else 32


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
