"""Layers every model family uses: the LayerNorm, the resize to another tensor's size, the Dense layer with
the transformers' truncated-normal initialisation, and the exact GELU with a written-out gradient."""

from __future__ import annotations

import math

import keras
import tensorflow as tf
from keras import layers

# tf.nn.gelu's constant (1 / sqrt(2), as it writes it), and the standard normal density's 1 / sqrt(2 pi).
_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@tf.custom_gradient
def _gelu(x):
    def grad(dy):
        # d/dx x Phi(x) = Phi(x) + x phi(x), Phi(x) = erfc(-x / sqrt 2) / 2, phi the standard normal density.
        c = lambda v: tf.cast(v, x.dtype)  # noqa: E731
        pdf = tf.exp(c(-0.5) * tf.square(x)) * c(_INV_SQRT_2PI)
        return dy * (c(0.5) * tf.math.erfc(-x * c(_SQRT_HALF)) + x * pdf)

    return 0.5 * x * tf.math.erfc(-x * tf.cast(_SQRT_HALF, x.dtype)), grad


@keras.saving.register_keras_serializable(package="seg_train")
def gelu(x):
    """The exact (erf) GELU, x Phi(x): the ops and the output of Keras' "gelu" (tf.nn.gelu(x, approximate=False):
    0.5 x erfc(-x / sqrt 2)), its gradient written out. TensorFlow differentiates that expression op by op: a
    dozen element-wise ops over the MLP's widest activation and four of its intermediates kept for the backward
    pass; the written-out gradient keeps x alone and recomputes erfc. The same values up to float round-off
    (tests/test_layers.py holds it to TensorFlow's autodiff and to the float64 derivative)."""
    return _gelu(x)


@keras.saving.register_keras_serializable(package="seg_train")
class LayerNorm(layers.LayerNormalization):
    """Keras' LayerNormalization over the last axis, its shift computed as beta - mean * inv.

    Keras' form converts to a TFLite NEG, which has no int8 kernel; a SUB has one. Same variables and
    function; moments in float32 for half-precision inputs, as Keras'.
    """

    def call(self, inputs):
        x = inputs
        if x.dtype in (tf.float16, tf.bfloat16):
            x = tf.cast(x, tf.float32)
        mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
        inv = tf.math.rsqrt(variance + self.epsilon) * tf.cast(self.gamma, x.dtype)
        return tf.cast(x * inv + (tf.cast(self.beta, x.dtype) - mean * inv), self.compute_dtype)



class ResizeLike(layers.Layer):
    """Bilinear resize of x to the spatial size of `ref`.

    Not UpSampling2D, which fails on unknown spatial sizes in graph mode.
    """

    def call(self, x, ref):
        size = tf.shape(ref)[1:3]
        return tf.cast(tf.image.resize(x, size, method="bilinear"), x.dtype)

    def compute_output_shape(self, x_shape, ref_shape):
        return (x_shape[0], ref_shape[1], ref_shape[2], x_shape[3])


def dense(units: int, name: str, use_bias: bool = True, activation=None) -> layers.Dense:
    """A Dense layer initialised as the transformers (MiT, DINO, EoMT) are: kernel ~ N(0, 0.02) truncated, bias 0.
    (Keras' Glorot default is several times wider, which matters when training from scratch.) A new initializer
    per layer: a shared one would repeat its values. `activation` "gelu" is the exact GELU (`gelu`)."""
    activation = gelu if activation == "gelu" else activation
    return layers.Dense(units, use_bias=use_bias, activation=activation, name=name,
                        kernel_initializer=keras.initializers.TruncatedNormal(stddev=0.02))
