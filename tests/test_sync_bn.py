"""Synchronized BN held to Keras' own BatchNormalization, not to itself.

The reference is `keras.layers.BatchNormalization` computed in float64 on the WHOLE batch on one
device; seg-train's SyncBatchNormalization runs in float32 with the batch split over 1 and over 4
logical towers (its backward pass is written by hand, models/sync_bn.py). Compared: the outputs,
d/dx of every tower's slice, d/dgamma and d/dbeta summed over the towers, and the moving mean and
variance after two training calls from a nonzero moving mean.

The wrong answers each check fails for (tried):
- the `xhat * sum(dy * xhat) / n` term dropped from dx: dx off by O(1);
- a Bessel-corrected (n - 1) variance for the moving statistics: moving variance off by 1/(n-1)
  (about 1.3% here), and the normalisation too if used there;
- the towers' variances averaged without Chan's correction sum n_i (m_i - mean)^2 (the towers'
  slices have different means here): variance and outputs off;
- per-tower statistics (no all-reduce): outputs and gradients off;
- a one-pass E[x^2] - E[x]^2 variance in float32: on the channel whose mean is 100x its spread
  (moving mean still 0, as in a layer trained from scratch) outputs and the gamma gradient are
  3e-4 and 7e-4 (relative) from float64, over the 1e-4 bound; Keras' own float32 layer is ~2e-6.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from seg_train.models.sync_bn import SyncBatchNormalization
from seg_train.parallel import replicas
from seg_train.run.state import TrainState
from seg_train.train.step import TrainStep
from tests.helpers import random_batch, tiny_config

pytestmark = pytest.mark.slow  # DEVELOPING.md: starts processes or takes seconds per test

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
C, MOMENTUM, EPS = 4, 0.9, 1e-3


def strategy(n):
    return replicas.make_strategy(replicas.Devices(DEVICES[:n], "CPU", ""))


def inputs(seed, ill_conditioned):
    """x [8, 6, 5, C] (towers' slices with different means), an upstream gradient dy, gamma, beta."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(8, 6, 5, C)) * [1.0, 3.0, 0.5, 2.0] + [0.0, -2.0, 1.0, 5.0]
    x += rng.normal(size=(8, 1, 1, C))  # each sample (so each tower's slice) its own mean
    if ill_conditioned:
        x[..., 3] = 100.0 + rng.normal(size=x.shape[:3])  # mean 100x its spread
    dy = rng.normal(size=x.shape)
    return x, dy


def keras_reference(xs, dys, gamma, beta, moving):
    """Keras' BatchNormalization in float64 on the whole batch: per call y, dx, dgamma, dbeta, moving stats."""
    layer = keras.layers.BatchNormalization(momentum=MOMENTUM, epsilon=EPS, dtype="float64")
    layer.build((None, None, None, C))
    layer.set_weights([gamma, beta, moving[0], moving[1]])
    out = []
    for x, dy in zip(xs, dys):
        x = tf.constant(x, tf.float64)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * dy)
        dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma.value, layer.beta.value])
        out.append(dict(y=y.numpy(), dx=dx.numpy(), dgamma=dgamma.numpy(), dbeta=dbeta.numpy(),
                        moving_mean=layer.moving_mean.numpy(), moving_variance=layer.moving_variance.numpy()))
    return out


def sync_bn(towers, xs, dys, gamma, beta, moving):
    """SyncBatchNormalization in float32, the batch split over `towers`: the same quantities per call."""
    s = strategy(towers)
    with s.scope():
        layer = SyncBatchNormalization(momentum=MOMENTUM, epsilon=EPS)
        layer.build((None, None, None, C))
        layer.set_weights([w.astype(np.float32) for w in (gamma, beta, moving[0], moving[1])])

    @tf.function
    def call(x, dy):
        def replica(x, dy):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer(x, training=True)
                loss = tf.reduce_sum(y * dy)
            dx, dgamma, dbeta = tape.gradient(loss, [x, layer.gamma.value, layer.beta.value])
            return y, dx, dgamma, dbeta

        return s.run(replica, (x, dy))

    out = []
    for x, dy in zip(xs, dys):
        b = x.shape[0] // towers
        split = lambda a: s.experimental_distribute_values_from_function(  # noqa: E731
            lambda ctx: tf.constant(a[ctx.replica_id_in_sync_group * b:(ctx.replica_id_in_sync_group + 1) * b],
                                    tf.float32))
        y, dx, dgamma, dbeta = call(split(x), split(dy))
        local = lambda v: [np.asarray(t, np.float64) for t in s.experimental_local_results(v)]  # noqa: E731
        out.append(dict(y=np.concatenate(local(y)), dx=np.concatenate(local(dx)),
                        dgamma=np.sum(local(dgamma), axis=0), dbeta=np.sum(local(dbeta), axis=0),
                        moving_mean=layer.moving_mean.numpy(), moving_variance=layer.moving_variance.numpy()))
    return out


def rel(a, b):
    """max |a - b| / max |b| (b the float64 reference)."""
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("towers", [1, 4])
@pytest.mark.parametrize("ill_conditioned", [False, True], ids=["well", "mean_100x_spread"])
def test_sync_bn_equals_keras_batchnorm_on_the_whole_batch(towers, ill_conditioned):
    (x1, dy1), (x2, dy2) = inputs(1, ill_conditioned), inputs(2, ill_conditioned)
    gamma, beta = np.array([1.5, 0.7, -0.4, 2.0]), np.array([0.1, -0.3, 0.0, 0.5])
    # From scratch the moving mean is 0 (the hard case for a shifted one-pass variance); otherwise
    # nonzero, so the momentum update of a wrong statistic shows.
    moving = (np.zeros(C), np.ones(C)) if ill_conditioned else (np.array([0.5, -1.0, 2.0, 0.3]),
                                                               np.array([2.0, 0.5, 1.0, 3.0]))
    ref = keras_reference([x1, x2], [dy1, dy2], gamma, beta, moving)
    got = sync_bn(towers, [x1, x2], [dy1, dy2], gamma, beta, moving)
    for call, (r, g) in enumerate(zip(ref, got)):
        for key in r:
            assert rel(g[key], r[key]) < 1e-4, (call, key, rel(g[key], r[key]))


def test_4_towers_sync_bn_equal_1_tower_keras_bn_two_sgd_steps(tmp_path):
    """The trainer: 4 towers with synchronized BN == 1 tower with Keras' own BatchNormalization.

    Two SGD steps with momentum on the same two batches; weights (BN moving statistics included).
    The 1-tower side builds every BN layer as keras.layers.BatchNormalization (model.fused_batchnorm:
    false, no synchronization), so no seg-train BN code runs there.
    """
    common = dict(train={"optimizer": "sgd", "learning_rate": 0.3, "momentum": 0.9},
                  model={"weight_decay": 0.01, "bn_momentum": 0.5})
    sync_cfg = tiny_config(tmp_path / "sync", **{**common, "model": {**common["model"], "sync_batchnorm": True}})
    keras_cfg = tiny_config(tmp_path / "keras", **{**common, "model": {**common["model"], "sync_batchnorm": False,
                                                                        "fused_batchnorm": False}})
    batches = [random_batch(seed=s, ignore_rows=[3, 0, 9, 0]) for s in (0, 1)]

    def train(cfg, n):
        trainer = TrainStep(TrainState(cfg, strategy(n)))
        for images, labels in batches:
            dist = trainer.state.strategy.experimental_distribute_dataset(
                tf.data.Dataset.from_tensors((images, labels)))
            trainer(next(iter(dist)))
        return trainer

    ref, sync = train(keras_cfg, 1), train(sync_cfg, 4)
    assert not any(isinstance(layer, SyncBatchNormalization) for layer in ref.state.model._flatten_layers())
    assert sum(isinstance(layer, SyncBatchNormalization) for layer in sync.state.model._flatten_layers()) > 3
    assert [v.path for v in ref.state.model.weights] == [v.path for v in sync.state.model.weights]
    start = TrainStep(TrainState(keras_cfg, strategy(1)))
    moved = 0.0
    for a, b, s in zip(ref.state.model.weights, sync.state.model.weights, start.state.model.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=2e-5, rtol=1e-4, err_msg=a.path)
        moved = max(moved, float(np.abs(a.numpy() - s.numpy()).max()))
    assert moved > 1e-2
