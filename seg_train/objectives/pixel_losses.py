"""Loss pieces as pure functions; the cross-tower scaling is done by the train step, not here.

The losses return a SUM and a NORMALIZER, not a mean: the train step divides the sum of all towers'
sums by the sum of their normalizers, so the objective does not depend on how the batch is split.
Every normalizer is per pixel or per image, never per tower: the valid pixels (or their class
weights); with `top_k` (`loss.top_k_percent_pixels`) the k = round(top_k * valid) largest
(weighted) losses of EACH IMAGE, ties lowest index first. DeepLab ranks a tower's whole batch and
truncates; per image the result is independent of the tower split, and rounding avoids
0.29 * 100 = 28.999... truncating to 28.

`ohem_threshold` (OHEM by probability) keeps per image the pixels below a true-class probability, at
least `ohem_min_kept` of them. Lovász-softmax and Dice (`loss.type`, `loss.terms`) are per-image losses
weighted by each image's share of the cross-entropy's normalizer (`objective_sum`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def keep_counts(valid_counts, top_k: float):
    """Pixels kept per image: round(top_k * valid) (halves up), at least 1 if valid > 0, at most valid.

    Float64, so the rounding is exact for any count a float32 holds."""
    n = tf.cast(valid_counts, tf.float64)
    k = tf.floor(n * float(top_k) + 0.5)
    return tf.minimum(tf.maximum(k, tf.minimum(n, 1.0)), n)


def softmax_cross_entropy(labels, logits):
    """Softmax cross-entropy per row of float32 `logits` [..., C] against int32 `labels` [...] in [0, C): what
    tf.nn.sparse_softmax_cross_entropy_with_logits computes, log(sum exp(x - max)) - (x[label] - max), with the
    gradient written out: upstream x (softmax - one_hot(label)).

    Written by hand because TensorFlow's op costs more than it should where the per-pixel loss spends it: its
    CPU kernel (SparseSoftmaxCrossEntropyWithLogits) takes about 1.6x these ops' forward + backward at the
    linear head's full-resolution shapes (benchmarks/bench_vit_parts.py's "pixel loss"; docs/PERFORMANCE.md),
    and its GPU kernel reduces in an unspecified order, so a run with op determinism on had to trace a
    log-softmax and a gather instead. These ops are deterministic on either device. The backward pass keeps
    exp(x - max) and its row sums, as many floats as the op's own stored backprop; its products and the one-hot
    peak at about 2.3 times the logits' size where the fused op, scaling its kept gradient in place, stays at 1
    (docs/PERFORMANCE.md: the memory this costs per image).
    """
    num_classes = logits.shape[-1] or tf.shape(logits)[-1]

    @tf.custom_gradient
    def cross_entropy(x):
        peak = tf.reduce_max(x, axis=-1, keepdims=True)
        shifted = x - peak
        e = tf.exp(shifted)
        total = tf.reduce_sum(e, axis=-1, keepdims=True)
        picked = tf.gather(shifted, labels[..., tf.newaxis], batch_dims=labels.shape.rank)
        loss = tf.math.log(total[..., 0]) - picked[..., 0]

        def grad(upstream):
            up = upstream[..., tf.newaxis]
            return e * (up / total) - tf.one_hot(labels, num_classes, dtype=e.dtype) * up

        return loss, grad

    return cross_entropy(logits)


def _weighted_ce(logits, labels, ignore_label: int, class_weights):
    """Per pixel: (cross-entropy x weight, weight, valid, label with ignored pixels as class 0)."""
    labels = tf.cast(labels, tf.int32)
    valid = tf.not_equal(labels, ignore_label)
    safe = tf.where(valid, labels, tf.zeros_like(labels))
    ce = softmax_cross_entropy(safe, tf.cast(logits, tf.float32))
    weight = tf.cast(valid, tf.float32)
    if class_weights is not None:
        weight = weight * tf.gather(tf.constant(np.asarray(class_weights, np.float32)), safe)
    return ce * weight, weight, valid, safe


def pixel_loss_sum(logits, labels, ignore_label: int, class_weights=None, top_k: float = 1.0):
    """Softmax cross-entropy summed over the pixels the loss counts, and its normalizer (module doc).

    Args:
      logits: float [b, h, w, C] (any float dtype; computed in float32).
      labels: integer [b, h, w]; `ignore_label` pixels never count.
      ignore_label: the label value to ignore.
      class_weights: None, or C non-negative per-class weights (a list or numpy array).
      top_k: in (0, 1]; the fraction of each image's valid pixels kept (1.0: all).
    Returns:
      (loss_sum, normalizer), float32 scalars; the normalizer is 0 when nothing counts, so divide
      with tf.math.divide_no_nan.
    """
    if not 0.0 < top_k <= 1.0:
        raise ValueError(f"top_k must be in (0, 1], got {top_k}")
    loss, weight, valid, _ = _weighted_ce(logits, labels, ignore_label, class_weights)
    if top_k >= 1.0:
        return tf.reduce_sum(loss), tf.reduce_sum(weight)

    batch = tf.shape(loss)[0]
    pixels = loss.shape[1] * loss.shape[2] if loss.shape[1] and loss.shape[2] else tf.shape(loss)[1] * tf.shape(loss)[2]
    loss = tf.reshape(loss, [batch, pixels])
    weight = tf.reshape(weight, [batch, pixels])
    valid = tf.reshape(valid, [batch, pixels])
    k = tf.cast(keep_counts(tf.reduce_sum(tf.cast(valid, tf.int32), axis=1), top_k), tf.float32)
    # A full per-image sort (the number kept differs by image), ignored pixels last (losses are >= 0).
    ranked, order = tf.math.top_k(tf.where(valid, loss, -tf.ones_like(loss)), k=pixels, sorted=True)
    keep = tf.cast(tf.range(pixels)[tf.newaxis, :], tf.float32) < k[:, tf.newaxis]
    keep = tf.cast(keep, tf.float32)
    loss_sum = tf.reduce_sum(ranked * keep)
    if class_weights is None:
        return loss_sum, tf.reduce_sum(k)
    return loss_sum, tf.reduce_sum(tf.gather(weight, order, batch_dims=1) * keep)


def pixel_cross_entropy_sum(logits, labels, ignore_label: int):
    """Softmax cross-entropy summed over the valid pixels, and the number of valid pixels.

    (sum, count) so the caller normalises by the step's GLOBAL count (module doc)."""
    return pixel_loss_sum(logits, labels, ignore_label)


def _flat(x, batch, pixels):
    return tf.reshape(x, tf.concat([[batch, pixels], tf.shape(x)[3:]], axis=0))


def cross_entropy_per_image(logits, labels, ignore_label: int, class_weights=None, top_k: float = 1.0,
                            ohem_threshold: float | None = None, ohem_min_kept: int = 0):
    """The cross-entropy term per image: (sums [b], normalizers [b]), as pixel_loss_sum defines them.

    Summed over the images, they are what pixel_loss_sum returns. `ohem_threshold`: each image keeps
    its valid pixels whose true-class probability is below it, and at least min(ohem_min_kept, valid)
    of lowest probability; normalizer: the count (or weight sum) of the kept pixels.
    """
    logits = tf.cast(logits, tf.float32)
    labels = tf.cast(labels, tf.int32)
    batch, pixels = tf.shape(labels)[0], tf.shape(labels)[1] * tf.shape(labels)[2]
    logits, labels = _flat(logits, batch, pixels), _flat(labels, batch, pixels)
    loss, weight, valid, safe = _weighted_ce(logits, labels, ignore_label, class_weights)
    if top_k >= 1.0 and ohem_threshold is None:
        return tf.reduce_sum(loss, axis=1), tf.reduce_sum(weight, axis=1)
    n_valid = tf.reduce_sum(tf.cast(valid, tf.int32), axis=1)
    position = tf.range(pixels)[tf.newaxis, :]
    if ohem_threshold is None:
        k = tf.cast(keep_counts(n_valid, top_k), tf.int32)
        _, order = tf.math.top_k(tf.where(valid, loss, -tf.ones_like(loss)), k=pixels, sorted=True)
        keep = position < k[:, tf.newaxis]
    else:
        prob = tf.gather(tf.nn.softmax(logits), safe, batch_dims=2)
        # Lowest true-class probability first, ignored pixels last (-p is in [-1, 0]).
        _, order = tf.math.top_k(tf.where(valid, -prob, -2.0 * tf.ones_like(prob)), k=pixels, sorted=True)
        kept_min = tf.minimum(n_valid, ohem_min_kept)[:, tf.newaxis]
        below = tf.gather(prob, order, batch_dims=1) < ohem_threshold
        keep = (position < n_valid[:, tf.newaxis]) & ((position < kept_min) | below)
    keep = tf.stop_gradient(tf.cast(keep, tf.float32))
    return (tf.reduce_sum(tf.gather(loss, order, batch_dims=1) * keep, axis=1),
            tf.reduce_sum(tf.gather(weight, order, batch_dims=1) * keep, axis=1))


def _probs_and_truth(logits, labels, ignore_label: int):
    """Softmax probabilities [b, P, C], one-hot truth [b, P, C] (zero rows at ignored pixels), valid [b, P]."""
    logits = tf.cast(logits, tf.float32)
    labels = tf.cast(labels, tf.int32)
    batch, pixels = tf.shape(labels)[0], tf.shape(labels)[1] * tf.shape(labels)[2]
    probs = tf.nn.softmax(_flat(logits, batch, pixels))
    labels = _flat(labels, batch, pixels)
    valid = tf.not_equal(labels, ignore_label)
    truth = tf.one_hot(tf.where(valid, labels, -1), tf.shape(probs)[-1], dtype=tf.float32)  # -1: all zeros
    return probs, truth, valid


def lovasz_softmax_per_image(logits, labels, ignore_label: int):
    """Lovász-softmax (Berman et al. 2018) of each image: [b].

    For each class c present in the image: the errors |1[y = c] - p_c| sorted decreasing, dotted with
    the discrete gradient of the Jaccard loss along that order; averaged over the present classes.
    Ignored pixels sort last as -1 and are multiplied by 0. 0 for an image with no valid pixel.
    """
    probs, truth, valid = _probs_and_truth(logits, labels, ignore_label)
    mask = tf.cast(valid, tf.float32)[..., tf.newaxis]
    errors = tf.where(valid[..., tf.newaxis], tf.abs(truth - probs), -1.0)
    errors, truth, mask = (tf.transpose(x, [0, 2, 1]) for x in (errors, truth, mask))  # [b, C, P]
    pixels = tf.shape(errors)[-1]
    ranked, order = tf.math.top_k(errors, k=pixels, sorted=True)
    fg = tf.gather(truth, order, batch_dims=2)
    kept = tf.gather(tf.broadcast_to(mask, tf.shape(errors)), order, batch_dims=2)
    total = tf.reduce_sum(fg, axis=-1, keepdims=True)
    intersection = total - tf.cumsum(fg, axis=-1)
    union = total + tf.cumsum(1.0 - fg, axis=-1)
    jaccard = 1.0 - intersection / union  # union >= 1 from the first pixel on
    grad = tf.concat([jaccard[..., :1], jaccard[..., 1:] - jaccard[..., :-1]], axis=-1)
    per_class = tf.reduce_sum(ranked * kept * tf.stop_gradient(grad), axis=-1)  # [b, C]
    present = tf.cast(total[..., 0] > 0, tf.float32)
    return tf.math.divide_no_nan(tf.reduce_sum(per_class * present, axis=-1), tf.reduce_sum(present, axis=-1))


DICE_SMOOTH = 1.0


def dice_per_image(logits, labels, ignore_label: int, smooth: float = DICE_SMOOTH):
    """Soft Dice loss of each image: [b], the mean over all C classes of 1 - (2 sum(p_c y_c) + smooth) /
    (sum(p_c) + sum(y_c) + smooth) over the valid pixels (`smooth`: a class absent from both costs ~0);
    0 for an image with no valid pixel."""
    probs, truth, valid = _probs_and_truth(logits, labels, ignore_label)
    mask = tf.cast(valid, tf.float32)[..., tf.newaxis]
    probs = probs * mask
    inter = tf.reduce_sum(probs * truth, axis=1)
    denom = tf.reduce_sum(probs, axis=1) + tf.reduce_sum(truth, axis=1)
    loss = tf.reduce_mean(1.0 - (2.0 * inter + smooth) / (denom + smooth), axis=-1)
    return tf.where(tf.reduce_any(valid, axis=1), loss, 0.0)


def objective_sum(logits, labels, ignore_label: int, class_weights=None, top_k: float = 1.0, terms=None,
                  ohem_threshold: float | None = None, ohem_min_kept: int = 0):
    """The configured loss as (sum, normalizer) for the train step (the module doc for the cross-entropy).

    `terms`: {type: weight} (LossConfig.term_weights; None: cross-entropy alone, pixel_loss_sum). Else,
    with n_i image i's cross-entropy normalizer (its valid pixel count without a cross_entropy term),
    the objective over all images of all towers is
        (w_ce * sum_i ce_sum_i + sum_t w_t * sum_i n_i L_t,i) / sum_i n_i
    """
    terms = terms or {"cross_entropy": 1.0}
    if set(terms) == {"cross_entropy"} and ohem_threshold is None:
        loss_sum, normalizer = pixel_loss_sum(logits, labels, ignore_label, class_weights, top_k)
        return loss_sum * terms["cross_entropy"] if terms["cross_entropy"] != 1.0 else loss_sum, normalizer
    if "cross_entropy" in terms:
        ce, n = cross_entropy_per_image(logits, labels, ignore_label, class_weights, top_k, ohem_threshold,
                                        ohem_min_kept)
        total = terms["cross_entropy"] * tf.reduce_sum(ce)
    else:
        n = tf.reduce_sum(tf.cast(tf.not_equal(tf.cast(labels, tf.int32), ignore_label), tf.float32), axis=[1, 2])
        total = tf.constant(0.0)
    n = tf.stop_gradient(n)
    per_image = {"lovasz": lovasz_softmax_per_image, "dice": dice_per_image}
    for name, w in terms.items():
        if name != "cross_entropy":
            total = total + w * tf.reduce_sum(n * per_image[name](logits, labels, ignore_label))
    return total, tf.reduce_sum(n)
