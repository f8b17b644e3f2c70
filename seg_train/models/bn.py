"""Which BatchNormalization class a model is built with (one place maps the flags to classes)."""

from __future__ import annotations

from keras import layers

from seg_train.models.fused_bn import FusedBatchNormalization
from seg_train.models.sync_bn import SyncBatchNormalization


def bn_class(sync: bool, fused: bool) -> type:
    """The BatchNormalization class for a layer: synchronized across towers or per tower.

    Synchronized BN is always models/sync_bn.py's layer (Keras' own traces far too slowly); per-tower
    BN is models/fused_bn.py's, or Keras' own with `fused=False`.
    """
    if sync:
        return SyncBatchNormalization
    return FusedBatchNormalization if fused else layers.BatchNormalization
