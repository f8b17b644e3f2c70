"""The pixel loss (losses.pixel_loss_sum): class weights, per-image hard-pixel mining, their
combination, ignored pixels, the (sum, normalizer) contract that makes the loss independent of how
the batch is split; and the median frequency class weights from the pre-training scan.

The hand cases use two classes and logits [0, a], whose cross-entropy is softplus(a) for label 0
and softplus(-a) for label 1: a = ln 3 gives ln 4 and ln 4/3, a = ln 7 gives ln 8 and ln 8/7.
"""

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from seg_train.data import class_weights
from seg_train.data.layouts import Sample
from seg_train.data.scan import class_weights_for_split, scan
from seg_train.objectives import pixel_losses as losses
from tests.helpers import tiny_config

LN2, LN3 = np.log(2.0), np.log(3.0)
IGNORE = 255


def two_class(a_rows, label_rows):
    """Logits [b, 1, w, 2] = [0, a] and labels [b, 1, w] from per-image lists."""
    a = np.array(a_rows, np.float32)[:, None, :]
    logits = np.stack([np.zeros_like(a), a], axis=-1)
    return logits, np.array(label_rows, np.int32)[:, None, :]


# Image 0: cross-entropies ln 4, ln 4/3, ln 8 on labels 0, 1, 0, then an ignored pixel.
IMG0 = ([LN3, LN3, np.log(7.0), 0.0], [0, 1, 0, IGNORE])


def run(logits, labels, **kw):
    s, n = losses.pixel_loss_sum(tf.constant(logits), tf.constant(labels), IGNORE, **kw)
    assert s.dtype == tf.float32 and n.dtype == tf.float32 and s.shape == n.shape == ()
    return float(s), float(n)


def test_plain_is_the_valid_pixel_sum_and_count():
    logits, labels = two_class([IMG0[0]], [IMG0[1]])
    s, n = run(logits, labels)
    assert s == pytest.approx(7 * LN2 - LN3, rel=1e-6) and n == 3.0
    assert tuple(map(float, losses.pixel_cross_entropy_sum(logits, labels, IGNORE))) == pytest.approx((s, n))


def test_class_weights_weight_each_pixel_and_the_normalizer():
    logits, labels = two_class([IMG0[0]], [IMG0[1]])
    s, n = run(logits, labels, class_weights=[1.0, 3.0])
    # ln 4 + 3 ln 4/3 + ln 8, over the weights 1 + 3 + 1 of the valid pixels (not the 3 pixels)
    assert s == pytest.approx(11 * LN2 - 3 * LN3, rel=1e-6) and n == 5.0
    s, n = run(logits, labels, class_weights=[0.0, 2.0])
    assert s == pytest.approx(2 * (2 * LN2 - LN3), rel=1e-6) and n == 2.0


def test_top_k_keeps_the_hardest_pixels_of_each_image():
    logits, labels = two_class([IMG0[0]], [IMG0[1]])
    # 3 valid pixels * 0.5 = 1.5 -> 2 kept (halves up): ln 8 and ln 4
    assert run(logits, labels, top_k=0.5) == pytest.approx((5 * LN2, 2.0), rel=1e-6)
    assert run(logits, labels, top_k=0.3) == pytest.approx((3 * LN2, 1.0), rel=1e-6)      # 0.9 -> 1
    assert run(logits, labels, top_k=0.999) == pytest.approx(run(logits, labels), rel=1e-6)  # 2.997 -> all 3


def test_top_k_with_class_weights_mines_the_weighted_losses():
    logits, labels = two_class([IMG0[0]], [IMG0[1]])
    # Weighted losses ln 4 = 1.39, 10 ln 4/3 = 2.88, ln 8 = 2.08: the two largest are the class-1
    # pixel and the ln 8 pixel (mining the unweighted losses would keep ln 8 and ln 4); the
    # normalizer is their weights, 10 + 1.
    s, n = run(logits, labels, class_weights=[1.0, 10.0], top_k=0.5)
    assert s == pytest.approx(10 * (2 * LN2 - LN3) + 3 * LN2, rel=1e-6) and n == 11.0


def test_top_k_ties_and_the_documented_tie_order():
    # Four equal losses: any two give the same sum and count.
    logits, labels = two_class([[0.0] * 4], [[0, 1, 0, 1]])
    assert run(logits, labels, top_k=0.5) == pytest.approx((2 * LN2, 2.0), rel=1e-6)
    assert run(logits, labels, class_weights=[1.0, 10.0], top_k=0.5) == pytest.approx((20 * LN2, 20.0), rel=1e-6)
    # Equal WEIGHTED losses of different weights (1 * ln 4 and 2 * ln 2): the lower pixel index is
    # kept, so the normalizer is that pixel's weight.
    logits, labels = two_class([[-LN3, 0.0]], [[1, 0]])
    assert run(logits, labels, class_weights=[2.0, 1.0], top_k=0.5) == pytest.approx((2 * LN2, 1.0), rel=1e-6)
    logits, labels = two_class([[0.0, -LN3]], [[0, 1]])
    assert run(logits, labels, class_weights=[2.0, 1.0], top_k=0.5) == pytest.approx((2 * LN2, 2.0), rel=1e-6)


def test_an_image_without_valid_pixels_adds_nothing():
    logits, labels = two_class([IMG0[0], [5.0, -5.0, 1.0, 2.0]], [IMG0[1], [IGNORE] * 4])
    for kw in ({}, {"class_weights": [1.0, 3.0]}, {"top_k": 0.5}, {"class_weights": [1.0, 10.0], "top_k": 0.5}):
        alone = run(logits[:1], labels[:1], **kw)
        assert run(logits, labels, **kw) == pytest.approx(alone, rel=1e-6), kw
        assert run(logits[1:], labels[1:], **kw) == (0.0, 0.0), kw


def test_mining_is_per_image_not_per_batch():
    # Image 0 has only large losses (ln 8), image 1 only small ones (ln 8/7). Per image, top_k 0.5
    # keeps 2 of each; ranking the batch as one would keep image 0's four.
    logits, labels = two_class([[np.log(7.0)] * 4, [np.log(7.0)] * 4], [[0] * 4, [1] * 4])
    s, n = run(logits, labels, top_k=0.5)
    assert n == 4.0 and s == pytest.approx(2 * 3 * LN2 + 2 * (3 * LN2 - np.log(7.0)), rel=1e-6)


def test_keep_counts_round_to_nearest_halves_up_at_least_one():
    n = tf.constant([0, 1, 2, 3, 10, 100, 7])
    assert losses.keep_counts(n, 0.25).numpy().tolist() == [0, 1, 1, 1, 3, 25, 2]
    assert losses.keep_counts(tf.constant([100]), 0.29).numpy().tolist() == [29]  # 28.999... in floating point
    assert losses.keep_counts(n, 1.0).numpy().tolist() == [0, 1, 2, 3, 10, 100, 7]


def test_gradient_only_reaches_the_kept_pixels():
    logits, labels = two_class([IMG0[0]], [IMG0[1]])
    x = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(x)
        s, _ = losses.pixel_loss_sum(x, tf.constant(labels), IGNORE, top_k=0.5)
    g = tape.gradient(s, x).numpy()[0, 0]
    # kept: pixels 0 (ln 4) and 2 (ln 8); dropped: pixel 1; ignored: pixel 3
    p0, p2 = 3 / 4, 7 / 8  # softmax of class 1 at a = ln 3 and a = ln 7
    np.testing.assert_allclose(g, [[-p0, p0], [0, 0], [-p2, p2], [0, 0]], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape", [(2, 5, 7, 11), (3, 40, 150)], ids=["image", "rows"])
def test_cross_entropy_and_its_gradient_are_tensorflows_op(shape):
    """The written-out cross-entropy against TensorFlow's own op (its forward, and its gradient by autodiff)
    and against float64 numpy by hand, with an upstream gradient that differs per row: fails for a gradient
    without the label's -1, one not scaled by the upstream, or a loss that misses the row's max."""
    rng = np.random.default_rng(3)
    x = rng.normal(0, 4, shape).astype(np.float32)
    x[0, ..., 0] += 90.0  # large logits: exp(x) overflows float32 unless the row's max is taken out
    x[-1, ..., -1] -= 1e4
    labels = rng.integers(0, shape[-1], shape[:-1]).astype(np.int32)
    upstream = rng.normal(0, 1, shape[:-1]).astype(np.float32)
    xt, lt, ut = tf.constant(x), tf.constant(labels), tf.constant(upstream)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xt)
        ours = losses.softmax_cross_entropy(lt, xt)
        theirs = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=lt, logits=xt)
    g_ours = tape.gradient(ours, xt, output_gradients=ut).numpy()
    g_theirs = tape.gradient(theirs, xt, output_gradients=ut).numpy()
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(g_ours, g_theirs, rtol=1e-5, atol=1e-6)
    # float64 by hand: lse(x) - x[label]; gradient upstream * (softmax - one_hot).
    x64 = x.astype(np.float64)
    peak = x64.max(-1, keepdims=True)
    soft = np.exp(x64 - peak) / np.exp(x64 - peak).sum(-1, keepdims=True)
    onehot = np.eye(shape[-1])[labels]
    by_hand = np.log(np.exp(x64 - peak).sum(-1)) + peak[..., 0] - np.take_along_axis(x64, labels[..., None], -1)[..., 0]
    np.testing.assert_allclose(ours.numpy(), by_hand, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(g_ours, upstream[..., None] * (soft - onehot), rtol=1e-5, atol=1e-6)
    assert np.isfinite(g_ours).all() and np.abs(g_ours).max() > 0.5


def reference(logits, labels, class_weights=None, top_k=1.0):
    """numpy, one image at a time: stable sort by (-weighted loss, pixel index)."""
    logits = logits.astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    total, norm = 0.0, 0.0
    for img in range(len(labels)):
        pix = []
        for i, lab in enumerate(labels[img].ravel()):
            if lab == IGNORE:
                continue
            w = 1.0 if class_weights is None else class_weights[lab]
            ce = lse[img].ravel()[i] - logits[img].reshape(-1, logits.shape[-1])[i, lab]
            pix.append((-(w * ce), i, w))
        pix.sort()
        k = len(pix) if top_k == 1.0 else min(len(pix), max(int(np.floor(top_k * len(pix) + 0.5)), min(len(pix), 1)))
        total += sum(-p[0] for p in pix[:k])
        norm += sum(p[2] for p in pix[:k]) if class_weights is not None else k
    return total, norm


MODES = [{}, {"class_weights": [0.5, 2.0, 0.0, 1.0]}, {"top_k": 0.3},
         {"class_weights": [0.5, 2.0, 0.0, 1.0], "top_k": 0.3}]


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (4, 6, 5, 4)).astype(np.float32)
    labels = rng.integers(0, 4, (4, 6, 5)).astype(np.int32)
    labels[0, :2] = IGNORE
    labels[1, :, :4] = IGNORE
    labels[2] = IGNORE  # no valid pixel
    return logits, labels


@pytest.mark.parametrize("kw", MODES, ids=["plain", "weights", "top_k", "both"])
def test_matches_numpy_reference(batch, kw):
    logits, labels = batch
    s, n = run(logits, labels, **kw)
    ref_s, ref_n = reference(logits, labels, **kw)
    assert s == pytest.approx(ref_s, rel=1e-5) and n == pytest.approx(ref_n, rel=1e-6)


@pytest.mark.parametrize("kw", MODES, ids=["plain", "weights", "top_k", "both"])
def test_halves_sum_to_the_whole_batch(batch, kw):
    # What makes 1 tower equal N towers: (sum, normalizer) of two halves add up to the whole's.
    logits, labels = batch
    whole = run(logits, labels, **kw)
    halves = [run(logits[i:i + 2], labels[i:i + 2], **kw) for i in (0, 2)]
    assert sum(h[0] for h in halves) == pytest.approx(whole[0], rel=1e-6)
    assert sum(h[1] for h in halves) == pytest.approx(whole[1], rel=1e-6)
    assert whole[0] / whole[1] != pytest.approx(np.mean([h[0] / h[1] for h in halves if h[1]]), rel=1e-3)


def test_xla_compiles_the_mining_path(batch):
    logits, labels = batch
    kw = MODES[3]
    fn = tf.function(lambda x, y: losses.pixel_loss_sum(x, y, IGNORE, **kw), jit_compile=True)
    s, n = fn(tf.constant(logits), tf.constant(labels))
    assert (float(s), float(n)) == pytest.approx(run(logits, labels, **kw), rel=1e-5)


# Median frequency: 3 label images, 4 classes (class 3 never appears).
#   image 0: class 0 x3, class 1 x1, ignored x2  (4 labelled pixels)
#   image 1: class 0 x1, class 2 x3              (4)
#   image 2: class 1 x2, ignored x4              (2)
# class pixels [4, 3, 3, 0]; labelled pixels of the images with the class [4+4, 4+2, 4, 0];
# freq [1/2, 1/2, 3/4]; median 1/2; weights [1, 1, 2/3, 0].
LABELS = [[0, 0, 0, 1, IGNORE, IGNORE], [0, 2, 2, 2], [1, 1, IGNORE, IGNORE, IGNORE, IGNORE]]


def test_median_frequency_weights_by_hand(caplog):
    with caplog.at_level(logging.WARNING, logger="seg_train"):
        w = class_weights.median_frequency_weights([4, 3, 3, 0], [8, 6, 4, 0], ["sky", "road", "car", "boat"])
    np.testing.assert_allclose(w, [1.0, 1.0, 2 / 3, 0.0], rtol=1e-6)
    assert w.dtype == np.float32
    assert "boat" in caplog.text and "weight 0" in caplog.text
    with pytest.raises(ValueError):
        class_weights.median_frequency_weights([0, 0], [0, 0])


def label_samples(folder):
    """LABELS written as one-row images and PNG labels."""
    samples = []
    for i, row in enumerate(LABELS):
        img, lab = folder / f"{i}.png", folder / f"{i}_label.png"
        Image.fromarray(np.zeros((1, len(row), 3), np.uint8)).save(img)
        Image.fromarray(np.array([row], np.uint8)).save(lab)
        samples.append(Sample(str(i), str(img), str(lab)))
    return samples


def test_class_weights_for_from_the_scan(tmp_path):
    report = scan(label_samples(tmp_path), 4, IGNORE)
    assert report.histogram.tolist() == [4, 3, 3, 0, 6]
    assert report.image_pixels.tolist() == [8, 6, 4, 0]
    cfg = tiny_config(tmp_path, tmp_path, data={"num_classes": 4}, loss={"class_weights": "median_frequency"})
    np.testing.assert_allclose(class_weights.class_weights_for(cfg, report), [1.0, 1.0, 2 / 3, 0.0], rtol=1e-6)
    cfg = tiny_config(tmp_path, tmp_path, data={"num_classes": 4}, loss={"class_weights": "sqrt_median_frequency"})
    w = class_weights.class_weights_for(cfg, report)
    np.testing.assert_allclose(w, [1.0, 1.0, (2 / 3) ** 0.5, 0.0], rtol=1e-6)
    assert w.dtype == np.float32
    cfg = tiny_config(tmp_path, tmp_path, data={"num_classes": 4}, loss={"class_weights": [1, 2, 3, 0]})
    assert class_weights.class_weights_for(cfg, report).tolist() == [1.0, 2.0, 3.0, 0.0]
    assert class_weights.class_weights_for(tiny_config(tmp_path, tmp_path), report) is None


class Unscannable:
    """A reader whose split must not be scanned (reading its samples fails the test)."""

    @property
    def samples(self):
        pytest.fail("the split was scanned")


def test_class_weights_for_split_scans_only_when_it_must(tmp_path):
    """seg-train and seg-bench get their weights from this one function. Wrong answers: median_frequency
    without a report given (seg-bench) not scanning the split (no weights, or a crash); a second scan
    when seg-train gives its report; a scan for fixed weights or none (seg-bench paying for nothing)."""
    samples = label_samples(tmp_path)
    cfg = tiny_config(tmp_path, tmp_path, data={"num_classes": 4}, loss={"class_weights": "median_frequency"})
    reader = SimpleNamespace(samples=samples, label_table=None)  # VOC: labels as stored
    np.testing.assert_allclose(class_weights_for_split(cfg, reader), [1.0, 1.0, 2 / 3, 0.0], rtol=1e-6)
    report = scan(samples, 4, IGNORE)
    np.testing.assert_allclose(class_weights_for_split(cfg, Unscannable(), report), [1.0, 1.0, 2 / 3, 0.0], rtol=1e-6)
    cfg = tiny_config(tmp_path, tmp_path, data={"num_classes": 4}, loss={"class_weights": [1, 2, 3, 0]})
    w = class_weights_for_split(cfg, Unscannable())
    assert w.tolist() == [1.0, 2.0, 3.0, 0.0] and w.dtype == np.float32
    assert class_weights_for_split(tiny_config(tmp_path, tmp_path), Unscannable()) is None
