"""Tests of seg_train.data.label_images and seg_train.data.synthetic (numpy/Pillow only, fast)."""

import numpy as np
import pytest
from PIL import Image

from seg_train.data import synthetic
from seg_train.data.label_images import colorize, load_class_names, read_label, save_index_png, voc_colormap


def test_voc_colormap_values():
    cmap = voc_colormap()
    assert cmap.shape == (256, 3) and cmap.dtype == np.uint8
    assert tuple(cmap[0]) == (0, 0, 0)
    assert tuple(cmap[1]) == (128, 0, 0)
    assert tuple(cmap[2]) == (0, 128, 0)
    assert tuple(cmap[3]) == (128, 128, 0)
    assert tuple(cmap[15]) == (192, 128, 128)  # person
    assert tuple(cmap[255]) == (224, 224, 192)
    assert np.array_equal(voc_colormap(21), cmap[:21])


def test_colorize_ignore_white_and_out_of_range_black():
    palette = voc_colormap(4)
    label = np.array([[0, 1, 2], [3, 255, 7], [-1, 2, 1]])
    rgb = colorize(label, palette)
    assert rgb.shape == (3, 3, 3) and rgb.dtype == np.uint8
    assert tuple(rgb[0, 1]) == (128, 0, 0)
    assert tuple(rgb[1, 1]) == (255, 255, 255)
    assert tuple(rgb[1, 2]) == (0, 0, 0)
    assert tuple(rgb[2, 0]) == (0, 0, 0)
    # The ignore value is white even when the palette defines that entry.
    assert tuple(colorize(np.array([[255]]), voc_colormap(256))[0, 0]) == (255, 255, 255)


def test_index_png_round_trip_gives_indices_not_colours(tmp_path):
    label = np.array([[0, 1, 2, 3], [4, 255, 1, 0]], dtype=np.uint8)
    path = tmp_path / "label.png"
    save_index_png(path, label, voc_colormap(5))
    with Image.open(path) as img:
        assert img.mode == "P"
        palette = np.array(img.getpalette()[: 256 * 3], dtype=np.uint8).reshape(-1, 3)
    assert tuple(palette[1]) == (128, 0, 0)
    assert tuple(palette[255]) == (224, 224, 192)  # padded entry
    back = read_label(path)
    assert back.dtype == np.uint8 and back.shape == (2, 4)
    assert np.array_equal(back, label)


def test_save_index_png_keeps_palette_entry_255_when_defined(tmp_path):
    palette = np.zeros((256, 3), dtype=np.uint8)
    palette[255] = (1, 2, 3)
    save_index_png(tmp_path / "l.png", np.full((2, 2), 255, np.uint8), palette)
    with Image.open(tmp_path / "l.png") as img:
        assert tuple(img.getpalette()[255 * 3 : 256 * 3]) == (1, 2, 3)


def test_read_label_rejects_rgb(tmp_path):
    path = tmp_path / "rgb.png"
    Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(path)
    with pytest.raises(ValueError, match=r"colour \(RGB\) label image"):
        read_label(path)


def test_read_label_single_channel_and_16_bit(tmp_path):
    label = np.array([[0, 3], [255, 7]], dtype=np.uint8)
    Image.fromarray(label).save(tmp_path / "l.png")
    assert np.array_equal(read_label(tmp_path / "l.png"), label)
    Image.fromarray(label.astype(np.uint16)).save(tmp_path / "i16.png")
    assert np.array_equal(read_label(tmp_path / "i16.png"), label)
    Image.fromarray(np.array([[0, 300]], dtype=np.uint16)).save(tmp_path / "big.png")
    with pytest.raises(ValueError, match="outside 0..255"):
        read_label(tmp_path / "big.png")


def test_load_class_names(tmp_path):
    assert load_class_names(tmp_path, 3) == ["class_0", "class_1", "class_2"]
    assert load_class_names(tmp_path, 2, names=["a", "b"]) == ["a", "b"]
    with pytest.raises(ValueError):
        load_class_names(tmp_path, 3, names=["a", "b"])
    (tmp_path / "classes.txt").write_text("bg\n\ncat\ndog\n")
    assert load_class_names(tmp_path, 3) == ["bg", "cat", "dog"]
    with pytest.raises(ValueError, match="classes.txt"):
        load_class_names(tmp_path, 4)


def _small(root, seed=0):
    return synthetic.generate(root, num_train=12, num_val=4, size=(64, 64), num_classes=5, seed=seed)


def test_generate_layout_and_labels(tmp_path):
    root = _small(tmp_path / "demo")
    assert root == tmp_path / "demo"
    assert (root / ".complete").is_file() and (root / "README.md").is_file()
    assert "synthetic" in (root / "README.md").read_text().lower()
    train = (root / "ImageSets/Segmentation/train.txt").read_text().split()
    val = (root / "ImageSets/Segmentation/val.txt").read_text().split()
    assert len(train) == 12 and len(val) == 4 and not set(train) & set(val)
    names = (root / "classes.txt").read_text().split()
    assert names[0] == "background" and len(names) == 5
    seen = set()
    for image_id in train + val:
        with Image.open(root / "JPEGImages" / f"{image_id}.jpg") as img:
            assert img.mode == "RGB" and img.size == (64, 64)
        with Image.open(root / "SegmentationClass" / f"{image_id}.png") as img:
            assert img.mode == "P"
        label = read_label(root / "SegmentationClass" / f"{image_id}.png")
        assert label.shape == (64, 64)
        seen |= set(np.unique(label).tolist())
    assert seen <= {0, 1, 2, 3, 4, 255}
    assert {0, 255} <= seen and len(seen - {0, 255}) >= 3
    # No temporary directory is left behind.
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]


def test_generate_is_deterministic(tmp_path):
    a, b = _small(tmp_path / "a", seed=3), _small(tmp_path / "b", seed=3)
    c = _small(tmp_path / "c", seed=4)
    files = sorted(p.name for p in (a / "SegmentationClass").iterdir())
    assert files == sorted(p.name for p in (b / "SegmentationClass").iterdir())
    for name in files:
        assert (a / "SegmentationClass" / name).read_bytes() == (b / "SegmentationClass" / name).read_bytes()
    assert any(
        (a / "SegmentationClass" / n).read_bytes() != (c / "SegmentationClass" / n).read_bytes() for n in files
    )


def test_generate_second_call_is_noop(tmp_path):
    root = _small(tmp_path / "demo")
    label = root / "SegmentationClass" / "demo_00000.png"
    before = label.stat().st_mtime_ns
    (root / "marker-of-first-run").write_text("x")
    assert _small(root, seed=99) == root
    assert label.stat().st_mtime_ns == before
    assert (root / "marker-of-first-run").exists()


def test_generate_refuses_foreign_non_empty_dir(tmp_path):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        _small(tmp_path / "demo")
    assert (tmp_path / "demo" / "mine.txt").read_text() == "keep me"
