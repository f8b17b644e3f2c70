"""Which BatchNormalization class a model is built with (one place maps the flags to classes)."""

from __future__ import annotations

from keras import layers

from seg_train.models.fused_bn import FusedBatchNormalization
from seg_train.models.sync_bn import SyncBatchNormalization


def bn_class(sync: bool, fused: bool) -> type:
    """The BatchNormalization class for a layer: synchronized across towers or per tower.

    Synchronized BN is always models/sync_bn.py's layer, whatever `fused`: with Keras' own
    synchronized BN, tracing time grows much faster than the tower count (see there). Per-tower BN
    is the fused kernel with Keras' semantics (models/fused_bn.py), or Keras' own layer with
    `fused=False` (`model.fused_batchnorm: false`).
    """
    if sync:
        return SyncBatchNormalization
    return FusedBatchNormalization if fused else layers.BatchNormalization
