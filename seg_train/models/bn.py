"""Which BatchNormalization class a model is built with (one place maps the flags to classes)."""

from __future__ import annotations

from keras import layers

from seg_train.models.fused_bn import FusedBatchNormalization, plain_keras
from seg_train.models.sync_bn import SyncBatchNormalization


def bn_class(sync: bool = False) -> type:
    """The BatchNormalization class for a layer: synchronized across towers or per tower.

    Synchronized BN is always models/sync_bn.py's layer: with Keras' own synchronized BN, tracing
    time grows much faster than the tower count (see there). Per-tower BN is the fused kernel with
    Keras' semantics (models/fused_bn.py), or Keras' own layer inside `with fused_bn.plain_keras():`
    (`model.fused_batchnorm: false`).
    """
    if sync:
        return SyncBatchNormalization
    return layers.BatchNormalization if plain_keras.on else FusedBatchNormalization
