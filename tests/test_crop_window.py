"""The training crop computed in the source image's coordinates (ImageReader.augment, crop first).

Held against: a numpy crop-and-resize of the source written from the definition (tests/helpers.py
`bilinear_resize`: TensorFlow 2's half-pixel bilinear, edge-clamped; nearest-neighbour labels with
ResizeNearestNeighbor's float32 index arithmetic), the whole-image augmentation seg-train used before
(`whole_image_augment` below, kept here as the reference: the new stream must be the old one bit for
bit), and the whole-file JPEG decode (a cropped decode must give the same pixels). Every stream is run
through tf.data, as training runs it (a tf.function would let Grappler rewrite x / std as
x * (1 / std) and change the last bit of both sides).
"""

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from seg_train.data import reader as reader_mod
from seg_train.data.label_images import save_index_png, voc_colormap
from seg_train.data.reader import apply_photometric, photometric_draws
from tests.helpers import bilinear_resize, open_reader, tiny_config

MEAN, STD = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)
# numpy's bilinear_resize places samples in float64, TensorFlow in float32: on these small, noisy images
# the values differ by less than this many levels of 0..255 (seen: up to 8e-4; a sample one pixel off
# moves them by tens of levels).
TOLERANCE_LEVELS = 5e-3


def texture(h, w, seed):
    """Noise over gradients: neighbouring pixels differ, so a sample taken one pixel off shows."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / w, yy * 255 / h, (xx + yy) * 127 / (w + h)], -1)
    return np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)


def whole_image_augment(reader, image, label, k):
    """seg-train's augmentation before the crop-first change, verbatim: the whole image cast, resized,
    mirrored and padded, then cropped. The reference the new stream must equal bit for bit."""
    self = reader
    cfg = self.cfg
    seeds = tf.random.experimental.stateless_split(
        tf.stack([tf.constant(self.seed + 1, tf.int64), k]), num=4)
    image = tf.cast(image, tf.float32)
    label = tf.cast(label, tf.int32)[..., None]
    lo, hi = cfg.random_scale
    if hi > lo or lo != 1.0:
        scale = tf.random.stateless_uniform([], seeds[0], lo, hi)
        hw = tf.cast(tf.shape(image)[:2], tf.float32)
        new_hw = tf.maximum(tf.cast(tf.round(hw * scale), tf.int32), 1)
        image = tf.image.resize(image, new_hw, method="bilinear")
        label = tf.image.resize(label, new_hw, method="nearest")
    if cfg.random_mirror:
        flip = tf.random.stateless_uniform([], seeds[1]) < 0.5
        image = tf.cond(flip, lambda: tf.reverse(image, [1]), lambda: image)
        label = tf.cond(flip, lambda: tf.reverse(label, [1]), lambda: label)
    ch, cw = cfg.crop_size
    h, w = tf.shape(image)[0], tf.shape(image)[1]
    ph, pw = tf.maximum(ch - h, 0), tf.maximum(cw - w, 0)
    pad = [[0, ph], [0, pw], [0, 0]]
    image = tf.pad(image - tf.constant(cfg.mean), pad) + tf.constant(cfg.mean)
    label = tf.pad(label, pad, constant_values=cfg.ignore_label)
    h, w = h + ph, w + pw
    y = tf.random.stateless_uniform([], seeds[2], 0, h - ch + 1, dtype=tf.int32)
    x = tf.random.stateless_uniform([], seeds[3], 0, w - cw + 1, dtype=tf.int32)
    image = image[y:y + ch, x:x + cw]
    label = label[y:y + ch, x:x + cw, 0]
    if cfg.photometric:
        key = tf.random.experimental.stateless_fold_in(tf.stack([tf.constant(self.seed + 1, tf.int64), k]), 1)
        jittered = apply_photometric(image, photometric_draws(cfg.photometric, key))
        inside = (tf.range(ch)[:, None] + y < h - ph) & (tf.range(cw)[None, :] + x < w - pw)
        image = tf.where(inside[..., None], jittered, image)
    image = self.normalize(image)
    image.set_shape([ch, cw, 3])
    label.set_shape([ch, cw])
    return image, tf.cast(label, tf.uint8)


def by_tf_data(fn, image, label, ks):
    """fn(image, label, k) for each k, run as tf.data runs the training stream: [(image, label)] numpy."""
    ds = tf.data.Dataset.from_tensor_slices(tf.constant(ks, tf.int64)).map(
        lambda k: fn(tf.constant(image), tf.constant(label), k))
    return [(a.numpy(), b.numpy()) for a, b in ds]


def draws(seed, k, lo, hi, mirror, hw, crop):
    """The documented draws of sample k, written out: scale, mirror, y, x, each from its own split of
    the key (seed + 1, k); the scaled size round(size * scale); the window position within the scaled
    image padded to the crop size."""
    seeds = tf.random.experimental.stateless_split(tf.constant([seed + 1, k], tf.int64), num=4)
    if hi > lo or lo != 1.0:
        s = tf.random.stateless_uniform([], seeds[0], lo, hi)
        size = np.maximum(np.round(np.float32(hw) * s.numpy()).astype(int), 1)
    else:
        size = np.array(hw)
    flip = bool(tf.random.stateless_uniform([], seeds[1]) < 0.5) if mirror else False
    padded = np.maximum(size, crop)
    y = int(tf.random.stateless_uniform([], seeds[2], 0, int(padded[0] - crop[0] + 1), dtype=tf.int32))
    x = int(tf.random.stateless_uniform([], seeds[3], 0, int(padded[1] - crop[1] + 1), dtype=tf.int32))
    return size, flip, y, x


def nearest_indices(n_in, n_out):
    """ResizeNearestNeighbor (half-pixel centres): min(floor((o + 0.5) * in / out), in - 1), in float32."""
    scale = np.float32(n_in) / np.float32(n_out)
    return np.minimum(np.floor((np.arange(n_out, dtype=np.float32) + np.float32(0.5)) * scale).astype(int), n_in - 1)


def numpy_crop(image, label, size, flip, y, x, crop, ignore=255):
    """The definition by hand: resize the whole image (numpy bilinear) and label (nearest), mirror, pad
    with the mean colour and ignore, cut the window, normalise."""
    h, w = label.shape
    if tuple(size) != (h, w):
        scaled = bilinear_resize(image[None].astype(np.float64), tuple(size))[0]
        lab = label[nearest_indices(h, size[0])][:, nearest_indices(w, size[1])]
    else:
        scaled, lab = image.astype(np.float64), label
    if flip:
        scaled, lab = scaled[:, ::-1], lab[:, ::-1]
    ph, pw = max(crop[0] - size[0], 0), max(crop[1] - size[1], 0)
    padded = np.empty((size[0] + ph, size[1] + pw, 3))
    padded[:] = MEAN
    padded[:size[0], :size[1]] = scaled
    plab = np.full(padded.shape[:2], ignore, np.uint8)
    plab[:size[0], :size[1]] = lab
    out = padded[y:y + crop[0], x:x + crop[1]]
    return (out - np.array(MEAN)) / np.array(STD), plab[y:y + crop[0], x:x + crop[1]]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A textured 45x67 image with a label of 5 classes and an ignored patch, and a one-sample data set
    (the reader needs a split to open)."""
    root = tmp_path_factory.mktemp("crop") / "voc"
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / d).mkdir(parents=True)
    image = texture(45, 67, 0)
    label = np.random.default_rng(1).integers(0, 5, (45, 67)).astype(np.uint8)
    label[10:14, 20:30] = 255
    Image.fromarray(image).save(root / "JPEGImages" / "a.jpg", quality=95)
    save_index_png(root / "SegmentationClass" / "a.png", label, voc_colormap())
    (root / "ImageSets" / "Segmentation" / "train.txt").write_text("a\n")
    return root, image, label


def reader_for(tmp_path, root, **data):
    cfg = tiny_config(tmp_path, data_root=root, data=dict({"num_classes": 5, "mean": list(MEAN), "std": list(STD)},
                                                          **data))
    return open_reader(cfg, "train", seed=3)


# Scales below, at and above 1 (1.0 with resizing configured: the kernel's no-op resize), and crops larger
# than the scaled image (the window leaves it: padding), mirrored or not.
CASES = {
    "down_0.6": dict(random_scale=[0.6, 0.6], crop_size=[16, 20]),
    "up_1.7": dict(random_scale=[1.7, 1.7], crop_size=[16, 20]),
    "up_2.6": dict(random_scale=[2.6, 2.6], crop_size=[21, 17]),
    "scale_1_resizing": dict(random_scale=[1.0, 1.0001], crop_size=[16, 20]),
    "no_resize": dict(random_scale=[1.0, 1.0], crop_size=[16, 20]),
    "window_leaves_image": dict(random_scale=[0.5, 0.9], crop_size=[40, 50]),
    "range_0.5_2": dict(random_scale=[0.5, 2.0], crop_size=[24, 24]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_crop_matches_a_numpy_crop_and_resize_of_the_source(tmp_path, source, case):
    """Each crop against the definition computed by hand on the whole image, 12 samples (both mirror
    states). Fails for a window placed one pixel off, a source box without the resampling margin, an
    inverted scale, a mirrored window position whose pixels are not mirrored, nearest indices rounded
    instead of floored: each moves values by whole pixels' differences (tens of levels here) or labels."""
    root, image, label = source
    spec = CASES[case]
    reader = reader_for(tmp_path, root, **spec)
    lo, hi = spec["random_scale"]
    ks = list(range(12))
    got = by_tf_data(reader.augment, image, label, ks)
    flips = set()
    for k, (img, lbl) in zip(ks, got):
        size, flip, y, x = draws(3, k, lo, hi, True, image.shape[:2], spec["crop_size"])
        flips.add(flip)
        want_img, want_lbl = numpy_crop(image, label, size, flip, y, x, spec["crop_size"])
        err = np.abs(img - want_img) * np.array(STD)  # in levels of 0..255
        assert err.max() < TOLERANCE_LEVELS, (case, k, float(err.max()))
        np.testing.assert_array_equal(lbl, want_lbl, err_msg=f"{case} k={k}")
    assert flips == {False, True}, case


def test_both_resampling_paths_are_the_definition(tmp_path, source):
    """The crop is made either from tf.image.resize of the whole image or from the window's own
    resampling, by cost: the cases above cover both (so neither can hide behind the other)."""
    root, image, _ = source
    seen = set()
    for case in ("down_0.6", "up_1.7", "range_0.5_2"):
        reader = reader_for(tmp_path, root, **CASES[case])
        for k in range(12):
            seen.add(bool(reader._window_plan(tf.constant(image.shape[:2]), tf.constant(k, tf.int64)).whole))
    assert seen == {False, True}


@pytest.mark.parametrize("spec", [
    dict(random_scale=[0.5, 2.0], crop_size=[16, 20]),
    dict(random_scale=[0.25, 3.0], crop_size=[33, 29], random_mirror=False),
    dict(random_scale=[0.5, 2.0], crop_size=[24, 24],
         photometric={"brightness": 32, "contrast": 0.5, "saturation": 0.5, "hue": 18}),
    dict(random_scale=[1.0, 1.0], crop_size=[50, 30]),
], ids=["default", "wide_range_no_mirror", "photometric", "no_resize_padded"])
def test_the_stream_is_the_whole_image_augmentation_bit_for_bit(tmp_path, source, spec):
    """The same draws give the same crops as the whole-image augmentation seg-train used before, to the
    bit (so runs started before the change resume on the same stream). Fails for any reordering of the
    interpolation's arithmetic (x then y, left + (right - left) * lerp), a dropped (x - mean) + mean,
    or a different draw."""
    root, image, label = source
    reader = reader_for(tmp_path, root, **spec)
    ks = list(range(40))
    new = by_tf_data(reader.augment, image, label, ks)
    old = by_tf_data(lambda i, l_, k: whole_image_augment(reader, i, l_, k), image, label, ks)
    for k, ((a, la), (b, lb)) in enumerate(zip(new, old)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (k, float(np.abs(a - b).max()))
        np.testing.assert_array_equal(la, lb, err_msg=str(k))


def jpeg_kinds(directory, h=70, w=101):
    """JPEG files as cameras and converters write them: chroma subsampled (4:2:0, 4:2:2) or not,
    progressive, low quality, greyscale, CMYK."""
    im = Image.fromarray(texture(h, w, 7))
    kinds = {"420": dict(subsampling=2, quality=90), "422": dict(subsampling=1, quality=75),
             "444": dict(subsampling=0, quality=95), "progressive": dict(progressive=True),
             "q30": dict(quality=30)}
    for name, kw in kinds.items():
        im.save(directory / f"{name}.jpg", **kw)
    im.convert("L").save(directory / "grey.jpg")
    im.convert("CMYK").save(directory / "cmyk.jpg")
    return ["420", "422", "444", "progressive", "q30", "grey", "cmyk"]


def test_a_jpeg_decoded_only_where_its_window_reads_gives_the_whole_decodes_crops(tmp_path, monkeypatch):
    """The training stream decodes a JPEG only around its crop's source box (decode_and_crop_jpeg); its
    samples equal `augment` of the whole decoded image for every kind of JPEG, with no sample falling
    back to Pillow. Fails without the margin around the box: libjpeg-turbo upsamples the chroma of a
    cropped decode's outermost column as if it were the image's edge (4:2:0 and 4:2:2 files)."""
    root = tmp_path / "voc"
    for d in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / d).mkdir(parents=True)
    names = jpeg_kinds(root / "JPEGImages")
    label = np.random.default_rng(2).integers(0, 5, (70, 101)).astype(np.uint8)
    for n in names:
        Image.fromarray(label).save(root / "SegmentationClass" / f"{n}.png")
    (root / "ImageSets" / "Segmentation" / "train.txt").write_text("".join(f"{n}\n" for n in names))
    reader = reader_for(tmp_path, root, random_scale=[1.5, 3.0], crop_size=[24, 32])
    calls = []
    real = reader_mod.load_sample
    monkeypatch.setattr(reader_mod, "load_sample", lambda *a: calls.append(a[0]) or real(*a))
    n = len(names)
    ks, order = list(range(4 * n)), []
    pairs = tf.data.Dataset.from_tensor_slices(tf.constant(ks, tf.int64)).map(lambda k: (k, k % n))
    cropped = [(a.numpy(), b.numpy()) for a, b in pairs.map(reader.training_sample)]
    whole = [(a.numpy(), b.numpy()) for a, b in pairs.map(lambda k, i: reader.augment(*reader.decode(i), k))]
    assert not calls  # TensorFlow decoded every sample: none went to Pillow's fallback
    inner = 0
    for k, ((a, la), (b, lb)) in enumerate(zip(cropped, whole)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (names[k % n], k)
        np.testing.assert_array_equal(la, lb)
        box = reader._window_plan(tf.constant([70, 101]), tf.constant(k, tf.int64)).box.numpy()
        order.append(box)
        inner += box[1] > 0 and box[1] + box[3] < 101
    assert inner >= n  # windows with source columns on both sides, where the margin matters
