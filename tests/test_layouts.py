"""The data layouts as they ship (seg_train/data/layouts.py): tiny Cityscapes, ADE20K and pairs trees
with the real file naming, read through the real commands.

Fails for: a layout that lists the wrong files (Cityscapes' colour or instance PNGs instead of the
labelIds, an image paired with another city's label), labels reaching training or evaluation as raw
ids instead of train ids (checked pixel by pixel against maps written out by hand), --check-data
counting raw values or not naming a raw value without a mapping, a missing folder or label that is
not named in one line, and a layout that trains, evaluates or predicts differently from the VOC path.
"""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml
from PIL import Image

from seg_train import cli
from seg_train import config as config_lib
from seg_train.config import ConfigError
from seg_train.config.resolve import annealing_windows
from seg_train.data import layouts
from seg_train.data.scan import class_weights_for_split
from seg_train.data.split import class_names_of
from tests.helpers import LAYOUT_H as H
from tests.helpers import LAYOUT_W as W
from tests.helpers import load_layout as load
from tests.helpers import mapped_label as mapped
from tests.helpers import open_reader, raw_label
from tests.helpers import write_layout_config as write_config


def test_each_layout_lists_its_files(tmp_path, trees):
    cs = load(tmp_path, trees, "cityscapes").data
    samples = layouts.list_samples(cs, "train")
    root = trees["cityscapes"]
    assert [s.id for s in samples] == ["aachen_000000_000019", "aachen_000001_000019", "bochum_000000_000019"]
    assert samples[2].image == str(root / "leftImg8bit/train/bochum/bochum_000000_000019_leftImg8bit.png")
    assert samples[2].label == str(root / "gtFine/train/bochum/bochum_000000_000019_gtFine_labelIds.png")
    assert layouts.split_exists(cs, "val") and not layouts.split_exists(cs, "nosuch")

    ade = load(tmp_path, trees, "ade20k").data
    samples = layouts.list_samples(ade, "validation")
    root = trees["ade20k"]
    assert [(s.id, s.image, s.label) for s in samples] == [
        (f"ADE_val_0000000{n}", str(root / f"images/validation/ADE_val_0000000{n}.jpg"),
         str(root / f"annotations/validation/ADE_val_0000000{n}.png")) for n in (1, 2)]

    pairs = load(tmp_path, trees, "pairs").data
    samples = layouts.list_samples(pairs, "val.txt")
    assert [(s.id, s.label) for s in samples] == [
        (f"photos/a/p{n}", str(trees["pairs"] / f"masks/p{n}_mask.png")) for n in (3, 4)]
    assert class_names_of(load(tmp_path, trees, "cityscapes"))[13] == "car"
    assert class_names_of(load(tmp_path, trees, "ade20k"))[:2] == ["wall", "building"]


@pytest.mark.parametrize("layout", ["cityscapes", "ade20k", "pairs"])
def test_reader_labels_are_the_by_hand_mapping(tmp_path, trees, layout):
    cfg = load(tmp_path, trees, layout)
    reader = open_reader(cfg, cfg.data.train_split)
    assert reader.label_table is not None
    for i, s in enumerate(reader.samples):
        image, label = reader.decode(i)
        np.testing.assert_array_equal(label.numpy(), mapped(layout, s.label), err_msg=s.label)
        assert image.shape == (H, W, 3)
    if layout == "cityscapes":  # the ids the test names: road, sidewalk, car, ignored, bicycle
        raw = raw_label(reader.samples[0].label)
        label = reader.decode(0)[1].numpy()
        for raw_id, train_id in ((7, 0), (8, 1), (26, 13), (0, 255), (9, 255), (33, 18)):
            if (raw == raw_id).any():
                assert (label[raw == raw_id] == train_id).all()


def test_training_stream_evaluation_and_class_weights_see_train_ids(tmp_path, trees):
    cfg = load(tmp_path, trees, "cityscapes", crop_size=[H, W], random_scale=[1.0, 1.0], random_mirror=False)
    reader = open_reader(cfg, "train")
    expected = [mapped("cityscapes", s.label) for s in reader.samples]
    # One epoch of 3 samples, whole images (the crop is the image): each is one of the mapped labels, once.
    (_, labels), = reader.train_dataset(3, 0, 1).take(1)
    seen = sorted(next(i for i, e in enumerate(expected) if np.array_equal(e, lbl)) for lbl in labels.numpy())
    assert seen == [0, 1, 2]
    for _, label, index in reader.eval_dataset():
        label = label.numpy()[0]
        np.testing.assert_array_equal(label[:H, :W], expected[int(index)])
        assert (label[H:] == 255).all() and (label[:, W:] == 255).all()  # padding: ignored

    # Median frequency by hand (numpy) from the mapped labels; the weights come from the scan with the map.
    cfg = config_lib.replace(cfg, "loss.class_weights", "median_frequency")
    stack = np.stack(expected)
    pixels = np.array([(stack == c).sum() for c in range(19)], np.float64)
    labelled = np.array([(e != 255).sum() for e in expected])
    image_pixels = np.array([sum(n for e, n in zip(expected, labelled) if (e == c).any()) for c in range(19)])
    present = pixels > 0
    freq = np.where(present, pixels / np.maximum(image_pixels, 1), 0)
    want = np.where(present, np.median(freq[present]) / np.where(present, freq, 1), 0)
    np.testing.assert_allclose(class_weights_for_split(cfg, reader), want, rtol=1e-6)


@pytest.mark.slow
def test_check_data_histogram_after_the_map_names_unmapped_values(tmp_path, trees, capsys):
    path = write_config(tmp_path, trees, "cityscapes", train_split="broken")
    assert cli.train_main(["--config", str(path), "--check-data"]) == 2
    out, err = capsys.readouterr()
    broken, val = out.split("split val: ")
    assert "raw label values with no mapping (their samples are bad): 40 (64 pixels in 1 samples)" in broken
    assert re.search(r"^bad: label values with no mapping \(.*aachen_000000_000019_gtFine_labelIds\.png\): "
                     r"expected raw values the label map covers, got \[40\]$", broken, re.M), broken
    assert err.strip().splitlines()[-1].startswith("error: 1 bad sample(s)")
    labels = [mapped("cityscapes", s.label) for s in layouts.list_samples(load(tmp_path, trees, "cityscapes").data,
                                                                          "val")]
    names = list(layouts.CITYSCAPES_CLASSES) + ["ignore"]
    for c, name in enumerate(names):
        count = sum(int((lbl == (255 if name == "ignore" else c)).sum()) for lbl in labels)
        assert re.search(rf"^{re.escape(name)}\s+{count}\s", val, re.M), (name, count, val)


def expect_error(data, split, message):
    with pytest.raises(ConfigError) as e:
        layouts.list_samples(data, split)
    assert str(e.value) == message and "\n" not in message


def test_missing_folders_and_files_are_named(tmp_path, trees):
    cs = load(tmp_path, trees, "cityscapes").data
    root = trees["cityscapes"]
    image = root / "leftImg8bit/nolabel/ulm/ulm_000000_000019_leftImg8bit.png"
    expect_error(cs, "nolabel", f"label not found ({root / 'gtFine/nolabel/ulm/ulm_000000_000019_gtFine_labelIds.png'})"
                 f": expected the gtFine labelIds PNG of {image}")
    expect_error(cs, "test", f"folder not found ({root / 'gtFine/test'}): expected Cityscapes' "
                 "gtFine/test/<city>/*_gtFine_labelIds.png under data.root (gtFine_trainvaltest.zip unpacked next "
                 "to leftImg8bit)")
    # With on_bad_sample: skip the sample is listed, and the scan drops it like any unreadable sample.
    skip = config_lib.replace(load(tmp_path, trees, "cityscapes"), "data.on_bad_sample", "skip").data
    assert len(layouts.list_samples(skip, "nolabel")) == 1

    ade = load(tmp_path, trees, "ade20k").data
    expect_error(ade, "test", f"folder not found ({trees['ade20k'] / 'images/test'}): expected "
                 "ADEChallengeData2016's images/test/*.jpg under data.root (the split names a folder: training or "
                 "validation, which train and val also name)")

    pairs = load(tmp_path, trees, "pairs").data
    expect_error(pairs, "nosuch.txt", f"split not found ({trees['pairs'] / 'nosuch.txt'}): expected a list file of "
                 "'image_path label_path' lines for split 'nosuch.txt' (relative to data.root)")
    bad = tmp_path / "bad.txt"
    bad.write_text("photos/a/p0.png masks/p0_mask.png\nphotos/a/p1.png\n")
    expect_error(pairs, str(bad), f"bad split line ({bad}:2): expected 'image_path label_path', "
                 "got 'photos/a/p1.png'")
    bad.write_text("photos/a/p0.png masks/none.png\n")
    expect_error(pairs, str(bad), f"label not found ({trees['pairs'] / 'masks/none.png'}): expected the label PNG "
                 f"of {bad}:1")
    gone = config_lib.replace(load(tmp_path, trees, "pairs"), "data.root", tmp_path / "gone").data
    expect_error(gone, "train.txt", f"data root not found (data.root): expected a pairs-layout folder, got "
                 f"'{tmp_path / 'gone'}'")


def default_splits(path: Path) -> Path:
    """The config at `path` without data.train_split / val_split: the defaults, train and val."""
    raw = yaml.safe_load(path.read_text())
    del raw["data"]["train_split"], raw["data"]["val_split"]
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_ade20k_default_split_names_are_training_and_validation(tmp_path, trees, capsys):
    """data.layout: ade20k with the default split names (train, val) reads images/training and
    images/validation (the usual names), through --check-data; the explicit names give the same
    samples. Fails for the alias dropped (folder not found) or dropped only where a split's existence is
    asked (the val split then 'not found, skipped', the run silently without evaluation)."""
    path = default_splits(write_config(tmp_path, trees, "ade20k"))
    cfg = config_lib.load(path)
    assert (cfg.data.train_split, cfg.data.val_split) == ("train", "val")
    assert cli.train_main(["--config", str(path), "--check-data"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^split train: 3 samples, 0 bad", out, re.M), out
    assert re.search(r"^split val: 2 samples, 0 bad", out, re.M), out
    for alias, folder in (("train", "training"), ("val", "validation")):
        assert layouts.split_exists(cfg.data, alias)
        assert layouts.split_location(cfg.data, alias) == str(trees["ade20k"] / "images" / folder)
        assert layouts.list_samples(cfg.data, alias) == layouts.list_samples(cfg.data, folder)
    assert [s.image for s in layouts.list_samples(cfg.data, "val")] == [
        str(trees["ade20k"] / f"images/validation/ADE_val_0000000{n}.jpg") for n in (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("layout, predict_from", [("cityscapes", "leftImg8bit/val/frankfurt"),
                                                  ("ade20k", "images/validation")])
def test_train_eval_predict(tmp_path, trees, layout, predict_from, capsys):
    """seg-train, seg-eval and seg-predict on the layout as shipped (tiny model, 2 steps), with the
    default split names (train, val: ADE20K's training and validation)."""
    path = str(default_splits(write_config(tmp_path, trees, layout)))
    run = tmp_path / "run"
    assert cli.train_main(["--config", path, "--gpus", "1"]) == 0
    assert tf.train.latest_checkpoint(str(run / "checkpoints")).endswith("ckpt-2")
    capsys.readouterr()
    assert cli.eval_main(["--config", path, "--gpus", "1", "--checkpoint", str(run), "--json"]) == 0
    record = json.loads((run / "eval" / "val-step2.json").read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record  # --json: the record, last
    cfg = config_lib.load(path)
    val = layouts.list_samples(cfg.data, cfg.data.val_split)
    labels = np.concatenate([mapped(layout, s.label).ravel() for s in val])
    # Every labelled pixel counted once, under its train id: the rows of the confusion matrix.
    by_class = np.bincount(labels[labels != 255], minlength=cfg.data.num_classes)
    np.testing.assert_array_equal(np.sum(record["confusion_matrix"], axis=1), by_class)
    assert list(record["per_class_iou"])[:2] == class_names_of(cfg)[:2]
    if layout == "cityscapes":
        # The .tflite file's evaluation reads the split through the same layout and label map.
        pytest.importorskip("ai_edge_litert")
        model = tmp_path / "m.tflite"
        assert cli.export_main(["--config", path, "--checkpoint", str(run), "--format", "tflite", "--output",
                                str(model)]) == 0
        assert cli.eval_main(["--config", path, "--model", str(model), "--json"]) == 0
        lite = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        np.testing.assert_array_equal(np.sum(lite["confusion_matrix"], axis=1), by_class)

    out = tmp_path / "pred"
    inputs = trees[layout] / predict_from
    assert cli.predict_main(["--config", path, "--gpus", "1", "--checkpoint", str(run), "--output", str(out),
                             str(inputs)]) == 0
    for image in sorted(inputs.iterdir()):
        classes = np.array(Image.open(out / f"{image.stem}.png"))
        assert classes.shape == (H, W) and classes.max() < cfg.data.num_classes


def test_shipped_configs_load():
    """Every config in configs/ loads; the two layout recipes resolve their classes from the layout."""
    folder = Path(__file__).resolve().parents[1] / "configs"
    cfgs = {p.stem: config_lib.load(p) for p in sorted(folder.glob("*.yaml"))}
    assert {"cityscapes", "ade20k", "voc", "camvid", "demo"} <= set(cfgs)
    cs, ade = cfgs["cityscapes"], cfgs["ade20k"]
    assert (cs.data.layout, cs.data.num_classes, cs.data.crop_size, cs.data.batch_size) == ("cityscapes", 19,
                                                                                          (769, 769), 8)
    assert (cs.eval.mode, cs.eval.crop_size, cs.model.output_stride) == ("slide", (769, 769), 16)
    assert cs.data.root == folder.parent / "data" / "cityscapes"
    assert (ade.data.layout, ade.data.num_classes, ade.data.crop_size, ade.data.batch_size) == ("ade20k", 150,
                                                                                              (512, 512), 16)
    assert (ade.data.train_split, ade.data.val_split) == ("training", "validation")
    assert ade.data.root == folder.parent / "data" / "ADEChallengeData2016"
    # SegFormer's recipe (the paper's keys) on each layout, its encoder from a keras-hub MiT preset.
    for name, layout, crop, batch in [("ade20k_segformer", "ade20k", (512, 512), 16),
                                      ("cityscapes_segformer", "cityscapes", (1024, 1024), 8)]:
        c = cfgs[name]
        assert (c.data.layout, c.data.crop_size, c.data.batch_size, c.model.backbone, c.model.head) == \
            (layout, crop, batch, "mit_b0", "segformer")
        t = c.train
        assert (t.optimizer, t.learning_rate, t.weight_decay, t.head_lr_multiplier, t.lr_power, t.warmup_steps,
                t.num_steps) == ("adamw", 6e-5, 0.01, 10.0, 1.0, 1500, 160000)
        assert (c.model.drop_path_rate, c.model.head_dropout, c.model.weight_decay) == (0.1, 0.1, 0.0)
        assert c.model.backbone_weights.parent == folder.parent / "presets"
    assert (cfgs["cityscapes_segformer"].eval.mode, cfgs["cityscapes_segformer"].eval.stride) == ("slide", (768, 768))
    # DINOv3's linear protocol (its model card's numbers) and the fine-tuned ViT-B/16 recipe.
    lin, ft = cfgs["ade20k_dinov3_linear"], cfgs["cityscapes_dinov3"]
    assert (lin.model.backbone, lin.model.head, lin.model.vit_layers, lin.model.freeze_backbone) == \
        ("dinov3_vits16", "linear", [12], True)
    assert (lin.data.crop_size, lin.data.batch_size, lin.train.num_steps, lin.train.learning_rate) == \
        ((512, 512), 16, 40000, 1e-3)
    assert (lin.eval.mode, lin.eval.crop_size, lin.eval.stride) == ("slide", (512, 512), (341, 341))
    assert (ft.model.backbone, ft.model.neck, ft.model.head, ft.data.crop_size, ft.train.layer_decay) == \
        ("dinov3_vitb16", "simple_pyramid", "segformer", (1024, 1024), 0.8)
    assert not ft.model.freeze_backbone and ft.model.drop_path_rate == 0.1
    for c in (lin, ft):
        assert c.model.backbone_weights.parent == folder.parent / "presets"
    # EoMT's recipe (the reference's numbers: AdamW 1e-4, layer decay 0.8, decay 0.05, poly 0.9, batch 16, 640 / 1024)
    # and the reference's semantic configs' numbers, written here: warmup (500, 1000); ADE20K 31 epochs of 1264
    # steps with windows 6520 k; Cityscapes 107 epochs of 186 steps with windows 3317 k.
    ade_windows = [(6520, 13040), (13040, 19560), (19560, 26080), (26080, 32600)]
    city_windows = [(3317, 6634), (6634, 9951), (9951, 13268), (13268, 16585)]
    for name, crop, queries, steps, windows in (("ade20k_eomt", (640, 640), 200, 31 * 1264, ade_windows),
                                                ("cityscapes_eomt", (1024, 1024), 100, 107 * 186, city_windows)):
        c = cfgs[name]
        t = c.train
        assert (c.model.head, c.model.num_queries, c.data.crop_size, c.data.batch_size) == ("eomt", queries, crop, 16)
        assert (t.optimizer, t.learning_rate, t.layer_decay, t.weight_decay, t.lr_power) == ("adamw", 1e-4, 0.8,
                                                                                             0.05, 0.9)
        assert (t.num_steps, t.warmup_steps, t.backbone_warmup_steps, annealing_windows(c)) == (steps, 500, 1000,
                                                                                                windows)
    # The published EoMT-L checkpoints (the reference's model zoos: 512 / 1024 inputs, 100 queries, the last 4 of 24
    # blocks; DINOv2 ones at patch 16, their position grid image_size / 16) and the fine-tuning from COCO (its
    # DINOv3 ADE20K semantic config: AdamW 2e-4, decay 0.05, no layer decay, warmup (2000, 3000), 16 epochs of 1264
    # steps, annealing starts (0, 6520, 9780, 13040) and ends (3000, 9780, 13040, 16300); the COCO model's 200
    # queries), each starting from a folder under presets/.
    for name, backbone, grid, crop, queries in (("ade20k_eomt_large", "dinov2_vitl16_reg", 32, (512, 512), 100),
                                                ("cityscapes_eomt_large", "dinov2_vitl16_reg", 64, (1024, 1024), 100),
                                                ("ade20k_eomt_dinov3_large", "dinov3_vitl16", None, (512, 512), 100),
                                                ("ade20k_eomt_from_coco", "dinov3_vitl16", None, (512, 512), 200)):
        c = cfgs[name]
        m = c.model
        assert (m.backbone, m.head, m.num_queries, m.eomt_blocks, m.position_grid) == (backbone, "eomt", queries, 4,
                                                                                      grid), name
        assert (c.data.crop_size, c.eval.mode, c.eval.crop_size, c.eval.stride) == (crop, "slide", crop, crop), name
        assert m.init_weights.parent == folder.parent / "presets" and m.backbone_weights is None, name
    t = cfgs["ade20k_eomt_from_coco"].train
    assert (t.optimizer, t.learning_rate, t.weight_decay, t.layer_decay, t.lr_power, t.warmup_steps,
            t.backbone_warmup_steps, t.num_steps) == ("adamw", 2e-4, 0.05, None, 0.9, 2000, 3000, 16 * 1264)
    assert annealing_windows(cfgs["ade20k_eomt_from_coco"]) == [(0, 3000), (6520, 9780), (9780, 13040), (13040, 16300)]
