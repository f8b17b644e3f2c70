"""Segment labels, the label a panoptic or instance sample carries: int32 [h, w] with value = train_class * 1000 +
instance, instance 0 a stuff region (one per stuff class), 1..998 the thing instances of an image (any numbering:
only equality matters), 999 the crowd region of that class; class data.ignore_label (any instance) unlabelled.

`encode` / `decode` in numpy and, with the `_tf` suffix, in TensorFlow (imported inside those functions: this
module is read before TensorFlow starts).
"""

from __future__ import annotations

import numpy as np

INSTANCE_BASE = 1000  # value = class * INSTANCE_BASE + instance
CROWD = 999  # the instance of a class's crowd region
STUFF = 0  # the instance of a stuff region


def encode(classes, instances) -> np.ndarray:
    """int32 segment labels of class and instance maps of one shape."""
    return (np.asarray(classes, np.int64) * INSTANCE_BASE + np.asarray(instances, np.int64)).astype(np.int32)


def decode(labels) -> tuple[np.ndarray, np.ndarray]:
    """(classes, instances) int32 of segment labels."""
    labels = np.asarray(labels, np.int64)
    return (labels // INSTANCE_BASE).astype(np.int32), (labels % INSTANCE_BASE).astype(np.int32)


def encode_tf(classes, instances):
    """`encode` in TensorFlow: int32."""
    import tensorflow as tf

    return tf.cast(classes, tf.int32) * INSTANCE_BASE + tf.cast(instances, tf.int32)


def decode_tf(labels):
    """`decode` in TensorFlow: (classes, instances) int32."""
    import tensorflow as tf

    labels = tf.cast(labels, tf.int32)
    return labels // INSTANCE_BASE, labels % INSTANCE_BASE
