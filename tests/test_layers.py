"""models/layers.py's exact GELU and LayerNorm, their gradients written out: the GELU held to Keras' own "gelu"
activation (the forward, op for op), to TensorFlow's autodiff of it and to the float64 derivative
x Phi(x) -> Phi(x) + x phi(x) computed with math.erfc by hand; the LayerNorm to Keras' LayerNormalization (forward and
TensorFlow's autodiff of it) and to the float64 layer norm and its gradient by hand; in half precision to Keras'
within its round-off.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.models.layers import LayerNorm, dense, gelu


def _points(dtype="float32"):
    """Both tails (the gradient's erfc and density underflow there), the kink region, and random values."""
    rng = np.random.default_rng(0)
    grid = np.concatenate([np.linspace(-12.0, 12.0, 481), rng.normal(0.0, 3.0, 2000)])
    return grid.astype(dtype)


def _float64_reference(x):
    """x Phi(x) and Phi(x) + x phi(x) in float64 (Phi(x) = erfc(-x / sqrt 2) / 2)."""
    x = x.astype(np.float64)
    phi_cdf = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in x])
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return x * phi_cdf, phi_cdf + x * pdf


def _value_and_grad(fn, x, dy):
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    return y.numpy(), tape.gradient(y, x, output_gradients=tf.constant(dy)).numpy()


def test_gelu_is_keras_gelu_and_its_gradient_the_derivative():
    """The forward is Keras' exact GELU bit for bit (the same ops), the gradient TensorFlow's autodiff of it within
    float32 round-off and the float64 derivative within float32 round-off too, in both tails and around 0. Fails
    for: the tanh approximation, a gradient without the x phi(x) term, phi without its 1 / sqrt(2 pi), the
    density's exponent -x^2 instead of -x^2 / 2, the upstream gradient not multiplied in."""
    x = _points()
    dy = np.random.default_rng(1).normal(0.0, 1.0, x.shape).astype("float32")
    ours = _value_and_grad(gelu, x, dy)
    keras_y, keras_dx = _value_and_grad(lambda t: keras.activations.gelu(t, approximate=False), x, dy)
    np.testing.assert_array_equal(ours[0], keras_y)
    scale = np.max(np.abs(keras_dx))
    assert np.max(np.abs(ours[1] - keras_dx)) < 2e-7 * scale
    ref_y, ref_d = _float64_reference(x)
    assert np.max(np.abs(ours[0] - ref_y)) < 2e-7 * np.max(np.abs(ref_y))
    assert np.max(np.abs(ours[1] - ref_d * dy)) < 2e-7 * scale


@pytest.mark.parametrize("dtype, tol", [("float16", 2e-3), ("bfloat16", 1.6e-2)])
def test_gelu_in_half_precision_is_keras(dtype, tol):
    """Under mixed precision the MLP's activation comes in half precision: the output and gradient stay in that
    dtype and within its round-off of Keras' GELU and TensorFlow's autodiff in the same dtype. Fails for: a
    constant that turns the computation into float32 (a dtype error) or float64."""
    x = tf.cast(_points("float32")[::8], dtype)
    dy = tf.cast(np.random.default_rng(2).normal(0.0, 1.0, x.shape), dtype)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        ours, theirs = gelu(x), keras.activations.gelu(x, approximate=False)
    assert ours.dtype == x.dtype
    d_ours, d_theirs = (tape.gradient(y, x, output_gradients=dy) for y in (ours, theirs))
    assert d_ours.dtype == x.dtype
    for a, b in ((ours, theirs), (d_ours, d_theirs)):
        a, b = (np.asarray(tf.cast(t, tf.float32)) for t in (a, b))
        assert np.max(np.abs(a - b)) <= tol * np.max(np.abs(b)), np.max(np.abs(a - b)) / np.max(np.abs(b))


def test_dense_gelu_takes_the_written_gradient_and_saves():
    """`dense(..., activation="gelu")` (the DINO MLPs, EoMT's mask MLP) uses `gelu`, and the layer's config
    round-trips through Keras' serialisation to the same function. Fails for: the string handed to Keras (its
    autodiffed GELU), the function not registered (a saved model that cannot be loaded)."""
    layer = dense(4, "mlp", activation="gelu")
    assert layer.activation is gelu
    again = keras.layers.Dense.from_config(layer.get_config())
    assert again.activation is gelu
    assert dense(4, "other", activation="silu").activation is keras.activations.silu


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
