"""Panoptic data as it ships (data/panoptic.py, data/segments.py): COCO panoptic and Cityscapes gtFine folders laid
out as they ship, read into segment labels (class * 1000 + instance) and held to the formats' definitions written
by hand, to cityscapesScripts' own converters, and to numpy; the labels through the reader's scale, crop and flip;
the stream on 1 and 4 towers and from a resumed step; TFRecords; the scan."""

import json
import logging

import numpy as np
import pytest
import tensorflow as tf
import yaml
from PIL import Image

from seg_train import config as config_lib
from seg_train.config import ConfigError
from seg_train.data import augment, panoptic, segments
from seg_train.data.reader import BadSample, load
from tests.helpers import (
    COCO_CATEGORIES,
    COCO_H,
    COCO_IMAGES,
    COCO_TRAIN_ID_BY_HAND,
    COCO_W,
    coco_labels_by_hand,
    coco_rgb,
    make_coco_panoptic_tree,
    open_reader,
)

EOMT = {"backbone": "dinov3_vits16", "head": "eomt", "num_queries": 20}


def coco_config(tmp_path, root, task="panoptic", **data):
    raw = {"seed": 0, "run_dir": "run",
           "data": {"layout": "coco_panoptic", "task": task, "root": str(root), "num_classes": 5,
                    "train_split": "val", "val_split": "val", "batch_size": 4, "crop_size": [16, 16],
                    "num_parallel_calls": 2, **data},
           "model": EOMT, "train": {"num_steps": 2}}
    path = tmp_path / "coco.yaml"
    path.write_text(yaml.safe_dump(raw))
    return config_lib.load(path)


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco") / "coco"
    scenes = make_coco_panoptic_tree(root, np.random.default_rng(0))
    return root, scenes


def assert_same_segments(got, want):
    """Equal partitions into segments (the same pixels share a label in both), whatever the instance numbers."""
    pairs = np.unique(np.stack([got.ravel(), want.ravel()]), axis=1)
    assert len(np.unique(pairs[0])) == pairs.shape[1] == len(np.unique(pairs[1]))


# ---- the encoding ---------------------------------------------------------------------------------------------
def test_segment_labels_encode_decode_and_the_evaluators_ground_truth():
    """segments.encode / decode in numpy and TensorFlow, and to_panoptic's ground truth (ids from 1, 0 unlabelled,
    crowd flagged, train ids as category ids). Fails for: an instance base other than 1000, decode taking the
    quotient for the instance, a crowd region not flagged, unlabelled pixels made a segment."""
    classes = np.array([[3, 3, 255], [0, 7, 7]])
    instances = np.array([[0, 999, 0], [12, 1, 2]])
    labels = segments.encode(classes, instances)
    np.testing.assert_array_equal(labels, [[3000, 3999, 255000], [12, 7001, 7002]])
    for got in (segments.decode(labels), [t.numpy() for t in segments.decode_tf(tf.constant(labels))]):
        np.testing.assert_array_equal(got[0], classes)
        np.testing.assert_array_equal(got[1], instances)
    np.testing.assert_array_equal(segments.encode_tf(classes, instances).numpy(), labels)
    ids, segs = segments.to_panoptic(labels, 255)
    assert ids[0, 2] == 0 and len(np.unique(ids)) == 6
    by_id = {s["id"]: s for s in segs}
    assert [(by_id[i]["category_id"], by_id[i]["iscrowd"]) for i in ids.ravel() if i] == \
        [(3, 0), (3, 1), (0, 0), (7, 0), (7, 0)]
    masks, train, crowd = segments.to_instances(labels, 255, thing_classes=[7, 3])
    assert train.tolist() == [3, 7, 7] and crowd.tolist() == [True, False, False]
    assert masks.sum((1, 2)).tolist() == [1, 1, 1]


# ---- COCO panoptic -------------------------------------------------------------------------------------------
def test_coco_ids_decode_as_r_plus_256_g_plus_65536_b_in_numpy_and_tensorflow(tmp_path):
    """One pixel per byte pattern of the id, written as COCO's PNG (RGB, Pillow) from the format's definition
    id = R + 256 G + 256^2 B, decoded by the codec's numpy and TensorFlow paths into the segment each id names.
    Fails for: the channels in the other order (B + 256 G + 256^2 R), a channel left out, the ids decoded from a
    luminance conversion."""
    rgb = np.array([[[1, 0, 0], [0, 1, 0], [0, 0, 1], [12, 34, 56], [255, 255, 255], [0, 0, 0]]], np.uint8)
    by_hand = [1, 256, 65536, 12 + 256 * 34 + 65536 * 56, 16777215, 0]
    np.testing.assert_array_equal(panoptic.rgb_to_id(rgb)[0], by_hand)
    cats = panoptic.Categories((7, 9), ("stuff", "thing"), (False, True))
    table = panoptic.SegmentTable(tuple(by_hand[:5]), (7, 9, 9, 9, 7), (0, 0, 0, 1, 0))
    png = tmp_path / "x.png"
    Image.fromarray(rgb, mode="RGB").save(png)
    data = png.read_bytes()
    codec = panoptic.SegmentCodec(config_lib.DataConfig(root=tmp_path, layout="coco_panoptic", num_classes=2,
                                                        task="panoptic"), cats)
    want = [0, 1001, 1002, 1999, 0, 255000]  # stuff 7 -> 0; things 9 -> 1 numbered in list order; crowd; VOID
    np.testing.assert_array_equal(codec.decode_np(data, table, "x.png")[0], want)
    label, valid = codec.decode_tf(tf.constant(data), tuple(tf.constant(a) for a in (table.ids, table.category_ids,
                                                                                       table.iscrowd)))
    assert bool(valid)
    np.testing.assert_array_equal(label.numpy()[0], want)


def test_coco_split_as_shipped_read_scanned_and_mapped_both_ways(coco, tmp_path, caplog):
    """COCO's val2017 panoptic layout (real file names and JSON structure, five real categories): the samples
    and their labels, by both decoders, equal the labels built by hand from the PNG ids and segments_info
    (category ids mapped to train ids by hand, crowd 999, stuff 0, unlabelled ignored); the categories' ids map
    the train ids back; the names come from the JSON; the scan counts segments and crowd by hand. `train` names
    val2017 when only COCO's file names are there. Fails for: category ids taken as train ids, a wrong sort of
    the categories, crowd as an instance, a segment's pixels read from another id, the TensorFlow path
    falling back to Pillow (it would hide a graph bug)."""
    from seg_train.data import scan
    from seg_train.data.split import categories_of, open_split

    root, scenes = coco
    cfg = coco_config(tmp_path, root)
    split = open_split(cfg, "val")
    assert [s.id for s in split.samples] == list(COCO_IMAGES)
    assert split.samples[0].image == str(root / "val2017" / "000000000139.jpg")
    assert split.samples[0].label == str(root / "annotations" / "panoptic_val2017" / "000000000139.png")
    cats = split.categories
    assert cats == categories_of(cfg)
    assert {c: cats.ids[t] for c, t in COCO_TRAIN_ID_BY_HAND.items()} == {c: c for c in COCO_TRAIN_ID_BY_HAND}
    assert cats.thing_classes == (0, 1) and split.class_names == [c["name"] for c in COCO_CATEGORIES]
    assert [panoptic.image_id(s) for s in split.samples] == [int(s) for s in COCO_IMAGES]
    with caplog.at_level(logging.WARNING, "seg_train"):
        for i, s in enumerate(split.samples):
            want = coco_labels_by_hand(*scenes[s.id])
            _, label = split.reader.decode(i)
            assert label.dtype == tf.int32
            np.testing.assert_array_equal(label.numpy(), want)
            np.testing.assert_array_equal(load(s, 5, 255, split.label_table)[1], want)
    assert not caplog.records, caplog.text

    report = scan.scan(split.samples, 5, 255, label_table=split.label_table)
    assert report.segments.tolist() == [3 * 3, 3, 3, 3, 0]  # persons: 2 + a crowd per image; car; tree; wall
    assert report.crowd.tolist() == [3, 0, 0, 0, 0]
    unlabelled = sum(int((ids == 0).sum()) for ids, _ in scenes.values())
    assert report.histogram[-1] == unlabelled and report.histogram.sum() == 3 * COCO_H * COCO_W
    assert "segments" in scan.format_report(report, split.class_names)


def test_coco_errors_are_one_line_naming_the_file(coco, tmp_path):
    """A JSON without isthing needs data.thing_classes (then they decide), one that disagrees with it is refused,
    data.num_classes against the categories, and a PNG id that segments_info does not list is a bad sample
    naming the PNG. Fails for: a silently guessed thing list, a class count taken from the config alone, an
    unknown id read as unlabelled."""
    from seg_train.data.split import open_split

    root, _ = coco
    other = tmp_path / "other"
    no_isthing = [{k: v for k, v in c.items() if k != "isthing"} for c in COCO_CATEGORIES]
    make_coco_panoptic_tree(other, np.random.default_rng(1), "val", categories=no_isthing)
    with pytest.raises(ConfigError) as e:
        open_split(coco_config(tmp_path, other), "val")
    assert (e.value.what, e.value.where) == ("thing classes unknown", str(other / "annotations" / "panoptic_val.json"))
    assert open_split(coco_config(tmp_path, other, thing_classes=[1]), "val").categories.thing_classes == (1,)
    with pytest.raises(ConfigError) as e:
        open_split(coco_config(tmp_path, root, thing_classes=[1]), "val")
    assert e.value.where == "data.thing_classes"
    with pytest.raises(ConfigError) as e:
        open_split(coco_config(tmp_path, root, num_classes=6), "val")
    assert e.value.where == "data.num_classes" and "5" in e.value.expected

    png = other / "annotations" / "panoptic_val" / f"{COCO_IMAGES[0]}.png"
    rgb = np.asarray(Image.open(png)).copy()
    rgb[5, 5] = [9, 9, 9]
    Image.fromarray(rgb).save(png)
    split = open_split(coco_config(tmp_path, other, thing_classes=[0, 1]), "val")
    with pytest.raises(BadSample, match=r"bad label \(.*000000000139\.png\): segment ids in the PNG that its "
                                        r"segments_info does not list: \[592137\]"):
        load(split.samples[0], 5, 255, split.label_table)


def test_config_refusals_are_one_line():
    """A per-pixel head refuses panoptic and instance; a layout without segments refuses them; thing classes
    with the semantic task; coco_panoptic with the semantic task or a label map. Cityscapes fills its 8 things.
    Fails for: any of these accepted (a run that trains on the wrong labels), Cityscapes' things left unknown."""
    base = {"data": {"root": "/x", "layout": "coco_panoptic", "task": "panoptic", "num_classes": 5,
                     "crop_size": [32, 32]}, "model": dict(EOMT)}

    def refused(where, **changes):
        raw = json.loads(json.dumps(base))
        for key, value in changes.items():
            section, name = key.split("__")
            raw[section][name] = value
        with pytest.raises(ConfigError) as e:
            config_lib.from_dict(raw)
        assert e.value.where == where, e.value
        return e.value

    config_lib.from_dict(base)
    assert "eomt" in refused("data.task", model__head="deeplabv3plus", model__backbone="mobilenetv2").expected
    refused("data.layout", data__layout="voc")
    refused("data.layout", data__task="semantic")
    refused("data.thing_classes", data__task="semantic", data__layout="voc", data__thing_classes=[1])
    refused("data.label_map", data__label_map={0: 1})
    refused("data.thing_classes", data__thing_classes=[2, 5])
    refused("data.thing_classes", data__thing_classes=[3, 1])
    cityscapes = config_lib.from_dict({"data": {"root": "/x", "layout": "cityscapes", "task": "instance",
                                                "crop_size": [32, 32]}, "model": dict(EOMT)})
    assert cityscapes.data.thing_classes == [11, 12, 13, 14, 15, 16, 17, 18]  # person .. bicycle
    semantic = config_lib.from_dict({"data": {"root": "/x", "layout": "cityscapes"}})
    assert semantic.data.task == "semantic" and semantic.data.thing_classes is None


# ---- Cityscapes ----------------------------------------------------------------------------------------------
CITYSCAPES_OBJECTS = [  # drawn in this order by cityscapesScripts, the later over the earlier
    ("sky", [[0, 0], [63, 0], [63, 15], [0, 15]]),
    ("building", [[0, 10], [40, 10], [40, 30], [0, 30]]),
    ("road", [[0, 30], [63, 30], [63, 47], [0, 47]]),
    ("car", [[2, 28], [14, 28], [14, 40], [2, 40]]),
    ("car", [[12, 30], [24, 30], [24, 44], [12, 44]]),  # overlaps the first car
    ("cargroup", [[40, 32], [60, 32], [60, 42], [40, 42]]),  # crowd
    ("person", [[30, 12], [34, 12], [34, 36], [30, 36]]),
    ("caravan", [[50, 10], [60, 10], [60, 20], [50, 20]]),  # has instances, ignored in evaluation: void
    ("ego vehicle", [[0, 44], [63, 44], [63, 47], [0, 47]]),  # void
]


def make_cityscapes_gtfine(root, split="val", city="frankfurt", n=2):
    """gtFine/<split>/<city>/ as shipped, from polygons: *_gtFine_polygons.json, *_gtFine_instanceIds.png drawn by
    cityscapesScripts' own json2instanceImg (saved as the 16-bit grey PNG Cityscapes ships: Pillow no longer
    writes its mode-I image as PNG), *_gtFine_labelIds.png by json2labelImg, and leftImg8bit images."""
    from cityscapesscripts.helpers.annotation import Annotation
    from cityscapesscripts.preparation.json2instanceImg import createInstanceImage
    from cityscapesscripts.preparation.json2labelImg import createLabelImage

    gt, left = root / "gtFine" / split / city, root / "leftImg8bit" / split / city
    gt.mkdir(parents=True)
    left.mkdir(parents=True)
    for i in range(n):
        stem = f"{city}_{i:06d}_000019"
        objects = [{"label": lab, "polygon": [[x + 3 * i, y] for x, y in poly]} for lab, poly in CITYSCAPES_OBJECTS]
        path = gt / f"{stem}_gtFine_polygons.json"
        path.write_text(json.dumps({"imgHeight": 48, "imgWidth": 64, "objects": objects}))
        annotation = Annotation()
        annotation.fromJsonFile(str(path))
        ids = np.asarray(createInstanceImage(annotation, "ids"))
        Image.fromarray(ids.astype(np.uint16)).save(gt / f"{stem}_gtFine_instanceIds.png")
        createLabelImage(annotation, "ids").save(gt / f"{stem}_gtFine_labelIds.png")
        Image.fromarray(np.full((48, 64, 3), 90 + 40 * i, np.uint8)).save(left / f"{stem}_leftImg8bit.png")
    return root


def test_cityscapes_instance_ids_match_cityscapesscripts_panoptic_conversion(tmp_path):
    """Cityscapes' gtFine written by cityscapesScripts' own drawing (16-bit instanceIds as shipped), read with
    layout cityscapes and data.task panoptic, against cityscapesScripts' createPanopticImgs of the same files
    (train ids as categories): every pixel's class is its reference segment's category, crowd (the cargroup)
    exactly where the reference says iscrowd, void where the reference has no segment, and the same pixels
    share a segment in both. Fails for: a cargroup read as one car, instanceIds read as 8 bits, labelId * 1000 +
    k divided the other way, the caravan (instances, ignored in evaluation) kept."""
    from cityscapesscripts.preparation.createPanopticImgs import convert2panoptic

    from seg_train.data.split import open_split

    root = make_cityscapes_gtfine(tmp_path / "cityscapes")
    instance_png = next((root / "gtFine" / "val" / "frankfurt").glob("*_instanceIds.png"))
    with Image.open(instance_png) as im:
        assert im.mode == "I;16"
    out = tmp_path / "reference"
    out.mkdir()
    convert2panoptic(str(root / "gtFine"), str(out), useTrainId=True, setNames=["val"])
    reference = json.loads((out / "cityscapes_panoptic_val_trainId.json").read_text())
    cfg = config_lib.from_dict({"data": {"root": str(root), "layout": "cityscapes", "task": "panoptic",
                                         "crop_size": [32, 32]}, "model": dict(EOMT)})
    split = open_split(cfg, "val")
    assert split.samples[0].label.endswith("_gtFine_instanceIds.png")
    for i, (sample, ann) in enumerate(zip(split.samples, reference["annotations"])):
        assert ann["image_id"] == sample.id
        ref_ids = panoptic.rgb_to_id(np.asarray(Image.open(out / "cityscapes_panoptic_val_trainId" /
                                                           ann["file_name"]).convert("RGB")))
        info = {s["id"]: s for s in ann["segments_info"]}
        known = np.isin(ref_ids, list(info))
        ref_class = np.vectorize(lambda v: info[v]["category_id"] if v in info else 255)(ref_ids)
        ref_crowd = np.vectorize(lambda v: bool(info[v]["iscrowd"]) if v in info else False)(ref_ids)
        for label in (split.reader.decode(i)[1].numpy(), load(sample, 19, 255, split.label_table)[1]):
            cls, inst = segments.decode(label)
            np.testing.assert_array_equal(cls, ref_class)
            np.testing.assert_array_equal(inst == segments.CROWD, ref_crowd)
            assert_same_segments(label[known], ref_ids[known])
        assert ref_crowd.any() and (cls == 13).sum() > (inst == segments.CROWD).sum() > 0  # cars and a group


# ---- through the reader: scale, crop, flip; towers; resume; TFRecords --------------------------------------------
def nearest_crop_by_hand(label, plan, crop, ignore):
    """The crop of `label` that `plan` (its draws: scaled size, window, mirror) describes, by numpy: nearest
    source pixel min(floor((i + 0.5) * (in / out)), in - 1) in float32 (TensorFlow's ResizeNearestNeighbor with
    half-pixel centres), then mirror, pad with `ignore`, cut the window."""
    H, W = label.shape  # noqa: N806
    h, w, y, x, flip = (int(v) for v in (plan.h, plan.w, plan.y, plan.x, plan.flip))
    f = np.float32  # in float32, as the kernel computes it (resize_nearest_neighbor_op.cc)
    rows = np.minimum(np.floor((np.arange(h, dtype=f) + f(0.5)) * (f(H) / f(h))).astype(int), H - 1)
    cols = np.minimum(np.floor((np.arange(w, dtype=f) + f(0.5)) * (f(W) / f(w))).astype(int), W - 1)
    scaled = label[rows][:, cols]
    if flip:
        scaled = scaled[:, ::-1]
    padded = np.full((max(h, crop[0]), max(w, crop[1])), ignore, label.dtype)
    padded[:h, :w] = scaled
    return padded[y:y + crop[0], x:x + crop[1]]


def test_scale_crop_flip_carry_each_pixels_segment_exactly(coco, tmp_path):
    """The training crops' segment labels equal a numpy nearest resample of the full-resolution labels by hand,
    mirrored, padded with 255 * 1000 and cut at the drawn window, and TensorFlow's own nearest resize of the
    same labels; at scales from 0.5 to 3, both mirror cases, windows that cut segments away. A segment outside
    the window is simply absent. Fails for: labels resampled bilinearly (values between two segments' labels),
    padding with 255 (a class-0 instance), the label not mirrored with the image."""
    root, scenes = coco
    cfg = coco_config(tmp_path, root, crop_size=[16, 16], random_scale=[0.5, 3.0])
    reader = open_reader(cfg, "val")
    image, label = reader.decode(0)
    full = label.numpy()
    seen = set()
    for k in range(24):
        k = tf.constant(k, tf.int64)
        plan = augment.crop_plan(cfg.data, cfg.seed, tf.shape(label), k)
        _, got = reader.augment(image, label, k)
        want = nearest_crop_by_hand(full, plan, (16, 16), 255000)
        np.testing.assert_array_equal(got.numpy(), want, err_msg=f"k={int(k)}")
        resized = tf.image.resize(full[..., None], [plan.h, plan.w], method="nearest")[..., 0].numpy()
        if int(plan.h) <= 16 and int(plan.w) <= 16 and not bool(plan.flip):
            np.testing.assert_array_equal(got.numpy()[:int(plan.h), :int(plan.w)], resized)
        seen.add((bool(plan.flip), float(plan.h) > COCO_H, len(np.unique(got)) < len(np.unique(full))))
    assert {(False, True, True), (True, True, True)} <= seen and any(not big for _, big, _ in seen)


def first_batches(reader, global_batch, towers, start, steps):
    """`steps` global batches from `start` as `towers` towers read them (one pipeline deals them in turn)."""
    ds = reader.train_dataset(global_batch, start, towers)
    out = []
    parts = list(ds.take(steps * towers).as_numpy_iterator())
    for s in range(steps):
        out.append(tuple(np.concatenate([p[j] for p in parts[s * towers:(s + 1) * towers]]) for j in range(2)))
    return out


def test_one_tower_four_towers_and_resume_read_the_same_segment_batches(tmp_path):
    """The synthetic panoptic demo set (data.synthetic with data.task panoptic, COCO's layout) through the
    training stream: 4 towers' slices make the global batch 1 tower reads, and a stream restarted at step 2
    reads steps 2 and 3 as the whole stream does, images and int32 segment labels bitwise; with data.cache (the
    Pillow decode, kept) too. Fails for: any draw
    or decode that depends on the tower or on the pipeline's past (e.g. a stateful random op, a counter kept in
    the reader), labels cast to uint8 on the way."""
    root = tmp_path / "demo"
    cfg = coco_config(tmp_path, root, synthetic=True, train_split="train", val_split="val", crop_size=[32, 32])
    reader = open_reader(cfg, "train")
    assert (root / "annotations" / "panoptic_train.json").is_file() and (root / "train").is_dir()
    one = first_batches(reader, 4, 1, 0, 4)
    four = first_batches(reader, 4, 4, 0, 4)
    resumed = first_batches(reader, 4, 4, 2, 2)
    assert one[0][1].dtype == np.int32 and (segments.decode(one[0][1])[1] > 0).any()
    for a, b in zip(one, four):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    for a, b in zip(one[2:], resumed):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    cached = open_reader(config_lib.replace(cfg, "data.cache", True), "train")
    for x, y in zip(one[0], first_batches(cached, 4, 2, 0, 1)[0]):  # data.cache: the Pillow decode, kept
        np.testing.assert_array_equal(x, y)


def test_the_demo_set_is_coco_panoptic_with_separate_things(tmp_path):
    """The synthetic panoptic set as a COCO panoptic reader sees it: every PNG id listed in segments_info with
    its area, every listed segment present, category ids not contiguous, things of a class several times in
    one image, crowd regions, unlabelled pixels. Fails for: ids missing from the JSON (bad samples), areas of
    the pre-outline masks, a set with one instance per class (nothing to tell apart)."""
    from seg_train.data import synthetic_panoptic

    root = synthetic_panoptic.generate(tmp_path / "demo", num_train=24, num_val=2, size=(48, 48), num_classes=5)
    raw = json.loads((root / "annotations" / "panoptic_train.json").read_text())
    assert [c["id"] for c in raw["categories"]] == [2, 5, 8, 11, 14]
    assert [c["isthing"] for c in raw["categories"]] == [0, 0, 0, 1, 1]
    several = crowd = 0
    for ann in raw["annotations"]:
        ids = panoptic.rgb_to_id(np.asarray(Image.open(root / "annotations" / "panoptic_train" / ann["file_name"])))
        listed = {s["id"]: s for s in ann["segments_info"]}
        assert set(np.unique(ids).tolist()) - {0} == set(listed)
        assert all(int((ids == i).sum()) == s["area"] for i, s in listed.items())
        things = [s["category_id"] for s in listed.values() if s["category_id"] in (11, 14) and not s["iscrowd"]]
        several += len(things) > len(set(things))
        crowd += any(s["iscrowd"] for s in listed.values())
        assert (ids == 0).any()
    assert several >= 3 and crowd >= 1


def test_tfrecords_keep_segment_labels_exactly(coco, tmp_path):
    """seg-prepare tfrecords of a COCO panoptic split (to ram://, a remote file system): the records hold the
    PNG as shipped with the segments_info, the index the categories; read with data.format tfrecord (no JSON
    there) every sample's labels and the training stream equal the folder's. Fails for: a lossy or 8-bit
    re-encoding of the ids, the segment table dropped (every id unknown), the categories not carried over."""
    import uuid

    from seg_train.data.prepare.tfrecords import write_tfrecords

    root, scenes = coco
    cfg = coco_config(tmp_path, root, crop_size=[16, 16])
    out = f"ram://{uuid.uuid4().hex}/coco"
    write_tfrecords(cfg, "val", out, 2)
    index = json.loads(tf.io.gfile.GFile(f"{out}/val.index.json").read())
    assert [c["id"] for c in index["categories"]] == [c["id"] for c in COCO_CATEGORIES]
    rec_cfg = config_lib.replace(config_lib.replace(cfg, "data.format", "tfrecord"), "data.root", out)
    records = open_reader(rec_cfg, "val")
    files = open_reader(cfg, "val")
    assert len(records) == 3
    for i in range(3):
        np.testing.assert_array_equal(records.decode(i)[1].numpy(),
                                      coco_labels_by_hand(*scenes[COCO_IMAGES[i]]))
        np.testing.assert_array_equal(load(records.samples[i], 5, 255, records.label_table)[1],
                                      files.decode(i)[1].numpy())
    for a, b in zip(first_batches(records, 4, 1, 0, 2), first_batches(files, 4, 1, 0, 2)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_eval_samples_are_full_resolution_segment_labels_padded_with_ignore(coco, tmp_path):
    """Evaluation samples: each image at full size, its int32 segment labels as by hand, the padding to a
    multiple of 32 filled with 255 * 1000 (never a segment). Fails for: padding with 255 (read as class 0,
    instance 255), labels cut to uint8."""
    root, scenes = coco
    reader = open_reader(coco_config(tmp_path, root), "val")
    for image, label, index in reader.eval_dataset(pad_to=32).as_numpy_iterator():
        want = coco_labels_by_hand(*scenes[COCO_IMAGES[int(index)]])
        assert image.shape == (1, 32, 32, 3) and label.dtype == np.int32
        np.testing.assert_array_equal(label[0, :COCO_H, :COCO_W], want)
        assert (label[0, COCO_H:] == 255000).all()


def test_a_killed_rgb_png_is_refused_not_misread(coco, tmp_path):
    """A COCO PNG saved as greyscale (an annotation tool's mistake) is a bad sample in both decoders, never ids
    from a luminance. Fails for: grey values taken as ids R = G = B."""
    from seg_train.data.split import open_split

    root = tmp_path / "grey"
    make_coco_panoptic_tree(root, np.random.default_rng(2), "val")
    png = root / "annotations" / "panoptic_val" / f"{COCO_IMAGES[1]}.png"
    Image.fromarray(np.asarray(Image.open(png))[..., 0]).save(png)
    split = open_split(coco_config(tmp_path, root), "val")
    with pytest.raises(BadSample, match="expected an 8-bit RGB PNG of segment ids"):
        load(split.samples[1], 5, 255, split.label_table)
    label, valid = split.label_table.decode_tf(tf.io.read_file(str(png)), tuple(
        tf.constant(a) for a in (split.samples[1].segments.ids, split.samples[1].segments.category_ids,
                                 split.samples[1].segments.iscrowd)))
    assert not bool(valid)
    assert coco_rgb(np.array([0x123456]))[0].tolist() == [0x56, 0x34, 0x12]


@pytest.mark.slow
def test_check_data_scans_cityscapes_instance_ids_for_the_panoptic_task(tmp_path, capsys):
    """seg-train --check-data with data.task panoptic on Cityscapes' gtFine: the scan reads the instanceIds (not
    the labelIds) and reports per class the segments and crowd regions cityscapesScripts drew: 2 cars and a
    group per image, the group a crowd, one person. Fails for: data.task dropped between the config and the scan
    (labelIds read, no segment counts), the group counted as a car."""
    from seg_train import cli

    root = make_cityscapes_gtfine(tmp_path / "cityscapes")
    path = tmp_path / "cityscapes.yaml"
    path.write_text(yaml.safe_dump({"data": {"root": str(root), "layout": "cityscapes", "task": "panoptic",
                                             "train_split": "val", "val_split": "val", "crop_size": [32, 32]},
                                    "model": EOMT, "run_dir": str(tmp_path / "run")}))
    assert cli.train_main(["--config", str(path), "--check-data"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0] in ("car", "person", "caravan")}
    assert rows["car"][-2:] == ["6", "2"] and rows["person"][-2:] == ["2", "0"], rows


def test_coco_panoptic_on_a_remote_file_system_reads_like_on_disk(coco, tmp_path):
    """The COCO panoptic split copied to ram:// (a TensorFlow file system, as gs:// is): the JSON, the PNG folder
    and the images are found and read through tf.io.gfile, the same samples and labels as on disk. Fails for:
    a path through pathlib (ram:/...), the JSON read with open()."""
    import os
    import uuid

    root, scenes = coco
    ram = f"ram://{uuid.uuid4().hex}/coco"
    for dirpath, _, names in os.walk(root):
        target = ram + dirpath[len(str(root)):]
        tf.io.gfile.makedirs(target)
        for name in names:
            tf.io.gfile.copy(os.path.join(dirpath, name), f"{target}/{name}")
    reader = open_reader(coco_config(tmp_path, ram), "val")
    assert reader.samples[0].label == f"{ram}/annotations/panoptic_val2017/{COCO_IMAGES[0]}.png"
    for i, stem in enumerate(COCO_IMAGES):
        np.testing.assert_array_equal(reader.decode(i)[1].numpy(), coco_labels_by_hand(*scenes[stem]))
