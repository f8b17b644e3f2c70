"""Synchronized BatchNormalization: one all-reduce per layer forward, one backward, gradient written out.

Not Keras 3's `BatchNormalization(synchronized=True)`: its all-reduces go through a
`tf.custom_gradient` wrapper that walks every tower's graph backwards at trace time, so tracing a
multi-tower step takes impractically long (see collectives.py).

In training mode across several towers:
- forward: each tower's per-channel (count n_i, mean m_i, centred M2_i) travel in ONE all-reduce
  (each in its own slot) and are combined as Chan et al.'s parallel variance:
      n = sum n_i,   mean = sum n_i m_i / n,   M2 = sum M2_i + sum n_i (m_i - mean)^2,
  which keeps float32 accuracy when a channel's mean is far larger than its spread, where
  E[x^2] - E[x]^2 loses most of its digits (docs/BATCHNORM.md);
- backward: dx = gamma / sqrt(var + eps) * (dy - sum_g(dy) / n - xhat * sum_g(dy * xhat) / n), the
  sums over ALL towers' pixels in one all-reduce; gamma's and beta's gradients are this tower's own.
The global moments are computed outside the custom gradient, so its graph walk stays in this layer.

On one tower the same code runs without the all-reduces. Inference runs the fused kernel
(models/fused_bn.py); masks and frozen layers use Keras' own path.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from seg_train.models.fused_bn import FusedBatchNormalization
from seg_train.parallel import collectives


@keras.saving.register_keras_serializable(package="seg_train")
class SyncBatchNormalization(FusedBatchNormalization):
    """keras.layers.BatchNormalization(synchronized=True) with one all-reduce per layer (module doc).

    Same variables as keras' BatchNormalization; inference runs the fused kernel.
    """

    def __init__(self, *args, **kwargs):
        kwargs["synchronized"] = False  # the synchronisation is ours; Keras' own path stays local
        super().__init__(*args, **kwargs)

    def get_config(self):
        return {**super().get_config(), "synchronized": True}

    def call(self, inputs, training=None, mask=None):
        rank = inputs.shape.rank
        if not (training and self.trainable) or mask is not None or rank != 4 or self.axis not in (-1, 3) \
                or self.renorm or not (self.scale and self.center):
            return super().call(inputs, training=training, mask=mask)
        x = tf.cast(inputs, tf.float32)
        mean, var, n = _global_moments(x)
        gamma = tf.cast(tf.convert_to_tensor(self.gamma), tf.float32)
        beta = tf.cast(tf.convert_to_tensor(self.beta), tf.float32)
        y = _normalize(x, gamma, beta, tf.stop_gradient(mean), tf.stop_gradient(var), n, self.epsilon)
        m = self.momentum
        self.moving_mean.assign(self.moving_mean * m + tf.stop_gradient(mean) * (1.0 - m))
        self.moving_variance.assign(self.moving_variance * m + tf.stop_gradient(var) * (1.0 - m))
        return tf.cast(y, self.compute_dtype)


def _global_moments(x):
    """The per-channel mean and biased variance of `x` over the pixels of all towers, and their count.

    Chan's combination of each tower's moments, gathered in one all-reduce (module doc).
    """
    dims = x.shape[:3].as_list()
    if None in dims:
        count = tf.cast(tf.reduce_prod(tf.shape(x)[:3]), tf.float32)
    else:
        count = tf.constant(float(dims[0] * dims[1] * dims[2]))
    local_mean = tf.reduce_sum(x, [0, 1, 2]) / tf.maximum(count, 1.0)
    local_m2 = tf.reduce_sum(tf.square(x - local_mean), [0, 1, 2])
    towers = collectives.num_replicas()
    if towers == 1:
        return local_mean, local_m2 / tf.maximum(count, 1.0), tf.maximum(count, 1.0)
    c = x.shape[-1]
    row = tf.concat([tf.reshape(count, [1]), local_mean, local_m2], axis=0)
    (gathered,) = collectives.all_reduce_sum([collectives.one_hot_row(row, collectives.replica_id(), towers)])
    table = tf.reshape(gathered, [towers, 2 * c + 1])
    counts, means, m2s = table[:, :1], table[:, 1:c + 1], table[:, c + 1:]
    n = tf.maximum(tf.reduce_sum(counts), 1.0)
    mean = tf.reduce_sum(counts * means, axis=0) / n
    m2 = tf.reduce_sum(m2s, axis=0) + tf.reduce_sum(counts * tf.square(means - mean), axis=0)
    return mean, m2 / n, n


def _normalize(x, gamma, beta, mean, var, n, epsilon):
    """y = gamma * (x - mean) / sqrt(var + eps) + beta with the cross-tower gradient of module doc."""

    @tf.custom_gradient
    def f(x, gamma, beta):
        inv = tf.math.rsqrt(var + epsilon)
        xhat = (x - mean) * inv
        y = xhat * gamma + beta

        def grad(dy):
            dbeta = tf.reduce_sum(dy, [0, 1, 2])
            dgamma = tf.reduce_sum(dy * xhat, [0, 1, 2])
            sums = tf.concat([dbeta, dgamma], axis=0)
            (sums,) = collectives.all_reduce_sum([sums])
            c = x.shape[-1]
            g_sum, gx_sum = sums[:c], sums[c:]
            dx = (gamma * inv) * (dy - g_sum / n - xhat * (gx_sum / n))
            return dx, dgamma, dbeta

        return y, grad

    return f(x, gamma, beta)
