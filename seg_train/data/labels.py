"""Label maps: raw label values (0..255, as stored in the label PNGs) -> training class ids.

One representation: a 256-entry lookup table, table[raw] = train id, or NO_ID where the raw value has
no mapping (a sample holding one is bad, and the message names the value). It is built from
data.label_map, data.reduce_zero_label, data.binary_threshold or the layout's built-in map
(layouts.py); None means the identity (labels already hold class indices, VOC's convention).

load_sample (reader.py) applies it with numpy, so training, evaluation, --check-data, precise BN and
the class-weight counts all see the same mapped values; `apply_tf` is the same lookup as a TensorFlow
op, for a reader that decodes labels in the graph; `raw_ids` is its inverse, the raw values seg-predict
--label-ids writes. No TensorFlow at module level: config.py builds the table to check a config before
TensorFlow starts.
"""

from __future__ import annotations

import numpy as np

from seg_train.config import ConfigError, DataConfig
from seg_train.data import layouts

NO_ID = -1
RAW_VALUES = 256  # 8-bit labels
OPTIONS = ("label_map", "reduce_zero_label", "binary_threshold")


def options_given(data: DataConfig) -> list[str]:
    """The label-map keys the config sets (data.label_map, reduce_zero_label, binary_threshold)."""
    return [f"data.{k}" for k in OPTIONS if getattr(data, k) not in (None, False)]


def _from_dict(mapping: dict, ignore_label: int) -> np.ndarray:
    table = np.full(RAW_VALUES, NO_ID, np.int16)
    for raw, train_id in mapping.items():
        table[raw] = ignore_label if train_id is None else train_id
    return table


def _reduce_zero(ignore_label: int) -> np.ndarray:
    """mmsegmentation's reduce_zero_label: 0 -> ignore, k -> k - 1, and ignore stays ignore."""
    table = np.arange(RAW_VALUES, dtype=np.int16) - 1
    table[0] = ignore_label
    table[ignore_label] = ignore_label
    return table


def _check_user_map(mapping, data: DataConfig) -> dict[int, int]:
    """data.label_map as {raw: train id}, each key and value checked (one line naming the key)."""
    if isinstance(mapping, list):
        if len(mapping) > RAW_VALUES:
            raise ConfigError("label map too long", "data.label_map",
                              f"expected at most {RAW_VALUES} entries (raw values 0..255), got {len(mapping)}")
        mapping = dict(enumerate(mapping))
    for raw, train_id in mapping.items():
        if not 0 <= raw < RAW_VALUES:
            raise ConfigError("label map key out of range", "data.label_map",
                              f"expected raw label values in 0..255 (8-bit labels), got key {raw}")
        if not (0 <= train_id < data.num_classes or train_id == data.ignore_label):
            raise ConfigError("label map value out of range", "data.label_map",
                              f"expected train ids in [0, {data.num_classes}) (data.num_classes) or "
                              f"{data.ignore_label} (data.ignore_label), got {raw}: {train_id}")
    return mapping


def label_table(data: DataConfig) -> np.ndarray | None:
    """The lookup table raw value -> train id (int16 [256], NO_ID: no mapping), or None for the identity.

    Raises:
      ConfigError: more than one of data.label_map / reduce_zero_label / binary_threshold, binary_threshold
        without num_classes 2, a key outside 0..255 or a value out of range in data.label_map, or a class
        that no raw value maps to.
    """
    given = options_given(data)
    if len(given) > 1:
        raise ConfigError("more than one label map", ", ".join(given), "expected at most one of them")
    if data.binary_threshold is not None:
        if data.num_classes != 2:
            raise ConfigError("binary_threshold needs 2 classes", "data.num_classes",
                              f"expected 2 with data.binary_threshold (raw < {data.binary_threshold} -> 0, "
                              f"raw >= {data.binary_threshold} -> 1), got {data.num_classes}")
        table = (np.arange(RAW_VALUES) >= data.binary_threshold).astype(np.int16)
    elif data.label_map is not None:
        table = _from_dict(_check_user_map(data.label_map, data), data.ignore_label)
    elif data.reduce_zero_label:
        table = _reduce_zero(data.ignore_label)
    else:
        own = layouts.builtin(data.layout)
        if own is None:
            return None
        table = _reduce_zero(data.ignore_label) if own.reduce_zero_label else _from_dict(own.label_map,
                                                                                         data.ignore_label)
    missing = sorted(set(range(data.num_classes)) - set(table.tolist()))
    if missing:
        raise ConfigError("a class with no id", given[0] if given else "data.num_classes",
                          f"expected every class 0..{data.num_classes - 1} to have a raw value mapped to it, "
                          f"none maps to {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return table


def apply(table: np.ndarray | None, label: np.ndarray) -> np.ndarray:
    """Raw uint8 label -> int16 train ids (NO_ID where the raw value has no mapping); None: the label itself."""
    if table is None:
        return label
    return table[label]


def apply_tf(table: np.ndarray | None, label):
    """`apply` as a TensorFlow op (tf.gather on the table): a uint8 label tensor -> int32 ids, NO_ID unmapped."""
    import tensorflow as tf  # only for a reader that maps in the graph; config checks stay TensorFlow-free

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

    The inverse of `label_table`, so that reading the written PNG back through the same config gives the
    predicted classes: Cityscapes' trainId t -> the labelId whose trainId is t, ADE20K's class k -> k + 1,
    the identity (VOC) unchanged. Where several raw values map to one train id (a data.label_map of your
    own), the lowest is written; a data.binary_threshold mask is written 0 / 255, the values a binary mask
    usually holds (either reads back as the same class with any threshold in 1..255). A class no raw value
    maps to would have nothing to write, but `label_table` already refuses such a config when it loads.
    """
    table = label_table(data)
    if table is None:
        return np.arange(data.num_classes, dtype=np.uint8)
    if data.binary_threshold is not None:
        return np.array([0, 255], np.uint8)
    # np.argmax gives the first (lowest) raw value equal to each train id.
    return np.argmax(table[None, :] == np.arange(data.num_classes)[:, None], axis=1).astype(np.uint8)
