"""Segment labels: the label of the panoptic and instance tasks (data.task), one int32 per pixel.

value = train class * INSTANCE_BASE + instance, with instance
  0             stuff: one region per stuff class in an image
  1 .. 998      a thing instance, numbered within the image (only equality matters)
  CROWD (999)   a crowd region of the class (COCO's `iscrowd: 1`; Cityscapes' thing pixels without an instance)
and class == data.ignore_label (ignore_value: ignore_label * INSTANCE_BASE) for unlabelled pixels. Every
ignored pixel holds exactly ignore_value, so equality of values is equality of segments.

numpy functions here; the same in TensorFlow with the `_tf` suffix (TensorFlow imported inside them, so numpy
users need none).
"""

from __future__ import annotations

import numpy as np

INSTANCE_BASE = 1000
STUFF = 0
CROWD = 999
MAX_INSTANCE = 998


def ignore_value(ignore_label: int) -> int:
    """The segment label of an unlabelled pixel."""
    return ignore_label * INSTANCE_BASE


def encode(classes, instances) -> np.ndarray:
    """(train classes, instances) -> int32 segment labels."""
    return (np.asarray(classes, np.int32) * INSTANCE_BASE + np.asarray(instances, np.int32)).astype(np.int32)


def decode(labels) -> tuple[np.ndarray, np.ndarray]:
    """Segment labels -> (train classes, instances), int32."""
    labels = np.asarray(labels, np.int32)
    return labels // INSTANCE_BASE, labels % INSTANCE_BASE


def encode_tf(classes, instances):
    import tensorflow as tf

    return tf.cast(classes, tf.int32) * INSTANCE_BASE + tf.cast(instances, tf.int32)


def decode_tf(labels):
    import tensorflow as tf

    labels = tf.cast(labels, tf.int32)
    return labels // INSTANCE_BASE, labels % INSTANCE_BASE


def classes(labels, ignore_label: int) -> np.ndarray:
    """Segment labels -> uint8 class map (ignore_label where unlabelled), e.g. for a per-class histogram."""
    return decode(labels)[0].astype(np.uint8)


def to_panoptic(labels, ignore_label: int) -> tuple[np.ndarray, list[dict]]:
    """One image's segment labels as the evaluators' ground truth: (segment ids int64 [H, W], 0 unlabelled,
    and [{"id", "category_id" (train id), "iscrowd"}] in increasing label order), ids 1, 2, ..."""
    labels = np.asarray(labels, np.int64)
    values, inverse = np.unique(labels, return_inverse=True)
    keep = values // INSTANCE_BASE != ignore_label
    ids = np.where(keep, np.cumsum(keep), 0)
    segments = [{"id": int(i), "category_id": int(v // INSTANCE_BASE), "iscrowd": int(v % INSTANCE_BASE == CROWD)}
                for i, v in zip(ids[keep], values[keep])]
    return ids[inverse.reshape(labels.shape)], segments


def to_instances(labels, ignore_label: int, thing_classes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One image's thing segments as instance masks: (masks bool [G, H, W], train ids [G], crowd [G]), in
    increasing label order; stuff and unlabelled pixels belong to none."""
    labels = np.asarray(labels, np.int64)
    values = np.unique(labels)
    cls, inst = values // INSTANCE_BASE, values % INSTANCE_BASE
    things = np.isin(cls, np.asarray(list(thing_classes), np.int64)) & (cls != ignore_label) & (inst != STUFF)
    values = values[things]
    masks = labels[None] == values[:, None, None]
    return masks, (values // INSTANCE_BASE).astype(np.int64), values % INSTANCE_BASE == CROWD


def count(labels, num_classes: int, ignore_label: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pixels per class [C + 1], the last unlabelled; segments per class [C], crowd regions included;
    crowd regions per class [C]) of one image's segment labels."""
    labels = np.asarray(labels)
    # One bincount over the values (< 256 * 1000) instead of np.unique's sort: a COCO image's scan time halves.
    per_value = np.bincount(labels.ravel())
    values = np.flatnonzero(per_value)
    cls = values // INSTANCE_BASE
    pixels = np.bincount(np.where(cls == ignore_label, num_classes, cls), weights=per_value[values],
                         minlength=num_classes + 1).astype(np.int64)
    values = values[cls != ignore_label]
    segments = np.bincount(values // INSTANCE_BASE, minlength=num_classes)
    crowd = np.bincount(values[values % INSTANCE_BASE == CROWD] // INSTANCE_BASE, minlength=num_classes)
    return pixels, segments, crowd
