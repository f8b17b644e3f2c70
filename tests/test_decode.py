"""TensorFlow-side decoding (seg_train/data/decode.py) against Pillow, the reader's fallback to
load_sample for bad files, and a data root on a TensorFlow file system (ram://) read through
tf.io.gfile."""

import io
import logging
import os
import re
import uuid

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from seg_train.cli import user_error
from seg_train.data import decode
from seg_train.data.label_images import save_index_png, voc_colormap
from seg_train.data.scan import scan
from seg_train.data.split import class_names_of
from tests.helpers import open_reader, tiny_config


def _texture(h, w, seed):
    """Noise over gradients: every 8x8 block has high-frequency content, where IDCTs differ."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (w + h)], -1)
    return np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)


def _encoded_images(tmp_path):
    """The image files a data set may hold, each as written by Pillow (odd sizes: edge blocks too)."""
    rgb = _texture(37, 53, 0)
    im = Image.fromarray(rgb)
    out = {}
    for name, kw in {"jpeg_420": dict(subsampling=2, quality=90), "jpeg_422": dict(subsampling=1, quality=75),
                     "jpeg_444": dict(subsampling=0, quality=95), "jpeg_progressive": dict(progressive=True),
                     "jpeg_q30": dict(quality=30)}.items():
        im.save(tmp_path / f"{name}.jpg", **kw)
        out[name] = tmp_path / f"{name}.jpg"
    im.convert("L").save(tmp_path / "jpeg_grey.jpg")
    out["jpeg_grey"] = tmp_path / "jpeg_grey.jpg"
    im.convert("CMYK").save(tmp_path / "jpeg_cmyk.jpg")
    out["jpeg_cmyk"] = tmp_path / "jpeg_cmyk.jpg"
    for mode in ("RGB", "RGBA", "L", "LA", "P"):
        src = Image.fromarray(np.dstack([rgb, rgb[..., :1]])) if "A" in mode else im
        src.convert(mode).save(tmp_path / f"png_{mode}.png")
        out[f"png_{mode}"] = tmp_path / f"png_{mode}.png"
    im.save(tmp_path / "bmp.bmp")
    out["bmp"] = tmp_path / "bmp.bmp"
    return out


def test_image_pixels_are_pillows(tmp_path):
    """Every kind of image file decodes in the graph to exactly Pillow's `convert("RGB")` pixels: what
    data.cache, the scan and seg-predict decode with. Fails for TensorFlow's default JPEG IDCT (the fast
    one: pixels a few levels off) and for a palette PNG image expanded differently from Pillow."""
    for name, path in _encoded_images(tmp_path).items():
        ours = decode.decode_image(tf.io.read_file(str(path))).numpy()
        with Image.open(path) as im:
            pillow = np.asarray(im.convert("RGB"))
        assert ours.shape == pillow.shape, name
        assert np.array_equal(ours, pillow), (name, int(np.abs(ours.astype(int) - pillow).max()))


def _label_files(tmp_path):
    label = np.zeros((20, 30), np.uint8)
    label[5:10, 5:10] = 1
    label[12:, :] = 2
    label[0, :] = 255
    save_index_png(tmp_path / "P.png", label, voc_colormap())
    Image.fromarray(label).save(tmp_path / "L.png")
    Image.fromarray(label.astype(np.uint16)).save(tmp_path / "I16.png")
    bits4 = Image.fromarray(label.clip(0, 3))
    bits4.putpalette(voc_colormap(4).tobytes())
    bits4.save(tmp_path / "P4.png", bits=2)  # a 2-bit palette
    return label, {"P": tmp_path / "P.png", "L": tmp_path / "L.png", "I;16": tmp_path / "I16.png",
                   "P4": tmp_path / "P4.png"}


def test_labels_are_class_indices_whatever_the_png_kind(tmp_path):
    """Palette labels (VOC's) give their stored indices: not the luminance of their colours (class 1
    -> 38, what tf.io.decode_png(channels=1) gives), nor colours. 'L' and 16-bit labels as Pillow's
    read_label gives them."""
    label, paths = _label_files(tmp_path)
    for mode, path in paths.items():
        with Image.open(path) as im:
            assert im.mode == mode.rstrip("4"), (mode, im.mode)  # the kind of PNG the case is about
        ours = decode.decode_label(tf.io.read_file(str(path))).numpy()
        want = label.clip(0, 3) if mode == "P4" else label
        assert ours.dtype == np.uint8 and np.array_equal(ours, want), (mode, np.unique(ours))


def test_colour_and_out_of_range_16_bit_labels_still_fail(tmp_path):
    """What read_label refuses fails in the graph too (the reader then names the file)."""
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "rgb.png")
    Image.fromarray(np.full((4, 4), 300, np.uint16)).save(tmp_path / "big.png")
    for name, message in (("rgb.png", "colour"), ("big.png", "outside 0..255")):
        # Eagerly the Pillow branch's error arrives as Python's; in tf.data's graph, in an OpError.
        with pytest.raises((tf.errors.OpError, ValueError), match=message):
            decode.decode_label(tf.io.read_file(str(tmp_path / name))).numpy()


# ---- the reader: bad files named, stand-ins, checks ---------------------------------------------------
def _voc(root, n=2, size=(20, 30), write=None):
    """A VOC-layout set of n textured JPEGs and palette labels (classes 0..2 and 255)."""
    write = write or (lambda path, data: open(path, "wb").write(data))
    rng = np.random.default_rng(1)
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        tf.io.gfile.makedirs(f"{root}/{d}")
    labels = []
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(_texture(*size, i)).save(buf, format="JPEG", quality=90)
        write(f"{root}/JPEGImages/img{i}.jpg", buf.getvalue())
        label = rng.integers(0, 3, size).astype(np.uint8)
        label[0] = 255
        buf = io.BytesIO()
        save_index_png(buf, label, voc_colormap())
        write(f"{root}/SegmentationClass/img{i}.png", buf.getvalue())
        labels.append(label)
    write(f"{root}/ImageSets/Segmentation/train.txt", "".join(f"img{i}\n" for i in range(n)).encode())
    write(f"{root}/classes.txt", b"background\ndisc\nsquare\n")
    return labels


def _first_batch(reader, batch=2):
    return [t.numpy() for t in next(iter(reader.train_dataset(batch, 0, 1)))]


def _stream_error(reader) -> str:
    """The one line seg-train prints for the error the training stream raises."""
    with pytest.raises(tf.errors.OpError) as info:
        _first_batch(reader)
    return user_error(info.value)


def test_missing_file_is_named_in_one_line_and_skip_gives_the_stand_in(tmp_path, caplog):
    """A missing image in the training stream ends as load_sample's line naming the file (not
    TensorFlow's NotFoundError, which seg-train would report as an internal error); with
    data.on_bad_sample: skip the sample is the fully ignored stand-in, with a warning naming it."""
    root = tmp_path / "voc"
    _voc(root)
    (root / "JPEGImages" / "img1.jpg").unlink()
    cfg = tiny_config(tmp_path, data_root=root, data={"crop_size": [8, 8], "random_scale": [1.0, 1.0]})
    line = _stream_error(open_reader(cfg, "train"))
    assert line == f"image not found ({root}/JPEGImages/img1.jpg): expected a readable JPEG/PNG image", line

    skip = tiny_config(tmp_path, data_root=root, data={"crop_size": [8, 8], "random_scale": [1.0, 1.0],
                                                       "on_bad_sample": "skip"})
    reader = open_reader(skip, "train")
    with caplog.at_level(logging.WARNING, "seg_train"):
        _, labels = _first_batch(reader)
    bad = reader.samples.index(next(s for s in reader.samples if s.id == "img1"))
    order = [int(reader._index_of(tf.constant(k, tf.int64))) for k in range(2)]
    assert (labels[order.index(bad)] == 255).all()
    assert not (labels[order.index(1 - bad)] == 255).all()
    assert re.search(r"skipping bad sample .*image not found \(.*img1\.jpg\)", caplog.text), caplog.text
    assert "decoded them with Pillow" not in caplog.text  # a stand-in is not a successful fallback


@pytest.mark.parametrize("defect, message", [
    ("label_larger", r"label size differs from image \({root}/SegmentationClass/img0.png\): expected 30x20 "
                     r"like img0.jpg, got 40x24"),
    ("label_values", r"label values out of range \({root}/SegmentationClass/img0.png\): expected values in "
                     r"\[0, 3\) or 255, got \[7\]"),
    ("label_rgb", r"bad label \({root}/SegmentationClass/img0.png\): colour \(RGB\) label image"),
], ids=["label_larger", "label_values", "label_rgb"])
def test_bad_label_in_the_stream_is_named(tmp_path, defect, message):
    """What load_sample refuses, the TensorFlow decode refuses too. Fails for a label larger than its
    image cropped silently (misaligned classes), or label values >= num_classes trained on."""
    root = tmp_path / "voc"
    labels = _voc(root)
    path = root / "SegmentationClass" / "img0.png"
    if defect == "label_larger":
        Image.fromarray(np.zeros((24, 40), np.uint8)).save(path)
    elif defect == "label_values":
        bad = labels[0].copy()
        bad[3, 4] = 7
        Image.fromarray(bad).save(path)  # 'L': decoded by TensorFlow itself
    else:
        Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(path)
    cfg = tiny_config(tmp_path, data_root=root, data={"crop_size": [8, 8], "random_scale": [1.0, 1.0]})
    line = _stream_error(open_reader(cfg, "train"))
    assert re.match(message.format(root=re.escape(str(root))), line), line


def test_a_file_only_pillow_reads_is_decoded_by_pillow_with_a_warning(tmp_path, caplog):
    """A PNG whose image-data CRC is wrong: libpng (TensorFlow) refuses it, Pillow (which skips that
    CRC) reads it. The sample is Pillow's pixels, not an error nor a stand-in, and the slower path is
    said once."""
    root = tmp_path / "voc"
    _voc(root, n=1)
    rgb = _texture(20, 30, 5)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    at = data.index(b"IDAT")
    data[at + 4 + int.from_bytes(data[at - 4:at], "big")] ^= 0xFF
    (root / "JPEGImages" / "img0.png").write_bytes(bytes(data))
    (root / "pairs.txt").write_text("JPEGImages/img0.png SegmentationClass/img0.png\n")
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf.io.decode_png(bytes(data))
    cfg = tiny_config(tmp_path, data_root=root, data={"crop_size": [20, 30], "random_scale": [1.0, 1.0],
                                                      "random_mirror": False, "mean": [0, 0, 0], "std": [1, 1, 1]})
    with caplog.at_level(logging.WARNING, "seg_train"):
        image, _, _ = next(iter(open_reader(cfg, "pairs.txt").eval_dataset(pad_to=1)))
    np.testing.assert_array_equal(image.numpy()[0], rgb)
    assert caplog.text.count("decoded them with Pillow instead") == 1, caplog.text


# ---- a data root on a TensorFlow file system ----------------------------------------------------------
def _ram_write(path, data):
    with tf.io.gfile.GFile(path, "wb") as f:
        f.write(data)


def test_a_ram_root_reads_like_the_same_set_on_disk(tmp_path):
    """data.root: ram://... stays that string (pathlib would make it ram:/...) and the training stream,
    the evaluation stream, the scan and classes.txt read through tf.io.gfile give what the same files
    on the local disk give."""
    ram = f"ram://{uuid.uuid4().hex}/voc"
    local = tmp_path / "voc"
    _voc(ram, n=3, write=_ram_write)
    _voc(local, n=3)
    data = {"crop_size": [16, 16]}
    cfg_ram, cfg_local = tiny_config(tmp_path / "a", data_root=ram, data=data), tiny_config(tmp_path / "b",
                                                                                             data_root=local, data=data)
    assert cfg_ram.data.root == ram
    assert class_names_of(cfg_ram) == ["background", "disc", "square"]
    a, b = open_reader(cfg_ram, "train", seed=2), open_reader(cfg_local, "train", seed=2)
    assert a.samples[0].image == f"{ram}/JPEGImages/img0.jpg"
    for x, y in zip(_first_batch(a, 3), _first_batch(b, 3)):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a.eval_dataset(pad_to=8), b.eval_dataset(pad_to=8)):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u.numpy(), v.numpy())
    report_a, report_b = scan(a.samples, 3, 255), scan(b.samples, 3, 255)
    assert not report_a.bad
    np.testing.assert_array_equal(report_a.histogram, report_b.histogram)

    tf.io.gfile.remove(f"{ram}/SegmentationClass/img2.png")
    report = scan(a.samples, 3, 255)
    assert [problem for _, problem in report.bad] == [
        f"label not found ({ram}/SegmentationClass/img2.png): expected a PNG of class indices"]


def test_url_paths_stay_urls_and_only_data_root_may_be_one(tmp_path):
    """gs://bucket/data is kept as written (pathlib would make it gs:/bucket/data, then resolve it
    against the config's folder), from the file, from --set and through the saved config; a run dir or
    a weights file on a URL is refused in one line rather than written to a local folder named gs:."""
    from seg_train import config as config_lib

    cfg = tiny_config(tmp_path, data_root="gs://bucket/data")
    assert cfg.data.root == "gs://bucket/data"
    assert config_lib.from_dict(cfg.to_dict()).data.root == "gs://bucket/data"
    assert config_lib.load(tmp_path / "config.yaml", ["data.root=s3://b/x"]).data.root == "s3://b/x"
    with pytest.raises(config_lib.ConfigError, match=r"^not a local path \(run_dir\): "):
        tiny_config(tmp_path, run_dir="gs://bucket/run")
    with pytest.raises(config_lib.ConfigError, match=r"^not a local path \(model\.backbone_weights\): "):
        config_lib.load(tmp_path / "config.yaml", ["model.backbone_weights=gs://b/w.h5"])


def _copy_tree(src, dst: str) -> None:
    for dirpath, _, names in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target = dst if rel == "." else f"{dst}/{rel}"
        tf.io.gfile.makedirs(target)
        for name in names:
            tf.io.gfile.copy(os.path.join(dirpath, name), f"{target}/{name}")


def test_cityscapes_on_ram_lists_like_on_disk_and_maps_labels_in_the_graph(tmp_path, caplog):
    """Cityscapes' layout on ram:// (listed with tf.io.gfile.glob) gives the samples the same tree gives on
    disk; its labelIds reach the reader as train ids by the official table written out by hand, mapped by
    TensorFlow: no sample falls back to Pillow (which would hide a wrong map in the graph, only slower).
    A labelId with no mapping is named in one line, as load_sample names it."""
    from seg_train.data import layouts
    from tests.helpers import LAYOUT_H as H
    from tests.helpers import LAYOUT_W as W
    from tests.helpers import load_layout as load
    from tests.helpers import make_cityscapes_tree as make_cityscapes
    from tests.helpers import mapped_label as mapped

    local = tmp_path / "cityscapes"
    make_cityscapes(local, np.random.default_rng(0))
    ram = f"ram://{uuid.uuid4().hex}/cityscapes"
    _copy_tree(local, ram)
    (tmp_path / "disk").mkdir()
    on_disk = load(tmp_path / "disk", {"cityscapes": local}, "cityscapes")
    cfg = load(tmp_path, {"cityscapes": ram}, "cityscapes", crop_size=[H, W], random_scale=[1.0, 1.0],
               random_mirror=False)
    assert cfg.data.root == ram
    samples = layouts.list_samples(cfg.data, "train")
    assert [(s.id, s.image, s.label) for s in samples] == [
        (s.id, s.image.replace(str(local), ram), s.label.replace(str(local), ram))
        for s in layouts.list_samples(on_disk.data, "train")]
    assert layouts.split_exists(cfg.data, "val") and not layouts.split_exists(cfg.data, "nosuch")

    reader = open_reader(cfg, "train")
    with caplog.at_level(logging.WARNING, "seg_train"):
        for i, s in enumerate(reader.samples):
            image, label = (t.numpy() for t in reader.decode(i))
            local_label = s.label.replace(ram, str(local))
            np.testing.assert_array_equal(label, mapped("cityscapes", local_label), err_msg=s.label)
            with Image.open(s.image.replace(ram, str(local))) as im:
                np.testing.assert_array_equal(image, np.asarray(im.convert("RGB")))
        _, labels = _first_batch(reader, 3)
    assert sorted(labels.reshape(3, -1).tolist()) == sorted(
        mapped("cityscapes", s.label.replace(ram, str(local))).ravel().tolist() for s in reader.samples)
    assert "decoded them with Pillow" not in caplog.text, caplog.text

    line = _stream_error(open_reader(cfg, "broken"))
    assert line == (f"label values with no mapping ({ram}/gtFine/broken/aachen/aachen_000000_000019_gtFine_"
                    "labelIds.png): expected raw values the label map covers, got [40]"), line


def test_scan_cache_sees_a_changed_file_on_ram(tmp_path):
    """The scan cache keys a ram:// file by tf.io.gfile.stat (os.stat cannot see it: every file would be
    'missing' and the key the same whatever the bytes): a label rewritten with a bad value is scanned again
    and reported, not read back as good from the cache."""
    from seg_train.data.scan import scan_cached

    ram = f"ram://{uuid.uuid4().hex}/voc"
    labels = _voc(ram, n=2, write=_ram_write)
    cfg = tiny_config(tmp_path, data_root=ram, data={"scan_cache_dir": str(tmp_path / "scans")})
    reader = open_reader(cfg, "train")
    first = scan_cached(cfg, reader, "train")
    assert first.cached is None and not first.bad
    assert scan_cached(cfg, reader, "train").cached is not None  # unchanged: read from the cache

    path = f"{ram}/SegmentationClass/img1.png"
    before = tf.io.gfile.stat(path).length
    bad = labels[1].copy()
    bad[2:6, 3:9] = 7
    buf = io.BytesIO()
    save_index_png(buf, bad, voc_colormap())
    tf.io.gfile.remove(path)  # ram:// appends to a file written again
    _ram_write(path, buf.getvalue())
    assert tf.io.gfile.stat(path).length != before  # ram:// has no mtime: the size is what changes
    again = scan_cached(cfg, reader, "train")
    assert again.cached is None
    assert [problem.split(" (")[0] for _, problem in again.bad] == ["label values out of range"]
