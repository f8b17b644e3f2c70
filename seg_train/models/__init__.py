"""Model construction from the config: one place maps `model.backbone` to a builder."""

from __future__ import annotations

import contextlib

import keras

from seg_train.config import ModelConfig
from seg_train.models import atrous, fused_bn
from seg_train.models.backbones import build_backbone
from seg_train.models.deeplabv3plus import ResizeLike, deeplabv3plus

__all__ = ["build", "ResizeLike"]


def build(cfg: ModelConfig, num_classes: int, seed: int = 0) -> keras.Model:
    """DeepLabV3+ on the configured backbone; call inside `strategy.scope()` for one set of variables.

    The seed fixes the initial weights, so every run with the same config starts from the same model.
    """
    keras.utils.set_random_seed(seed)
    with (contextlib.nullcontext() if cfg.fast_atrous else atrous.plain_keras(),
          contextlib.nullcontext() if cfg.fused_batchnorm else fused_bn.plain_keras()):
        backbone = build_backbone(cfg.backbone, cfg.output_stride, cfg.bn_momentum, cfg.sync_batchnorm,
                                  cfg.backbone_weights)
        return deeplabv3plus(backbone, num_classes, cfg.output_stride, cfg.aspp_channels, cfg.decoder_channels,
                             cfg.low_level_channels, cfg.bn_momentum, cfg.sync_batchnorm)
