"""Where a data set's files are, as each one ships (data.layout): voc, cityscapes, ade20k, pairs, coco_panoptic;
every layout's listing, and the class names of the layouts that know them.

A layout turns (data config, split) into samples (image and label paths, or a TFRecord record). What
its label values mean is label_tables.LAYOUT_LABELS's; labels.py applies it. Files are reached through
tf.io.gfile (data/files.py), so data.root may be a URL; paths are strings, which pathlib would mangle.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tensorflow as tf

from seg_train.config import ConfigError, DataConfig
from seg_train.data import files, panoptic, records

LAYOUTS = ("voc", "cityscapes", "ade20k", "pairs", "coco_panoptic")


@dataclass(frozen=True)
class Sample:
    id: str
    image: str
    label: str
    # data.format: tfrecord: the record (records.RecordRef) holding both; image and label then name it.
    record: object = None
    # coco_panoptic: the image's segments as its JSON lists them (panoptic.SegmentTable).
    segments: object = None


# ---- class names ---------------------------------------------------------------------------------------
CITYSCAPES_CLASSES = ("road", "sidewalk", "building", "wall", "fence", "pole", "traffic light", "traffic sign",
                      "vegetation", "terrain", "sky", "person", "rider", "car", "truck", "bus", "train",
                      "motorcycle", "bicycle")

# The SceneParsing benchmark's objectInfo150 order, as mmsegmentation's ADE20KDataset.METAINFO lists it
# (its 'bed ' without the trailing space): class k here is annotation value k + 1.
ADE20K_CLASSES = (
    "wall", "building", "sky", "floor", "tree", "ceiling", "road", "bed", "windowpane", "grass", "cabinet",
    "sidewalk", "person", "earth", "door", "table", "mountain", "plant", "curtain", "chair", "car", "water",
    "painting", "sofa", "shelf", "house", "sea", "mirror", "rug", "field", "armchair", "seat", "fence", "desk",
    "rock", "wardrobe", "lamp", "bathtub", "railing", "cushion", "base", "box", "column", "signboard",
    "chest of drawers", "counter", "sand", "sink", "skyscraper", "fireplace", "refrigerator", "grandstand",
    "path", "stairs", "runway", "case", "pool table", "pillow", "screen door", "stairway", "river", "bridge",
    "bookcase", "blind", "coffee table", "toilet", "flower", "book", "hill", "bench", "countertop", "stove",
    "palm", "kitchen island", "computer", "swivel chair", "boat", "bar", "arcade machine", "hovel", "bus",
    "towel", "light", "truck", "tower", "chandelier", "awning", "streetlight", "booth", "television receiver",
    "airplane", "dirt track", "apparel", "pole", "land", "bannister", "escalator", "ottoman", "bottle",
    "buffet", "poster", "stage", "van", "ship", "fountain", "conveyer belt", "canopy", "washer", "plaything",
    "swimming pool", "stool", "barrel", "basket", "waterfall", "tent", "bag", "minibike", "cradle", "oven",
    "ball", "food", "step", "tank", "trade name", "microwave", "pot", "animal", "bicycle", "lake",
    "dishwasher", "screen", "blanket", "sculpture", "hood", "sconce", "vase", "traffic light", "tray",
    "ashcan", "fan", "pier", "crt screen", "plate", "monitor", "bulletin board", "shower", "radiator", "glass",
    "clock", "flag",
)


CLASS_NAMES = {"cityscapes": CITYSCAPES_CLASSES, "ade20k": ADE20K_CLASSES}


def own_class_names(layout: str) -> tuple[str, ...] | None:
    """The class names of a layout that knows its classes (label_tables.LAYOUT_LABELS), or None (voc, pairs)."""
    return CLASS_NAMES.get(layout)


# ---- listing ---------------------------------------------------------------------------------------------
_CITYSCAPES_IMAGE, _CITYSCAPES_LABEL = "_leftImg8bit.png", "_gtFine_labelIds.png"
# The panoptic and instance tasks read the instance ids beside the labelIds.
_CITYSCAPES_SEGMENTS = "_gtFine_instanceIds.png"
_VOC_IMAGE_DIR, _VOC_LABEL_DIR, _VOC_SPLIT_DIR = "JPEGImages", "SegmentationClass", "ImageSets/Segmentation"


def _sorted(paths) -> list[str]:
    """Paths in pathlib's order (by their parts: 'a/x' before 'a-b/x'), so the sample order stays stable."""
    return sorted(paths, key=lambda p: p.split("/"))


def _folder(path: str, expected: str) -> str:
    if not files.is_dir(path):
        raise ConfigError("folder not found", path, expected)
    return path


def _check_label(label: str, present: set[str], data: DataConfig, expected: str) -> None:
    """A missing label is named with its image at once (on_bad_sample: skip drops it in the scan).
    `present`: the label folder's files, listed once (not a stat per file on remote storage)."""
    if data.on_bad_sample == "error" and label not in present:
        raise ConfigError("label not found", label, expected)


def _check_file(path: str, data: DataConfig, what: str, expected: str) -> None:
    """As _check_label, for a file of a list (no folder to list: one look per file)."""
    if data.on_bad_sample == "error" and not files.is_file(path):
        raise ConfigError(f"{what} not found", path, expected)


def _cityscapes(data: DataConfig, split: str) -> list[tuple[str, str, str]]:
    root = str(data.root)
    label_suffix = _CITYSCAPES_LABEL if data.task == "semantic" else _CITYSCAPES_SEGMENTS
    images = _folder(files.join(root, "leftImg8bit", split),
                     f"expected Cityscapes' leftImg8bit/{split}/<city>/*{_CITYSCAPES_IMAGE} under data.root "
                     "(the split names a folder: train, val or test)")
    labels = _folder(files.join(root, "gtFine", split),
                     f"expected Cityscapes' gtFine/{split}/<city>/*{label_suffix} under data.root "
                     "(gtFine_trainvaltest.zip unpacked next to leftImg8bit)")
    present = set(tf.io.gfile.glob(files.join(labels, "*", f"*{label_suffix}")))
    out = []
    for image in _sorted(tf.io.gfile.glob(files.join(images, "*", f"*{_CITYSCAPES_IMAGE}"))):
        city, name = image.split("/")[-2:]
        stem = name[:-len(_CITYSCAPES_IMAGE)]
        label = files.join(labels, city, f"{stem}{label_suffix}")
        _check_label(label, present, data, f"expected the gtFine {label_suffix[8:-4]} PNG of {image}")
        out.append((stem, image, label))
    if not out:
        raise ConfigError("empty split", images, f"expected <city>/*{_CITYSCAPES_IMAGE} images")
    return out


# ADEChallengeData2016's folders are training/ and validation/; the names every other layout uses (and the
# config's defaults) name them too, so a config need not spell the layout's own.
ADE20K_SPLITS = {"train": "training", "val": "validation"}


def split_folder(data: DataConfig, split: str) -> str:
    """The folder name a split stands for in the layout: ade20k's train and val are training and validation;
    any other name (and every other layout's) as it is."""
    return ADE20K_SPLITS.get(split, split) if data.layout == "ade20k" else split


def _ade20k(data: DataConfig, split: str) -> list[tuple[str, str, str]]:
    root = str(data.root)
    split = split_folder(data, split)
    images = _folder(files.join(root, "images", split),
                     f"expected ADEChallengeData2016's images/{split}/*.jpg under data.root "
                     "(the split names a folder: training or validation, which train and val also name)")
    labels = _folder(files.join(root, "annotations", split),
                     f"expected ADEChallengeData2016's annotations/{split}/*.png under data.root")
    present = set(tf.io.gfile.glob(files.join(labels, "*.png")))
    out = []
    for image in _sorted(tf.io.gfile.glob(files.join(images, "*.jpg"))):
        stem = files.stem(image)
        label = files.join(labels, f"{stem}.png")
        _check_label(label, present, data, f"expected the annotation PNG of {image}")
        out.append((stem, image, label))
    if not out:
        raise ConfigError("empty split", images, "expected *.jpg images")
    return out


def _list_file(data: DataConfig, split: str) -> str:
    """A pairs split: a list file, relative to data.root (or as given: absolute, or from the current folder)."""
    for candidate in (files.join(data.root, split), split):
        if files.is_file(candidate):
            return candidate
    return files.join(data.root, split)


def _pairs(data: DataConfig, split: str) -> list[tuple[str, str, str]]:
    root = str(data.root)
    path = _list_file(data, split)
    if not files.is_file(path):
        raise ConfigError("split not found", path,
                          f"expected a list file of 'image_path label_path' lines for split {split!r} "
                          "(relative to data.root)")
    out = []
    for lineno, parts, line in files.split_lines(path):
        if len(parts) != 2:
            raise ConfigError("bad split line", f"{path}:{lineno}", f"expected 'image_path label_path', got {line!r}")
        # A leading '/' means the data root, as in DeepLab-style list files.
        image, label = (files.join(root, p.lstrip("/")) for p in parts)
        _check_file(image, data, "image", f"expected the image file of {path}:{lineno}")
        _check_file(label, data, "label", f"expected the label PNG of {path}:{lineno}")
        # The id names the sample in messages and in the scan's skip list: its path, unique where a stem is not.
        out.append((str(Path(parts[0].lstrip("/")).with_suffix("")), image, label))
    if not out:
        raise ConfigError("empty split", path, "expected at least one 'image_path label_path' line")
    return out


def _voc_split_file(root: str, split: str) -> str:
    """The file listing a VOC split: ImageSets/Segmentation/<split>.txt, or `split` itself as a list file."""
    voc = files.join(root, _VOC_SPLIT_DIR, f"{split}.txt")
    if files.is_file(voc):
        return voc
    for candidate in (split, files.join(root, split)):
        if files.is_file(candidate):
            return candidate
    return voc


def _voc(data: DataConfig, split: str) -> list[tuple[str, str, str]]:
    """A VOC split: one id per line (JPEGImages/<id>.jpg, SegmentationClass/<id>.png), or `image label` path
    pairs (DrSleep-style list files), relative to the data root (a leading '/' is the root)."""
    root = str(data.root)
    path = _voc_split_file(root, split)
    if not files.is_file(path):
        raise ConfigError("split not found", f"{path}", f"expected a split file for split {split!r} "
                          f"(ImageSets/Segmentation/{split}.txt under data.root, "
                          "or a list file of 'image label' pairs)")
    out = []
    for lineno, parts, line in files.split_lines(path):
        if len(parts) == 1:
            sid = parts[0]
            out.append((sid, files.join(root, _VOC_IMAGE_DIR, f"{sid}.jpg"),
                        files.join(root, _VOC_LABEL_DIR, f"{sid}.png")))
        elif len(parts) == 2:
            image, label = (files.join(root, p.lstrip("/")) for p in parts)
            out.append((files.stem(image), image, label))
        else:
            raise ConfigError("bad split line", f"{path}:{lineno}", f"expected an id or 'image label', got {line!r}")
    if not out:
        raise ConfigError("empty split", str(path), "expected at least one sample")
    return out


def _coco_panoptic(data: DataConfig, split: str) -> list[tuple[str, str, str, panoptic.SegmentTable]]:
    """A COCO panoptic split (panoptic.py): one sample per entry of its JSON's annotations."""
    path, pngs, images = panoptic.coco_folders(data, split)
    raw = panoptic.read_json(path)
    panoptic.coco_categories(raw, path, data.thing_classes)  # a JSON without isthing, or disagreeing, named now
    _folder(pngs, f"expected the panoptic PNGs of {path} in annotations/panoptic_<split>/ under data.root")
    _folder(images, "expected the images of the split in <split>/ or images/<split>/ under data.root")
    present = set(tf.io.gfile.glob(files.join(pngs, "*.png")))
    out = []
    for image, png, table in panoptic.coco_entries(raw, path):
        label = files.join(pngs, png)
        _check_label(label, present, data, f"expected the panoptic PNG {png} that {path} names")
        out.append((files.stem(image), files.join(images, image), label, table))
    if not out:
        raise ConfigError("empty split", path, "at least one annotation")
    return out


_LISTERS = {"voc": _voc, "cityscapes": _cityscapes, "ade20k": _ade20k, "pairs": _pairs,
            "coco_panoptic": _coco_panoptic}


def list_samples(data: DataConfig, split: str) -> list[Sample]:
    """The samples of `split` in the configured layout; ConfigError for a missing root, split, folder,
    list file or (on_bad_sample: error) label, an empty split, or a malformed list line."""
    if data.format == "tfrecord":
        return _records(data, split)
    root = str(data.root)
    if not files.is_dir(root):
        raise ConfigError("data root not found", "data.root",
                          f"expected a {data.layout}-layout folder, got {root!r}")
    return [Sample(*entry[:3], segments=entry[3] if len(entry) > 3 else None)
            for entry in _LISTERS[data.layout](data, split)]


def _records(data: DataConfig, split: str) -> list[Sample]:
    """data.format: tfrecord: one sample per record of the split's shards (data/records.py)."""
    pattern = records.split_pattern(str(data.root), split)
    try:
        found = records.load_records(pattern)
    except FileNotFoundError:
        raise ConfigError("split not found", pattern, f"TFRecord shards of split {split!r} "
                          "(seg-prepare tfrecords writes <split>-NNNNN-of-MMMMM.tfrecord)") from None
    except records.ShardError as e:  # the framing of a shard: truncated, or not a TFRecord file
        raise ConfigError("unreadable TFRecord shard", e.shard, e.problem) from None
    if not found:
        raise ConfigError("empty split", pattern, "at least one record")
    # The record stands for both files: errors name it by shard and id.
    return [Sample(sid, f"{ref.shard}[{sid}]", f"{ref.shard}[{sid}]", ref) for sid, ref in found]


def split_location(data: DataConfig, split: str) -> str:
    """The file or folder that holds `split` (named when it is missing)."""
    if data.format == "tfrecord":
        return records.split_pattern(str(data.root), split)
    if data.layout == "cityscapes":
        return files.join(data.root, "leftImg8bit", split)
    if data.layout == "ade20k":
        return files.join(data.root, "images", split_folder(data, split))
    if data.layout == "pairs":
        return _list_file(data, split)
    if data.layout == "coco_panoptic":
        return panoptic.coco_folders(data, split)[0]
    return _voc_split_file(str(data.root), split)


def split_exists(data: DataConfig, split: str) -> bool:
    """Whether `split` is there to be read (optional splits are skipped with a message when it is not)."""
    where = split_location(data, split)
    if data.format == "tfrecord":
        return bool(records.shard_paths(where))
    return files.is_dir(where) if data.layout in ("cityscapes", "ade20k") else files.is_file(where)
