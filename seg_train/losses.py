"""Loss pieces as pure functions; the cross-tower scaling is done by the train step, not here."""

from __future__ import annotations

import tensorflow as tf


def pixel_cross_entropy_sum(logits, labels, ignore_label: int):
    """Softmax cross-entropy summed over the valid pixels, and the number of valid pixels.

    Returning (sum, count) rather than a mean lets the caller normalise by the GLOBAL valid-pixel
    count of the step: a per-tower mean would give towers with many ignored pixels more weight.

    Args:
      logits: float [b, h, w, C].
      labels: integer [b, h, w]; `ignore_label` pixels contribute nothing.
    Returns:
      (float32 scalar sum, float32 scalar count).
    """
    labels = tf.cast(labels, tf.int32)
    valid = tf.not_equal(labels, ignore_label)
    safe = tf.where(valid, labels, tf.zeros_like(labels))
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=safe, logits=tf.cast(logits, tf.float32))
    mask = tf.cast(valid, tf.float32)
    return tf.reduce_sum(ce * mask), tf.reduce_sum(mask)


def decay_variables(model) -> list:
    """Conv and dense kernels (depthwise/pointwise included): what weight decay applies to."""
    names = ("kernel", "depthwise_kernel", "pointwise_kernel")
    return [v for v in model.trainable_variables if v.name in names]


def weight_decay(variables, coefficient: float):
    """coefficient * sum(l2_loss(kernel)) with l2_loss(x) = sum(x**2) / 2."""
    if not variables or coefficient == 0:
        return tf.constant(0.0, tf.float32)
    return coefficient * tf.add_n([tf.nn.l2_loss(tf.cast(v, tf.float32)) for v in variables])
