"""What a raw label value means: the built-in layouts' class counts and label maps, and label_ids (the
train id of each raw value 0..255). Pure Python: the config checks a label map with it before TensorFlow
starts. `data` below is a DataConfig, duck-typed because the config imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from seg_train.util.errors import ConfigError

# cityscapesScripts' official table: trainId of each labelId 0..33, None where it says 255.
CITYSCAPES_TRAIN_IDS = (
    None, None, None, None, None, None, None,  # 0-6: unlabeled, ego vehicle, rectification border, out of roi,
                                               # static, dynamic, ground
    0, 1,                                      # 7 road, 8 sidewalk
    None, None,                                # 9 parking, 10 rail track
    2, 3, 4,                                   # 11 building, 12 wall, 13 fence
    None, None, None,                          # 14 guard rail, 15 bridge, 16 tunnel
    5,                                         # 17 pole
    None,                                      # 18 polegroup
    6, 7, 8, 9, 10, 11, 12, 13, 14, 15,        # 19 traffic light .. 28 bus
    None, None,                                # 29 caravan, 30 trailer
    16, 17, 18,                                # 31 train, 32 motorcycle, 33 bicycle
)

# cityscapesScripts' labels with hasInstances (24 person .. 33 bicycle): their gtFine instanceIds hold
# labelId * 1000 + k per instance, and the labelId alone where no instance was drawn (a group).
CITYSCAPES_INSTANCE_LABEL_IDS = tuple(range(24, 34))


@dataclass(frozen=True)
class LayoutLabels:
    """What a shipped data set's label values mean: its class count and how raw values become classes
    (its class names are in seg_train/data/layouts.py)."""
    num_classes: int
    # raw value -> train id, None: ignore_label; raw values not listed have no mapping.
    label_map: Optional[dict[int, Optional[int]]] = None
    reduce_zero_label: bool = False
    # The train ids with instances (data.thing_classes of the panoptic and instance tasks), if it knows them.
    thing_classes: Optional[tuple[int, ...]] = None


# The layouts that know their classes: Cityscapes' labelIds -> the 19 train ids, ADE20K's 0 = "other" and
# classes 1..150. voc and pairs labels hold class indices.
LAYOUT_LABELS = {
    "cityscapes": LayoutLabels(19, dict(enumerate(CITYSCAPES_TRAIN_IDS)), thing_classes=tuple(
        CITYSCAPES_TRAIN_IDS[i] for i in CITYSCAPES_INSTANCE_LABEL_IDS if CITYSCAPES_TRAIN_IDS[i] is not None)),
    "ade20k": LayoutLabels(150, reduce_zero_label=True),
}

NO_ID = -1  # a raw value with no mapping: a sample holding one is bad, and its message names the value
RAW_VALUES = 256  # 8-bit labels
LABEL_MAP_KEYS = ("label_map", "reduce_zero_label", "binary_threshold")


def label_map_keys(data) -> list[str]:
    """The label-map keys the config sets (data.label_map, reduce_zero_label, binary_threshold)."""
    return [f"data.{k}" for k in LABEL_MAP_KEYS if getattr(data, k) not in (None, False)]


def _ids_from_dict(mapping: dict, ignore_label: int) -> list[int]:
    ids = [NO_ID] * RAW_VALUES
    for raw, train_id in mapping.items():
        ids[raw] = ignore_label if train_id is None else train_id
    return ids


def _reduce_zero(ignore_label: int) -> list[int]:
    """mmsegmentation's reduce_zero_label: 0 -> ignore, k -> k - 1, and ignore stays ignore."""
    ids = [raw - 1 for raw in range(RAW_VALUES)]
    ids[0] = ignore_label
    ids[ignore_label] = ignore_label
    return ids


def _check_user_map(mapping, data) -> dict[int, int]:
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


def label_ids(data) -> Optional[list[int]]:
    """The train id of each raw label value 0..255 (NO_ID: no mapping), or None for the identity (VOC's
    convention); ConfigError for conflicting or out-of-range settings, or a class no raw value maps to."""
    given = label_map_keys(data)
    if len(given) > 1:
        raise ConfigError("more than one label map", ", ".join(given), "expected at most one of them")
    if data.binary_threshold is not None:
        if data.num_classes != 2:
            raise ConfigError("binary_threshold needs 2 classes", "data.num_classes",
                              f"expected 2 with data.binary_threshold (raw < {data.binary_threshold} -> 0, "
                              f"raw >= {data.binary_threshold} -> 1), got {data.num_classes}")
        ids = [int(raw >= data.binary_threshold) for raw in range(RAW_VALUES)]
    elif data.label_map is not None:
        ids = _ids_from_dict(_check_user_map(data.label_map, data), data.ignore_label)
    elif data.reduce_zero_label:
        ids = _reduce_zero(data.ignore_label)
    else:
        own = LAYOUT_LABELS.get(data.layout)
        if own is None:
            return None
        ids = _reduce_zero(data.ignore_label) if own.reduce_zero_label else _ids_from_dict(own.label_map,
                                                                                             data.ignore_label)
    missing = sorted(set(range(data.num_classes)) - set(ids))
    if missing:
        raise ConfigError("a class with no id", given[0] if given else "data.num_classes",
                          f"expected every class 0..{data.num_classes - 1} to have a raw value mapped to it, "
                          f"none maps to {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return ids
