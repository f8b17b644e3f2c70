"""AtrousConv2D (models/atrous.py) must equal Keras' Conv2D exactly: outputs and both gradients."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.models import atrous
from seg_train.models.atrous import AtrousConv2D


def _pair(rate, filters=5, use_bias=False):
    ref = keras.layers.Conv2D(filters, 3, padding="same", dilation_rate=rate, use_bias=use_bias)
    new = AtrousConv2D(filters, 3, padding="same", dilation_rate=rate, use_bias=use_bias)
    ref.build((None, None, None, 4))
    new.build((None, None, None, 4))
    rng = np.random.default_rng(0)
    new.set_weights([rng.normal(size=w.shape).astype("float32") for w in ref.get_weights()])
    ref.set_weights(new.get_weights())
    return ref, new


def _grads(layer, x):
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(y * y)
    gx, *gw = tape.gradient(loss, [x, *layer.trainable_variables])
    return y, gx, gw


@pytest.mark.parametrize("shape,rate", [
    ((2, 8, 8, 4), 6),     # all taps live: the native dilated conv
    ((2, 8, 8, 4), 12),    # rate >= both sides: a 1x1 conv
    ((2, 11, 15, 4), 12),  # rate >= height only: a 1x3 conv at rate 12
    ((2, 15, 11, 4), 12),  # rate >= width only
    ((1, 7, 9, 4), (2, 9)),  # different rates per axis
])
@pytest.mark.parametrize("traced", [False, True])
def test_equals_keras_conv2d(shape, rate, traced):
    ref, new = _pair(rate, use_bias=True)
    x = np.random.default_rng(1).normal(size=shape).astype("float32")
    f_ref, f_new = (tf.function(lambda v, layer=layer: _grads(layer, v)) if traced
                    else (lambda v, layer=layer: _grads(layer, v))
                    for layer in (ref, new))
    for a, b in zip(tf.nest.flatten(f_ref(x)), tf.nest.flatten(f_new(x))):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-4)


def test_unknown_spatial_size_keeps_every_tap():
    ref, new = _pair(12)
    f = tf.function(lambda v: new(v), input_signature=[tf.TensorSpec([None, None, None, 4])])
    x = np.random.default_rng(2).normal(size=(1, 20, 6, 4)).astype("float32")
    np.testing.assert_allclose(f(x).numpy(), ref(x).numpy(), rtol=1e-4, atol=1e-4)


def test_live_taps():
    assert atrous.live_taps(8, 3, 12) == slice(1, 2)
    assert atrous.live_taps(12, 3, 12) == slice(1, 2)   # rows i-12 and i+12 never inside 0..11
    assert atrous.live_taps(13, 3, 12) == slice(0, 3)   # row 12 reads row 0
    assert atrous.live_taps(None, 3, 12) == slice(0, 3)
    assert atrous.live_taps(4, 1, 12) == slice(0, 1)


def test_mixed_bfloat16_runs_in_bfloat16():
    new = AtrousConv2D(3, 3, padding="same", dilation_rate=12, dtype="mixed_bfloat16")
    y = new(tf.ones([1, 8, 8, 2]))
    assert y.dtype == tf.bfloat16 and new.kernel.dtype == tf.float32


def test_fallback_without_native_dilation(monkeypatch):
    """TensorFlow's plain CPU kernels have no dilated filter gradient: the Keras path must be kept."""
    monkeypatch.setattr(atrous, "native_dilation_supported", lambda *dtype: False)
    ref, new = _pair(6)
    x = np.random.default_rng(3).normal(size=(2, 8, 8, 4)).astype("float32")
    graph = tf.function(lambda v: new(v)).get_concrete_function(tf.TensorSpec(x.shape)).graph
    assert any(op.type == "SpaceToBatchND" for op in graph.get_operations())
    for a, b in zip(tf.nest.flatten(_grads(ref, x)), tf.nest.flatten(_grads(new, x))):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backbone", ["tiny", "resnet50"])
def test_model_fast_atrous_is_exact(backbone):
    """The whole DeepLabV3+ with model.fast_atrous true and false: same weights, same logits."""
    from seg_train import models
    from seg_train.config import ModelConfig

    def build(fast):
        return models.build(ModelConfig(backbone=backbone, fast_atrous=fast, aspp_channels=8, decoder_channels=8,
                                        low_level_channels=4), 3, seed=0)

    fast, plain = build(True), build(False)
    kinds = lambda m: {type(layer).__name__ for layer in m._flatten_layers()}  # noqa: E731
    assert "AtrousConv2D" in kinds(fast) and "AtrousConv2D" not in kinds(plain)
    plain.set_weights(fast.get_weights())
    x = np.random.default_rng(4).normal(size=(1, 64, 96, 3)).astype("float32")  # ASPP map 4x6: rates 6+ drop taps
    np.testing.assert_allclose(fast(x, training=False).numpy(), plain(x, training=False).numpy(), rtol=1e-3, atol=1e-3)


def test_float16_dilated_conv_and_its_gradients_run_and_match_float32():
    """mixed_float16 on a CPU: oneDNN takes no float16 here and TensorFlow's plain kernels refuse a
    dilated input gradient, which crashed the first train step of the demo with
    `train.precision: mixed_float16`. The float16 layer must run forward and backward (traced, as
    in a train step) and agree with Keras' float32 Conv2D to float16 precision."""
    ref, _ = _pair(2)
    new = AtrousConv2D(5, 3, padding="same", dilation_rate=2, use_bias=False, dtype="float16")
    new.build((None, None, None, 4))
    new.set_weights([w.astype("float16") for w in ref.get_weights()])
    x = np.random.default_rng(1).normal(size=(2, 9, 10, 4)).astype("float32")
    y_ref, gx_ref, gw_ref = _grads(ref, x)
    y, gx, gw = tf.function(lambda v: _grads(new, v))(tf.constant(x, tf.float16))
    for a, b in [(y, y_ref), (gx, gx_ref), (gw[0], gw_ref[0])]:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 2e-3 * np.linalg.norm(b)
