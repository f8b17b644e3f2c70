"""Label maps applied: raw label values (0..255, as stored in the label PNGs) -> training class ids.

A 256-entry lookup table, table[raw] = train id, NO_ID where unmapped (a sample holding one is bad);
its contents are label_tables.label_ids's; None is the identity. `apply` is the numpy lookup, `apply_tf`
the same in the graph, `raw_ids` the inverse for seg-predict --label-ids. No TensorFlow at module level:
seg-predict reads `raw_ids` before TensorFlow starts.
"""

from __future__ import annotations

import numpy as np

from seg_train.config import DataConfig
from seg_train.config.label_tables import NO_ID, RAW_VALUES, label_ids


def label_table(data: DataConfig) -> np.ndarray | None:
    """The lookup table raw value -> train id (int16 [256], NO_ID: no mapping), or None for the identity.

    Raises:
      ConfigError: a label map label_tables.label_ids refuses (it is checked when the config loads, too).
    """
    ids = label_ids(data)
    return None if ids is None else np.array(ids, np.int16)


def apply(table: np.ndarray | None, label: np.ndarray) -> np.ndarray:
    """Raw uint8 label -> int16 train ids (NO_ID where the raw value has no mapping); None: the label itself."""
    if table is None:
        return label
    return table[label]


def apply_tf(table: np.ndarray | None, label):
    """`apply` as a TensorFlow op (tf.gather on the table): a uint8 label tensor -> int32 ids, NO_ID unmapped."""
    import tensorflow as tf  # only for a reader that maps in the graph: raw_ids stays TensorFlow-free

    if table is None:
        return tf.cast(label, tf.int32)
    return tf.gather(tf.constant(table, tf.int32), tf.cast(label, tf.int32))


def unmapped_counts(table: np.ndarray | None, label: np.ndarray) -> dict[int, int]:
    """Pixels per raw value that has no mapping (empty if all map)."""
    if table is None:
        return {}
    counts = np.bincount(label.ravel(), minlength=RAW_VALUES)
    return {raw: int(counts[raw]) for raw in np.flatnonzero((table == NO_ID) & (counts > 0)).tolist()}


def raw_ids(data: DataConfig) -> np.ndarray:
    """Train id -> the raw label value seg-predict --label-ids writes for it (uint8 [num_classes]).

    The inverse of `label_table`, so the written PNG reads back as the predicted classes. Where several
    raw values map to one id the lowest is written; a binary_threshold mask is written 0 / 255, which
    reads back the same with any threshold in 1..255.
    """
    table = label_table(data)
    if table is None:
        return np.arange(data.num_classes, dtype=np.uint8)
    if data.binary_threshold is not None:
        return np.array([0, 255], np.uint8)
    # np.argmax gives the first (lowest) raw value equal to each train id.
    return np.argmax(table[None, :] == np.arange(data.num_classes)[:, None], axis=1).astype(np.uint8)
