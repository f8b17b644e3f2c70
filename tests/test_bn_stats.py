"""Precise BN (seg_train.infer.precise_bn.PreciseBN.reestimate): the moving statistics become the exact population
statistics of every BN layer's input over the re-estimation batches, the same on every tower, and
nothing else changes.

The references are computed without the module's mechanism: a direct convolution in numpy/TF for the
first BN layer, and for every layer a non-distributed copy of the model whose BN inputs are read with
sub-models called in training mode on each tower's slice of each global batch.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train import models
from seg_train.data import synthetic
from seg_train.infer import precise_bn
from seg_train.parallel import replicas
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import global_batches, open_reader, population, tiny_config, train_batches

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
NUM_CLASSES = 3


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("bn") / "data", num_train=16, num_val=8, size=(40, 40),
                              num_classes=NUM_CLASSES, seed=0)


def make(tmp_path, data_root, towers, **sections):
    cfg = tiny_config(tmp_path, data_root, data={"batch_size": 8}, **sections)
    strategy = replicas.make_strategy(replicas.Devices(DEVICES[:towers], "CPU", "test"))
    trainer = TrainStep(TrainState(cfg, strategy))
    return trainer, open_reader(cfg, "train")


def train_steps(trainer, reader, n):
    it = train_batches(trainer.state, reader)
    for _ in range(n):
        trainer(next(it))


def tower_values(variable, strategy):
    return [np.asarray(v) for v in strategy.experimental_local_results(variable.value)]


def moving_stats(trainer):
    return [(layer.moving_mean.numpy().copy(), layer.moving_variance.numpy().copy())
            for layer in trainer.state.bn_layers]


def test_every_bn_layer_matches_per_tower_training_mode_reference(tmp_path, data_root):
    """Fails for moving statistics other than every BN layer's population statistics over the re-estimation
    batches, each layer's input normalised upstream with each tower's own batch statistics as in training (tower 0's
    or per-tower statistics, a Bessel-corrected variance, a layer's output read for its input, a layer missed), for
    towers left holding different copies, or for a re-estimation that moves the step or bn_stats_step. The stem BN is
    also held to a direct convolution of the same batches (no model in the reference). The 2-tower statistics:
    test_mixed_bfloat16_moments_in_float32.
    """
    towers = 4
    trainer, reader = make(tmp_path, data_root, towers)
    model = trainer.state.model
    # Non-trivial gamma/beta, so that each layer's input depends on how the layers before it
    # normalised (with each tower's own batch statistics, as in training).
    rng = np.random.default_rng(1)
    for layer in trainer.state.bn_layers:
        layer.gamma.assign(rng.uniform(0.5, 2.0, layer.gamma.shape).astype(np.float32))
        layer.beta.assign(rng.normal(0, 0.5, layer.beta.shape).astype(np.float32))

    # Reference: a plain (non-distributed) copy, BN inputs read through sub-models in training mode
    # on each tower's slice (consecutive per-tower batches of each global batch).
    ref = models.build(trainer.state.cfg.model, NUM_CLASSES, trainer.state.cfg.seed)
    ref.set_weights(model.get_weights())
    backbone = ref.get_layer("tiny")
    bb_bn = [lay for lay in backbone.layers if isinstance(lay, keras.layers.BatchNormalization)]
    head_bn = [lay for lay in ref.layers if isinstance(lay, keras.layers.BatchNormalization)]
    assert len(bb_bn) + len(head_bn) == len(trainer.state.bn_layers) == 15
    bb_probe = keras.Model(backbone.input, [lay.input for lay in bb_bn])
    head_probe = keras.Model(ref.input, [lay.input for lay in head_bn])
    per_tower = trainer.state.cfg.data.batch_size // towers
    feats = {lay.name: [] for lay in bb_bn + head_bn}
    batches = global_batches(trainer, reader, 2)
    for images in batches:
        for r in range(towers):
            x = images[r * per_tower:(r + 1) * per_tower]
            outs = bb_probe(x, training=True) + head_probe(x, training=True)
            for lay, f in zip(bb_bn + head_bn, outs):
                feats[lay.name].append(f.numpy())

    assert precise_bn.PreciseBN(trainer.state).reestimate(reader, 2, progress=False) is True
    assert int(trainer.state.bn_stats_step.numpy()) == int(trainer.state.step.numpy()) == 0
    # stem_bn's input by hand: stem_conv(image), a 3x3 stride-2 'same' convolution, no bias.
    kernel = model.get_layer("tiny").get_layer("stem_conv").kernel.numpy()
    conv = [tf.nn.conv2d(images, kernel, strides=2, padding="SAME").numpy() for images in batches]
    assert sum(f.shape[0] for f in conv) == 16
    mean, var = population(conv)
    stem_bn = model.get_layer("tiny").get_layer("stem_bn")
    np.testing.assert_allclose(stem_bn.moving_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stem_bn.moving_variance.numpy(), var, rtol=1e-5, atol=1e-7)
    for layer in trainer.state.bn_layers:
        mean, var = population(feats[layer.name])
        np.testing.assert_allclose(layer.moving_mean.numpy(), mean, rtol=1e-4, atol=1e-5, err_msg=layer.name)
        np.testing.assert_allclose(layer.moving_variance.numpy(), var, rtol=1e-4, atol=1e-5, err_msg=layer.name)
        # Every tower holds the same copy (the training-mode pass had moved each one by momentum
        # from its own batches; only a cross-replica assignment makes them agree).
        for v in (layer.moving_mean, layer.moving_variance):
            copies = tower_values(v, trainer.state.strategy)
            assert len(copies) == towers
            for c in copies[1:]:
                np.testing.assert_array_equal(c, copies[0], err_msg=layer.name)


def test_only_moving_stats_change_and_result_is_deterministic(tmp_path, data_root):
    trainer, reader = make(tmp_path, data_root, towers=2)
    train_steps(trainer, reader, 1)
    trainable = [v.numpy().copy() for v in trainer.state.model.trainable_variables]
    slots = [np.asarray(v).copy() for v in trainer.state.optimizer.variables]
    assert any(np.abs(s).sum() > 0 for s in slots[2:])  # slots are live (Adam moments after a step)
    before = moving_stats(trainer)

    bn = precise_bn.PreciseBN(trainer.state)
    assert bn.reestimate(reader, 2, progress=False)
    for a, v in zip(trainable, trainer.state.model.trainable_variables):
        np.testing.assert_array_equal(a, v.numpy(), err_msg=v.path)
    for a, v in zip(slots, trainer.state.optimizer.variables):
        np.testing.assert_array_equal(a, np.asarray(v), err_msg=v.path)
    assert int(trainer.state.step.numpy()) == 1 and int(trainer.state.bn_stats_step.numpy()) == 1
    after = moving_stats(trainer)
    assert all(not np.allclose(a[0], b[0]) for a, b in zip(before, after))

    # Forced again (bn_stats_step reset): the same batches, the same statistics.
    trainer.state.bn_stats_step.assign(-1)
    assert bn.reestimate(reader, 2, progress=False)  # its probe and forward pass kept from the first call
    for (m1, v1), (m2, v2) in zip(after, moving_stats(trainer)):
        np.testing.assert_allclose(m1, m2, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(v1, v2, rtol=1e-6, atol=1e-7)


def test_checkpoint_marked_reestimated_is_not_reestimated_again(tmp_path, data_root):
    trainer, reader = make(tmp_path, data_root, towers=2)
    trainer.state.step.assign(1)  # as after one training step (the weights do not matter here)
    bn = precise_bn.PreciseBN(trainer.state)
    assert bn.reestimate(reader, 1, progress=False) is True
    assert bn.reestimate(reader, 1, progress=False) is False  # same step: no-op
    prefix = tf.train.Checkpoint(**trainer.state.checkpoint_objects()).write(str(tmp_path / "ckpt"))
    saved = moving_stats(trainer)

    restored, _ = make(tmp_path, data_root, towers=2)
    assert restored.state.restore_weights(prefix) == 1
    assert int(restored.state.bn_stats_step.numpy()) == 1
    restored_bn = precise_bn.PreciseBN(restored.state)
    assert restored_bn.reestimate(reader, 1, progress=False) is False
    for (m1, v1), (m2, v2) in zip(saved, moving_stats(restored)):
        np.testing.assert_array_equal(m1, m2)
        np.testing.assert_array_equal(v1, v2)
    # A later step no longer matches: re-estimated again.
    restored.state.step.assign_add(1)
    assert restored_bn.reestimate(reader, 1, progress=False) is True
    assert int(restored.state.bn_stats_step.numpy()) == 2


def test_mixed_bfloat16_moments_in_float32(tmp_path, data_root):
    trainer, reader = make(tmp_path, data_root, towers=2, train={"precision": "mixed_bfloat16"})
    conv = trainer.state.model.get_layer("tiny").get_layer("stem_conv")
    assert conv.compute_dtype == "bfloat16"
    assert precise_bn.PreciseBN(trainer.state).reestimate(reader, 2, progress=False)
    # The BN input is bfloat16; its moments are taken in float32 (as Keras' BN computes them).
    feats = [conv(images).numpy().astype(np.float32) for images in global_batches(trainer, reader, 2)]
    mean, var = population(feats)
    bn = trainer.state.model.get_layer("tiny").get_layer("stem_bn")
    assert bn.moving_mean.dtype == "float32"
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn.moving_variance.numpy(), var, rtol=1e-5, atol=1e-6)


def test_rejects_no_batches(tmp_path, data_root):
    from seg_train.config import ConfigError
    trainer, reader = make(tmp_path, data_root, towers=1)
    with pytest.raises(ConfigError, match="bn_reestimate_batches"):
        precise_bn.PreciseBN(trainer.state).reestimate(reader, 0)


def test_frozen_bn_layer_keeps_its_statistics(tmp_path, data_root):
    # A BN layer with trainable=False normalises with its moving statistics even in training mode:
    # those are what the weights were trained with, so re-estimation must leave them alone.
    trainer, reader = make(tmp_path, data_root, towers=2)
    frozen = trainer.state.model.get_layer("tiny").get_layer("stem_bn")
    frozen.trainable = False
    frozen.moving_mean.assign(np.full(frozen.moving_mean.shape, 0.25, np.float32))
    assert precise_bn.PreciseBN(trainer.state).reestimate(reader, 1, progress=False)
    np.testing.assert_array_equal(frozen.moving_mean.numpy(), 0.25)
    np.testing.assert_array_equal(frozen.moving_variance.numpy(), 1.0)
    other = trainer.state.model.get_layer("aspp0_bn")
    assert not np.allclose(other.moving_variance.numpy(), 1.0)


def _nested_bn_model():
    """stem conv -> mid model [mid_bn -> deep model [deep_conv -> deep_bn]] -> top_bn (two nesting levels, as in
    the ResNet backbones), each BN input shifted and scaled away from zero mean / unit variance."""
    keras.utils.set_random_seed(3)
    deep_in = keras.Input((6, 6, 4))
    deep_conv = keras.layers.Conv2D(5, 3, padding="same", bias_initializer=keras.initializers.Constant(2.0),
                                    name="deep_conv")
    deep_bn = keras.layers.BatchNormalization(name="deep_bn")
    deep = keras.Model(deep_in, deep_bn(deep_conv(deep_in)), name="deep")
    mid_in = keras.Input((6, 6, 4))
    mid_bn = keras.layers.BatchNormalization(name="mid_bn")
    mid = keras.Model(mid_in, deep(mid_bn(mid_in)), name="mid")
    inp = keras.Input((6, 6, 3))
    stem = keras.layers.Conv2D(4, 1, bias_initializer=keras.initializers.Constant(-1.5), name="stem")
    top_bn = keras.layers.BatchNormalization(gamma_initializer=keras.initializers.Constant(3.0), name="top_bn")
    return keras.Model(inp, top_bn(mid(stem(inp)))), (stem, mid_bn, deep_conv, deep_bn, top_bn)


def test_probe_reads_bn_inputs_inside_nested_models():
    model, (stem, mid_bn, deep_conv, deep_bn, top_bn) = _nested_bn_model()
    layers = [top_bn, mid_bn, deep_bn]
    probe, layout = precise_bn._probe(model, {id(layer): i for i, layer in enumerate(layers)})
    images = np.random.default_rng(0).normal(1.0, 2.0, (3, 6, 6, 3)).astype(np.float32)
    outs = probe(images, training=True)
    # The probe's first output is the model's own (same layers, same variables).
    np.testing.assert_allclose(outs[0].numpy(), model(images, training=True).numpy(), rtol=1e-6, atol=1e-6)
    # Each BN input by hand, in training mode (every BN normalises with its batch statistics).
    s = stem(images)
    d = deep_conv(mid_bn(s, training=True))
    inputs = {0: deep_bn(d, training=True), 1: s, 2: d}
    assert sorted(i for i, _ in layout) == [0, 1, 2]
    for k, (i, channels) in enumerate(layout):
        count, mean, m2 = (t.numpy() for t in outs[1 + 3 * k:4 + 3 * k])
        x = inputs[i].numpy().reshape(-1, channels).astype(np.float64)
        assert channels == x.shape[1] and count == x.shape[0] == 3 * 6 * 6, layers[i].name
        np.testing.assert_allclose(mean, x.mean(0), rtol=1e-5, atol=1e-6, err_msg=layers[i].name)
        np.testing.assert_allclose(m2, ((x - x.mean(0)) ** 2).sum(0), rtol=1e-5, atol=1e-5, err_msg=layers[i].name)


@pytest.mark.filterwarnings("ignore:.*mask attached:UserWarning")  # Keras: the nested models pass no mask on
def test_masked_bn_input_is_refused():
    # A masked BN normalises over the unmasked pixels only, which the recorded moments would not.
    inner_in = keras.Input((4, 4, 3))
    bn = keras.layers.BatchNormalization(name="inner_bn")
    inner = keras.Model(inner_in, bn(inner_in))
    inp = keras.Input((4, 4, 3))
    model = keras.Model(inp, inner(keras.layers.Masking(0.0)(inp)))
    probe, _ = precise_bn._probe(model, {id(bn): 0})
    with pytest.raises(ValueError, match="'inner_bn' received a mask"):
        probe(np.ones((2, 4, 4, 3), np.float32), training=True)
