"""FusedBatchNormalization (models/fused_bn.py) must behave as keras.layers.BatchNormalization."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.models.fused_bn import FusedBatchNormalization


def _pair(dtype="float32", **kw):
    ref = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-3, dtype=dtype, **kw)
    new = FusedBatchNormalization(momentum=0.9, epsilon=1e-3, dtype=dtype, **kw)
    for layer in (ref, new):
        layer.build((None, None, None, 6))
    rng = np.random.default_rng(0)
    weights = [rng.uniform(0.5, 1.5, size=w.shape).astype("float32") for w in ref.get_weights()]
    ref.set_weights(weights)
    new.set_weights(weights)
    return ref, new


def _run(layer, x, training):
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=training)
        loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.reshape(tf.range(6, dtype=tf.float32), [1, 1, 1, 6]))
        loss += tf.reduce_sum(tf.square(tf.cast(y, tf.float32)))
    grads = tape.gradient(loss, [x, layer.gamma, layer.beta])
    return [y, *grads, layer.moving_mean.value, layer.moving_variance.value]


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("traced", [False, True])
def test_equals_keras_batchnorm(training, traced):
    ref, new = _pair()
    x = (np.random.default_rng(1).normal(size=(3, 5, 7, 6)) * 3 + 2).astype("float32")
    for _ in range(2):  # twice: the second call sees moving statistics the first one moved
        outs = [(tf.function(_run) if traced else _run)(layer, x, training) for layer in (ref, new)]
        for a, b in zip(*outs):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-4)
    if training:
        assert not np.allclose(new.moving_mean.numpy(), 0.0)  # the moving statistics did move


def test_mixed_bfloat16_against_float32_on_the_same_inputs():
    """The bfloat16 layer against Keras' BN in float32 on the same inputs (values bfloat16 holds exactly,
    so the layer's own input cast changes nothing): the moving statistics are float32 arithmetic in
    both and must agree tightly; the output may differ by one bfloat16 rounding only."""
    ref, _ = _pair("float32")
    ref_bf16, new = _pair("mixed_bfloat16")
    x = (np.random.default_rng(2).normal(size=(2, 4, 4, 6)) * 3 + 2).astype("float32")
    x = tf.cast(tf.cast(x, tf.bfloat16), tf.float32).numpy()
    a, b, c = _run(ref, x, True), _run(new, x, True), _run(ref_bf16, x, True)
    assert b[0].dtype == tf.bfloat16 and new.moving_mean.dtype == tf.float32
    y_ref, y = a[0].numpy(), tf.cast(b[0], tf.float32).numpy()
    np.testing.assert_allclose(y, y_ref, rtol=2.0**-8 + 1e-5, atol=1e-5)  # round to nearest: 8 significant bits
    tight = dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new.moving_mean.numpy(), ref.moving_mean.numpy(), **tight)
    np.testing.assert_allclose(new.moving_variance.numpy(), ref.moving_variance.numpy(), **tight)
    # The check fails for a layer that leaves the fused op's variance Bessel-corrected (n / (n - 1) too
    # large): its moving variance would be this, outside the tolerance.
    n = x.size // x.shape[-1]
    batch_var = x.reshape(-1, x.shape[-1]).astype(np.float64).var(axis=0)
    uncorrected = ref.moving_variance.numpy() + (1 - ref.momentum) * batch_var * (n / (n - 1) - 1)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(uncorrected, ref.moving_variance.numpy(), **tight)
    # Gradients: the upstream gradient is rounded to bfloat16 before the backward pass, and the input
    # gradient is a small difference of such values, far from float32's; Keras' own bfloat16 BN, fed the
    # same rounded gradient, is the reference there (the two round differently inside).
    for u, v in zip(c[1:4], b[1:4]):
        np.testing.assert_allclose(tf.cast(v, tf.float32).numpy(), tf.cast(u, tf.float32).numpy(), rtol=2e-2, atol=2e-2)


def test_falls_back_where_not_fusable():
    """Synchronized BN (cross-tower statistics) and 2-D inputs take Keras' own path, same results."""
    ref, new = _pair(synchronized=True)
    x = np.random.default_rng(3).normal(size=(2, 3, 3, 6)).astype("float32")
    graph = tf.function(lambda v: new(v, training=True)).get_concrete_function(tf.TensorSpec(x.shape)).graph
    assert not any("FusedBatchNorm" in op.type for op in graph.get_operations())
    flat = FusedBatchNormalization()
    y = flat(np.ones((4, 6), "float32"), training=True)
    assert y.shape == (4, 6)


def test_fused_kernel_used():
    _, new = _pair()
    graph = tf.function(lambda v: new(v, training=True)).get_concrete_function(tf.TensorSpec([2, 4, 4, 6])).graph
    assert any("FusedBatchNorm" in op.type for op in graph.get_operations())


@pytest.mark.parametrize("backbone", ["tiny", "mobilenetv2"])
def test_model_fused_batchnorm_matches_keras(backbone):
    """The whole DeepLabV3+ with model.fused_batchnorm true and false: logits and moving statistics."""
    from seg_train import models
    from seg_train.config import ModelConfig

    def build(fused):
        return models.build(ModelConfig(backbone=backbone, fused_batchnorm=fused, aspp_channels=8, decoder_channels=8,
                                        low_level_channels=4), 3, seed=0)

    fused, plain = build(True), build(False)
    kinds = lambda m: [type(layer).__name__ for layer in models.batchnorm_layers(m)]  # noqa: E731
    assert set(kinds(fused)) == {"FusedBatchNormalization"} and set(kinds(plain)) == {"BatchNormalization"}
    plain.set_weights(fused.get_weights())
    x = np.random.default_rng(4).normal(size=(2, 64, 64, 3)).astype("float32")
    np.testing.assert_allclose(fused(x, training=True).numpy(), plain(x, training=True).numpy(), rtol=2e-3, atol=2e-3)
    for a, b in zip(models.batchnorm_layers(fused), models.batchnorm_layers(plain)):
        np.testing.assert_allclose(a.moving_variance.numpy(), b.moving_variance.numpy(), rtol=1e-3, atol=1e-5)
    np.testing.assert_allclose(fused(x, training=False).numpy(), plain(x, training=False).numpy(), rtol=2e-3, atol=2e-3)
