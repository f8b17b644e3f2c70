"""models/layers.py's LayerNorm, its gradient written out, held to Keras' LayerNormalization (forward and
TensorFlow's autodiff of it) and to the float64 layer norm and its gradient by hand; in half precision to Keras'
within its round-off.
"""


import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.models.layers import LayerNorm


def _norm_pair(shape, epsilon=1e-5, seed=3):
    """seg-train's LayerNorm and Keras' LayerNormalization with the same random gamma and beta."""
    rng = np.random.default_rng(seed)
    ours, keras_norm = LayerNorm(epsilon=epsilon), keras.layers.LayerNormalization(epsilon=epsilon)
    for layer in (ours, keras_norm):
        layer.build(shape)
    gamma, beta = rng.normal(1.0, 0.5, shape[-1:]), rng.normal(0.0, 0.5, shape[-1:])
    for layer in (ours, keras_norm):
        layer.gamma.assign(gamma.astype("float32"))
        layer.beta.assign(beta.astype("float32"))
    return ours, keras_norm, gamma, beta


def _norm_grads(layer, x, dy):
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
    return [np.asarray(t) for t in [y] + tape.gradient(y, [x, layer.gamma, layer.beta], output_gradients=dy)]


def _float64_norm(x, gamma, beta, dy, epsilon):
    """The layer norm over the last axis and its gradients (x, gamma, beta) in float64, by hand."""
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + epsilon)
    xhat = (x - mean) * rstd
    g = dy * gamma
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    rows = tuple(range(x.ndim - 1))
    return [xhat * gamma + beta, dx, (dy * xhat).sum(rows), dy.sum(rows)]


@pytest.mark.parametrize("shape", [(2, 37, 48), (2, 5, 6, 40)])
def test_layer_norm_is_keras_and_its_gradient_the_float64_one(shape):
    """Output and the gradients with respect to the input, gamma and beta: Keras' LayerNormalization and
    TensorFlow's autodiff of it, and the float64 ones by hand, within float32 round-off; rows whose mean is several
    times their spread (the residual stream's), a token map and a feature map. Fails for: the mean(g) or the
    xhat mean(g xhat) term left out, xhat without its 1 / std, dx without the final rstd, gamma's gradient without
    xhat or beta's summed over the channels instead of the rows."""
    rng = np.random.default_rng(4)
    x = (rng.normal(0.0, 1.0, shape) * rng.lognormal(0.0, 1.0, shape[-1]) + rng.normal(0.0, 4.0, shape[:-1] + (1,)))
    x = x.astype("float32")
    dy = rng.normal(0.0, 1.0, shape).astype("float32")
    ours, keras_norm, gamma, beta = _norm_pair(shape)
    got, theirs = _norm_grads(ours, x, dy), _norm_grads(keras_norm, x, dy)
    exact = _float64_norm(x, gamma, beta, dy, 1e-5)
    for name, a, b, c in zip(["y", "dx", "dgamma", "dbeta"], got, theirs, exact):
        scale = np.max(np.abs(c))
        assert np.max(np.abs(a - b)) < 2e-6 * scale, (name, np.max(np.abs(a - b)) / scale)
        assert np.max(np.abs(a - c)) < 2e-6 * scale, (name, np.max(np.abs(a - c)) / scale)


def test_layer_norm_in_half_precision_keeps_float32_moments():
    """Under mixed_float16 the input comes in float16: the output is float16 and the gradients (input: float16,
    gamma and beta: float32) within float16 round-off of Keras' LayerNormalization under the same policy. Fails
    for: the gradient computed in float16 against float32 moments (a dtype error), the output left in float32."""
    shape = (2, 11, 32)
    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(0.0, 2.0, shape).astype("float16"))
    dy = tf.constant(rng.normal(0.0, 1.0, shape).astype("float16"))
    try:
        keras.mixed_precision.set_global_policy("mixed_float16")
        ours, keras_norm, _, _ = _norm_pair(shape)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    got, theirs = _norm_grads(ours, x, dy), _norm_grads(keras_norm, x, dy)
    assert got[0].dtype == np.float16 and got[1].dtype == np.float16
    for name, a, b in zip(["y", "dx", "dgamma", "dbeta"], got, theirs):
        a, b = a.astype(np.float64), b.astype(np.float64)
        assert np.max(np.abs(a - b)) <= 4e-3 * np.max(np.abs(b)), (name, np.max(np.abs(a - b)) / np.max(np.abs(b)))
