"""Layers every model family uses: the LayerNorm (its gradient written out), the exact GELU (its intermediates
recomputed in the backward pass), the resize to another tensor's size, and the Dense layer with the transformers'
truncated-normal initialisation."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import layers

from seg_train.models.recompute import after


@keras.saving.register_keras_serializable(package="seg_train")
def gelu(x):
    """Keras' exact GELU ("gelu": 0.5 x erfc(-x / sqrt 2) in TensorFlow), the same ops forward and backward, but the
    backward pass keeps x alone and runs the forward's three cheap ops again from it.

    TensorFlow's autodiff keeps three intermediates of the MLP's widest tensor (0.5 x, the erfc and its argument)
    where x is enough: 12 of the 31 floats per token and channel a ViT block kept for its backward pass
    (docs/SCALING.md section 9). Run again (recompute.after: not before the gradient arrives, never merged with
    the forward) and differentiated by the same autodiff, the gradient is the same ops' (tests/test_layers.py:
    to the bit in float16; in float32 Grappler's rewrites of the two graphs may round an ulp apart).
    """

    @tf.custom_gradient
    def run(x):
        def grad(dy):
            again = after(x, dy)
            with tf.GradientTape() as tape:
                tape.watch(again)
                y = keras.activations.gelu(again, approximate=False)
            return tape.gradient(y, again, output_gradients=dy)

        return keras.activations.gelu(x, approximate=False), grad

    return run(x)


@keras.saving.register_keras_serializable(package="seg_train")
class LayerNorm(layers.LayerNormalization):
    """Keras' LayerNormalization over the last axis, its shift computed as beta - mean * inv.

    Keras' form converts to a TFLite NEG, which has no int8 kernel; a SUB has one. Same variables and
    function; moments in float32 for half-precision inputs, as Keras'; the gradient written out (`_layer_norm`).
    """

    def call(self, inputs):
        x = inputs
        if x.dtype in (tf.float16, tf.bfloat16):
            x = tf.cast(x, tf.float32)
        y = _layer_norm(x, tf.cast(self.gamma, x.dtype), tf.cast(self.beta, x.dtype), self.epsilon)
        return tf.cast(y, self.compute_dtype)


def _layer_norm(x, gamma, beta, epsilon: float):
    """LayerNorm's forward with its gradient written out, the textbook dx = rstd (g - mean(g) - xhat mean(g xhat)),
    g = dy gamma, xhat = (x - mean) rstd: TensorFlow's autodiff of the moments, the rsqrt and the two products runs
    more ops over the whole [.., C] tensor (the broadcasts' reductions, the squared difference's gradient) and
    keeps more of them. The same values up to float round-off (tests/test_layers.py)."""

    @tf.custom_gradient
    def run(x, gamma, beta):
        mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
        rstd = tf.math.rsqrt(variance + epsilon)
        inv = rstd * gamma

        def grad(dy):
            xhat = (x - mean) * rstd
            rows = list(range(x.shape.rank - 1))
            g = dy * gamma
            dx = rstd * (g - tf.reduce_mean(g, -1, keepdims=True) - xhat * tf.reduce_mean(g * xhat, -1, keepdims=True))
            return dx, tf.reduce_sum(dy * xhat, rows), tf.reduce_sum(dy, rows)

        return x * inv + (beta - mean * inv), grad

    return run(x, gamma, beta)



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
