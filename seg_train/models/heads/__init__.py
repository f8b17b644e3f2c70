"""The per-pixel heads, on any backbone that returns its features shallowest first: DeepLabV3+, LR-ASPP and
SegFormer's all-MLP decoder. One table maps model.head to a Head: the low-level strides it reads (what the family
asks its backbone or neck for) and its builder. (The DINO linear head and EoMT are their families' own.)"""

from __future__ import annotations

from typing import Callable, NamedTuple

import keras

from seg_train.models.heads.deeplabv3plus import deeplabv3plus
from seg_train.models.heads.lraspp import lraspp
from seg_train.models.heads.segformer import segformer


class Head(NamedTuple):
    """A per-pixel head: `low_strides(cfg)` the strides of the low-level features it takes (the backbone then
    adds the output stride's), `build(backbone, num_classes, cfg, choice)` the model."""
    low_strides: Callable[[object], tuple]
    build: Callable[..., keras.Model]


def _deeplab_strides(cfg) -> tuple:
    return (2, 4) if cfg.decoder_stride == 2 else (4,)


def _deeplab(backbone, num_classes, cfg, choice):
    fine = (cfg.fine_low_level_channels, cfg.fine_channels) if cfg.decoder_stride == 2 else None
    return deeplabv3plus(backbone, num_classes, cfg.output_stride, choice, cfg.aspp_channels, cfg.decoder_channels,
                         cfg.low_level_channels, cfg.bn_momentum, fine)


def _lraspp(backbone, num_classes, cfg, choice):
    return lraspp(backbone, num_classes, choice, cfg.lraspp_channels, cfg.bn_momentum)


def _segformer(backbone, num_classes, cfg, choice):
    return segformer(backbone, num_classes, choice, cfg.segformer_channels, cfg.bn_momentum, cfg.head_dropout)


HEADS = {
    "deeplabv3plus": Head(_deeplab_strides, _deeplab),
    "lraspp": Head(lambda cfg: (8,), _lraspp),
    "segformer": Head(lambda cfg: tuple(s for s in (4, 8, 16) if s < cfg.output_stride), _segformer),
}
