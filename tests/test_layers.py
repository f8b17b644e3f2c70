"""models/layers.py's LayerNorm, its gradient written out, held to Keras' LayerNormalization (forward and
TensorFlow's autodiff of it) and to the float64 layer norm and its gradient by hand; in half precision to Keras'
within its round-off. Its exact GELU, held to Keras' GELU, TensorFlow's autodiff of it and the float64 derivative,
and to the memory it keeps for the backward pass.
"""


import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.models.layers import LayerNorm, gelu
from tests.helpers import CPU_DEVICES


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


# ---- the exact GELU ----------------------------------------------------------------------------------------
def _gelu_and_grad(fn, x, upstream):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    return y, tape.gradient(y, x, output_gradients=upstream)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("float16", 0.0)])
def test_gelu_is_keras_and_its_gradient_autodiffs_and_the_float64_one(dtype, tol):
    """Forward: Keras' exact GELU traced alone, to the bit (Grappler optimises a forward whose intermediates no
    backward reads alike; with autodiff attached, float16 tails round apart). Backward: TensorFlow's autodiff of
    Keras' GELU (the same ops run again from x; in float32 Grappler's rewrites of the two graphs may round an ulp
    apart) and the float64 derivative Phi(x) + x phi(x). Fails for a gradient that misses the upstream, or one of
    the approximate (tanh) GELU."""
    rng = np.random.default_rng(4)
    x = tf.constant(rng.normal(0, 3, (16, 96)).astype(dtype))
    upstream = tf.constant(rng.normal(0, 1, (16, 96)).astype(dtype))
    keras_gelu = lambda v: keras.activations.gelu(v, approximate=False)  # noqa: E731
    ours = tf.function(lambda x: _gelu_and_grad(gelu, x, upstream))(x)
    autodiff = tf.function(lambda x: _gelu_and_grad(keras_gelu, x, upstream))(x)
    np.testing.assert_array_equal(ours[0].numpy(), tf.function(keras_gelu)(x).numpy())
    np.testing.assert_allclose(ours[1].numpy(), autodiff[1].numpy(), rtol=tol, atol=tol)
    x64, up64 = x.numpy().astype(np.float64), upstream.numpy().astype(np.float64)
    derivative = 0.5 * (1.0 + np.vectorize(math.erf)(x64 / math.sqrt(2.0))) + x64 * np.exp(-0.5 * x64 ** 2) / math.sqrt(
        2.0 * math.pi)
    bound = 1e-5 if dtype == "float32" else 4e-3
    np.testing.assert_allclose(ours[1].numpy(), up64 * derivative, rtol=bound, atol=bound)


def test_gelu_backward_keeps_its_input_alone():
    """The allocator's peak over a forward + backward of four GELUs in a row on [4096, 1536] (the tests' CPU
    allocator keeps statistics, conftest.py), against Keras' GELU differentiated by TensorFlow, in units of one
    such tensor: autodiff keeps three float32 intermediates per GELU besides its input (seen: 15.3 against 8.0).
    Fails if the intermediates are stored again (autodiff through the forward) or the recomputation merges with
    the forward's ops."""
    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(0, 1, (4096, 1536)).astype("float32"))
    size = x.shape.num_elements() * 4
    device = CPU_DEVICES[0].replace("/device:", "")

    def peak(fn):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = x
                for i in range(4):
                    y = fn(y) * (1.0 + 0.1 * i)
                loss = tf.reduce_sum(y)
            return tape.gradient(loss, x)

        step(x)  # traced and run once: later allocations are the step's own
        tf.config.experimental.reset_memory_stats(device)
        before = tf.config.experimental.get_memory_info(device)["current"]
        step(x)
        return (tf.config.experimental.get_memory_info(device)["peak"] - before) / size

    ours, autodiff = peak(gelu), peak(lambda v: keras.activations.gelu(v, approximate=False))
    assert autodiff - ours >= 4.5, (ours, autodiff)
