"""Loss pieces as pure functions; the cross-tower scaling is done by the train step, not here.

The pixel loss (`pixel_loss_sum`) returns a SUM and a NORMALIZER instead of a mean: the train step
divides the sum over all towers (and micro-batches) of the sums by the sum of the normalizers, so
the objective is the same however the global batch is split. Everything a normalizer depends on is
per pixel or per image (never per tower), which is what makes 1 tower equal N towers:

- plain: cross-entropy summed over the valid pixels / the number of valid pixels;
- `class_weights` (`loss.class_weights`): each pixel's loss times its class's weight / the sum of
  the weights of the valid pixels (a weighted mean);
- `top_k` (`loss.top_k_percent_pixels`, DeepLab's and Model Garden's hard-pixel mining): only the
  k pixels with the largest loss of EACH IMAGE count, k = round(top_k * that image's valid pixels)
  (halves up, at least 1 when the image has a valid pixel) / the number of pixels kept. DeepLab and
  Model Garden rank the whole batch of a tower at once and truncate top_k * (all pixels, ignored
  ones included); ranking per image over its valid pixels keeps the result independent of how the
  batch is split over towers and of how much of an image is ignored, and rounding to the nearest
  integer is not thrown off by products like 0.29 * 100 = 28.999... that truncation turns into 28;
- both: the ranking is on the WEIGHTED per-pixel losses (as DeepLab and Model Garden mine), and
  the normalizer is the sum of the weights of the kept pixels. This one normalizer depends on the
  logits (which pixels are kept), so the train step must all-reduce it after the forward pass;
  in every other case it depends on the labels alone.
Equal losses at the cut-off are kept lowest pixel index first (tf.math.top_k's order), so the
choice is deterministic.
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf

from seg_train.config import ConfigError

log = logging.getLogger("seg_train")


def keep_counts(valid_counts, top_k: float):
    """Pixels kept per image: round(top_k * valid) (halves up), at least 1 if valid > 0, at most valid.

    Computed in float64, so any count a float32 holds exactly gives the exact rounding.
    """
    n = tf.cast(valid_counts, tf.float64)
    k = tf.floor(n * float(top_k) + 0.5)
    return tf.minimum(tf.maximum(k, tf.minimum(n, 1.0)), n)


def pixel_loss_sum(logits, labels, ignore_label: int, class_weights=None, top_k: float = 1.0):
    """Softmax cross-entropy summed over the pixels the loss counts, and its normalizer (module doc).

    Args:
      logits: float [b, h, w, C] (any float dtype; computed in float32).
      labels: integer [b, h, w]; `ignore_label` pixels never count.
      ignore_label: the label value to ignore.
      class_weights: None, or C non-negative per-class weights (a list or numpy array).
      top_k: in (0, 1]; the fraction of each image's valid pixels kept (1.0: all).
    Returns:
      (loss_sum, normalizer), float32 scalars. The objective is sum(loss_sum) / sum(normalizer)
      over all towers and micro-batches; the normalizer is 0 when nothing counts (no valid pixel,
      or only zero-weight classes), so divide with tf.math.divide_no_nan.
    """
    if not 0.0 < top_k <= 1.0:
        raise ValueError(f"top_k must be in (0, 1], got {top_k}")
    labels = tf.cast(labels, tf.int32)
    valid = tf.not_equal(labels, ignore_label)
    safe = tf.where(valid, labels, tf.zeros_like(labels))
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=safe, logits=tf.cast(logits, tf.float32))
    weight = tf.cast(valid, tf.float32)
    if class_weights is not None:
        weight = weight * tf.gather(tf.constant(np.asarray(class_weights, np.float32)), safe)
    loss = ce * weight
    if top_k >= 1.0:
        return tf.reduce_sum(loss), tf.reduce_sum(weight)

    batch = tf.shape(loss)[0]
    pixels = loss.shape[1] * loss.shape[2] if loss.shape[1] and loss.shape[2] else tf.shape(loss)[1] * tf.shape(loss)[2]
    loss = tf.reshape(loss, [batch, pixels])
    weight = tf.reshape(weight, [batch, pixels])
    valid = tf.reshape(valid, [batch, pixels])
    k = tf.cast(keep_counts(tf.reduce_sum(tf.cast(valid, tf.int32), axis=1), top_k), tf.float32)
    # Every image's pixels ranked by loss, ignored pixels last (losses are >= 0): a full per-image
    # sort, since the number kept differs between images. The gradient flows through the values.
    ranked, order = tf.math.top_k(tf.where(valid, loss, -tf.ones_like(loss)), k=pixels, sorted=True)
    keep = tf.cast(tf.range(pixels)[tf.newaxis, :], tf.float32) < k[:, tf.newaxis]
    keep = tf.cast(keep, tf.float32)
    loss_sum = tf.reduce_sum(ranked * keep)
    if class_weights is None:
        return loss_sum, tf.reduce_sum(k)
    return loss_sum, tf.reduce_sum(tf.gather(weight, order, batch_dims=1) * keep)


def pixel_cross_entropy_sum(logits, labels, ignore_label: int):
    """Softmax cross-entropy summed over the valid pixels, and the number of valid pixels.

    Returning (sum, count) rather than a mean lets the caller normalise by the GLOBAL valid-pixel
    count of the step: a per-tower mean would give towers with many ignored pixels more weight.
    `pixel_loss_sum` with neither class weights nor mining.
    """
    return pixel_loss_sum(logits, labels, ignore_label)


def median_frequency_weights(class_pixels, image_pixels, class_names=None) -> np.ndarray:
    """SegNet's median frequency balancing (Badrinarayanan et al. 2017, after Eigen & Fergus 2015).

    w_c = median_freq / freq_c, with freq_c = (pixels of class c) / (pixels of the images where c is
    present) and median_freq the median of the freq_c. Pixels are LABELLED pixels here: ignore_label
    pixels are not pixels of any class the loss sees, so they count in neither number. A class with
    no pixel has no frequency: weight 0 (with a warning), and it takes no part in the median.

    Args:
      class_pixels: [C] pixels of each class over the split.
      image_pixels: [C] for each class, the labelled pixels of the images that contain it.
    Returns:
      float32 [C] weights.
    """
    class_pixels = np.asarray(class_pixels, np.float64)
    image_pixels = np.asarray(image_pixels, np.float64)
    present = class_pixels > 0
    if not present.any():
        raise ValueError("no labelled pixel in the split: median frequency weights need class pixels")
    freq = np.zeros_like(class_pixels)
    freq[present] = class_pixels[present] / image_pixels[present]
    weights = np.zeros_like(class_pixels)
    weights[present] = np.median(freq[present]) / freq[present]
    if not present.all():
        absent = [class_names[c] if class_names else str(c) for c in np.flatnonzero(~present)]
        log.warning("loss.class_weights: median_frequency: no pixel of class(es) %s in the train split: weight 0",
                    ", ".join(absent))
    return weights.astype(np.float32)


def class_weights_for(cfg, scan_report, class_names=None) -> np.ndarray | None:
    """The per-class loss weights `loss.class_weights` asks for, as float32 [num_classes], or None.

    `scan_report` is datacheck.scan's report of the TRAIN split (its pixel counts give
    'median_frequency' and 'sqrt_median_frequency'); `class_names` only name classes in warnings.
    """
    weights = cfg.loss.class_weights
    if weights is None:
        return None
    if not isinstance(weights, str):
        return np.asarray(weights, np.float32)
    n = cfg.data.num_classes
    try:
        w = median_frequency_weights(scan_report.histogram[:n], scan_report.image_pixels[:n], class_names)
    except ValueError:
        raise ConfigError("no labelled pixels to balance", "loss.class_weights",
                          f"a train split with labelled pixels for '{weights}' (or a list of weights)") from None
    # 'sqrt_median_frequency': the square root of SegNet's weights, a milder balancing. On CamVid at
    # 2000 steps the full weights moved too many pixels into the rare classes (val -1.6 mIoU: Building
    # and Pedestrian lost more than Pole, Car and Bicyclist gained) while the square roots gained
    # +2.2 val / +0.9 test mIoU over no weights (docs/ACCURACY.md).
    return np.sqrt(w).astype(np.float32) if weights == "sqrt_median_frequency" else w


def decay_variables(model) -> list:
    """Conv and dense kernels (depthwise/pointwise included): what weight decay applies to."""
    names = ("kernel", "depthwise_kernel", "pointwise_kernel")
    return [v for v in model.trainable_variables if v.name in names]


def weight_decay(variables, coefficient: float):
    """coefficient * sum(l2_loss(kernel)) with l2_loss(x) = sum(x**2) / 2."""
    if not variables or coefficient == 0:
        return tf.constant(0.0, tf.float32)
    return coefficient * tf.add_n([tf.nn.l2_loss(tf.cast(v, tf.float32)) for v in variables])
