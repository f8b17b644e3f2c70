"""Run seg-prepare voc|camvid|folder (the installed console script) on tiny fabricated inputs (numpy/Pillow
only), and check `seg-prepare --help` lists every converter."""

import json
import os
import re
import subprocess

import numpy as np
import pytest
from PIL import Image

from tests.helpers import seg_prepare

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

VOC_PALETTE = np.zeros((256, 3), dtype=np.uint8)
VOC_PALETTE[1], VOC_PALETTE[15], VOC_PALETTE[255] = (128, 0, 0), (192, 128, 128), (224, 224, 192)


def run(command, *args, env=None):
    """Run `seg-prepare COMMAND ARGS`."""
    return subprocess.run([*seg_prepare(), command, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=120)


def test_help_lists_every_converter():
    result = subprocess.run([*seg_prepare(), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for command in ("voc", "camvid", "folder", "tfrecords"):
        assert re.search(rf"^    {command}\b", result.stdout, re.M), result.stdout
    result = subprocess.run(seg_prepare(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "COMMAND" in result.stderr


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def write_rgb(path, size=(8, 6), value=100):
    Image.fromarray(np.full((size[1], size[0], 3), value, dtype=np.uint8)).save(path)


def write_palette_label(path, label):
    img = Image.fromarray(label.astype(np.uint8))
    img.putpalette(VOC_PALETTE.tobytes())
    img.save(path)


def read_indices(path):
    with Image.open(path) as img:
        assert img.mode in ("P", "L"), img.mode
        return np.array(img)


def split(root, name):
    return (root / "ImageSets" / "Segmentation" / f"{name}.txt").read_text().split()


# --- voc ---------------------------------------------------------------------------------------

VOC_IDS = {"train": ["2007_000001", "2007_000002"], "val": ["2007_000003"]}


def make_voc(root):
    """A three-image VOC2012 folder; label of id k holds k, 15 and a 255 border."""
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / sub).mkdir(parents=True)
    labels = {}
    for k, image_id in enumerate(VOC_IDS["train"] + VOC_IDS["val"], start=1):
        write_rgb(root / "JPEGImages" / f"{image_id}.jpg")
        label = np.zeros((6, 8), dtype=np.uint8)
        label[1:3, 1:4], label[3:, 5:], label[0] = k, 15, 255
        write_palette_label(root / "SegmentationClass" / f"{image_id}.png", label)
        labels[image_id] = label
    for name, ids in VOC_IDS.items():
        (root / "ImageSets/Segmentation" / f"{name}.txt").write_text("\n".join(ids) + "\n")
    (root / "ImageSets/Segmentation/trainval.txt").write_text("\n".join(VOC_IDS["train"] + VOC_IDS["val"]) + "\n")
    return labels


def test_prepare_voc(tmp_path):
    labels = make_voc(tmp_path / "VOC2012")
    out = tmp_path / "out"
    result = run("voc", "--voc", tmp_path / "VOC2012", "--output", out)
    assert result.returncode == 0, result.stderr
    assert split(out, "train") == VOC_IDS["train"] and split(out, "val") == VOC_IDS["val"]
    assert len(split(out, "trainval")) == 3
    classes = (out / "classes.txt").read_text().split()
    assert len(classes) == 21 and classes[0] == "background" and classes[15] == "person"
    for image_id, label in labels.items():
        assert (out / "JPEGImages" / f"{image_id}.jpg").is_file()
        with Image.open(out / "SegmentationClass" / f"{image_id}.png") as img:
            assert img.mode == "P"  # kept as is
        assert np.array_equal(read_indices(out / "SegmentationClass" / f"{image_id}.png"), label)
    assert not (out / "ImageSets/Segmentation/train_aug.txt").exists()


def test_prepare_voc_copy_mode(tmp_path):
    make_voc(tmp_path / "VOC2012")
    result = run("voc", "--voc", tmp_path / "VOC2012", "--output", tmp_path / "out", "--mode", "copy")
    assert result.returncode == 0, result.stderr
    src = tmp_path / "VOC2012/SegmentationClass/2007_000001.png"
    dst = tmp_path / "out/SegmentationClass/2007_000001.png"
    assert dst.read_bytes() == src.read_bytes() and not os.path.samefile(src, dst)


def test_prepare_voc_missing_folder(tmp_path):
    make_voc(tmp_path / "VOC2012")
    (tmp_path / "VOC2012/SegmentationClass").rename(tmp_path / "VOC2012/elsewhere")
    result = run("voc", "--voc", tmp_path / "VOC2012", "--output", tmp_path / "out")
    assert_one_line_error(result, "SegmentationClass")
    assert not (tmp_path / "out").exists()


def test_prepare_voc_rejects_colour_label(tmp_path):
    make_voc(tmp_path / "VOC2012")
    write_rgb(tmp_path / "VOC2012/SegmentationClass/2007_000002.png")
    result = run("voc", "--voc", tmp_path / "VOC2012", "--output", tmp_path / "out")
    assert_one_line_error(result, "2007_000002.png", "RGB")


def write_sbd_mat(path, mask):
    """An SBD cls/<id>.mat as the release has it: a MATLAB struct GTcls with Segmentation (uint8 class
    indices), Boundaries (a 20x1 cell of sparse per-class boundary maps) and CategoriesPresent."""
    import scipy.io
    import scipy.sparse

    boundaries = np.empty((20, 1), dtype=object)
    for c in range(20):
        boundaries[c, 0] = scipy.sparse.csc_matrix(np.zeros(mask.shape))
    present = np.unique(mask[(mask > 0) & (mask < 255)]).astype(np.uint8).reshape(-1, 1)
    scipy.io.savemat(path, {"GTcls": {"Segmentation": mask, "Boundaries": boundaries, "CategoriesPresent": present}})


def make_sbd(root):
    """A tiny SBD dataset folder: cls/<id>.mat files written with scipy.io.savemat, img/<id>.jpg."""
    (root / "cls").mkdir(parents=True)
    (root / "img").mkdir()
    masks = {}
    for k, image_id in enumerate(["2007_000001", "2007_000003", "2008_000010", "2008_000011"]):
        mask = np.full((6, 8), k + 2, dtype=np.uint8)
        mask[:2] = 0
        mask[4, k] = 15
        write_sbd_mat(root / "cls" / f"{image_id}.mat", mask)
        write_rgb(root / "img" / f"{image_id}.jpg", value=50)
        masks[image_id] = mask
    (root / "train.txt").write_text("2007_000001\n2008_000010\n")
    (root / "val.txt").write_text("2007_000003\n2008_000011\n")
    return masks


def missing_scipy(root):
    """A `scipy` package to put first on PYTHONPATH that fails to import, as when scipy is not installed."""
    (root / "scipy").mkdir(parents=True)
    (root / "scipy/__init__.py").write_text("raise ImportError('No module named scipy (test stub)')\n")
    return root


def test_prepare_voc_sbd_missing_scipy(tmp_path):
    make_voc(tmp_path / "VOC2012")
    make_sbd(tmp_path / "sbd")
    env = dict(os.environ, PYTHONPATH=str(missing_scipy(tmp_path / "stub")))
    args = ["--voc", tmp_path / "VOC2012", "--sbd", tmp_path / "sbd", "--output", tmp_path / "out"]
    result = run("voc", *args, env=env)
    assert_one_line_error(result, "scipy", "pip install scipy")
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_prepare_voc_sbd_train_aug(tmp_path):
    labels = make_voc(tmp_path / "VOC2012")
    masks = make_sbd(tmp_path / "sbd")
    out = tmp_path / "out"
    result = run("voc", "--voc", tmp_path / "VOC2012", "--sbd", tmp_path / "sbd", "--output", out)
    assert result.returncode == 0, result.stderr
    # (SBD train + SBD val + VOC train) - VOC val
    assert split(out, "train_aug") == ["2007_000001", "2007_000002", "2008_000010", "2008_000011"]
    assert split(out, "val") == ["2007_000003"]
    for image_id in split(out, "train_aug"):
        assert (out / "JPEGImages" / f"{image_id}.jpg").is_file()
        expected = labels.get(image_id, masks.get(image_id))  # VOC's own label takes precedence
        for sub in ("SegmentationClass", "SegmentationClassAug"):
            with Image.open(out / sub / f"{image_id}.png") as img:
                assert img.mode == "P"
            assert np.array_equal(read_indices(out / sub / f"{image_id}.png"), expected)
    # VOC val keeps its VOC label, not SBD's.
    assert np.array_equal(read_indices(out / "SegmentationClass/2007_000003.png"), labels["2007_000003"])
    assert masks["2008_000010"][4, 2] == 15 and read_indices(out / "SegmentationClass/2008_000010.png")[4, 2] == 15


def test_prepare_voc_sbd_unreadable_mat(tmp_path):
    make_voc(tmp_path / "VOC2012")
    make_sbd(tmp_path / "sbd")
    (tmp_path / "sbd/cls/2008_000010.mat").write_bytes(b"MATLAB 5.0 MAT-file, truncated")
    result = run("voc", "--voc", tmp_path / "VOC2012", "--sbd", tmp_path / "sbd",
                 "--output", tmp_path / "out")
    assert_one_line_error(result, "unreadable SBD mask", "2008_000010.mat",
                          "a MATLAB file with a GTcls.Segmentation array")


# --- camvid ------------------------------------------------------------------------------------


def make_camvid(root):
    """SegNet layout with two images per split; labels use all values 0..11."""
    labels = {}
    for s, split_name in enumerate(("train", "val", "test")):
        (root / split_name).mkdir(parents=True)
        (root / f"{split_name}annot").mkdir()
        for n in range(2):
            name = f"0001TP_{s}{n}"
            write_rgb(root / split_name / f"{name}.png", size=(8, 6), value=40 * n + 20)
            label = (np.arange(48).reshape(6, 8) % 12).astype(np.uint8)
            Image.fromarray(label).save(root / f"{split_name}annot" / f"{name}.png")
            labels[name] = label
    return labels


def test_prepare_camvid(tmp_path):
    labels = make_camvid(tmp_path / "CamVid")
    out = tmp_path / "out"
    result = run("camvid", "--segnet", tmp_path / "CamVid", "--output", out)
    assert result.returncode == 0, result.stderr
    assert split(out, "train") == ["0001TP_00", "0001TP_01"]
    assert split(out, "val") == ["0001TP_10", "0001TP_11"]
    assert split(out, "test") == ["0001TP_20", "0001TP_21"]
    assert (out / "classes.txt").read_text().split() == (
        "Sky Building Pole Road Pavement Tree SignSymbol Fence Car Pedestrian Bicyclist".split()
    )
    for image_id, label in labels.items():
        with Image.open(out / "JPEGImages" / f"{image_id}.jpg") as img:
            assert img.format == "JPEG" and img.mode == "RGB" and img.size == (8, 6)
        expected = np.where(label == 11, 255, label)
        assert np.array_equal(read_indices(out / "SegmentationClass" / f"{image_id}.png"), expected)


def test_prepare_camvid_resize(tmp_path):
    make_camvid(tmp_path / "CamVid")
    out = tmp_path / "out"
    result = run("camvid", "--segnet", tmp_path / "CamVid", "--output", out, "--size", 4, 3)
    assert result.returncode == 0, result.stderr
    with Image.open(out / "JPEGImages/0001TP_00.jpg") as img:
        assert img.size == (4, 3)
    label = read_indices(out / "SegmentationClass/0001TP_00.png")
    assert label.shape == (3, 4)
    assert set(np.unique(label).tolist()) <= set(range(11)) | {255}  # NEAREST: no blended values


def test_prepare_camvid_bad_label_value(tmp_path):
    make_camvid(tmp_path / "CamVid")
    Image.fromarray(np.full((6, 8), 20, dtype=np.uint8)).save(tmp_path / "CamVid/valannot/0001TP_10.png")
    result = run("camvid", "--segnet", tmp_path / "CamVid", "--output", tmp_path / "out")
    assert_one_line_error(result, "0001TP_10.png", "0..11")


def test_prepare_camvid_missing_annotations(tmp_path):
    make_camvid(tmp_path / "CamVid")
    (tmp_path / "CamVid/testannot/0001TP_21.png").unlink()
    result = run("camvid", "--segnet", tmp_path / "CamVid", "--output", tmp_path / "out")
    assert_one_line_error(result, "missing label", "0001TP_21.png")


# --- folder ------------------------------------------------------------------------------------


def make_folder(root, rgb_labels=False):
    """Images a..e (+ an unmatched one) and labels a..e (+ an unmatched one)."""
    images, labels = root / "images", root / "labels"
    images.mkdir(parents=True)
    labels.mkdir()
    expected = {}
    for k, stem in enumerate("abcde"):
        if k % 2:
            write_rgb(images / f"{stem}.png", value=30 * k)
        else:
            write_rgb(images / f"{stem}.jpg", value=30 * k)
        label = np.zeros((6, 8), dtype=np.uint8)
        label[2:, :4], label[0, 0] = k % 3 + 1, 255
        expected[stem] = label
        if rgb_labels:
            colours = np.full((256, 3), 9)
            colours[:4] = [[0, 0, 0], [128, 0, 0], [0, 128, 0], [128, 128, 0]]
            colours[255] = (255, 255, 255)
            Image.fromarray(colours[label].astype(np.uint8)).save(labels / f"{stem}.png")
        elif k == 1:
            Image.fromarray(label).save(labels / f"{stem}.png")  # 'L'
        else:
            write_palette_label(labels / f"{stem}.png", label)
    write_rgb(images / "no_label.jpg")
    write_palette_label(labels / "no_image.png", np.zeros((6, 8)))
    return expected


def test_prepare_folder_index_labels(tmp_path):
    expected = make_folder(tmp_path)
    out = tmp_path / "out"
    inputs = ["--images", tmp_path / "images", "--labels", tmp_path / "labels", "--val-fraction", 0.4]
    result = run("folder", *inputs, "--output", out)
    assert result.returncode == 0, result.stderr
    assert "no_label" in result.stderr and "no_image" in result.stderr  # unmatched files reported
    train, val = split(out, "train"), split(out, "val")
    assert len(val) == 2 and sorted(train + val) == list("abcde")
    assert (out / "classes.txt").read_text().split() == ["class_0", "class_1", "class_2", "class_3"]
    for stem, label in expected.items():
        with Image.open(out / "JPEGImages" / f"{stem}.jpg") as img:
            assert img.format == "JPEG" and img.mode == "RGB"
        assert np.array_equal(read_indices(out / "SegmentationClass" / f"{stem}.png"), label)
    # Same seed, same split; the split does not depend on the output folder.
    again = run("folder", *inputs, "--output", tmp_path / "out2")
    assert again.returncode == 0 and split(tmp_path / "out2", "val") == val


def test_prepare_folder_colour_map(tmp_path):
    expected = make_folder(tmp_path, rgb_labels=True)
    # 255,255,255 is mapped to ignore explicitly; 128,128,0 (class 3) is left out -> unknown.
    (tmp_path / "map.json").write_text(json.dumps({"0,0,0": 0, "128,0,0": 1, "0,128,0": 2, "255,255,255": 255}))
    out = tmp_path / "out"
    result = run(
        "folder", "--images", tmp_path / "images", "--labels", tmp_path / "labels",
        "--output", out, "--colour-map", tmp_path / "map.json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    unknown = sum(int((label == 3).sum()) for label in expected.values())
    assert f"warning: {unknown} pixels" in result.stderr
    for stem, label in expected.items():
        assert np.array_equal(read_indices(out / "SegmentationClass" / f"{stem}.png"), np.where(label == 3, 255, label))

    (tmp_path / "map.txt").write_text("# R G B index\n0 0 0 0\n128 0 0 1\n0 128 0 2\n128 128 0 3\n255 255 255 255\n")
    result = run(
        "folder", "--images", tmp_path / "images", "--labels", tmp_path / "labels",
        "--output", tmp_path / "out2", "--colour-map", tmp_path / "map.txt",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "pixels" not in result.stderr
    for stem, label in expected.items():
        assert np.array_equal(read_indices(tmp_path / "out2" / "SegmentationClass" / f"{stem}.png"), label)


def test_prepare_folder_rgb_without_colour_map(tmp_path):
    make_folder(tmp_path, rgb_labels=True)
    (tmp_path / "images/no_label.jpg").unlink()  # so that the only stderr line is the error
    (tmp_path / "labels/no_image.png").unlink()
    result = run(
        "folder", "--images", tmp_path / "images", "--labels", tmp_path / "labels",
        "--output", tmp_path / "out",
    )  # fmt: skip
    assert_one_line_error(result, "colour (RGB) label image", "--colour-map")


def test_prepare_folder_refuses_a_jpeg_label(tmp_path):
    """A JPEG label (lossy: its class values damaged) is refused in one line naming it, as seg-train refuses
    it; written out as a PNG, its damaged values would pass every later check. Fails for a JPEG label
    converted like any other."""
    make_folder(tmp_path)
    (tmp_path / "images/no_label.jpg").unlink()
    (tmp_path / "labels/no_image.png").unlink()
    label = tmp_path / "labels/c.png"
    with Image.open(label) as im:
        im.convert("L").save(tmp_path / "labels/c.jpg", quality=95)
    label.unlink()
    result = run(
        "folder", "--images", tmp_path / "images", "--labels", tmp_path / "labels",
        "--output", tmp_path / "out",
    )  # fmt: skip
    assert_one_line_error(result, f"error: lossy JPEG label ({tmp_path / 'labels/c.jpg'}): ",
                          "convert the label to PNG")


def test_prepare_folder_no_pairs(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "labels").mkdir()
    write_rgb(tmp_path / "images/x.jpg")
    write_palette_label(tmp_path / "labels/y.png", np.zeros((6, 8)))
    result = run(
        "folder", "--images", tmp_path / "images", "--labels", tmp_path / "labels",
        "--output", tmp_path / "out",
    )  # fmt: skip
    assert_one_line_error(result, "no image/label pairs")
