"""BatchNormalization as TensorFlow's fused kernel, with Keras' semantics.

Written by hand because Keras 3's BatchNormalization on TensorFlow is not fused: it runs as
Mean / SquaredDifference / Sub / Mul / Tile / RealDiv ops and their gradients, about a quarter of the
op time of the benchmark model's step (docs/PERFORMANCE.md). `tf.compat.v1.nn.fused_batch_norm`
(FusedBatchNormV3, oneDNN on CPUs, cuDNN on GPUs) does the same forward and backward in a fraction
of the time (docs/BATCHNORM.md, "The BN kernel").

Same variables, same maths as keras.layers.BatchNormalization (its subclass, so every isinstance
check, checkpoint and weight file still holds):
- training: normalise with the batch mean and the BIASED batch variance; moving statistics
  <- momentum * moving + (1 - momentum) * batch statistics, the variance biased as Keras uses it
  (the fused op returns the Bessel-corrected one, which is undone here);
- inference: the moving statistics.
Only the order of floating-point operations differs (agreement to ~1e-5, tests/test_fused_bn.py).
Anything the fused op cannot do falls back to Keras' own call: synchronized BN (the statistics
all-reduced across towers), masks, renorm, no scale/center, an axis other than the last of a 4-D
input.
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
            # The fused op's variance is Bessel-corrected: undo it. A Python number when the shape is
            # static (always in a traced train step): a few graph ops less per layer, which the
            # graph optimisation of every tower pays for.
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
            # A frozen layer (trainable = False: model.freeze_batchnorm) in a training pass: the same
            # affine map as inference, as plain element-wise ops. The fused inference op's gradient
            # (FusedBatchNormGradV3 with is_training=false) has no deterministic GPU kernel, so
            # train.deterministic could not run on a GPU with frozen BN layers.
            scale = gamma * tf.math.rsqrt(tf.cast(self.moving_variance.value, tf.float32) + self.epsilon)
            offset = beta - tf.cast(self.moving_mean.value, tf.float32) * scale
            y = tf.cast(inputs, tf.float32) * scale + offset
        else:
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(inputs, gamma, beta,
                                                       mean=tf.cast(self.moving_mean.value, tf.float32),
                                                       variance=tf.cast(self.moving_variance.value, tf.float32),
                                                       epsilon=self.epsilon, data_format="NHWC", is_training=False)
        return tf.cast(y, self.compute_dtype)
