"""Panoptic data as it ships: COCO's panoptic format and Cityscapes' gtFine instanceIds, read into segment labels
(data/segments.py) for data.task panoptic and instance.

COCO panoptic (data.layout coco_panoptic; COCO itself, and what annotation tools export in its format):
  annotations/panoptic_<split>.json   images [{id, file_name}], annotations [{image_id, file_name,
                                      segments_info [{id, category_id, iscrowd, area, bbox}]}],
                                      categories [{id, name, isthing}]
  annotations/panoptic_<split>/*.png  RGB, segment id = R + 256 G + 256^2 B, 0 unlabelled
  <split>/*.jpg (or images/<split>/)  the images
The split is named as the config names it; train and val also name COCO's train2017 and val2017. Category ids
(COCO's run 1..200, 133 used) map to train ids 0..n-1 in increasing id order; `Categories.ids` is the inverse
(train id -> category id) for writing predictions.

Cityscapes (data.layout cityscapes): gtFine/<split>/<city>/*_gtFine_instanceIds.png, 16-bit grey: labelId * 1000 + k
for instance k of a class with instances, the labelId alone elsewhere, where on a class with instances it marks
a group (crowd), as cityscapesScripts' createPanopticImgs reads it; labelIds map to train ids through the
Cityscapes label table (config/label_tables.py).

Labels are stored raw and mapped when read, like class labels: a SegmentCodec (the reader's label table for
these tasks) decodes a label file in numpy (Pillow: the scan, data.cache, the fallback) and in TensorFlow (the
streams), to the same values.
"""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass

import numpy as np

from seg_train.config import ConfigError, DataConfig
from seg_train.config.label_tables import CITYSCAPES_INSTANCE_LABEL_IDS, NO_ID, RAW_VALUES
from seg_train.data import files, labels, records, segments
from seg_train.data.label_images import JPEG_START, LossyLabel

# The ids a COCO panoptic PNG's channels hold: id = R + 256 G + 256^2 B.
RGB_WEIGHTS = (1, 256, 256 * 256)
COCO_SPLITS = {"train": "train2017", "val": "val2017"}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_SENTINEL = np.iinfo(np.int32).max  # pads a lookup so it is never empty; no segment id reaches it (< 256^3)


def rgb_to_id(rgb) -> np.ndarray:
    """uint8 [H, W, 3] -> int32 [H, W] segment ids, R + 256 G + 256^2 B."""
    rgb = np.asarray(rgb, np.int32)
    return rgb[..., 0] * RGB_WEIGHTS[0] + rgb[..., 1] * RGB_WEIGHTS[1] + rgb[..., 2] * RGB_WEIGHTS[2]


def rgb_to_id_tf(rgb):
    import tensorflow as tf

    rgb = tf.cast(rgb, tf.int32)
    return rgb[..., 0] * RGB_WEIGHTS[0] + rgb[..., 1] * RGB_WEIGHTS[1] + rgb[..., 2] * RGB_WEIGHTS[2]


@dataclass(frozen=True)
class Categories:
    """A data set's classes for the segment tasks, by train id: its own category id, name, and whether a thing."""
    ids: tuple[int, ...]
    names: tuple[str, ...]
    is_thing: tuple[bool, ...]

    @property
    def thing_classes(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.is_thing) if t)

    def lookup(self) -> tuple[np.ndarray, np.ndarray]:
        """(category ids sorted, their train ids), padded with a sentinel (for searchsorted)."""
        order = np.argsort(np.asarray(self.ids, np.int64), kind="stable")
        return (np.append(np.asarray(self.ids, np.int64)[order], _SENTINEL).astype(np.int64),
                np.append(order, 0).astype(np.int32))


@dataclass(frozen=True)
class SegmentTable:
    """One image's segments as its annotation lists them (raw category ids), and its image id there."""
    ids: tuple[int, ...]
    category_ids: tuple[int, ...]
    iscrowd: tuple[int, ...]
    image_id: object = None


# ---- COCO's JSON -----------------------------------------------------------------------------------------
def coco_split_name(data: DataConfig, split: str) -> str:
    """The split's name in the file names: as given, or COCO's train2017 / val2017 for train / val when only
    those are there."""
    if split in COCO_SPLITS and not files.is_file(coco_json_path(data.root, split)) \
            and files.is_file(coco_json_path(data.root, COCO_SPLITS[split])):
        return COCO_SPLITS[split]
    return split


def coco_json_path(root, split: str) -> str:
    return files.join(root, "annotations", f"panoptic_{split}.json")


def coco_folders(data: DataConfig, split: str) -> tuple[str, str, str]:
    """(the JSON, the PNG folder, the image folder) of a coco_panoptic split (the folders as found: the
    annotations/ and images/ forms, else the first)."""
    root, name = str(data.root), coco_split_name(data, split)
    pngs = [files.join(root, "annotations", f"panoptic_{name}"), files.join(root, f"panoptic_{name}")]
    images = [files.join(root, name), files.join(root, "images", name)]
    png = next((p for p in pngs if files.is_dir(p)), pngs[0])
    image = next((p for p in images if files.is_dir(p)), images[0])
    return coco_json_path(root, name), png, image


@functools.lru_cache(maxsize=4)
def _read_json(path: str, size: int, mtime: int) -> dict:
    """A JSON file parsed once per (path, size, mtime): COCO's train JSON is hundreds of MB."""
    try:
        return json.loads(files.read_bytes(path))
    except (OSError, ValueError) as e:
        raise ConfigError("unreadable annotation file", path, f"a COCO panoptic JSON ({type(e).__name__}: "
                          f"{str(e)[:200]})") from None


def read_json(path: str) -> dict:
    import tensorflow as tf

    if not files.is_file(path):
        raise ConfigError("annotation file not found", path,
                          "a COCO panoptic JSON (annotations/panoptic_<split>.json under data.root)")
    st = tf.io.gfile.stat(path)
    return _read_json(path, st.length, st.mtime_nsec)


def coco_categories(raw: dict, path: str, thing_classes) -> Categories:
    """The JSON's `categories`, in increasing id order, as train ids 0..n-1; `thing_classes` (data.thing_classes)
    where the JSON has no `isthing`, else it must agree."""
    try:
        cats = sorted(raw["categories"], key=lambda c: int(c["id"]))
        ids = tuple(int(c["id"]) for c in cats)
        names = tuple(str(c.get("name", f"class_{i}")) for i, c in enumerate(cats))
        flags = [c.get("isthing") for c in cats]
    except (KeyError, TypeError, ValueError):
        raise ConfigError("bad categories", path, "a `categories` list of {id, name, isthing}") from None
    if not ids or len(set(ids)) != len(ids):
        raise ConfigError("bad categories", path, "at least one category, each id once")
    given = None if thing_classes is None else set(thing_classes)
    if any(f is None for f in flags):
        if given is None:
            raise ConfigError("thing classes unknown", path, "categories with `isthing` (1 thing, 0 stuff), or "
                              "data.thing_classes")
        return Categories(ids, names, tuple(i in given for i in range(len(ids))))
    is_thing = tuple(bool(f) for f in flags)
    if given is not None and given != {i for i, t in enumerate(is_thing) if t}:
        raise ConfigError("not the data's things", "data.thing_classes",
                          f"{[i for i, t in enumerate(is_thing) if t]} (or no value): the train ids whose "
                          f"category has isthing 1 in {path}, got {sorted(given)}")
    return Categories(ids, names, is_thing)


def coco_entries(raw: dict, path: str) -> list[tuple[str, str, SegmentTable]]:
    """(image file name, PNG file name, segments) of each annotation, in the JSON's order."""
    try:
        image_files = {img["id"]: str(img["file_name"]) for img in raw.get("images", [])}
        out = []
        for ann in raw["annotations"]:
            info = ann.get("segments_info", [])
            table = SegmentTable(tuple(int(s["id"]) for s in info), tuple(int(s["category_id"]) for s in info),
                                 tuple(int(s.get("iscrowd", 0)) for s in info), ann["image_id"])
            image = image_files.get(ann["image_id"])
            if image is None:
                raise ConfigError("bad annotation", path, f"an `images` entry for image_id {ann['image_id']!r}")
            out.append((image, str(ann["file_name"]), table))
    except (KeyError, TypeError, ValueError):
        raise ConfigError("bad annotations", path, "`annotations` of {image_id, file_name, segments_info "
                          "[{id, category_id, iscrowd}]} and `images` of {id, file_name}") from None
    return out


def categories(data: DataConfig, names=None) -> Categories:
    """The configured data set's categories by train id (its things, and the category ids predictions are
    written with); `names`: the class names of a layout whose files do not name them (cityscapes).
    ConfigError when they disagree with data.num_classes or data.thing_classes."""
    if data.layout == "cityscapes":
        return cityscapes_categories(data, names)
    if data.format == "tfrecord":
        found, where = _record_categories(data)
    else:
        where = coco_folders(data, data.train_split)[0]
        if not files.is_file(where) and files.is_file(coco_folders(data, data.val_split)[0]):
            where = coco_folders(data, data.val_split)[0]
        found = read_json(where)
    cats = coco_categories(found, where, data.thing_classes)
    if len(cats.ids) != data.num_classes:
        raise ConfigError("wrong number of classes", "data.num_classes",
                          f"{len(cats.ids)} (the categories of {where}), got {data.num_classes}")
    return cats


def _record_categories(data: DataConfig) -> tuple[dict, str]:
    """The categories seg-prepare tfrecords wrote into a split's index file."""
    for split in (data.train_split, data.val_split):
        path = records.index_path(records.split_pattern(str(data.root), split))
        if files.is_file(path):
            index = read_json(path)
            if "categories" in index:
                return index, path
    path = records.index_path(records.split_pattern(str(data.root), data.train_split))
    raise ConfigError("categories not found", path, "the index file seg-prepare tfrecords writes with a "
                      "coco_panoptic split (it holds the categories)")


def cityscapes_categories(data: DataConfig, names=None) -> Categories:
    """Cityscapes' train ids with their labelIds (the category ids of its panoptic ground truth), names, things."""
    raw = labels.raw_ids(data)
    names = names if names is not None else tuple(f"class_{i}" for i in range(data.num_classes))
    things = set(data.thing_classes or ())
    return Categories(tuple(int(r) for r in raw), tuple(names), tuple(i in things for i in range(data.num_classes)))


# ---- segment labels from a table ----------------------------------------------------------------------------
def segment_values(table: SegmentTable, cats: Categories) -> np.ndarray:
    """Each listed segment's label (segments.py): its train class, instance 1.. for thing segments in list order,
    CROWD for crowd, STUFF for stuff. ValueError for an unknown category or too many instances."""
    ids, cat_ids, crowd = (np.asarray(a, np.int64) for a in (table.ids, table.category_ids, table.iscrowd))
    sorted_ids, train_of = cats.lookup()
    pos = np.minimum(np.searchsorted(sorted_ids, cat_ids), len(sorted_ids) - 1)
    unknown = sorted_ids[pos] != cat_ids
    if unknown.any():
        raise ValueError(f"category ids the categories do not list: {sorted(set(cat_ids[unknown].tolist()))[:8]}")
    train = train_of[pos].astype(np.int64)
    thing = np.asarray(cats.is_thing, bool)[train] if train.size else np.zeros(0, bool)
    numbered = thing & (crowd == 0)
    counter = np.cumsum(numbered)
    if counter.size and counter[-1] > segments.MAX_INSTANCE:
        raise ValueError(f"{int(counter[-1])} thing segments; expected at most {segments.MAX_INSTANCE} per image")
    inst = np.where(crowd != 0, segments.CROWD, np.where(thing, counter, segments.STUFF))
    if len(set(ids.tolist())) != ids.size or (ids <= 0).any():
        raise ValueError("segment ids must be positive and listed once")
    return segments.encode(train, inst)


def segment_values_tf(cat_ids, crowd, cats: Categories):
    """segment_values in TensorFlow: (values int32 [n], valid)."""
    import tensorflow as tf

    sorted_ids, train_of = (tf.constant(a) for a in cats.lookup())
    cat_ids = tf.cast(cat_ids, tf.int64)
    pos = tf.minimum(tf.searchsorted(sorted_ids, cat_ids), tf.size(sorted_ids) - 1)
    found = tf.gather(sorted_ids, pos) == cat_ids
    train = tf.gather(train_of, pos)
    thing = tf.gather(tf.constant(cats.is_thing, tf.bool), train)
    is_crowd = tf.cast(crowd, tf.int64) != 0
    counter = tf.cumsum(tf.cast(thing & ~is_crowd, tf.int32))
    inst = tf.where(is_crowd, segments.CROWD, tf.where(thing, counter, segments.STUFF))
    valid = tf.reduce_all(found) & (tf.reduce_max(tf.concat([counter, [0]], 0)) <= segments.MAX_INSTANCE)
    return segments.encode_tf(train, inst), valid


def _png_kind(data: bytes) -> tuple[int, int] | None:
    """(bit depth, colour type) of a PNG's header, None for anything else."""
    if len(data) < 26 or data[:8] != _PNG_SIGNATURE:
        return None
    return data[24], data[25]


class SegmentCodec:
    """How a data set's label files become segment labels: the reader's label table for data.task panoptic and
    instance (labels.label_table's for semantic). `kind`: coco (RGB ids and a per-image segment table) or
    cityscapes (instanceIds)."""

    def __init__(self, data: DataConfig, cats: Categories):
        self.kind = "cityscapes" if data.layout == "cityscapes" else "coco"
        self.categories = cats
        self.num_classes, self.ignore_label = data.num_classes, data.ignore_label
        self.ignore = segments.ignore_value(data.ignore_label)
        table = labels.label_table(data) if self.kind == "cityscapes" else None
        self.raw_table = None if table is None else np.asarray(table, np.int32)

    def cache_key(self) -> str:
        """What the scan cache keys an entry on (with the checking code): everything that changes a decode."""
        parts = [self.kind, self.num_classes, self.ignore_label, self.categories,
                 None if self.raw_table is None else self.raw_table.tolist()]
        return repr(parts)

    # ---- numpy (Pillow) ----
    def decode_np(self, data: bytes, table: SegmentTable | None, name: str) -> np.ndarray:
        """int32 segment labels [H, W] of a label file's bytes; LossyLabel for a JPEG, ValueError (without the
        name) for anything else wrong."""
        from PIL import Image

        if data[:len(JPEG_START)] == JPEG_START:
            raise LossyLabel(name)
        kind = _png_kind(data)
        with Image.open(io.BytesIO(data)) as img:
            if self.kind == "coco":
                # 16-bit colour would reach Pillow as 8 bits per channel: other ids, no error.
                if kind is None or kind[1] not in (2, 3, 6) or (kind[1] != 3 and kind[0] != 8):
                    raise ValueError(f"{img.mode} image; expected an 8-bit RGB PNG of segment ids "
                                     "(R + 256 G + 256^2 B)")
                return self._from_ids(rgb_to_id(np.asarray(img.convert("RGB"))), table)
            if kind is None or kind[1] != 0:
                raise ValueError(f"{img.mode} image; expected a grey PNG of Cityscapes instanceIds")
            return self._from_instance_ids(np.asarray(img).astype(np.int64))

    def _from_ids(self, ids: np.ndarray, table: SegmentTable | None) -> np.ndarray:
        if table is None:
            raise ValueError("no segments_info for this PNG")
        values = segment_values(table, self.categories)
        sorted_ids = np.asarray(table.ids, np.int64)
        order = np.argsort(sorted_ids)
        sorted_ids, values = np.append(sorted_ids[order], _SENTINEL), np.append(values[order], self.ignore)
        pos = np.searchsorted(sorted_ids, ids)
        hit = sorted_ids[pos] == ids
        unknown = ~hit & (ids != 0)
        if unknown.any():
            raise ValueError(f"segment ids in the PNG that its segments_info does not list: "
                             f"{sorted(set(ids[unknown].tolist()))[:8]}")
        return np.where(ids == 0, self.ignore, values[pos]).astype(np.int32)

    def _from_instance_ids(self, raw: np.ndarray) -> np.ndarray:
        label_id = np.where(raw >= segments.INSTANCE_BASE, raw // segments.INSTANCE_BASE, raw)
        inside = label_id < RAW_VALUES
        train = np.where(inside, self.raw_table[np.where(inside, label_id, 0)], NO_ID)
        if (train == NO_ID).any():
            raise ValueError(f"instanceIds values with no mapping: {sorted(set(raw[train == NO_ID].tolist()))[:8]}")
        has_instances = np.isin(label_id, CITYSCAPES_INSTANCE_LABEL_IDS)
        k = raw % segments.INSTANCE_BASE + 1
        bad = (raw >= segments.INSTANCE_BASE) & (~has_instances | (k > segments.MAX_INSTANCE))
        if bad.any():
            raise ValueError(f"instance ids on a class without instances, or past {segments.MAX_INSTANCE}: "
                             f"{sorted(set(raw[bad].tolist()))[:8]}")
        inst = np.where(raw >= segments.INSTANCE_BASE, k, np.where(has_instances, segments.CROWD, segments.STUFF))
        return np.where(train == self.ignore_label, self.ignore, segments.encode(train, inst)).astype(np.int32)

    # ---- TensorFlow ----
    def decode_tf(self, contents, table):
        """decode_np in the graph: (int32 segment labels [H, W], whether the file passes decode_np's checks).
        `table`: the image's (segment ids, category ids, iscrowd) tensors (coco), else None. A file this cannot
        decode gives valid False (the reader then decodes it with decode_np, which names the problem)."""
        import tensorflow as tf

        head = tf.io.decode_raw(tf.strings.substr(tf.strings.join([contents, b"\x00" * 26]), 0, 26), tf.uint8)
        is_png = tf.reduce_all(tf.equal(head[:8], tf.constant(list(_PNG_SIGNATURE), tf.uint8)))
        depth, colour = head[24], head[25]
        if self.kind == "coco":
            ok = is_png & (((colour == 2) | (colour == 6)) & (depth == 8) | (colour == 3))
            rgb = tf.cond(ok, lambda: tf.io.decode_png(contents, channels=3),
                          lambda: tf.zeros([1, 1, 3], tf.uint8))
            label, valid = self._from_ids_tf(rgb_to_id_tf(rgb), table)
            return label, ok & valid
        ok = is_png & (colour == 0) & ((depth == 8) | (depth == 16))
        raw = tf.cond(ok & (depth == 16), lambda: tf.cast(tf.io.decode_png(contents, channels=1, dtype=tf.uint16),
                                                          tf.int32),
                      lambda: tf.cond(ok, lambda: tf.cast(tf.io.decode_png(contents, channels=1), tf.int32),
                                      lambda: tf.zeros([1, 1, 1], tf.int32)))
        label, valid = self._from_instance_ids_tf(raw[..., 0])
        return label, ok & valid

    def _from_ids_tf(self, ids, table):
        import tensorflow as tf

        seg_ids, cat_ids, crowd = table
        values, valid = segment_values_tf(cat_ids, crowd, self.categories)
        seg_ids = tf.cast(seg_ids, tf.int32)
        order = tf.argsort(seg_ids, stable=True)
        sorted_ids = tf.concat([tf.gather(seg_ids, order), [_SENTINEL]], 0)
        values = tf.concat([tf.gather(values, order), [self.ignore]], 0)
        unique = tf.reduce_all(sorted_ids[1:] > sorted_ids[:-1]) & tf.reduce_all(seg_ids > 0)
        pos = tf.searchsorted(sorted_ids, tf.reshape(ids, [-1]))
        pos = tf.reshape(pos, tf.shape(ids))
        hit = tf.gather(sorted_ids, pos) == ids
        label = tf.where(ids == 0, self.ignore, tf.gather(values, pos))
        return label, valid & unique & tf.reduce_all(hit | (ids == 0))

    def _from_instance_ids_tf(self, raw):
        import tensorflow as tf

        base = segments.INSTANCE_BASE
        label_id = tf.where(raw >= base, raw // base, raw)
        inside = label_id < RAW_VALUES
        train = tf.where(inside, tf.gather(tf.constant(self.raw_table), tf.where(inside, label_id, 0)), NO_ID)
        has_instances = tf.reduce_any(label_id[..., None] == tf.constant(CITYSCAPES_INSTANCE_LABEL_IDS, tf.int32), -1)
        k = raw % base + 1
        bad = (raw >= base) & (~has_instances | (k > segments.MAX_INSTANCE))
        valid = tf.reduce_all(train != NO_ID) & ~tf.reduce_any(bad)
        inst = tf.where(raw >= base, k, tf.where(has_instances, segments.CROWD, segments.STUFF))
        label = tf.where(train == self.ignore_label, self.ignore, segments.encode_tf(train, inst))
        return label, valid


def image_id(sample) -> object:
    """A sample's image id in its annotation file (COCO's JSON image_id; the file stem, as an int when all digits,
    for samples without one, e.g. TFRecords)."""
    table = getattr(sample, "segments", None)
    if table is not None and table.image_id is not None:
        return table.image_id
    return int(sample.id) if sample.id.isdigit() else sample.id
