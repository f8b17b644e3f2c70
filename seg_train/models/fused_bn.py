"""BatchNormalization as TensorFlow's fused kernel, with Keras' semantics.

Keras 3's BatchNormalization on TensorFlow runs as many small unfused ops, a large share of the step
(docs/PERFORMANCE.md); FusedBatchNormV3 does the same much faster (docs/BATCHNORM.md).

A subclass with the same variables and maths (biased batch variance, Keras' moving-average update),
so checkpoints and isinstance checks hold; only floating-point order differs. Anything the fused op
cannot do (synchronized, masks, renorm, no scale/center, other axes) falls back to Keras' call.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers


@keras.saving.register_keras_serializable(package="seg_train")
class FusedBatchNormalization(layers.BatchNormalization):
    """keras.layers.BatchNormalization run as FusedBatchNormV3 where that is exact (module doc)."""

    def _fusable(self, inputs, mask) -> bool:
        rank = inputs.shape.rank
        return (mask is None and rank == 4 and self.axis in (-1, 3) and not self.synchronized
                and not self.renorm and self.scale and self.center
                and inputs.dtype in (tf.float32, tf.bfloat16, tf.float16))

    def call(self, inputs, training=None, mask=None):
        if not self._fusable(inputs, mask):
            return super().call(inputs, training=training, mask=mask)
        gamma = tf.cast(self.gamma.value, tf.float32)
        beta = tf.cast(self.beta.value, tf.float32)
        if training and self.trainable:
            y, mean, var = tf.compat.v1.nn.fused_batch_norm(inputs, gamma, beta, epsilon=self.epsilon,
                                                            data_format="NHWC", is_training=True)
            # The fused op's variance is Bessel-corrected: undo it (a Python number when static, so
            # fewer graph ops).
            dims = inputs.shape[:3].as_list()
            if None in dims:
                shape = tf.shape(inputs)
                n = tf.cast(shape[0] * shape[1] * shape[2], tf.float32)
                var = var * ((n - 1.0) / tf.maximum(n, 1.0))
            else:
                n = dims[0] * dims[1] * dims[2]
                var = var * ((n - 1.0) / max(n, 1.0))
            m = self.momentum
            self.moving_mean.assign(self.moving_mean * m + tf.stop_gradient(mean) * (1.0 - m))
            self.moving_variance.assign(self.moving_variance * m + tf.stop_gradient(var) * (1.0 - m))
        elif training:
            # A frozen layer in a training pass: the inference affine map as element-wise ops, since
            # the fused inference op's gradient has no deterministic GPU kernel.
            scale = gamma * tf.math.rsqrt(tf.cast(self.moving_variance.value, tf.float32) + self.epsilon)
            offset = beta - tf.cast(self.moving_mean.value, tf.float32) * scale
            y = tf.cast(inputs, tf.float32) * scale + offset
        else:
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(inputs, gamma, beta,
                                                       mean=tf.cast(self.moving_mean.value, tf.float32),
                                                       variance=tf.cast(self.moving_variance.value, tf.float32),
                                                       epsilon=self.epsilon, data_format="NHWC", is_training=False)
        return tf.cast(y, self.compute_dtype)
