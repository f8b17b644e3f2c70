"""ImageReader: palette labels read as indices, padding with ignore_label, stateless augmentation."""

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from seg_train.config import DataConfig
from seg_train.data.label_images import save_index_png, voc_colormap
from seg_train.data.layouts import list_samples
from seg_train.data.reader import BadSample, load_sample
from tests.helpers import open_reader, tiny_config


def make_voc(root, labels, size=(20, 30)):
    (root / "JPEGImages").mkdir(parents=True)
    (root / "SegmentationClass").mkdir()
    (root / "ImageSets" / "Segmentation").mkdir(parents=True)
    ids = []
    for i, label in enumerate(labels):
        sid = f"img{i}"
        rgb = np.full((*label.shape, 3), 100 + 20 * i, np.uint8)
        Image.fromarray(rgb).save(root / "JPEGImages" / f"{sid}.jpg")
        save_index_png(root / "SegmentationClass" / f"{sid}.png", label, voc_colormap())
        ids.append(sid)
    (root / "ImageSets" / "Segmentation" / "train.txt").write_text("\n".join(ids) + "\n")
    return root


def test_palette_label_read_as_indices(tmp_path):
    label = np.zeros((20, 30), np.uint8)
    label[5:10, 5:10] = 1
    label[12:, :] = 2
    label[0, :] = 255
    root = make_voc(tmp_path / "voc", [label])
    assert Image.open(root / "SegmentationClass" / "img0.png").mode == "P"
    cfg = tiny_config(tmp_path, data_root=root)
    reader = open_reader(cfg, "train")
    image, decoded = reader.decode(0)
    np.testing.assert_array_equal(decoded.numpy(), label)  # not colours (128,0,0) nor luminance (38)
    assert image.shape == (20, 30, 3)


def test_crop_pads_label_with_ignore_and_is_a_pure_function_of_k(tmp_path):
    label = np.ones((20, 30), np.uint8)
    root = make_voc(tmp_path / "voc", [label])
    cfg = tiny_config(tmp_path, data_root=root, data={"crop_size": [40, 40], "random_scale": [1.0, 1.0]})
    reader = open_reader(cfg, "train", seed=3)
    image, lbl = reader.decode(0)
    a_img, a_lbl = reader.augment(image, lbl, np.int64(7))
    b_img, b_lbl = reader.augment(image, lbl, np.int64(7))
    np.testing.assert_array_equal(a_img.numpy(), b_img.numpy())
    a = a_lbl.numpy()
    assert a.shape == (40, 40)
    assert (a == 1).sum() == 20 * 30 and (a == 255).sum() == 40 * 40 - 20 * 30
    # Padded image pixels are the mean colour: zero after normalisation.
    assert np.allclose(a_img.numpy()[a == 255], 0.0)


def test_pair_list_split_and_errors(tmp_path):
    label = np.zeros((20, 30), np.uint8)
    root = make_voc(tmp_path / "voc", [label, label])
    (root / "pairs.txt").write_text("/JPEGImages/img1.jpg /SegmentationClass/img1.png\n")
    samples = list_samples(DataConfig(root=root), "pairs.txt")
    assert len(samples) == 1 and samples[0].image.endswith("img1.jpg")
    (root / "ImageSets" / "Segmentation" / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="empty split"):
        list_samples(DataConfig(root=root), "empty")
    bad = label.copy()
    bad[0, 0] = 7
    save_index_png(root / "SegmentationClass" / "img1.png", bad, voc_colormap())
    with pytest.raises(BadSample, match=r"label values out of range .*img1.png.*\[7\]"):
        load_sample(samples[0].image, samples[0].label, 3, 255)
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(root / "SegmentationClass" / "img1.png")
    with pytest.raises(BadSample, match="colour"):
        load_sample(samples[0].image, samples[0].label, 3, 255)


def test_cache_gives_the_same_stream_and_decodes_once(tmp_path, monkeypatch):
    """data.cache: the same batches as decoding every time, and each file decoded only once.

    The cache is filled by load_sample (Pillow), the plain stream is decoded by TensorFlow without
    load_sample: the same batches mean the same pixels. Fails too for a TensorFlow decode that fails
    on good files, which the fallback to load_sample would hide (only slower)."""
    from seg_train.data import reader as reader_mod

    rng = np.random.default_rng(0)
    labels = [rng.integers(0, 3, size=(20, 30)).astype(np.uint8) for _ in range(3)]
    root = make_voc(tmp_path / "voc", labels)
    plain_cfg = tiny_config(tmp_path, data_root=root, data={"crop_size": [16, 16], "num_parallel_calls": 2})
    cached_cfg = tiny_config(tmp_path, data_root=root, data={"crop_size": [16, 16], "num_parallel_calls": 2,
                                                             "cache": True})
    calls = []
    real = reader_mod.load_sample
    monkeypatch.setattr(reader_mod, "load_sample", lambda *a: calls.append(a[0]) or real(*a))
    plain = list(open_reader(plain_cfg, "train", seed=1).train_dataset(2, 0, 1).take(6))
    n_plain = len(calls)
    calls.clear()
    cached_reader = open_reader(cached_cfg, "train", seed=1)
    cached = list(cached_reader.train_dataset(2, 0, 1).take(6))  # 12 samples: 4 passes over 3 images
    assert n_plain == 0  # TensorFlow decoded every sample: no fallback to load_sample
    assert sorted(calls) == sorted(set(calls)) and len(calls) == 3  # cached: each file once, however far ahead
    assert cached_reader.cache_bytes() == 3 * (20 * 30 * 3 + 20 * 30)
    for (a_img, a_lbl), (b_img, b_lbl) in zip(plain, cached):
        np.testing.assert_array_equal(a_img.numpy(), b_img.numpy())
        np.testing.assert_array_equal(a_lbl.numpy(), b_lbl.numpy())


def test_mirror_flips_image_and_label_together(tmp_path):
    """A mirrored sample's label is mirrored with its image: the wrong answer is a label left as it was
    (bright pixels would then carry the dark half's class on two thirds of the columns)."""
    root = make_voc(tmp_path / "voc", [np.zeros((20, 30), np.uint8)])
    label = np.zeros((20, 30), np.uint8)
    label[:, 10:] = 1  # an asymmetric split, so a mirror really moves the boundary
    image = np.where(label[..., None] == 1, 220, 30).astype(np.uint8).repeat(3, axis=-1)
    Image.fromarray(image).save(root / "JPEGImages" / "img0.jpg")
    save_index_png(root / "SegmentationClass" / "img0.png", label, voc_colormap())
    cfg = tiny_config(tmp_path, data_root=root, data={"crop_size": [20, 30], "random_scale": [1.0, 1.0]})
    reader = open_reader(cfg, "train")
    decoded = reader.decode(0)
    mirrored = []
    for k in range(8):
        img, lbl = (t.numpy() for t in reader.augment(*decoded, np.int64(k)))
        mirrored.append(bool(lbl[0, 0] == 1))
        bright = img[..., 0] > 0.0  # normalised: the dark half is far below the mean colour, the bright far above
        assert (bright == (lbl == 1)).mean() > 0.95, k
    assert any(mirrored) and not all(mirrored)  # both cases really seen


@pytest.mark.parametrize("replicas,pipelines,micro,start", [(1, 1, 1, 0), (4, 1, 1, 3), (4, 2, 2, 5), (2, 2, 3, 1)])
def test_train_order_is_the_definition_per_sample(tmp_path, replicas, pipelines, micro, start):
    # The stream reads the order one epoch's permutation at a time; the definition is _index_of(k),
    # a permutation per sample, and the counter formula of the module docstring, both by hand here.
    root = make_voc(tmp_path / "voc", [np.zeros((4, 4), np.uint8)] * 7)
    cfg = tiny_config(tmp_path, data_root=root)
    reader = open_reader(cfg, "train", seed=5)
    B = 4  # noqa: N806 - the global batch
    b, r_local = B // replicas, replicas // pipelines
    for p in range(pipelines):
        got = list(reader.train_order(B, start, replicas, p, pipelines, micro).take(40).as_numpy_iterator())
        per_replica, per_step = micro * b, r_local * micro * b
        for t, (k, index) in enumerate(got):
            s, rem = start + t // per_step, t % per_step
            r, q = rem // per_replica, rem % per_replica
            m, i = q // b, q % b
            want_k = (s * micro + m) * B + p * r_local * b + r * b + i
            assert k == want_k
            assert index == int(reader._index_of(tf.constant(want_k, tf.int64)))
    # A different epoch is a different order (7 samples, 40 elements: several epochs were compared above).
    assert [int(reader._index_of(tf.constant(k, tf.int64))) for k in range(7)] != \
        [int(reader._index_of(tf.constant(k, tf.int64))) for k in range(7, 14)]


def test_split_list_lines_skip_comments_and_an_unreadable_file_is_one_error(tmp_path):
    """files.split_lines, which the VOC/pairs reader and the pairs layout share: blank lines and '#'
    lines are skipped with the line numbers kept (wrong if it renumbers or keeps a comment); a file
    that is not UTF-8 is a ConfigError naming it (wrong if UnicodeDecodeError escapes)."""
    from seg_train.config import ConfigError
    from seg_train.data import files

    path = tmp_path / "train.txt"
    path.write_text("# image label\n\n a/1.jpg  a/1.png \n  #x y\nb\n")
    assert files.split_lines(str(path)) == [(3, ["a/1.jpg", "a/1.png"], " a/1.jpg  a/1.png "), (5, ["b"], "b")]
    path.write_bytes(b"\xff\xfe a.jpg a.png\n")
    for read in (files.split_lines, lambda p: list_samples(DataConfig(root=tmp_path), p)):
        with pytest.raises(ConfigError) as e:
            read(str(path))
        assert (e.value.what, e.value.where) == ("cannot read split", str(path))
